"""When nothing fits, the closest configuration is the one that sizing every rejected configuration finds, though
most are ruled out by one packing at the best need so far instead of a bisection (planner/diagnose.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeplan.errors import InfeasibleError
from pipeplan.planner import diagnose
from pipeplan.planner import search as search_module
from pipeplan.planner.feasibility import least_capacity
from pipeplan.planner.request import PlanRequest
from search_fixtures import gpt_like, profile


def closest_by_sizing_all(view: diagnose.SearchView) -> diagnose.Failure:
    """The reference: every greedy failure sized, then the least need, measured ones first, first of equals."""
    out = []
    for f in view.failures:
        if f.how == "greedy":
            cfg = f.config
            mem = view.memory(cfg, view.problem(cfg.microbatch_size(view.request.batch_size), cfg.recompute))
            f = replace(f, need_bytes=least_capacity(mem, cfg.virtual_stages, int(view.profile.usable_memory_bytes)))
        out.append(f)
    measured = [f for f in out if f.how != "state"]
    return min(measured or out, key=lambda x: x.need_bytes)


@pytest.mark.parametrize("gib,kw", [
    (0.75, dict(devices=8, batch_size=64, dtype="fp32")),
    (0.75, dict(devices=8, batch_size=64, dtype="fp32", schedule="gpipe")),
    (0.75, dict(devices=8, batch_size=64, dtype="bf16", recompute="off")),
    (0.75, dict(devices=8, batch_size=64, dtype="fp32", sharding="none")),
    (2.0, dict(devices=2, batch_size=8, dtype="fp32", recompute="off")),
])
def test_the_closest_failure_is_the_one_sizing_every_failure_finds(monkeypatch, gib, kw):
    views = []

    def keep(view, lead=None):
        views.append(view)
        return diagnose.infeasible_message(view, lead)

    monkeypatch.setattr(search_module, "infeasible_message", keep)
    with pytest.raises(InfeasibleError):
        search_module.search(gpt_like(blocks=8, hidden=1024, seq=1024, vocab=32000, batch=1), profile(gib),
                             PlanRequest(**kw))
    view = views[0]
    assert sum(f.how == "greedy" for f in view.failures) > 1  # something to rule out
    want, got = closest_by_sizing_all(view), diagnose._closest(view)
    assert (got.config, got.need_bytes, got.how) == (want.config, want.need_bytes, want.how)
