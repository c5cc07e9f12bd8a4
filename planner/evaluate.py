"""Predictions for one given partition: the function every plan's numbers come from.

The search, the baselines (equal layers, DeepSpeed's "parameters", torchgpipe's
balance_by_time) and `pipeplan show` must predict a partition the same way, or
comparisons between them mean nothing. So all of them go through `evaluate`:
cost models for stage times, sends and all-reduce, `costmodels.memory.stage_memory`
for memory, and the event simulator (`planner/simulate.py`) for the iteration.

Conventions (docs/plan-format.md):
- "stage" is a virtual stage in model order. Synchronous schedules: stage s runs
  on pipeline device s % P (P = stages / chunks) of every data-parallel replica.
- Synchronous schedules replicate the whole pipeline `data_parallel` times; the
  global batch splits evenly, microbatch = batch / (data_parallel * M), and each
  stage all-reduces its gradients across replicas once per iteration.
- "pipedream" replicates stages individually (`replicas` per stage, PipeDream
  SOSP'19 §3.1): a stage with r replicas takes every r-th microbatch, so its
  per-microbatch occupancy is (fwd + bwd + weight all-reduce) / r, as in
  PipeDream's optimizer; microbatch = batch / M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.costmodels.comm import allreduce_time_s, group_link, p2p_time_s
from pipeplan.costmodels.compute import local_times_note
from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import model_state_bytes, stage_memory
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.plan import SCHEDULES, Plan, Prediction, Stage, StagePrediction
from pipeplan.planner.problem import Problem, build_problem
from pipeplan.planner.simulate import SimResult, simulate

GIB = 2**30
LAYOUTS = ("stage-major", "pipeline-major")


def graph_summary(graph: Graph) -> dict:
    """Plan.graph: what identifies the traced model (the runtime checks the fingerprint)."""
    src = graph.source or {}
    return {
        "fingerprint": graph.fingerprint(),
        "name": graph.name,
        "model_file": src.get("model_file"),
        "entry": src.get("entry"),
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


def contiguous(assignment: list[int]) -> bool:
    return all(b - a in (0, 1) for a, b in zip(assignment, assignment[1:])) and (not assignment or assignment[0] == 0)


def boundary_bytes(problem: Problem, assignment: list[int], stages: int) -> list[int]:
    """Bytes per microbatch crossing each stage boundary (index s: from stage s to s+1).

    Contiguous assignments use the problem's cut bytes (exact, a tensor counted once
    per boundary it spans). For DAG assignments a producer's bytes crossing a
    boundary are the sum of its crossing edges, capped at its output size (one
    tensor read by several later stages crosses once).
    """
    if contiguous(assignment):
        out = [0] * stages
        for i in range(len(assignment) - 1):
            if assignment[i] != assignment[i + 1]:
                out[assignment[i]] = problem.cut_bytes[i]
        return out
    per_src: dict[tuple[int, int], int] = {}
    for src, dst, nbytes in problem.edges:
        for b in range(assignment[src], assignment[dst]):
            per_src[(src, b)] = per_src.get((src, b), 0) + nbytes
    out = [0] * stages
    for (src, b), nbytes in per_src.items():
        out[b] += min(nbytes, problem.output_bytes[src])
    return out


@dataclass
class _Inputs:
    """Everything the simulator and the memory model need, per virtual stage / device."""

    fwd: list[float]
    bwd: list[float]
    rec: list[float]
    send: list[float]
    allreduce: list[float]
    send_bytes: list[int]
    static: list[int]
    act: list[int]
    rbytes: list[int]
    memory: list  # MemoryBreakdown per pipeline device
    msg_bytes: list[int]  # per stage: what each of its ops sends and receives (activation out + in, or their gradients)


def evaluate(graph: Graph, profile: HardwareProfile, assignment: list[int], *, replicas: list[int] | int | None = None,
             schedule: str, microbatches: int, batch_size: int, dtype: str = "fp32", optimizer: str = "adam",
             recompute: bool = False, times: str = "model", chunks: int = 1, layout: str = "stage-major",
             problem: Problem | None = None, solver: dict | None = None) -> Plan:
    """Predictions for the partition `assignment` (stage index of every layer, in graph order).

    `replicas`: an int (or equal list) is the data-parallel degree of the whole
    pipeline for synchronous schedules; for "pipedream" a list gives each stage's
    replica count. `problem` may be passed when already built for this microbatch.
    """
    plan, _ = predict(graph, profile, assignment, replicas=replicas, schedule=schedule, microbatches=microbatches,
                      batch_size=batch_size, dtype=dtype, optimizer=optimizer, recompute=recompute, times=times,
                      chunks=chunks, layout=layout, problem=problem, solver=solver)
    return plan


def simulate_plan(plan: Plan, graph: Graph, profile: HardwareProfile) -> SimResult:
    """The plan's timeline (events and memory over time) for plots and Chrome traces."""
    index = {name: i for i, name in enumerate(l.name for l in graph.layers)}
    assignment = [0] * len(graph.layers)
    try:
        for st in plan.stages:
            for name in st.layers:
                assignment[index[name]] = st.index
    except KeyError as e:
        raise UserError(f"plan names layer {e.args[0]!r}, which the graph does not have",
                        "use the graph the plan was made from") from None
    replicas = [st.replicas for st in plan.stages] if plan.schedule == "pipedream" else plan.data_parallel
    _, sim = predict(graph, profile, assignment, replicas=replicas, schedule=plan.schedule,
                     microbatches=plan.microbatches, batch_size=plan.batch_size, dtype=plan.dtype,
                     optimizer=plan.optimizer, recompute=plan.recompute, times=plan.times, chunks=plan.chunks,
                     ranks=[st.devices for st in plan.stages], keep_events=True)
    return sim


def predict(graph: Graph, profile: HardwareProfile, assignment: list[int], *, replicas, schedule: str,
            microbatches: int, batch_size: int, dtype: str, optimizer: str, recompute: bool, times: str = "model",
            chunks: int = 1, layout: str = "stage-major", ranks: list[list[int]] | None = None,
            problem: Problem | None = None, solver: dict | None = None, summary: dict | None = None,
            keep_events: bool = False) -> tuple[Plan, SimResult]:
    """`evaluate` plus the simulation result (events only when keep_events)."""
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    n = len(graph.layers)
    if len(assignment) != n:
        raise ValueError(f"assignment has {len(assignment)} entries for {n} layers")
    S = max(assignment) + 1
    if sorted(set(assignment)) != list(range(S)):
        raise ValueError("every stage needs at least one layer")
    if S % chunks:
        raise ValueError(f"{S} stages cannot be split into {chunks} chunks per device")
    P = S // chunks
    M, B = microbatches, batch_size
    if schedule == "pipedream":
        reps = [replicas] * S if isinstance(replicas, int) else list(replicas or [1] * S)
        if len(reps) != S:
            raise ValueError(f"replicas has {len(reps)} entries for {S} stages")
        dp = 1
    else:
        if isinstance(replicas, (list, tuple)):
            if len(set(replicas)) > 1:
                raise ValueError(f"{schedule} replicates the whole pipeline: replicas must be equal, got {replicas}")
            replicas = replicas[0] if replicas else 1
        dp = int(replicas or 1)
        reps = [dp] * S
    if B % (M * dp):
        raise UserError(f"batch size {B} is not divisible into {M} microbatches" + (f" x {dp} replicas" if dp > 1 else ""),
                        "pick a microbatch count that divides the batch")
    mb = B // (M * dp)
    if problem is None:
        problem = build_problem(graph, profile, microbatch_size=mb, dtype=dtype, times=times)

    # Ranks of each virtual stage's replicas.
    if ranks is None:
        if schedule == "pipedream":
            ranks, off = [], 0
            for r in reps:
                ranks.append(list(range(off, off + r)))
                off += r
        else:
            per_device = place(P, dp, layout)
            ranks = [per_device[s % P] for s in range(S)]
    devices = len({r for rs in ranks for r in rs})

    stage_of = {problem.names[i]: assignment[i] for i in range(n)}
    shared = []  # (bytes, stages using it) for parameters tied across stages
    for sp in graph.shared_params:
        used = sorted({stage_of[name] for name in sp.layers if name in stage_of})
        if len(used) > 1:
            shared.append((int(sp.bytes), used))
    # Devices computing side by side on one machine slow each other (local profiles; 1 on GPUs).
    slow = profile.concurrency_slowdown if devices > 1 else 1.0
    x = _inputs(problem, profile, assignment, S, P, chunks, reps, ranks, shared=shared, schedule=schedule, M=M, dtype=dtype,
                optimizer=optimizer, recompute=recompute, slow=slow)
    # The runtime's own time around every op (calibrated on local profiles, else 0) is part of
    # the iteration but not of the stage's compute: simulated, reported apart from fwd_s/bwd_s.
    o = [profile.overhead_for(schedule, nbytes) for nbytes in x.msg_bytes]
    sim = simulate(schedule, [f + oh for f, oh in zip(x.fwd, o)], [b + oh for b, oh in zip(x.bwd, o)], x.send, M,
                   chunks=chunks if schedule == "interleaved" else 1,
                   static_bytes=x.static, activation_bytes_per_mb=x.act,
                   allreduce_s=None if schedule == "pipedream" else x.allreduce,
                   recompute_s=x.rec if recompute else None, recompute_bytes=x.rbytes if recompute else None,
                   keep_events=keep_events)

    cap = int(profile.usable_memory_bytes)
    names = problem.names
    stages = []
    for s in range(S):
        p = s % P
        mem = x.memory[p]
        f_s = slow * float(sum(problem.fwd_s[i] for i in range(n) if assignment[i] == s))
        b_s = slow * float(sum(problem.bwd_s[i] for i in range(n) if assignment[i] == s))
        stages.append(Stage(
            index=s,
            layers=[names[i] for i in range(n) if assignment[i] == s],
            devices=list(ranks[s]),
            replicas=reps[s],
            predicted=StagePrediction(
                fwd_s=f_s,
                bwd_s=b_s,
                compute_s=f_s + b_s + (f_s if recompute else 0.0),
                send_s=float(x.send[s]),
                send_bytes=int(x.send_bytes[s]),
                allreduce_s=float(x.allreduce[s]),
                memory_bytes=int(mem.total_bytes),
                weights_bytes=int(mem.weights_bytes),
                optimizer_bytes=int(mem.optimizer_bytes),
                activation_bytes=int(mem.activation_bytes + mem.buffer_bytes),
                op_overhead_s=float(o[s]),
            ),
        ))
    peak = max(m.total_bytes for m in x.memory)
    model_flops = (graph.fwd_flops + graph.bwd_flops) * B / graph.batch_size
    try:
        peak_flops = profile.flops_for(dtype)
    except ValueError:
        peak_flops = 0.0
    it = float(sim.iteration_s)
    pred = Prediction(
        iteration_s=it,
        samples_per_s=B / it if it > 0 else math.inf,
        bubble_fraction=float(sim.bubble_fraction),
        peak_memory_bytes=int(peak),
        achieved_flops_fraction=model_flops / it / (devices * peak_flops) if it > 0 and peak_flops else 0.0,
        memory_capacity_bytes=cap,
        fits=peak <= cap,
    )
    notes = []
    for p, m in enumerate(x.memory):
        if m.total_bytes > cap:
            notes.append(f"device {p} of each pipeline needs {m.total_bytes / GIB:.2f} GiB but {profile.name} has "
                         f"{cap / GIB:.2f} GiB usable")
    for sp in graph.shared_params:
        used = sorted({stage_of[l] for l in sp.layers if l in stage_of})
        if len(used) > 1:
            notes.append(f"shared parameter {sp.name} ({sp.bytes / 2**20:.1f} MiB) is used by stages "
                         f"{', '.join(map(str, used))}: each keeps a copy (counted in its memory) and their "
                         f"gradients are all-reduced at the end of the iteration (charged to stage {used[0]})")
    local_note = local_times_note(graph, profile, dtype=dtype, times=times, samples=mb) if profile is not None else None
    if local_note:
        notes.append(local_note)
    plan = Plan(
        graph=dict(summary) if summary is not None else graph_summary(graph),
        profile=profile.name,
        schedule=schedule,
        microbatches=M,
        batch_size=B,
        stages=stages,
        predicted=pred,
        devices=devices,
        chunks=chunks,
        recompute=bool(recompute),
        optimizer=optimizer,
        dtype=dtype,
        solver=dict(solver or {}),
        notes=notes,
        data_parallel=dp,
        times=times,
    )
    return plan, sim


def _inputs(problem: Problem, profile: HardwareProfile, assignment: list[int], S: int, P: int, chunks: int,
            reps: list[int], ranks: list[list[int]], *, shared: list[tuple[int, list[int]]], schedule: str, M: int,
            dtype: str, optimizer: str, recompute: bool, slow: float = 1.0) -> _Inputs:
    n = problem.n
    f = [0.0] * S
    b = [0.0] * S
    params = [0] * S
    saved = [0] * S
    for i in range(n):
        s = assignment[i]
        f[s] += slow * problem.fwd_s[i]
        b[s] += slow * problem.bwd_s[i]
        params[s] += problem.param_bytes[i]
        saved[s] += problem.saved_bytes[i]
    # A parameter tied across stages (e.g. GPT-2's embedding and LM head) is owned by its
    # first user's stage; every other stage using it keeps a copy with its own gradients
    # and optimizer state, as Megatron-LM does with its embedding group.
    own_params = list(params)
    for nbytes, used in shared:
        for s in used[1:]:
            params[s] += nbytes
    out_bytes = boundary_bytes(problem, assignment, S)
    in_bytes = [problem.input_bytes] + out_bytes[:-1]

    send = []
    for s in range(S):
        if s == S - 1 or out_bytes[s] == 0:
            send.append(0.0)
            continue
        if schedule == "pipedream":
            link = profile.link_between(ranks[s][-1], ranks[s + 1][0])
            # r_s x r_{s+1} replicas share the boundary; each microbatch crosses one link.
            send.append(p2p_time_s(out_bytes[s], link) / min(reps[s], reps[s + 1]))
        else:
            send.append(max(p2p_time_s(out_bytes[s], profile.link_between(a, c)) for a, c in zip(ranks[s], ranks[s + 1])))

    allreduce = []
    for s in range(S):
        grad = model_state_bytes(own_params[s], optimizer=optimizer, dtype=dtype).grad_bytes
        allreduce.append(allreduce_time_s(grad, reps[s], group_link(profile, ranks[s])) if reps[s] > 1 else 0.0)
    for nbytes, used in shared:  # the tied copies' gradients: one all-reduce over every copy
        group = sorted({r for s in used for r in ranks[s]})
        grad = model_state_bytes(nbytes, optimizer=optimizer, dtype=dtype).grad_bytes
        allreduce[used[0]] += allreduce_time_s(grad, len(group), group_link(profile, group))

    rec = [f[s] if recompute else 0.0 for s in range(S)]
    fwd, bwd = list(f), list(b)
    if schedule == "pipedream":  # a stage with r replicas takes every r-th microbatch (PipeDream §3.1)
        fwd = [f[s] / reps[s] for s in range(S)]
        bwd = [(b[s] + allreduce[s]) / reps[s] for s in range(S)]
        rec = [rec[s] / reps[s] for s in range(S)]

    memory = []
    for p in range(P):
        mine = list(range(p, S, P))
        memory.append(stage_memory(
            param_bytes=sum(params[s] for s in mine),
            saved_bytes_per_mb=sum(saved[s] for s in mine),
            input_bytes_per_mb=max(in_bytes[s] for s in mine),
            output_bytes_per_mb=max(out_bytes[s] for s in mine),
            schedule=schedule, stages=P, stage=p,
            # async PipeDream keeps K - s in flight whatever M is (no flush)
            microbatches=max(M, P) if schedule == "pipedream" else M,
            optimizer=optimizer, dtype=dtype, recompute=recompute,
            chunks=chunks if schedule == "interleaved" else 1,
        ))
    # Simulator memory: the device's fixed part, and per microbatch what stays until its backward.
    static = [m.weights_bytes + m.optimizer_bytes + m.buffer_bytes for m in memory]
    act = [in_bytes[s] if recompute else saved[s] for s in range(S)]
    rbytes = [saved[s] if recompute else 0 for s in range(S)]
    # An op's messages: a forward receives its input and sends its output, a backward the gradients of both.
    msg = [(in_bytes[s] if s > 0 else 0) + (out_bytes[s] if s < S - 1 else 0) for s in range(S)]
    return _Inputs(fwd, bwd, rec, send, allreduce, out_bytes, static, act, rbytes, memory, msg)
