"""Brute-force optima for small problems: the oracle the solvers are tested against.

Each function enumerates every candidate and evaluates it with the same cost
function the solver claims to minimise, so agreement checks the search, not the
cost model. Exponential on purpose; keep n <= ~10.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache

from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.dp import LinkArg, MemoryFn, stage_costs
from pipeplan.planner.ilp import dag_stage_times
from pipeplan.planner.pipedream import allreduce_pipedream_s
from pipeplan.planner.problem import Problem

StageTime = Callable[[int, float, float, int], float]
"""(level, compute or inner time, parameter bytes, replicas) -> the stage's time in PipeDream's objective."""


def brute_chain(problem: Problem, stages: int, *, link: LinkArg, memory_bytes: MemoryFn | None = None,
                capacity_bytes: int | None = None, comm: str = "sum") -> tuple[float, list[tuple[int, int]] | None]:
    """(best bottleneck, bounds) over all contiguous partitions into `stages` non-empty stages."""
    n = problem.n
    best: float = math.inf
    best_bounds: list[tuple[int, int]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        ends = [0, *cuts, n]
        bounds = list(zip(ends[:-1], ends[1:], strict=True))
        if memory_bytes is not None and capacity_bytes is not None:
            if any(memory_bytes(s, a, b) > capacity_bytes for s, (a, b) in enumerate(bounds)):
                continue
        value = max(stage_costs(problem, bounds, link, comm))
        if value < best:
            best, best_bounds = value, bounds
    return best, best_bounds


def dag_assignments(problem: Problem, stages: int) -> Iterator[list[int]]:
    """Every assignment of nodes to stages with stage(u) <= stage(v) on edges, all stages used."""
    n = problem.n
    parents: list[list[int]] = [[] for _ in range(n)]
    for a, b, _ in problem.edges:
        parents[b].append(a)
    current = [0] * n

    def rec(v: int) -> Iterator[list[int]]:
        if v == n:
            if len(set(current)) == stages:
                yield list(current)
            return
        low = max((current[p] for p in parents[v]), default=0)
        for s in range(low, stages):
            current[v] = s
            yield from rec(v + 1)

    yield from rec(0)


def brute_dag(problem: Problem, stages: int, *, link: LinkArg, device_speed: list[float] | None = None,
              capacity_bytes: float | list[float] | tuple[float, ...] | None = None, memory_bytes_per_layer: Sequence[int] | None = None,
              comm: str = "sum") -> tuple[float, list[int] | None]:
    """(best bottleneck, assignment) of the ILP's objective over all valid assignments."""
    best: float = math.inf
    best_a: list[int] | None = None
    caps: Sequence[float] | None = None
    mem: Sequence[int] = ()
    if capacity_bytes is not None:
        caps = capacity_bytes if isinstance(capacity_bytes, (list, tuple)) else [capacity_bytes] * stages
        mem = memory_bytes_per_layer or [p + s for p, s in zip(problem.param_bytes, problem.saved_bytes, strict=True)]
    for a in dag_assignments(problem, stages):
        if caps is not None:
            used = [0] * stages
            for v, s in enumerate(a):
                used[s] += mem[v]
            if any(u > c for u, c in zip(used, caps, strict=False)):  # a caller's caps list may be longer
                continue
        value = max(dag_stage_times(problem, a, stages, link=link, device_speed=device_speed, comm=comm))
        if value < best:
            best, best_a = value, a
    return best, best_a


def brute_pipedream(problem: Problem, levels: list[tuple[int, Link]], *, dag: bool = False) -> float:
    """PipeDream objective's optimum, at most `count` units per level.

    dag=False: nested contiguous ranges of the topological order (what
    partition_pipedream optimises for chains and wide DAGs). dag=True: stages at
    every level are any precedence-respecting node sets (the ideal lattice).
    """
    stage_time = _pipedream_stage_time(levels)
    if dag:
        return _brute_pipedream_sets(problem, levels, stage_time)
    return _brute_pipedream_ranges(problem, levels, stage_time)


def _pipedream_stage_time(levels: list[tuple[int, Link]]) -> StageTime:
    """PipeDream's stage time at each level, written out again from its definition (pipedream.py's
    docstring) rather than shared with the solver, so the oracle checks the solver's arithmetic too.
    D[l] is the number of devices in one unit of level l: each all-reduces its shard of the weights."""
    D = [1]
    for c, _ in levels[:-1]:
        D.append(D[-1] * c)

    def stage_time(level: int, x: float, p: float, r: int) -> float:
        return (x + allreduce_pipedream_s(p, r, levels[level][1].bandwidth_bytes_per_s) / D[level]) / r

    return stage_time


def _best_replication(stage_time: StageTime, level: int, xs: Sequence[float], ps: Sequence[float], units: int,
                      best: float) -> float:
    """min(best, the slowest stage's time under the best replica counts for stages with times xs and
    parameter bytes ps, using at most `units` units in all)."""
    k = len(xs)
    for reps in _replica_vectors(k, units):
        best = min(best, max(stage_time(level, xs[i], ps[i], reps[i]) for i in range(k)))
    return best


def _precedence_assignments(nodes: tuple[int, ...], k: int, parents: list[list[int]]) -> Iterator[dict[int, int]]:
    """Precedence-respecting assignments of `nodes` (in index order) to k non-empty stages."""
    inside = set(nodes)
    cur: dict[int, int] = {}

    def rec(pos: int) -> Iterator[dict[int, int]]:
        if pos == len(nodes):
            if len(set(cur.values())) == k:
                yield dict(cur)
            return
        v = nodes[pos]
        low = max((cur[p] for p in parents[v] if p in inside), default=0)
        for st in range(low, k):
            cur[v] = st
            yield from rec(pos + 1)
        del cur[v]

    yield from rec(0)


def _brute_pipedream_sets(problem: Problem, levels: list[tuple[int, Link]], stage_time: StageTime) -> float:
    """Optimum when a stage at any level may be any precedence-respecting node set (dag=True)."""
    comp = problem.compute_s
    params = problem.trainable  # what all-reduces: frozen parameters get no gradient
    parents: list[list[int]] = [[] for _ in range(problem.n)]
    for src, dst, _ in problem.edges:
        parents[dst].append(src)

    @lru_cache(maxsize=None)
    def best_set(level: int, nodes: tuple[int, ...]) -> float:
        N = levels[level][0]
        best = math.inf
        for k in range(1, min(N, len(nodes)) + 1):
            for a in _precedence_assignments(nodes, k, parents):
                groups = [tuple(v for v in nodes if a[v] == s) for s in range(k)]
                xs = [sum(comp[v] for v in g) if level == 0 else best_set(level - 1, g) for g in groups]
                ps = [sum(params[v] for v in g) for g in groups]
                best = _best_replication(stage_time, level, xs, ps, N, best)
        return best

    return best_set(len(levels) - 1, tuple(range(problem.n)))


def _brute_pipedream_ranges(problem: Problem, levels: list[tuple[int, Link]], stage_time: StageTime) -> float:
    """Optimum over nested contiguous ranges of the topological order (dag=False)."""
    comp = problem.compute_s
    params = problem.trainable  # what all-reduces: frozen parameters get no gradient

    @lru_cache(maxsize=None)
    def best_range(level: int, a: int, b: int) -> float:
        N = levels[level][0]
        best = math.inf
        length = b - a
        for k in range(1, min(N, length) + 1):
            for cuts in itertools.combinations(range(a + 1, b), k - 1):
                ends = [a, *cuts, b]
                ranges = list(zip(ends[:-1], ends[1:], strict=True))
                xs = [sum(comp[i] for i in range(s, e)) if level == 0 else best_range(level - 1, s, e) for s, e in ranges]
                ps = [sum(params[i] for i in range(s, e)) for s, e in ranges]
                best = _best_replication(stage_time, level, xs, ps, N, best)
        return best

    return best_range(len(levels) - 1, 0, problem.n)


def _replica_vectors(k: int, total: int) -> Iterator[tuple[int, ...]]:
    """All k-tuples of positive integers with sum <= total."""
    for combo in itertools.product(range(1, total - k + 2), repeat=k):
        if sum(combo) <= total:
            yield combo
