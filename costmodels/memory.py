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

import math
from dataclasses import dataclass

from pipeplan.errors import UserError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("gpipe", "1f1b", "pipedream", "interleaved")
DTYPES = ("fp32", "tf32", "bf16", "fp16")

# fp32 optimizer-state buffers per parameter (SGD: none; momentum: the velocity;
# Adam/AdamW: first and second moments). Source: ZeRO (Rajbhandari et al. 2019) §3.1.
_STATE_BUFFERS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise UserError(f"unknown {what} {value!r}", f"use one of: {', '.join(allowed)}")
    return value


def is_mixed_precision(dtype: str) -> bool:
    """bf16/fp16 mean mixed precision: 16-bit weights/activations, fp32 master weights."""
    return _check(dtype, DTYPES, "dtype") in ("bf16", "fp16")


@dataclass(frozen=True)
class ModelState:
    weights_bytes: int  # the copy the forward/backward reads (fp32, or 16-bit in mixed precision)
    grad_bytes: int  # gradients, in the same dtype as those weights
    optimizer_bytes: int  # fp32 master copy (mixed precision only) + optimizer state buffers
    total_bytes: int


def model_state_bytes(param_bytes_fp32: int, *, optimizer: str, dtype: str) -> ModelState:
    """Bytes of weights, gradients and optimizer state for parameters of `param_bytes_fp32` fp32 bytes.

    Source: ZeRO (Rajbhandari et al., SC'20, arXiv 1910.02054) §3.1: mixed-precision
    Adam keeps fp16 parameters and gradients (2Ψ + 2Ψ) and an fp32 copy of the
    parameters, momentum and variance (KΨ, K = 12): 16Ψ bytes. For fp32 training
    the same accounting gives 4Ψ weights + 4Ψ grads + 8Ψ Adam state = 16Ψ, the
    "fp32 param, fp32 grads: 16" row of the Megatron-LM README's bytes/parameter
    table. SGD keeps no state, momentum one fp32 buffer (4Ψ). tf32 is fp32 storage.
    """
    _check(optimizer, OPTIMIZERS, "optimizer")
    if param_bytes_fp32 < 0:
        raise ValueError(f"negative parameter bytes {param_bytes_fp32}")
    n = param_bytes_fp32  # 4 bytes per parameter; keep integer arithmetic exact
    state = _STATE_BUFFERS[optimizer] * n
    if is_mixed_precision(dtype):
        weights = n // 2
        grads = n // 2
        opt = n + state  # fp32 master weights + state
    else:
        weights = n
        grads = n
        opt = state
    return ModelState(weights, grads, opt, weights + grads + opt)


def activation_bytes_scale(dtype: str) -> float:
    """Factor from traced (fp32) activation bytes to the training dtype's bytes.

    Source: mixed-precision training (Micikevicius et al., ICLR 2018, §3) stores
    activations in 16 bits; Korthikanti et al. (2022) §4 count activation memory
    at 2 bytes/element for the same reason. tf32 only changes the matmul unit;
    tensors stay fp32. (A judgement: autocast keeps a few tensors such as softmax
    statistics in fp32; they are a small share and are ignored.)
    """
    return 0.5 if is_mixed_precision(dtype) else 1.0


def inflight_microbatches(schedule: str, stages: int, stage: int, microbatches: int, chunks: int = 1) -> int:
    """How many microbatches' activations stage `stage` holds at its peak.

    - gpipe: all M. GPipe (Huang et al. 2019) §2.3 runs every forward before any
      backward; Megatron-LM (Narayanan et al. 2021) §2.2.1: "m microbatches for GPipe".
    - 1f1b (PipeDream-Flush): min(K - s, M). Stage s runs K - s - 1 warm-up
      forwards and then one more forward before its first backward (Megatron-LM
      §2.2.1: "p or fewer microbatches"; schedules.py: num_warmup =
      min(p - rank - 1, M)). Stage 0 holds K, the last stage 1.
    - pipedream (async, PipeDream SOSP'19 §3.2): the same 1F1B steady state,
      K - s at stage s ("NOAM" = K minibatches admitted for K stages), but with
      no flush the stream never drains, so M does not cap it.
    - interleaved (Megatron-LM §2.2.2, v = `chunks` model chunks per device,
      `stages` = p devices, `stage` = device index): the count returned is of
      (chunk, microbatch) pairs, each holding ONE chunk's activations. From
      Megatron-LM's schedules.py (forward_backward_pipelining_with_interleaving):
      warm-up = 2(p - d - 1) + (v - 1)p forwards, then one more forward before the
      first backward, capped at M*v; when M == p it runs all M*v forwards first.
      Divided by v this is p + (p - 1)/v chunk-sets on device 0, i.e. p microbatches
      times Korthikanti et al. (2022) §4.2.3's factor (1 + (p - 1)/(p*v))
      (their "m" is our v, the number of chunks, not microbatches). With v = 1
      it is 1F1B (Megatron's warm-up formula assumes v >= 2).
    """
    _check(schedule, SCHEDULES, "schedule")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError("stages, microbatches and chunks must be >= 1")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(stages - stage, microbatches)
    if schedule == "pipedream":  # no flush: minibatches keep streaming, so M does not cap it
        return stages - stage
    if chunks == 1:  # one chunk per device is plain 1F1B (Megatron only interleaves with v >= 2)
        return min(stages - stage, microbatches)
    p, d, v, m = stages, stage, chunks, microbatches
    total = m * v
    if m == p:
        return total
    warmup = min(2 * (p - d - 1) + (v - 1) * p, total)
    return min(warmup + 1, total)


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


def stashed_weight_versions(schedule: str, inflight: int) -> int:
    """Weight versions async PipeDream keeps: one per in-flight microbatch.

    Source: PipeDream (Narayanan et al., SOSP'19) §3.3 "weight stashing": each
    in-flight minibatch's backward must use the weights its forward used, so a
    stage keeps the current version plus one stashed version per in-flight
    microbatch beyond the first (stage 0 of a K-stage pipeline: K versions, the
    last stage: 1). Flushing schedules (gpipe, 1f1b, interleaved) keep one.
    """
    return max(1, inflight) if schedule == "pipedream" else 1


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
    full = math.ceil(saved_bytes_per_mb * inflight / chunks)
    if not recompute:
        return full
    held = math.ceil(input_bytes_per_mb * inflight / chunks) + math.ceil(saved_bytes_per_mb / chunks)
    return min(full, held)


def stage_memory(*, param_bytes: int, saved_bytes_per_mb: int, input_bytes_per_mb: int, output_bytes_per_mb: int,
                 schedule: str, stages: int, stage: int, microbatches: int, optimizer: str, dtype: str,
                 recompute: bool, chunks: int = 1) -> MemoryBreakdown:
    """Predicted peak memory of one pipeline stage (one device).

    param_bytes: fp32 bytes of the stage's parameters (all its chunks when interleaved).
    saved_bytes_per_mb / input_bytes_per_mb / output_bytes_per_mb: bytes for one
    microbatch in the training dtype (see the module docstring): activations the
    stage saves for backward, the tensors it receives, the tensors it sends.

    Terms (each documented in docs/cost-models.md):
    weights + stashed versions (pipedream), grads + optimizer state + master copy
    (`model_state_bytes`), activations (`activation_bytes` with
    `inflight_microbatches`), and receive buffers: one microbatch's input buffer
    plus the buffer for the gradient of its output (the last stage computes the
    loss itself and receives no gradient; interleaved devices all receive one).
    """
    _check(schedule, SCHEDULES, "schedule")
    if schedule != "interleaved" and chunks != 1:
        raise ValueError(f"chunks={chunks} only applies to the interleaved schedule")
    for name, value in (("param_bytes", param_bytes), ("saved_bytes_per_mb", saved_bytes_per_mb),
                        ("input_bytes_per_mb", input_bytes_per_mb), ("output_bytes_per_mb", output_bytes_per_mb)):
        if value < 0:
            raise ValueError(f"negative {name}: {value}")
    state = model_state_bytes(param_bytes, optimizer=optimizer, dtype=dtype)
    inflight = inflight_microbatches(schedule, stages, stage, microbatches, chunks)
    versions = stashed_weight_versions(schedule, inflight)
    weights = state.weights_bytes * versions
    optimizer_bytes = state.grad_bytes + state.optimizer_bytes
    acts = activation_bytes(saved_bytes_per_mb=saved_bytes_per_mb, input_bytes_per_mb=input_bytes_per_mb,
                            inflight=inflight, recompute=recompute, chunks=chunks)
    receives_grad = (schedule == "interleaved" and chunks > 1) or stage < stages - 1
    buffers = int(input_bytes_per_mb) + (int(output_bytes_per_mb) if receives_grad else 0)
    total = weights + optimizer_bytes + acts + buffers
    return MemoryBreakdown(weights, optimizer_bytes, acts, buffers, total, inflight, versions)
