"""DAG partitioning as a mixed-integer program (PuLP + its bundled CBC).

The DP cuts one topological order into contiguous pieces; on a DAG with real
branches (Inception, NASNet, multi-tower models) a better pipeline may put two
parallel branches in different stages in a way no single order's prefix can.
The ILP assigns each node to a stage directly:

  w[v,s] = 1 iff stage(v) <= s      (cumulative form: w[v,s] <= w[v,s+1])
  x[v,s] = w[v,s] - w[v,s-1]        (v is in stage s)
  edge u->v:   w[v,s] <= w[u,s]     (precedence: stage(u) <= stage(v))
  every stage holds at least one node
  c[u,s] >= w[u,s] - w[v,s]  for each consumer v of u   (u's output crosses boundary s)
  l[s]   >= c[u,s]                                     (boundary s carries a message)
  comm(s) = sum_u c[u,s] bytes_u/bw_s + l[s] lat_s     (p2p time over boundary s)
  T >= sum_v (fwd+bwd)_v x[v,s] / speed[s] + comm(s-1) + comm(s)
  sum_v mem[s][v] x[v,s] <= capacity[s]
  minimise T

The cumulative variables make precedence a single inequality per edge and stage
(much tighter LP relaxation than sum_s s*x). Communication is the DP's: every
tensor live across a boundary is sent over it (a skip over three stages is paid
on each of the three links) as activation forward (charged to the stage before
the boundary) and as gradient backward (charged to the stage after), one
latency per boundary that carries anything. bytes_u is the largest edge out of
u (a node's output is one tensor). For a contiguous assignment the objective is
exactly the DP's, so the ILP is never worse than the DP, and equal on chains.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Union, cast

from pipeplan.costmodels.comm import p2p_time_s
from pipeplan.hardware_profiles.profile import Link
from pipeplan.planner.dp import LinkArg, Partition, SolverInfo, link_fn, partition_dp
from pipeplan.planner.problem import Problem


def _consumers(problem: Problem) -> dict[int, tuple[list[int], int]]:
    out: dict[int, tuple[list[int], int]] = {}
    for s, d, nbytes in problem.edges:
        cons, b = out.get(s, ([], 0))
        if d not in cons:
            cons.append(d)
        out[s] = (cons, max(b, int(nbytes)))
    return out


def dag_stage_times(problem: Problem, assignment: list[int], stages: int, *, link: LinkArg,
                    device_speed: list[float] | None = None, comm: str = "sum") -> list[float]:
    """The ILP's objective terms for a given assignment (reference for brute force and tests).

    comm="sum": compute + boundary sends; "overlap": max(compute, each boundary's send).
    """
    fn = link_fn(link)
    speed = device_speed or [1.0] * stages
    comp = problem.compute_s
    t = [0.0] * stages
    for v, s in enumerate(assignment):
        t[s] += comp[v] / speed[s]
    crossing = [0] * max(stages - 1, 0)
    for u, (cons, nbytes) in _consumers(problem).items():
        last = max(assignment[v] for v in cons)
        for b in range(assignment[u], last):
            crossing[b] += nbytes
    for b, nbytes in enumerate(crossing):
        cost = p2p_time_s(nbytes, fn(b))
        if comm == "sum":
            t[b] += cost
            t[b + 1] += cost
        else:
            t[b] = max(t[b], cost)
            t[b + 1] = max(t[b + 1], cost)
    return t


def _stage_windows(problem: Problem, K: int, speed: list[float], ub: float | None) -> tuple[list[int], list[int]]:
    """[lo, hi] stage range of each node under T <= ub (compute only; sends only add time)."""
    n = problem.n
    if ub is None:
        return [0] * n, [K - 1] * n
    comp = problem.compute_s
    children: list[list[int]] = [[] for _ in range(n)]
    parents: list[list[int]] = [[] for _ in range(n)]
    for a, b, _ in problem.edges:
        children[a].append(b)
        parents[b].append(a)
    anc = [0] * n
    for v in range(n):
        for p in parents[v]:
            anc[v] |= anc[p] | (1 << p)
    desc = [0] * n
    for v in range(n - 1, -1, -1):
        for ch in children[v]:
            desc[v] |= desc[ch] | (1 << ch)

    def weight(bits: int, v: int) -> float:
        return comp[v] + sum(comp[i] for i in range(n) if (bits >> i) & 1)

    cap = [ub * sp * (1 + 1e-9) for sp in speed]
    lo, hi = [], []
    for v in range(n):
        need, total, st = weight(anc[v], v), 0.0, 0
        while st < K - 1 and total + cap[st] < need:
            total += cap[st]
            st += 1
        lo.append(st)
        need, total, st = weight(desc[v], v), 0.0, K - 1
        while st > 0 and total + cap[st] < need:
            total += cap[st]
            st -= 1
        hi.append(max(st, lo[-1]))
    return lo, hi


MemoryTable = Union[Sequence[float], Sequence[Sequence[float]]]
"""Per-layer memory bytes: one list for every stage, or one list per stage."""

LpTerm = Any
"""A PuLP variable or linear expression: PuLP ships no type hints (mypy: ignore_missing_imports), so they are Any."""


def _memory_table(problem: Problem, stages: int, memory_bytes_per_layer: MemoryTable | None) -> list[list[float]]:
    """Per stage, per layer: the bytes a layer costs in that stage (see partition_ilp)."""
    if memory_bytes_per_layer is None:
        row: list[float] = [p + a for p, a in zip(problem.param_bytes, problem.saved_bytes, strict=True)]
        return [row] * stages
    if memory_bytes_per_layer and isinstance(memory_bytes_per_layer[0], (list, tuple)):
        # the first entry says which form it is; the casts record what that check established
        return [list(r) for r in cast(Sequence[Sequence[float]], memory_bytes_per_layer)]
    return [list(cast(Sequence[float], memory_bytes_per_layer))] * stages


def partition_ilp(problem: Problem, stages: int, *, link: LinkArg, device_speed: list[float] | None = None,
                  capacity_bytes: list[int] | int | None = None, memory_bytes_per_layer: MemoryTable | None = None,
                  time_limit_s: float = 30.0, warm_start: Partition | None = None, threads: int = 1,
                  comm: str = "sum") -> Partition:
    """Min-bottleneck assignment of DAG nodes to `stages` stages (see module docstring).

    memory_bytes_per_layer: per-layer bytes (one list) or per stage x per layer
    (lists; the in-flight count differs by stage); default param + saved bytes.
    comm: "sum" (compute + sends, the DP's default) or "overlap" (max of compute
    and each boundary's send). Returns status "optimal", "feasible" (time limit
    hit: best plan, with bound and gap) or "infeasible".
    """
    import warnings

    import pulp

    with warnings.catch_warnings():
        # PuLP 3.x deprecates LpVariable(...) and PULP_CBC_CMD in favour of 4.0 APIs that
        # its bundled CBC does not have yet; the calls below work on PuLP 2.7 to 3.x.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _partition_ilp(pulp, problem, stages, link=link, device_speed=device_speed,
                              capacity_bytes=capacity_bytes, memory_bytes_per_layer=memory_bytes_per_layer,
                              time_limit_s=time_limit_s, warm_start=warm_start, threads=threads, comm=comm)


def _partition_ilp(pulp: ModuleType, problem: Problem, stages: int, *, link: LinkArg,
                   device_speed: list[float] | None, capacity_bytes: list[int] | int | None,
                   memory_bytes_per_layer: MemoryTable | None, time_limit_s: float, warm_start: Partition | None,
                   threads: int, comm: str) -> Partition:
    """Build the model (variables, then constraints in a fixed order: CBC's path, and so which of
    several optimal assignments it returns, depends on it), warm-start it, solve, read it back."""
    t0 = time.perf_counter()
    n, K = problem.n, stages
    if K < 1:
        raise ValueError("stages must be >= 1")
    if n < K:
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason=f"{n} layers cannot fill {K} stages")
    speed = list(device_speed) if device_speed is not None else [1.0] * K
    if len(speed) != K or any(s <= 0 for s in speed):
        raise ValueError("device_speed needs one positive entry per stage")
    cons = _consumers(problem)
    upper = _upper_bound(problem, K, link=link, speed=speed, capacity_bytes=capacity_bytes, warm_start=warm_start,
                         comm=comm)
    ub = upper[1] if upper is not None else None
    model = _Model(pulp, n, K, _stage_windows(problem, K, speed, ub), ub)
    _add_precedence(model, problem)
    comm_s = _add_communication(model, cons, link_fn(link))
    _add_stage_times(model, problem.compute_s, speed, comm_s, comm)
    if capacity_bytes is not None:
        caps = capacity_bytes if isinstance(capacity_bytes, (list, tuple)) else [capacity_bytes] * K
        _add_memory_caps(model, caps, _memory_table(problem, K, memory_bytes_per_layer))
    if upper is not None:
        _set_warm_start(model, upper[0], upper[1], cons)
    log_text = _run_cbc(model, time_limit_s, threads, warm=upper is not None)
    return _read_solution(model, problem, link=link, speed=speed, comm=comm, log_text=log_text, t0=t0)


def _upper_bound(problem: Problem, K: int, *, link: LinkArg, speed: list[float], capacity_bytes: list[int] | int | None,
                 warm_start: Partition | None, comm: str) -> tuple[list[int], float] | None:
    """A known assignment and its objective UB: the warm start, else (no memory caps) the DP on the
    topological order, which is feasible then. With T <= UB most variables are fixed: node v's
    ancestors (and v) fit only in stages 0..stage(v), its descendants only in stage(v)..K-1."""
    ub_part = warm_start if warm_start is not None and warm_start.assignment else None
    if ub_part is None and capacity_bytes is None:
        ub_part = partition_dp(problem, K, link=link, comm=comm)
        if ub_part.solver["status"] == "infeasible":
            ub_part = None
    if ub_part is None:
        return None
    times = dag_stage_times(problem, ub_part.assignment, K, link=link, device_speed=speed, comm=comm)
    return ub_part.assignment, max(times)


class _Model:
    """The MIP being built: the objective T and the cumulative assignment w (module docstring).

    Only w[v, s] inside node v's stage window [lo, hi) are variables: below it
    W(v, s) is the constant 0 (v cannot be in stages 0..s), from hi on the
    constant 1, which keeps the model small and lets constraints between
    constants be dropped.
    """

    def __init__(self, pulp: ModuleType, n: int, K: int, windows: tuple[list[int], list[int]],
                 ub: float | None) -> None:
        self.pulp = pulp
        self.n, self.K = n, K
        self.lo_st, self.hi_st = windows
        self.prob: LpTerm = pulp.LpProblem("pipeplan_partition", pulp.LpMinimize)
        self.T: LpTerm = pulp.LpVariable("T", lowBound=0, upBound=ub * (1 + 1e-9) if ub else None)
        self.w: dict[tuple[int, int], LpTerm] = {
            (v, s): pulp.LpVariable(f"w_{v}_{s}", cat="Binary")
            for v in range(n) for s in range(K - 1) if self.lo_st[v] <= s < self.hi_st[v]}
        self.c: dict[tuple[int, int], LpTerm] = {}  # c[u, s]: u's output crosses boundary s
        self.lat: dict[int, LpTerm] = {}  # lat[s]: boundary s carries a message
        self.prob += self.T

    def W(self, v: int, s: int) -> int | LpTerm:
        """1 iff stage(v) <= s: a constant outside v's window."""
        if s < self.lo_st[v]:
            return 0
        if s >= self.hi_st[v]:
            return 1
        return self.w[v, s]

    def X(self, v: int, s: int) -> int | LpTerm:
        """1 iff v is in stage s."""
        return self.W(v, s) - self.W(v, s - 1)

    def add_le(self, lhs: int | LpTerm, rhs: int | LpTerm) -> None:
        """lhs <= rhs, skipped when both are constants (the windows already imply it)."""
        if isinstance(lhs, int) and isinstance(rhs, int):
            return
        self.prob.addConstraint(lhs <= rhs)

    def assignment(self) -> list[int]:
        """Each node's stage in the solved model: the first s with w[v, s] = 1 (K-1 if none)."""
        out = []
        for v in range(self.n):
            st = self.K - 1
            for s in range(self.K - 1):
                ws = self.W(v, s)
                if (ws if isinstance(ws, int) else (ws.value() or 0)) > 0.5:
                    st = s
                    break
            out.append(st)
        return out


def _add_precedence(model: _Model, problem: Problem) -> None:
    """w is cumulative in s, edges go forward (stage(u) <= stage(v)), and no stage is empty."""
    K, n, W = model.K, model.n, model.W
    for v in range(n):
        for s in range(K - 2):
            model.add_le(W(v, s), W(v, s + 1))
    for u, d, _ in problem.edges:
        for s in range(K - 1):
            model.add_le(W(d, s), W(u, s))
    # stage s non-empty: some node has stage <= s and not <= s-1
    for s in range(K):
        model.prob += model.pulp.lpSum(model.X(v, s) for v in range(n)) >= 1


def _add_communication(model: _Model, cons: dict[int, tuple[list[int], int]],
                       fn: Callable[[int], Link]) -> dict[int, LpTerm]:
    """The crossing variables c and latency indicators l; returns comm(s), boundary s's p2p time."""
    pulp, prob, K, W = model.pulp, model.prob, model.K, model.W
    c = model.c
    for u, (consumers, nbytes) in cons.items():
        if nbytes <= 0:
            continue
        for s in range(K - 1):
            diffs = [W(u, s) - W(v, s) for v in consumers]
            if all(isinstance(d, int) and d <= 0 for d in diffs):
                continue  # never crosses this boundary
            c[u, s] = pulp.LpVariable(f"c_{u}_{s}", lowBound=0, upBound=1)
            for d in diffs:
                if not (isinstance(d, int) and d <= 0):
                    prob += c[u, s] >= d
    lat = model.lat
    lat.update({s: pulp.LpVariable(f"l_{s}", lowBound=0, upBound=1) for s in range(K - 1)})
    by_boundary: dict[int, list[tuple[int, LpTerm]]] = {s: [] for s in range(K - 1)}
    for (u, s), var in c.items():
        by_boundary[s].append((u, var))
        prob += lat[s] >= var
    comm_s = {}
    for s in range(K - 1):
        lk = fn(s)
        comm_s[s] = pulp.lpSum((cons[u][1] / lk.bandwidth_bytes_per_s) * var for u, var in by_boundary[s]) \
            + lk.latency_s * lat[s]
    return comm_s


def _add_stage_times(model: _Model, comp: Sequence[float], speed: list[float], comm_s: dict[int, LpTerm],
                     comm: str) -> None:
    """T >= each stage's time (compute + sends, or each separately for comm="overlap"), and two valid
    cuts (the slowest node, the average load) that tighten the LP bound."""
    pulp, prob, K, n, T = model.pulp, model.prob, model.K, model.n, model.T
    total = sum(comp)
    for s in range(K):
        expr = pulp.lpSum((comp[v] / speed[s]) * model.X(v, s) for v in range(n))
        if comm == "sum":
            if s > 0:
                expr += comm_s[s - 1]
            if s < K - 1:
                expr += comm_s[s]
        elif s < K - 1:
            prob += T >= comm_s[s]
        prob += T >= expr
    prob += T >= max(comp) / max(speed)  # valid cuts that tighten the LP bound
    prob += T >= total / sum(speed)


def _add_memory_caps(model: _Model, caps: Sequence[int], mem: list[list[float]]) -> None:
    """Each stage's layers fit its capacity."""
    for s in range(model.K):
        model.prob += model.pulp.lpSum(mem[s][v] * model.X(v, s) for v in range(model.n)) <= caps[s]


def _set_warm_start(model: _Model, a: list[int], ub: float, cons: dict[int, tuple[list[int], int]]) -> None:
    """Start CBC from the known assignment `a` (objective ub): every variable set to its value there."""
    for (v, s), var in model.w.items():
        var.setInitialValue(1 if a[v] <= s else 0)
    model.T.setInitialValue(ub)
    for (u, s), var in model.c.items():
        var.setInitialValue(1 if a[u] <= s < max(a[v] for v in cons[u][0]) else 0)
    for s, var in model.lat.items():
        var.setInitialValue(1 if any(a[u] <= s < max(a[v] for v in cons[u][0])
                                     for (u, ss) in model.c if ss == s) else 0)


def _run_cbc(model: _Model, time_limit_s: float, threads: int, *, warm: bool) -> str:
    """Solve with the bundled CBC; returns its log, which says whether it stopped on time and its bound."""
    pulp = model.pulp
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))),
                                   warmStart=warm, threads=threads, logPath=log)
        model.prob.solve(solver)
        if not os.path.exists(log):
            return ""
        with open(log) as fh:
            return fh.read()


def _read_solution(model: _Model, problem: Problem, *, link: LinkArg, speed: list[float], comm: str, log_text: str,
                   t0: float) -> Partition:
    """The solved model as a Partition: its assignment priced by dag_stage_times, "optimal" only when
    CBC proved it (not stopped on time), else "feasible" with the bound from CBC's log."""
    pulp, prob, K = model.pulp, model.prob, model.K
    status = pulp.LpStatus.get(prob.status, str(prob.status))
    if prob.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionUnbounded) or status == "Infeasible":
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason="no assignment fits the memory caps")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason=f"no solution found ({status})")
    assignment = model.assignment()
    times = dag_stage_times(problem, assignment, K, link=link, device_speed=speed, comm=comm)
    objective = max(times)
    optimal = prob.sol_status == pulp.LpSolutionOptimal and "Stopped on time" not in log_text
    bound = objective if optimal else _parse_bound(log_text, objective)
    return _result(assignment, times, K, "optimal" if optimal else "feasible", objective, bound, t0)


def _parse_bound(log: str, objective: float) -> float:
    """CBC prints 'Lower bound: x' (or 'best possible x') when it stops early."""
    for pattern in (r"Lower bound:\s*([-+0-9.eE]+)", r"best possible\s*([-+0-9.eE]+)"):
        found = re.findall(pattern, log)
        if found:
            try:
                return min(float(found[-1]), objective)
            except ValueError:
                pass
    return 0.0


def _result(assignment: list[int], times: list[float], K: int, status: str, objective: float, bound: float,
            t0: float, reason: str | None = None) -> Partition:
    gap = None
    if status in ("optimal", "feasible") and objective > 0:
        gap = max(0.0, (objective - bound) / objective)
    solver: SolverInfo = {"name": "ilp", "status": status, "objective": objective, "bound": bound, "gap": gap,
                          "time_s": time.perf_counter() - t0}
    if reason:
        solver["reason"] = reason
    return Partition(assignment=assignment, bottleneck_s=objective, stage_s=list(times), replicas=[1] * K,
                     solver=solver)


def has_parallel_branches(problem: Problem, *, min_compute_fraction: float = 0.0) -> bool:
    """True when two nodes with compute are incomparable (neither reaches the other).

    Residual networks have skip edges but no such pairs (the skip is a single
    tensor, the branch is the block), so their topological order loses nothing;
    Inception-style branches do have them, and there the ILP can beat the DP.
    """
    n = problem.n
    comp = problem.compute_s
    total = sum(comp) or 1.0
    heavy = [comp[i] > min_compute_fraction * total for i in range(n)]
    succ = [0] * n  # bitset of descendants
    children: list[list[int]] = [[] for _ in range(n)]
    for s, d, _ in problem.edges:
        children[s].append(d)
    for v in range(n - 1, -1, -1):
        bits = 0
        for c in children[v]:
            bits |= succ[c] | (1 << c)
        succ[v] = bits
    heavy_bits = sum(1 << i for i in range(n) if heavy[i])
    for v in range(n):
        if not heavy[v]:
            continue
        later = heavy_bits >> (v + 1) << (v + 1)
        if later & ~succ[v]:
            return True
    return False


def choose_solver(problem: Problem, *, max_ilp_nodes: int = 300) -> str:
    """--solver auto: "dp" for chains and branch-free DAGs (the DP is optimal there
    and fast), "ilp" when parallel branches exist and the DAG is small enough for
    CBC to prove optimality within the default time limit."""
    if problem.is_chain() or problem.n > max_ilp_nodes:
        return "dp"
    return "ilp" if has_parallel_branches(problem, min_compute_fraction=0.01) else "dp"


def solve(problem: Problem, stages: int, *, link: LinkArg, solver: str = "auto", time_limit_s: float = 30.0,
          memory_bytes: Callable[[int, int, int], int] | None = None, capacity_bytes: int | None = None) -> Partition:
    """DP, ILP or auto; the ILP is warm-started from the DP partition (a valid DAG assignment)."""
    kind = choose_solver(problem) if solver == "auto" else solver
    dp = partition_dp(problem, stages, link=link, memory_bytes=memory_bytes, capacity_bytes=capacity_bytes)
    if kind == "dp":
        return dp
    if kind != "ilp":
        raise ValueError(f"unknown solver {solver!r}")
    if memory_bytes is not None and capacity_bytes is not None:
        return dp  # the ILP's memory model is per-layer linear; keep the exact DP check
    ilp = partition_ilp(problem, stages, link=link, time_limit_s=time_limit_s,
                        warm_start=dp if dp.solver["status"] != "infeasible" else None)
    if ilp.solver["status"] == "infeasible" or ilp.bottleneck_s > dp.bottleneck_s:
        return dp
    return ilp
