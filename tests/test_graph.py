"""The graph type: cut bytes (the planner's communication input), fingerprints, JSON."""

import json

import pytest

from pipeplan.costmodels.graph import Edge, Graph, Layer, load_graph
from pipeplan.errors import UserError


def chain_with_skip() -> Graph:
    # a -> b -> c -> d, plus a long edge a -> d carrying a second output of a
    layers = [
        Layer("a", outputs={"a.out": 100, "a.skip": 7}),
        Layer("b", outputs={"b.out": 50}),
        Layer("c", outputs={"c.out": 30}),
        Layer("d", outputs={}),
    ]
    for layer in layers:
        layer.output_bytes = sum(layer.outputs.values())
    edges = [
        Edge("a", "b", 100, ["a.out"]),
        Edge("b", "c", 50, ["b.out"]),
        Edge("c", "d", 30, ["c.out"]),
        Edge("a", "d", 7, ["a.skip"]),
    ]
    return Graph("toy", layers, edges, batch_size=2)


def test_cut_bytes_pays_skip_on_every_cut_it_spans():
    assert chain_with_skip().cut_bytes() == [100 + 7, 50 + 7, 30 + 7]


def test_tensor_read_by_two_later_layers_counts_once_per_cut():
    g = chain_with_skip()
    g.edges.append(Edge("a", "c", 100, ["a.out"]))  # a.out also read by c
    assert g.cut_bytes() == [107, 100 + 50 + 7, 37]


def test_json_round_trip_is_exact(tmp_path):
    g = chain_with_skip()
    path = tmp_path / "g.json"
    g.save(path)
    back = load_graph(path)
    assert back.to_dict() == g.to_dict()
    assert json.loads(path.read_text())["format"] == "pipeplan.graph/v1"


def test_fingerprint_ignores_measurements_but_not_structure():
    g1, g2 = chain_with_skip(), chain_with_skip()
    g2.layers[0].fwd_s = 3.0
    g2.batch_size = 64
    assert g1.fingerprint() == g2.fingerprint()
    g2.edges.pop()
    assert g1.fingerprint() != g2.fingerprint()


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"format": "pipeplan.plan/v1"}, "expected 'pipeplan.graph/v1'"),
        ({"format": "pipeplan.graph/v9"}, "version 'v9' is not supported"),
        ([1, 2], "not a pipeplan file"),
    ],
)
def test_wrong_format_is_rejected_clearly(tmp_path, doc, message):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=message):
        load_graph(path)


def test_edge_against_execution_order_is_rejected(tmp_path):
    doc = chain_with_skip().to_dict()
    doc["edges"].append({"src": "d", "dst": "a", "bytes": 1, "tensors": []})
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="against the execution order"):
        load_graph(path)
