"""Issue 19 point 3: the trace splits each layer's backward into input-gradient B and weight-gradient W.

Independent values: a Linear y = x W^T (batch m, in k, out n) has dgrad = 2*m*n*k and wgrad = 2*m*n*k FLOPs
(two matmuls of the same size as the forward); a layer without weights has W = 0; the first Linear, whose
input needs no gradient, is all W. Time: a layer's traced W against the eager model's backward with that
layer's parameters trainable less the same with them frozen (no hooks, no attribution).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from pipeplan.costmodels.graph import Graph, Layer, weight_grad_share, weight_grad_time_share
from pipeplan.errors import UserError
from timing_pairs import ratios_until_within

MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

def example_inputs(batch_size):
    return (torch.randn(batch_size, 32),)
'''


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from pipeplan.costmodels.trace import trace

    path = tmp_path_factory.mktemp("zbtrace") / "model.py"
    path.write_text(MODEL)
    return trace(str(path), batch_size=8, time_layers=False)


def test_linear_backward_splits_into_equal_dgrad_and_wgrad(traced):
    m = 8
    by_kind = [(l.kind, l.fwd_flops, l.bwd_flops, l.bwd_weight_flops) for l in traced.layers]
    linears = [x for x in by_kind if x[1] > 0]
    assert linears[0] == ("matmul", 2 * m * 32 * 64, 2 * m * 32 * 64, 2 * m * 32 * 64)  # no dgrad to the input
    assert linears[1] == ("matmul", 2 * m * 64 * 16, 2 * 2 * m * 64 * 16, 2 * m * 64 * 16)  # dgrad + wgrad
    assert all(x[3] == 0 for x in by_kind if x[1] == 0)  # ReLU: no weights, no W


def test_round_trip_and_old_graphs(traced, tmp_path):
    path = tmp_path / "g.json"
    traced.save(path)
    doc = json.loads(path.read_text())
    again = Graph.from_dict(doc, path)
    assert [l.bwd_weight_flops for l in again.layers] == [l.bwd_weight_flops for l in traced.layers]
    for layer in doc["layers"]:  # a graph from before the field: the documented rule
        del layer["bwd_weight_flops"]
    old = Graph.from_dict(doc, path)
    assert [weight_grad_share(l) for l in old.layers] == [0.5 if l.param_bytes else 0.0 for l in old.layers]
    assert [weight_grad_share(l) for l in again.layers][-1] == 0.5


def test_check_rejects_w_beyond_the_backward(traced, tmp_path):
    doc = traced.to_dict()
    doc["layers"][0]["bwd_weight_flops"] = doc["layers"][0]["bwd_flops"] + 1
    with pytest.raises(UserError, match="bwd_weight_flops"):
        Graph.from_dict(doc, tmp_path / "bad.json")
    doc["layers"][0]["bwd_weight_flops"] = -1
    with pytest.raises(UserError, match="bwd_weight_flops"):
        Graph.from_dict(doc, tmp_path / "bad.json")


def test_share_rule():
    assert weight_grad_share(Layer(name="a", bwd_flops=10, bwd_weight_flops=4)) == 0.4
    assert weight_grad_share(Layer(name="b", bwd_flops=0, bwd_weight_flops=0)) == 0.0
    assert weight_grad_share(Layer(name="c", bwd_flops=10, param_bytes=4)) == 0.5
    assert weight_grad_share(Layer(name="d", bwd_flops=10)) == 0.0


TIMED_MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 8))

def example_inputs(batch_size):
    return (torch.randn(batch_size, 64),)
'''


def _frozen_w_s(path: str, batch_size: int, layer: int, rounds: int = 3, reps: int = 12) -> float:
    """Layer `layer`'s W, measured without the tracer: the whole model's eager backward (gradients kept,
    accumulating) with the layer's parameters trainable, less the same with them frozen."""
    from pipeplan.costmodels.model_file import load_model_file

    spec = load_model_file(path, "build_model")
    model = spec.build()
    inputs, target = spec.example_inputs(batch_size), spec.example_target(batch_size)

    def backward_s() -> float:
        times = []
        for _ in range(reps + 2):
            loss = spec.loss(model(*inputs), target)
            t = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    diffs = []
    for _ in range(rounds):
        for frozen in (False, True):
            for p in model[layer].parameters():
                p.requires_grad_(not frozen)
            t = backward_s()
            diffs.append(t if not frozen else -t)
    return statistics.median(diffs[0::2]) + statistics.median(diffs[1::2])


def test_trace_times_each_backward_as_b_and_w(tmp_path):
    """A Linear's traced W (its backward less its timed B) against the model's backward with and without
    that Linear's parameters trainable; parameter-free layers have none, the first Linear is all W."""
    from pipeplan.costmodels.trace import trace
    from pipeplan.hardware_profiles.allocator import keep_freed_memory

    path = tmp_path / "timed.py"
    path.write_text(TIMED_MODEL)
    graphs = []

    def pair() -> tuple[float, float]:
        graphs.append(trace(str(path), batch_size=4, repeats=9))
        keep_freed_memory()  # as the trace ran
        return graphs[-1].layers[2].bwd_weight_s, _frozen_w_s(str(path), 4, 2)

    def within(ratio: float) -> bool:
        return 0.6 <= ratio <= 1.6

    ratios = ratios_until_within(pair, within)
    assert within(ratios[-1]), ratios
    graph = graphs[-1]
    first, relu, mid = graph.layers[0], graph.layers[1], graph.layers[2]
    assert first.bwd_weight_s == first.bwd_s > 0  # its input needs no gradient: B is empty
    assert relu.bwd_weight_s == 0.0
    assert all(0.0 <= l.bwd_weight_s <= l.bwd_s for l in graph.layers)
    assert 0.0 < mid.bwd_weight_s < mid.bwd_s  # a Linear mid-model has both parts
    again = Graph.from_dict(json.loads(json.dumps(graph.to_dict())), tmp_path / "g.json")
    assert [l.bwd_weight_s for l in again.layers] == [l.bwd_weight_s for l in graph.layers]


def test_time_share_rule_and_check(traced, tmp_path):
    assert weight_grad_time_share(Layer(name="a", bwd_s=2.0, bwd_weight_s=0.5, bwd_flops=10, bwd_weight_flops=5)) \
        == 0.25
    assert weight_grad_time_share(Layer(name="b", bwd_flops=10, bwd_weight_flops=4)) == 0.4  # untimed: FLOPs
    doc = traced.to_dict()
    doc["layers"][0]["bwd_s"], doc["layers"][0]["bwd_weight_s"] = 1.0, 1.5
    with pytest.raises(UserError, match="bwd_weight_s"):
        Graph.from_dict(doc, tmp_path / "bad.json")
