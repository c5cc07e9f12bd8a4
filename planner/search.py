"""Automatic search: the fastest pipeline configuration that fits, and how it compares.

Given a `PlanRequest` (devices, global batch, and whatever the user fixed), try
every configuration of `planner/configs.py` (stages x replicas x microbatches x
schedule x chunks x recomputation), partition each (`planner/partition.py`: the
DP under the memory cap, plus the naive splits), predict the candidates
(`planner/predict.py`: cost models + event simulation) and keep the best by
samples/s. Configurations that cannot fit are recognised without the DP
(`planner/feasibility.py`), configurations that cannot win are skipped by a
throughput bound (`planner/bounds.py`: this changes the work, not the answer),
and when nothing fits `planner/diagnose.py` says by how much. The runners-up are
the best of the configurations that were evaluated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pulp import PulpSolverError

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory
from pipeplan.errors import InfeasibleError, UserError
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.baselines import equal_layers
from pipeplan.planner.bounds import chain_ramp, iteration_lower_bound, split_within
from pipeplan.planner.configs import Config, configurations, pipedream_microbatch_counts, shape_pairs, sharding_levels
from pipeplan.planner.diagnose import Failure, SearchView, closest_failure, infeasible_message, just_enough
from pipeplan.planner.dp import Partition
from pipeplan.planner.feasibility import greedy_fits, state_lower_bound
from pipeplan.planner.partition import Partitioner, ilp_info, ilp_partition, link_fn
from pipeplan.planner.pipedream import partition_pipedream
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import graph_summary, predict
from pipeplan.planner.problem import Problem, build_problem, memory_signature, range_memory
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.runnable import split_backward_conflict
from pipeplan.schedules import facts, stage_device
from pipeplan.units import GIB

__all__ = ["search", "SearchResult", "Candidate", "Progress", "pipedream_levels"]

REFITS = 3
"""How many times the DP is asked again under a lower capacity when the exact prediction finds its partitions over
memory (`_Search.partition_and_predict`); each round is one DP run per communication model and its predictions."""
RESCUE_STEPS = 3
"""Capacities the DP tries for the closest configuration when nothing fitted (`_Search.rescue_closest`)."""

Progress = Callable[[str, int, int], None]
"""(what is being searched, step, steps) -> None."""


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
class Candidate:
    """A feasible plan the search keeps, with the configuration and partition it came from."""

    plan: Plan
    config: Config
    partition: Partition

    def rank(self) -> tuple[float, int]:
        """Sort key: fastest first, then the smaller memory peak."""
        return (-self.plan.predicted.samples_per_s, self.plan.predicted.peak_memory_bytes)


class _Search:
    """State of one search: cached problems and memory models, the top list, counters, failures."""

    def __init__(self, graph: Graph, profile: HardwareProfile, request: PlanRequest) -> None:
        self.graph, self.profile, self.request = graph, profile, request
        self.B = request.batch_size
        self.cap = int(profile.usable_memory_bytes)
        self.summary = graph_summary(graph)
        index = {layer.name: i for i, layer in enumerate(graph.layers)}
        self.shared = [(int(sp.bytes), sorted(index[name] for name in sp.layers if name in index))
                       for sp in graph.shared_params]
        self.shared_users = [users for _, users in self.shared]  # per candidate: planner/runnable.py
        self.top: list[Candidate] = []
        self.failures: list[Failure] = []
        self.evaluated = self.pruned = self.infeasible = 0
        self.unrunnable: list[tuple[Config, int]] = []  # (configuration, stage) torch's split backward cannot run
        self.partitioner = Partitioner(self.cap, heuristics=request.heuristics)
        self._problems: dict[tuple[int, bool], Problem] = {}
        self._memory: dict[tuple[Any, ...], RangeMemory] = {}
        self._ramps: dict[tuple[int, bool], list[float]] = {}

    # -- cached inputs -------------------------------------------------------
    def problem(self, mb: int, recompute: bool = False) -> Problem:
        """Per-microbatch numbers; with recomputation the DP balances fwd + (fwd + bwd)."""
        key = (mb, recompute)
        if key not in self._problems:
            if recompute:
                base = self.problem(mb)
                self._problems[key] = replace(base, bwd_s=tuple(b + f for f, b in zip(base.fwd_s, base.bwd_s,
                                                                                      strict=True)))
            else:
                self._problems[key] = build_problem(self.graph, self.profile, microbatch_size=mb,
                                                    dtype=self.request.training_dtype, times=self.request.times,
                                                    mixed_precision=self.request.mixed_precision)
        return self._problems[key]

    def ramp(self, mb: int, tail: bool) -> list[float]:
        key = (mb, tail)
        if key not in self._ramps:
            plain = self.problem(mb)
            self._ramps[key] = chain_ramp(plain.fwd_s, plain.bwd_s, tail=tail)
        return self._ramps[key]

    def memory_key(self, cfg: Config, prob: Problem) -> tuple[Any, ...]:
        """Everything of a configuration its `range_memory` reads (the problem, cached per microbatch size and
        recomputation, by identity): the key of the memory cache and, with the links, of the DP's."""
        return (id(prob), cfg.schedule, cfg.stages, cfg.chunks, cfg.recompute, cfg.recompute_granularity,
                memory_signature(cfg), *self.sharding_key(cfg))

    def memory(self, cfg: Config, prob: Problem) -> RangeMemory:
        key = self.memory_key(cfg, prob)
        if key not in self._memory:
            self._memory[key] = range_memory(prob, cfg, self.request, self.shared)
        return self._memory[key]

    @staticmethod
    def sharding_key(cfg: Config) -> tuple[str, int]:
        """How sharding enters memory: the level and the replicas it divides by (nothing when unsharded)."""
        return (cfg.sharding, cfg.data_parallel) if cfg.sharding != "none" else ("none", 1)

    def threshold(self) -> float:
        """Throughput a configuration must be able to beat to be worth partitioning: the best so far.

        Pruning against the best (not the last of the top list) keeps the best
        exact and makes the runners-up the best of what was evaluated."""
        return self.top[0].plan.predicted.samples_per_s if self.top else 0.0

    def beaten(self, iteration_s: float) -> bool:
        """True (and counted) when a partition whose iteration takes at least `iteration_s` (`iteration_bound`)
        cannot beat the best plan so far."""
        if iteration_s > 0 and self.B / iteration_s <= self.threshold():
            self.pruned += 1
            return True
        return False

    # -- one configuration ---------------------------------------------------
    def try_config(self, cfg: Config) -> None:
        """Bound, check memory, partition and predict one configuration (both placements where they differ)."""
        mb = cfg.microbatch_size(self.B)
        if mb < 1:
            return
        if self.config_beaten(cfg, mb):
            return
        P, d = cfg.stages, cfg.data_parallel
        prob = self.problem(mb, cfg.recompute)
        replicated_stages = not facts(cfg.schedule).replicates_whole_pipeline
        levels = sharding_levels(self.request, cfg.schedule, d, unsharded_too=self.profile.local)
        for i, level in enumerate(levels):  # the least sharding that fits (a failure recorded for the last only)
            if self.fits(replace(cfg, sharding=level), prob, record=i == len(levels) - 1):
                cfg, more = replace(cfg, sharding=level), levels[i + 1:]
                break
        else:
            return
        layouts = [cfg]
        if not replicated_stages and d > 1 and P > 1 and P * d > self.profile.devices_per_node:
            layouts.append(replace(cfg, layout="pipeline-major"))  # sends inside a node, all-reduce across
        mem = self.memory(cfg, prob)
        for lcfg in layouts:
            parts = self.partition_and_predict(lcfg, prob, mem, mb)
            # More sharding holds less, so these partitions fit it too; its collectives overlap compute
            # and leave less for the end of the iteration, so it may be faster: predicted, not re-partitioned.
            for level in more:
                for part in parts:
                    self.consider(replace(lcfg, sharding=level), part, mb)

    def config_beaten(self, cfg: Config, mb: int) -> bool:
        """True (and counted) when no partition of the configuration can beat the best plan so far, decided
        before partitioning: every device of a pipeline busy the whole iteration; without interleaving, no split
        whose stages all stay under the iteration to beat, counting on a flushing schedule each device's ramp and
        drain (`iteration_bound` of every split at once; partitions under memory caps only do worse)."""
        if not self.top:
            return False
        limit = self.B / self.threshold()  # the iteration a plan must beat, in seconds
        P, M = cfg.stages, cfg.microbatches
        rule = facts(cfg.schedule)
        shared = 1 if rule.replicates_whole_pipeline else cfg.data_parallel  # replicas of a stage share its work
        compute = self.problem(mb, cfg.recompute).compute_s
        ramp = self.ramp(mb, not rule.splits_backward) if rule.flushes else None
        if M * sum(compute) / P / shared >= limit or (
                cfg.chunks == 1 and not split_within(compute, P, limit * shared, microbatches=M, ramp_s=ramp)):
            self.pruned += 1
            return True
        return False

    def fits(self, cfg: Config, prob: Problem, *, record: bool = True) -> bool:
        """Model state and a greedy packing: a configuration that fails either cannot fit (recorded)."""
        req = self.request
        need = state_lower_bound(prob.param_bytes, cfg.stages, optimizer=req.optimizer, dtype=req.training_dtype,
                                 mixed_precision=req.mixed_precision, sharding=cfg.sharding, shards=cfg.data_parallel,
                                 frozen_param_bytes=prob.frozen)
        failure = None
        if need > self.cap:
            failure = Failure(need, "state", cfg)
        elif not greedy_fits(self.memory(cfg, prob), cfg.virtual_stages, self.cap):
            failure = Failure(-1, "greedy", cfg)  # how far off: computed if nothing fits
        if failure and record:
            self.infeasible += 1
            self.failures.append(failure)
        return failure is None

    def partition_and_predict(self, cfg: Config, prob: Problem, mem: RangeMemory, mb: int) -> list[Partition]:
        """The configuration's candidate partitions, each predicted, the DP's again under less memory where the
        prediction finds them over (`predict_new`); returns the distinct partitions predicted."""
        links = link_fn(self.profile, cfg)
        key = (mb, cfg.virtual_stages, *self.memory_key(cfg, prob))
        seen: dict[tuple[int, ...], Partition] = {}
        over = self.predict_new(cfg, self.partitioner.candidates(cfg, prob, mem, links, key), mb, seen, self.cap)
        capacity = self.cap
        for _ in range(REFITS):
            if over <= 0:
                break
            capacity -= over
            over = self.predict_new(cfg, self.partitioner.dp_optima(cfg, prob, mem, links, key, capacity), mb, seen,
                                    capacity)
        return list(seen.values())

    def predict_new(self, cfg: Config, parts: list[Partition], mb: int, seen: dict[tuple[int, ...], Partition],
                    capacity: int) -> int:
        """Predict the partitions not `seen` yet; returns by how much the DP's exceed memory where none of them fits
        (0 where one fits or none was over), which a refit takes off the DP's `capacity`: the DP prices a device
        running several chunks as copies of each and its sends at one point of its order (costmodels/memory.py
        `RangeMemory`), the prediction by walking it, and a device's gathered or largest-layer terms differ by chunk."""
        over, fitted = 0, False
        for part in parts:
            if part.solver.get("status") == "infeasible":
                if capacity == self.cap:  # a refit's says nothing of the device's capacity
                    self.infeasible += 1
                    if part.solver.get("memory_cap"):
                        self.failures.append(Failure(-1, "dp", cfg))  # sized if nothing fits (diagnose.py)
                continue
            if tuple(part.assignment) in seen:
                continue
            seen[tuple(part.assignment)] = part
            got = self.consider(cfg, part, mb)
            if part.solver.get("name") != "dp":
                continue
            if isinstance(got, Failure):
                over = max(over, got.need_bytes - self.cap)
            fitted = fitted or isinstance(got, Plan)
        return 0 if fitted else over

    def rescue_closest(self) -> Failure | None:
        """Nothing fitted: partition the configuration the diagnosis would name again, where it holds several
        chunks a device, and let the prediction judge.

        The greedy packing and the DP price a device of several chunks as that many copies of each chunk
        (costmodels/memory.py `RangeMemory`), which overstates a device whose chunks differ: a V schedule's device 0
        holds a convolutional net's first chunk, heavy with activations, beside its light last one. ResNet-101
        (PipeDream's profile) under zb-v on 8 V100s was refused as "needs 14.7 GiB" of 15.0 (the DP's split at the
        copies' 39.7 GiB, predicted): the partitions the DP finds from the copies' least capacity up are predicted,
        each device's chunks walked as they run. Only the closest configuration: the copies' overstatement has no
        bound that would rule others out cheaply (more configurations: a search as long again when nothing fits).
        Returns that configuration's failure (None: no configuration failed), for the diagnosis where nothing
        fits still: the failures are then as they were."""
        if not self.failures:
            return None
        f = closest_failure(self.view())
        cfg = f.config
        if f.how not in ("greedy", "dp") or cfg.chunks == 1:
            return f
        mb = cfg.microbatch_size(self.B)
        prob = self.problem(mb, cfg.recompute)
        mem = self.memory(cfg, prob)
        links = link_fn(self.profile, cfg)
        key = (mb, cfg.virtual_stages, *self.memory_key(cfg, prob))
        seen: dict[tuple[int, ...], Partition] = {}
        failures, infeasible = len(self.failures), self.infeasible
        for step in range(RESCUE_STEPS):  # the diagnosis's own split first (diagnose._worst_stage), then looser
            capacity = just_enough(f.need_bytes) + f.need_bytes * step // 8
            self.predict_new(cfg, self.partitioner.dp_optima(cfg, prob, mem, links, key, capacity), mb, seen,
                             capacity)
        if not self.top:  # the diagnosis reads the search's own failures, as without the rescue
            del self.failures[failures:]
            self.infeasible = infeasible
        return f

    def consider(self, cfg: Config, part: Partition, mb: int) -> Plan | Failure | None:
        """Predict a partition (unless its busiest device already loses) and keep it if it fits and ranks: the plan,
        the Failure recorded when the prediction finds it over memory, or None when it was not predicted."""
        if facts(cfg.schedule).splits_backward:
            stage = split_backward_conflict(self.shared_users, part.assignment)
            if stage is not None:
                self.unrunnable.append((cfg, stage))
                return None
        if self.beaten(self.iteration_bound(cfg, part.assignment, mb)):
            return None
        solver = dict(part.solver)
        solver["layout"] = cfg.layout
        plan = predict(self.graph, self.profile, part.assignment, cfg, self.request, problem=self.problem(mb),
                       solver=solver, summary=self.summary).plan
        self.evaluated += 1
        if not plan.predicted.fits:
            self.infeasible += 1
            self.failures.append(Failure(plan.predicted.peak_memory_bytes, "exact", cfg))
            return self.failures[-1]
        self.admit(Candidate(plan, cfg, part))
        return plan

    def iteration_bound(self, cfg: Config, assignment: list[int], mb: int) -> float:
        """Seconds the partition's iteration takes at the least (planner/bounds.py): its busiest device's compute
        for every microbatch, and on a flushing schedule each device's ramp and drain around it."""
        P = cfg.stages
        prob = self.problem(mb, cfg.recompute)
        busy = [0.0] * P
        device_of = [stage_device(cfg.schedule, s, P) for s in range(max(assignment) + 1)]
        for i, s in enumerate(assignment):
            busy[device_of[s]] += prob.compute_s[i]
        if cfg.stage_replicas:
            busy = [busy[s] / cfg.stage_replicas[s] for s in range(P)]
        rule = facts(cfg.schedule)
        if rule.flushes:  # every replica runs the whole pipeline and its microbatches
            plain = self.problem(mb)
            return iteration_lower_bound(plain.fwd_s, plain.bwd_s, busy, assignment, device_of, cfg.microbatches,
                                         tail=not rule.splits_backward)
        shared = not (rule.replicates_whole_pipeline or cfg.stage_replicas)  # d replicas of each stage share them
        return cfg.microbatches * max(busy) / (cfg.data_parallel if shared else 1)

    def admit(self, new: Candidate) -> None:
        """Keep the `top` fastest configurations, one partition each: several partitions of one configuration
        (the DP's, the heuristics', the ILP's) would show as runners-up that read the same."""
        same = [c for c in self.top if c.config == new.config]
        if same and same[0].rank() <= new.rank():
            return
        self.top = sorted([c for c in self.top if c.config != new.config] + [new], key=Candidate.rank)
        del self.top[self.request.top:]

    def view(self) -> SearchView:
        return SearchView(self.graph, self.profile, self.request, self.failures, self.problem, self.memory)


def pipedream_levels(profile: HardwareProfile, devices: int) -> list[tuple[int, Link]]:
    """The device hierarchy for PipeDream's optimizer: devices per node, then nodes."""
    per = profile.devices_per_node
    if devices <= per:
        return [(devices, profile.intra_node)]
    if devices % per == 0:
        return [(per, profile.intra_node), (devices // per, profile.inter_node)]
    return [(devices, profile.inter_node)]  # ragged: plan flat at the slower link


def _pipedream_optimizer(sr: _Search, M: int) -> None:
    """PipeDream's own optimizer (per-stage replication over the hierarchy) for one microbatch count."""
    if sr.B % M:
        return
    mb = sr.B // M
    part = partition_pipedream(sr.problem(mb), pipedream_levels(sr.profile, sr.request.devices),
                               memory_capacity_bytes=sr.cap)
    if not part.assignment:
        sr.infeasible += 1
        return
    S = max(part.assignment) + 1
    if M < S:
        return  # async: fewer than K microbatches only relabels the same steady state
    part.solver.pop("blocks", None)  # nested solver detail; the plan's stages say it
    cfg = Config(schedule="pipedream", stages=S, data_parallel=max(part.replicas), microbatches=M,
                 stage_replicas=tuple(part.replicas))
    sr.consider(cfg, part, mb)


def _refine_with_ilp(sr: _Search) -> None:
    """Re-partition the best configuration with the ILP (DAG splits); keep it if it predicts faster.

    The ILP is an improvement step: when its solver fails (CBC missing or
    crashed) the DP plan stands and records why."""
    best = sr.top[0]
    cfg, plan = best.config, best.plan
    mb = cfg.microbatch_size(sr.B)
    prob = sr.problem(mb, cfg.recompute)
    try:
        got = ilp_partition(prob, cfg, sr.memory(cfg, prob), link_fn(sr.profile, cfg), capacity_bytes=sr.cap,
                            time_limit_s=sr.request.ilp_time_limit_s, warm_start=best.partition)
    except PulpSolverError as e:
        plan.solver["ilp"] = {"status": "solver error", "message": str(e)}
        return
    if got is None:
        return
    if got.assignment == best.partition.assignment:
        plan.solver["ilp"] = ilp_info(got)
        return
    new = sr.consider(cfg, got, mb)  # admitted into the top list if it fits; best first
    if isinstance(new, Plan):
        new.solver["warm_start"] = "dp"


def _enumerate(graph: Graph, profile: HardwareProfile, request: PlanRequest, progress: Progress | None) -> _Search:
    """Every configuration of `request` (resolved for `profile`) partitioned and evaluated: the kept plans in
    `top`, the rejected ones in `failures`."""
    n = len(graph.layers)
    request.check_graph(n, grouped=graph.source.get("depth") is not None)
    sr = _Search(graph, profile, request)
    if not any(sr.problem(1).compute_s):
        raise UserError(f"graph {graph.name!r} has no layer times under --times {request.times} "
                        "(every layer takes 0 s)", "use --times model, or trace the model to measure it")
    pairs = shape_pairs(request, n)
    for step, (K, d) in enumerate(pairs):
        if progress:
            progress(f"{K} stages x {d} replicas", step, len(pairs))
        for cfg in configurations(request, K, d, n):
            sr.try_config(cfg)
    if "pipedream" in request.schedules and not request.stages and not request.data_parallel:
        for M in pipedream_microbatch_counts(request):
            _pipedream_optimizer(sr, M)
    if progress:
        progress("done", len(pairs), len(pairs))
    return sr


def _block_hint(graph: Graph, profile: HardwareProfile, request: PlanRequest) -> str | None:
    """Per-block recomputation and the plan it gives, where nothing fits under per-stage recomputation but that does.

    Why: a checkpoint per stage (the default granularity, `pipeplan run`'s) keeps each microbatch's stage input but
    re-runs the whole stage at once, holding all it saves; a checkpoint per block (as Megatron-LM, DeepSpeed and
    torchtitan recompute) holds one block's. A model that fits only that way would otherwise be reported as
    needing more devices. The hint is a plan the search found, not a guess: it costs a second enumeration (not its
    diagnosis), only when nothing fits."""
    if request.recompute == "off" or request.recompute_granularity != "stage":
        return None
    try:
        sr = _enumerate(graph, profile, replace(request, recompute_granularity="block", top=1), None)
    except UserError:  # no schedule asked for runs block checkpoints
        return None
    if not sr.top:
        return None
    best, cfg = sr.top[0].plan, sr.top[0].config
    return (f"--recompute-granularity block ({cfg.describe()}: {best.predicted.peak_memory_bytes / GIB:.1f} GiB at "
            f"the fullest device, {best.predicted.samples_per_s:.4g} samples/s)")


def _wants_ilp(sr: _Search) -> bool:
    first = sr.top[0].config
    solver = sr.request.solver
    return not first.stage_replicas and (
        solver == "ilp" or (solver == "auto" and not sr.problem(first.microbatch_size(sr.B)).is_chain()))


def alternative_summary(plan: Plan) -> dict[str, Any]:
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
        "recompute_granularity": plan.recompute_granularity,
        "sharding": plan.sharding,
        "layer_counts": [len(s.layers) for s in plan.stages],
        "layout": plan.solver.get("layout", "stage-major"),
        "iteration_s": plan.predicted.iteration_s,
        "samples_per_s": plan.predicted.samples_per_s,
        "bubble_fraction": plan.predicted.bubble_fraction,
        "peak_memory_bytes": plan.predicted.peak_memory_bytes,
    }


def _result(sr: _Search, t0: float) -> SearchResult:
    """The best plan, its runners-up and its equal-layers baseline (same configuration)."""
    best, cfg = sr.top[0].plan, sr.top[0].config
    alternatives = [c.plan for c in sr.top[1:]]
    base_assign = equal_layers(len(sr.graph.layers), cfg.virtual_stages)
    baseline = predict(sr.graph, sr.profile, base_assign, cfg, sr.request,
                       problem=sr.problem(cfg.microbatch_size(sr.B)), solver={"name": "equal-layers"},
                       summary=sr.summary).plan
    elapsed = time.perf_counter() - t0
    best.alternatives = [alternative_summary(p) for p in alternatives]
    best.solver["search"] = {"evaluated": sr.evaluated, "pruned": sr.pruned, "infeasible": sr.infeasible,
                             "time_s": elapsed, "devices_available": sr.request.devices}
    return SearchResult(best=best, alternatives=alternatives, baseline=baseline, evaluated=sr.evaluated,
                        pruned=sr.pruned, infeasible=sr.infeasible, time_s=elapsed)


def search(graph: Graph, profile: HardwareProfile, request: PlanRequest, *,
           progress: Progress | None = None) -> SearchResult:
    """Best feasible plan (highest samples/s) for `request`; InfeasibleError when nothing fits.

    Fields the request fixes (stages, microbatches, schedule, data_parallel,
    chunks) restrict the enumeration; dtype "auto" is resolved for `profile`.
    solver "dp" partitions every configuration with the DP; "ilp" and "auto" then
    re-partition the best configuration with the ILP warm-started from the DP
    ("auto" only when the graph has branches a single execution order could split better).
    """
    t0 = time.perf_counter()
    request = request.for_profile(profile)
    sr = _enumerate(graph, profile, request, progress)
    if not sr.top and sr.unrunnable and not sr.failures:
        cfg, stage = sr.unrunnable[0]
        raise UserError(f"{cfg.schedule}: the balanced splits put two uses of a shared parameter in one stage past the "
                        f"first (stage {stage} of {cfg.describe()}), which torch's split backward cannot run "
                        "(docs/schedules.md)", "choose a schedule without split backwards, such as --schedule 1f1b")
    closest = sr.rescue_closest() if not sr.top else None
    if not sr.top:
        raise InfeasibleError(*infeasible_message(sr.view(), _block_hint(graph, profile, request), closest))
    if _wants_ilp(sr):
        _refine_with_ilp(sr)
    return _result(sr, t0)
