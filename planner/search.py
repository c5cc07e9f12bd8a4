"""Automatic search: the fastest pipeline configuration that fits, and how it compares.

Given N devices and a global batch, enumerate stages K, data-parallel replicas d
(K*d <= N), microbatches M (divisors of the per-replica batch), schedule (gpipe,
1f1b, interleaved with v chunks, pipedream) and recomputation; partition each
with the DP (`planner/dp.py`) under the memory cap, predict the candidate
partitions with `evaluate` (cost models + event simulation; see `candidates`)
and keep the best by samples/s.

Pruning keeps it to seconds: before partitioning a configuration, an upper
bound on its throughput (every device busy all the time, none faster than its
largest layer: B / (M * max(total per-microbatch work / P, largest layer))) is
compared with the best plan so far, and after partitioning the bound is
tightened with the partition's busiest device before simulating. Neither bound
can discard a configuration that would have beaten the best, so pruning changes
the work, not the answer; the runners-up are the best of the configurations
that were evaluated. Configurations that cannot fit are recognised without the
DP (model state spread evenly; a greedy packing under the memory model), and
partitions are cached across configurations with the same microbatch size,
memory signature and links.

"auto" schedules are the synchronous ones (gpipe, 1f1b, interleaved): async
PipeDream changes the training semantics (stale weights), so it is planned
only when asked for ("pipedream", or "all").
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import (
    OPTIMIZERS,
    activation_bytes,
    inflight_microbatches,
    model_state_bytes,
    stashed_weight_versions,
)
from pipeplan.errors import InfeasibleError, UserError
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.baselines import equal_layers, torchgpipe_balance_by_time
from pipeplan.planner.dp import stage_costs
from pipeplan.planner.dp import COMM_MODES, Partition, assignment_bounds, boundary_links, partition_dp
from pipeplan.planner.evaluate import GIB, evaluate, place, predict, simulate_plan  # noqa: F401 (re-exported API)
from pipeplan.planner.plan import SCHEDULES, Plan
from pipeplan.planner.problem import Problem, build_problem

SEARCH_SCHEDULES = ("auto", "all", *SCHEDULES)
AUTO_SCHEDULES = ("1f1b", "gpipe", "interleaved")
SOLVERS = ("auto", "dp", "ilp")
# Chunks per device tried by the interleaved schedule: the bubble shrinks as 1/v while
# communication grows with v (Megatron-LM §2.2.2), so doubling steps cover the trade-off.
CHUNK_CHOICES = (2, 4, 8)
TOP = 5


@dataclass
class SearchResult:
    best: Plan
    alternatives: list[Plan]  # runners-up, best first (distinct configurations)
    baseline: Plan | None  # equal layers per stage, same K/d/M/schedule/recompute as best
    evaluated: int  # configurations partitioned and predicted
    pruned: int = 0  # configurations skipped by the throughput bound
    infeasible: int = 0  # configurations with no partition that fits
    time_s: float = 0.0


@dataclass(frozen=True)
class Config:
    schedule: str
    stages: int  # pipeline devices P (virtual stages = P * chunks)
    data_parallel: int  # replicas (per stage for pipedream)
    microbatches: int
    chunks: int
    recompute: bool
    stage_replicas: tuple[int, ...] = ()  # pipedream optimizer's per-stage replicas (else data_parallel each)

    def replicas(self):
        return list(self.stage_replicas) if self.stage_replicas else self.data_parallel

    def describe(self) -> str:
        def n(x: int, what: str) -> str:
            return f"{x} {what}{'' if x == 1 else 's'}"

        if self.stage_replicas:
            return (f"{n(self.stages, 'stage')} with replicas {list(self.stage_replicas)}, "
                    f"{self.microbatches} microbatches, pipedream")

        rc = ", recomputation" if self.recompute else ""
        v = f" x {n(self.chunks, 'chunk')}" if self.chunks > 1 else ""
        return (f"{n(self.stages, 'stage')}{v} x {n(self.data_parallel, 'replica')}, "
                f"{n(self.microbatches, 'microbatch')}".replace("microbatchs", "microbatches") + f", {self.schedule}{rc}")


@dataclass
class _Overflow:
    need_bytes: int = 0
    stage: int = 0
    config: Config | None = None


def _divisors(x: int) -> list[int]:
    small = [i for i in range(1, int(math.isqrt(x)) + 1) if x % i == 0]
    return sorted(set(small + [x // i for i in small]))


def _check_options(devices, batch_size, schedule, stages, microbatches, solver, dtype, optimizer, recompute, n_layers):
    if devices < 1:
        raise UserError(f"--devices must be at least 1, got {devices}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if schedule not in SEARCH_SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SEARCH_SCHEDULES)}")
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}", f"use one of {', '.join(SOLVERS)}")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if recompute not in ("auto", "on", "off", True, False):
        raise UserError(f"unknown recompute setting {recompute!r}", "use auto, on or off")
    if stages is not None and not 1 <= stages <= devices:
        raise UserError(f"--stages {stages} must be between 1 and the {devices} devices")
    if stages is not None and stages > n_layers:
        raise UserError(f"--stages {stages} exceeds the graph's {n_layers} layers", "trace with a larger --depth or use fewer stages")
    if microbatches is not None and (microbatches < 1 or batch_size % microbatches):
        raise UserError(f"--microbatches {microbatches} does not divide the batch size {batch_size}",
                        "pick a microbatch count that divides the batch")


def _worst_link(profile: HardwareProfile, pairs):
    """The slowest of the links between rank pairs (synchronous replicas wait for the slowest)."""
    links = {profile.link_between(a, b) for a, b in pairs}
    return min(links, key=lambda lk: (lk.bandwidth_bytes_per_s, -lk.latency_s))


def min_bottleneck(compute_s, stages: int) -> float:
    """Smallest possible slowest-stage compute of a contiguous split (no sends, no memory caps).

    Greedy packing decides "fits in T?" exactly for sums; bisection on T to 1e-9 relative,
    returning a value never above the true optimum (it is used as a lower bound).
    """
    prefix = list(itertools.accumulate(compute_s, initial=0.0))
    n = len(compute_s)
    if stages >= n:
        return max(compute_s, default=0.0)

    def fits(T: float) -> bool:
        a = 0
        for _ in range(stages):
            a = bisect.bisect_right(prefix, prefix[a] + T) - 1
            if a >= n:
                return True
        return a >= n

    lo, hi = max(max(compute_s), prefix[-1] / stages), prefix[-1]
    if fits(lo):
        return lo
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


class StageMemoryModel:
    """`costmodels.memory.stage_memory` for layers [a, b) on a stage, fast enough for the DP's callbacks.

    The DP asks about thousands of layer ranges per configuration; the model is
    the same sum of terms as `stage_memory` (weights x stashed versions, grads +
    optimizer state, `activation_bytes` for the in-flight count, receive buffers)
    with the per-stage constants computed once. tests/test_search.py checks it
    equals `stage_memory`. Interleaved: a device holds v chunks; a chunk is
    admitted when a device made of v copies of it fits, so a device whose v
    chunks each pass holds at most the largest of those totals (weights and
    activations add up over chunks; receive buffers are shared).
    """

    def __init__(self, prob: Problem, cfg: Config, *, optimizer: str, dtype: str,
                 shared: list[tuple[int, list[int]]] = ()):
        P, n = cfg.stages, prob.n
        # Tied parameters: (bytes, sorted layer indices using it). A range holding a user
        # but not the owner (first user) keeps a copy, as `evaluate` charges it.
        self.shared = [(nbytes, users) for nbytes, users in shared if len(users) > 1]
        self.n, self.P = n, P
        self.ch = cfg.chunks if cfg.schedule == "interleaved" else 1
        self.recompute = cfg.recompute
        self.pp, self.sp = [0], [0]
        for i in range(n):
            self.pp.append(self.pp[-1] + prob.param_bytes[i])
            self.sp.append(self.sp[-1] + prob.saved_bytes[i])
        self.cut = prob.cut_bytes
        self.input = prob.input_bytes
        M = max(cfg.microbatches, P) if cfg.schedule == "pipedream" else cfg.microbatches
        self.inflight = [inflight_microbatches(cfg.schedule, P, p, M, self.ch) for p in range(P)]
        self.versions = [stashed_weight_versions(cfg.schedule, x) for x in self.inflight]
        self.receives = [cfg.schedule == "interleaved" or p < P - 1 for p in range(P)]
        unit = 4 * 2**20  # a whole number of parameters, so integer halving is exact
        st = model_state_bytes(unit, optimizer=optimizer, dtype=dtype)
        self.w_per_byte = st.weights_bytes / unit
        self.rest_per_byte = (st.grad_bytes + st.optimizer_bytes) / unit

    def device_total(self, p: int, params: int, saved: int, inb: int, outb: int) -> int:
        weights = math.ceil(self.w_per_byte * params) * self.versions[p]
        rest = math.ceil(self.rest_per_byte * params)
        acts = activation_bytes(saved_bytes_per_mb=saved, input_bytes_per_mb=inb, inflight=self.inflight[p],
                                recompute=self.recompute, chunks=self.ch)
        return weights + rest + acts + inb + (outb if self.receives[p] else 0)

    def __call__(self, s: int, a: int, b: int) -> int:
        ch = self.ch
        params = self.pp[b] - self.pp[a]
        for nbytes, users in self.shared:
            if users[0] < a and any(a <= u < b for u in users):
                params += nbytes
        return self.device_total(s % self.P, params * ch, (self.sp[b] - self.sp[a]) * ch,
                                 self.input if a == 0 else self.cut[a - 1], self.cut[b - 1] if b < self.n else 0)

    def greedy_fits(self, stages: int, capacity: int) -> bool:
        """Can [0, n) be cut into `stages` ranges that each fit? Greedy longest prefixes:
        exact when memory grows with a range (the DP's own assumption)."""
        a, n = 0, self.n
        for s in range(stages):
            last = n - (stages - 1 - s)  # leave a layer for every later stage
            if a >= last or self(s, a, a + 1) > capacity:
                return False
            b = a + 1
            if s == stages - 1:
                b = n
            else:
                while b < last and self(s, a, b + 1) <= capacity:
                    b += 1
            if self(s, a, b) > capacity:
                return False
            a = b
        return a == n

    def least_capacity(self, stages: int, start: int) -> int:
        """Smallest capacity the greedy can fit (to 0.1%): how far a configuration is from fitting."""
        lo, hi = start, max(start, 1) * 2
        while not self.greedy_fits(stages, hi):
            lo, hi = hi, hi * 2
        while hi - lo > max(1, hi // 1000):
            mid = (lo + hi) // 2
            if self.greedy_fits(stages, mid):
                hi = mid
            else:
                lo = mid
        return hi


class _Searcher:
    """State of one search: cached problems, the top list, counters, the least-overflowing failure."""

    def __init__(self, graph: Graph, profile: HardwareProfile, batch_size: int, *, dtype: str, optimizer: str,
                 times: str, top: int, heuristics: bool = True):
        from pipeplan.planner.evaluate import graph_summary

        self.heuristics = heuristics
        self.graph, self.profile, self.B = graph, profile, batch_size
        self.dtype, self.optimizer, self.times, self.top = dtype, optimizer, times, top
        self.cap = int(profile.usable_memory_bytes)
        self.n = len(graph.layers)
        self.summary = graph_summary(graph)
        index = {layer.name: i for i, layer in enumerate(graph.layers)}
        self.shared = [(int(sp.bytes), sorted(index[name] for name in sp.layers if name in index))
                       for sp in graph.shared_params]
        self._problems: dict[tuple[int, bool], Problem] = {}
        self.top_plans: list[tuple[float, int, Plan, Config, Partition]] = []
        self.evaluated = self.pruned = self.infeasible = 0
        # (bytes needed, how known: "state" lower bound / "greedy" estimate / "exact", config, layout)
        self.failures: list[tuple[int, str, Config, str]] = []
        self._memfns: dict = {}
        self._bottlenecks: dict = {}
        self._partitions: dict = {}

    # -- cached inputs -------------------------------------------------------
    def problem(self, mb: int, recompute: bool = False) -> Problem:
        key = (mb, recompute)
        if key not in self._problems:
            if recompute:
                base = self.problem(mb)
                from dataclasses import replace

                # The DP balances fwd+bwd; recomputation re-runs the forward before the backward.
                self._problems[key] = replace(base, bwd_s=tuple(b + f for f, b in zip(base.fwd_s, base.bwd_s)))
            else:
                self._problems[key] = build_problem(self.graph, self.profile, microbatch_size=mb, dtype=self.dtype,
                                                    times=self.times)
        return self._problems[key]

    def min_bottleneck(self, mb: int, recompute: bool, stages: int) -> float:
        key = (mb, recompute, stages)
        if key not in self._bottlenecks:
            self._bottlenecks[key] = min_bottleneck(self.problem(mb, recompute).compute_s, stages)
        return self._bottlenecks[key]

    def microbatch_size(self, cfg: Config) -> int:
        per = cfg.microbatches * (1 if cfg.schedule == "pipedream" else cfg.data_parallel)
        return self.B // per if self.B % per == 0 else 0

    def threshold(self) -> float:
        """Throughput a configuration must be able to beat to be worth partitioning: the best so far.

        Pruning against the best (not the last of the top list) keeps the best
        exact and makes the runners-up the best of what was evaluated."""
        return self.top_plans[0][0] if self.top_plans else 0.0

    # -- one configuration ---------------------------------------------------
    def link_fn(self, cfg: Config, layout: str):
        P, d = cfg.stages, cfg.data_parallel
        if cfg.schedule == "pipedream":
            return boundary_links(self.profile, d)
        per_device = place(P, d, layout)

        def fn(b: int):
            return _worst_link(self.profile, zip(per_device[b % P], per_device[(b + 1) % P]))

        return fn

    def memory_fn(self, cfg: Config, prob: Problem):
        key = (id(prob), cfg.schedule, cfg.stages, cfg.chunks, cfg.recompute, self.memory_signature(cfg))
        if key not in self._memfns:
            self._memfns[key] = StageMemoryModel(prob, cfg, optimizer=self.optimizer, dtype=self.dtype,
                                                 shared=self.shared)
        return self._memfns[key]

    def memory_signature(self, cfg: Config) -> tuple[int, ...]:
        """In-flight counts per device: the only way M enters the memory model."""
        M = max(cfg.microbatches, cfg.stages) if cfg.schedule == "pipedream" else cfg.microbatches
        return tuple(inflight_microbatches(cfg.schedule, cfg.stages, p, M, cfg.chunks) for p in range(cfg.stages))

    def state_lower_bound(self, cfg: Config, prob: Problem) -> int:
        """Model state no partition can avoid: the total spread evenly, and the largest layer's."""
        P = cfg.stages
        total = model_state_bytes(sum(prob.param_bytes), optimizer=self.optimizer, dtype=self.dtype).total_bytes
        one = model_state_bytes(max(prob.param_bytes, default=0), optimizer=self.optimizer, dtype=self.dtype).total_bytes
        return max(-(-total // P), one)

    def try_config(self, cfg: Config) -> None:
        mb = self.microbatch_size(cfg)
        if mb < 1:
            return
        P, v, d, M = cfg.stages, cfg.chunks, cfg.data_parallel, cfg.microbatches
        S = P * v
        prob = self.problem(mb, cfg.recompute)
        # Every device of a pipeline busy the whole iteration; without interleaving, no stage
        # lighter than the best memory-blind split of the chain (partitions only get worse).
        per_device = sum(prob.compute_s) / P
        if v == 1:
            per_device = max(per_device, self.min_bottleneck(mb, cfg.recompute, S))
        lb = M * per_device / (d if cfg.schedule == "pipedream" else 1)
        if lb > 0 and self.B / lb <= self.threshold():
            self.pruned += 1
            return
        need = self.state_lower_bound(cfg, prob)
        if need > self.cap:
            self.infeasible += 1
            self.failures.append((need, "state", cfg, "stage-major"))
            return
        layouts = ["stage-major"]
        if cfg.schedule != "pipedream" and d > 1 and P > 1 and P * d > self.profile.devices_per_node:
            layouts.append("pipeline-major")
        mem = self.memory_fn(cfg, prob)
        if not mem.greedy_fits(S, self.cap):
            self.infeasible += 1
            self.failures.append((-1, "greedy", cfg, "stage-major"))  # how far off: computed if nothing fits
            return
        for layout in layouts:
            links = self.link_fn(cfg, layout)
            seen: set[tuple[int, ...]] = set()
            for part in self.candidates(cfg, prob, mem, links, mb):
                if part.solver.get("status") == "infeasible":
                    self.infeasible += 1
                    over = part.solver.get("overflow_bytes")
                    if over is not None:
                        self.failures.append((self.cap + int(over), "exact", cfg, layout))
                    continue
                if tuple(part.assignment) not in seen:
                    seen.add(tuple(part.assignment))
                    self.consider(cfg, layout, part, mb)

    def candidates(self, cfg: Config, prob: Problem, mem, links, mb: int) -> list[Partition]:
        """Partitions worth simulating for one configuration.

        The DP is exact for its bottleneck objective, but the simulator also charges
        pipeline fill and drain and lets sends overlap compute, so the DP's optimum
        under either communication model (blocking sends, overlapped sends) is not
        always the simulator's best. Both DP optima are candidates, and (unless
        `heuristics` is off) so are the equal-layers and torchgpipe time-balanced
        splits, so a plan is never predicted slower than the naive split it is
        compared with. The simulator picks; predict() re-checks memory exactly.
        """
        S = cfg.stages * cfg.chunks
        out = []
        for comm in COMM_MODES:
            key = (mb, cfg.recompute, S, cfg.schedule, cfg.chunks, self.memory_signature(cfg),
                   tuple(links(b) for b in range(S - 1)), comm)
            if key not in self._partitions:
                self._partitions[key] = partition_dp(prob, S, link=links, memory_bytes=mem, capacity_bytes=self.cap,
                                                     comm=comm)
            out.append(self._partitions[key])
        if self.heuristics and 1 < S <= prob.n and not cfg.stage_replicas:
            heuristic = [("equal-layers", equal_layers(prob.n, S))]
            try:
                heuristic.append(("balance-by-time", torchgpipe_balance_by_time(list(prob.compute_s), S)))
            except ValueError:  # torchgpipe's heuristic can cycle or empty a stage; then it is no candidate
                pass
            for name, assignment in heuristic:
                stage_s = stage_costs(prob, assignment_bounds(assignment), links)
                out.append(Partition(assignment=assignment, bottleneck_s=max(stage_s), stage_s=stage_s,
                                     replicas=[1] * S, solver={"name": name, "status": "feasible"}))
        return out

    def consider(self, cfg: Config, layout: str, part: Partition, mb: int) -> Plan | None:
        P, v, d, M = cfg.stages, cfg.chunks, cfg.data_parallel, cfg.microbatches
        prob = self.problem(mb, cfg.recompute)
        busy = [0.0] * P
        for i, s in enumerate(part.assignment):
            busy[s % P] += prob.compute_s[i]
        if cfg.stage_replicas:
            busy = [busy[s] / cfg.stage_replicas[s] for s in range(P)]
        lb = M * max(busy) / (d if cfg.schedule == "pipedream" and not cfg.stage_replicas else 1)
        if lb > 0 and self.B / lb <= self.threshold():
            self.pruned += 1
            return None
        solver = dict(part.solver)
        solver["layout"] = layout
        plan, _ = predict(self.graph, self.profile, part.assignment, replicas=cfg.replicas(), schedule=cfg.schedule,
                          microbatches=M, batch_size=self.B, dtype=self.dtype, optimizer=self.optimizer,
                          recompute=cfg.recompute, times=self.times, chunks=v, layout=layout,
                          problem=self.problem(mb), solver=solver, summary=self.summary)
        self.evaluated += 1
        if not plan.predicted.fits:
            self.infeasible += 1
            self.failures.append((plan.predicted.peak_memory_bytes, "exact", cfg, layout))
            return None
        self.top_plans.append((plan.predicted.samples_per_s, -plan.predicted.peak_memory_bytes, plan, cfg, part))
        self.top_plans.sort(key=lambda t: (-t[0], -t[1]))
        del self.top_plans[self.top:]
        return plan


def pipedream_levels(profile: HardwareProfile, devices: int) -> list[tuple[int, Link]]:
    """The device hierarchy for PipeDream's optimizer: devices per node, then nodes."""
    per = profile.devices_per_node
    if devices <= per:
        return [(devices, profile.intra_node)]
    if devices % per == 0:
        return [(per, profile.intra_node), (devices // per, profile.inter_node)]
    return [(devices, profile.inter_node)]  # ragged: plan flat at the slower link


def _pipedream_optimizer(sr: "_Searcher", devices: int, M: int) -> None:
    """PipeDream's own optimizer (per-stage replication over the hierarchy) for one microbatch count."""
    from pipeplan.planner.pipedream import partition_pipedream

    if sr.B % M:
        return
    mb = sr.B // M
    prob = sr.problem(mb)
    part = partition_pipedream(prob, pipedream_levels(sr.profile, devices), memory_capacity_bytes=sr.cap)
    if not part.assignment:
        sr.infeasible += 1
        return
    S = max(part.assignment) + 1
    if M < S:
        return  # async: fewer than K microbatches only relabels the same steady state
    part.solver.pop("blocks", None)  # nested solver detail; the plan's stages say it
    cfg = Config("pipedream", S, max(part.replicas), M, 1, False, tuple(part.replicas))
    sr.consider(cfg, "stage-major", part, mb)


def _summary(plan: Plan) -> dict:
    """What `Plan.alternatives` keeps of a runner-up."""
    return {
        "schedule": plan.schedule,
        "stages": len(plan.stages) // plan.chunks,
        "chunks": plan.chunks,
        "data_parallel": plan.data_parallel,
        "replicas": [s.replicas for s in plan.stages],
        "devices": plan.devices,
        "microbatches": plan.microbatches,
        "microbatch_size": plan.microbatch_size,
        "recompute": plan.recompute,
        "layer_counts": [len(s.layers) for s in plan.stages],
        "layout": plan.solver.get("layout", "stage-major"),
        "iteration_s": plan.predicted.iteration_s,
        "samples_per_s": plan.predicted.samples_per_s,
        "bubble_fraction": plan.predicted.bubble_fraction,
        "peak_memory_bytes": plan.predicted.peak_memory_bytes,
    }


def search(graph: Graph, profile: HardwareProfile, devices: int, batch_size: int, *, schedule: str = "auto",
           stages: int | None = None, microbatches: int | None = None, solver: str = "auto", dtype: str = "fp32",
           optimizer: str = "adam", recompute: str | bool = "auto", times: str = "model",
           progress: Callable[[str, int, int], None] | None = None, data_parallel: int | None = None,
           chunks: int | None = None, top: int = TOP, ilp_time_limit_s: float = 10.0,
           heuristics: bool = True) -> SearchResult:
    """Best feasible plan (highest samples/s) over the configuration space; InfeasibleError when nothing fits.

    Fixed options (stages, microbatches, schedule, data_parallel, chunks) restrict
    the enumeration; `stages` counts pipeline devices (virtual stages for the
    interleaved schedule are stages x chunks). solver "dp" partitions every
    configuration with the DP; "ilp" and "auto" then re-partition the best
    configuration with the ILP warm-started from the DP ("auto" only when the
    graph has branches a single execution order could split better).
    """
    t0 = time.perf_counter()
    n = len(graph.layers)
    _check_options(devices, batch_size, schedule, stages, microbatches, solver, dtype, optimizer, recompute, n)
    if data_parallel is not None and (data_parallel < 1 or data_parallel * (stages or 1) > devices):
        raise UserError(f"--data-parallel {data_parallel} does not fit on {devices} devices")
    schedules = AUTO_SCHEDULES if schedule == "auto" else SCHEDULES if schedule == "all" else (schedule,)
    rc_opts = {"auto": (False, True), "on": (True,), "off": (False,), True: (True,), False: (False,)}[recompute]
    sr = _Searcher(graph, profile, batch_size, dtype=dtype, optimizer=optimizer, times=times, top=top,
                   heuristics=heuristics)
    if not any(sr.problem(1).compute_s):
        raise UserError(f"graph {graph.name!r} has no layer times under --times {times} (every layer takes 0 s)",
                        "use --times model, or trace the model to measure it")

    pairs = []
    for K in ([stages] if stages else range(1, min(devices, n) + 1)):
        for d in ([data_parallel] if data_parallel else range(1, devices // K + 1)):
            pairs.append((K, d))
    pairs.sort(key=lambda kd: (-kd[0] * kd[1], kd[0]))  # whole-machine configurations first: good plans early

    for step, (K, d) in enumerate(pairs):
        if progress:
            progress(f"{K} stages x {d} replicas", step, len(pairs))
        for sched in schedules:
            base = batch_size if sched == "pipedream" else batch_size // d if batch_size % d == 0 else 0
            if not base:
                continue
            for M in ([microbatches] if microbatches else _divisors(base)):
                if base % M:
                    continue
                if sched == "pipedream" and M < K and not microbatches:
                    continue  # async: fewer than K microbatches only relabels the same steady state
                if sched == "gpipe" and (K == 1 or M == 1) and schedule != "gpipe":
                    continue  # identical to 1f1b there (one stage or one microbatch)
                v_list = [1]
                if sched == "interleaved":
                    if K < 2 or M % K:
                        continue
                    v_list = [chunks] if chunks else list(CHUNK_CHOICES)
                    v_list = [v for v in v_list if v >= 2 and K * v <= n]
                for v in v_list:
                    for rc in rc_opts:
                        sr.try_config(Config(sched, K, d, M, v, rc))
    if "pipedream" in schedules and not stages and not data_parallel:
        for M in ([microbatches] if microbatches else _divisors(batch_size)):
            _pipedream_optimizer(sr, devices, M)
    if progress:
        progress("done", len(pairs), len(pairs))

    if not sr.top_plans:
        raise InfeasibleError(*_infeasible_message(sr, devices, batch_size, recompute, schedules))

    first = sr.top_plans[0][3]
    if not first.stage_replicas and (
            solver == "ilp" or (solver == "auto" and not sr.problem(sr.microbatch_size(first)).is_chain())):
        _refine_with_ilp(sr, time_limit_s=ilp_time_limit_s)

    _, _, best, cfg, part = sr.top_plans[0]
    alternatives = [t[2] for t in sr.top_plans[1:]]
    base_assign = equal_layers(n, cfg.stages * cfg.chunks)
    baseline, _ = predict(graph, profile, base_assign, replicas=cfg.replicas(), schedule=cfg.schedule,
                          microbatches=cfg.microbatches, batch_size=batch_size, dtype=dtype, optimizer=optimizer,
                          recompute=cfg.recompute, times=times, chunks=cfg.chunks,
                          layout=best.solver.get("layout", "stage-major"), problem=sr.problem(sr.microbatch_size(cfg)),
                          solver={"name": "equal-layers"}, summary=sr.summary)
    elapsed = time.perf_counter() - t0
    best.alternatives = [_summary(p) for p in alternatives]
    best.solver["search"] = {"evaluated": sr.evaluated, "pruned": sr.pruned, "infeasible": sr.infeasible,
                             "time_s": elapsed, "devices_available": devices}
    return SearchResult(best=best, alternatives=alternatives, baseline=baseline, evaluated=sr.evaluated,
                        pruned=sr.pruned, infeasible=sr.infeasible, time_s=elapsed)


def _refine_with_ilp(sr: _Searcher, *, time_limit_s: float) -> None:
    """Re-partition the best configuration with the ILP (DAG splits); keep it if it predicts faster."""
    try:
        from pipeplan.planner.ilp import partition_ilp
    except ImportError:
        return
    _, _, plan, cfg, part = sr.top_plans[0]
    mb = sr.microbatch_size(cfg)
    prob = sr.problem(mb, cfg.recompute)
    layout = plan.solver.get("layout", "stage-major")
    S = cfg.stages * cfg.chunks
    mem = sr.memory_fn(cfg, prob)
    ch = mem.ch
    # Additive per-layer bytes for the ILP (receive buffers left out; `consider` re-checks the whole).
    per_layer = [[mem.device_total(s % cfg.stages, prob.param_bytes[i] * ch, prob.saved_bytes[i] * ch, 0, 0)
                  for i in range(prob.n)] for s in range(S)]
    try:
        got = partition_ilp(prob, S, link=sr.link_fn(cfg, layout), capacity_bytes=sr.cap,
                            memory_bytes_per_layer=per_layer, time_limit_s=time_limit_s, warm_start=part)
    except Exception:  # the ILP is an improvement step; the DP plan stands without it
        return
    if got.solver.get("status") not in ("optimal", "feasible") or not got.assignment:
        return
    info = {k: got.solver.get(k) for k in ("status", "objective", "bound", "gap", "time_s")}
    if got.assignment == part.assignment:
        plan.solver["ilp"] = info
        return
    new = sr.consider(cfg, layout, got, mb)  # admitted into the top list if it fits; best first
    if new is not None:
        new.solver["warm_start"] = "dp"


def _infeasible_message(sr: _Searcher, devices: int, batch_size: int, recompute, schedules) -> tuple[str, str]:
    """One line saying by how much the least-overflowing configuration misses, and what would fit it."""
    cap, profile = sr.cap, sr.profile
    if not sr.failures:
        return (f"no pipeline configuration of {devices} devices and batch {batch_size} could be built",
                "check --stages/--microbatches against the batch size and the graph's layer count")
    sized = {}
    for i, (need, kind, cfg, layout) in enumerate(sr.failures):
        if kind == "greedy":
            prob = sr.problem(sr.microbatch_size(cfg), cfg.recompute)
            mem = sr.memory_fn(cfg, prob)
            key = (id(mem), cfg.stages * cfg.chunks)
            if key not in sized:
                sized[key] = mem.least_capacity(cfg.stages * cfg.chunks, cap)
            sr.failures[i] = (sized[key], kind, cfg, layout)
    measured = [f for f in sr.failures if f[1] != "state"]
    # State-only bounds may understate; prefer configurations whose partition was tried.
    need, kind, cfg, layout = min(measured or sr.failures, key=lambda f: f[0])
    stage_txt = " (model state alone)"
    if kind != "state":
        mb = sr.microbatch_size(cfg)
        prob = sr.problem(mb, cfg.recompute)
        for capacity in (need + max(1, need // 500), 2 * need):
            part = partition_dp(prob, cfg.stages * cfg.chunks, link=sr.link_fn(cfg, layout),
                                memory_bytes=sr.memory_fn(cfg, prob), capacity_bytes=capacity)
            if part.assignment:
                break
        if part.assignment:
            plan, _ = predict(sr.graph, profile, part.assignment, replicas=cfg.data_parallel, schedule=cfg.schedule,
                              microbatches=cfg.microbatches, batch_size=batch_size, dtype=sr.dtype,
                              optimizer=sr.optimizer, recompute=cfg.recompute, times=sr.times, chunks=cfg.chunks,
                              layout=layout, problem=sr.problem(mb), summary=sr.summary)
            worst = max(plan.stages, key=lambda s: s.predicted.memory_bytes)
            need = worst.predicted.memory_bytes
            stage_txt = (f" on stage {worst.index}" if cfg.chunks == 1 else
                         f" on pipeline device {worst.index % cfg.stages}")
    over = need - cap
    msg = (f"nothing fits: the smallest plan ({cfg.describe()}) needs {need / GIB:.1f} GiB{stage_txt} but "
           f"{profile.name} has {cap / GIB:.1f} GiB usable ({over / GIB:.1f} GiB, {100 * over / cap:.0f}% over)")
    hints = []
    state = model_state_bytes(sum(sr.problem(1).param_bytes), optimizer=sr.optimizer, dtype=sr.dtype).total_bytes
    largest = max(range(sr.n), key=lambda i: sr.problem(1).param_bytes[i])
    one = model_state_bytes(sr.problem(1).param_bytes[largest], optimizer=sr.optimizer, dtype=sr.dtype).total_bytes
    if one > cap:
        hints.append(f"layer {sr.graph.layers[largest].name} alone needs {one / GIB:.1f} GiB of weights and optimizer "
                     f"state: no pipeline split fits it; use a device with more memory or a lighter optimizer")
    else:
        want = max(devices + 1, math.ceil(devices * need / cap), math.ceil(state / cap))
        hints.append(f"more devices (about {want})")
    if recompute in ("off", False) and kind != "state":
        hints.append("recomputation (--recompute on)")
    if batch_size > 1 and kind != "state" and sr.microbatch_size(cfg) > 1:
        hints.append(f"smaller microbatches (the smallest plan uses {sr.microbatch_size(cfg)} samples each; "
                     "more microbatches or a smaller batch)")
    if sr.optimizer in ("adam", "adamw"):
        hints.append("a lighter optimizer (sgd keeps no state)")
    return msg, "would fit with: " + "; ".join(hints)
