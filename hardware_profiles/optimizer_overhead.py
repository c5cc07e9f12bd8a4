"""Host time per parameter tensor of one optimizer step, measured by `profiles calibrate`.

torch.optim on a CPU does not use its foreach kernels (torch/optim/optimizer.py
`_default_to_fused_or_foreach` picks them only for CUDA-like devices): Adam's
`_single_tensor_adam` runs ~8 eager ops per parameter tensor (step += 1, lerp_,
mul_, addcmul_, sqrt, div, add_, addcdiv_), each dispatched from Python. For a
model of many small tensors that host time, not the bytes the update moves, is
the step: examples/gpt.py's 137K parameters in ~50 tensors stepped in 1.2 ms on
one core here, against 0.3 ms for its 72 bytes per parameter at the core's
memory bandwidth. So calibrate times a step over many tiny tensors (their bytes
negligible) and stores seconds per tensor per optimizer; costmodels/optimizer_step.py
adds tensors x that to the per-parameter term.

The per-parameter term is measured too (`per_param_s`), on a few tensors far beyond the
last-level cache, rather than derived from the bytes Adam's passes move and the copy
bandwidth: the passes over one tensor reuse what the pass before left in cache, so the
bytes overstate the traffic (the figures measured here: costmodels/optimizer_step.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Final

from pipeplan.choices import OPTIMIZERS
from pipeplan.optimizers import DEFAULT_LR, make_optimizer

TENSORS: Final[int] = 256
NUMEL: Final[int] = 16  # 64 bytes a tensor: the bytes term is nanoseconds
STEPS, WARMUP = 15, 3
LARGE_TENSORS: Final[int] = 8
LARGE_NUMEL: Final[int] = 1 << 20  # 4 MiB a tensor, 32 MiB a state over the 8: beyond a 32 MiB L3 with p, g, m, v
LARGE_STEPS, LARGE_WARMUP = 5, 2


# On a GPU the large tensors must pass the L2 too (H100 50 MB, H200 60 MB): 32 MiB a tensor, 256 MiB over the 8.
GPU_LARGE_NUMEL: Final[int] = 1 << 23


def per_tensor_s(device: str = "cpu") -> dict[str, float]:
    """Median seconds per parameter tensor of one step of each optimizer, on the calling thread.

    On CUDA the runtime steps with torch's fused kernels (pipeplan/optimizers.py), whose host time per tensor
    this measures as it comes. torch's default there, its foreach kernels, spent host time per tensor (Adam on the
    H200: 252, 501 and 1229 µs over 1, 16 and 64 tiny tensors: 15 µs a tensor beyond a fixed ~0.24 ms, which
    `per_step_s` measures; the ~1 µs a tensor it adds to this figure, spread over TENSORS, is left in)."""
    return {name: step_s(name, TENSORS, NUMEL, STEPS, WARMUP, device) / TENSORS for name in OPTIMIZERS}


def per_step_s(tensor_s: dict[str, float], device: str = "cpu") -> dict[str, float]:
    """Seconds of one step of each optimizer beyond its per-tensor time (`tensor_s`), on one tiny tensor: the part
    of a step that does not grow with the model (on CUDA, Adam on the H200: 252 µs over one tensor, 15 a tensor)."""
    out: dict[str, float] = {}
    for name in OPTIMIZERS:
        fixed = step_s(name, 1, NUMEL, STEPS, WARMUP, device) - tensor_s.get(name, 0.0)
        if fixed > 0:
            out[name] = fixed
    return out


def per_param_s(tensor_s: dict[str, float], device: str = "cpu") -> dict[str, float]:
    """Seconds per parameter of one step of each optimizer, on the calling thread: a step over
    LARGE_TENSORS tensors of LARGE_NUMEL floats, less their per-tensor time (`tensor_s`, from `per_tensor_s`).
    Large tensors, because the models whose step matters are big: small ones stay in cache and step faster
    per parameter (here ~15% at 64K floats a tensor), which this slightly over-predicts. Measure it under the
    runtime's allocator setting (calibrate sets `keep_freed_memory` first): without it the temporaries Adam
    allocates per tensor land on fresh pages, and its step took 7.1 ns a parameter here instead of 3.1."""
    numel = GPU_LARGE_NUMEL if device == "cuda" else LARGE_NUMEL
    n = LARGE_TENSORS * numel
    out: dict[str, float] = {}
    for name in OPTIMIZERS:
        large_s = step_s(name, LARGE_TENSORS, numel, LARGE_STEPS, LARGE_WARMUP, device)
        per_param = (large_s - LARGE_TENSORS * tensor_s.get(name, 0.0)) / n
        if per_param > 0:  # else (a disturbed run) the profile keeps the bytes model for it
            out[name] = per_param
    return out


def step_s(name: str, tensors: int, numel: int, steps: int, warmup: int, device: str = "cpu") -> float:
    """Median seconds of one step of optimizer `name` (as the runtime builds it) over `tensors` x `numel` floats
    on `device` (`timed_steps_s`)."""
    return timed_steps_s(optimizer_over(name, tensors, numel, device), steps, warmup, device)


def optimizer_over(name: str, tensors: int, numel: int, device: str = "cpu") -> Any:
    """Optimizer `name` as the runtime builds it, over `tensors` parameters of `numel` floats with gradients set."""
    import torch

    params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones(numel, device=device)
    return make_optimizer(name, params, DEFAULT_LR[name])


def timed_steps_s(opt: Any, steps: int, warmup: int, device: str = "cpu") -> float:
    """Median seconds of `opt.step()` over `steps` steps after `warmup` untimed ones (CUDA: synchronized before and
    after each, so the kernels' time counts as the runtime waits for it)."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(steps + warmup):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
