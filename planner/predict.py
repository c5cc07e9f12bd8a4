"""Predictions for one given partition: the function every plan's numbers come from.

The search, the baselines (equal layers, DeepSpeed's "parameters", torchgpipe's
balance_by_time) and `pipeplan show` must predict a partition the same way, or
comparisons between them mean nothing. So all of them go through `predict`:
cost models for stage times, sends and all-reduce, `costmodels.memory.stage_memory`
for memory, and the event simulator (`planner/simulate.py`) for the iteration.

Conventions (docs/plan-format.md):
- "stage" is a virtual stage in model order. Synchronous schedules: stage s runs
  on pipeline device s % P (P = stages / chunks) of every data-parallel replica; the V schedules (zb-v,
  dualpipev) run stage s on device s for s < P, else 2P - 1 - s (pipeplan.schedules.stage_device).
- Synchronous schedules replicate the whole pipeline `data_parallel` times; the
  global batch splits evenly, microbatch = batch / (data_parallel * M), and each
  stage all-reduces its gradients across replicas once per iteration.
- "pipedream" replicates stages individually (`replicas` per stage, PipeDream
  SOSP'19 §3.1): a stage with r replicas takes every r-th microbatch, so its
  per-microbatch occupancy is (fwd + bwd + weight all-reduce) / r, as in
  PipeDream's optimizer; microbatch = batch / M.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.choices import (
    DEFAULT_MIXED_PRECISION,
    DtypeRequest,
    Layout,
    MixedPrecision,
    Optimizer,
    OptimizerKernels,
    RecomputeGranularity,
    Sharding,
    Times,
)
from pipeplan.costmodels.graph import Graph
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict_inputs import (
    StageInputs,
    boundary_bytes,
    collectives_overlap,
    op_times,
    overlap_slowdown,
    receives_wait,
    stage_inputs,
)
from pipeplan.planner.predict_report import assemble_plan
from pipeplan.planner.problem import Problem, build_problem
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.simulate import SimResult, simulate
from pipeplan.schedules import facts, stage_device

__all__ = ["Evaluation", "predict", "evaluate", "graph_summary", "place", "boundary_bytes"]


@dataclass(frozen=True)
class Evaluation:
    """A predicted plan and the simulation it came from (events only when asked for)."""

    plan: Plan
    sim: SimResult


def graph_summary(graph: Graph) -> dict[str, Any]:
    """Plan.graph: what identifies the traced model (the runtime checks the fingerprint)."""
    src = graph.source or {}
    return {
        "fingerprint": graph.fingerprint(),
        "op_fingerprint": graph.op_fingerprint(),  # the runtime's second chance (Graph.op_fingerprint)
        "name": graph.name,
        "model_file": src.get("model_file"),
        "entry": src.get("entry"),
        "seq_len": src.get("seq_len"),  # a Hugging Face config's sequence length: the runtime rebuilds at it
        "depth": src.get("depth"),
        "trace_batch_size": graph.batch_size,
        "layers": len(graph.layers),
    }


def place(pipeline_devices: int, data_parallel: int, layout: str = "stage-major") -> list[list[int]]:
    """Global ranks of each pipeline device's replicas.

    stage-major: a stage's replicas take consecutive ranks (all-reduce stays inside
    a node, sends may cross nodes; PipeDream's placement, `dp.boundary_links`).
    pipeline-major: each pipeline replica takes consecutive ranks (sends stay inside
    a node, the all-reduce crosses nodes).
    """
    P, d = pipeline_devices, data_parallel
    if layout == "stage-major":
        return [[p * d + r for r in range(d)] for p in range(P)]
    if layout == "pipeline-major":
        return [[r * P + p for r in range(d)] for p in range(P)]
    raise ValueError(f"unknown layout {layout!r}")


def _stage_count(assignment: Sequence[int], n: int, chunks: int) -> int:
    """Virtual stages of a valid assignment (every stage used, divisible into chunks)."""
    if len(assignment) != n:
        raise ValueError(f"assignment has {len(assignment)} entries for {n} layers")
    S = max(assignment) + 1
    if sorted(set(assignment)) != list(range(S)):
        raise ValueError("every stage needs at least one layer")
    if S % chunks:
        raise ValueError(f"{S} stages cannot be split into {chunks} chunks per device")
    return S


def _replicas(config: Config, S: int) -> tuple[list[int], int]:
    """(replicas of each virtual stage, data-parallel degree of the whole pipeline)."""
    if not facts(config.schedule).replicates_whole_pipeline:
        reps = list(config.stage_replicas) if config.stage_replicas else [config.data_parallel] * S
        if len(reps) != S:
            raise ValueError(f"replicas has {len(reps)} entries for {S} stages")
        return reps, 1
    if config.stage_replicas and len(set(config.stage_replicas)) > 1:
        raise ValueError(f"{config.schedule} replicates the whole pipeline: replicas must be equal, "
                         f"got {list(config.stage_replicas)}")
    dp = config.stage_replicas[0] if config.stage_replicas else config.data_parallel
    return [dp] * S, dp


def _ranks(config: Config, reps: Sequence[int], S: int, dp: int) -> list[list[int]]:
    """Global ranks of each virtual stage's replicas."""
    if not facts(config.schedule).replicates_whole_pipeline:
        ranks, off = [], 0
        for r in reps:
            ranks.append(list(range(off, off + r)))
            off += r
        return ranks
    P = S // config.chunks
    per_device = place(P, dp, config.layout)
    return [per_device[stage_device(config.schedule, s, P)] for s in range(S)]


def _microbatch_size(request: PlanRequest, M: int, dp: int) -> int:
    B = request.batch_size
    if B % (M * dp):
        raise UserError(f"batch size {B} is not divisible into {M} microbatches" + (f" x {dp} replicas" if dp > 1 else ""),
                        "pick a microbatch count that divides the batch")
    return B // (M * dp)


def _simulate(config: Config, x: StageInputs, overhead_s: Sequence[float], keep_events: bool, *,
              overlap: bool = True, slowdown: float = 0.0, waits: bool = False) -> SimResult:
    """The event simulation of one iteration; the runtime's per-op time is part of every op.

    A sharded stage's per-microbatch collectives run beside its compute on GPUs and in series with it in
    pipeplan's runtime on a local profile (`overlap`), slowing the compute they overlap by `slowdown`
    (predict_inputs.op_times); `waits`: an op waits for its input's transfer (predict_inputs.receives_wait)."""
    rule = facts(config.schedule)
    rc = config.recompute
    fwd = op_times(x.fwd, x.fwd_comm, overhead_s, overlap=overlap, slowdown=slowdown)
    bwd = op_times(x.bwd, x.bwd_comm, overhead_s, overlap=overlap, slowdown=slowdown)
    return simulate(config.schedule, fwd, bwd, x.send, config.microbatches,
                    chunks=config.chunks if rule.interleaves else 1,
                    static_bytes=x.static, activation_bytes_per_mb=x.act,
                    allreduce_s=x.allreduce if rule.replicates_whole_pipeline else None,
                    recompute_s=x.rec if rc else None, recompute_bytes=x.rbytes if rc else None,
                    optimizer_s=None if rule.updates_each_microbatch else x.optimizer,
                    wgrad_s=x.wgrad if rule.splits_backward and x.wgrad else None,
                    tied_stages=x.tied if not rule.flushes else None,
                    fresh_grad_s=x.fresh if any(x.fresh) else None,
                    recompute_w_s=x.rec_w if rc and x.rec_w else None, receives_wait=waits,
                    keep_events=keep_events)


def predict(graph: Graph, profile: HardwareProfile, assignment: Sequence[int], config: Config, request: PlanRequest,
            *, ranks: list[list[int]] | None = None, problem: Problem | None = None,
            solver: dict[str, Any] | None = None, summary: dict[str, Any] | None = None,
            keep_events: bool = False, split_extra_s: Sequence[float] | None = None) -> Evaluation:
    """The plan for partition `assignment` (virtual stage of every layer, in graph order) under `config`.

    `request` supplies what is not the configuration's (batch, dtype, optimizer,
    times); `problem` may be passed when already built for this microbatch;
    `ranks` overrides the placement (a saved plan's own devices); `split_extra_s`, per stage, what torch's split
    backward takes beyond a whole one as measured on the plan's own stages (runtime/split_cost.py), in place of
    the model's (zero-bubble schedules only).
    """
    facts(config.schedule)
    n = len(graph.layers)
    S = _stage_count(assignment, n, config.chunks)
    reps, dp = _replicas(config, S)
    mb = _microbatch_size(request, config.microbatches, dp)
    dtype = request.training_dtype
    if problem is None:
        problem = build_problem(graph, profile, microbatch_size=mb, dtype=dtype, times=request.times,
                                mixed_precision=request.mixed_precision)
    if ranks is None:
        ranks = _ranks(config, reps, S, dp)
    devices = len({r for rs in ranks for r in rs})
    # Devices computing side by side on one machine slow each other (local profiles; 1 on GPUs).
    slow = profile.concurrency_slowdown if devices > 1 else 1.0
    slow_memory = profile.memory_slowdown() if devices > 1 else 1.0
    x = stage_inputs(problem, profile, graph, assignment, config, request, reps, ranks, slow=slow,
                     slow_memory=slow_memory, split_extra_s=split_extra_s)
    # The runtime's own time around every op (calibrated on local profiles, else 0) is part of
    # the iteration but not of the stage's compute: simulated, reported apart from fwd_s/bwd_s.
    overhead_s = [profile.overhead_for(config.schedule, nbytes, extra, alone=S == 1, chunks=config.chunks)
                  for nbytes, extra in zip(x.msg_bytes, x.msg_extra_tensors, strict=True)]
    overlap, slowdown = collectives_overlap(profile), overlap_slowdown(profile)
    waits = receives_wait(profile, config.schedule)
    sim = _simulate(config, x, overhead_s, keep_events, overlap=overlap, slowdown=slowdown, waits=waits)
    plan = assemble_plan(graph, profile, problem, assignment, config, request, x, sim, ranks=ranks, reps=reps,
                         dp=dp, mb=mb, devices=devices, slow=slow, overhead_s=overhead_s, solver=solver,
                         graph_info=dict(summary) if summary is not None else graph_summary(graph),
                         overlap=overlap, slowdown=slowdown, waits=waits)
    return Evaluation(plan, sim)


def evaluate(graph: Graph, profile: HardwareProfile, assignment: Sequence[int], *, schedule: str, microbatches: int,
             batch_size: int, data_parallel: int = 1, stage_replicas: Sequence[int] = (), chunks: int = 1,
             recompute: bool = False, recompute_granularity: RecomputeGranularity = "stage",
             layout: Layout = "stage-major", dtype: DtypeRequest = "fp32",
             optimizer: Optimizer = "adam", times: Times = "model", sharding: Sharding = "none",
             mixed_precision: MixedPrecision = DEFAULT_MIXED_PRECISION, problem: Problem | None = None,
             solver: dict[str, Any] | None = None, optimizer_kernels: OptimizerKernels = "auto") -> Plan:
    """`predict` with its configuration and request spelled as keywords: a one-off prediction of a split.

    `data_parallel` replicates the whole pipeline (synchronous schedules);
    `stage_replicas` gives each stage's replica count (PipeDream).
    """
    config = Config(schedule=facts(schedule).name, stages=(max(assignment) + 1) // chunks, microbatches=microbatches,
                    data_parallel=data_parallel, stage_replicas=tuple(stage_replicas), chunks=chunks,
                    recompute=recompute, recompute_granularity=recompute_granularity if recompute else "stage",
                    layout=layout, sharding=sharding)
    request = PlanRequest(devices=sum(config.replica_counts()), batch_size=batch_size, dtype=dtype,
                          optimizer=optimizer, times=times, mixed_precision=mixed_precision,
                          optimizer_kernels=optimizer_kernels)
    return predict(graph, profile, assignment, config, request, problem=problem, solver=solver).plan
