"""Memory per pipeline stage: model state + activations in flight + receive buffers.

Why a closed form and not the simulator: the partitioner asks "does layers
[i, j) fit on stage s?" thousands of times, so every term here is a small pure
function of the stage's byte counts and the schedule. The SEARCH helper's
simulator replays the same schedules event by event and must agree with
`inflight_microbatches` (it is the oracle both are tested against).

Conventions
- `param_bytes` is always the fp32 size of the stage's parameters (4 B each), as traced.
- Activation byte counts passed to `stage_memory` are taken as they are: pass
  bytes in the training dtype (multiply traced fp32 bytes by
  `activation_bytes_scale(dtype)` first). Keeping the scaling out of
  `stage_memory` means a caller who already scaled cannot scale twice and
  under-predict memory.
- Stages are 0-indexed: s = 0..K-1. For the interleaved schedule a "stage" is a
  device (p devices, v model chunks each), see `inflight_microbatches`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeplan.choices import (
    DEFAULT_MIXED_PRECISION,
    DTYPES,
    MIXED_PRECISION_DTYPES,
    MIXED_PRECISIONS,
    OPTIMIZERS,
    SHARDINGS,
)
from pipeplan.costmodels.recompute import block_runs
from pipeplan.errors import UserError
from pipeplan.schedules import facts, inflight_microbatches, stage_device, stashed_weight_versions, weight_pass_points
from pipeplan.v_orders import walk

__all__ = [
    "ModelState", "MemoryBreakdown", "RangeMemory",
    "model_state_bytes", "gathered_bytes", "activation_bytes_scale", "activation_bytes", "stage_memory", "is_mixed_precision",
    "inflight_microbatches", "stashed_weight_versions", "interleaved_activation_factor", "OPTIMIZERS", "DTYPES",
]

# fp32 optimizer-state buffers per parameter (SGD: none; momentum: the velocity;
# Adam/AdamW: first and second moments). Source: ZeRO (Rajbhandari et al. 2019) §3.1.
_STATE_BUFFERS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def _check(value: str, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise UserError(f"unknown {what} {value!r}", f"use one of: {', '.join(allowed)}")
    return value


def is_mixed_precision(dtype: str) -> bool:
    """bf16/fp16 mean mixed precision: 16-bit weights/activations, fp32 master weights."""
    return _check(dtype, DTYPES, "dtype") in MIXED_PRECISION_DTYPES


@dataclass(frozen=True)
class ModelState:
    weights_bytes: int  # the copy the forward/backward reads (fp32, or 16-bit in mixed precision); this device's share
    grad_bytes: int  # gradients (16-bit or fp32, see `model_state_bytes`); this device's share
    optimizer_bytes: int  # fp32 master copy (mixed precision) + optimizer state buffers (+ main grads); this share
    total_bytes: int


def _unsharded_parts(n: int, optimizer: str, dtype: str, mixed_precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer-side bytes) of parameters of n fp32 bytes, nothing sharded.

    DeepSpeed / the ZeRO paper (§3.1): 16-bit weights and gradients (2 + 2 bytes a
    parameter), fp32 master weights and Adam's two moments (4 + 8): 16 bytes.
    Megatron-LM (README, "bytes per parameter"; docs distrib_optimizer.md): bf16
    weights with fp32 gradients (2 + 4 + 4 + 8 = 18 bytes); fp16 weights and
    gradients plus an fp32 main-gradient copy in the optimizer (2 + 2 + 4 + 4 + 8 = 20).
    torch.autocast (`pipeplan run`; torchtitan's DDP or one-device runs, `maybe_enable_amp`): fp32 weights,
    gradients and state, plus the 16-bit copy of each weight it casts, cached until the step's autocast region
    ends (aten/src/ATen/autocast_mode.cpp, `cached_cast`): 4 + 2 + 4 + state (18 with Adam). Judgement: every
    weight counted as cast; norms' and embeddings' weights, which autocast leaves fp32, are a small share of the
    models pipelined.
    fp32/tf32 training: 4 + 4 + state, the same in every recipe (Megatron's "fp32: 16").
    """
    state = _STATE_BUFFERS[optimizer] * n
    if not is_mixed_precision(dtype):
        return n, n, state
    if mixed_precision == "autocast":
        return n + n // 2, n, state
    if mixed_precision == "megatron":
        return (n // 2, n, n + state) if dtype == "bf16" else (n // 2, n // 2, 2 * n + state)
    return n // 2, n // 2, n + state


def _shard(weights: int, grads: int, opt: int, sharding: str, shards: int) -> tuple[int, int, int]:
    """Each device's share under a ZeRO level (Rajbhandari et al. §5.1-5.3): ZeRO-1 splits the
    optimizer side (Megatron's distributed optimizer: master weights, moments, main grads) over the
    `shards` replicas, ZeRO-2 the gradients too, ZeRO-3 the weights too; shares round up."""
    level = SHARDINGS.index(sharding)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if level >= 1:
        opt = -(-opt // shards)
    if level >= 2:
        grads = -(-grads // shards)
    if level >= 3:
        weights = -(-weights // shards)
    return weights, grads, opt


def model_state_bytes(param_bytes_fp32: int, *, optimizer: str, dtype: str, mixed_precision: str = DEFAULT_MIXED_PRECISION,
                      sharding: str = "none", shards: int = 1, frozen_bytes_fp32: int = 0) -> ModelState:
    """Bytes one device keeps of weights, gradients and optimizer state for parameters of `param_bytes_fp32`, of
    which `frozen_bytes_fp32` need no gradient: those keep their weights only, whole on every replica (no `.grad`;
    the optimizer is never given them, so no master copy or state; pipeplan's runtime shards the trainable
    parameters only, runtime/sharding.py, where FSDP would shard frozen weights under ZeRO-3 too).

    Per parameter (Ψ parameters, d = `shards`, the stage's replicas), as the cited tables give them:
    - DeepSpeed (ZeRO paper §3.1 and its table 1, mixed-precision Adam, K = 12):
      16Ψ; ZeRO-1 4Ψ + 12Ψ/d; ZeRO-2 2Ψ + 14Ψ/d; ZeRO-3 16Ψ/d.
    - Megatron-LM (README table, d = data-parallel size): bf16 18Ψ, distributed
      optimizer (ZeRO-1) 6Ψ + 12Ψ/d; fp16 20Ψ and 4Ψ + 16Ψ/d; fp32 16Ψ and 8Ψ + 8Ψ/d.
    SGD keeps no state, momentum one fp32 buffer. tf32 is fp32 storage.
    """
    _check(optimizer, OPTIMIZERS, "optimizer")
    _check(mixed_precision, MIXED_PRECISIONS, "mixed-precision recipe")
    _check(sharding, SHARDINGS, "sharding")
    if param_bytes_fp32 < 0 or not 0 <= frozen_bytes_fp32 <= param_bytes_fp32:
        raise ValueError(f"parameter bytes {param_bytes_fp32} with {frozen_bytes_fp32} frozen")
    parts = _unsharded_parts(param_bytes_fp32 - frozen_bytes_fp32, optimizer, dtype, mixed_precision)
    weights, grads, opt = _shard(*parts, sharding, shards)
    weights += _unsharded_parts(frozen_bytes_fp32, optimizer, dtype, mixed_precision)[0]
    return ModelState(weights, grads, opt, weights + grads + opt)


def gathered_bytes(largest_layer_param_bytes: int, *, optimizer: str, dtype: str, mixed_precision: str = DEFAULT_MIXED_PRECISION,
                   sharding: str = "none") -> int:
    """Transient full-size tensors a sharded stage holds while it computes.

    ZeRO-2 reduce-scatters gradients as backward produces them, so one layer's
    full gradient waits for its reduce-scatter (DeepSpeed's `reduce_bucket_size`
    buckets; a layer here). ZeRO-3/FSDP gathers a layer's full weights for its
    forward and backward and prefetches the next one's (FSDP, Zhao et al. VLDB
    2023 §3.3-3.4: the peak is the sharded model plus the unsharded units in
    flight; DeepSpeed's `stage3_prefetch_bucket_size`): two layers' weights and
    one layer's full gradient. Judgement: the layer is the unit (torchtitan wraps
    each transformer block; the tracer's layers are blocks or finer).
    """
    if sharding in ("none", "zero1"):
        return 0
    full = model_state_bytes(largest_layer_param_bytes, optimizer=optimizer, dtype=dtype,
                             mixed_precision=mixed_precision)
    return full.grad_bytes + (2 * full.weights_bytes if sharding == "zero3" else 0)


def activation_bytes_scale(dtype: str) -> float:
    """Factor from traced (fp32) activation bytes to the training dtype's bytes.

    Source: mixed-precision training (Micikevicius et al., ICLR 2018, §3) stores
    activations in 16 bits; Korthikanti et al. (2022) §4 count activation memory
    at 2 bytes/element for the same reason. tf32 only changes the matmul unit;
    tensors stay fp32. (A judgement: autocast keeps a few tensors such as softmax
    statistics in fp32; they are a small share and are ignored.)
    """
    return 0.5 if is_mixed_precision(dtype) else 1.0


def interleaved_activation_factor(stages: int, chunks: int) -> float:
    """Korthikanti et al. (2022) §4.2.3: first-stage activation memory multiplier (1 + (p-1)/(p*v)).

    Relative to the non-interleaved 1F1B first stage (p microbatches of its layers).
    """
    return 1.0 + (stages - 1) / (stages * chunks)


@dataclass(frozen=True)
class MemoryBreakdown:
    weights_bytes: int  # compute-dtype weights, plus stashed versions for async PipeDream
    optimizer_bytes: int  # gradients + optimizer state + fp32 master copy
    activation_bytes: int  # saved for backward, for the in-flight microbatches
    buffer_bytes: int  # receive buffers: one microbatch's input and output gradient
    total_bytes: int
    inflight: int = 0  # microbatches (or chunk-microbatches, interleaved) held at the peak
    weight_versions: int = 1  # copies of the weights kept (PipeDream weight stashing)
    grad_bytes: int = 0  # the gradients' part of optimizer_bytes (this device's share)
    gathered_bytes: int = 0  # ZeRO-2/3: full-size layer weights and gradients held while computing (in total_bytes)
    transient_bytes: int = 0  # one microbatch's peak beyond the stage's saved activations (in total_bytes)
    deferred_grad_bytes: int = 0  # split backwards: output gradients B keeps for the pending W's (in total_bytes)


def activation_bytes(*, saved_bytes_per_mb: int, input_bytes_per_mb: int, inflight: int, recompute: bool,
                     chunks: int = 1) -> int:
    """Activation bytes held at the stage's peak.

    Without recomputation: `inflight` microbatches' saved activations
    (interleaved: `inflight` chunk-microbatches, each 1/v of the device's saved
    bytes, chunks assumed equal). With recomputation (GPipe §2.3 re-materialization;
    Chen et al. 2016; Korthikanti et al. 2022 table 2 "full recompute: layer input
    only"): the stage inputs of the in-flight microbatches plus one microbatch's
    full activations while its backward runs, never more than without recomputation.
    """
    if inflight < 0:
        raise ValueError("negative in-flight count")
    return _held_activations(saved_bytes_per_mb, input_bytes_per_mb, inflight, recompute, chunks)


def _held_activations(saved: int, inb: int, inflight: int, recompute: bool, chunks: int, loss_saved: int = 0,
                      loss_kept: int = 0, rerun: int | None = None) -> int:
    """`activation_bytes` without the checks and keywords: the partitioner calls it millions of times.
    `loss_saved`: on the last stage, what the loss saves, which runs outside a recomputed stage's checkpoint
    (runtime/recompute.py): while one microbatch's backward re-runs the stage, the `loss_kept` others between their
    loss and their backward keep it beside their inputs (`losses_waiting`: GPipe's last stage M - 1).
    Recomputed, `inb` is what a microbatch keeps until its backward (its checkpoints' inputs) and `rerun` what one
    re-run brings back at a time: None, the whole stage's saves (one checkpoint per stage); per block, the largest
    block's (`checkpointed_bytes`)."""
    full = math.ceil(saved * inflight / chunks)
    if not recompute:
        return full
    again = math.ceil(saved / chunks) if rerun is None else rerun
    return min(full, math.ceil(inb * inflight / chunks) + loss_kept * loss_saved + again)


def checkpointed_bytes(input_bytes: int, passed_bytes: Sequence[int], saved_bytes: Sequence[int],
                       transient_bytes: Sequence[int], block_of: Sequence[int],
                       sent: Sequence[bool] | None = None) -> tuple[int, int, int]:
    """(kept per microbatch, one re-run, tensors in flight beyond it) of a stage whose every block is a checkpoint of
    its own, from its input and its layers' (in execution order) `passed_bytes` (what a layer passes to another
    block), `saved_bytes`, `transient_bytes` (costmodels/transient.py), blocks (`block_of`; a block the stage cuts
    counts as the part of it inside the stage) and `sent` (whether a later stage reads the layer's outputs too).

    Each checkpoint keeps its inputs until its backward (torch's non-reentrant checkpoint keeps them as they are, no
    copy): the stage's input and what every block but the last passes on (the last one's outputs leave the stage),
    less what the stage sends anyway (its outputs, which it keeps for its microbatches in flight: `kept_outputs`,
    the same storage). A tensor is counted once per producing layer however many blocks read it. The backward
    re-runs one block at a time and holds its saves while it runs: the largest block's (Korthikanti et al. 2022,
    table 2, "full recompute": one 2sbh input kept per transformer layer, one layer's activations re-made). In
    flight beyond that: within the block being re-run, at each layer its saves so far and its transient
    (`transient_over_saved` per block; the last layer's is the loss's, which runs after the last checkpoint), less
    the re-run already counted.
    """
    runs = block_runs(block_of)
    if not runs:
        return input_bytes, 0, 0
    leaves = sent or [False] * len(block_of)
    kept = input_bytes + sum(p for p, out in zip(passed_bytes[:runs[-1][0]], leaves, strict=False) if not out)
    rerun = peak = 0
    for start, stop in runs:
        held = 0
        for i in range(start, stop):
            held += saved_bytes[i]
            peak = max(peak, held + transient_bytes[i])
        rerun = max(rerun, held)
    return kept, rerun, max(0, peak - rerun)


def held_with_deferred(saved: int, inb: int, points: Sequence[tuple[int, int, bool]], recompute: bool, chunks: int,
                       deferred: int, transient: int, loss_saved: int = 0, loss_kept: int = 0,
                       w_rerun: int = 0, rerun: int | None = None) -> tuple[int, int, int]:
    """(activations, deferred gradients, tensors in flight) at a device's peak: the largest sum over its (held,
    pending W, busy) points (`schedules.weight_pass_points`). A backward split into B and W (zero bubble) keeps
    each pending W's weight-op output gradients, `deferred` bytes per (chunk-)microbatch (costmodels/transient.py,
    `_DeferredGrads`); `transient` (one microbatch's peak beyond its saves) comes on top while a forward or a B
    runs, not while a W does. One busy point (held, 0) where backwards do not split.

    Recomputed, a W holds not one re-run but `w_rerun` bytes (`split_rerun_bytes`) beside the held inputs (and the
    loss's saves on the last stage, `_held_activations`), where a forward or a B holds one re-run (`rerun`, as
    `_held_activations`)."""
    def at(held: int, pending: int, busy: bool) -> tuple[int, int, int]:
        if recompute and not busy:  # the loss's saves of one microbatch too (measured on ZB-H1's last stage)
            acts = math.ceil(inb * held / chunks) + max(1, loss_kept) * loss_saved + w_rerun
        else:
            acts = _held_activations(saved, inb, held, recompute, chunks, loss_saved, loss_kept, rerun)
        return acts, pending * deferred, transient if busy else 0

    return max((at(*point) for point in points), key=sum)


def saves_received_buffer(schedule: str) -> bool:
    """Whether a stage's first layer that saves its input saves the buffer the input was received into: torch's
    stages run each microbatch on that buffer (stage.py `_retrieve_recv_activations`); PipeDream's own loops
    receive into a tensor of their own beside their one buffer."""
    return facts(schedule).torch_class is not None


def saved_beyond_received(saved: int, input_saved: int, schedule: str) -> int:
    """What a stage saves per microbatch beyond its received input, where a first layer that saves its input (a
    LayerNorm, a Linear, a GELU, a convolution) saves the very tensor the memory model counts already: torch's
    stages run each microbatch on the tensor they received it into (stage.py `_retrieve_recv_activations`: the
    buffer itself), counted among the receive buffers (`receive_buffers`) or, recomputed, as
    the input its checkpoint keeps (which the re-run's saves would count a second time). `input_saved`: the
    stage's first layers' `Layer.input_saved_bytes`. Where the stage does not save its received buffer
    (`saves_received_buffer`: PipeDream's loops), as traced. Counted twice, GPT's 3-stage GPipe middle stage read +8.4% on the
    CPU runtime and a recomputed ZB-V device whose stage starts at a GELU +27% (benchmarks/RESULTS.md, "Peak
    memory")."""
    return max(0, saved - input_saved) if saves_received_buffer(schedule) else saved


def split_rerun_bytes(saved: int, loss_saved: int, nonweight_saved: int, weight_passes: int, first: bool) -> int:
    """What a recomputed stage's W holds at its peak under torch's split backward: each of its autograd calls (one
    per parameter group, `costmodels.recompute.weight_grad_passes`) re-runs the stage's checkpointed forward, and
    what a re-run recomputed for the ops W never reads (a GELU's input, attention's queries, keys and values:
    `nonweight_saved`) stays until the W ends, when the graph goes; the re-run in progress holds all it recomputes
    (`saved` less the loss's, which runs outside the checkpoint). Measured with torch's functions on two GPT
    blocks (12 parameter groups): W's peak 7 times one re-run, within 5% of this rule
    (tests/test_deferred_grads.py). The first stage's W is its whole backward: one re-run."""
    rerun = max(0, saved - loss_saved)
    return rerun if first else weight_passes * nonweight_saved + rerun


class Sends(NamedTuple):
    """What a device's ops leave live under torch's multi-stage schedules (`_PipelineScheduleRuntime`: interleaved
    1F1B, ZB-H1, ZB-V, DualPipeV), by virtual stage, per microbatch. Such a schedule keeps every send's work object
    in a list it waits on only at the step's end (torch 2.13 schedules.py `_step_microbatches`, `send_ops`), and a
    work object keeps its tensor: a forward's output sent to another device (in `fwd_cache` until its backward, in
    the list from then) and a backward's input gradient sent to another device stay live until the step ends
    (`out`, `grad`; 0 where the next or previous stage is on this device, whose pre-made receive buffer the tensor
    replaces, stage.py `set_local_fwd_input`: counted among the receive buffers). The model's output (`model_out`,
    on the `last` stage) stays from its forward to its backward (`fwd_cache`); a W or a whole backward adds one
    weight gradient into `.grad` (`accumulating`, `accumulating_grad_bytes`). Measured op by op on the CPU runtime
    (GPT's recomputed ZB-V first device peaks in its last W with 40 MiB of gradients and 8 MiB of outputs sent and
    not yet waited for: benchmarks/RESULTS.md, "Peak memory")."""

    out: Sequence[int]
    grad: Sequence[int]
    model_out: int
    last: int
    accumulating: int


def left_live(order: Sequence[tuple[str, int, int]], sends: Sends) -> list[int]:
    """Per op of a rank's order, the bytes of `sends` live while it runs: what the ops before it left, its own."""
    live, per_op = 0, []
    for kind, s, _ in order:
        if kind == "F":
            live += sends.model_out if s == sends.last else sends.out[s]
        elif kind in ("B", "BW") and s != 0:  # torch skips the first stage's B; its W has no input gradient
            live += sends.grad[s]
        per_op.append(live + (sends.accumulating if kind in ("W", "BW") else 0))
        if kind in ("B", "BW") and s == sends.last:
            live -= sends.model_out
    return per_op


def walked_held_bytes(order: Sequence[tuple[str, int, int]], saved: Sequence[int], deferred: Sequence[int],
                      transient: Sequence[int], sends: Sends | None = None) -> tuple[int, int, int]:
    """`held_with_deferred` walked op by op over a rank's order (planner/simulate.py `device_orders`: a V schedule's
    two chunks, interleaving's several), each virtual stage with its own bytes per microbatch (indexed by virtual
    stage; `deferred` 0 for stage 0), where the counts' estimate takes the chunks as equal: a V's first rank holds
    the embedding's stage and the loss's, whose saved bytes, tensors in flight and deferred gradients differ several
    times over. With `sends`, the activations include what `left_live` counts at each op."""
    live = left_live(order, sends) if sends is not None else [0] * len(order)
    points = ((held + extra, pending, transient[s] if kind != "W" else 0)
              for (kind, s, held, pending), extra in zip(walk(order, saved.__getitem__, deferred.__getitem__), live,
                                                         strict=True))
    return max(points, key=sum, default=(0, 0, 0))


def walked_recomputed_bytes(order: Sequence[tuple[str, int, int]], kept: Sequence[int], rerun: Sequence[int],
                            w_rerun: Sequence[int], loss_saved: Sequence[int], deferred: Sequence[int],
                            transient: Sequence[int], sends: Sends | None = None) -> tuple[int, int, int]:
    """`walked_held_bytes` under recomputation, each virtual stage with its own bytes (indexed by virtual stage): a
    microbatch held keeps its stage's checkpointed input (`kept`); a forward or a backward re-runs its own stage
    (`rerun`, with its tensors in flight), a W holds its own stage's re-runs (`w_rerun`, `split_rerun_bytes`) and,
    on the last stage, the loss's saves (`loss_saved`), as `held_with_deferred` prices each. The counts' estimate
    takes the device's largest input for every chunk's microbatch and its larger W for every W: a ZB-V middle device
    whose chunks receive 4 and 2 MiB and re-run 293 and 267 MiB in their W's. With `sends`, as `walked_held_bytes`."""
    live = left_live(order, sends) if sends is not None else [0] * len(order)
    points = []
    for (kind, s, held, pending), extra in zip(walk(order, kept.__getitem__, deferred.__getitem__), live, strict=True):
        if kind == "W":
            points.append((held + extra + w_rerun[s] + loss_saved[s], pending, 0))
        else:
            points.append((held + extra + rerun[s], pending, transient[s]))
    return max(points, key=sum, default=(0, 0, 0))


def kept_outputs(schedule: str, inflight: int) -> int:
    """Microbatches whose stage output the stage still holds: torch.distributed.pipelining keeps each forward's
    output in the stage's `fwd_cache` until that microbatch's backward (torch 2.13 stage.py,
    `forward_one_chunk`/`backward_one_chunk`), one per microbatch in flight (the last stage's, the model's
    output: `kept_model_outputs`). PipeDream's own loops: 0. GPipe (pipeplan/lean_gpipe.py): 0, each output's data
    freed once sent (what autograd saves of it stays, in the saved bytes)."""
    rule = facts(schedule)
    if rule.frees_sent_outputs:
        return 0
    return inflight if rule.torch_class is not None else 0


def kept_model_outputs(schedule: str, stages: int, microbatches: int) -> int:
    """Microbatches whose model output (a language model's logits) the device running the last stage keeps
    (`kept_outputs`): as many as that stage has between their forward and their backward (the output leaves
    `fwd_cache` at the backward, and a split backward's B, which keeps only the loss for W). All M under GPipe,
    which runs every forward before any backward; one under the others, whose last stage runs each microbatch's
    backward (or B) right after its forward (torch detaches the last stage's output once it is done,
    stage.py); 0 in PipeDream's loops."""
    rule = facts(schedule)
    if rule.torch_class is None:
        return 0
    if rule.interleaves or rule.splits_backward:
        return 1
    return inflight_microbatches(schedule, stages, stages - 1, microbatches, 1)


def losses_waiting(schedule: str, stages: int, microbatches: int) -> int:
    """Microbatches whose loss's saves the last stage holds, under recomputation (the loss runs outside the
    checkpoint), while another microbatch's backward re-runs the stage: those between their loss and their
    backward but that one. M - 1 under GPipe, which runs every forward first; none under the others, whose last
    stage runs each microbatch's backward (or B) right after its forward (`kept_model_outputs`; PipeDream's
    loops likewise). On the CPU runtime GPipe's recomputed last stage read -25.7% without them, +1.6% with."""
    return max(0, kept_model_outputs(schedule, stages, microbatches) - 1)


def accumulating_grad_bytes(largest_layer_param_bytes: int, *, schedule: str, microbatches: int, optimizer: str,
                            dtype: str, mixed_precision: str = DEFAULT_MIXED_PRECISION, sharding: str = "none") -> int:
    """A weight gradient in flight while it is added into `.grad`: from a step's second microbatch on, each
    layer's backward makes its parameters' gradients anew and accumulates them (autograd's AccumulateGrad; the
    first backward keeps the new one as `.grad`). Priced as the stage's largest layer's gradients, since they do
    not grow with the batch (costmodels/transient.py leaves them out). Not under ZeRO-2/3, whose full-size layer
    gradient is already in `gathered_bytes`, nor where every microbatch updates (async PipeDream)."""
    if microbatches < 2 or sharding in ("zero2", "zero3") or facts(schedule).updates_each_microbatch:
        return 0
    return model_state_bytes(largest_layer_param_bytes, optimizer=optimizer, dtype=dtype,
                             mixed_precision=mixed_precision).grad_bytes


def receive_buffers(schedule: str, stages: int, stage: int, microbatches: int, chunks: int,
                    inflight: int, recompute: bool = False) -> tuple[int, int]:
    """(input buffers, output-gradient buffers) pipeline device `stage` holds through a step.

    GPipe and 1F1B (pipeplan/lean_gpipe.py `receive_lazily`: each buffer made when its receive is posted, dropped
    after its microbatch's backward): the inputs of the microbatches in flight, which a recomputed stage's activations
    already count (its checkpoints' inputs). Under GPipe the gradient of one sent while the next backward runs takes
    the place of that microbatch's input, released by then; torch's 1F1B loop keeps the last gradient it sent in its
    send list through the next backward, beside the inputs in flight (one more). One output-gradient buffer, for
    the backward that runs. The
    first stage: the microbatch, counted once. A stage whose first op saves its input holds it once, here, and
    its saved bytes leave it out (`saved_beyond_received`).

    The other torch schedules: torch 2.13's PipelineStage allocates one receive buffer per microbatch and direction
    when the step sets up and keeps them all through it (stage.py `_setup_forward_recv_info`,
    `_setup_backward_recv_info`; pytorch/pytorch#136380 asks to reuse a few instead; NVIDIA NeMo Automodel
    PR #3780 measured ~52 GiB of them on a middle stage). Per virtual stage of the device: M input buffers
    unless it is the first stage (whose input is the microbatch itself, counted once), M gradient buffers
    unless it is the last. PipeDream's own loops: one input buffer, and one gradient buffer per microbatch in
    flight on every stage but the last (runtime/pipedream_comm.py posts each gradient's receive when the
    forward sends the activation, so gloo can move it while the stage computes).
    """
    rule = facts(schedule)
    if rule.torch_class is None:
        return 1, (max(1, inflight) if stage < stages - 1 else 0)
    if rule.receives_per_microbatch:
        # torch's loop (1F1B) holds the gradient it sent last in its send list through the next backward
        ins = 1 if stage == 0 else (0 if recompute else inflight) + (not rule.frees_sent_outputs)
        return ins, (0 if stage == stages - 1 else 1)
    # the device runs `chunks` virtual stages; stage 0 is device 0's under every placement (the search asks this
    # for every configuration, so not by listing the device's stages)
    first_here = stage == 0
    last_here = stage_device(schedule, stages * chunks - 1, stages) == stage
    return (chunks * microbatches - (microbatches - 1 if first_here else 0),
            chunks * microbatches - (microbatches if last_here else 0))


def chunk_receive_bytes(schedule: str, mine: Sequence[int], in_bytes: Sequence[int], out_bytes: Sequence[int],
                        microbatches: int) -> int | None:
    """The receive buffers of a device running several virtual stages (`mine`, indexed into the model's stages'
    `in_bytes` and `out_bytes` per microbatch) under torch's multi-stage schedules, each stage's at its own cut:
    M input buffers for every stage but the model's first (whose input, the microbatch itself, is counted once),
    M output-gradient buffers for every stage but the model's last (`receive_buffers` counts the same buffers).
    None where `receive_buffers`' counts times one cut are exact: one stage a device, or a schedule that does
    not allocate per microbatch. Why: a V's or an interleaved device's chunks cut the model in different places;
    priced at the device's largest cut, a recomputed ZB-V device whose chunks receive gradients of 2 and 10 MiB
    counted 32 MiB of buffers it never held (benchmarks/RESULTS.md, "Peak memory")."""
    rule = facts(schedule)
    if len(mine) < 2 or rule.torch_class is None or rule.receives_per_microbatch:
        return None
    last = len(in_bytes) - 1
    return sum(int(in_bytes[s]) * (1 if s == 0 else microbatches) + (0 if s == last else int(out_bytes[s]) * microbatches)
               for s in mine)


def stage_memory(*, param_bytes: int, saved_bytes_per_mb: int, input_bytes_per_mb: int, output_bytes_per_mb: int,
                 schedule: str, stages: int, stage: int, microbatches: int, optimizer: str, dtype: str,
                 recompute: bool, chunks: int = 1, mixed_precision: str = DEFAULT_MIXED_PRECISION, sharding: str = "none",
                 shards: int = 1, largest_layer_param_bytes: int = 0,
                 stage_replicas: Sequence[int] | None = None, transient_bytes: int = 0,
                 model_output_bytes_per_mb: int = 0, deferred_grad_bytes_per_mb: int = 0,
                 held_bytes: tuple[int, int, int] | None = None, loss_saved_bytes_per_mb: int = 0,
                 w_rerun_bytes: int = 0, checkpointed: tuple[int, int] | None = None,
                 input_saved_bytes_per_mb: int = 0, receive_bytes: int | None = None,
                 frozen_param_bytes: int = 0, kept_bytes: int | None = None) -> MemoryBreakdown:
    """Predicted peak memory of one pipeline stage (one device).

    param_bytes: fp32 bytes of the stage's parameters (all its chunks when interleaved); frozen_param_bytes: of
    them, those that need no gradient (`model_state_bytes`).
    saved_bytes_per_mb / input_bytes_per_mb / output_bytes_per_mb: bytes for one
    microbatch in the training dtype (see the module docstring): activations the
    stage saves for backward, the tensors it receives, the tensors it sends.
    sharding / shards: the ZeRO level and the replicas the stage's state is split
    over; largest_layer_param_bytes: fp32 bytes of its largest layer's trainable parameters (`gathered_bytes`; frozen
    ones are neither gathered nor given gradients).
    stage_replicas: every stage's replica count where the schedule replicates stages one by one (async
    PipeDream): the in-flight count is then the runtime's per replica (`replicated_inflight`), not K - s.
    transient_bytes: what one microbatch's step holds at its peak beyond the stage's saved activations
    (`transient_over_saved` of its layers): a device runs one forward or backward at a time, beside everything
    it holds for the others; plus a weight gradient being accumulated (`accumulating_grad_bytes`).
    model_output_bytes_per_mb: the model's output where this device holds the last stage, which it keeps for
    the last stage's microbatches in flight under torch's schedules (`kept_model_outputs`), as every stage
    keeps what it sends for its own (`kept_outputs`).
    deferred_grad_bytes_per_mb: where backwards split into B and W, the output gradients of its weight ops that
    one (chunk-)microbatch's B keeps until its W, for a virtual stage of this device other than the model's first
    (`held_with_deferred`).
    held_bytes: (activations, deferred gradients, tensors in flight) at the device's peak where the caller walked
    its order chunk by chunk (`walked_held_bytes` with the device's `Sends`), in place of the estimate from the
    counts; its activations include the outputs kept and sent, the model's output and the weight gradient being
    added in where the peak has them, so only the receive buffers are added to it.
    kept_bytes: counted, not walked, the outputs, input gradients and model outputs the device keeps beyond its
    receive buffers where the caller knows them (ZB-H1 on torch's multi-stage runtime, which keeps every send to the
    step's end: planner/walks.py `kept_send_counts`), in place of `kept_outputs` and `kept_model_outputs`.
    loss_saved_bytes_per_mb: where the device holds the last stage, what the loss saves; recomputed, the
    microbatches waiting for their backward keep it (`_held_activations`, `losses_waiting`). w_rerun_bytes:
    recomputed under a split backward, what a W holds (`split_rerun_bytes`). checkpointed: recomputed with a checkpoint
    per block, (kept per microbatch, one re-run) of `checkpointed_bytes` over the device's stages; None: one checkpoint
    per stage, which keeps the stage's input and re-runs all it saves. input_saved_bytes_per_mb: of
    saved_bytes_per_mb, what the device's stages save of their received inputs (`saved_beyond_received`).
    receive_bytes: the receive buffers' bytes where the caller summed them per virtual stage of the device
    (`chunk_receive_bytes`), in place of `receive_buffers`' counts times the device's largest cut.

    Terms (each documented in docs/cost-models.md):
    weights + stashed versions (pipedream), grads + optimizer state + master copy
    (`model_state_bytes`), gathered layers (`gathered_bytes`), activations
    (`activation_bytes` with `inflight_microbatches`), tensors in flight (`transient_bytes`), and in
    `buffer_bytes` the receive buffers (`receive_buffers`: one per microbatch each way under torch's
    schedules, PipeDream's loops one input and one gradient buffer per in-flight microbatch) and the outputs
    kept for the backward (`kept_outputs`, `kept_model_outputs`).
    """
    if not facts(schedule).interleaves and chunks != 1:
        raise ValueError(f"chunks={chunks} only applies to the interleaved schedule")
    for name, value in (("param_bytes", param_bytes), ("saved_bytes_per_mb", saved_bytes_per_mb),
                        ("input_bytes_per_mb", input_bytes_per_mb), ("output_bytes_per_mb", output_bytes_per_mb),
                        ("largest_layer_param_bytes", largest_layer_param_bytes),
                        ("deferred_grad_bytes_per_mb", deferred_grad_bytes_per_mb)):
        if value < 0:
            raise ValueError(f"negative {name}: {value}")
    state = model_state_bytes(param_bytes, optimizer=optimizer, dtype=dtype, mixed_precision=mixed_precision,
                              sharding=sharding, shards=shards, frozen_bytes_fp32=frozen_param_bytes)
    gathered = gathered_bytes(largest_layer_param_bytes, optimizer=optimizer, dtype=dtype,
                              mixed_precision=mixed_precision, sharding=sharding) if shards > 1 else 0
    inflight = inflight_microbatches(schedule, stages, stage, microbatches, chunks, replicas=stage_replicas)
    versions = stashed_weight_versions(schedule, inflight)
    frozen_weights = _unsharded_parts(frozen_param_bytes, optimizer, dtype, mixed_precision)[0]
    weights = (state.weights_bytes - frozen_weights) * versions + frozen_weights  # a frozen weight is never stashed
    optimizer_bytes = state.grad_bytes + state.optimizer_bytes
    if transient_bytes < 0 or model_output_bytes_per_mb < 0:
        raise ValueError(f"negative transient_bytes or model_output_bytes_per_mb: {transient_bytes}, "
                         f"{model_output_bytes_per_mb}")
    points = weight_pass_points(schedule, stages, stage, microbatches, chunks, inflight)
    saved_bytes_per_mb = saved_beyond_received(saved_bytes_per_mb, input_saved_bytes_per_mb, schedule)
    kept, rerun = checkpointed or (input_bytes_per_mb, None)
    acts, deferred, transient_bytes = held_bytes or held_with_deferred(
        saved_bytes_per_mb, kept, points, recompute, chunks, deferred_grad_bytes_per_mb, transient_bytes,
        loss_saved_bytes_per_mb, losses_waiting(schedule, stages, microbatches), w_rerun_bytes, rerun)
    if receive_bytes is None:  # one cut for all the device's buffers; a caller with several cuts sums them
        ins, grads = receive_buffers(schedule, stages, stage, microbatches, chunks, inflight, recompute)
        receive_bytes = int(input_bytes_per_mb) * ins + int(output_bytes_per_mb) * grads
    buffers = int(receive_bytes)
    if held_bytes is None:  # a walk counts these op by op (`Sends`)
        buffers += (kept_outputs(schedule, inflight) * int(output_bytes_per_mb)
                    + kept_model_outputs(schedule, stages, microbatches) * int(model_output_bytes_per_mb)
                    if kept_bytes is None else int(kept_bytes))
        transient_bytes += accumulating_grad_bytes(largest_layer_param_bytes, schedule=schedule,
                                                   microbatches=microbatches, optimizer=optimizer, dtype=dtype,
                                                   mixed_precision=mixed_precision,
                                                   sharding=sharding if shards > 1 else "none")
    total = weights + optimizer_bytes + gathered + acts + buffers + transient_bytes + deferred
    return MemoryBreakdown(weights, optimizer_bytes, acts, buffers, total, inflight, versions, state.grad_bytes, gathered,
                           transient_bytes, deferred)


class RangeMemory:
    """`stage_memory` of layers [a, b) on a stage, fast enough for the partitioner's callbacks.

    The DP asks about thousands of layer ranges per configuration, so the terms of
    `stage_memory` (weights x stashed versions, gradients + optimizer state,
    `activation_bytes` for the in-flight count, receive buffers) are evaluated
    from prefix sums with the per-stage constants computed once; the result is
    the same number (tests/test_search.py checks it against `stage_memory`).

    Interleaved: a device holds `chunks` chunks; a chunk is admitted when a device
    made of `chunks` copies of it fits, so a device whose chunks each pass holds
    at most the largest of those totals (weights and activations add up over
    chunks; receive buffers are shared). Tied parameters (`shared`: bytes and the
    sorted layer indices using them): a range holding a user but not the owner
    (the first user) keeps a copy, as the prediction charges it.
    """

    def __init__(self, *, param_bytes: Sequence[int], saved_bytes: Sequence[int], cut_bytes: Sequence[int],
                 frozen_param_bytes: Sequence[int] = (),
                 input_bytes: int, schedule: str, stages: int, microbatches: int, chunks: int, recompute: bool,
                 optimizer: str, dtype: str, shared: Sequence[tuple[int, Sequence[int]]] = (),
                 mixed_precision: str = DEFAULT_MIXED_PRECISION, sharding: str = "none", shards: int = 1,
                 transient_bytes: Sequence[int] = (), model_output_bytes: int = 0,
                 deferred_grad_bytes: Sequence[int] = (), loss_saved_bytes: int = 0,
                 nonweight_saved_bytes: Sequence[int] = (), weight_passes: Sequence[int] = (),
                 input_saved_bytes: Sequence[int] = (), input_nonweight_saved_bytes: Sequence[int] = (),
                 blocks: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None,
                 kept_sends: Sequence[tuple[int, int, int]] | None = None, walked: bool = False) -> None:
        n, P = len(param_bytes), stages
        rule = facts(schedule)
        self.shared = [(nbytes, list(users)) for nbytes, users in shared if len(users) > 1]
        self.n, self.P = n, P
        self.ch = chunks if rule.interleaves else 1
        self.device_of = [stage_device(schedule, s, P) for s in range(P * self.ch)]
        self.recompute = recompute
        # a checkpoint per block (`blocks`: each layer's block, what it passes to other blocks, its last reader)
        self.blocked = _Blocks(*blocks, saved_bytes, transient_bytes or [0] * len(saved_bytes)) \
            if recompute and blocks is not None else None
        self.pp, self.sp = [0], [0]
        for i in range(n):
            self.pp.append(self.pp[-1] + param_bytes[i])
            self.sp.append(self.sp[-1] + saved_bytes[i])
        # of pp, parameters without gradients (weights only: `model_state_bytes`); None: every one trains
        self.fp = list(itertools.accumulate(frozen_param_bytes, initial=0)) if any(frozen_param_bytes) else None
        self.cut = list(cut_bytes)
        self.input = input_bytes
        self.inflight = [inflight_microbatches(schedule, P, p, microbatches, self.ch) for p in range(P)]
        self.versions = [stashed_weight_versions(schedule, x) for x in self.inflight]
        self.receives = [receive_buffers(schedule, P, p, microbatches, self.ch, x, recompute)
                         for p, x in enumerate(self.inflight)]
        self.points = [weight_pass_points(schedule, P, p, microbatches, self.ch, x) for p, x in enumerate(self.inflight)]
        # only a split backward keeps gradients for W: other schedules skip the prefix sums and their range sums
        self.dp = list(itertools.accumulate(deferred_grad_bytes, initial=0)) \
            if rule.splits_backward and any(deferred_grad_bytes) else None
        self.loss_saved = loss_saved_bytes if recompute else 0  # the loss's saves, outside a recomputed checkpoint
        self.losses = losses_waiting(schedule, P, microbatches)
        # recomputed under a split backward: what a W holds (split_rerun_bytes) from prefix sums
        self.rerun = (list(itertools.accumulate(nonweight_saved_bytes, initial=0)),
                      list(itertools.accumulate(weight_passes, initial=0))) \
            if recompute and rule.splits_backward and len(nonweight_saved_bytes) == n == len(weight_passes) else None
        # what a range's first layer saves of its received input (`saved_beyond_received`), as a W re-runs it too
        self.input_saved = (list(input_saved_bytes) or [0] * n, list(input_nonweight_saved_bytes) or [0] * n) \
            if saves_received_buffer(schedule) else ([0] * n, [0] * n)
        self.sharding, self.shards = sharding, shards
        unit = 4 * 2**20  # a whole number of parameters: the per-byte factors below are exact
        w, g, o = _unsharded_parts(unit, _check(optimizer, OPTIMIZERS, "optimizer"), dtype,
                                   _check(mixed_precision, MIXED_PRECISIONS, "mixed-precision recipe"))
        self.per_byte = (w / unit, g / unit, o / unit)
        # the largest layer's full-size tensors: `gathered_bytes` under ZeRO-2/3 over replicas, else the gradient
        # being accumulated (`accumulating_grad_bytes`); as gradients + weights factors of its parameter bytes
        # (floored, as `_unsharded_parts` halves), since the DP asks millions of times
        zero_holds = sharding in ("zero2", "zero3") and shards > 1
        accumulates = accumulating_grad_bytes(unit, schedule=schedule, microbatches=microbatches, optimizer=optimizer,
                                              dtype=dtype, mixed_precision=mixed_precision,
                                              sharding=sharding if shards > 1 else "none") > 0
        self.largest_parts = (int(zero_holds or accumulates), 2 if zero_holds and sharding == "zero3" else 0)
        self.largest = _RangeMax([p - z for p, z in zip(param_bytes, frozen_param_bytes or [0] * n, strict=True)]) \
            if any(self.largest_parts) else None
        # where the runtime keeps its sends (`kept_sends`: outputs sent, input gradients sent, model outputs at the
        # device's fullest point), they replace the counts' kept outputs; a walked device's recomputed stages keep
        # their input as the receive buffer, as its prediction counts them
        self.sends = list(kept_sends) if kept_sends is not None else None
        self.walked = walked
        self.keeps = [kept_outputs(schedule, x) for x in self.inflight]
        self.keeps_model_out = kept_model_outputs(schedule, P, microbatches)
        self.model_out = model_output_bytes
        # a range's tensors in flight: max over its layers L of (saved by a..L) + L's, less what a..b saves
        self.transient = _RangeMax([self.sp[i + 1] + t for i, t in enumerate(transient_bytes)]) \
            if any(transient_bytes) else None
        self.transient_last = transient_bytes[-1] if self.transient is not None else 0

    def device_total(self, p: int, params: int, saved: int, inb: int, outb: int, largest: int = 0,
                     transient: int = 0, model_out: int = 0, deferred: int = 0, loss_saved: int = 0,
                     w_rerun: int = 0, checkpointed: tuple[int, int | None] | None = None, frozen: int = 0,
                     sent: tuple[int, int] = (0, 0)) -> int:
        """`stage_memory(...).total_bytes` of pipeline device p holding these bytes (`model_out`: the model's
        output, where the range ends the model; `deferred`: a (chunk-)microbatch's gradients kept for W;
        `loss_saved`, `w_rerun`, `checkpointed`: as stage_memory's; `frozen`: of `params`, those without gradients;
        `sent`: the cuts a walked device's sends are priced at, `_kept`)."""
        w, g, o = (math.ceil(f * (params - frozen)) for f in self.per_byte)
        w, g, o = _shard(w, g, o, self.sharding, self.shards)
        w_frozen = math.ceil(self.per_byte[0] * frozen)  # whole on every replica, never stashed (`stage_memory`)
        kept, rerun = checkpointed or (inb, None)
        if deferred or w_rerun:  # both 0 unless backwards split
            acts = sum(held_with_deferred(saved, kept, self.points[p], self.recompute, self.ch, deferred, transient,
                                          loss_saved, self.losses, w_rerun, rerun))
            transient = 0  # in acts
        else:  # no W pending (the DP's hot path): the most microbatches held, with tensors in flight
            acts = _held_activations(saved, kept, self.inflight[p], self.recompute, self.ch, loss_saved, self.losses,
                                     rerun)
        grads_of, weights_of = self.largest_parts
        gathered = grads_of * int(largest * self.per_byte[1]) + weights_of * int(largest * self.per_byte[0])
        ins, grads = self.receives[p]
        return (w * self.versions[p] + w_frozen + g + o + gathered + acts + inb * ins + outb * grads + transient
                + self._kept(p, outb, model_out, sent))

    def _kept(self, p: int, outb: int, model_out: int, sent: tuple[int, int]) -> int:
        """Outputs and input gradients device p keeps beyond its receive buffers: the counts' kept outputs, or the
        sends the runtime keeps (`kept_sends`) at the chunk's cuts `sent` (outputs, input gradients)."""
        if self.sends is None:
            return outb * self.keeps[p] + model_out * self.keeps_model_out
        outs, grads, model_outs = self.sends[p]
        return outs * sent[0] + grads * sent[1] + model_outs * model_out

    def __call__(self, s: int, a: int, b: int) -> int:
        """Bytes of virtual stage s holding layers [a, b)."""
        ch = self.ch
        params = self.pp[b] - self.pp[a]
        if self.shared:
            params += self._tied_copies(a, b)
        largest = self.largest(a, b) if self.largest is not None else 0
        outb = self.cut[b - 1] if b < self.n else 0
        deferred = self.dp[b] - self.dp[a] if self.dp is not None and s > 0 else 0  # torch skips stage 0's B
        loss_saved = self.loss_saved if b == self.n else 0
        saved = max(0, self.sp[b] - self.sp[a] - self.input_saved[0][a])
        w_rerun = 0
        if self.rerun is not None:
            nonweight, passes = self.rerun
            w_rerun = split_rerun_bytes(saved, loss_saved, max(0, nonweight[b] - nonweight[a] - self.input_saved[1][a]),
                                        passes[b] - passes[a], first=s == 0)
        inb = self.input if a == 0 else self.cut[a - 1]
        checkpointed: tuple[int, int | None] | None = None
        # a walked device's recomputed stage keeps its received input as the receive buffer, counted there
        received = inb if self.walked and a > 0 else 0
        if self.blocked is not None:  # `checkpointed_bytes` of the range, its chunks as many copies (as `saved`)
            kept, rerun, transient = self.blocked(a, b, inb)
            checkpointed = ((kept - received) * ch, rerun)
        else:
            transient = self._transient(a, b)
            checkpointed = (0, None) if received else None
        # the model's first and last chunks: their device's other chunks send gradients and outputs at the one cut
        # of theirs that crosses (a layered model's cuts are alike)
        sent = (outb if b < self.n else inb, inb if a > 0 else outb)
        return self.device_total(self.device_of[s], params * ch, saved * ch, inb, outb, largest,
                                 transient, 0 if b < self.n else self.model_out, deferred, loss_saved, w_rerun,
                                 checkpointed, (self.fp[b] - self.fp[a]) * ch if self.fp is not None else 0, sent)

    def _transient(self, a: int, b: int) -> int:
        """`transient_over_saved` of layers [a, b) from the range maximum; the model's last layer apart under
        recomputation (its loss runs outside the checkpoint)."""
        peak_of = self.transient
        if peak_of is None:
            return 0
        if not (self.recompute and b == self.n):
            return max(0, peak_of(a, b) - self.sp[b])
        last = self.sp[a] + self.sp[b] - self.sp[b - 1] + self.transient_last  # in the prefix sums' frame
        return max(0, max(peak_of(a, b - 1), last) - self.sp[b])

    def _tied_copies(self, a: int, b: int) -> int:
        """Bytes of tied parameters [a, b) uses but does not own."""
        return sum(nbytes for nbytes, users in self.shared if users[0] < a and any(a <= u < b for u in users))


def transient_over_saved(saved_bytes: Sequence[int], transient_bytes: Sequence[int], *,
                         loss_apart: bool = False) -> int:
    """What a stage made of these layers (in execution order) holds at its peak beyond all they save.

    A layer's `transient_bytes` (costmodels/transient.py) is what is live while it runs beyond what it and
    the layers before it saved; on a stage only its own layers' saves are held, so at layer L the stage holds
    its saves up to L plus L's transient. The largest of those, less the stage's whole saved bytes (held at the
    end of its forward anyway), never below 0. A language model's last stage: the loss's two logit-sized
    gradients beside every saved tensor; a convolutional stem's large early gradients come when little is held.

    `loss_apart`: the last layer carries the loss, which runs outside a recomputed stage's checkpoint
    (runtime/recompute.py wraps the stage module; the schedule computes the loss after it), so the loss's
    backward, and the peak the trace charged to that layer, comes before the re-run brings the other layers'
    activations back: there the stage holds the last layer's own saves and its transient only.
    """
    held, peak = 0, 0
    for saved, transient in list(zip(saved_bytes, transient_bytes, strict=True))[:-1 if loss_apart else None]:
        held += saved
        peak = max(peak, held + transient)
    if loss_apart and saved_bytes:
        held += saved_bytes[-1]
        peak = max(peak, saved_bytes[-1] + transient_bytes[-1])
    return max(0, peak - held)


class _Blocks:
    """`checkpointed_bytes` of any layer range [a, b): prefix sums of what layers save, the largest block's saves
    and peak over whole blocks by range maximum, the range's cut first and last blocks from the prefix sums and a
    range maximum over layers (a block's peak from layer x: max over its layers L of saved[x..L] + transient[L],
    i.e. max(sp[L + 1] + transient[L]) - sp[x]), and per stage end b the prefix sums of what layers pass on to
    readers before b (built once per b the partitioner asks about: O(n) each)."""

    def __init__(self, block_of: Sequence[int], passed: Sequence[int], last_reader: Sequence[int],
                 saved: Sequence[int], transient: Sequence[int]) -> None:
        self.block = list(block_of)
        self.passed, self.last_reader = list(passed), list(last_reader)
        self.kept: dict[int, list[int]] = {}  # b -> prefix sums of passed bytes whose readers all come before b
        self.sp = list(itertools.accumulate(saved, initial=0))
        self.reach = _RangeMax([self.sp[i + 1] + t for i, t in enumerate(transient)])
        self.start = {b: i for i, b in reversed(list(enumerate(block_of)))}
        self.stop = {b: i + 1 for i, b in enumerate(block_of)}
        blocks = range(max(block_of, default=-1) + 1)
        self.saved = _RangeMax([self.sp[self.stop[b]] - self.sp[self.start[b]] for b in blocks])
        self.peak = _RangeMax([self.reach(self.start[b], self.stop[b]) - self.sp[self.start[b]] for b in blocks])

    def __call__(self, a: int, b: int, inb: int) -> tuple[int, int, int]:
        first, last = self.block[a], self.block[b - 1]
        tail = max(a, self.start[last])  # where the range's last block begins
        if b not in self.kept:
            self.kept[b] = list(itertools.accumulate(
                (p if r < b else 0 for p, r in zip(self.passed, self.last_reader, strict=True)), initial=0))
        kept = inb + self.kept[b][tail] - self.kept[b][a]
        if first == last:
            rerun, peak = self.sp[b] - self.sp[a], self.reach(a, b) - self.sp[a]
        else:
            head = self.stop[first]
            rerun = max(self.sp[head] - self.sp[a], self.sp[b] - self.sp[tail], self.saved(first + 1, last))
            peak = max(self.reach(a, head) - self.sp[a], self.reach(tail, b) - self.sp[tail],
                       self.peak(first + 1, last))
        return kept, rerun, max(0, peak - rerun)


class _RangeMax:
    """Largest value of values[a:b] in O(1) after O(n log n) set-up (a sparse table: Bender & Farach-Colton 2000)."""

    def __init__(self, values: Sequence[int]) -> None:
        self.table = [list(values)]
        k = 1
        while 2 * k <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + k]) for i in range(len(prev) - k)])
            k *= 2

    def __call__(self, a: int, b: int) -> int:
        if b <= a:
            return 0
        j = (b - a).bit_length() - 1
        row = self.table[j]
        return max(row[a], row[b - (1 << j)])
