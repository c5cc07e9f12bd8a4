"""Every user error of analyze / plan / compare / show: exit 2, one line saying what and what to do, nothing written."""

from __future__ import annotations

import json

import pytest

from cli_fixtures import chain_graph, hand_plan
from cli_invoke import invoke as run
from cli_invoke import one_error_line


@pytest.fixture()
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    chain_graph().save(path)
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", "no-such-gpu"], "no-such-gpu"),
        (["--stages", "9"], "--stages 9 needs at least 9 devices but --gpus is 8"),
        (["--microbatches", "3"], "--microbatches 3 does not divide --batch-size 64"),
        (["--microbatches", "128"], "--microbatches 128 is more than the batch size 64"),
        (["--schedule", "interleaved", "--stages", "1"], "--schedule interleaved needs at least 2 stages"),
        (["--entry", "build_big"], "--entry only apply when tracing a model.py"),
        (["--trace-batch-size", "4"], "--trace-batch-size only apply when tracing a model.py"),
        (["--plot", "out.svg"], "the plot is a PNG image"),
        (["-o", "no/such/dir/plan.json"], "folder no/such/dir does not exist"),
        (["-o", "same.json", "--chrome-trace", "same.json"], "two outputs name the same file"),
        (["--schedule", "zigzag"], "Invalid value for '--schedule'"),
        (["--gpus", "0"], "Invalid value for '--gpus'"),
    ],
)
def test_analyze_bad_options(graph_file, tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    args = ["analyze", graph_file, "--profile", "a100-80gb-sxm", "--gpus", "8"] + extra
    code, out, err = run(args)
    assert code == 2, (out, err)
    assert message in err
    assert out == ""
    assert not (tmp_path / "same.json").exists()


def test_unknown_profile_message(graph_file):
    code, out, err = run(["plan", graph_file, "--profile", "no-such-gpu", "--gpus", "8"])
    assert code == 2
    line = one_error_line(err)
    assert "no-such-gpu" in line and "profiles list" in line


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "invalid JSON at line 1"),
        (json.dumps({"format": "pipeplan.plan/v1"}), "format is 'pipeplan.plan/v1', expected 'pipeplan.graph/v1'"),
        (json.dumps({"format": "pipeplan.graph/v9"}), "format version 'v9' is not supported"),
        (json.dumps({"layers": []}), "not a pipeplan file"),
    ],
)
def test_plan_bad_graph_file(tmp_path, content, message):
    bad = tmp_path / "graph.json"
    bad.write_text(content)
    code, out, err = run(["plan", bad, "--profile", "a100-80gb-sxm", "--gpus", "8", "-o", tmp_path / "plan.json"])
    assert code == 2
    assert message in one_error_line(err)
    assert not (tmp_path / "plan.json").exists()


def test_missing_inputs(tmp_path):
    code, _, err = run(["analyze", tmp_path / "nope.py", "--profile", "a100-80gb-sxm", "--gpus", "8"])
    assert code == 2 and "nope.py: no such file" in one_error_line(err)
    code, _, err = run(["plan", tmp_path / "nope.json", "--profile", "a100-80gb-sxm", "--gpus", "8"])
    assert code == 2 and "nope.json: no such file" in one_error_line(err)
    code, _, err = run(["show", tmp_path / "nope.json"])
    assert code == 2 and "no such plan file" in one_error_line(err)


def test_plan_refuses_a_model_file(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("def build_model():\n    pass\n")
    code, _, err = run(["plan", model, "--profile", "a100-80gb-sxm", "--gpus", "8"])
    assert code == 2 and "use `pipeplan analyze`" in one_error_line(err)


def test_show_rejects_a_graph_as_plan_and_a_foreign_graph(tmp_path, graph_file):
    code, _, err = run(["show", graph_file])
    assert code == 2 and "expected 'pipeplan.plan/v1'" in one_error_line(err)
    plan_path = tmp_path / "plan.json"
    hand_plan().save(plan_path)
    code, _, err = run(["show", plan_path, "--graph", graph_file])
    assert code == 2 and "is not the graph" in one_error_line(err)


def test_compare_profile_list_errors(graph_file):
    code, _, err = run(["compare", graph_file, "--profiles", "a100-80gb-sxm,nope-gpu", "--gpus", "8"])
    assert code == 2 and "nope-gpu" in one_error_line(err)
    code, _, err = run(["compare", graph_file, "--profiles", "a100-80gb-sxm,a100-80gb-sxm", "--gpus", "8"])
    assert code == 2 and "lists a profile twice" in one_error_line(err)
    code, _, err = run(["compare", graph_file, "--profiles", " , ", "--gpus", "8"])
    assert code == 2 and "--profiles is empty" in one_error_line(err)


def test_plan_bad_pipedream_file(tmp_path):
    bad = tmp_path / "graph.txt"
    bad.write_text("node1 -- this is not a PipeDream profile\n")
    code, out, err = run(["plan", bad, "--profile", "a100-80gb-sxm", "--gpus", "8"])
    assert code == 2 and out == ""
    assert "graph.txt" in one_error_line(err)
