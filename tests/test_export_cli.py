"""`pipeplan export`: exact exports, exit 2 with the reason, and `--nearest` re-predicted beside the plan."""

from __future__ import annotations

import json

import pytest

from cli_invoke import invoke as run
from pipeplan.planner.predict import evaluate
from test_export_fixtures import counts_assignment, llama_graph


def h100():
    from pipeplan.hardware_profiles import load_profile

    return load_profile("h100-sxm")


def predict_split(g, counts, **kw):
    return evaluate(g, h100(), counts_assignment(counts), schedule=kw.pop("schedule", "1f1b"), microbatches=8,
                    batch_size=16, dtype="bf16", **kw)


@pytest.fixture
def files(tmp_path):
    """A leaf-level (half-block) graph and a plan on h100-sxm that cuts inside block 1."""
    g = llama_graph(4, halves=True)
    g.save(tmp_path / "graph.json")
    plan = predict_split(g, [5, 7])
    plan.save(tmp_path / "plan.json")
    return tmp_path, g, plan


def test_exact_export_prints_settings_and_json(tmp_path):
    g = llama_graph(4)
    predict_split(g, [4, 4], schedule="gpipe").save(tmp_path / "plan.json")
    code, out, err = run(["export", tmp_path / "plan.json", "--to", "deepspeed"])
    assert code == 0, err
    assert "PARTS = [0, 3, 7]" in out and "no option for explicit stage boundaries" in out
    code, out, err = run(["export", tmp_path / "plan.json", "--to", "torchtitan", "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["exact"] and doc["nearest"] is None
    assert doc["stage_modules"] == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "lm_head"]]
    code, out, err = run(["export", tmp_path / "plan.json", "--to", "megatron"])
    assert code == 2 and "Megatron-LM has no GPipe schedule" in err


def test_inexpressible_exits_2_saying_why(files):
    tmp, _, _ = files
    code, out, err = run(["export", tmp / "plan.json", "--to", "megatron"])
    assert code == 2 and out == ""
    assert "megatron cannot express this plan: stage 1 starts inside decoder block model.layers.1" in err
    assert "--nearest" in err


def test_nearest_is_repredicted_beside_the_plan(files):
    tmp, g, plan = files
    code, out, err = run(["export", tmp / "plan.json", "--to", "megatron", "--nearest", "--graph", tmp / "graph.json",
                          "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["format"] == "pipeplan.export/v1" and doc["exact"] is False
    near = doc["nearest"]
    # the cut at model.layers.1.mlp is one layer from the block's start and one from its end: the earlier wins
    assert near["layer_counts"] == [4, 8]
    again = predict_split(g, [4, 8])
    assert near["samples_per_s"] == pytest.approx(again.predicted.samples_per_s, rel=1e-9)
    assert doc["original"]["samples_per_s"] == pytest.approx(plan.predicted.samples_per_s, rel=1e-9)
    assert "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3" in doc["snippets"]["arguments"]
    assert doc["nearest"]["changes"][0].startswith("cuts moved to block boundaries")


def test_nearest_replans_when_no_small_change_expresses_the_plan(tmp_path):
    """DeepSpeed has no interleaving: --nearest re-runs the search within 1F1B and ZeRO-0/1 and exports its best."""
    from dataclasses import replace

    from pipeplan.planner.replay import request_of
    from pipeplan.planner.search import search

    g = llama_graph(8)
    g.save(tmp_path / "graph.json")
    plan = predict_split(g, [3, 2, 2, 2, 1, 2], schedule="interleaved", chunks=3)  # 6 chunks on 2 devices
    plan.save(tmp_path / "plan.json")
    code, out, err = run(["export", tmp_path / "plan.json", "--to", "deepspeed", "--nearest", "--graph",
                          tmp_path / "graph.json", "--json"])
    assert code == 0, err
    near = json.loads(out)["nearest"]
    assert near["changes"][0].startswith("re-planned within what deepspeed runs (DeepSpeed has no interleaved schedule)")
    assert near["schedule"] == "1f1b" and near["sharding"] in ("none", "zero1") and near["fits"]
    # the independent answer: the search itself, asked for 1F1B at ZeRO-1 at most, on the same devices and batch
    best = search(g, h100(), replace(request_of(plan), schedule="1f1b", sharding="zero1")).best
    assert near["samples_per_s"] == pytest.approx(best.predicted.samples_per_s, rel=1e-9)
    code, out, err = run(["export", tmp_path / "plan.json", "--to", "deepspeed"])
    assert code == 2 and "no interleaved schedule" in err and "--nearest" in err


def test_nearest_megatron_plan_of_zero_bubble_runs_1f1b(tmp_path):
    """Megatron has no zero-bubble schedule: ZB-H1 (1F1B's order with each W split off) becomes 1F1B on the same
    split, re-predicted; a V schedule (two stages a device, V-placed) is re-planned within 1F1B and interleaved.
    Either way the nearest plan is one Megatron's exporter takes (the ZB-H1 plan came back unchanged, and
    `export --nearest` failed on it)."""
    g = llama_graph(4)
    g.save(tmp_path / "graph.json")
    predict_split(g, [4, 4], schedule="zb-h1").save(tmp_path / "zb.json")
    code, out, err = run(["export", tmp_path / "zb.json", "--to", "megatron", "--nearest", "--graph",
                          tmp_path / "graph.json", "--json"])
    assert code == 0, err
    near = json.loads(out)["nearest"]
    assert near["changes"] == ["schedule zb-h1 -> 1f1b (Megatron has no zero-bubble schedule)"]
    assert near["schedule"] == "1f1b" and near["layer_counts"] == [4, 4]
    assert near["samples_per_s"] == pytest.approx(predict_split(g, [4, 4]).predicted.samples_per_s, rel=1e-9)
    predict_split(g, [2, 2, 2, 2], schedule="zb-v", chunks=2).save(tmp_path / "v.json")
    code, out, err = run(["export", tmp_path / "v.json", "--to", "megatron", "--nearest", "--graph",
                          tmp_path / "graph.json", "--json"])
    assert code == 0, err
    near = json.loads(out)["nearest"]
    assert near["changes"][0].startswith("re-planned within what megatron runs") and "zb-v" in near["changes"][0]
    assert near["schedule"] in ("1f1b", "interleaved") and near["fits"]
