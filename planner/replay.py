"""Replaying a saved plan: its configuration and request, and its simulated timeline.

`pipeplan show`, `--plot` and `--chrome-trace` draw a plan that may have been
made elsewhere. With the graph and profile at hand the plan is re-predicted
exactly (`simulate_plan`); from the plan file alone, its stored per-stage
predictions are re-simulated (`simulate_from_plan`), which is all the
schedule's timing depends on, so the Gantt of `show` is the one the search
predicted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeplan.costmodels.graph import Graph
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.overlap import overlap_share
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import predict
from pipeplan.planner.predict_inputs import op_times
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.simulate import SimResult, simulate
from pipeplan.schedules import facts

__all__ = ["config_of", "request_of", "assignment_of", "simulate_plan", "simulate_from_plan", "with_split_extra",
           "with_measured_slowdown", "MEASURED_SPLIT_KEY", "MEASURED_SLOWDOWN_KEY"]

# Where a plan keeps the split-backward extras measured on its own stages (runtime/split_cost.py), so that a
# re-prediction from the graph reproduces the plan's numbers.
MEASURED_SPLIT_KEY = "split_extra_measured_s"
# Where it keeps the side-by-side slowdown measured on its own stages (runtime/side_by_side.py), for the same reason.
MEASURED_SLOWDOWN_KEY = "concurrency_slowdown_measured"
SIDE_BY_SIDE_KEY, OVERLAP_KEY = "concurrency_slowdown_side_by_side", "compute_overlap_share"  # what it came from
# analyze's device-like timing at several microbatch sizes (cli/device_like.py): what it compared, for the plan's note
COMPARED_KEY = "microbatch_sizes_compared"


def config_of(plan: Plan) -> Config:
    """The configuration a plan fixes (its partition aside)."""
    rule = facts(plan.schedule)
    stage_replicas = () if rule.replicates_whole_pipeline else tuple(st.replicas for st in plan.stages)
    return Config(schedule=rule.name, stages=len(plan.stages) // plan.chunks, data_parallel=plan.data_parallel,
                  microbatches=plan.microbatches, chunks=plan.chunks, recompute=plan.recompute,
                  recompute_granularity=plan.recompute_granularity,
                  stage_replicas=stage_replicas, layout=plan.solver.get("layout", "stage-major"), sharding=plan.sharding)


def request_of(plan: Plan) -> PlanRequest:
    """The request settings a plan was predicted under (batch, dtype, optimizer, times, sharding)."""
    return PlanRequest(devices=max(1, plan.devices), batch_size=plan.batch_size, dtype=plan.dtype,
                       optimizer=plan.optimizer, optimizer_kernels=plan.optimizer_kernels, times=plan.times,
                       sharding=plan.sharding,
                       mixed_precision=plan.mixed_precision)


def assignment_of(plan: Plan, graph: Graph) -> list[int]:
    """The stage of every graph layer; a layer the graph lacks is a user error (wrong graph)."""
    index = {name: i for i, name in enumerate(layer.name for layer in graph.layers)}
    assignment = [0] * len(graph.layers)
    try:
        for st in plan.stages:
            for name in st.layers:
                assignment[index[name]] = st.index
    except KeyError as e:
        raise UserError(f"plan names layer {e.args[0]!r}, which the graph does not have",
                        "use the graph the plan was made from") from None
    return assignment


def simulate_plan(plan: Plan, graph: Graph, profile: HardwareProfile) -> SimResult:
    """The plan's timeline (events and memory over time) for plots and Chrome traces, re-predicted exactly."""
    return predict(graph, profile_of(plan.solver, profile), assignment_of(plan, graph), config_of(plan), request_of(plan),
                   ranks=[st.devices for st in plan.stages], keep_events=True,
                   split_extra_s=plan.solver.get(MEASURED_SPLIT_KEY)).sim


def profile_of(solver: dict[str, Any], profile: HardwareProfile) -> HardwareProfile:
    """`profile` as a plan with this solver record was predicted on it: with the side-by-side slowdown measured on
    the plan's own stages in place of calibrate's, where there is one (`with_measured_slowdown`)."""
    measured = solver.get(MEASURED_SLOWDOWN_KEY)
    return profile if measured is None else replace(profile, concurrency_slowdown=float(measured))


def with_measured_slowdown(plan: Plan, graph: Graph, profile: HardwareProfile, slowdown: float,
                           request: PlanRequest | None = None) -> Plan:
    """The plan re-predicted at the side-by-side slowdown measured on its own stages (runtime/side_by_side.py) in
    place of the profile's `concurrency_slowdown` (calibrate's probe), charged on the share of compute during which
    another device computes too (planner/overlap.py; all of it where replicas compute the same steps at once).

    Same partition, configuration and placement (and measured split extras, if any); the factor applied is kept in
    `plan.solver` under `MEASURED_SLOWDOWN_KEY` for `simulate_plan`, the measurement and the share beside it.
    """
    request = request or request_of(plan)
    if plan.data_parallel > 1 or any(st.replicas > 1 for st in plan.stages):
        share = 1.0
    else:
        alone = predict(graph, replace(profile, concurrency_slowdown=1.0), assignment_of(plan, graph), config_of(plan),
                        request, ranks=[st.devices for st in plan.stages], keep_events=True,
                        split_extra_s=plan.solver.get(MEASURED_SPLIT_KEY))
        share = overlap_share(alone.sim.events)
    return _remeasured(plan, graph, profile, request, {
        MEASURED_SLOWDOWN_KEY: 1.0 + (float(slowdown) - 1.0) * share, SIDE_BY_SIDE_KEY: float(slowdown),
        OVERLAP_KEY: share})


def with_split_extra(plan: Plan, graph: Graph, profile: HardwareProfile, extra_s: list[float],
                     request: PlanRequest | None = None) -> Plan:
    """The plan re-predicted with its stages' measured split-backward extras (seconds per stage, the first 0).

    Same partition, configuration and placement; the measurements are kept in `plan.solver` under
    `MEASURED_SPLIT_KEY` for `simulate_plan`. `request`: the search's own (default: what the plan records).
    """
    return _remeasured(plan, graph, profile, request or request_of(plan),
                       {MEASURED_SPLIT_KEY: [float(e) for e in extra_s]})


def _remeasured(plan: Plan, graph: Graph, profile: HardwareProfile, request: PlanRequest,
                measured: dict[str, Any]) -> Plan:
    """The plan re-predicted with `measured` added to what its solver record already holds, with a note per
    measurement (each refinement re-predicts from scratch, so the notes of those before it are written again)."""
    solver = {**plan.solver, **measured}
    split = solver.get(MEASURED_SPLIT_KEY)
    new = predict(graph, profile_of(solver, profile), assignment_of(plan, graph), config_of(plan), request, ranks=[st.devices for st in plan.stages],
                  solver=solver, split_extra_s=split).plan
    new.alternatives = list(plan.alternatives)  # the search's runners-up, which re-predicting this plan leaves alone
    if split is not None:
        ms = ", ".join(f"{e * 1e3:.2f}" for e in split[1:])
        new.notes.append(f"the split backward's extra (torch's B + W beyond a whole backward) was timed on stages 1.. "
                         f"of this plan: {ms} ms a microbatch; the search ranked plans by the calibrated model of it")
    if COMPARED_KEY in solver:
        new.notes.append(compared_note(solver[COMPARED_KEY]))
    if MEASURED_SLOWDOWN_KEY in solver:
        new.notes.append(f"this plan's stages were timed side by side on their cores: {solver[SIDE_BY_SIDE_KEY]:.3f}x "
                         f"slower than alone (calibrate's probe: {profile.concurrency_slowdown:.3f}x); "
                         f"{solver[OVERLAP_KEY]:.0%} of their compute runs beside another device's, so it is charged "
                         f"{solver[MEASURED_SLOWDOWN_KEY]:.3f}x; the search ranked plans by the probe's figure")
    return new


def compared_note(compared: str) -> str:
    """The note of a plan that analyze chose among plans timed like a device at several microbatch sizes."""
    return f"analyze timed the model like a device at several microbatch sizes and kept the fastest plan: {compared}"


def simulate_from_plan(plan: Plan, *, recompute_last: bool = True, receives_wait: bool | None = None) -> SimResult:
    """Re-simulate from the per-stage predictions stored in the plan (no graph needed; used by `show`).

    The plan keeps each stage's per-microbatch forward, backward, recompute
    (`recompute_s`, `wgrad_recompute_s`: StagePrediction.reruns_s) and send times and its all-reduce time.
    `recompute_last=False` replays it as a framework that spares one microbatch's re-run would run it
    (simulate's option: torchgpipe's `checkpoint="except_last"`). `receives_wait` replays it with the receiver
    waiting for each transfer or not (None: as the plan was predicted, its `receives_wait`); False models a
    framework that copies on CUDA streams of its own, overlapped with compute (torchgpipe/copy.py).
    """
    rule = facts(plan.schedule)
    stages = sorted(plan.stages, key=lambda s: s.index)
    p = [s.predicted for s in stages]
    allreduce = [x.allreduce_s for x in p]
    per_stage = not rule.replicates_whole_pipeline
    # PipeDream: a stage with r replicas takes every r-th microbatch and folds its weight all-reduce and update
    # into the backward (PipeDream SOSP'19 §3.1), as planner/predict_inputs.py does; other schedules: r = 1.
    r = [max(1, s.replicas) if per_stage else 1 for s in stages]
    folded = [a + x.optimizer_s for a, x in zip(allreduce, p, strict=True)] if per_stage else [0.0] * len(p)
    # every op also carries the runtime's time around it, as the search simulated it
    # a sharded stage's per-microbatch collectives beside or after its compute, as the plan was predicted
    overhead = [x.op_overhead_s for x in p]
    fwd = op_times([x.fwd_s / k for x, k in zip(p, r, strict=True)], [x.fwd_comm_s for x in p], overhead,
                   overlap=plan.collectives_overlap, slowdown=plan.overlap_slowdown)
    bwd = op_times([(x.bwd_s + a) / k for x, a, k in zip(p, folded, r, strict=True)], [x.bwd_comm_s for x in p],
                   overhead, overlap=plan.collectives_overlap, slowdown=plan.overlap_slowdown)
    reruns = [x.reruns_s(rule.splits_backward) for x in p]
    recompute = [b / k for (b, _), k in zip(reruns, r, strict=True)]
    recompute_w = [w / k for (_, w), k in zip(reruns, r, strict=True)]
    return simulate(
        plan.schedule,
        fwd,
        bwd,
        [x.send_s for x in p],
        plan.microbatches,
        chunks=plan.chunks if rule.interleaves else 1,
        allreduce_s=allreduce if any(allreduce) and not per_stage else None,
        recompute_s=recompute if any(recompute) else None,
        wgrad_s=[x.wgrad_s for x in p] if rule.splits_backward and any(x.wgrad_s for x in p) else None,
        optimizer_s=None if rule.updates_each_microbatch else [x.optimizer_s for x in p],
        tied_stages=plan.tied_stages or None,
        fresh_grad_s=[x.fresh_grad_s / k for x, k in zip(p, r, strict=True)] if any(x.fresh_grad_s for x in p) else None,
        recompute_w_s=recompute_w if rule.splits_backward and any(recompute_w) else None,
        recompute_last=recompute_last,
        receives_wait=plan.receives_wait if receives_wait is None else receives_wait,
    )
