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
from collections.abc import Callable

from pipeplan.costmodels.comm import p2p_time_s
from pipeplan.planner.dp import LinkArg, Partition, link_fn, partition_dp
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


def _memory_table(problem, stages, memory_bytes_per_layer):
    if memory_bytes_per_layer is None:
        row = [p + a for p, a in zip(problem.param_bytes, problem.saved_bytes)]
        return [row] * stages
    if memory_bytes_per_layer and isinstance(memory_bytes_per_layer[0], (list, tuple)):
        return [list(r) for r in memory_bytes_per_layer]
    return [list(memory_bytes_per_layer)] * stages


def partition_ilp(problem: Problem, stages: int, *, link: LinkArg, device_speed: list[float] | None = None,
                  capacity_bytes: list[int] | int | None = None, memory_bytes_per_layer=None,
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


def _partition_ilp(pulp, problem, stages, *, link, device_speed, capacity_bytes, memory_bytes_per_layer,
                   time_limit_s, warm_start, threads, comm) -> Partition:
    t0 = time.perf_counter()
    n, K = problem.n, stages
    if K < 1:
        raise ValueError("stages must be >= 1")
    if n < K:
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason=f"{n} layers cannot fill {K} stages")
    fn = link_fn(link)
    speed = list(device_speed) if device_speed is not None else [1.0] * K
    if len(speed) != K or any(s <= 0 for s in speed):
        raise ValueError("device_speed needs one positive entry per stage")
    comp = problem.compute_s
    cons = _consumers(problem)

    # An upper bound UB (warm start, else the DP on the topological order, which is
    # feasible here) fixes most variables: with T <= UB, node v's ancestors (and v)
    # fit only in stages 0..stage(v), its descendants only in stage(v)..K-1.
    ub_part = warm_start if warm_start is not None and warm_start.assignment else None
    if ub_part is None and capacity_bytes is None:
        ub_part = partition_dp(problem, K, link=link, comm=comm)
        if ub_part.solver["status"] == "infeasible":
            ub_part = None
    ub = max(dag_stage_times(problem, ub_part.assignment, K, link=link, device_speed=speed, comm=comm)) if ub_part else None
    lo_st, hi_st = _stage_windows(problem, K, speed, ub)

    prob = pulp.LpProblem("pipeplan_partition", pulp.LpMinimize)
    T = pulp.LpVariable("T", lowBound=0, upBound=ub * (1 + 1e-9) if ub else None)
    w = {(v, s): pulp.LpVariable(f"w_{v}_{s}", cat="Binary")
         for v in range(n) for s in range(K - 1) if lo_st[v] <= s < hi_st[v]}

    def W(v, s):
        if s < lo_st[v]:
            return 0
        if s >= hi_st[v]:
            return 1
        return w[v, s]

    def X(v, s):
        return W(v, s) - W(v, s - 1)

    def add(constraint_lhs, constraint_rhs):  # lhs <= rhs, skipping constant pairs
        if isinstance(constraint_lhs, int) and isinstance(constraint_rhs, int):
            return
        prob.addConstraint(constraint_lhs <= constraint_rhs)

    prob += T
    for v in range(n):
        for s in range(K - 2):
            add(W(v, s), W(v, s + 1))
    for u, d, _ in problem.edges:
        for s in range(K - 1):
            add(W(d, s), W(u, s))
    # stage s non-empty: some node has stage <= s and not <= s-1
    for s in range(K):
        prob += pulp.lpSum(X(v, s) for v in range(n)) >= 1
    c: dict[tuple[int, int], object] = {}
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
    lat = {s: pulp.LpVariable(f"l_{s}", lowBound=0, upBound=1) for s in range(K - 1)}
    by_boundary: dict[int, list] = {s: [] for s in range(K - 1)}
    for (u, s), var in c.items():
        by_boundary[s].append((u, var))
        prob += lat[s] >= var
    comm_s = {}
    for s in range(K - 1):
        lk = fn(s)
        comm_s[s] = pulp.lpSum((cons[u][1] / lk.bandwidth_bytes_per_s) * var for u, var in by_boundary[s]) \
            + lk.latency_s * lat[s]
    total = sum(comp)
    for s in range(K):
        expr = pulp.lpSum((comp[v] / speed[s]) * X(v, s) for v in range(n))
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
    if capacity_bytes is not None:
        caps = capacity_bytes if isinstance(capacity_bytes, (list, tuple)) else [capacity_bytes] * K
        mem = _memory_table(problem, K, memory_bytes_per_layer)
        for s in range(K):
            prob += pulp.lpSum(mem[s][v] * X(v, s) for v in range(n)) <= caps[s]

    if ub_part is not None:
        a = ub_part.assignment
        for (v, s), var in w.items():
            var.setInitialValue(1 if a[v] <= s else 0)
        T.setInitialValue(ub)
        for (u, s), var in c.items():
            var.setInitialValue(1 if a[u] <= s < max(a[v] for v in cons[u][0]) else 0)
        for s, var in lat.items():
            var.setInitialValue(1 if any(a[u] <= s < max(a[v] for v in cons[u][0]) for (u, ss) in c if ss == s) else 0)

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))),
                                   warmStart=ub_part is not None, threads=threads, logPath=log)
        prob.solve(solver)
        log_text = open(log).read() if os.path.exists(log) else ""

    status = pulp.LpStatus.get(prob.status, str(prob.status))
    if prob.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionUnbounded) or status == "Infeasible":
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason="no assignment fits the memory caps")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return _result([], [], K, "infeasible", math.inf, math.inf, t0, reason=f"no solution found ({status})")
    assignment = []
    for v in range(n):
        st = K - 1
        for s in range(K - 1):
            ws = W(v, s)
            if (ws if isinstance(ws, int) else (ws.value() or 0)) > 0.5:
                st = s
                break
        assignment.append(st)
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


def _result(assignment, times, K, status, objective, bound, t0, reason=None) -> Partition:
    gap = None
    if status in ("optimal", "feasible") and objective > 0:
        gap = max(0.0, (objective - bound) / objective)
    solver = {"name": "ilp", "status": status, "objective": objective, "bound": bound, "gap": gap,
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
