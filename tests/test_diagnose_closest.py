"""When nothing fits, the closest configuration is the one that sizing every rejected configuration finds, though
most are ruled out by one packing (or one DP pass) at the best need so far instead of a bisection
(planner/diagnose.py); the DP's failures, left unsized by the search, get the overflow `partition_dp` reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeplan.errors import InfeasibleError
from pipeplan.planner import diagnose
from pipeplan.planner import dp as dp_module
from pipeplan.planner import partition as partition_module
from pipeplan.planner import search as search_module
from pipeplan.planner.dp import partition_dp
from pipeplan.planner.feasibility import least_capacity
from pipeplan.planner.partition import link_fn
from pipeplan.planner.request import PlanRequest
from search_fixtures import gpt_like, profile


def closest_by_sizing_all(view: diagnose.SearchView) -> diagnose.Failure:
    """The reference: every greedy failure sized, every DP failure given the overflow the DP itself reports, then the
    least need, measured ones first, first of equals."""
    out = []
    cap = int(view.profile.usable_memory_bytes)
    for f in view.failures:
        cfg = f.config
        prob = view.problem(cfg.microbatch_size(view.request.batch_size), cfg.recompute)
        mem = view.memory(cfg, prob)
        if f.how == "greedy":
            f = replace(f, need_bytes=least_capacity(mem, cfg.virtual_stages, cap))
        elif f.how == "dp":
            part = partition_dp(prob, cfg.virtual_stages, link=link_fn(view.profile, cfg), memory_bytes=mem,
                                capacity_bytes=cap)
            assert part.solver["status"] == "infeasible" and part.solver["memory_cap"]
            f = replace(f, need_bytes=cap + part.solver["overflow_bytes"])
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
@pytest.mark.parametrize("greedy_check", [True, False])
def test_the_closest_failure_is_the_one_sizing_every_failure_finds(monkeypatch, gib, kw, greedy_check):
    """Without the greedy check (`greedy_check=False`) every configuration whose model state fits reaches the DP,
    whose failures the search leaves unsized: the diagnosis sizes and rules them out itself."""
    views = []
    if not greedy_check:
        monkeypatch.setattr(search_module, "greedy_fits", lambda *a: True)

    def keep(view, lead=None, closest=None):
        views.append(view)
        return diagnose.infeasible_message(view, lead, closest)

    monkeypatch.setattr(search_module, "infeasible_message", keep)
    with pytest.raises(InfeasibleError):
        search_module.search(gpt_like(blocks=8, hidden=1024, seq=1024, vocab=32000, batch=1), profile(gib),
                             PlanRequest(**kw))
    view = views[0]
    assert sum(f.how == ("greedy" if greedy_check else "dp") for f in view.failures) > 1  # something to rule out
    assert all(f.need_bytes == -1 for f in view.failures if f.how == "dp")  # left unsized by the search
    want, got = closest_by_sizing_all(view), diagnose.closest_failure(view)
    assert (got.config, got.need_bytes, got.how) == (want.config, want.need_bytes, want.how)


def test_a_search_that_finds_a_plan_sizes_no_dp_overflow(monkeypatch):
    """The DP's overflow is read only when nothing fits: a search whose refits meet infeasible DPs (the prediction
    found a partition over, the DP under less memory then finds none) runs no overflow bisection."""
    infeasible = []
    real = partition_module.partition_dp_modes

    def counted(*a, **kw):
        parts = real(*a, **kw)
        infeasible.extend(part.solver["status"] == "infeasible" for part in parts)
        return parts

    def refuse(*a):
        raise AssertionError("the DP's overflow was sized though a plan fits")

    monkeypatch.setattr(partition_module, "partition_dp_modes", counted)
    monkeypatch.setattr(dp_module, "_min_overflow", refuse)
    got = search_module.search(gpt_like(blocks=8, hidden=1024, seq=1024, vocab=32000, batch=1), profile(1.5),
                               PlanRequest(devices=8, batch_size=64, dtype="fp32"))
    assert got.best.predicted.fits
    assert any(infeasible)  # the case this test is about: a refit's DP found no partition
