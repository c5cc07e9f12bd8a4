"""Per-stage inputs of a prediction: compute, sends, all-reduce and memory of each virtual stage.

`planner/predict.py` turns a partition into these numbers, then simulates and
reports them; the arithmetic lives here so each cost has one short function
with its source (sends: `costmodels.comm.p2p_time_s`; all-reduce:
`allreduce_time_s`, and for ZeRO `half_ring_time_s`; the optimizer step: `costmodels.optimizer_step`;
memory: `costmodels.memory.stage_memory`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pipeplan.costmodels.comm import allreduce_time_s, collective_link, half_ring_time_s, p2p_time_s
from pipeplan.costmodels.grad_passes import dp_flatten_s, grad_scale_s, unscale_s
from pipeplan.costmodels.graph import Graph, Layer, SharedParam, trainable_params, weight_grad_time_share
from pipeplan.costmodels.memory import (
    MemoryBreakdown,
    Sends,
    accumulating_grad_bytes,
    checkpointed_bytes,
    chunk_receive_bytes,
    is_mixed_precision,
    model_state_bytes,
    saved_beyond_received,
    split_rerun_bytes,
    stage_memory,
    transient_over_saved,
    walked_held_bytes,
    walked_recomputed_bytes,
)
from pipeplan.costmodels.optimizer_step import optimizer_step_s, stash_copy_s
from pipeplan.costmodels.recompute import (
    block_runs,
    checkpoint_overhead_s,
    cold_read_s,
    rerun_forward_s,
    rerun_shares,
    weight_grad_passes,
)
from pipeplan.costmodels.split_backward import split_backward_extra_s
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.problem import Problem
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.walks import cut_sends, keeps_sends, kept_send_counts, walk_orders, walks
from pipeplan.precision import scales_loss
from pipeplan.schedules import device_stages, facts

__all__ = ["StageInputs", "stage_inputs", "boundary_bytes", "boundary_tensors", "contiguous", "shared_stages", "op_times",
           "collectives_overlap", "overlap_slowdown", "receives_wait"]


FLAG_BYTES = 4  # fp16's "an inf somewhere" flag, one float all-reduced over every device (runtime/loss_scale.py)

# Compute running beside a collective on the same GPU is slower than alone: Lee et al., "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114, 2025), abstract:
# "an average computational slowdown of 18.9%, with a maximum of 40.0%", GPT and LLaMA training on A100, H100,
# MI250 and MI210 (NCCL/RCCL kernels occupy SMs: a GEMM sized to one wave spills into a second).
OVERLAP_COMPUTE_SLOWDOWN = 0.189


def collectives_overlap(profile: HardwareProfile) -> bool:
    """Whether a plan on `profile` runs its ZeRO collectives beside compute (a GPU framework) or in series
    (pipeplan's runtime on a local profile, the only runtime a local profile's plan runs on)."""
    return not profile.local


def receives_wait(profile: HardwareProfile, schedule: str) -> bool:
    """Whether the simulator makes an op wait for its input's transfer once its device reaches it (simulate's
    `receives_wait`), or starts the transfer at the producer's end.

    torch.distributed.pipelining (a schedule's `torch_class`) posts an op's receives when it comes to the op and
    waits on them, so it waits. PipeDream's own loop (runtime/pipedream_comm.py, the schedules without a torch
    class) posts a microbatch's receives ahead, the gradient's with the forward's send, so they arrive while the
    stage computes: it does not. Where the runtime's time around each op was measured (`profiles calibrate` on
    pipeplan's local runtime, hardware_profiles/op_overhead.py), that measured gap already holds the wait, counted
    from the producer's end.
    """
    return not profile.op_overhead_s and facts(schedule).torch_class is not None


def overlap_slowdown(profile: HardwareProfile) -> float:
    """How much slower compute runs beside a collective on `profile`: `OVERLAP_COMPUTE_SLOWDOWN` on a GPU (its
    source measured GPUs), 0 where that source measured nothing (TPUs) or nothing overlaps (a local profile)."""
    return OVERLAP_COMPUTE_SLOWDOWN if collectives_overlap(profile) and profile.gpu_vendor() else 0.0


def op_times(compute_s: Sequence[float], comm_s: Sequence[float], overhead_s: Sequence[float], *,
             overlap: bool, slowdown: float = 0.0) -> list[float]:
    """Each stage's simulated op: its compute with its per-microbatch collectives (ZeRO-2/3), plus the runtime's time.

    GPU frameworks run the collectives beside the compute (FSDP prefetches the next all-gather and DeepSpeed
    buckets the reduce-scatter behind the backward: Zhao et al., VLDB 2023, §3.3): the op takes the longer.
    pipeplan's own runtime on a local profile runs them in series, inside the op (runtime/sharding.wrap_stage:
    gather, compute, reduce-scatter on one thread over gloo): the op takes the sum. Measured on this machine's
    2 cores (GPT example, 1 stage x 2 replicas, ZeRO-3): a backward of 22.3 ms unsharded took 27.2 ms sharded,
    while max() predicted 21.5 ms.
    Overlap is not free on a GPU: the collective's kernels take SMs and memory bandwidth from the compute they run
    beside, so that compute runs `slowdown` (`overlap_slowdown`) slower for as long as they overlap; the op takes
    max(compute + slowdown x min(compute, comm), comm).
    """
    if overlap:
        return [max(c + slowdown * min(c, m), m) + oh
                for c, m, oh in zip(compute_s, comm_s, overhead_s, strict=True)]
    return [c + m + oh for c, m, oh in zip(compute_s, comm_s, overhead_s, strict=True)]


@dataclass
class StageInputs:
    """Everything the simulator and the memory model need, per virtual stage / device."""

    fwd: list[float]
    bwd: list[float]
    rec: list[float]
    send: list[float]
    allreduce: list[float]  # once per iteration after the stage's last backward (all-reduce; ZeRO: see _sync_times)
    fwd_comm: list[float]  # ZeRO-3: collectives of every forward (overlapped with it: the op takes the longer)
    bwd_comm: list[float]  # ZeRO-2/3: collectives of every backward (likewise)
    send_bytes: list[int]
    static: list[int]
    act: list[int]
    rbytes: list[int]
    memory: list[MemoryBreakdown]  # per pipeline device
    msg_bytes: list[int]  # per stage: what each of its ops sends and receives (activation out + in, or their gradients)
    optimizer: list[float] = field(default_factory=list)  # each stage's optimizer step (PipeDream: folded into bwd)
    wgrad: list[float] = field(default_factory=list)  # of bwd, the weight-gradient part W (zero bubble: _wgrad)
    tied: list[list[int]] = field(default_factory=list)  # stages holding one tied parameter (shared_stages)
    fresh: list[float] = field(default_factory=list)  # of bwd (W), what a backward into fresh gradients saves
    rec_w: list[float] = field(default_factory=list)  # zero bubble + recomputation: the re-runs each W makes (_w_reruns)
    split: list[float] = field(default_factory=list)  # of bwd (W), what torch's split backward adds (_split_extra)
    msg_extra_tensors: list[int] = field(default_factory=list)  # per stage: tensors its ops' messages carry beyond one each


def contiguous(assignment: Sequence[int]) -> bool:
    return all(b - a in (0, 1) for a, b in zip(assignment, assignment[1:], strict=False)) and (not assignment or assignment[0] == 0)


def boundary_bytes(problem: Problem, assignment: Sequence[int], stages: int) -> list[int]:
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


def boundary_tensors(graph: Graph, names: Sequence[str], assignment: Sequence[int], stages: int) -> list[int]:
    """Tensors per microbatch crossing each stage boundary (index s: from stage s to s+1): every tensor made before
    the boundary and read after it, as the runtime sends them (runtime/split.py's live-in sets: a skip connection's
    tensor is forwarded by the stages it spans, one tensor of each boundary). An edge that names no tensors (an
    imported profile) is one tensor of its source."""
    stage_of = {names[i]: assignment[i] for i in range(len(names))}
    crossing: list[set[str]] = [set() for _ in range(max(0, stages - 1))]
    for e in graph.edges:
        if e.src not in stage_of or e.dst not in stage_of:
            continue
        tensors = [f"{e.src}/{t}" for t in e.tensors or [""]]
        for b in range(stage_of[e.src], stage_of[e.dst]):
            crossing[b].update(tensors)
    return [len(c) for c in crossing] + [0] * (stages > 0)


def shared_stages(graph: Graph, names: Sequence[str], assignment: Sequence[int]) -> list[tuple[SharedParam, list[int]]]:
    """(parameter, stages using it) for each parameter tied across stages."""
    stage_of = {names[i]: assignment[i] for i in range(len(names))}
    shared = []
    for sp in graph.shared_params:
        used = sorted({stage_of[name] for name in sp.layers if name in stage_of})
        if len(used) > 1:
            shared.append((sp, used))
    return shared


@dataclass(frozen=True)
class _Sums:
    f: list[float]
    b: list[float]
    params: list[int]
    own_params: list[int]
    saved: list[int]
    largest: list[int]  # fp32 bytes of the stage's largest layer's trainable parameters (what ZeRO-2/3 hold unsharded)
    transient: list[int]  # one microbatch's peak beyond the stage's saved bytes (memory.transient_over_saved)
    deferred: list[int]  # gradients a split backward's B keeps for W, per microbatch (0 on the first stage)
    w_rerun: list[int]  # recomputed under a split backward: what a W holds (memory.split_rerun_bytes)
    loss_saved: list[int]  # the loss's saved bytes on the last stage, 0 elsewhere
    input_saved: list[int]  # of saved, what its first layer saves of its received input (memory.saved_beyond_received)
    frozen: list[int]  # of own_params, those without gradients: weights only (memory.model_state_bytes)

    def trainable(self, s: int) -> int:
        """Stage s's parameter bytes with gradients (tied copies included): what it reduces and steps."""
        return self.params[s] - self.frozen[s]


def _stage_sums(problem: Problem, assignment: Sequence[int], S: int, slow: float,
                shared: Sequence[tuple[int, list[int]]], recompute: bool = False) -> _Sums:
    """Per-stage compute and bytes. A parameter tied across stages (e.g. GPT-2's embedding and
    LM head) is owned by its first user's stage; every other stage using it keeps a copy with
    its own gradients and optimizer state, as Megatron-LM does with its embedding group."""
    f, b = [0.0] * S, [0.0] * S
    params, saved, largest, transient, deferred, frozen = [0] * S, [0] * S, [0] * S, [0] * S, [0] * S, [0] * S
    members: list[list[int]] = [[] for _ in range(S)]  # each stage's layers, in order
    for i in range(problem.n):
        s = assignment[i]
        members[s].append(i)
        f[s] += slow * problem.fwd_s[i]
        b[s] += slow * problem.bwd_s[i]
        params[s] += problem.param_bytes[i]
        frozen[s] += problem.frozen[i]
        saved[s] += problem.saved_bytes[i]
        largest[s] = max(largest[s], problem.param_bytes[i] - problem.frozen[i])
        if problem.deferred_grad_bytes and s > 0:  # torch skips the first stage's B (memory.held_with_deferred)
            deferred[s] += problem.deferred_grad_bytes[i]
    own_params = list(params)
    for nbytes, used in shared:
        for s in used[1:]:
            params[s] += nbytes
    last = assignment[problem.n - 1] if problem.n else 0  # the stage computing the loss (outside its checkpoint)
    loss_saved = [problem.loss_saved_bytes if s == last else 0 for s in range(S)]
    input_saved = [problem.input_saved_bytes[mine[0]] if mine and problem.input_saved_bytes else 0
                   for mine in members]
    w_rerun = [0] * S
    # split backwards run only on torch's stages, which save their received buffer (memory.saves_received_buffer)
    if recompute and problem.nonweight_saved_bytes and problem.weight_passes:
        input_nonweight = [problem.input_nonweight_saved_bytes[mine[0]]
                           if mine and problem.input_nonweight_saved_bytes else 0 for mine in members]
        w_rerun = [split_rerun_bytes(max(0, saved[s] - input_saved[s]), loss_saved[s],
                                     max(0, sum(problem.nonweight_saved_bytes[i] for i in mine) - input_nonweight[s]),
                                     sum(problem.weight_passes[i] for i in mine), first=s == 0)
                   for s, mine in enumerate(members)]
    if problem.transient_bytes:
        transient = [transient_over_saved([problem.saved_bytes[i] for i in mine],
                                          [problem.transient_bytes[i] for i in mine], loss_apart=recompute and s == last)
                     for s, mine in enumerate(members)]
    return _Sums(f, b, params, own_params, saved, largest, transient, deferred, w_rerun, loss_saved, input_saved,
                 frozen)


class _Held(NamedTuple):
    """Per stage, what one microbatch holds until its backward: without recomputation its saves beyond its received
    input (memory.saved_beyond_received); recomputed, its checkpointed inputs (`kept`) and what one re-run brings
    back (`rerun`), per block where recomputed a block at a time."""

    saved: list[int]
    kept: list[int]
    rerun: list[int]


def _held_per_microbatch(sums: _Sums, schedule: str, in_bytes: Sequence[int],
                         blocked: Sequence[tuple[int, int, int]] | None) -> _Held:
    saved = [saved_beyond_received(x, first, schedule) for x, first in zip(sums.saved, sums.input_saved, strict=True)]
    if blocked:
        return _Held(saved, [b[0] for b in blocked], [b[1] for b in blocked])
    return _Held(saved, list(in_bytes), saved)


def _send_times(profile: HardwareProfile, schedule: str, out_bytes: Sequence[int], reps: Sequence[int],
                ranks: Sequence[Sequence[int]]) -> list[float]:
    """Per stage: sending its output to the next stage, one microbatch (the slowest replica pair)."""
    S = len(out_bytes)
    send = []
    for s in range(S):
        if s == S - 1 or out_bytes[s] == 0:
            send.append(0.0)
        elif not facts(schedule).replicates_whole_pipeline:
            link = profile.link_between(ranks[s][-1], ranks[s + 1][0])
            # r_s x r_{s+1} replicas share the boundary; each microbatch crosses one link.
            send.append(p2p_time_s(out_bytes[s], link) / min(reps[s], reps[s + 1]))
        else:
            send.append(max(p2p_time_s(out_bytes[s], profile.link_between(a, c))
                            for a, c in zip(ranks[s], ranks[s + 1], strict=False)))
    return send


@dataclass(frozen=True)
class _Sync:
    step_end: list[float]
    fwd: list[float]
    bwd: list[float]


def _sync_times(profile: HardwareProfile, config: Config, request: PlanRequest, own_params: Sequence[int],
                own_frozen: Sequence[int], reps: Sequence[int], ranks: Sequence[Sequence[int]],
                shared: Sequence[tuple[int, list[int]]]) -> _Sync:
    """Per stage: the data-parallel collectives among its replicas, where the frameworks put them.

    Unsharded: one gradient all-reduce after the last backward. ZeRO-1 (Megatron's
    distributed optimizer, DeepSpeed stage 1): a reduce-scatter of the gradients
    there, then an all-gather of the updated parameters. ZeRO-2 (DeepSpeed stage 2
    reduces every micro-step): a reduce-scatter after every backward, the all-gather
    at the end. ZeRO-3/FSDP: every forward and every backward all-gathers the
    parameters and every backward reduce-scatters the gradients (ZeRO §7.2.2:
    1.5x an all-reduce's traffic per pass); nothing is left for the end. Sizes are
    the full gradients (grad dtype) and weights (compute dtype), as
    `model_state_bytes` counts them. Frozen parameters (`own_frozen` of `own_params`) have no gradient, are
    never updated and stay whole on every replica (runtime/sharding.py): nothing of theirs is reduced or gathered.
    Tied copies: one all-reduce over every copy, charged to the owner.
    """
    S = len(own_params)
    step_end, fwd, bwd = [0.0] * S, [0.0] * S, [0.0] * S
    for s in range(S):
        if reps[s] < 2:
            continue
        full = model_state_bytes(own_params[s], optimizer=request.optimizer, dtype=request.training_dtype,
                                 mixed_precision=request.mixed_precision, frozen_bytes_fp32=own_frozen[s])
        gathered = model_state_bytes(own_params[s] - own_frozen[s], optimizer=request.optimizer,
                                     dtype=request.training_dtype, mixed_precision=request.mixed_precision).weights_bytes
        rs = half_ring_time_s(full.grad_bytes, reps[s],
                              collective_link(profile, ranks[s], "reduce_scatter", full.grad_bytes))
        ag = half_ring_time_s(gathered, reps[s], collective_link(profile, ranks[s], "all_gather", gathered))
        if config.sharding == "none":
            step_end[s] = allreduce_time_s(full.grad_bytes, reps[s],
                                           collective_link(profile, ranks[s], "allreduce", full.grad_bytes))
        elif config.sharding == "zero1":
            step_end[s] = rs + ag
        elif config.sharding == "zero2":
            step_end[s], bwd[s] = ag, rs
        else:
            fwd[s], bwd[s] = ag, ag + rs
    for nbytes, used in shared:
        group = sorted({r for s in used for r in ranks[s]})
        grad = model_state_bytes(nbytes, optimizer=request.optimizer, dtype=request.training_dtype,
                                 mixed_precision=request.mixed_precision).grad_bytes
        step_end[used[0]] += allreduce_time_s(grad, len(group), collective_link(profile, group, "allreduce", grad))
    return _Sync(step_end, fwd, bwd)


def _with_flatten(profile: HardwareProfile, config: Config, step_end: Sequence[float], grads: Sequence[int],
                  reps: Sequence[int], tensors: Sequence[int], slow: float, *, divides: bool) -> list[float]:
    """Each stage's end-of-step sync with the runtime's copies around an unsharded all-reduce (its gradients into
    one buffer, divided unless fp16 weighted the loss already: costmodels/grad_passes.dp_flatten_s), which every
    replica makes at once."""
    return [t + (slow * dp_flatten_s(grads[s], profile=profile, tensors=tensors[s], divides=divides)
                 if reps[s] > 1 and config.sharding == "none" else 0.0)
            for s, t in enumerate(step_end)]


def _with_unscale(profile: HardwareProfile, opt: Sequence[float], grads: Sequence[int], tensors: Sequence[int],
                  ranks: Sequence[Sequence[int]], slow: float) -> list[float]:
    """fp16's update: each stage's gradients unscaled and checked (costmodels/grad_passes.unscale_s; the division
    by M it replaces is not in `opt`), and one flag all-reduced over every device before any steps
    (runtime/loss_scale.py)."""
    everyone = sorted({r for rs in ranks for r in rs})
    flag_s = allreduce_time_s(FLAG_BYTES, len(everyone), collective_link(profile, everyone, "allreduce", FLAG_BYTES))
    return [o + slow * unscale_s(grads[s], profile=profile, tensors=tensors[s]) + flag_s for s, o in enumerate(opt)]


def _grad_bytes(param_bytes: int, request: PlanRequest) -> int:
    """The gradients' bytes of `param_bytes` of fp32 parameters, in the recipe's gradient dtype."""
    return model_state_bytes(param_bytes, optimizer=request.optimizer, dtype=request.training_dtype,
                             mixed_precision=request.mixed_precision).grad_bytes


def _backward_part(problem: Problem, assignment: Sequence[int], S: int, slow: float,
                   share: dict[str, float]) -> list[float]:
    """Per stage, the part of its backward that `share` (layer name -> share of the layer's backward) names: every
    layer's device backward time times its share, so a traced share carries to the device's time."""
    out = [0.0] * S
    for i in range(problem.n):
        out[assignment[i]] += slow * problem.bwd_s[i] * share.get(problem.names[i], 0.0)
    return out


def _wgrad(problem: Problem, graph: Graph, assignment: Sequence[int], S: int, slow: float) -> list[float]:
    """Each stage's weight-gradient time W: every layer's backward time times its W share
    (costmodels.graph.weight_grad_time_share: the traced time split, else the FLOP split, else the rule)."""
    return _backward_part(problem, assignment, S, slow, {layer.name: weight_grad_time_share(layer)
                                                        for layer in graph.layers})


def _first_stage_whole_w(wgrad: list[float], bwd: Sequence[float]) -> list[float]:
    """W per stage as torch runs a split backward: the first stage's W is its whole backward and its B empty.

    torch.distributed.pipelining (torch 2.13 stage.py, `PipelineStage.backward_one_chunk`) skips the
    input-gradient pass on the first stage, whose input needs no gradient, and its `backward_weight_one_chunk`
    then runs autograd.backward over the whole stage. Measured on examples/mlp.py's stage 0 under ZB-V: B
    ~0.05 ms and W 22-25 ms, against 9.7 and 15.0 ms by its layers' W shares. With recomputation that W
    re-runs the forward once and the empty B none (simulate._rerun_before_b, _w_reruns).
    """
    return [bwd[0], *wgrad[1:]]


def _fresh_saving(problem: Problem, graph: Graph, assignment: Sequence[int], S: int, slow: float) -> list[float]:
    """What each stage's backward saves when it writes fresh gradients instead of adding into existing ones:
    every layer's backward time times its traced share of adds (`grad_accumulate_s`, costmodels/accumulate.py);
    0 for a layer whose adds were not timed (analytic, imported, untimed or older graphs)."""
    return _backward_part(problem, assignment, S, slow, {
        layer.name: min(1.0, layer.grad_accumulate_s / layer.bwd_s)
        for layer in graph.layers if layer.grad_accumulate_s is not None and layer.bwd_s > 0})


def _device_memory(config: Config, request: PlanRequest, sums: _Sums, in_bytes: Sequence[int],
                   out_bytes: Sequence[int], reps: Sequence[int], model_out_bytes: int, held: _Held,
                   blocked: Sequence[tuple[int, int, int]] | None = None) -> list[MemoryBreakdown]:
    """Peak memory of each pipeline device (all its chunks), from `stage_memory`; `model_out_bytes`: the model's
    output per microbatch (the last layer's outputs), which the device holding the last stage keeps; `held`: what
    a microbatch holds per stage (`_held_per_microbatch`), for a walk (planner/walks.py); `blocked`: recomputed a block at a
    time, each stage's `checkpointed_bytes` (a device's chunks: kept adds up, one re-run)."""
    rule = facts(config.schedule)
    S = len(in_bytes)
    P = S // config.chunks
    orders = walk_orders(config, P) if walks(config.schedule) else None
    cuts = cut_sends(config.schedule, P, in_bytes, out_bytes, model_out_bytes) if keeps_sends(config.schedule) else None
    counted = kept_send_counts(config) if cuts is not None and orders is None else None  # ZB-H1: the counts + sends
    memory = []
    for p in range(P):
        mine = device_stages(config.schedule, p, P, S // P)
        walked = None
        if orders is not None and cuts is not None:  # this device's weight gradient being added in, at its W's
            adding = accumulating_grad_bytes(max(sums.largest[s] for s in mine), schedule=config.schedule,
                                             microbatches=config.microbatches, optimizer=request.optimizer,
                                             dtype=request.training_dtype, mixed_precision=request.mixed_precision,
                                             sharding=config.sharding if reps[p] > 1 else "none")
            walked = _walked(config, sums, held, orders[p], in_bytes, cuts._replace(accumulating=adding))
        memory.append(stage_memory(
            param_bytes=sum(sums.params[s] for s in mine), frozen_param_bytes=sum(sums.frozen[s] for s in mine),
            saved_bytes_per_mb=sum(sums.saved[s] for s in mine),
            input_bytes_per_mb=max(in_bytes[s] for s in mine),
            output_bytes_per_mb=max(out_bytes[s] for s in mine),
            schedule=config.schedule, stages=P, stage=p,
            microbatches=config.microbatches,  # async PipeDream's K - s ignores it: pipeplan/schedules.py
            optimizer=request.optimizer, dtype=request.training_dtype, recompute=config.recompute,
            chunks=config.chunks if rule.interleaves else 1, mixed_precision=request.mixed_precision,
            sharding=config.sharding, shards=reps[p], largest_layer_param_bytes=max(sums.largest[s] for s in mine),
            stage_replicas=None if rule.replicates_whole_pipeline else reps,  # PipeDream: the runtime's count
            transient_bytes=max(sums.transient[s] for s in mine),
            model_output_bytes_per_mb=model_out_bytes if S - 1 in mine else 0,
            deferred_grad_bytes_per_mb=_per_deferring_stage(sums.deferred, mine),
            held_bytes=walked, kept_bytes=_kept_sent(counted[p], cuts, mine) if counted and cuts else None,
            loss_saved_bytes_per_mb=max(sums.loss_saved[s] for s in mine) if config.recompute else 0,
            w_rerun_bytes=max(sums.w_rerun[s] for s in mine) if rule.splits_backward else 0,
            checkpointed=(sum(blocked[s][0] for s in mine), max(blocked[s][1] for s in mine)) if blocked else None,
            input_saved_bytes_per_mb=sum(sums.input_saved[s] for s in mine),
            receive_bytes=chunk_receive_bytes(config.schedule, mine, in_bytes, out_bytes, config.microbatches),
        ))
    return memory


def _kept_sent(counts: tuple[int, int, int], cuts: Sends, mine: Sequence[int]) -> int:
    """What a counted device whose runtime keeps its sends holds of them (`kept_send_counts`: outputs, input
    gradients, model outputs), at its stage's cuts."""
    outs, grads, model_outs = counts
    return sum(outs * cuts.out[s] + grads * cuts.grad[s] + model_outs * (cuts.model_out if s == cuts.last else 0)
               for s in mine)


def block_checkpoints(problem: Problem, assignment: Sequence[int], in_bytes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Each stage's `checkpointed_bytes` (kept per microbatch, one re-run, in flight beyond it) with a checkpoint per
    block (`Problem.blocks`)."""
    block_of, passed, last_reader = problem.blocks
    transient = problem.transient_bytes or (0,) * problem.n
    members: list[list[int]] = [[] for _ in in_bytes]
    for i, s in enumerate(assignment):
        members[s].append(i)
    return [checkpointed_bytes(in_bytes[s], [passed[i] for i in mine], [problem.saved_bytes[i] for i in mine],
                               [transient[i] for i in mine], [block_of[i] for i in mine],
                               [last_reader[i] > mine[-1] for i in mine])
            for s, mine in enumerate(members)]


def _per_deferring_stage(deferred: Sequence[int], mine: Sequence[int]) -> int:
    """A device's gradients kept for W per (chunk-)microbatch: the mean over its virtual stages but the model's
    first (whose B torch skips, so the pending counts of `schedules.weight_pass_points` leave it out)."""
    deferring = [deferred[s] for s in mine if s > 0]
    return math.ceil(sum(deferring) / len(deferring)) if deferring else 0


def _walked(config: Config, sums: _Sums, held: _Held, order: Sequence[tuple[str, int, int]], in_bytes: Sequence[int],
            sends: Sends) -> tuple[int, int, int]:
    """A device (`walks`) walked over its order (`walk_orders`) with each virtual stage's own bytes and what its ops
    leave live (memory.walked_held_bytes, and recomputed memory.walked_recomputed_bytes: each stage's checkpointed
    inputs and re-runs). A checkpoint keeps its stage's received input as it is, the receive buffer counted apart
    (chunk_receive_bytes): only the model's first stage, whose input is the microbatch, keeps its own."""
    if not config.recompute:
        return walked_held_bytes(order, held.saved, sums.deferred, sums.transient, sends)
    kept = [k - (int(b) if s > 0 else 0) for s, (k, b) in enumerate(zip(held.kept, in_bytes, strict=True))]
    return walked_recomputed_bytes(order, kept, held.rerun, sums.w_rerun, sums.loss_saved, sums.deferred,
                                   sums.transient, sends)


def stage_inputs(problem: Problem, profile: HardwareProfile, graph: Graph, assignment: Sequence[int], config: Config,
                 request: PlanRequest, reps: Sequence[int], ranks: Sequence[Sequence[int]], *,
                 slow: float = 1.0, slow_memory: float = 1.0,
                 split_extra_s: Sequence[float] | None = None) -> StageInputs:
    """The per-stage numbers of a partition, ready for the simulator and the report (`split_extra_s`: measured
    per stage, see `_split_extra`). `slow` scales compute and `slow_memory` the memory-bound update passes
    (flatten, optimizer, unscale, stash) for devices working side by side on one machine (predict: the profile's
    `concurrency_slowdown` and `memory_slowdown()`)."""
    S = len(reps)
    shared = [(int(sp.bytes), used) for sp, used in shared_stages(graph, problem.names, assignment)]
    rc = config.recompute
    sums = _stage_sums(problem, assignment, S, slow, shared, rc)
    out_bytes = boundary_bytes(problem, assignment, S)
    in_bytes = [problem.input_bytes] + out_bytes[:-1]
    blocked = block_checkpoints(problem, assignment, in_bytes) \
        if rc and config.recompute_granularity == "block" else None
    if blocked:  # what a stage holds beyond its kept inputs is one block's re-run, not the stage's saves
        sums = replace(sums, transient=[t for _, _, t in blocked])
    send = _send_times(profile, config.schedule, out_bytes, reps, ranks)
    sync = _sync_times(profile, config, request, sums.own_params, sums.frozen, reps, ranks, shared)
    tensors = _param_tensors(graph, problem.names, assignment, S)
    trainable = [sums.trainable(s) for s in range(S)]
    grads = [_grad_bytes(p, request) for p in trainable]
    scaled = scales_loss(request.training_dtype, config.schedule)
    allreduce = _with_flatten(profile, config, sync.step_end, grads, reps, tensors, slow_memory, divides=not scaled)
    opt = _optimizer_times(profile, config, request, trainable, grads, reps, slow_memory, tensors, scaled=scaled)
    if scaled:
        opt = _with_unscale(profile, opt, grads, tensors, ranks, slow_memory)
    if not facts(config.schedule).flushes:  # each update also stashes a new weight version (optimizer_step.py)
        opt = [o + slow_memory * stash_copy_s(trainable[s], profile=profile) for s, o in enumerate(opt)]
    splits = facts(config.schedule).splits_backward
    layers = _stage_layers(graph, problem.names, assignment, S) if rc or splits else []
    rec = rerun_times(problem, profile, assignment, layers, slow, blocks=bool(blocked),
                      slow_memory=slow_memory) if rc else [0.0] * S
    fwd, bwd = list(sums.f), list(sums.b)
    fresh = _fresh_saving(problem, graph, assignment, S, slow)
    if not facts(config.schedule).replicates_whole_pipeline:  # a stage with r replicas takes every r-th microbatch
        fwd = [sums.f[s] / reps[s] for s in range(S)]
        bwd = [(sums.b[s] + allreduce[s] + opt[s]) / reps[s] for s in range(S)]  # PipeDream updates every microbatch
        rec = [rec[s] / reps[s] for s in range(S)]
        fresh = [fresh[s] / reps[s] for s in range(S)]
    held = _held_per_microbatch(sums, config.schedule, in_bytes, blocked)
    memory = _device_memory(config, request, sums, in_bytes, out_bytes, reps,
                            problem.output_bytes[-1] if problem.n else 0, held, blocked)
    # Simulator memory: the device's fixed part, and per microbatch what stays until its backward.
    static = [m.weights_bytes + m.optimizer_bytes + m.gathered_bytes + m.buffer_bytes for m in memory]
    act = held.kept if rc else held.saved
    rbytes = held.rerun if rc else [0] * S
    # An op's messages: a forward receives its input and sends its output, a backward the gradients of both; a
    # boundary between two stages on the same devices (the turn of a V) is a hand-over in memory, no message.
    remote = [list(ranks[s]) != list(ranks[s + 1]) for s in range(S - 1)]
    msg = _over_remote_cuts(out_bytes, remote)
    # torch posts a message per tensor, each with its own cost (HardwareProfile.overhead_for's per-tensor term)
    extra = _over_remote_cuts([max(0, n - 1) for n in boundary_tensors(graph, problem.names, assignment, S)], remote)
    wgrad = _wgrad(problem, graph, assignment, S, slow) if splits else []
    rec_w: list[float] = []
    split: list[float] = []
    if wgrad:
        wgrad = _first_stage_whole_w(wgrad, bwd)
        split = _split_extra(profile, layers, slow, split_extra_s)
        wgrad = [w + e for w, e in zip(wgrad, split, strict=True)]
        bwd = [b + e for b, e in zip(bwd, split, strict=True)]
        fresh = [min(f, w) for f, w in zip(fresh, wgrad, strict=True)]  # the adds are part of W (AccumulateGrad)
        rec_w = _w_reruns(layers, rec) if rc else []
    return StageInputs(fwd, bwd, rec, send, allreduce, sync.fwd, sync.bwd, out_bytes, static, act, rbytes, memory,
                       msg, opt, wgrad, [list(used) for _, used in shared], fresh, rec_w, split, extra)


def _over_remote_cuts(per_cut: Sequence[int], remote: Sequence[bool]) -> list[int]:
    """Per stage, the sum of `per_cut` (index s: the boundary from stage s to s+1) over the stage's two boundaries
    that cross devices: what an op receives and sends. A boundary between two stages on the same devices (the turn
    of a V) is a hand-over in memory, no message."""
    S = len(remote) + 1
    return [(per_cut[s - 1] if s > 0 and remote[s - 1] else 0) + (per_cut[s] if s < S - 1 and remote[s] else 0)
            for s in range(S)]


def _split_extra(profile: HardwareProfile, layers: Sequence[Sequence[Layer]], slow: float,
                 measured_s: Sequence[float] | None = None) -> list[float]:
    """What each stage's split backward takes beyond its whole backward (costmodels/split_backward.py), charged to
    its W; none on the first stage, whose W is one whole backward (`_first_stage_whole_w`).

    `measured_s`: the stages' own extras timed on one core (runtime/split_cost.py), used instead of the model;
    like the traced layer times, they are scaled by the slowdown of cores computing side by side.
    """
    if measured_s is not None:
        if len(measured_s) != len(layers):
            raise ValueError(f"{len(measured_s)} measured split extras for {len(layers)} stages")
        return [0.0, *(slow * max(0.0, float(e)) for e in measured_s[1:])]
    return [0.0, *(slow * split_backward_extra_s(layers[s], per_split_s=profile.split_backward_s,
                                                  per_group_s=profile.split_backward_group_s,
                                                  mem_bw_bytes_per_s=profile.mem_bw_bytes_per_s)
                   for s in range(1, len(layers)))]


def _stage_layers(graph: Graph, names: Sequence[str], assignment: Sequence[int], S: int) -> list[list[Layer]]:
    """Each stage's layers, in execution order."""
    layers: list[list[Layer]] = [[] for _ in range(S)]
    for i, name in enumerate(names):
        layers[assignment[i]].append(graph.layer(name))
    return layers


def _w_reruns(layers: Sequence[Sequence[Layer]], rec: Sequence[float]) -> list[float]:
    """What each stage's zero-bubble W spends re-running its forward under recomputation: one re-run (`rec`) per
    parameter group (costmodels/recompute.weight_grad_passes: torch calls autograd.grad once per group, and each
    call re-runs the checkpointed forward); one on the first stage, whose W is one whole backward."""
    return [rec[0], *(weight_grad_passes(layers[s]) * rec[s] for s in range(1, len(rec)))]


def rerun_times(problem: Problem, profile: HardwareProfile, assignment: Sequence[int],
                layers: Sequence[Sequence[Layer]], slow: float, *, blocks: bool = False,
                slow_memory: float = 1.0) -> list[float]:
    """Each stage's re-run under recomputation (`layers`: each stage's, _stage_layers): its forward up to its last
    saved tensor, plus the host time of torch's checkpoint around it, per stage and per tensor its forward saves
    (costmodels/recompute.py), plus on this machine's CPU reading the inputs the re-run runs on from DRAM
    (`cold_read_s`, times `slow_memory` as the other memory-bound passes). `blocks`: a checkpoint per block
    (`Problem.blocks`), each re-run up to its own last save, each with the checkpoint's host time and its own
    cold inputs."""
    S = len(layers)
    fwd: list[list[float]] = [[] for _ in range(S)]
    index: list[list[int]] = [[] for _ in range(S)]
    blocks_of: list[list[int]] = [[] for _ in range(S)]
    for i, s in enumerate(assignment):
        fwd[s].append(slow * problem.fwd_s[i])
        index[s].append(i)
        blocks_of[s].append(problem.blocks[0][i] if blocks else 0)
    cpu = profile.local_cpu()  # elsewhere the cold read is free (cold_read_s): no need to count its bytes
    into: list[list[tuple[int, int]]] = [[] for _ in range(problem.n if cpu else 0)]
    for src, dst, nbytes in problem.edges if cpu else ():
        into[dst].append((src, nbytes))
    total = [0.0] * S
    for s in range(S):
        for a, b in block_runs(blocks_of[s]):
            mine = layers[s][a:b]
            total[s] += (rerun_forward_s(mine, fwd[s][a:b])
                         + slow * checkpoint_overhead_s(mine, profile.recompute_overhead_s, profile.recompute_tensor_s))
            if cpu:
                cold = _cold_input_bytes(problem, into, index[s][a:b], rerun_shares(mine))
                total[s] += slow_memory * cold_read_s(cold, profile)
    return total


def _cold_input_bytes(problem: Problem, into: Sequence[Sequence[tuple[int, int]]], region: Sequence[int],
                      shares: Sequence[float]) -> float:
    """Bytes a region's re-run reads of tensors made outside it (the model's input for the first layer): each
    layer's inputs from outside times the share of it the re-run runs, a tensor read by several of its layers
    once (edges carry a source's bytes per reader)."""
    inside = set(region)
    cold: dict[int, float] = {}
    for i, share in zip(region, shares, strict=True):
        sources = [*into[i], *([(-1, problem.input_bytes)] if i == 0 else [])]
        for src, nbytes in sources:
            if src not in inside:
                cold[src] = max(cold.get(src, 0.0), share * nbytes)
    return sum(cold.values())


def _param_tensors(graph: Graph, names: Sequence[str], assignment: Sequence[int], S: int) -> list[int]:
    """Parameter tensors each stage's optimizer steps: the distinct trainable parameters its layers use (a tied one
    in every stage holding a copy; a frozen one has no gradient to step)."""
    layers = {layer.name: layer for layer in graph.layers}
    fqns: list[set[str]] = [set() for _ in range(S)]
    for i, name in enumerate(names):
        fqns[assignment[i]].update(trainable_params(layers[name]))
    return [len(f) for f in fqns]


def _optimizer_times(profile: HardwareProfile, config: Config, request: PlanRequest, params: Sequence[int],
                     grads: Sequence[int], reps: Sequence[int], slow: float, tensors: Sequence[int], *,
                     scaled: bool) -> list[float]:
    """Each stage's optimizer step (costmodels/optimizer_step.py), after the division of its gradients (`grads`
    bytes in `tensors` tensors) by M that every update of M > 1 microbatches but async PipeDream's makes
    (`grad_scale_s`; priced for a batch-mean loss, which the graph does not record: a summed one skips it), unless
    fp16's loss scaling weighted the losses instead (`scaled`: its unscaling is `_with_unscale`'s). Under
    ZeRO a replica steps its shard only, one flat tensor (runtime/sharding.py), but divides its full gradients
    first; devices stepping side by side on one machine share its memory bandwidth (`slow`: the profile's
    `memory_concurrency_slowdown`)."""
    mixed = is_mixed_precision(request.training_dtype)
    sharded = config.sharding != "none"
    scales = config.microbatches > 1 and not facts(config.schedule).updates_each_microbatch and not scaled
    return [slow * (optimizer_step_s(params[s] / (reps[s] if sharded else 1), optimizer=request.optimizer,
                                     mixed_precision=mixed, profile=profile, kernels=request.optimizer_kernels,
                                     tensors=min(1, tensors[s]) if sharded else tensors[s])
                    + (grad_scale_s(grads[s], profile=profile, tensors=tensors[s]) if scales else 0.0))
            for s in range(len(params))]
