"""PipeDream-mode partitioning against brute force and hand-computed configurations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.brute import brute_pipedream
from pipeplan.planner.pipedream import allreduce_pipedream_s, partition_pipedream
from pipeplan.planner.problem import Problem, chain_problem, dag_problem

INTRA = Link("nvlink", 10e9, 0.0)
INTER = Link("ib", 1e9, 0.0)


@st.composite
def chains(draw, max_n=6):
    n = draw(st.integers(1, max_n))
    compute = draw(st.lists(st.floats(0.001, 1.0), min_size=n, max_size=n))
    params = draw(st.lists(st.integers(0, 400_000_000), min_size=n, max_size=n))
    return chain_problem(compute, param_bytes=params)


def _check_structure(problem, levels, got):
    total = 1
    for c, _ in levels:
        total *= c
    assert got.solver["status"] == "optimal"
    assert sum(got.replicas) <= total
    assert len(got.assignment) == problem.n
    for s, d, _ in problem.edges:
        assert got.assignment[s] <= got.assignment[d]


@settings(max_examples=80, deadline=None)
@given(chains(), st.integers(1, 5))
def test_flat_matches_brute_force(problem, workers):
    levels = [(workers, INTER)]
    got = partition_pipedream(problem, levels)
    assert got.bottleneck_s == pytest.approx(brute_pipedream(problem, levels), rel=1e-9)
    _check_structure(problem, levels, got)
    # the flat result's stage times are the objective's terms
    assert max(got.stage_s) == pytest.approx(got.bottleneck_s)


@settings(max_examples=40, deadline=None)
@given(chains(max_n=5), st.integers(1, 3), st.integers(1, 3))
def test_two_level_matches_brute_force(problem, inner, outer):
    levels = [(inner, INTRA), (outer, INTER)]
    got = partition_pipedream(problem, levels)
    assert got.bottleneck_s == pytest.approx(brute_pipedream(problem, levels), rel=1e-9)
    _check_structure(problem, levels, got)


@st.composite
def dags(draw, max_n=6):
    n = draw(st.integers(2, max_n))
    edges = []
    for v in range(1, n):
        for s in sorted(draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=2))):
            edges.append((s, v, 0))
    compute = draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))
    params = draw(st.lists(st.integers(0, 400_000_000), min_size=n, max_size=n))
    return Problem(names=tuple(f"n{i}" for i in range(n)), fwd_s=tuple(c / 3 for c in compute),
                   bwd_s=tuple(c - c / 3 for c in compute), param_bytes=tuple(params), saved_bytes=(0,) * n,
                   output_bytes=(0,) * n, cut_bytes=(0,) * (n - 1), input_bytes=0, edges=tuple(edges))


@settings(max_examples=40, deadline=None)
@given(dags(), st.integers(1, 3))
def test_dag_stages_are_ideals_and_match_brute_force(problem, workers):
    levels = [(workers, INTER)]
    got = partition_pipedream(problem, levels)
    assert got.bottleneck_s == pytest.approx(brute_pipedream(problem, levels, dag=True), rel=1e-9)
    _check_structure(problem, levels, got)


@settings(max_examples=25, deadline=None)
@given(dags(max_n=5), st.integers(1, 2), st.integers(1, 2))
def test_two_level_dag_matches_brute_force(problem, inner, outer):
    levels = [(inner, INTRA), (outer, INTER)]
    got = partition_pipedream(problem, levels)
    expected = brute_pipedream(problem, levels, dag=not problem.is_chain())
    assert got.bottleneck_s == pytest.approx(expected, rel=1e-9)
    _check_structure(problem, levels, got)


def test_replication_hand_value():
    # one heavy layer without parameters, then a light layer with big weights, 4 workers at 1 GB/s:
    # replicate the first 3x (3 s / 3 = 1 s), keep the second single: max(1, 0.9) = 1 s.
    p = chain_problem([3.0, 0.9], param_bytes=[0, 500_000_000])
    got = partition_pipedream(p, [(4, INTER)])
    assert got.replicas == [3, 1]
    assert got.bottleneck_s == pytest.approx(1.0)
    # all four on the first layer's stage alone is not allowed: 4 + 1 > 4 devices
    assert sum(got.replicas) <= 4


def test_allreduce_formula():
    # 4 (r-1) P / (B r): 2 replicas of 1 GB over 1 GB/s = 2 s; one replica: nothing
    assert allreduce_pipedream_s(1e9, 2, 1e9) == pytest.approx(2.0)
    assert allreduce_pipedream_s(1e9, 1, 1e9) == 0.0
    assert allreduce_pipedream_s(3e9, 4, 1e9) == pytest.approx(9.0)


def test_pipeline_or_data_parallel_hand_values():
    # four equal layers: a 4-stage straight pipeline (1 s, no all-reduce) beats data parallelism
    p = chain_problem([1.0, 1.0, 1.0, 1.0], param_bytes=[1000] * 4)
    got = partition_pipedream(p, [(4, INTER)])
    assert got.replicas == [1, 1, 1, 1] and got.bottleneck_s == pytest.approx(1.0)
    # one unsplittable layer with small weights: 4 replicas, (4 s + 4*3*1000/(1e9*4)) / 4
    one = partition_pipedream(chain_problem([4.0], param_bytes=[1000]), [(4, INTER)])
    assert one.replicas == [4]
    assert one.bottleneck_s == pytest.approx((4.0 + 3e-6) / 4, rel=1e-12)


def test_memory_cap_forces_a_split():
    p = chain_problem([1.0, 3.0], param_bytes=[1000, 1000], saved_bytes=[10, 10])
    free = partition_pipedream(p, [(2, INTER)])
    assert free.replicas == [2]  # data parallel is best without a cap
    # a device holding both layers needs 4*2000 + ceil(2/2)*20 = 8020 bytes; cap below that
    capped = partition_pipedream(p, [(2, INTER)], memory_capacity_bytes=8000)
    assert capped.replicas == [1, 1] and capped.bottleneck_s == pytest.approx(3.0)


@st.composite
def frozen_parts(draw, problem):
    """Of each layer's parameter bytes, a part that needs no gradient."""
    return tuple(draw(st.integers(0, p)) for p in problem.param_bytes)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.booleans(), st.integers(1, 3))
def test_frozen_parameters_are_not_all_reduced(data, dag, workers):
    # frozen weights get no gradient, so PipeDream's all-reduce term sees only the trainable bytes: the
    # optimum equals brute force on the same model with the frozen bytes taken out of its parameters
    problem = data.draw(dags(max_n=5) if dag else chains(max_n=5))
    frozen = data.draw(frozen_parts(problem))
    with_frozen = replace(problem, frozen_param_bytes=frozen)
    trainable_only = replace(problem, param_bytes=tuple(p - f for p, f in zip(problem.param_bytes, frozen, strict=True)))
    levels = [(workers, INTER)]
    got = partition_pipedream(with_frozen, levels)
    assert got.bottleneck_s == pytest.approx(brute_pipedream(trainable_only, levels, dag=dag), rel=1e-9)


@pytest.mark.parametrize("dag", [False, True])
def test_frozen_weights_are_held_once_under_a_memory_cap(dag):
    # 1000 bytes of weights on one device: trainable, they need 4 x 1000 (weights, gradients, Adam's two
    # moments); frozen, their 1000 alone. A cap of 2000 fits the frozen model only.
    edges = [(0, 1, 0), (0, 2, 0), (1, 2, 0)]
    p = dag_problem([1.0, 1.0, 1.0], edges, param_bytes=[1000, 0, 0]) if dag else \
        chain_problem([1.0, 1.0, 1.0], param_bytes=[1000, 0, 0])
    assert not partition_pipedream(p, [(1, INTER)], memory_capacity_bytes=2000).assignment
    frozen = partition_pipedream(replace(p, frozen_param_bytes=(1000, 0, 0)), [(1, INTER)],
                                 memory_capacity_bytes=2000)
    assert frozen.assignment == [0, 0, 0] and frozen.bottleneck_s == pytest.approx(3.0)
