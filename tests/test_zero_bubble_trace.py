"""Issue 19 point 3: the trace splits each layer's backward into input-gradient B and weight-gradient W.

Independent values: a Linear y = x W^T (batch m, in k, out n) has dgrad = 2*m*n*k and wgrad = 2*m*n*k FLOPs
(two matmuls of the same size as the forward); a layer without weights has W = 0; the first Linear, whose
input needs no gradient, is all W.
"""

from __future__ import annotations

import json

import pytest

from pipeplan.costmodels.graph import Graph, Layer, weight_grad_share
from pipeplan.errors import UserError

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
