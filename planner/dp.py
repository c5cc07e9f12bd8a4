"""Optimal contiguous partition of a layer chain into K pipeline stages (min bottleneck).

Why not the textbook DP f[s][b] = min_a max(f[s-1][a], cost(a, b))? It is
O(K n^2): minutes for 10,000 layers. Instead we search the bottleneck value T
and answer "can the layers be cut into K stages, each costing <= T?" exactly in
O(K n) numpy work:

    cost(s, a, b) = C[b] - C[a] + sendL_s(a) + sendR_s(b)

(C = prefix sums of fwd+bwd; sendL = p2p time of the gradient sent back over the
cut before layer a on boundary s-1; sendR = p2p time of the activation sent
forward over the cut after layer b-1 on boundary s). The condition splits into a
term of a and a term of b:  C[a] - sendL_s(a) >= C[b] + sendR_s(b) - T.  So the
set of prefix ends reachable with s+1 stages is one vectorised comparison
against the running maximum of (C[a] - sendL_s(a)) over the prefix ends reachable
with s stages. This is exact for ANY send costs (they need not be monotone in
the cut position, which is what breaks a greedy "extend while it fits") and for
links that depend on the boundary index (devices_per_node).

Memory caps: memory_bytes(stage, start, end) is assumed monotone in the layer
interval (a stage that gains layers never needs less memory). Then for each end
b the admissible starts form a suffix [L_s(b), b), found once per stage by two
pointers (independent of T), and the running maximum becomes a range maximum
(sparse table). The chosen partition is re-checked with the callback itself.

The bottleneck is found by bisection between a lower bound and the bottleneck of
the best partition seen so far (always an achieved value), to relative 1e-12;
`bound` and `gap` in the result say how close.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from pipeplan.costmodels.comm import p2p_time_s
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.problem import Problem

LinkArg = Union[Link, Callable[[int], Link]]
MemoryFn = Callable[[int, int, int], int]
SolverInfo = dict[str, Any]
"""What a solver reports (name, status, objective, bound, gap, time_s, and its own extras): a JSON record that
the search copies into `Plan.solver`, so it has that field's type; its values are of mixed types."""

RTOL = 1e-12


@dataclass
class Partition:
    assignment: list[int]  # stage index of each layer (non-decreasing for chains)
    bottleneck_s: float  # objective value
    stage_s: list[float]  # per-stage time used in the objective
    replicas: list[int]  # per stage (all 1 unless PipeDream mode)
    solver: SolverInfo = field(default_factory=dict)  # name, status, objective, bound, gap, time_s

    @property
    def stages(self) -> int:
        return len(self.stage_s)

    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) layer ranges of each stage (contiguous assignments only)."""
        return assignment_bounds(self.assignment)


def assignment_bounds(assignment: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(assignment) + 1):
        if i == len(assignment) or assignment[i] != assignment[i - 1]:
            out.append((start, i))
            start = i
    return out


def link_fn(link: LinkArg) -> Callable[[int], Link]:
    return link if callable(link) and not isinstance(link, Link) else (lambda _b: link)


def boundary_links(profile: HardwareProfile, replicas: list[int] | int = 1) -> Callable[[int], Link]:
    """Link used by stage boundary b (between stages b and b+1) when stages take
    consecutive device ranks: the inter-node link when the last device of stage b
    and the first device of stage b+1 sit on different nodes."""

    def fn(b: int) -> Link:
        if isinstance(replicas, int):
            last = (b + 1) * replicas - 1
        else:
            last = sum(replicas[: b + 1]) - 1
        return profile.link_between(last, last + 1)

    return fn


COMM_MODES = ("sum", "overlap")


def stage_costs(problem: Problem, bounds: list[tuple[int, int]], link: LinkArg, comm: str = "sum") -> list[float]:
    """The DP objective's per-stage time for given [start, end) ranges (reference for tests).

    comm="sum": compute + the sends (blocking p2p). comm="overlap": max(compute,
    each send) - sends run on their own link/stream while the device computes, as
    the schedule simulator assumes.
    """
    fn = link_fn(link)
    comp = problem.compute_s
    n = problem.n
    out = []
    for s, (a, b) in enumerate(bounds):
        t = math.fsum(comp[a:b])
        left = p2p_time_s(problem.cut_bytes[a - 1], fn(s - 1)) if a > 0 else 0.0
        right = p2p_time_s(problem.cut_bytes[b - 1], fn(s)) if b < n else 0.0
        out.append(t + left + right if comm == "sum" else max(t, left, right))
    return out


def bounds_to_assignment(bounds: list[tuple[int, int]]) -> list[int]:
    return [s for s, (a, b) in enumerate(bounds) for _ in range(a, b)]


class _Chain:
    """Precomputed arrays for one (problem, K, link, memory) instance, shared by both communication models: `reach`,
    `backtrack` and `costs` take the model (`overlap`) as their caller's bisection asks."""

    def __init__(self, problem: Problem, stages: int, link: LinkArg, memory_bytes: MemoryFn | None,
                 capacity_bytes: int | None):
        self.n, self.K = problem.n, stages
        self.C = np.concatenate([[0.0], np.cumsum(np.asarray(problem.compute_s, dtype=np.float64))])
        fn = link_fn(link)
        cache: dict[Link, np.ndarray] = {}

        def sends(lk: Link) -> np.ndarray:
            if lk not in cache:
                cache[lk] = np.array([p2p_time_s(c, lk) for c in problem.cut_bytes], dtype=np.float64)
            return cache[lk]

        n = self.n
        self.sendL, self.sendR = [], []
        for s in range(stages):
            left = np.zeros(n + 1)
            right = np.zeros(n + 1)
            if s > 0 and n > 1:
                left[1:n] = sends(fn(s - 1))
            if s < stages - 1 and n > 1:
                right[1:n] = sends(fn(s))
            self.sendL.append(left)
            self.sendR.append(right)
        self.memory_bytes = memory_bytes if capacity_bytes is not None else None
        self.L: list[np.ndarray | None] = [None] * stages
        self.window_max: list[_WindowMax | None] = [None] * stages  # over each stage's admissible starts L[s]
        if self.memory_bytes is not None and capacity_bytes is not None:
            self.set_capacity(capacity_bytes)

    def set_capacity(self, capacity: int) -> None:
        """L[s][b] = smallest start a with memory(s, a, b) <= capacity (b: no start fits)."""
        n, mem = self.n, self.memory_bytes
        if mem is None:
            raise RuntimeError("internal: a memory cap without a memory function")
        self.capacity = capacity
        for s in range(self.K):
            lo_b, hi_b = s + 1, n - (self.K - 1 - s)
            L = np.zeros(n + 1, dtype=np.int64)
            a = 0
            for b in range(lo_b, hi_b + 1):
                a = max(a, s)
                while a < b and mem(s, a, b) > capacity:
                    a += 1
                L[b] = a
            L[:lo_b] = 0
            L[hi_b + 1:] = n
            self.L[s] = None if (L[lo_b:hi_b + 1] <= s).all() else L
            self.window_max[s] = None if self.L[s] is None else _WindowMax(L)

    def reach(self, T: float, overlap: bool = False) -> list[np.ndarray] | None:
        """Reachable prefix ends after each number of stages, or None if K stages cannot cover all layers."""
        n, K, C = self.n, self.K, self.C
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        history = [reach]
        for s in range(K):
            if overlap:  # max(compute, sends) <= T: sends are admissibility masks
                g = np.where(reach & (self.sendL[s] <= T), C, -np.inf)
            else:
                g = np.where(reach, C - self.sendL[s], -np.inf)
            window_max = self.window_max[s]
            if window_max is None:
                best = np.full(n + 1, -np.inf)
                best[1:] = np.maximum.accumulate(g)[:-1]
            else:
                best = window_max(g)
            if overlap:
                new = (best > -np.inf) & (best >= C - T) & (self.sendR[s] <= T)
            else:
                new = (best > -np.inf) & (best >= C + self.sendR[s] - T)
            new[0] = False
            new[n - (K - 1 - s) + 1:] = False  # leave a layer for every later stage
            if not new.any():
                return None
            reach = new
            history.append(reach)
        return history if reach[n] else None

    def backtrack(self, history: list[np.ndarray], T: float, overlap: bool = False) -> list[tuple[int, int]] | None:
        n, C = self.n, self.C
        b = n
        bounds = []
        for s in range(self.K - 1, -1, -1):
            starts = self.L[s]
            lo = 0 if starts is None else int(starts[b])
            a_range = np.arange(lo, b)
            if T == math.inf:
                ok = history[s][lo:b].copy()
            elif overlap:
                ok = history[s][lo:b] & (C[lo:b] >= C[b] - T) & (self.sendL[s][lo:b] <= T) & (self.sendR[s][b] <= T)
            else:
                ok = history[s][lo:b] & ((C[lo:b] - self.sendL[s][lo:b]) >= C[b] + self.sendR[s][b] - T)
            cands = a_range[ok]
            if self.memory_bytes is not None:
                cands = [a for a in cands[::-1] if self.memory_bytes(s, int(a), b) <= self.capacity]
            if len(cands) == 0:
                return None
            # the latest feasible start keeps this (last) stage small, leaving slack to the prefix
            a = int(max(cands))
            bounds.append((a, b))
            b = a
        bounds.reverse()
        return bounds

    def any_partition(self) -> list[tuple[int, int]] | None:
        """A partition that fits the memory cap, with no bound on any stage's time (so under either communication
        model), or None."""
        hist = self.reach(math.inf)
        return self.backtrack(hist, math.inf) if hist is not None else None

    def costs(self, bounds: list[tuple[int, int]], overlap: bool) -> list[float]:
        if overlap:
            return [float(max(self.C[b] - self.C[a], self.sendL[s][a], self.sendR[s][b])) for s, (a, b) in enumerate(bounds)]
        return [float(self.C[b] - self.C[a] + self.sendL[s][a] + self.sendR[s][b]) for s, (a, b) in enumerate(bounds)]


class _WindowMax:
    """out[b] = max(g[L[b]:b]) for every b at once (-inf where the window is empty), via a sparse table.

    One stage's starts L stay fixed while the bisection calls `reach` ~45 times with another g each time, so
    where each window's two covering blocks lie is worked out once here, and each call only fills the table
    (in place, up to the level the widest window needs). README's Llama-3-70B `analyze` makes 81,377 of these
    calls: 3.2 s of a 30 s run when each rebuilt the indices and stacked a fresh table, 1.0 s since (one run each).
    """

    def __init__(self, L: np.ndarray) -> None:
        idx = np.arange(len(L))
        length = idx - L  # window [L, b-1] has length b - L
        self.valid = np.flatnonzero(length > 0)
        self.level = np.floor(np.log2(length[self.valid])).astype(np.int64)
        self.left = L[self.valid]
        self.right = self.valid - (1 << self.level)
        levels = int(self.level.max()) + 1 if len(self.valid) else 1
        self.table = np.empty((levels, len(L)))

    def __call__(self, g: np.ndarray) -> np.ndarray:
        st = self.table
        st[0] = g
        k = 1
        for j in range(1, len(st)):  # level j: the max of 2^j entries from each position (fewer at the end)
            st[j, :-k] = np.maximum(st[j - 1, :-k], st[j - 1, k:])
            st[j, -k:] = st[j - 1, -k:]
            k *= 2
        out = np.full(len(g), -np.inf)
        out[self.valid] = np.maximum(st[self.level, self.left], st[self.level, self.right])
        return out


def partition_dp(problem: Problem, stages: int, *, link: LinkArg, memory_bytes: MemoryFn | None = None,
                 capacity_bytes: int | None = None, comm: str = "sum", size_overflow: bool = True) -> Partition:
    """Optimal contiguous K-stage partition minimising the slowest stage (compute + boundary sends).

    comm="sum" (default, the agreed objective): a stage's time is its compute plus
    the p2p sends at its boundaries. comm="overlap": max(compute, each send), for
    runtimes that overlap p2p with compute (the schedule simulator's model).

    Infeasible (memory, or fewer layers than stages) -> Partition with
    solver["status"] == "infeasible"; for memory, solver["memory_cap"] is True and
    solver["overflow_bytes"] is how much more capacity the least-overflowing partition
    needs (within 0.1%; `overflow_bytes`). That takes ~15 more passes over the chain, so
    `size_overflow=False` leaves it out for a caller that needs it only when nothing
    fits (the search: planner/diagnose.py sizes it then).
    """
    return partition_dp_modes(problem, stages, link=link, memory_bytes=memory_bytes, capacity_bytes=capacity_bytes,
                              comms=(comm,), size_overflow=size_overflow)[0]


def partition_dp_modes(problem: Problem, stages: int, *, link: LinkArg, memory_bytes: MemoryFn | None = None,
                       capacity_bytes: int | None = None, comms: tuple[str, ...] = COMM_MODES,
                       size_overflow: bool = True) -> list[Partition]:
    """`partition_dp` under each communication model of `comms`, in that order, from one memory walk.

    Which starts fit the memory cap (`_Chain.set_capacity`, two pointers over every stage) and whether any
    partition fits do not depend on the model, only the bisection on the bottleneck does; the search asks
    for both models of every configuration, and walked the memory twice: 9.3 s of a 78 s `analyze` of
    Llama-3.1-405B on 1,024 H100s (README) went to those walks.
    """
    t0 = time.perf_counter()
    for comm in comms:
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if problem.n < stages:
        return [_infeasible(stages, t0, reason=f"{problem.n} layers cannot fill {stages} stages") for _ in comms]
    chain = _Chain(problem, stages, link, memory_bytes, capacity_bytes)
    bounds = chain.any_partition()
    if bounds is None:
        overflow = (_min_overflow(chain, capacity_bytes) if size_overflow and memory_bytes is not None
                    and capacity_bytes is not None else None)
        return [_infeasible(stages, t0, reason="no partition fits the memory cap", overflow=overflow, memory_cap=True)
                for _ in comms]
    shared_s = time.perf_counter() - t0
    return [_bisect(chain, problem, link, comm, bounds, shared_s) for comm in comms]


def _bisect(chain: _Chain, problem: Problem, link: LinkArg, comm: str, feasible: list[tuple[int, int]],
            shared_s: float) -> Partition:
    """The optimum under `comm`, by bisection on the bottleneck from a `feasible` partition's."""
    t0 = time.perf_counter()
    overlap = comm == "overlap"
    stages, n = chain.K, chain.n
    best = feasible
    hi = max(chain.costs(feasible, overlap))
    comp = np.asarray(problem.compute_s, dtype=np.float64)
    lo = max(float(comp.max()), float(chain.C[-1]) / stages) if n else 0.0
    lo = min(lo, hi)
    iterations = 0
    while hi - lo > RTOL * max(hi, 1e-300):
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        iterations += 1
        hist = chain.reach(mid, overlap)
        got = chain.backtrack(hist, mid, overlap) if hist is not None else None
        if got is None:
            lo = mid
        else:
            best = got
            hi = min(mid, max(chain.costs(got, overlap)))
    stage_s = stage_costs(problem, best, link, comm)
    bottleneck = max(stage_s)
    return Partition(
        assignment=bounds_to_assignment(best),
        bottleneck_s=bottleneck,
        stage_s=stage_s,
        replicas=[1] * stages,
        solver={
            "name": "dp",
            "status": "optimal",
            "objective": bottleneck,
            "bound": lo,
            "gap": (bottleneck - lo) / bottleneck if bottleneck > 0 else 0.0,
            "time_s": shared_s + time.perf_counter() - t0,
            "iterations": iterations,
            "comm": comm,
        },
    )


def partition_fits(problem: Problem, stages: int, *, link: LinkArg, memory_bytes: MemoryFn,
                   capacity_bytes: int) -> bool:
    """Whether some `stages`-stage partition fits `capacity_bytes`: one memory walk, no sizing."""
    return _fitting_chain(problem, stages, link, memory_bytes, capacity_bytes)[1]


def overflow_bytes(problem: Problem, stages: int, *, link: LinkArg, memory_bytes: MemoryFn,
                   capacity_bytes: int) -> int:
    """0 when some `stages`-stage partition fits `capacity_bytes`, else the least extra capacity for which one does
    (within 0.1%): what `partition_dp` reports of a memory-infeasible chain, asked for on demand."""
    chain, fits = _fitting_chain(problem, stages, link, memory_bytes, capacity_bytes)
    return 0 if fits else _min_overflow(chain, capacity_bytes)


def _fitting_chain(problem: Problem, stages: int, link: LinkArg, memory_bytes: MemoryFn,
                   capacity_bytes: int) -> tuple[_Chain, bool]:
    if problem.n < stages:
        raise ValueError(f"{problem.n} layers cannot fill {stages} stages")
    chain = _Chain(problem, stages, link, memory_bytes, capacity_bytes)
    return chain, chain.any_partition() is not None


def _min_overflow(chain: _Chain, capacity: int) -> int:
    """Smallest extra capacity (bytes, to within 0.1%) for which some partition fits."""
    lo, hi = 0, max(capacity, 1)
    while True:
        chain.set_capacity(capacity + hi)
        if chain.any_partition() is not None:
            break
        lo, hi = hi, hi * 4
        if hi > 1 << 62:
            return hi
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        chain.set_capacity(capacity + mid)
        if chain.any_partition() is not None:
            hi = mid
        else:
            lo = mid
    chain.set_capacity(capacity)
    return int(hi)


def _infeasible(stages: int, t0: float, *, reason: str, overflow: int | None = None,
                memory_cap: bool = False) -> Partition:
    solver = {"name": "dp", "status": "infeasible", "objective": math.inf, "bound": math.inf, "gap": None,
              "time_s": time.perf_counter() - t0, "reason": reason, "memory_cap": memory_cap}
    if overflow is not None:
        solver["overflow_bytes"] = overflow
    return Partition(assignment=[], bottleneck_s=math.inf, stage_s=[], replicas=[1] * stages, solver=solver)
