"""Bad flags and bad destinations for every command: exit 2 at once, one line naming the option; and output
that a pipe or a file can take (no padding, no wrapped cells, no progress bars)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bad_inputs import expect_user_error
from cli_fixtures import chain_graph
from runtime_helpers import EXAMPLES, REPO

PROFILE = ["--profile", "a100-80gb-sxm"]


@pytest.fixture()
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    chain_graph().save(path)
    return path


def unwritable_destinations(tmp_path):
    """A path under a regular file (unwritable for everyone) and, where permissions bind, a read-only folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = [blocker / "out"]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if not os.access(locked, os.W_OK):  # root writes anywhere
        out.append(locked / "out")
    return out


@pytest.mark.parametrize("command, option, suffix", [
    (["analyze", str(EXAMPLES / "mlp.py"), *PROFILE, "--gpus", "2"], "-o", ".json"),
    (["analyze", str(EXAMPLES / "mlp.py"), *PROFILE, "--gpus", "2"], "--plot", ".png"),
    (["analyze", str(EXAMPLES / "mlp.py"), *PROFILE, "--gpus", "2"], "--chrome-trace", ".json"),
    (["trace", str(EXAMPLES / "mlp.py")], "-o", ".json"),
    (["profiles", "calibrate", "--budget-s", "5"], "-o", ".yaml"),
    (["import", str(REPO / "tests" / "data" / "pipedream-profiles" / "alexnet.graph.txt")], "-o", ".json"),
])
def test_destinations_are_checked_before_the_work(tmp_path, monkeypatch, command, option, suffix):
    import pipeplan.costmodels.trace as trace_module
    import pipeplan.hardware_profiles.calibrate as calibrate_module

    def never(*a, **k):
        raise AssertionError("the work started before the destination was checked")

    monkeypatch.setattr(trace_module, "trace", never)
    monkeypatch.setattr(calibrate_module, "calibrate", never)
    for folder in unwritable_destinations(tmp_path):
        target = folder.with_suffix(suffix)
        t0 = time.monotonic()
        expect_user_error([*command, option, target], names=[option, str(target.parent)], outputs=[target])
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("args, names", [
    (["--gpus", "0"], ["--gpus"]),
    (["--gpus", "four"], ["--gpus"]),
    (["--batch-size", "-3"], ["--batch-size"]),
    (["--microbatches", "0"], ["--microbatches"]),
    (["--stages", "3", "--microbatches", "2", "--schedule", "1f1b", "--batch-size", "8"], ["1f1b", "--microbatches 2"]),
    (["--stages", "4", "--microbatches", "6", "--schedule", "interleaved", "--batch-size", "12"], ["interleaved"]),
    (["--schedule", "chimera"], ["--schedule"]),
    (["--sharding", "zero4"], ["--sharding"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--profile", "no-such-gpu"], ["no-such-gpu"]),
    (["--plot", "out.svg"], ["--plot"]),
])
def test_bad_flags_are_one_line(graph_file, tmp_path, monkeypatch, args, names):
    monkeypatch.chdir(tmp_path)
    base = ["plan", graph_file, "--gpus", "4"] if "--profile" in args else ["plan", graph_file, *PROFILE, "--gpus", "4"]
    expect_user_error([*base, *args], names=names)


def test_bad_model_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = {
        "syntax.py": ("def build_model(:\n", "syntax error"),
        "raises.py": ("raise RuntimeError('boom')\n", "boom"),
        "empty.py": ("", "build_model"),
        "nobuild.py": ("x = 1\n", "build_model"),
    }
    for name, (text, why) in cases.items():
        (tmp_path / name).write_text(text)
        expect_user_error(["analyze", name, *PROFILE, "--gpus", "2"], names=[name, why])
    (tmp_path / "folder.py").mkdir()
    expect_user_error(["analyze", "folder.py", *PROFILE, "--gpus", "2"], names=["folder.py"])
    expect_user_error(["show", "missing.json"], names=["missing.json"])
    expect_user_error(["plan", "missing.json", *PROFILE, "--gpus", "2"], names=["missing.json"])
    (tmp_path / "binary.json").write_bytes(b"\x00\xff\xfe" * 10)
    expect_user_error(["show", "binary.json"], names=["binary.json"])
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0)
    if not os.access(locked, os.R_OK):
        expect_user_error(["show", "locked.json"], names=["locked.json"])


def test_errors_name_files_as_the_user_typed_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text("def build_model(:\n")
    line = expect_user_error(["analyze", "model.py", *PROFILE, "--gpus", "2"], names=["model.py"])
    assert str(tmp_path) not in line and line.startswith("error: model.py:")


def test_piped_output_is_plain(tmp_path):
    """Piped (not a terminal): no line padded with spaces, no table cell wrapped, no progress bars on stderr."""
    r = subprocess.run([sys.executable, "-m", "pipeplan", "analyze", str(EXAMPLES / "mlp.py"), *PROFILE, "--gpus", "4"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "COLUMNS": ""}, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [l for l in lines if l != l.rstrip()] == []
    assert any("MFLOP forward" in l for l in lines)  # "10.2 MFLOP forward" whole on one line
    assert max(len(l) for l in lines) > 80  # not squeezed into 80 columns
    assert "━" not in r.stderr and "\x1b" not in r.stderr and "━" not in r.stdout.split("\n")[0]


def test_compare_plot_axis_turns_log_for_a_wide_span():
    from pipeplan.cli.plots import compare_axis_is_log

    assert compare_axis_is_log([3.6e3, 4e6])
    assert not compare_axis_is_log([1e6, 4e6])
    assert not compare_axis_is_log([0.0, 4e6])  # an infeasible row (0) is not a span


@pytest.mark.parametrize("args, names", [
    (["--gpus", "99999999999999999999999"], ["--gpus", "262144"]),  # unbounded: the search ran out of memory
    (["--gpus", "-1"], ["--gpus"]),
    (["--gpus", "1.5"], ["--gpus"]),
    (["--gpus", ""], ["--gpus"]),
    (["--batch-size", "10000000000000000000000000"], ["--batch-size", "16777216"]),  # unbounded: divisors for hours
    (["--batch-size", "nan"], ["--batch-size"]),
    (["--microbatches", "65536", "--batch-size", "65536"], ["--microbatches", "4096"]),  # a MemoryError at 2**40
    (["--stages", "100000000000000000000"], ["--stages"]),
    (["--profiled-batch-size", "0"], ["--profiled-batch-size"]),
    (["--profiled-batch-size", "1e3"], ["--profiled-batch-size"]),
])
def test_huge_and_malformed_counts_are_refused_at_once(graph_file, args, names):
    t0 = time.monotonic()
    expect_user_error(["plan", graph_file, *PROFILE, "--gpus", "4", *args], names=names)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("command, args, names", [
    (["trace", "model.py"], ["--seq-len", "0"], ["--seq-len"]),
    (["trace", "model.py"], ["--seq-len", "99999999999999"], ["--seq-len"]),
    (["trace", "model.py"], ["--batch-size", "99999999999"], ["--batch-size"]),
    (["trace", "model.py"], ["--depth", "100000"], ["--depth"]),
    (["trace", "model.py"], ["--repeats", "1000000000"], ["--repeats"]),
    (["analyze", "model.py", *PROFILE, "--gpus", "2"], ["--trace-batch-size", "99999999999"], ["--trace-batch-size"]),
    (["import", "graph.txt", "-o", "g.json"], ["--batch-size", "-5"], ["--batch-size"]),
    (["profiles", "calibrate", "-o", "local.yaml"], ["--budget-s", "nan"], ["--budget-s"]),
    (["profiles", "calibrate", "-o", "local.yaml"], ["--budget-s", "inf"], ["--budget-s"]),
    (["profiles", "calibrate", "-o", "local.yaml"], ["--budget-s", "-3"], ["--budget-s"]),
])
def test_bad_values_of_the_other_commands(tmp_path, monkeypatch, command, args, names):
    import pipeplan.costmodels.trace as trace_module
    import pipeplan.hardware_profiles.calibrate as calibrate_module

    def never(*a, **k):
        raise AssertionError("the work started before the flags were checked")

    monkeypatch.setattr(trace_module, "trace", never)
    monkeypatch.setattr(calibrate_module, "calibrate", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text("def build_model():\n    pass\n")
    expect_user_error([*command, *args], names=names, outputs=[tmp_path / "g.json", tmp_path / "local.yaml"])


@pytest.mark.parametrize("content", [
    "[" * 100_000 + "]" * 100_000,  # past json's recursion limit: was "internal error: RecursionError"
    "[" * 100 + "]" * 100,  # past pipeplan's nesting bound
    '{"format": NaN}',
    '{"format": "pipeplan.graph/v1", "batch_size": 1' + "0" * 5000 + "}",  # an integer too long to convert
    '{"format": "pipeplan.graph/v1", "layers": [',  # truncated
    "",
])
@pytest.mark.parametrize("command", ["plan", "analyze"])
def test_malformed_graph_json(tmp_path, monkeypatch, content, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "graph.json").write_text(content)
    expect_user_error([command, "graph.json", *PROFILE, "--gpus", "2", "-o", "plan.json"], names=["graph.json"],
                      outputs=[tmp_path / "plan.json"])


def test_a_folder_or_a_missing_file_given_as_a_graph(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "graphs").mkdir()
    line = expect_user_error(["plan", "graphs", *PROFILE, "--gpus", "2"], names=["graphs"])
    assert "is a folder" in line
    line = expect_user_error(["plan", "nope.json", *PROFILE, "--gpus", "2"], names=["nope.json"])
    assert "no such file" in line


@pytest.mark.parametrize("command, option, suffix", [
    (["compare", str(EXAMPLES / "mlp.py"), "--profiles", "a100-80gb-sxm,h100-sxm", "--gpus", "2"], "--plot", ".png"),
    (["plan", "graph.json", *PROFILE, "--gpus", "2"], "-o", ".json"),
    (["show", "plan.json"], "--plot", ".png"),
    (["show", "plan.json"], "--chrome-trace", ".json"),
])
def test_destinations_of_compare_plan_and_show(tmp_path, monkeypatch, command, option, suffix):
    import pipeplan.costmodels.trace as trace_module
    import pipeplan.planner.search as search_module
    from cli_fixtures import hand_plan

    def never(*a, **k):
        raise AssertionError("the work started before the destination was checked")

    monkeypatch.setattr(trace_module, "trace", never)
    monkeypatch.setattr(search_module, "search", never)
    monkeypatch.chdir(tmp_path)
    chain_graph().save(tmp_path / "graph.json")
    hand_plan().save(tmp_path / "plan.json")
    for folder in unwritable_destinations(tmp_path):
        target = folder.with_suffix(suffix).relative_to(tmp_path)  # named as typed
        expect_user_error([*command, option, target], names=[option, str(target.parent)], outputs=[tmp_path / target])
    missing = Path("no-such-folder") / f"out{suffix}"
    expect_user_error([*command, option, missing], names=[option, "does not exist"], outputs=[tmp_path / missing])
