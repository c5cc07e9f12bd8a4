"""A 16-bit step under torch.autocast: the tracer's replay of autocast's casts, and the memory it predicts.

Checked against torch itself: the CPU replay against torch's own CPU autocast (saved bytes, layer by layer), the
predicted peak of a whole step against torch's MemTracker over a real autocast step, and the CUDA lists against
bytes worked out by hand for a model whose softmax only CUDA's autocast runs in fp32.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pipeplan.costmodels import autocast_bytes
from pipeplan.costmodels import trace as trace_module
from pipeplan.costmodels.autocast_policy import Casts
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.measure import count_pass, count_saved
from pipeplan.costmodels.memory import model_state_bytes
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SOFTMAX = str(REPO / "tests/data/autocast_softmax.py")
# memory_bench's reference step and whole-model prediction, loaded from its file (benchmarks/ first on sys.path
# would shadow tests' own modules)
_SPEC = importlib.util.spec_from_file_location("memory_bench", REPO / "benchmarks" / "memory_bench.py")
assert _SPEC is not None and _SPEC.loader is not None
mb = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mb)
MODELS = [("examples/gpt.py", 4), ("examples/resnet.py", 8), ("examples/unet.py", 4), ("examples/mlp.py", 16),
          ("tests/data/autocast_upcast.py", 4)]  # a norm that upcasts a matmul's 16-bit output


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
    replayed = count_saved(ep, model, spec, inputs, target, layer_of, n, casts).saved_bytes
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


@pytest.mark.parametrize("path,batch,half_misses_by", [("examples/gpt.py", 4, 0.10), ("examples/resnet.py", 16, 0.05)])
def test_autocast_recipe_predicts_a_real_autocast_step(path, batch, half_misses_by):
    """Within 5% of the real step, where half the fp32 bytes (16-bit throughout) misses it by more: the GPT's
    fp32 residual stream and loss most, the ResNet's convolutions (bf16 outputs) less."""
    full = str(REPO / path)
    measured = mb.measured_peak_bytes(full, batch, autocast=True)
    g = trace_module.trace(full, batch, time_layers=False)
    assert mb.predicted_peak_bytes(g, recipe="autocast") == pytest.approx(measured, rel=0.05)
    assert abs(mb.predicted_peak_bytes(g, recipe="deepspeed") / measured - 1) > half_misses_by


@pytest.mark.parametrize("path,batch,alike", [("examples/resnet.py", 8, True), ("examples/gpt.py", 4, False),
                                              ("examples/unet.py", 4, False)])
def test_one_replay_serves_both_devices_only_where_their_lists_agree(path, batch, alike, monkeypatch):
    """The trace replays one device's lists for both only where, op by op, they cast alike (a ResNet: its linear
    and convolutions 16-bit on both, norms and pools on neither; the GPT's layer_norm and softmax are fp32 on CUDA
    only, the U-Net's skip `cat` is promoted on CPU only): its counts equal two full replays."""
    spec, model, inputs, target, ep, graph, layer_of = _program(str(REPO / path), batch)
    assert autocast_bytes.same_casts(ep, "cuda", "cpu") == alike
    shared = trace_module.trace(str(REPO / path), batch, time_layers=False, repeated_blocks=False)
    monkeypatch.setattr(autocast_bytes, "same_casts", lambda *_: False)
    apart = trace_module.trace(str(REPO / path), batch, time_layers=False, repeated_blocks=False)
    assert [x.autocast for x in shared.layers] == [x.autocast for x in apart.layers]
    assert all(x.autocast["cpu"] == x.autocast["cuda"] for x in shared.layers) or not alike


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
