"""Reading PipeDream graph.txt profiles, `pipeplan import`, and load_any_graph."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.costmodels.graph import load_graph
from pipeplan.costmodels.load import load_any_graph
from pipeplan.costmodels.pipedream_import import load_pipedream_graph
from pipeplan.errors import UserError

PROFILES = Path(__file__).resolve().parent / "data" / "pipedream-profiles"
NAMES = ["alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge", "nasnetamobile",
         "resnet101", "resnet18", "resnet50", "resnext101", "resnext50", "squeezenet1_0", "vgg16"]


def _path(name):
    return PROFILES / f"{name}.graph.txt"


def _count_from_text(path):
    """Independent count: node lines, minus Input* sources, minus __getitem__ nodes with no out-edge."""
    nodes, srcs = {}, set()
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            a, b = line.strip().split(" -- ")
            srcs.add(a)
        elif line.strip():
            nid, desc = line.split(" -- ")[:2]
            f = float(re.search(r"forward_compute_time=([0-9.]+)", line).group(1))
            b = float(re.search(r"backward_compute_time=([0-9.]+)", line).group(1))
            nodes[nid] = (desc, f, b)
    keep = {n for n, (d, _, _) in nodes.items()
            if not d.startswith("Input") and not (d.startswith("__getitem__") and n not in srcs)}
    return keep, sum(nodes[n][1] for n in keep), sum(nodes[n][2] for n in keep)


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_imports(name):
    path = _path(name)
    g = load_pipedream_graph(path)
    keep, fwd_ms, bwd_ms = _count_from_text(path)
    assert {l.name for l in g.layers} == keep
    assert sum(l.fwd_s for l in g.layers) == pytest.approx(fwd_ms / 1000)
    assert sum(l.bwd_s for l in g.layers) == pytest.approx(bwd_ms / 1000)
    index = {l.name: i for i, l in enumerate(g.layers)}
    assert all(index[e.src] < index[e.dst] for e in g.edges)  # topological
    for e in g.edges:
        assert e.bytes == g.layer(e.src).output_bytes
    assert g.inputs and all(k.startswith("Input") for k in g.inputs)


def test_activation_lists_are_summed_and_sizes_mapped():
    g = load_pipedream_graph(_path("gnmt"))
    lstm = g.layer("node7")  # activation_size=[6291456.0; 131072.0; 131072.0], parameter_size=50364416
    assert lstm.output_bytes == 6291456 + 131072 + 131072 == lstm.saved_bytes
    assert lstm.param_bytes == 50364416
    assert lstm.fwd_s == pytest.approx(3.190e-3) and lstm.bwd_s == pytest.approx(5.348e-3)
    assert lstm.kind == "matmul"
    assert sorted(g.inputs) == ["Input0", "Input1", "Input2"]
    assert "node20" in {l.name for l in g.layers}  # a non-Input source ("hidden") stays a layer


def test_vgg16_first_layers_and_json_round_trip(tmp_path):
    g = load_pipedream_graph(_path("vgg16"), batch_size=64)
    assert g.name == "vgg16" and g.batch_size == 64 and g.layers[0].kind == "conv"
    out = tmp_path / "vgg16.json"
    g.save(out)
    back = load_graph(out)
    assert back.fingerprint() == g.fingerprint()
    assert [l.fwd_s for l in back.layers] == [l.fwd_s for l in g.layers]
    assert load_any_graph(out).fingerprint() == g.fingerprint()
    assert load_any_graph(_path("vgg16")).fingerprint() == g.fingerprint()


@pytest.mark.parametrize("text,needle", [
    ("hello world\n", "not a PipeDream node line"),
    ("node1 -- Conv -- forward_compute_time=x, backward_compute_time=1, activation_size=1, parameter_size=1\n",
     "not a number"),
    ("node1 -- Conv -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "\tnode1 -- node9\n", "unknown node"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "\tnode1 -- node2\n\tnode2 -- node1\n", "cycle"),
    ("", "no nodes"),
])
def test_bad_files_are_user_errors(tmp_path, text, needle):
    p = tmp_path / "graph.txt"
    p.write_text(text)
    with pytest.raises(UserError, match=needle):
        load_pipedream_graph(p)


def test_load_any_graph_rejects_other_files(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("just some text\n")
    with pytest.raises(UserError, match="neither a pipeplan graph JSON nor a PipeDream"):
        load_any_graph(p)
    with pytest.raises(UserError, match="no such graph file"):
        load_any_graph(tmp_path / "missing.txt")


def test_import_command(tmp_path):
    out = tmp_path / "alexnet.json"
    r = CliRunner().invoke(cli, ["import", str(_path("alexnet")), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["layers"] == 22 and summary["name"] == "alexnet"
    assert load_graph(out).fingerprint() == summary["fingerprint"]


def test_import_command_bad_input_exits_2_without_output(tmp_path):
    bad = tmp_path / "graph.txt"
    bad.write_text("garbage\n")
    out = tmp_path / "g.json"
    r = CliRunner().invoke(cli, ["import", str(bad), "-o", str(out)])
    assert r.exit_code == 2
    assert "not a PipeDream node line" in r.output and "Traceback" not in r.output
    assert not out.exists()
