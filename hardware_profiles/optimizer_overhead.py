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
adds tensors x that to the bytes / bandwidth term.
"""

from __future__ import annotations

import statistics
import time
from typing import Final

from pipeplan.choices import OPTIMIZERS
from pipeplan.optimizers import DEFAULT_LR, make_optimizer

TENSORS: Final[int] = 256
NUMEL: Final[int] = 16  # 64 bytes a tensor: the bytes term is nanoseconds
STEPS, WARMUP = 15, 3


def per_tensor_s() -> dict[str, float]:
    """Median seconds per parameter tensor of one step of each optimizer, on the calling thread."""
    import torch

    out: dict[str, float] = {}
    for name in OPTIMIZERS:
        params = [torch.nn.Parameter(torch.zeros(NUMEL)) for _ in range(TENSORS)]
        for p in params:
            p.grad = torch.ones(NUMEL)
        opt = make_optimizer(name, params, DEFAULT_LR[name])
        times = []
        for i in range(STEPS + WARMUP):
            t0 = time.perf_counter()
            opt.step()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) / TENSORS
    return out
