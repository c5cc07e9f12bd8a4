"""The prediction of a partition on a mixed cluster: each stage priced on its own device type.

A stage's layer times, its all-reduce, optimizer step and memory come from its
group's profile (`planner/predict_inputs.stage_inputs` run once per group on
that group's `Problem`, built by `planner/problem.build_problem` with the
group's profile: per-kind efficiencies differ, so no single speed factor would
do); the send between two stages of different groups crosses the cluster's link
(`costmodels.comm.p2p_time_s`). Then the same event simulation as every other
plan (`planner/predict._simulate`), and each device's peak checked against its
own capacity. Synchronous schedules without interleaving only: the stages of a
group are contiguous (planner/mixed_search.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeplan.costmodels.comm import p2p_time_s
from pipeplan.costmodels.graph import Graph
from pipeplan.planner.cluster import Cluster
from pipeplan.planner.configs import Config
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import Evaluation, _microbatch_size, _simulate, _stage_count, graph_summary
from pipeplan.planner.predict_inputs import (
    StageInputs,
    collectives_overlap,
    overlap_slowdown,
    receives_wait,
    stage_inputs,
)
from pipeplan.planner.predict_report import assemble_plan, reruns_per_microbatch_s
from pipeplan.planner.problem import Problem, build_problem
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import facts

__all__ = ["mixed_predict", "mixed_ranks"]

GIB = 2**30
_FIELDS = ("fwd", "bwd", "rec", "send", "allreduce", "fwd_comm", "bwd_comm", "send_bytes", "static", "act", "rbytes",
           "memory", "msg_bytes", "optimizer", "fresh", "msg_extra_tensors")


def mixed_ranks(cluster: Cluster, types: Sequence[int], replicas: int) -> list[list[int]]:
    """Global ranks of each stage's replicas: a group's stages take its devices in order, stage-major."""
    used = [0] * len(cluster.groups)
    ranks = []
    for g in types:
        start = cluster.offset(g) + used[g]
        ranks.append(list(range(start, start + replicas)))
        used[g] += replicas
    for g, n in enumerate(used):
        if n > cluster.groups[g].count:
            raise ValueError(f"{n} devices placed on group {g} of {cluster.groups[g].count}")
    return ranks


def _spliced(parts: dict[int, StageInputs], types: Sequence[int]) -> StageInputs:
    """Stage s's numbers from its own group's inputs (zero bubble's W, its re-runs under recomputation and what the
    split adds too, where the schedule has them)."""
    fields = _FIELDS + tuple(name for name in ("wgrad", "rec_w", "split") if all(getattr(parts[g], name) for g in types))
    return StageInputs(**{name: [getattr(parts[g], name)[s] for s, g in enumerate(types)] for name in fields},
                       tied=parts[types[0]].tied)  # the same graph and assignment in every group


def mixed_predict(graph: Graph, cluster: Cluster, assignment: Sequence[int], types: Sequence[int], config: Config,
                  request: PlanRequest, *, problems: dict[int, Problem] | None = None,
                  solver: dict[str, object] | None = None, keep_events: bool = False) -> Evaluation:
    """The plan for `assignment` (stage of each layer) with stage s on group `types[s]` of `cluster`."""
    rule = facts(config.schedule)
    if not rule.replicates_whole_pipeline or config.chunks != 1 or config.layout != "stage-major":
        raise ValueError("mixed clusters plan synchronous, non-interleaved, stage-major pipelines")
    S = _stage_count(assignment, len(graph.layers), 1)
    if len(types) != S:
        raise ValueError(f"{len(types)} device types for {S} stages")
    dp = config.data_parallel
    reps = [dp] * S
    mb = _microbatch_size(request, config.microbatches, dp)
    ranks = mixed_ranks(cluster, types, dp)
    problems = dict(problems or {})
    parts: dict[int, StageInputs] = {}
    for g in sorted(set(types)):
        profile = cluster.groups[g].profile
        if g not in problems:
            problems[g] = build_problem(graph, profile, microbatch_size=mb, dtype=request.training_dtype,
                                        times=request.times, mixed_precision=request.mixed_precision)
        local = [[r - cluster.offset(g) for r in rs] for rs in ranks]
        parts[g] = stage_inputs(problems[g], profile, graph, assignment, config, request, reps, local)
    x = _spliced(parts, types)
    for s in range(S - 1):
        if types[s] != types[s + 1]:  # across groups: the cluster's link
            x.send[s] = p2p_time_s(x.send_bytes[s], cluster.link) if x.send_bytes[s] else 0.0
    overhead_s = [cluster.groups[g].profile.overhead_for(config.schedule, n, extra, alone=S == 1,
                                                         chunks=config.chunks)
                  for g, n, extra in zip(types, x.msg_bytes, x.msg_extra_tensors, strict=True)]
    group_profiles = [cluster.groups[g].profile for g in set(types)]
    overlap = all(collectives_overlap(p) for p in group_profiles)
    slowdown = max(overlap_slowdown(p) for p in group_profiles)
    waits = all(receives_wait(p, config.schedule) for p in group_profiles)
    sim = _simulate(config, x, overhead_s, keep_events, overlap=overlap, slowdown=slowdown, waits=waits)
    first = types[0]
    plan = assemble_plan(graph, cluster.groups[first].profile, problems[first], assignment, config, request, x, sim,
                         ranks=ranks, reps=reps, dp=dp, mb=mb, devices=S * dp, slow=1.0, overhead_s=overhead_s,
                         solver=dict(solver or {}), graph_info=graph_summary(graph), overlap=overlap,
                         slowdown=slowdown, waits=waits)
    _own_times(plan, problems, assignment, types, x.split)
    return Evaluation(_mixed_record(plan, cluster, types, x, request, graph), sim)


def _own_times(plan: Plan, problems: dict[int, Problem], assignment: Sequence[int], types: Sequence[int],
               split: Sequence[float]) -> None:
    """Each stage's reported fwd/bwd from its own type's problem (`assemble_plan` sums one problem's); its re-runs
    under recomputation and what zero bubble's split backward adds come from the stage inputs, already each type's
    own (0 without)."""
    for s, g in enumerate(types):
        f = float(sum(problems[g].fwd_s[i] for i, a in enumerate(assignment) if a == s))
        b = float(sum(problems[g].bwd_s[i] for i, a in enumerate(assignment) if a == s)) + (split[s] if split else 0.0)
        old = plan.stages[s].predicted
        rerun = reruns_per_microbatch_s(plan.schedule, s, old.recompute_s, old.wgrad_recompute_s)
        plan.stages[s].predicted = replace(old, fwd_s=f, bwd_s=b, compute_s=f + b + rerun)


def _mixed_record(plan: Plan, cluster: Cluster, types: Sequence[int], x: StageInputs, request: PlanRequest,
                  graph: Graph) -> Plan:
    """The plan as a mixed one: device types per stage, capacity and FLOP/s per type, the cluster as profile.

    `memory_capacity_bytes` is the capacity of the device with the largest peak (the pair the report shows);
    `fits` checks every device against its own type's capacity."""
    caps = [int(cluster.groups[g].profile.usable_memory_bytes) for g in types]
    over = [(s, m.total_bytes, caps[s]) for s, m in enumerate(x.memory) if m.total_bytes > caps[s]]
    for s, g in enumerate(types):
        plan.stages[s].device_type = cluster.groups[g].profile.name
    notes = [n for n in plan.notes if not n.startswith("device ")]
    notes += [f"device {s} of each pipeline ({cluster.groups[types[s]].profile.name}) needs {need / GIB:.2f} GiB "
              f"but has {cap / GIB:.2f} GiB usable" for s, need, cap in over]
    peak_flops = sum(cluster.groups[g].profile.flops_for(request.training_dtype) * plan.data_parallel for g in types)
    model_flops = (graph.fwd_flops + graph.bwd_flops) * request.batch_size / graph.batch_size
    it = plan.predicted.iteration_s
    peak_stage = max(range(len(caps)), key=lambda s: x.memory[s].total_bytes)  # the capacity beside the peak
    plan.predicted = replace(plan.predicted, fits=not over, memory_capacity_bytes=caps[peak_stage],
                             achieved_flops_fraction=model_flops / it / peak_flops if it > 0 and peak_flops else 0.0)
    plan.profile = cluster.spec
    plan.notes = notes
    return plan
