"""The search on a mixed cluster: which stages run on which device type, and the rest of the configuration.

Each stage runs on one device type (all its replicas alike) and a type's stages
are contiguous (HetPipe, Park et al. ATC'20; PipeDream's hierarchy): for an
order of the groups, the first c_1 stages on the first, the next c_2 on the
second, ... with c_g x replicas within the group's count; every order and every
split is tried (for two groups: the first k stages on A and the rest on B, and
the other way round). For each placement and configuration (stages x replicas x
microbatches x schedule x recomputation x ZeRO level, `planner/configs.py`;
synchronous non-interleaved schedules, stage-major) the chain DP of
`planner/mixed_dp.py` partitions with per-type costs and capacities, and
`planner/mixed_predict.py` predicts the partition; the best by samples/s wins.
A partition that would lose to the best so far by its devices' work, ramp and drain
alone is not simulated (`planner/bounds.iteration_lower_bound`): this changes the
work, not the answer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeplan.costmodels.comm import p2p_time_s
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory
from pipeplan.errors import InfeasibleError, UserError
from pipeplan.planner.baselines import equal_layers
from pipeplan.planner.bounds import iteration_lower_bound
from pipeplan.planner.cluster import Cluster
from pipeplan.planner.configs import Config, configurations, shape_pairs, sharding_levels
from pipeplan.planner.mixed_dp import StageCosts, mixed_chain_dp
from pipeplan.planner.mixed_predict import mixed_predict
from pipeplan.planner.plan import Plan
from pipeplan.planner.problem import Problem, build_problem, memory_signature, range_memory
from pipeplan.planner.request import PlanRequest, default_dtype
from pipeplan.planner.runnable import split_backward_conflict
from pipeplan.planner.search import SearchResult, alternative_summary
from pipeplan.schedules import SCHEDULE_NAMES, facts, schedules_where

__all__ = ["mixed_search", "placements", "cluster_request", "MixedCandidate"]


@dataclass(frozen=True)
class MixedCandidate:
    plan: Plan
    config: Config
    types: tuple[int, ...]
    assignment: tuple[int, ...]


def cluster_request(request: PlanRequest, cluster: Cluster) -> PlanRequest:
    """The request on the whole cluster, dtype "auto" resolved once for all groups: fp32 if any group has no
    16-bit rate (Pascal), else fp16 if any group has no bf16 (V100, T4), else each group's default
    (`request.default_dtype`); every device trains in one precision."""
    request = replace(request, devices=cluster.devices)
    if request.dtype != "auto":
        return request
    dtypes = {default_dtype(g.profile) for g in cluster.groups}
    return replace(request, dtype=next((d for d in ("fp32", "fp16") if d in dtypes), sorted(dtypes)[0]))


def placements(cluster: Cluster, stages: int, replicas: int) -> list[tuple[int, ...]]:
    """Device type of each stage: contiguous runs, in every order of the groups, within each group's count."""
    seen: dict[tuple[int, ...], None] = {}
    G = len(cluster.groups)
    for order in itertools.permutations(range(G)):
        for counts in _compositions(stages, G):
            if all(c * replicas <= cluster.groups[g].count for g, c in zip(order, counts, strict=True)):
                seen[tuple(g for g, c in zip(order, counts, strict=True) for _ in range(c))] = None
    return list(seen)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` non-negative integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


class _MixedSearch:
    """Cached per-group problems, the top list and the counters of one mixed search."""

    def __init__(self, graph: Graph, cluster: Cluster, request: PlanRequest) -> None:
        self.graph, self.cluster, self.request = graph, cluster, request
        self.B = request.batch_size
        index = {layer.name: i for i, layer in enumerate(graph.layers)}
        self.shared = [(int(sp.bytes), sorted(index[name] for name in sp.layers if name in index))
                       for sp in graph.shared_params]
        self.shared_users = [users for _, users in self.shared]  # per candidate: planner/runnable.py
        self._problems: dict[tuple[int, int], Problem] = {}
        self._partitions: dict[tuple[Any, ...], tuple[float, list[int]] | None] = {}
        self.top: list[MixedCandidate] = []
        self.evaluated = self.pruned = self.infeasible = 0

    def problem(self, g: int, mb: int) -> Problem:
        if (g, mb) not in self._problems:
            self._problems[(g, mb)] = build_problem(self.graph, self.cluster.groups[g].profile, microbatch_size=mb,
                                                    dtype=self.request.training_dtype, times=self.request.times,
                                                    mixed_precision=self.request.mixed_precision)
        return self._problems[(g, mb)]

    def best_rate(self) -> float:
        return self.top[0].plan.predicted.samples_per_s if self.top else 0.0

    def costs(self, cfg: Config, types: Sequence[int], mb: int, mem: RangeMemory) -> StageCosts:
        probs = [self.problem(g, mb) for g in range(len(self.cluster.groups))]
        compute = [[f + b + (f if cfg.recompute else 0.0) for f, b in zip(p.fwd_s, p.bwd_s, strict=True)]
                   for p in probs]
        cut = probs[0].cut_bytes

        def send_s(s: int, b: int) -> float:
            same = s + 1 < len(types) and types[s] == types[s + 1]
            link = self.cluster.groups[types[s]].profile.intra_node if same else self.cluster.link
            return p2p_time_s(cut[b - 1], link)

        caps = [int(self.cluster.groups[g].profile.usable_memory_bytes) for g in types]
        return StageCosts(compute, send_s, mem, caps)

    def memory(self, cfg: Config, mb: int) -> RangeMemory:
        return range_memory(self.problem(0, mb), replace(cfg, chunks=1), self.request, self.shared)

    def lower_bound_s(self, cfg: Config, mb: int) -> float:
        """An iteration of `cfg` takes at least M x (every layer on its fastest type) / K: the busiest stage
        computes at least the average, and each stage computes all M microbatches."""
        groups = range(len(self.cluster.groups))
        fastest = sum(min(self.problem(g, mb).compute_s[i] for g in groups) for i in range(len(self.graph.layers)))
        return cfg.microbatches * fastest / cfg.stages

    def partition(self, cfg: Config, types: tuple[int, ...], mb: int) -> tuple[float, list[int]] | None:
        """The DP's partition (cached by how M enters the memory model, `memory_signature`)."""
        key = (types, mb, cfg.recompute, cfg.schedule, cfg.sharding, cfg.data_parallel,
               memory_signature(replace(cfg, chunks=1)))
        if key not in self._partitions:
            self._partitions[key] = mixed_chain_dp(self.costs(cfg, types, mb, self.memory(cfg, mb)), types)
        return self._partitions[key]

    def try_config(self, cfg: Config) -> None:
        """Every placement of this configuration, at the least ZeRO level whose DP partition fits."""
        mb = cfg.microbatch_size(self.B)
        if mb < 1:
            return
        bound = self.lower_bound_s(cfg, mb)
        if bound > 0 and self.B / bound <= self.best_rate():
            self.pruned += 1
            return
        for types in placements(self.cluster, cfg.stages, cfg.data_parallel):
            for level in sharding_levels(self.request, cfg.schedule, cfg.data_parallel):
                lcfg = replace(cfg, sharding=level)
                got = self.partition(lcfg, types, mb)
                if got is not None:
                    self.consider(lcfg, types, got[1], mb)
                    break
            else:
                self.infeasible += 1

    def iteration_bound(self, cfg: Config, types: Sequence[int], assignment: Sequence[int], mb: int) -> float:
        """Seconds the partition's iteration takes at the least: planner/bounds.iteration_lower_bound (each device's
        ramp, work and drain; its busiest work alone without a flush) with each layer priced on its stage's type."""
        probs = [self.problem(types[s], mb) for s in assignment]
        fwd = [p.fwd_s[i] for i, p in enumerate(probs)]
        bwd = [p.bwd_s[i] for i, p in enumerate(probs)]
        busy = [0.0] * len(types)
        for i, s in enumerate(assignment):
            busy[s] += fwd[i] * (2 if cfg.recompute else 1) + bwd[i]
        rule = facts(cfg.schedule)
        if not rule.flushes:
            return cfg.microbatches * max(busy)
        return iteration_lower_bound(fwd, bwd, busy, assignment, range(len(types)), cfg.microbatches,
                                     tail=not rule.splits_backward)

    def consider(self, cfg: Config, types: Sequence[int], assignment: Sequence[int], mb: int,
                 solver: str = "mixed-dp") -> None:
        # a split torch's split backward cannot run (planner/runnable.py)
        if facts(cfg.schedule).splits_backward and split_backward_conflict(self.shared_users, assignment) is not None:
            self.infeasible += 1
            return
        bound = self.iteration_bound(cfg, types, assignment, mb)
        if bound > 0 and self.B / bound <= self.best_rate():
            self.pruned += 1
            return
        problems = {g: self.problem(g, mb) for g in set(types)}
        plan = mixed_predict(self.graph, self.cluster, assignment, types, cfg, self.request, problems=problems,
                             solver={"name": solver, "status": "optimal", "layout": "stage-major"}).plan
        self.evaluated += 1
        if not plan.predicted.fits:
            self.infeasible += 1
            return
        new = MixedCandidate(plan, cfg, tuple(types), tuple(assignment))
        same = [c for c in self.top if (c.config, c.types) == (cfg, new.types)]
        if same and same[0].plan.predicted.samples_per_s >= plan.predicted.samples_per_s:
            return
        self.top = sorted([c for c in self.top if (c.config, c.types) != (cfg, new.types)] + [new],
                          key=lambda c: (-c.plan.predicted.samples_per_s, c.plan.predicted.peak_memory_bytes))
        del self.top[self.request.top:]


def _shifted(assignment: Sequence[int]) -> Iterator[list[int]]:
    """Every partition one layer away: a boundary moved by one layer, no stage left empty."""
    n = len(assignment)
    for i in range(1, n):
        if assignment[i] != assignment[i - 1]:
            if i + 1 < n and assignment[i + 1] == assignment[i]:  # stage of layer i keeps a layer: give i to the left
                yield [*assignment[:i], assignment[i - 1], *assignment[i + 1:]]
            if i - 2 >= 0 and assignment[i - 2] == assignment[i - 1]:  # the left keeps a layer: give i-1 to the right
                yield [*assignment[:i - 1], assignment[i], *assignment[i:]]


def _refine(sr: _MixedSearch, limit: int = 64) -> None:
    """Hill-climb the best plan's boundaries one layer at a time on simulated samples/s.

    The DP balances per-microbatch stage time; the simulation adds the bubble and the sends, so a neighbouring
    split can be faster (few per cent on the tests' brute force). Improvement only: the best never gets worse."""
    best = sr.top[0]
    mb = best.config.microbatch_size(sr.B)
    for _ in range(limit):
        before = sr.top[0]
        for assign in _shifted(best.assignment):
            sr.consider(best.config, best.types, assign, mb, solver="mixed-dp + boundary shifts")
        if sr.top[0] is before:
            return
        best = sr.top[0]


def _summary_mixed(plan: Plan) -> dict[str, Any]:
    return {**alternative_summary(plan), "device_types": [s.device_type for s in plan.stages]}


def _plans_on_clusters(schedule: str) -> bool:
    """Whether the mixed search plans `schedule`: synchronous, whole pipelines replicated, one stage a device (the
    chain DP places one stage per device type run; several chunks a device would interleave types)."""
    rule = facts(schedule)
    return rule.flushes and rule.replicates_whole_pipeline and not rule.interleaves


def mixed_search(graph: Graph, cluster: Cluster, request: PlanRequest) -> SearchResult:
    """Best feasible plan on `cluster` (module docstring); InfeasibleError when nothing fits."""
    t0 = time.perf_counter()
    request = cluster_request(request, cluster)
    n = len(graph.layers)
    request.check_graph(n, grouped=graph.source.get("depth") is not None)
    if request.schedule in SCHEDULE_NAMES and not _plans_on_clusters(request.schedule) or request.chunks is not None:
        raise UserError(f"--cluster plans synchronous pipelines of one stage a device; --schedule {request.schedule} "
                        "is not one", f"pick --schedule {schedules_where(_plans_on_clusters)}, or auto")
    sr = _MixedSearch(graph, cluster, request)
    for K, d in shape_pairs(request, n):
        for cfg in configurations(request, K, d, n):
            if _plans_on_clusters(cfg.schedule) and cfg.chunks == 1:
                sr.try_config(cfg)
    if not sr.top:
        raise InfeasibleError(f"no plan fits on --cluster {cluster.spec}",
                              "raise the device counts, lower the batch size, or use larger-memory devices")
    _refine(sr)
    best = sr.top[0]
    base = equal_layers(n, best.config.stages)
    baseline = mixed_predict(graph, cluster, base, best.types, best.config, request,
                             solver={"name": "equal-layers"}).plan
    elapsed = time.perf_counter() - t0
    best.plan.alternatives = [_summary_mixed(c.plan) for c in sr.top[1:]]
    best.plan.solver["search"] = {"evaluated": sr.evaluated, "pruned": sr.pruned, "infeasible": sr.infeasible,
                                  "time_s": elapsed, "devices_available": cluster.devices}
    best.plan.solver["cluster"] = {"groups": [[g.profile.name, g.count] for g in cluster.groups],
                                   "link_gbps": cluster.link.bandwidth_bytes_per_s / 1e9,
                                   "link_latency_us": cluster.link.latency_s * 1e6}
    return SearchResult(best=best.plan, alternatives=[c.plan for c in sr.top[1:]], baseline=baseline,
                        evaluated=sr.evaluated, pruned=sr.pruned, infeasible=sr.infeasible, time_s=elapsed)
