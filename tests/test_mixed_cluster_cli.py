"""`--cluster` on analyze / plan / compare: the report's device-type column, --json, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from cli_invoke import invoke as run
from pipeplan.hardware_profiles import load_profile
from search_fixtures import gpt_like

CLUSTER = "a100-80gb-sxm:2,v100-32gb-sxm2:2"


@pytest.fixture()
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    gpt_like(blocks=4).save(path)
    return path


def test_plan_cluster_json_names_each_stage_device_type(graph_file, tmp_path):
    code, out, err = run(["plan", graph_file, "--cluster", CLUSTER, "-b", "8", "--stages", "2", "--json", "-o", tmp_path / "plan.json"])
    assert code == 0, err
    doc = json.loads(out)
    types = [s["device_type"] for s in doc["plan"]["stages"]]
    assert set(types) <= {"a100-80gb-sxm", "v100-32gb-sxm2"} and len(types) == 2
    assert doc["plan"]["profile"] == CLUSTER
    assert [g["name"] for g in doc["cluster"]["groups"]] == ["a100-80gb-sxm", "v100-32gb-sxm2"]
    assert [g["count"] for g in doc["cluster"]["groups"]] == [2, 2]
    # default link: the slower inter-node link, V100's 6.25 GB/s (hardware_profiles/catalog/v100-32gb-sxm2.yaml)
    assert doc["cluster"]["link"]["bandwidth_bytes_per_s"] == load_profile("v100-32gb-sxm2").inter_node.bandwidth_bytes_per_s
    assert doc["plan"]["dtype"] == "fp16"  # V100 has no bf16: the whole cluster trains in fp16
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert [s["device_type"] for s in saved["stages"]] == types


def test_plan_cluster_report_has_a_device_type_column_when_mixed(graph_file):
    # 1 A100 + 1 V100 each: K=2 with one replica must use both types (a stage per device).
    code, out, err = run(["plan", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "-b", "8",
                          "--stages", "2"])
    assert code == 0, err
    assert "device type" in out
    assert "1 × a100-80gb-sxm + 1 × v100-32gb-sxm2" in out or "1 × v100-32gb-sxm2 + 1 × a100-80gb-sxm" in out


def test_cluster_link_flag_is_used(graph_file):
    code, out, err = run(["plan", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "--cluster-link",
                          "1,100", "-b", "8", "--stages", "2", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["cluster"]["link"] == {"bandwidth_bytes_per_s": 1e9, "latency_s": pytest.approx(1e-4)}
    first = doc["plan"]["stages"][0]["predicted"]
    assert first["send_s"] == pytest.approx(1e-4 + first["send_bytes"] / 1e9)


@pytest.mark.parametrize("args, words", [
    (["--cluster", CLUSTER, "--gpus", "4"], "--cluster replaces --profile and --gpus"),
    (["--cluster", CLUSTER, "--profile", "a100-80gb-sxm"], "--cluster replaces --profile and --gpus"),
    (["--cluster", "a100-80gb-sxm:4"], "names one group"),
    (["--cluster", "a100-80gb-sxm:0,v100-32gb-sxm2:2"], "whole number from 1"),
    (["--cluster", "a100-80gb-sxm:2,v100-32gb-sxm2:1e9"], "whole number from 1"),
    (["--cluster", "nope:2,v100-32gb-sxm2:2"], "unknown hardware profile 'nope'"),
    (["--cluster", CLUSTER, "--cluster-link", "fast"], "--cluster-link fast"),
    (["--cluster-link", "10", "--profile", "a100-80gb-sxm", "--gpus", "2"], "--cluster-link needs --cluster"),
    (["--cluster", CLUSTER, "--schedule", "interleaved"], "one stage a device; --schedule interleaved is not one"),
    # the V schedules hold two stages a device too: refused up front, not searched into "no plan fits"
    (["--cluster", CLUSTER, "--schedule", "zb-v"], "(pick --schedule gpipe, 1f1b or zb-h1, or auto)"),
    (["--cluster", CLUSTER, "--schedule", "dualpipev"], "--schedule dualpipev is not one"),
    (["--cluster", CLUSTER, "--schedule", "pipedream-2bw"], "--schedule pipedream-2bw is not one"),
    (["--cluster", CLUSTER, "--plot", "x.png"], "--plot is not available with --cluster"),
    (["--gpus", "4"], "missing --profile"),
    (["--profile", "a100-80gb-sxm"], "missing --gpus"),
])
def test_cluster_errors_exit_2_with_one_line(graph_file, args, words):
    code, out, err = run(["plan", graph_file, *args])
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


def test_compare_adds_a_cluster_row(graph_file):
    code, out, err = run(["compare", graph_file, "--profiles", "a100-80gb-sxm", "--gpus", "2", "-b", "8",
                          "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "--json"])
    assert code == 0, err
    rows = json.loads(out)["profiles"]
    assert [r["profile"] for r in rows] == ["a100-80gb-sxm", "a100-80gb-sxm:1,v100-32gb-sxm2:1"]
    assert rows[1]["devices_available"] == 2 and rows[1]["feasible"]
    assert set(rows[1]["device_types"]) <= {"a100-80gb-sxm", "v100-32gb-sxm2"}


def test_analyze_takes_cluster_too(graph_file):
    code, out, err = run(["analyze", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "-b", "8",
                          "--stages", "2", "--json"])
    assert code == 0, err
    stages = json.loads(out)["plan"]["stages"]
    assert sorted(s["device_type"] for s in stages) == ["a100-80gb-sxm", "v100-32gb-sxm2"]  # one device of each


def test_a_cluster_plan_on_one_of_its_types_names_that_type(graph_file, tmp_path):
    """A one-stage plan runs on one device type of the cluster: its header names that type, not the --cluster spec
    as if it were one profile ("1 × a100-80gb-sxm:1,v100-32gb-sxm2:1 (of 2 available)"), and `show` reads it
    against that type (it noted the spec as a profile not found)."""
    plan_file = tmp_path / "plan.json"
    code, out, err = run(["plan", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "-b", "8",
                          "--stages", "1", "-o", plan_file])
    assert code == 0, err
    (stage,) = json.loads(plan_file.read_text())["stages"]
    header = f"{stage['replicas']} × {stage['device_type']} (of 2 available): "
    assert any(line.startswith(header) for line in out.splitlines()), out
    # `show` loads that type's profile (the plan's `profile` is the cluster spec): its memory against the capacity
    code, out, err = run(["show", plan_file])
    assert code == 0, err
    share = stage["predicted"]["memory_bytes"] / load_profile(stage["device_type"]).usable_memory_bytes
    assert "not found" not in out and f"({share:.0%})" in out, out


def test_show_reports_a_saved_mixed_plan_with_each_types_capacity(graph_file, tmp_path):
    plan_file = tmp_path / "plan.json"
    code, _, err = run(["plan", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "-b", "8",
                        "--stages", "2", "-o", plan_file])
    assert code == 0, err
    code, out, err = run(["show", plan_file])
    assert code == 0, err
    assert "not found" not in out and "device type" in out
    # each stage's memory is shown as a share of its own type's usable memory (the catalogue files)
    rows = [line for line in out.splitlines() if "-sxm" in line and "│" in line and "GiB (" in line]
    for stage in json.loads(plan_file.read_text())["stages"]:
        share = stage["predicted"]["memory_bytes"] / load_profile(stage["device_type"]).usable_memory_bytes
        row = next(r for r in rows if f" {stage['device_type']} " in r)
        assert f"({share:.0%})" in row, (stage["device_type"], row)


def test_export_of_a_mixed_plan_names_each_stages_device_type(graph_file, tmp_path):
    plan_file = tmp_path / "plan.json"
    code, _, err = run(["plan", graph_file, "--cluster", "a100-80gb-sxm:1,v100-32gb-sxm2:1", "-b", "8",
                        "--stages", "2", "--schedule", "1f1b", "-o", plan_file])
    assert code == 0, err
    code, out, err = run(["export", plan_file, "--to", "deepspeed", "--json"])
    assert code == 0, err
    types = [s["device_type"] for s in json.loads(plan_file.read_text())["stages"]]
    note = next(n for n in json.loads(out)["notes"] if n.startswith("mixed cluster"))
    assert all(f"stage {i}: {t}" in note for i, t in enumerate(types))
