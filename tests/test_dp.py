"""The chain DP against brute force, hand-computed cases, and its problem builder."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.brute import brute_chain
from pipeplan.planner.dp import (
    COMM_MODES,
    _WindowMax,
    boundary_links,
    overflow_bytes,
    partition_dp,
    partition_dp_modes,
    partition_fits,
    stage_costs,
)
from pipeplan.planner.problem import build_problem, chain_problem

FAST = Link("nvlink", 100e9, 1e-6)
SLOW = Link("ib", 1e9, 1e-5)


@st.composite
def chains(draw, max_n=9):
    n = draw(st.integers(1, max_n))
    compute = draw(st.lists(st.floats(0.001, 1.0), min_size=n, max_size=n))
    cuts = draw(st.lists(st.integers(0, 2_000_000), min_size=n - 1, max_size=n - 1))
    params = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    k = draw(st.integers(1, n))
    return chain_problem(compute, cut_bytes=cuts, param_bytes=params), k


@settings(max_examples=150, deadline=None)
@given(chains(), st.booleans())
def test_dp_matches_brute_force(case, hetero):
    problem, k = case
    link = (lambda b: SLOW if b % 2 else FAST) if hetero else SLOW
    best, _ = brute_chain(problem, k, link=link)
    got = partition_dp(problem, k, link=link)
    assert got.solver["status"] == "optimal"
    assert got.bottleneck_s == pytest.approx(best, rel=1e-9)
    # the reported partition really has that value
    assert max(stage_costs(problem, got.bounds(), link)) == pytest.approx(got.bottleneck_s, rel=1e-12)
    assert len(got.bounds()) == k and got.assignment == sorted(got.assignment)


@settings(max_examples=120, deadline=None)
@given(chains(), st.integers(50, 400))
def test_dp_memory_caps_match_brute_force(case, capacity):
    problem, k = case

    def memory(stage, start, end):  # 1F1B-like: earlier stages hold more microbatches
        return sum(problem.param_bytes[start:end]) * (k - stage)

    best, _ = brute_chain(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity)
    got = partition_dp(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity)
    if best == math.inf:
        assert got.solver["status"] == "infeasible"
        # overflow: the least-overflowing partition needs exactly this much more (within 0.1%)
        need = min(
            max(memory(s, a, b) for s, (a, b) in enumerate(bounds)) - capacity
            for bounds in _all_bounds(problem.n, k)
        )
        assert need * 0.999 - 1 <= got.solver["overflow_bytes"] <= need * 1.001 + 1
        # asked for on demand (the search's way), the same figure; not sized, the same verdict
        assert overflow_bytes(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity) == \
            got.solver["overflow_bytes"]
        lazy = partition_dp(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity, size_overflow=False)
        assert lazy.solver["memory_cap"] and "overflow_bytes" not in lazy.solver
        assert not partition_fits(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity)
    else:
        assert got.bottleneck_s == pytest.approx(best, rel=1e-9)
        assert all(memory(s, a, b) <= capacity for s, (a, b) in enumerate(got.bounds()))
        assert overflow_bytes(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity) == 0
        assert partition_fits(problem, k, link=SLOW, memory_bytes=memory, capacity_bytes=capacity)


def _all_bounds(n, k):
    import itertools

    for cuts in itertools.combinations(range(1, n), k - 1):
        ends = [0, *cuts, n]
        yield list(zip(ends[:-1], ends[1:], strict=True))


def test_uniform_chain_hand_value():
    # 8 layers of 1 s into 4 stages, 1 MB cuts over 1 GB/s + 10 us: middle stages pay two sends
    p = chain_problem([1.0] * 8, cut_bytes=[1_000_000] * 7)
    got = partition_dp(p, 4, link=SLOW)
    send = 1e-5 + 1e6 / 1e9
    assert got.bounds() == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert got.bottleneck_s == pytest.approx(2.0 + 2 * send)


def test_cut_placed_at_the_small_activation():
    # equal compute; one cut is 100x cheaper to send: the 2-stage split must use it
    p = chain_problem([1.0, 1.0, 1.0, 1.0], cut_bytes=[50_000_000, 500_000, 50_000_000])
    got = partition_dp(p, 2, link=SLOW)
    assert got.bounds() == [(0, 2), (2, 4)]
    # balanced cut costs 2 + 1.5 s of sending; 3 + 0.0005 s is better, 3 + 0.05 s is not
    p2 = chain_problem([1.0, 1.0, 1.0, 1.0], cut_bytes=[500_000, 1_500_000_000, 50_000_000])
    got2 = partition_dp(p2, 2, link=SLOW)
    assert got2.bounds() == [(0, 1), (1, 4)]
    assert got2.bottleneck_s == pytest.approx(3.0 + 1e-5 + 0.0005)


def test_more_stages_than_layers_is_infeasible():
    got = partition_dp(chain_problem([1.0, 2.0]), 3, link=SLOW)
    assert got.solver["status"] == "infeasible" and got.bottleneck_s == math.inf


def _profile(devices_per_node):
    return HardwareProfile(name="t", device="t", memory_bytes=1 << 30, usable_memory_bytes=1 << 30,
                           mem_bw_bytes_per_s=1e12, peak_flops={"fp32": 1e12}, devices_per_node=devices_per_node,
                           intra_node=FAST, inter_node=SLOW)


def test_boundary_links_cross_nodes_where_devices_do():
    fn = boundary_links(_profile(4))
    assert [fn(b).kind for b in range(7)] == ["nvlink"] * 3 + ["ib"] + ["nvlink"] * 3
    fn2 = boundary_links(_profile(4), replicas=[2, 2, 1, 3])
    assert [fn2(b).kind for b in range(3)] == ["nvlink", "ib", "nvlink"]


def test_inter_node_boundary_moves_the_cut():
    # 8 equal layers, 8 stages over 2 nodes of 4: fine either way; with 2 stages on 1+1 nodes the
    # big cut must avoid the slow link: compare the same problem with both links
    p = chain_problem([1.0] * 4, cut_bytes=[10_000_000, 1_000, 10_000_000])
    fast = partition_dp(p, 2, link=FAST)
    slow = partition_dp(p, 2, link=SLOW)
    assert slow.bounds() == [(0, 2), (2, 4)]
    assert slow.bottleneck_s == pytest.approx(2.0 + 1e-5 + 1e3 / 1e9)
    assert fast.bottleneck_s < slow.bottleneck_s


def test_build_problem_scales_bytes_with_the_microbatch():
    layers = [
        Layer("a", param_bytes=40, output_bytes=800, saved_bytes=1600, fwd_s=0.8, bwd_s=1.6),
        Layer("b", param_bytes=0, output_bytes=400, saved_bytes=0, fwd_s=0.4, bwd_s=0.8),
        Layer("c", param_bytes=4, output_bytes=80, saved_bytes=80, fwd_s=0.2, bwd_s=0.4),
    ]
    edges = [Edge("a", "b", 800), Edge("b", "c", 400), Edge("a", "c", 800)]
    g = Graph(name="t", layers=layers, edges=edges, batch_size=8, input_bytes=160)
    p = build_problem(g, None, microbatch_size=2, times="measured")
    assert p.fwd_s == pytest.approx((0.2, 0.1, 0.05))
    assert p.saved_bytes == (400, 0, 20) and p.param_bytes == (40, 0, 4)
    assert p.cut_bytes == (200, 300)  # a's output is live across both cuts
    assert p.input_bytes == 40 and sorted(p.edges) == [(0, 1, 200), (0, 2, 200), (1, 2, 100)]
    assert not p.is_chain()


@settings(max_examples=100, deadline=None)
@given(chains(), st.booleans())
def test_dp_overlap_objective_matches_brute_force(case, hetero):
    problem, k = case
    link = (lambda b: SLOW if b % 2 else FAST) if hetero else Link("slow", 1e7, 1e-4)
    best, _ = brute_chain(problem, k, link=link, comm="overlap")
    got = partition_dp(problem, k, link=link, comm="overlap")
    assert got.bottleneck_s == pytest.approx(best, rel=1e-9)
    assert max(stage_costs(problem, got.bounds(), link, "overlap")) == pytest.approx(got.bottleneck_s, rel=1e-12)


def test_overlap_hand_value():
    # sends overlap compute: 8 x 1 s into 4 stages, sends of 0.5 s hide behind 2 s of compute
    p = chain_problem([1.0] * 8, cut_bytes=[500_000_000] * 7)
    got = partition_dp(p, 4, link=SLOW, comm="overlap")
    assert got.bottleneck_s == pytest.approx(2.0)
    # a 3 s send cannot hide: every boundary costs 3 s + latency
    p2 = chain_problem([1.0] * 8, cut_bytes=[3_000_000_000] * 7)
    assert partition_dp(p2, 4, link=SLOW, comm="overlap").bottleneck_s == pytest.approx(3.0 + 1e-5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=70), st.data())
def test_window_max_is_the_max_over_each_window(values, data):
    """dp._WindowMax against max() of each window, for nondecreasing starts (what the two-pointer walk makes; a start
    past its end is an empty window, as set_capacity marks ends no start fits), called twice with different values as the bisection does."""
    n1 = len(values)
    L = np.array(sorted(data.draw(st.lists(st.integers(0, n1), min_size=n1, max_size=n1))), dtype=np.int64)
    window_max = _WindowMax(L)
    for g in (np.array(values), np.array(values[::-1])):
        want = [max(g[L[b]:b]) if L[b] < b else -math.inf for b in range(n1)]
        assert window_max(g).tolist() == want


@settings(max_examples=80, deadline=None)
@given(chains(), st.integers(50, 400), st.booleans())
def test_both_models_from_one_memory_walk_are_each_models_own(case, capacity, hetero):
    """partition_dp_modes (one memory walk for both communication models, as the search asks) gives what
    partition_dp gives under each model alone: partition, bottleneck, bound, status and overflow."""
    problem, k = case
    link = (lambda b: SLOW if b % 2 else FAST) if hetero else SLOW

    def memory(stage, start, end):
        return sum(problem.param_bytes[start:end]) * (k - stage)

    both = partition_dp_modes(problem, k, link=link, memory_bytes=memory, capacity_bytes=capacity, comms=COMM_MODES)
    for comm, got in zip(COMM_MODES, both, strict=True):
        alone = partition_dp(problem, k, link=link, memory_bytes=memory, capacity_bytes=capacity, comm=comm)
        assert got.assignment == alone.assignment and got.bottleneck_s == alone.bottleneck_s
        assert {key: v for key, v in got.solver.items() if key != "time_s"} == \
            {key: v for key, v in alone.solver.items() if key != "time_s"}
