"""A prediction's numbers as a `Plan`: per-stage predictions, the iteration's, and the notes a user must read.

Kept apart from the arithmetic (`predict_inputs`) and the simulation (`predict`)
so that what a plan records, and in which units, is read in one place
(docs/plan-format.md describes the same fields).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pipeplan.costmodels.compute import local_times_note
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import MemoryBreakdown
from pipeplan.hardware_profiles.loader import profile_reference
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.plan import Plan, Prediction, Stage, StagePrediction
from pipeplan.planner.predict_inputs import StageInputs, shared_stages
from pipeplan.planner.problem import Problem
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.simulate import SimResult
from pipeplan.schedules import facts, stage_device
from pipeplan.units import GIB, MIB

__all__ = ["assemble_plan"]


def _stages(problem: Problem, assignment: Sequence[int], x: StageInputs, *, schedule: str, chunks: int,
            recompute: bool,
            ranks: Sequence[Sequence[int]], reps: Sequence[int], slow: float,
            overhead_s: Sequence[float]) -> list[Stage]:
    n, S = problem.n, len(reps)
    P = S // chunks
    whole = facts(schedule).replicates_whole_pipeline
    stages = []
    for s in range(S):
        mem = x.memory[stage_device(schedule, s, P)]
        f_s = slow * float(sum(problem.fwd_s[i] for i in range(n) if assignment[i] == s))
        b_s = slow * float(sum(problem.bwd_s[i] for i in range(n) if assignment[i] == s))
        b_s += x.split[s] if x.split else 0.0  # zero bubble: torch's split backward beyond a whole one
        per_replica = 1 if whole else reps[s]  # x.rec and x.fresh are per replica where replicas share a stage's work
        rec_s, rec_w = _reruns_s(x, s, schedule, recompute)
        rec_s, rec_w = rec_s * per_replica, rec_w * per_replica
        stages.append(Stage(
            index=s,
            layers=[problem.names[i] for i in range(n) if assignment[i] == s],
            devices=list(ranks[s]),
            replicas=reps[s],
            predicted=StagePrediction(
                fwd_s=f_s, bwd_s=b_s, compute_s=f_s + b_s + reruns_per_microbatch_s(schedule, s, rec_s, rec_w),
                send_s=float(x.send[s]), send_bytes=int(x.send_bytes[s]), allreduce_s=float(x.allreduce[s]),
                optimizer_s=float(x.optimizer[s]),
                memory_bytes=int(mem.total_bytes), weights_bytes=int(mem.weights_bytes),
                optimizer_bytes=int(mem.optimizer_bytes), grad_bytes=int(mem.grad_bytes),
                gathered_bytes=int(mem.gathered_bytes),
                activation_bytes=int(mem.activation_bytes + mem.buffer_bytes + mem.transient_bytes
                                     + mem.deferred_grad_bytes),
                op_overhead_s=float(overhead_s[s]),
                fwd_comm_s=float(x.fwd_comm[s]), bwd_comm_s=float(x.bwd_comm[s]),
                wgrad_s=float(x.wgrad[s]) if x.wgrad else 0.0,
                fresh_grad_s=float(x.fresh[s]) * per_replica if x.fresh else 0.0,
                recompute_s=rec_s, wgrad_recompute_s=rec_w,
            ),
        ))
    return stages


def _reruns_s(x: StageInputs, s: int, schedule: str, recompute: bool) -> tuple[float, float]:
    """Stage s's (one re-run of the forward, the re-runs of its W) under recomputation; (0, 0) without."""
    if not recompute:
        return 0.0, 0.0
    return float(x.rec[s]), float(x.rec_w[s]) if facts(schedule).splits_backward and x.rec_w else 0.0


def reruns_per_microbatch_s(schedule: str, s: int, rec_s: float, rec_w: float) -> float:
    """Stage s's re-runs of one microbatch, which compute_s counts: the backward's (ScheduleFacts.b_reruns) and
    W's. DualPipeV's whole backwards re-run it once without the W's, so there this is an upper bound."""
    return facts(schedule).b_reruns(s) * rec_s + rec_w


def _prediction(graph: Graph, profile: HardwareProfile, request: PlanRequest, memory: Sequence[MemoryBreakdown],
                sim: SimResult, devices: int) -> Prediction:
    cap = int(profile.usable_memory_bytes)
    B = request.batch_size
    peak = max(m.total_bytes for m in memory)
    model_flops = (graph.fwd_flops + graph.bwd_flops) * B / graph.batch_size
    try:
        peak_flops = profile.flops_for(request.training_dtype)
    except ValueError:
        peak_flops = 0.0
    it = float(sim.iteration_s)
    return Prediction(
        iteration_s=it,
        samples_per_s=B / it if it > 0 else math.inf,
        bubble_fraction=float(sim.bubble_fraction),
        peak_memory_bytes=int(peak),
        achieved_flops_fraction=model_flops / it / (devices * peak_flops) if it > 0 and peak_flops else 0.0,
        memory_capacity_bytes=cap,
        fits=peak <= cap,
    )


def _notes(graph: Graph, profile: HardwareProfile, request: PlanRequest, problem: Problem,
           assignment: Sequence[int], memory: Sequence[MemoryBreakdown], mb: int, devices: int) -> list[str]:
    """Memory overflows, tied parameters' copies, a dtype priced at the fp32 rate, whether local stage times are the
    device's own, and a local plan that needs more devices than this machine has."""
    cap = int(profile.usable_memory_bytes)
    notes = []
    for p, m in enumerate(memory):
        if m.total_bytes > cap:
            notes.append(f"device {p} of each pipeline needs {m.total_bytes / GIB:.2f} GiB but {profile.name} has "
                         f"{cap / GIB:.2f} GiB usable")
    for sp, used in shared_stages(graph, problem.names, assignment):
        notes.append(f"shared parameter {sp.name} ({sp.bytes / MIB:.1f} MiB) is used by stages "
                     f"{', '.join(map(str, used))}: each keeps a copy (counted in its memory) and their "
                     f"gradients are all-reduced at the end of the iteration (charged to stage {used[0]})")
    slow = dtype_fallback_note(profile, request.training_dtype)
    if slow:
        notes.append(slow)
    local_note = local_times_note(graph, profile, dtype=request.training_dtype, times=request.times, samples=mb)
    if local_note:
        notes.append(local_note)
    if profile.local and devices > profile.devices_per_node:
        notes.append(local_machines_note(profile, devices))
    return notes


def dtype_fallback_note(profile: HardwareProfile, dtype: str) -> str | None:
    """A 16-bit or tf32 dtype the device has no fast path for runs at its fp32 rate (`HardwareProfile.flops_for`):
    say so, and which dtype is fast there (bf16 on a V100 is priced at 15.7 TFLOP/s, fp16 at 125)."""
    if dtype == "fp32" or profile.peak_flops.get(dtype):
        return None
    rate = profile.flops_for(dtype)
    peaks = {d: float(v) for d, v in profile.peak_flops.items() if v}
    fastest = max(peaks, key=lambda d: peaks[d])
    better = f"; --dtype {fastest} runs at {peaks[fastest] / 1e12:.3g}" if fastest != "fp32" else ""
    return (f"{profile.name} has no {dtype} fast path: {dtype} is priced at its fp32 rate, "
            f"{rate / 1e12:.3g} TFLOP/s{better}")


def local_machines_note(profile: HardwareProfile, devices: int) -> str:
    """A local profile's device is one of this machine's cores (`devices_per_node` of them): a plan for more devices
    spans several such machines, and run on this one its processes would take turns on its cores, which no
    prediction prices (`pipeplan run` warns too: runtime/launch.shared_cores_warning)."""
    machines = -(-devices // profile.devices_per_node)
    per = profile.devices_per_node
    return (f"{devices} devices of the local profile {profile.name} are {machines} machines like this one, which "
            f"holds {per} (its devices_per_node), linked as its inter_node link prices ({profile.inter_node.kind}, "
            f"measured on this machine alone); run on this one machine, the {devices} processes would take turns "
            f"on its cores, which no prediction prices: run with --nnodes {machines}, or plan for --gpus {per} or "
            f"fewer")


def assemble_plan(graph: Graph, profile: HardwareProfile, problem: Problem, assignment: Sequence[int], config: Config,
                  request: PlanRequest, x: StageInputs, sim: SimResult, *, ranks: Sequence[Sequence[int]],
                  reps: Sequence[int], dp: int, mb: int, devices: int, slow: float, overhead_s: Sequence[float],
                  solver: dict[str, Any] | None, graph_info: dict[str, Any], overlap: bool,
                  slowdown: float, waits: bool) -> Plan:
    """The `Plan` of a predicted partition; `overlap`, `slowdown` and `waits` as it was simulated
    (predict._simulate), so `show` and `run` replay the same timeline."""
    stages = _stages(problem, assignment, x, schedule=config.schedule, chunks=config.chunks, recompute=config.recompute, ranks=ranks,
                     reps=reps, slow=slow, overhead_s=overhead_s)
    return Plan(
        graph=graph_info,
        profile=profile_reference(profile),
        schedule=config.schedule,
        microbatches=config.microbatches,
        batch_size=request.batch_size,
        stages=stages,
        predicted=_prediction(graph, profile, request, x.memory, sim, devices),
        devices=devices,
        chunks=config.chunks,
        recompute=bool(config.recompute),
        recompute_granularity=config.recompute_granularity if config.recompute else "stage",
        optimizer=request.optimizer,
        optimizer_kernels=request.optimizer_kernels,
        dtype=request.training_dtype,
        solver=dict(solver or {}),
        notes=_notes(graph, profile, request, problem, assignment, x.memory, mb, devices),
        data_parallel=dp,
        times=request.times,
        sharding=config.sharding,
        mixed_precision=request.mixed_precision,
        collectives_overlap=overlap,
        overlap_slowdown=slowdown,
        receives_wait=waits,
        tied_stages=[list(g) for g in x.tied],
    )
