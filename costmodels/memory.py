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
from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.choices import DTYPES, MIXED_PRECISION_DTYPES, OPTIMIZERS
from pipeplan.errors import UserError
from pipeplan.schedules import facts, inflight_microbatches, stashed_weight_versions

__all__ = [
    "ModelState", "MemoryBreakdown", "RangeMemory",
    "model_state_bytes", "activation_bytes_scale", "activation_bytes", "stage_memory", "is_mixed_precision",
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


def _held_activations(saved: int, inb: int, inflight: int, recompute: bool, chunks: int) -> int:
    """`activation_bytes` without the checks and keywords: the partitioner calls it millions of times."""
    full = math.ceil(saved * inflight / chunks)
    if not recompute:
        return full
    return min(full, math.ceil(inb * inflight / chunks) + math.ceil(saved / chunks))


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
    if not facts(schedule).interleaves and chunks != 1:
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
    receives_grad = (facts(schedule).interleaves and chunks > 1) or stage < stages - 1
    buffers = int(input_bytes_per_mb) + (int(output_bytes_per_mb) if receives_grad else 0)
    total = weights + optimizer_bytes + acts + buffers
    return MemoryBreakdown(weights, optimizer_bytes, acts, buffers, total, inflight, versions)


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
                 input_bytes: int, schedule: str, stages: int, microbatches: int, chunks: int, recompute: bool,
                 optimizer: str, dtype: str, shared: Sequence[tuple[int, Sequence[int]]] = ()) -> None:
        n, P = len(param_bytes), stages
        rule = facts(schedule)
        self.shared = [(nbytes, list(users)) for nbytes, users in shared if len(users) > 1]
        self.n, self.P = n, P
        self.ch = chunks if rule.interleaves else 1
        self.recompute = recompute
        self.pp, self.sp = [0], [0]
        for i in range(n):
            self.pp.append(self.pp[-1] + param_bytes[i])
            self.sp.append(self.sp[-1] + saved_bytes[i])
        self.cut = list(cut_bytes)
        self.input = input_bytes
        self.inflight = [inflight_microbatches(schedule, P, p, microbatches, self.ch) for p in range(P)]
        self.versions = [stashed_weight_versions(schedule, x) for x in self.inflight]
        self.receives = [rule.interleaves or p < P - 1 for p in range(P)]
        unit = 4 * 2**20  # a whole number of parameters, so integer halving is exact
        st = model_state_bytes(unit, optimizer=optimizer, dtype=dtype)
        self.w_per_byte = st.weights_bytes / unit
        self.rest_per_byte = (st.grad_bytes + st.optimizer_bytes) / unit

    def device_total(self, p: int, params: int, saved: int, inb: int, outb: int) -> int:
        """`stage_memory(...).total_bytes` of pipeline device p holding these bytes."""
        weights = math.ceil(self.w_per_byte * params) * self.versions[p]
        rest = math.ceil(self.rest_per_byte * params)
        acts = _held_activations(saved, inb, self.inflight[p], self.recompute, self.ch)
        return weights + rest + acts + inb + (outb if self.receives[p] else 0)

    def __call__(self, s: int, a: int, b: int) -> int:
        """Bytes of virtual stage s holding layers [a, b)."""
        ch = self.ch
        params = self.pp[b] - self.pp[a]
        if self.shared:
            params += self._tied_copies(a, b)
        return self.device_total(s % self.P, params * ch, (self.sp[b] - self.sp[a]) * ch,
                                 self.input if a == 0 else self.cut[a - 1], self.cut[b - 1] if b < self.n else 0)

    def _tied_copies(self, a: int, b: int) -> int:
        """Bytes of tied parameters [a, b) uses but does not own."""
        return sum(nbytes for nbytes, users in self.shared if users[0] < a and any(a <= u < b for u in users))
