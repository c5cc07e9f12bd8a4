"""PipeDream-mode partitioning: stages may be replicated, over a hierarchy of links.

Objective (PipeDream, SOSP'19, as its optimizer code computes it; docs/solvers.md):
a stage holding layers [a, b) replicated r times at hierarchy level l takes

    t_l(a, b, r) = (X + AR_l(P(a, b), r) / D_l) / r,   AR_l(P, r) = 4 (r - 1) P / (B_l r)

where X is the stage's compute C(a, b) (sum of fwd+bwd) at the device level, or
the best time of the sub-pipeline that runs the range inside one unit of the
level below; P is the stage's parameter bytes, B_l the level's bandwidth, D_l the
number of devices inside one unit of level l (1 at the device level; each holds
a shard of the weights and all-reduces it over its own link). Compute and
all-reduce are SUMMED (PipeDream's code; its paper takes the max). The pipeline's
time is the slowest stage; activation transfers are not in the objective
(PipeDream's default: they overlap with compute). Levels may use at most their
number of units (PipeDream's --use_fewer_machines).

Algorithm. PipeDream's DP is O(S^3 m^2) over the antichain DAG's S states (S
explodes on wide DAGs). Branching DAGs with few ideals (downward-closed node
sets; ResNets, DenseNet, GNMT) get an exact vectorised DP over all ideals, for
one level or two (`_partition_ideals*`). Otherwise states are prefixes of the
topological order, and we search the objective value T: for a threshold, every
stage cost is monotone in its layer range, so the furthest prefix coverable
with at most m units is

    reach[m] = max(reach[m-1], max_v R_v(reach[m - v])),

R_v(p) being the furthest end of a stage starting at p with v replicas that
meets T (a searchsorted on prefix sums at the device level; a binary search
over the level below otherwise). That is O(N^2 log n) per threshold, exact, and
the bisection on T stops at relative 1e-12.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.dp import Partition
from pipeplan.planner.problem import Problem

RTOL = 1e-12
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int32]
_Step = tuple[int, int, int]
"""How a cover reached its furthest point with m units: (replicas v of the last stage, units before it, its start)."""


@dataclass
class Block:
    """One stage at some level: layers [start, end), `replicas` units of the level below."""

    start: int
    end: int
    replicas: int
    time_s: float = 0.0
    inner: list["Block"] = field(default_factory=list)  # the sub-pipeline in each replica (levels > 0)


def allreduce_pipedream_s(param_bytes: float, replicas: int, bandwidth_bytes_per_s: float) -> float:
    """PipeDream's data-parallel communication time, 4 (r-1) P / (B r).

    Source: msr-fiddle/pipedream optimizer/optimizer_graph_hierarchical.py
    (compute_partitioning): `(4 * m * parameter_size) / (bandwidth * (m+1))` with m+1
    replicas; a ring all-reduce moves 2 (r-1)/r P per device, and PipeDream counts
    the link as shared by both directions (factor 2 again).
    """
    if replicas <= 1:
        return 0.0
    return 4.0 * (replicas - 1) * param_bytes / (bandwidth_bytes_per_s * replicas)


class _Solver:
    def __init__(self, problem: Problem, levels: list[tuple[int, Link]], memory_capacity_bytes: float | None,
                 param_factor: float) -> None:
        self.n = problem.n
        self.C = np.concatenate([[0.0], np.cumsum(np.asarray(problem.compute_s, dtype=np.float64))])
        self.P = np.concatenate([[0.0], np.cumsum(np.asarray(problem.trainable, dtype=np.float64))])
        F = np.concatenate([[0.0], np.cumsum(np.asarray(problem.frozen, dtype=np.float64))])
        self.A = np.concatenate([[0.0], np.cumsum(np.asarray(problem.saved_bytes, dtype=np.float64))])
        self.counts = [int(c) for c, _ in levels]
        self.bw = [float(link.bandwidth_bytes_per_s) for _, link in levels]
        self.D = [1]
        for c in self.counts[:-1]:
            self.D.append(self.D[-1] * c)
        self.total = self.D[-1] * self.counts[-1]
        # device level: stage [p, e) with v replicas meets X  <=>  h[v][e] - h[v][p] <= v X
        self.h: dict[int, FloatArray] = {}
        self.mem: dict[int, FloatArray] = {}
        for v in range(1, self.counts[0] + 1):
            coef = 4.0 * (v - 1) / (self.bw[0] * v)
            self.h[v] = self.C + coef * self.P
            if memory_capacity_bytes is not None:
                self.mem[v] = param_factor * self.P + F + math.ceil(self.total / v) * self.A
        self.cap = memory_capacity_bytes

    def stage_time(self, level: int, x: float, start: int, end: int, r: int) -> float:
        p = float(self.P[end] - self.P[start])
        return (x + allreduce_pipedream_s(p, r, self.bw[level]) / self.D[level]) / r

    # ---- furthest end of one stage -----------------------------------------
    def furthest(self, level: int, v: int, p: int, b: int, X: float) -> int:
        if level == 0:
            h = self.h[v]
            e = int(np.searchsorted(h, h[p] + v * X, side="right")) - 1
            if self.cap is not None:
                m = self.mem[v]
                e = min(e, int(np.searchsorted(m, m[p] + self.cap, side="right")) - 1)
            return max(p, min(e, b))
        lo, hi = p, b  # lo always feasible (empty stage)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(level, v, p, mid, X):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _inner_budget(self, level: int, v: int, p: int, e: int, X: float) -> float:
        pb = float(self.P[e] - self.P[p])
        return v * X - allreduce_pipedream_s(pb, v, self.bw[level]) / self.D[level]

    def _fits(self, level: int, v: int, p: int, e: int, X: float) -> bool:
        y = self._inner_budget(level, v, p, e, X)
        return y >= 0 and self.cover(level - 1, p, e, y) is not None

    # ---- greedy furthest reach over units of one level --------------------
    def cover(self, level: int, a: int, b: int, X: float) -> tuple[list[int], list[_Step | None]] | None:
        """(reach, record) if [a, b) fits in `counts[level]` units at threshold X, else None."""
        N = self.counts[level]
        reach = [a] * (N + 1)
        rec: list[_Step | None] = [None] * (N + 1)
        for m in range(1, N + 1):
            reach[m] = reach[m - 1]
            for v in range(1, m + 1):
                p = reach[m - v]
                e = self.furthest(level, v, p, b, X)
                if e > reach[m]:
                    reach[m] = e
                    rec[m] = (v, m - v, p)
            if reach[m] >= b:
                return reach[: m + 1], rec[: m + 1]
        return None

    def blocks(self, level: int, a: int, b: int, X: float) -> list[Block]:
        got = self.cover(level, a, b, X)
        if got is None:
            raise RuntimeError("internal: reconstruction of a feasible threshold failed")
        reach, rec = got
        m, frontier, out = len(reach) - 1, b, []
        while frontier > a:
            step = rec[m]
            if step is None:
                m -= 1
                continue
            v, prev, p = step
            blk = Block(p, frontier, v)
            if level > 0:
                blk.inner = self.blocks(level - 1, p, frontier, self._inner_budget(level, v, p, frontier, X))
            out.append(blk)
            frontier, m = p, prev
        out.reverse()
        return out

    def evaluate(self, level: int, blocks: list[Block]) -> float:
        worst = 0.0
        for blk in blocks:
            if level == 0:
                x = float(self.C[blk.end] - self.C[blk.start])
            else:
                x = self.evaluate(level - 1, blk.inner)
            blk.time_s = self.stage_time(level, x, blk.start, blk.end, blk.replicas)
            worst = max(worst, blk.time_s)
        return worst


def pipedream_time_s(problem: Problem, levels: list[tuple[int, Link]], blocks: list[Block]) -> float:
    """The objective of a given (nested) configuration; fills each Block.time_s."""
    return _Solver(problem, levels, None, 0.0).evaluate(len(levels) - 1, blocks)


def flatten(blocks: list[Block], outer_replicas: int = 1) -> list[tuple[int, int, int, float]]:
    """Device-level stages (start, end, total replicas, stage time) in pipeline order."""
    out: list[tuple[int, int, int, float]] = []
    for blk in blocks:
        if blk.inner:
            out.extend(flatten(blk.inner, outer_replicas * blk.replicas))
        else:
            out.append((blk.start, blk.end, outer_replicas * blk.replicas, blk.time_s))
    return out


def partition_pipedream(problem: Problem, levels: list[tuple[int, Link]], *, memory_capacity_bytes: int | None = None,
                        param_factor: float = 4.0, max_ideals: int = 2000,
                        max_ideals_two_level: int = 300) -> Partition:
    """Best PipeDream configuration (stages and replication) for `levels`, innermost first.

    levels=[(8, nvlink)] is one 8-device node; [(4, nvlink), (2, infiniband)] is
    two 4-device nodes (PipeDream's `-n 4 2 -b bw1 bw2`). Memory, when capped: a
    device holds param_factor x its stage's trainable fp32 parameter bytes (weights,
    grads, Adam state: 4 by default), its frozen ones once, plus ceil(devices /
    replicas) microbatches of saved activations (PipeDream's in-flight count for an
    input stage); the all-reduce moves the trainable bytes only. Returns a
    Partition of device-level stages: replicas[s] counts all copies of stage s;
    stage_s[s] is that stage's time at the device level; solver["blocks"] holds
    the nested configuration.

    Branching DAGs on one level: stages are differences of ideals (downward-closed
    node sets, PipeDream's antichain states), so a stage may end inside a residual
    block's branches, when the DAG has at most `max_ideals` ideals; a DP over the
    ideal lattice then gives the optimum over every valid split. Two levels: the
    same over pairs of ideals when there are at most `max_ideals_two_level` and
    S^3 N1 (N1+1) / 4 <= 1e8 (the inner level is solved for every pair, vectorised). Otherwise (wide
    DAGs, chains, deeper hierarchies, memory caps on two levels) stages are ranges
    of the topological order.
    """
    t0 = time.perf_counter()
    if not levels or any(c < 1 for c, _ in levels):
        raise ValueError("levels must be a non-empty list of (units >= 1, Link)")
    n = problem.n
    if n == 0:
        raise ValueError("empty problem")
    if len(levels) == 1 and not problem.is_chain():
        ideals = enumerate_ideals(problem, max_ideals)
        if ideals is not None:
            return _partition_ideals(problem, levels[0], ideals, memory_capacity_bytes, param_factor, t0)
    if len(levels) == 2 and not problem.is_chain() and memory_capacity_bytes is None:
        ideals = enumerate_ideals(problem, max_ideals_two_level)
        # the inner level costs ~S^3 N1 (N1 + 1) / 4 element operations: keep it under ~1 s
        n1 = levels[0][0]
        if ideals is not None and len(ideals) ** 3 * n1 * (n1 + 1) / 4 <= 1e8:
            return _partition_ideals_two_level(problem, levels, ideals, t0)
    return _partition_ranges(problem, levels, memory_capacity_bytes, param_factor, t0)


def _partition_ranges(problem: Problem, levels: list[tuple[int, Link]], memory_capacity_bytes: float | None,
                      param_factor: float, t0: float) -> Partition:
    """Stages as nested ranges of the topological order: chains, wide DAGs, deeper hierarchies, memory caps
    on two levels. Device-level stages of the best nested configuration, in pipeline order."""
    n = problem.n
    sol = _Solver(problem, levels, memory_capacity_bytes, param_factor)
    top = len(levels) - 1
    if sol.cover(top, 0, n, math.inf) is None:
        return _infeasible(t0, "a single layer exceeds the memory cap at every replication")
    best, lo, iterations = _bisect_threshold(sol, top, n)
    objective = sol.evaluate(top, best)
    flat = flatten(best)
    assignment = [s for s, (a, b, _, _) in enumerate(flat) for _ in range(a, b)]
    return Partition(
        assignment=assignment,
        bottleneck_s=objective,
        stage_s=[t for *_, t in flat],
        replicas=[r for _, _, r, _ in flat],
        solver={
            "name": "pipedream",
            "status": "optimal",
            "objective": objective,
            "bound": lo,
            "gap": (objective - lo) / objective if objective > 0 else 0.0,
            "time_s": time.perf_counter() - t0,
            "iterations": iterations,
            "devices": sum(r for _, _, r, _ in flat),
            "blocks": [_block_dict(b) for b in best],
        },
    )


def _bisect_threshold(sol: _Solver, top: int, n: int) -> tuple[list[Block], float, int]:
    """(best configuration, proven lower bound, iterations) of a bisection on the objective value T.

    The upper end is always the time of a configuration actually found (a
    threshold's cover can beat the threshold), so the answer is achieved, and a
    threshold no cover meets is a proven bound; stops at relative RTOL.
    """
    best = sol.blocks(top, 0, n, math.inf)
    hi = sol.evaluate(top, best)
    lo = min(float(sol.C[-1]) / sol.total, hi)
    iterations = 0
    while hi - lo > RTOL * max(hi, 1e-300) and iterations < 200:
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        iterations += 1
        if sol.cover(top, 0, n, mid) is None:
            lo = mid
        else:
            got = sol.blocks(top, 0, n, mid)
            value = sol.evaluate(top, got)
            if value <= hi:
                best, hi = got, value
            hi = min(hi, mid) if value <= mid else hi
    return best, lo, iterations


def _infeasible(t0: float, reason: str) -> Partition:
    """The result when no configuration fits the memory cap (one record for the range and ideal paths)."""
    return Partition(assignment=[], bottleneck_s=math.inf, stage_s=[], replicas=[], solver={
        "name": "pipedream", "status": "infeasible", "objective": math.inf, "bound": math.inf, "gap": None,
        "time_s": time.perf_counter() - t0, "reason": reason})


def _block_dict(b: Block) -> dict[str, object]:
    d: dict[str, object] = {"start": b.start, "end": b.end, "replicas": b.replicas, "time_s": b.time_s}
    if b.inner:
        d["inner"] = [_block_dict(x) for x in b.inner]
    return d


def enumerate_ideals(problem: Problem, limit: int) -> list[int] | None:
    """All ideals (downward-closed node sets) as bitsets, smallest first; None past `limit`.

    Breadth-first by size; each ideal carries the nodes that may join it next, so
    a step costs O(that frontier), and a wide DAG stops at `limit` quickly.
    """
    n = problem.n
    preds = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for a, b, _ in problem.edges:
        preds[b] |= 1 << a
        children[a].append(b)
    start = tuple(v for v in range(n) if preds[v] == 0)
    seen = {0}
    frontier = [(0, start)]
    out = [0]
    while frontier:
        nxt = []
        for ideal, avail in frontier:
            for v in avail:
                grown = ideal | (1 << v)
                if grown in seen:
                    continue
                seen.add(grown)
                out.append(grown)
                if len(out) > limit:
                    return None
                new_avail = [u for u in avail if u != v]
                new_avail += [c for c in children[v] if preds[c] & ~grown == 0]
                nxt.append((grown, tuple(new_avail)))
        frontier = nxt
    return out  # BFS by size: every subset comes before its supersets


# ---------------------------------------------------------------------------
# Exact DPs over the ideal lattice (branching DAGs with few ideals)

Choices = dict[tuple[int, int], tuple[int, int]]
"""(ideal j, units m) -> (ideal k, replicas v): the best use of m units for j ends with stage j minus k on v."""


@dataclass(frozen=True)
class _IdealSums:
    """Per ideal (in `ideals` order): compute, parameter and saved bytes of its nodes, and which ideals nest.

    A stage is the difference of two nested ideals, so its sums are differences of these rows.
    """

    C: FloatArray
    P: FloatArray  # trainable parameter bytes: all-reduced, and param_factor x in memory
    F: FloatArray  # frozen parameter bytes: weights only, once in memory
    A: FloatArray
    subset: npt.NDArray[np.bool_]  # subset[k, j]: ideal k is strictly inside ideal j


def _ideal_sums(problem: Problem, ideals: list[int]) -> _IdealSums:
    """Both ideal DPs start here: one matrix product per sum over the ideals' membership bits."""
    n = problem.n
    bits = np.array([[(I >> v) & 1 for v in range(n)] for I in ideals], dtype=np.float32)
    b64 = bits.astype(np.float64)
    size = bits.sum(axis=1)
    # ideal k is strictly inside ideal j: |k \ j| == 0 and k is smaller
    subset = ((bits @ (1.0 - bits).T) == 0) & (size[:, None] < size[None, :])
    return _IdealSums(C=b64 @ np.asarray(problem.compute_s, dtype=np.float64),
                      P=b64 @ np.asarray(problem.trainable, dtype=np.float64),
                      F=b64 @ np.asarray(problem.frozen, dtype=np.float64),
                      A=b64 @ np.asarray(problem.saved_bytes, dtype=np.float64), subset=subset)


def _walk_back(choice: Choices, full: int, units: int) -> list[tuple[int, int, int]]:
    """The stages of the best configuration of ideal `full` on `units` units, first stage first,
    as (ideal k, ideal j, replicas): the stage is j minus k."""
    out = []
    j, m = full, units
    while j != 0:
        k, v = choice[j, m]
        out.append((k, j, v))
        j, m = k, m - v
    out.reverse()
    return out


def _partition_ideals(problem: Problem, level: tuple[int, Link], ideals: list[int], cap: float | None,
                      param_factor: float, t0: float) -> Partition:
    """f[j][m] = min over ideals k inside j and v <= m of max(f[k][m-v], t(j minus k, v)); exact."""
    N, link = level
    bw = float(link.bandwidth_bytes_per_s)
    f, choice = _ideal_dp(_ideal_sums(problem, ideals), N, bw, cap, param_factor)
    full = len(ideals) - 1
    objective = float(f[full, N])
    if not math.isfinite(objective):
        return _infeasible(t0, "no configuration fits the memory cap")
    stages = [(ideals[j] & ~ideals[k], v) for k, j, v in _walk_back(choice, full, N)]
    n = problem.n
    comp = np.asarray(problem.compute_s, dtype=np.float64)
    assignment = [0] * n
    stage_s: list[float] = []
    replicas: list[int] = []
    blocks: list[dict[str, object]] = []
    for s, (members, v) in enumerate(stages):
        nodes = [i for i in range(n) if (members >> i) & 1]
        for i in nodes:
            assignment[i] = s
        c = float(comp[nodes].sum())
        p = float(sum(problem.trainable[i] for i in nodes))
        ts = (c + allreduce_pipedream_s(p, v, bw)) / v
        stage_s.append(ts)
        replicas.append(v)
        blocks.append({"layers": nodes, "replicas": v, "time_s": ts})
    return Partition(
        assignment=assignment, bottleneck_s=max(stage_s), stage_s=stage_s, replicas=replicas,
        solver={"name": "pipedream", "status": "optimal", "objective": max(stage_s), "bound": objective, "gap": 0.0,
                "time_s": time.perf_counter() - t0, "ideals": len(ideals), "devices": sum(replicas),
                "blocks": blocks},
    )


def _ideal_dp(sums: _IdealSums, N: int, bw: float, cap: float | None,
              param_factor: float) -> tuple[FloatArray, Choices]:
    """(f, choice): f[j, m] the best time of ideal j on at most m units, every candidate last stage
    (each ideal k inside j, each replica count v) compared at once per j (numpy)."""
    S = len(sums.C)
    vs = np.arange(1, N + 1, dtype=np.float64)
    coef = 4.0 * (vs - 1) / (bw * vs)
    f = np.full((S, N + 1), np.inf)
    f[0, :] = 0.0
    ms = np.arange(1, N + 1)
    prev_m = np.clip(ms[:, None] - ms[None, :], 0, N)  # (m, v) -> m - v
    valid = (ms[None, :] <= ms[:, None])[:, :, None]  # v <= m
    choice: Choices = {}
    for j in range(1, S):
        anc = np.nonzero(sums.subset[:, j])[0]
        t = _last_stage_times(sums, j, anc, vs, coef, cap, param_factor)  # (N, len)
        F = f[anc]  # (len, N+1): best time of ideal k with at most m units
        # cand[m-1, v-1, k] = max(f[k][m-v], t[v][k]) for v <= m, else inf
        cand = np.maximum(F[:, prev_m].transpose(1, 2, 0), t[None, :, :])
        cand = np.where(valid, cand, np.inf)
        flat = cand.reshape(N, -1)
        arg = np.argmin(flat, axis=1)
        vals = flat[np.arange(N), arg]
        for m in range(1, N + 1):  # "at most m units": keep m-1's answer unless strictly better
            if vals[m - 1] < f[j, m - 1]:
                v, k = divmod(int(arg[m - 1]), len(anc))
                f[j, m] = vals[m - 1]
                choice[j, m] = (int(anc[k]), v + 1)
            else:
                f[j, m] = f[j, m - 1]
                if (j, m - 1) in choice:
                    choice[j, m] = choice[j, m - 1]
    return f, choice


def _last_stage_times(sums: _IdealSums, j: int, anc: npt.NDArray[np.intp], vs: FloatArray, coef: FloatArray,
                      cap: float | None, param_factor: float) -> FloatArray:
    """t[v-1, i]: time of stage j minus anc[i] on v = vs[v-1] replicas, coef[v-1] its all-reduce seconds
    per parameter byte (inf where it breaks the memory cap)."""
    N = len(vs)
    dC = sums.C[j] - sums.C[anc]
    dP = sums.P[j] - sums.P[anc]
    t: FloatArray = (dC[None, :] + coef[:, None] * dP[None, :]) / vs[:, None]
    if cap is not None:
        dA = sums.A[j] - sums.A[anc]
        dF = sums.F[j] - sums.F[anc]
        need = param_factor * dP[None, :] + dF[None, :] + np.ceil(N / vs)[:, None] * dA[None, :]
        t = np.where(need <= cap, t, np.inf)
    return t


@dataclass(frozen=True)
class _InnerTables:
    """The inner level of the two-level DP: best[k, j, m] is the best pipeline of ideal j minus ideal k
    on at most m devices of a node; its last stage is j minus split[k, j, m] on reps[k, j, m] devices."""

    best: FloatArray
    split: IntArray
    reps: IntArray

    def stages(self, ideals: list[int], k: int, j: int, m: int) -> list[tuple[int, int]]:
        """The inner pipeline of stage j minus k on m devices: (node set bits, replicas), first stage first."""
        inner = []
        jj, mm = j, m
        while jj != k:
            ii, v1 = int(self.split[k, jj, mm]), int(self.reps[k, jj, mm])
            inner.append((ideals[jj] & ~ideals[ii], v1))
            jj, mm = ii, mm - v1
        inner.reverse()
        return inner


def _partition_ideals_two_level(problem: Problem, levels: list[tuple[int, Link]], ideals: list[int],
                                t0: float) -> Partition:
    """Two levels over the ideal lattice, as PipeDream's hierarchical optimizer does over its states.

    Inner: F1[k, j, m] = best pipeline of ideal j minus ideal k on at most m devices of a node,
    for every pair at once (vectorised over k). Outer: the single-level DP with the inner
    optimum T1(k, j) = F1[k, j, N1] as a stage's compute, all-reduce shards over N1 devices.
    """
    (N1, link1), (N2, link2) = levels
    bw1, bw2 = float(link1.bandwidth_bytes_per_s), float(link2.bandwidth_bytes_per_s)
    sums = _ideal_sums(problem, ideals)
    inner = _inner_dp(sums, N1, bw1)
    f, choice = _outer_dp(inner.best[:, :, N1], sums, N1, N2, bw2)
    full = len(ideals) - 1
    if not math.isfinite(f[full, N2]):
        raise RuntimeError("internal: two-level ideal DP found no configuration")
    n = problem.n
    comp = problem.compute_s
    assignment = [0] * n
    stage_s: list[float] = []
    replicas: list[int] = []
    blocks: list[dict[str, object]] = []
    worst = 0.0
    for k, j, v2 in _walk_back(choice, full, N2):
        stages = inner.stages(ideals, k, j, N1)
        inner_times = []
        for members, v1 in stages:
            nodes = [i for i in range(n) if (members >> i) & 1]
            c = math.fsum(comp[i] for i in nodes)
            p = float(sum(problem.trainable[i] for i in nodes))
            ts = (c + allreduce_pipedream_s(p, v1, bw1)) / v1
            for i in nodes:
                assignment[i] = len(stage_s)
            stage_s.append(ts)
            replicas.append(v1 * v2)
            inner_times.append(ts)
        p_outer = float(sums.P[j] - sums.P[k])
        t_outer = (max(inner_times) + allreduce_pipedream_s(p_outer, v2, bw2) / N1) / v2
        worst = max(worst, t_outer)
        blocks.append({"replicas": v2, "time_s": t_outer,
                       "inner": [{"layers": [i for i in range(n) if (mem >> i) & 1], "replicas": v1}
                                 for mem, v1 in stages]})
    return Partition(
        assignment=assignment, bottleneck_s=worst, stage_s=stage_s, replicas=replicas,
        solver={"name": "pipedream", "status": "optimal", "objective": worst, "bound": float(f[full, N2]),
                "gap": 0.0, "time_s": time.perf_counter() - t0, "ideals": len(ideals), "devices": sum(replicas),
                "blocks": blocks},
    )


def _inner_dp(sums: _IdealSums, N1: int, bw1: float) -> _InnerTables:
    """The inner level for every pair of nested ideals (k, j) at once: for each j, vectorised over k."""
    C, P, subset = sums.C, sums.P, sums.subset
    S = len(C)
    F1 = np.full((S, S, N1 + 1), np.inf)
    idx = np.arange(S)
    F1[idx, idx, :] = 0.0
    ch_i = np.full((S, S, N1 + 1), -1, dtype=np.int32)
    ch_v = np.zeros((S, S, N1 + 1), dtype=np.int32)
    for j in range(1, S):
        anc = np.nonzero(subset[:, j])[0]  # ideals strictly inside j: the only starts k (rows) and splits i (columns)
        rows = np.arange(len(anc))
        Fk = F1[np.ix_(anc, anc)]  # (len k, len i, N1+1)
        for m in range(1, N1 + 1):
            best = F1[anc, j, m - 1].copy()  # at most m-1 devices
            bi = ch_i[anc, j, m - 1].copy()
            bv = ch_v[anc, j, m - 1].copy()
            for v in range(1, m + 1):
                t = (C[j] - C[anc] + 4.0 * (v - 1) * (P[j] - P[anc]) / (bw1 * v)) / v  # (len i,)
                cand = np.maximum(Fk[:, :, m - v], t[None, :])
                arg = np.argmin(cand, axis=1)
                val = cand[rows, arg]
                better = val < best
                best = np.where(better, val, best)
                bi = np.where(better, anc[arg], bi)
                bv = np.where(better, v, bv)
            F1[anc, j, m] = best
            ch_i[anc, j, m] = bi
            ch_v[anc, j, m] = bv
    return _InnerTables(best=F1, split=ch_i, reps=ch_v)


def _outer_dp(T1: FloatArray, sums: _IdealSums, N1: int, N2: int, bw2: float) -> tuple[FloatArray, Choices]:
    """The outer level's single-level DP, a stage's compute being the inner optimum T1[k, j]; the
    all-reduce of its weights is sharded over the N1 devices of a node."""
    P, subset = sums.P, sums.subset
    S = len(P)
    f = np.full((S, N2 + 1), np.inf)
    f[0, :] = 0.0
    choice: Choices = {}
    for j in range(1, S):
        anc = np.nonzero(subset[:, j])[0]
        for m in range(1, N2 + 1):
            f[j, m] = f[j, m - 1]
            if (j, m - 1) in choice:
                choice[j, m] = choice[j, m - 1]
            for v in range(1, m + 1):
                t = (T1[anc, j] + 4.0 * (v - 1) * (P[j] - P[anc]) / (bw2 * v) / N1) / v
                cand = np.maximum(f[anc, m - v], t)
                a = int(np.argmin(cand))
                if cand[a] < f[j, m]:
                    f[j, m] = float(cand[a])
                    choice[j, m] = (int(anc[a]), v)
    return f, choice
