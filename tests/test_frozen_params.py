"""Frozen parameters (requires_grad False: a frozen backbone, an adapter's base model) hold weights only.

They have no gradient, no optimizer state, nothing to all-reduce and nothing to step; a planner that charged them
16 bytes a parameter under Adam predicted 26.5 MiB for tests/data/frozen_backbone.py's one-device plan, where
`pipeplan run` metered 8.5 MiB (by hand, 2026-11-30: 8.49 predicted since).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

import pipeplan
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory, model_state_bytes
from pipeplan.costmodels.recompute import weight_grad_passes, weight_passes_added
from pipeplan.errors import UserError
from pipeplan.planner.predict import evaluate
from pipeplan.planner.predict_inputs import _param_tensors
from pipeplan.planner.problem import build_problem
from search_fixtures import assert_range_memory_is_stage_memory, gpt_like, profile

FILE = str(Path(__file__).parent / "data" / "frozen_backbone.py")


def _model():
    spec = importlib.util.spec_from_file_location("frozen_backbone", FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_model()


@pytest.mark.parametrize("repeated_blocks", [True, False])
def test_trace_records_each_layers_frozen_bytes(repeated_blocks):
    """Per layer, the bytes of the parameters it owns that need no gradient, from the model's own flags; the
    backbone's six identical blocks are traced as three and cloned by default, and the clones keep the flag."""
    model = _model()
    frozen = {fqn: p.numel() * p.element_size() for fqn, p in model.named_parameters() if not p.requires_grad}
    graph = pipeplan.trace(FILE, batch_size=8, time_layers=False, repeated_blocks=repeated_blocks)
    assert any("identical blocks" in n for n in graph.notes) == repeated_blocks
    for layer in graph.layers:
        assert layer.frozen_param_bytes == sum(frozen.get(fqn, 0) for fqn in layer.params), layer.name
        assert layer.frozen_param_bytes in (0, layer.param_bytes)  # a Linear is frozen whole, or trains whole
        assert layer.frozen_params == [fqn for fqn in layer.params if fqn in frozen], layer.name
    assert graph.frozen_param_bytes == sum(frozen.values()) == 6 * (256 * 256 + 256) * 4
    assert graph.param_bytes - graph.frozen_param_bytes == sum(
        p.numel() * 4 for p in model.parameters() if p.requires_grad)


def test_graph_file_keeps_frozen_bytes_and_refuses_more_than_the_layer_holds(tmp_path):
    graph = pipeplan.trace(FILE, batch_size=8, time_layers=False)
    path = tmp_path / "graph.json"
    graph.save(path)
    again = pipeplan.load_graph(path)
    assert [layer.frozen_param_bytes for layer in again.layers] == [layer.frozen_param_bytes for layer in graph.layers]
    assert [layer.frozen_params for layer in again.layers] == [layer.frozen_params for layer in graph.layers]
    doc = json.loads(path.read_text())
    doc["layers"][0]["frozen_param_bytes"] = doc["layers"][0]["param_bytes"] + 4
    with pytest.raises(UserError, match=r"layers\[0\].*frozen_param_bytes"):
        Graph.from_dict(doc, path)
    doc = json.loads(path.read_text())
    doc["layers"][0]["frozen_params"] = ["not.a.parameter.of.this.layer"]
    with pytest.raises(UserError, match=r"layers\[0\].*frozen_params"):
        Graph.from_dict(doc, path)


def test_frozen_parameters_are_no_weight_pass_and_no_optimizer_tensor():
    """A frozen parameter gets no gradient, so torch's split backward makes no weight-gradient group for it
    (its grad accumulator is None in `_get_grad_fn_or_grad_acc`) and the optimizer steps no tensor for it:
    both counts are those of the model's trainable parameters, counted from the model itself."""
    model = _model()
    graph = pipeplan.trace(FILE, batch_size=8, time_layers=False)
    trainable = [fqn for fqn, p in model.named_parameters() if p.requires_grad]
    modules = {fqn.rsplit(".", 1)[0] for fqn in trainable}
    assert weight_grad_passes(graph.layers) == len(modules) == 2  # the head's two Linears
    assert sum(weight_passes_added(graph.layers)) == len(modules)
    names = [layer.name for layer in graph.layers]
    assert _param_tensors(graph, names, [0] * len(names), 1) == [len(trainable)] == [4]


def test_model_state_charges_frozen_parameters_their_weights_only():
    """ZeRO paper §3.1 / Megatron-LM's bytes per parameter for the trainable ones; the weights alone for the rest
    (fp32 training: 4 B; Megatron's bf16 recipe: the 2-byte copy the model computes with)."""
    t, f = 4000, 6000  # fp32 bytes: 1000 trainable and 1500 frozen parameters
    s = model_state_bytes(t + f, optimizer="adam", dtype="fp32", frozen_bytes_fp32=f)
    assert (s.weights_bytes, s.grad_bytes, s.optimizer_bytes) == (t + f, t, 2 * t)
    s = model_state_bytes(t + f, optimizer="adam", dtype="bf16", mixed_precision="megatron", frozen_bytes_fp32=f)
    assert s.total_bytes == 18 * t // 4 + 2 * f // 4
    # pipeplan's runtime shards the trainable parameters only (runtime/sharding.py): frozen weights stay whole
    s = model_state_bytes(t + f, optimizer="adam", dtype="fp32", sharding="zero3", shards=4, frozen_bytes_fp32=f)
    assert (s.weights_bytes, s.grad_bytes, s.optimizer_bytes) == (t // 4 + f, t // 4, 2 * t // 4)
    with pytest.raises(ValueError):
        model_state_bytes(t, optimizer="adam", dtype="fp32", frozen_bytes_fp32=t + 4)


def _frozen_blocks(graph: Graph, every: int = 2) -> Graph:
    """The graph with every `every`-th transformer block's parameters frozen."""
    layers = [dataclasses.replace(layer, frozen_param_bytes=layer.param_bytes)
              if layer.name.startswith("block") and int(layer.name[5:]) % every == 0 else layer
              for layer in graph.layers]
    return dataclasses.replace(graph, layers=layers)


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("interleaved", 2), ("pipedream", 1)])
@pytest.mark.parametrize("sharding,mixed_precision,dtype", [("none", "deepspeed", "fp32"),
                                                            ("zero1", "megatron", "bf16"),
                                                            ("zero3", "deepspeed", "bf16")])
def test_range_memory_equals_stage_memory_with_frozen_layers(schedule, chunks, sharding, mixed_precision, dtype):
    """The partitioner's prefix sums (RangeMemory) give stage_memory's number when some layers are frozen."""
    prob = build_problem(_frozen_blocks(gpt_like(blocks=6, hidden=128, seq=64, vocab=500, batch=2)), profile(),
                         microbatch_size=2, dtype=dtype)
    assert any(prob.frozen) and not all(prob.frozen)
    P, M = 3, 6
    mem = RangeMemory(param_bytes=prob.param_bytes, frozen_param_bytes=prob.frozen_param_bytes,
                      saved_bytes=prob.saved_bytes, cut_bytes=prob.cut_bytes, input_bytes=prob.input_bytes,
                      schedule=schedule, stages=P, microbatches=M, chunks=chunks, recompute=False, optimizer="adam",
                      dtype=dtype, sharding=sharding, shards=3, mixed_precision=mixed_precision)
    assert_range_memory_is_stage_memory(prob, mem, stages=P, chunks=chunks, microbatches=M, ranges=30,
                                        schedule=schedule, optimizer="adam", dtype=dtype, recompute=False,
                                        sharding=sharding, shards=3, mixed_precision=mixed_precision)


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_a_plan_reduces_and_steps_the_trainable_parameters_only(sharding):
    """Frozen blocks cost a plan their weights and nothing else: its gradients, optimizer state, all-reduce and
    step equal those of the same model whose frozen blocks had no parameters at all, its weights those of the model
    with every block trainable."""
    base = gpt_like(blocks=4, hidden=256, seq=128, vocab=1000, batch=8)
    frozen = _frozen_blocks(base, every=1)
    bare = dataclasses.replace(base, layers=[dataclasses.replace(layer, param_bytes=0)
                                             if layer.name.startswith("block") else layer for layer in base.layers])
    n = len(base.layers)

    def plan(graph: Graph):
        return evaluate(graph, profile(), [0] * (n // 2) + [1] * (n - n // 2), schedule="1f1b", microbatches=4,
                        batch_size=16, data_parallel=2, sharding=sharding).stages

    for trains, fr, none in zip(plan(base), plan(frozen), plan(bare), strict=True):
        p = fr.predicted
        assert p.weights_bytes == trains.predicted.weights_bytes > none.predicted.weights_bytes
        assert (p.grad_bytes, p.optimizer_bytes) == (none.predicted.grad_bytes, none.predicted.optimizer_bytes)
        assert p.allreduce_s == pytest.approx(none.predicted.allreduce_s, rel=1e-12)
        assert p.optimizer_s == pytest.approx(none.predicted.optimizer_s, rel=1e-12)
        assert p.allreduce_s < trains.predicted.allreduce_s and p.optimizer_s < trains.predicted.optimizer_s


def test_search_fits_a_frozen_model_the_trainable_one_does_not_fit():
    """The search's state bound and partitioner count frozen parameters' weights only: at a memory that holds
    the weights but not a trainable model's Adam state, the frozen model plans and the trainable one is refused."""
    base = gpt_like(blocks=8, hidden=1024, seq=128, vocab=1000, batch=8)
    frozen = _frozen_blocks(base, every=1)
    weights_gib = base.param_bytes / 2**30
    small = profile(memory_gib=weights_gib * 4)  # room for the weights, not for 16 bytes a parameter
    request = pipeplan.PlanRequest(devices=1, batch_size=8)
    with pytest.raises(pipeplan.InfeasibleError):
        pipeplan.search(base, small, request)
    best = pipeplan.search(frozen, small, request).best
    assert best.stages[0].predicted.memory_bytes <= small.usable_memory_bytes


def test_analyze_reports_the_trainable_parameters(tmp_path):
    """`analyze --json` counts them apart, and its plan's device holds the frozen weights with no state for them."""
    from click.testing import CliRunner

    from pipeplan.cli.main import cli

    graph = pipeplan.trace(FILE, batch_size=8, time_layers=False)
    path = tmp_path / "graph.json"
    graph.save(path)
    r = CliRunner().invoke(cli, ["analyze", str(path), "--profile", "h100-sxm", "--gpus", "1", "--dtype", "fp32",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    model = _model()
    assert doc["graph"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert doc["graph"]["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    stage = doc["plan"]["stages"][0]["predicted"]
    assert stage["weights_bytes"] == graph.param_bytes
    assert stage["grad_bytes"] == graph.param_bytes - graph.frozen_param_bytes  # fp32 gradients, trainable only


def test_a_frozen_prefix_runs_no_backward_on_a_roofline():
    """A frozen backbone before a trainable head: autograd records none of the backbone's ops (the trace saved
    nothing there and counted no backward FLOPs), so a catalogue profile prices its layers' backward at 0 and the
    head's as before; the same layers trainable, or with nothing frozen in front, are priced as always."""
    from pipeplan.costmodels.compute import layer_roofline_s, layer_times_s
    from pipeplan.costmodels.graph import backward_free

    graph = pipeplan.trace(FILE, batch_size=8, time_layers=False)
    free = backward_free(graph)
    assert free == [layer.name.startswith("backbone") for layer in graph.layers]
    prof = pipeplan.load_profile("h100-sxm")
    fwd, bwd = layer_times_s(graph, prof, times="roofline")
    for layer, f, b, is_free in zip(graph.layers, fwd, bwd, free, strict=True):
        want_f, want_b = layer_roofline_s(layer, prof, samples=graph.batch_size, batch_size=graph.batch_size)
        assert f == pytest.approx(want_f) and b == (0.0 if is_free else pytest.approx(want_b))
    thawed = dataclasses.replace(graph, layers=[dataclasses.replace(layer, frozen_param_bytes=0)
                                                for layer in graph.layers])
    assert not any(backward_free(thawed))
    # a parameter-free layer reading only the model's inputs, which may need gradients, is not assumed free; the
    # frozen layer after it is, once it reads only free layers
    from pipeplan.costmodels.graph import Edge, Layer

    layers = [Layer("scale", kind="elementwise", bytes_moved=64), Layer("fc", kind="matmul", param_bytes=40,
                                                                        frozen_param_bytes=40, bytes_moved=104)]
    hand = Graph(name="hand", layers=layers, edges=[Edge("scale", "fc", 32)], batch_size=1)
    assert backward_free(hand) == [False, False]
    hand = Graph(name="hand", layers=layers[1:], edges=[], batch_size=1)
    assert backward_free(hand) == [True]
