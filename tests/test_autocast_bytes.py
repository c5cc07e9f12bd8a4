"""A 16-bit step under torch.autocast: the tracer's replay of autocast's casts, and the memory it predicts.

Checked against torch itself: the CPU replay against torch's own CPU autocast (saved bytes, layer by layer), the
predicted peak of a whole step against torch's MemTracker over a real autocast step, and the CUDA lists against
bytes worked out by hand for a model whose softmax only CUDA's autocast runs in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.costmodels import trace as trace_module
from pipeplan.costmodels.autocast_policy import Casts
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.measure import count_pass
from pipeplan.costmodels.memory import model_state_bytes, stage_memory, transient_over_saved
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SOFTMAX = str(REPO / "tests/data/autocast_softmax.py")
MODELS = [("examples/gpt.py", 4), ("examples/resnet.py", 8), ("examples/unet.py", 4), ("examples/mlp.py", 16)]


class _CountEverything(set):
    """A `Casts.storages` that holds nothing: the weights' 16-bit copies count as saved bytes, as torch's own
    autocast step saves them."""

    def __contains__(self, key: object) -> bool:
        return False

    def add(self, key: object) -> None:
        return None


def _program(path: str, batch: int):
    spec = load_model_file(path)
    torch.manual_seed(0)
    model = spec.build()
    inputs, target = spec.example_inputs(batch), spec.example_target(batch)
    ep, graph = trace_module.export_structure(spec, batch, model=model, inputs=inputs)
    layer_of = {n: i for i, layer in enumerate(graph.layers) for n in layer.nodes}
    return spec, model, inputs, target, ep, graph, layer_of


@pytest.mark.parametrize("path,batch", MODELS)
def test_cpu_replay_saves_what_torch_cpu_autocast_saves(path, batch):
    spec, model, inputs, target, ep, graph, layer_of = _program(str(REPO / path), batch)
    n = len(graph.layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_saved = count_pass(ep, model, spec, inputs, target, layer_of, n).saved_bytes
    casts = Casts("cpu", torch.bfloat16)
    casts.storages = _CountEverything()
    replayed = count_pass(ep, model, spec, inputs, target, layer_of, n, casts=casts).saved_bytes
    assert replayed == torch_saved
    fp32 = count_pass(ep, model, spec, inputs, target, layer_of, n).saved_bytes
    assert sum(torch_saved) != pytest.approx(sum(fp32) / 2, rel=0.05)  # autocast is not "half of fp32"


def test_cuda_lists_run_softmax_in_fp32_and_cpu_lists_do_not():
    """Linear -> softmax -> Linear at batch 4 x 64 features (BD = 256 elements), by hand: the first Linear saves
    its input cast to bf16 (2BD bytes); softmax saves its output, fp32 on CUDA (its input cast up: 4BD) and bf16
    on CPU (2BD); the second Linear saves its input in bf16, on CUDA a new cast (2BD), on CPU the softmax output
    already counted (0), and the loss its fp32 input and the target (4BD + 4BD)."""
    g = trace_module.trace(SOFTMAX, 4, time_layers=False)
    bd = 4 * 64
    assert [x.autocast["cuda"]["saved_bytes"] for x in g.layers] == [2 * bd, 4 * bd, 2 * bd + 8 * bd]
    assert [x.autocast["cpu"]["saved_bytes"] for x in g.layers] == [2 * bd, 2 * bd, 8 * bd]
    assert [x.saved_bytes for x in g.layers] == [4 * bd, 4 * bd, 8 * bd]  # fp32: the softmax output saved once
    assert [x.autocast["cuda"]["output_bytes"] for x in g.layers] == [2 * bd, 4 * bd, 2 * bd]


def _autocast_step_peak(path: str, batch: int) -> int:
    """MemTracker's peak over a real CPU autocast (bf16) step after one Adam step (memory_bench's reference)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = load_model_file(path)
    torch.manual_seed(0)
    model = spec.build()
    x, target = spec.example_inputs(batch), spec.example_target(batch)
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = spec.loss(model(*x), target)
        loss.backward()

    step()
    opt.step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _predicted(g: Graph, recipe: str) -> int:
    """The whole model on one device, as memory_bench prices it, under a mixed-precision recipe."""
    if recipe == "autocast":
        saved = [x.autocast["cpu"]["saved_bytes"] for x in g.layers]
        transient = [x.autocast["cpu"]["transient_bytes"] for x in g.layers]
    else:
        saved = [x.saved_bytes // 2 for x in g.layers]
        transient = [x.transient_bytes // 2 for x in g.layers]
    return stage_memory(param_bytes=sum(x.param_bytes for x in g.layers), saved_bytes_per_mb=sum(saved),
                        input_bytes_per_mb=0, output_bytes_per_mb=0, schedule="1f1b", stages=1, stage=0,
                        microbatches=2, optimizer="adam", dtype="bf16", mixed_precision=recipe, recompute=False,
                        largest_layer_param_bytes=max(x.param_bytes for x in g.layers),
                        transient_bytes=transient_over_saved(saved, transient)).total_bytes


@pytest.mark.parametrize("path,batch,half_misses_by", [("examples/gpt.py", 4, 0.10), ("examples/resnet.py", 16, 0.05)])
def test_autocast_recipe_predicts_a_real_autocast_step(path, batch, half_misses_by):
    """Within 5% of the real step, where half the fp32 bytes (16-bit throughout) misses it by more: the GPT's
    fp32 residual stream and loss most, the ResNet's convolutions (bf16 outputs) less."""
    full = str(REPO / path)
    measured = _autocast_step_peak(full, batch)
    g = trace_module.trace(full, batch, time_layers=False)
    assert _predicted(g, "autocast") == pytest.approx(measured, rel=0.05)
    assert abs(_predicted(g, "deepspeed") / measured - 1) > half_misses_by


def test_autocast_model_state_is_fp32_state_and_a_16_bit_copy():
    n = 4_000_000  # fp32 bytes: 1M parameters
    state = model_state_bytes(n, optimizer="adam", dtype="bf16", mixed_precision="autocast")
    assert (state.weights_bytes, state.grad_bytes, state.optimizer_bytes) == (n + n // 2, n, 2 * n)
    assert state.total_bytes == 18 * n // 4  # 18 bytes a parameter
    assert model_state_bytes(n, optimizer="adam", dtype="fp32", mixed_precision="autocast").total_bytes == 4 * n


def test_graph_keeps_autocast_counts_and_checks_them(tmp_path):
    g = trace_module.trace(SOFTMAX, 4, time_layers=False)
    path = tmp_path / "g.json"
    g.save(path)
    again = Graph.from_dict(g.to_dict())
    assert [x.autocast for x in again.layers] == [x.autocast for x in g.layers]
    doc = g.to_dict()
    doc["layers"][0]["autocast"] = {"tpu": doc["layers"][0]["autocast"]["cuda"]}
    with pytest.raises(UserError, match="autocast"):
        Graph.from_dict(doc)
    doc["layers"][0]["autocast"] = {"cuda": {"saved_bytes": -1}}
    with pytest.raises(UserError, match="autocast"):
        Graph.from_dict(doc)
