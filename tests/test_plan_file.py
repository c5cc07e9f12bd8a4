"""The plan file (pipeplan.plan/v1): exact round trip, required fields, clear rejection of other files."""

from __future__ import annotations

import json
import os
import re

import pytest

from pipeplan.errors import UserError
from pipeplan.planner.plan import PLAN_FORMAT, Plan, load_plan
from pipeplan.planner.predict import evaluate
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.search import search
from search_fixtures import gpt_like, profile


@pytest.fixture(scope="module")
def searched():
    g = gpt_like(blocks=8, hidden=512, seq=256, vocab=8000, batch=4)
    return g, search(g, profile(2.0), PlanRequest(devices=8, batch_size=32))


def test_round_trip_is_exact(tmp_path, searched):
    _, res = searched
    plan = res.best
    path = tmp_path / "plan.json"
    plan.save(path)
    back = load_plan(path)
    assert back == plan
    assert back.to_dict() == plan.to_dict()
    assert json.loads(path.read_text()) == json.loads(json.dumps(plan.to_dict()))


def test_required_fields(tmp_path, searched):
    g, res = searched
    doc = res.best.to_dict()
    assert doc["format"] == PLAN_FORMAT
    for key in ("schedule", "microbatches", "batch_size", "microbatch_size", "stages", "predicted", "graph",
                "profile", "recompute", "optimizer", "dtype", "devices", "data_parallel", "alternatives"):
        assert key in doc, key
    assert set(doc["graph"]) >= {"fingerprint", "name", "model_file", "entry", "depth", "trace_batch_size", "layers"}
    assert doc["graph"]["fingerprint"] == g.fingerprint()
    for st in doc["stages"]:
        assert set(st) >= {"layers", "devices", "replicas", "predicted"}
        assert set(st["predicted"]) >= {"compute_s", "send_s", "memory_bytes"}
        assert all(name in {l.name for l in g.layers} for name in st["layers"])
    assert set(doc["predicted"]) >= {"iteration_s", "samples_per_s", "bubble_fraction", "peak_memory_bytes",
                                     "achieved_flops_fraction"}
    # Every layer is in exactly one stage, in order.
    assert [n for st in doc["stages"] for n in st["layers"]] == [l.name for l in g.layers]
    assert doc["microbatch_size"] * doc["microbatches"] * doc["data_parallel"] == doc["batch_size"]


def test_evaluated_plan_round_trips_with_data_parallel(tmp_path):
    g = gpt_like(blocks=4, hidden=256, seq=128, vocab=1000, batch=4)
    plan = evaluate(g, profile(), [0, 0, 0, 1, 1, 1], data_parallel=2, schedule="gpipe", microbatches=2, batch_size=16)
    path = tmp_path / "p.json"
    plan.save(path)
    back = load_plan(path)
    assert back == plan and back.microbatch_size == 4 and back.data_parallel == 2


def _write(tmp_path, doc):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    return path


def test_rejects_other_formats_and_versions(tmp_path, searched):
    _, res = searched
    doc = res.best.to_dict()
    with pytest.raises(UserError, match=r"format version 'v2' is not supported \(this pipeplan reads 'v1'\)"):
        load_plan(_write(tmp_path, {**doc, "format": "pipeplan.plan/v2"}))
    with pytest.raises(UserError, match=r"format is 'pipeplan.graph/v1', expected 'pipeplan.plan/v1'"):
        load_plan(_write(tmp_path, {**doc, "format": "pipeplan.graph/v1"}))
    with pytest.raises(UserError, match="not a pipeplan file"):
        load_plan(_write(tmp_path, {k: v for k, v in doc.items() if k != "format"}))
    with pytest.raises(UserError, match="x.json: stages is missing"):
        load_plan(_write(tmp_path, {k: v for k, v in doc.items() if k != "stages"}))
    with pytest.raises(UserError, match="x.json: schedule is 'zero-bubble': must be one of gpipe"):
        load_plan(_write(tmp_path, {**doc, "schedule": "zero-bubble"}))
    with pytest.raises(UserError, match="x.json: batch_size is .*: must be divisible by microbatches"):
        load_plan(_write(tmp_path, {**doc, "batch_size": doc["batch_size"] + 1}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="invalid JSON"):
        load_plan(bad)


def test_plan_is_written_atomically(tmp_path, searched, monkeypatch):
    """A failure while writing leaves the old file intact and no temp files behind."""
    _, res = searched
    path = tmp_path / "plan.json"
    path.write_text("old")
    import pipeplan._io as io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(io.os, "fsync", boom)
    with pytest.raises(OSError):
        res.best.save(path)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_from_dict_ignores_unknown_keys(searched):
    _, res = searched
    doc = res.best.to_dict()
    doc["future_field"] = 1
    doc["stages"][0]["predicted"]["future"] = 2
    assert Plan.from_dict(doc) == res.best


@pytest.mark.parametrize("key, value", [("dtype", "fp8"), ("optimizer", "lion"), ("optimizer_kernels", "apex")])
def test_a_value_the_plan_refuses_is_named_with_its_file(tmp_path, searched, key, value):
    """`pipeplan run`/`show` of an edited plan: the one-line error names the file as well as the value."""
    _, res = searched
    doc = res.best.to_dict()
    doc[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}: unknown {key} '{value}'"):
        load_plan(path)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_keep_the_users_umask(tmp_path, umask, mode):
    """mkstemp creates 0600 files; a plan, graph or profile must get what any new file gets under the umask."""
    from pipeplan._io import atomic_write_text

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "out.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == mode
