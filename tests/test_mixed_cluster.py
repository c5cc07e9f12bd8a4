"""Mixed clusters (--cluster): placements, the per-type DP and prediction, against brute force and the plain path."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.cluster import Cluster, ClusterGroup, default_link, parse_cluster
from pipeplan.planner.configs import Config
from pipeplan.planner.mixed_dp import mixed_chain_dp, stage_cost
from pipeplan.planner.mixed_predict import mixed_predict
from pipeplan.planner.mixed_search import _MixedSearch, cluster_request, mixed_search, placements
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import predict
from pipeplan.planner.request import PlanRequest
from search_fixtures import gpt_like, profile

FAST = profile(40.0, name="fast")
# Half the FLOP/s and memory bandwidth, twice the memory: per-kind times differ, so stages must be priced per type.
SLOW = replace(profile(80.0, name="slow"), mem_bw_bytes_per_s=0.75e12,
               peak_flops={"fp32": 9.75e12, "tf32": 78e12, "bf16": 156e12, "fp16": 156e12},
               inter_node=Link("infiniband", 12.5e9, 2e-5))


def cluster(a: int = 2, b: int = 2, fast=FAST, slow=SLOW, link: Link | None = None) -> Cluster:
    return Cluster((ClusterGroup(fast, a), ClusterGroup(slow, b)), link or default_link([fast, slow]), "fast:2,slow:2")


def request(**kw) -> PlanRequest:
    base = dict(devices=4, batch_size=8, dtype="bf16", recompute="off", sharding="none", solver="dp", heuristics=False)
    return PlanRequest(**{**base, **kw})


def partitions(n: int, K: int):
    """Every contiguous split of n layers into K non-empty stages, as stage-of-layer lists."""
    for cuts in itertools.combinations(range(1, n), K - 1):
        ends = (*cuts, n)
        yield [next(s for s, e in enumerate(ends) if i < e) for i in range(n)]


# -- cluster description --------------------------------------------------------------------------------------------

def test_parse_cluster_default_link_is_the_slower_inter_node_link():
    load = {"fast": FAST, "slow": SLOW}.__getitem__
    c = parse_cluster("fast:3,slow:5", load, max_count=64)
    assert [(g.profile.name, g.count) for g in c.groups] == [("fast", 3), ("slow", 5)] and c.devices == 8
    assert c.link == SLOW.inter_node  # 12.5 GB/s < 25 GB/s
    assert c.offset(1) == 3
    custom = parse_cluster("fast:3,slow:5", load, max_count=64, link="100,2")
    assert (custom.link.bandwidth_bytes_per_s, custom.link.latency_s) == (100e9, pytest.approx(2e-6))
    item = parse_cluster("fast:3,slow:5,link=50/1", load, max_count=64)
    assert item.link.bandwidth_bytes_per_s == 50e9


@pytest.mark.parametrize("spec, words", [
    ("fast:3", "one group"), ("fast:0,slow:1", "whole number from 1"), ("fast:x,slow:1", "whole number"),
    ("fast,slow:1", "PROFILE:COUNT"), ("fast:40,slow:40", "more than 64"), ("fast:1,fast:2", "twice"),
])
def test_parse_cluster_errors(spec, words):
    load = {"fast": FAST, "slow": SLOW}.__getitem__
    with pytest.raises(UserError, match=words):
        parse_cluster(spec, load, max_count=64)


def test_placements_are_contiguous_runs_within_counts():
    c = cluster(2, 1)
    for K, d in ((1, 1), (2, 1), (3, 1), (2, 2), (4, 1)):
        got = set(placements(c, K, d))
        want = set()
        for types in itertools.product(range(2), repeat=K):
            runs = [k for k, _ in itertools.groupby(types)]
            if len(runs) == len(set(runs)) and all(types.count(g) * d <= c.groups[g].count for g in range(2)):
                want.add(types)
        assert got == want, (K, d)


def test_dtype_auto_is_shared_fp16_when_a_group_has_no_bf16():
    v100_like = replace(SLOW, peak_flops={"fp32": 15.7e12, "tf32": None, "fp16": 125e12, "bf16": None})
    assert cluster_request(request(dtype="auto"), cluster(slow=v100_like)).dtype == "fp16"
    assert cluster_request(request(dtype="auto"), cluster()).dtype == "bf16"
    pascal_like = replace(SLOW, peak_flops={"fp32": 11.76e12, "tf32": None, "fp16": None, "bf16": None})
    assert cluster_request(request(dtype="auto"), cluster(slow=pascal_like)).dtype == "fp32"  # it cannot run 16-bit


# -- prediction -----------------------------------------------------------------------------------------------------

def test_one_type_prediction_equals_the_plain_prediction():
    g = gpt_like(blocks=4)
    cfg = Config(schedule="1f1b", stages=2, data_parallel=2, microbatches=2)
    req = request()
    assign = [0, 0, 0, 1, 1, 1]
    plain = predict(g, FAST, assign, cfg, req).plan
    mixed = mixed_predict(g, cluster(4, 2), assign, (0, 0), cfg, req).plan
    assert mixed.predicted.iteration_s == plain.predicted.iteration_s
    assert mixed.predicted.peak_memory_bytes == plain.predicted.peak_memory_bytes
    assert [s.predicted for s in mixed.stages] == [s.predicted for s in plain.stages]
    assert [s.devices for s in mixed.stages] == [s.devices for s in plain.stages]
    assert [s.device_type for s in mixed.stages] == ["fast", "fast"]


@pytest.mark.parametrize("recompute", ["off", "on"])
def test_one_type_zero_bubble_prediction_equals_the_plain_prediction(recompute):
    """Zero bubble's W, its re-runs under recomputation and what torch's split adds carry through the splice."""
    fast = replace(FAST, split_backward_s=1e-4, split_backward_group_s=5e-5)
    g = gpt_like(blocks=4)
    cfg = Config(schedule="zb-h1", stages=2, data_parallel=1, microbatches=4, recompute=recompute == "on")
    req = request(recompute=recompute)
    assign = [0, 0, 0, 1, 1, 1]
    plain = predict(g, fast, assign, cfg, req).plan
    mixed = mixed_predict(g, cluster(4, 2, fast=fast), assign, (0, 0), cfg, req).plan
    assert plain.stages[1].predicted.wgrad_s > 0 and (recompute == "off" or plain.stages[1].predicted.wgrad_recompute_s > 0)
    assert [s.predicted for s in mixed.stages] == [s.predicted for s in plain.stages]
    assert mixed.predicted.iteration_s == plain.predicted.iteration_s


def test_each_stage_priced_on_its_own_type_and_the_cluster_link_between():
    g = gpt_like(blocks=4)
    cfg = Config(schedule="gpipe", stages=2, data_parallel=1, microbatches=2)
    req = request()
    assign = [0, 0, 0, 1, 1, 1]
    link = Link("test", 10e9, 1e-4)
    mixed = mixed_predict(g, cluster(link=link), assign, (0, 1), cfg, req).plan
    on_fast = predict(g, FAST, assign, cfg, req).plan
    on_slow = predict(g, SLOW, assign, cfg, req).plan
    assert mixed.stages[0].predicted.fwd_s == on_fast.stages[0].predicted.fwd_s
    assert mixed.stages[1].predicted.fwd_s == on_slow.stages[1].predicted.fwd_s
    assert mixed.stages[1].predicted.fwd_s > on_fast.stages[1].predicted.fwd_s  # the slow type really is slower
    nbytes = mixed.stages[0].predicted.send_bytes
    assert nbytes > 0
    assert mixed.stages[0].predicted.send_s == pytest.approx(1e-4 + nbytes / 10e9)  # alpha-beta over the cluster link
    assert [s.devices for s in mixed.stages] == [[0], [2]]  # the slow group's first device


# -- the DP and the search against brute force ----------------------------------------------------------------------

def test_dp_matches_brute_force_on_every_placement():
    g = gpt_like(blocks=4)
    c = cluster()
    sr = _MixedSearch(g, c, request())
    n = len(g.layers)
    for K in (2, 3):
        cfg = Config(schedule="1f1b", stages=K, data_parallel=1, microbatches=4)
        mem = sr.memory(cfg, 1)
        for types in placements(c, K, 1):
            costs = sr.costs(cfg, types, 1, mem)
            tight = replace(costs, capacity_bytes=[x // 40 for x in costs.capacity_bytes])  # memory binds
            for k in (costs, tight):
                prefix = [list(itertools.accumulate(row, initial=0.0)) for row in k.compute_s]
                brute = min((max(stage_cost(k, types, prefix, s, a.index(s), len(a) - a[::-1].index(s))
                                 for s in range(K)), a) for a in partitions(n, K))
                got = mixed_chain_dp(k, types)
                if brute[0] == float("inf"):
                    assert got is None
                else:
                    assert got is not None and got[0] == pytest.approx(brute[0])


@pytest.mark.parametrize("stages, microbatches, schedule", [(2, 4, "1f1b"), (2, 8, "gpipe"), (3, 4, "1f1b"),
                                                          (3, 2, "gpipe")])
def test_search_agrees_with_brute_force_over_placements_and_partitions(stages, microbatches, schedule):
    """The search (DP partition per placement, boundary shifts on the best, simulation) against simulating every
    placement x partition of a 7-layer chain on 2 fast + 2 slow devices."""
    g = gpt_like(blocks=5)
    c = cluster()
    req = request(stages=stages, data_parallel=1, microbatches=microbatches, schedule=schedule)
    cfg = Config(schedule=schedule, stages=stages, data_parallel=1, microbatches=microbatches)
    best = 0.0
    for types in itertools.product(range(2), repeat=stages):
        if types not in placements(c, stages, 1):
            continue
        for assign in partitions(len(g.layers), stages):
            plan = mixed_predict(g, c, assign, types, cfg, req).plan
            if plan.predicted.fits:
                best = max(best, plan.predicted.samples_per_s)
    got = mixed_search(g, c, req).best
    assert got.predicted.samples_per_s == pytest.approx(best, rel=1e-9)


def test_memory_capacity_binds_per_type():
    """The head stage (large activations) fits only on the larger-memory type, though the other type is faster."""
    g = gpt_like(blocks=4)
    req = request(stages=2, data_parallel=1, microbatches=4, schedule="1f1b")
    roomy = mixed_search(g, cluster(), req).best
    assert {s.device_type for s in roomy.stages} == {"fast"}  # unconstrained, everything on the faster type
    head_stage = [s for s in roomy.stages if "head" in s.layers][0]
    small = replace(FAST, usable_memory_bytes=int(head_stage.predicted.memory_bytes * 0.9),
                    memory_bytes=int(head_stage.predicted.memory_bytes * 0.9))
    got = mixed_search(g, cluster(fast=small), req).best
    on_head = [s for s in got.stages if "head" in s.layers][0]
    assert on_head.device_type == "slow"
    caps = {"fast": small.usable_memory_bytes, "slow": SLOW.usable_memory_bytes}
    assert all(s.predicted.memory_bytes <= caps[s.device_type] for s in got.stages)
    assert got.predicted.fits


# -- plan file and runtime ------------------------------------------------------------------------------------------

def test_plan_file_carries_device_types_and_old_plans_still_load(tmp_path):
    g = gpt_like(blocks=4)
    plan = mixed_search(g, cluster(), request(stages=2, data_parallel=1, microbatches=4)).best
    plan.save(tmp_path / "p.json")
    doc = plan.to_dict()
    assert all(isinstance(s["device_type"], str) for s in doc["stages"])
    again = Plan.from_dict(doc)
    assert [s.device_type for s in again.stages] == [s.device_type for s in plan.stages]
    plain = predict(g, FAST, [0, 0, 0, 1, 1, 1], Config(schedule="1f1b", stages=2, data_parallel=1, microbatches=4),
                   request()).plan
    old = plain.to_dict()
    assert all("device_type" not in s for s in old["stages"])  # plans without --cluster read as before
    assert not Plan.from_dict(old).mixed
    old["stages"][0]["device_type"] = 5
    with pytest.raises(UserError, match="device_type"):
        Plan.from_dict(old)


def test_run_refuses_a_mixed_plan():
    from pipeplan.runtime.launch import LaunchOptions, check_plan

    g = gpt_like(blocks=4)
    cfg = Config(schedule="1f1b", stages=2, data_parallel=1, microbatches=4)
    plan = mixed_predict(g, cluster(), [0, 0, 0, 1, 1, 1], (0, 1), cfg, request()).plan
    with pytest.raises(UserError, match="mixed cluster .*cannot emulate"):
        check_plan(plan, LaunchOptions(steps=2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_bound_a_mixed_partition_is_skipped_by_never_exceeds_its_prediction(schedule, recompute):
    """Every placement x partition of a 7-layer chain on 2 fast + 2 slow devices: the lower bound the mixed search
    skips a partition by (each device's ramp, work and drain, layers priced on their stage's type) is never above
    the simulated iteration."""
    g = gpt_like(blocks=5)
    c = cluster()
    req = cluster_request(request(schedule=schedule, recompute="on" if recompute else "off"), c)
    sr = _MixedSearch(g, c, req)
    checked = 0
    for stages, M in itertools.product((2, 3), (1, 4)):
        cfg = Config(schedule=schedule, stages=stages, data_parallel=1, microbatches=M, recompute=recompute)
        for types in placements(c, stages, 1):
            for assign in partitions(len(g.layers), stages):
                iteration = mixed_predict(g, c, assign, types, cfg, req).plan.predicted.iteration_s
                assert 0 < sr.iteration_bound(cfg, types, assign, 8 // M) <= iteration * (1 + 1e-9), (types, assign)
                checked += 1
    assert checked == 2 * 84  # placements x partitions: 4 x 6 on two stages, 4 x 15 on three
