"""Host time of zero bubble's split backward beyond one whole backward, measured by `profiles calibrate`.

Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) run every stage's backward but the first as two passes through
torch.distributed.pipelining's own functions (torch 2.13 `_backward.py`): `stage_backward_input` (B) walks the
stage's autograd graph to group its parameters (`get_param_groups`) and hooks each group's intermediates, and
`stage_backward_weight` (W) then calls `torch.autograd.grad` once per group. The arithmetic is the whole
backward's; the walks, hooks and one autograd call per group are not, and neither is reading each group's
output gradient back from memory (`costmodels/split_backward.py` prices those bytes at the memory bandwidth).
Paired on one thread, split against whole, on pipeplan's own stages of the four examples (16 stages past the
first; benchmarks/RESULTS.md, "Recomputation's re-run", third table): the split cost 0.04-2.2 ms more, 1-19% of
the stage's forward + whole backward (40% of a 0.1 ms stage).
So calibrate times stages of tiny layers (their arithmetic and bytes are microseconds) whole and split, and
fits a line: per split backward + per parameter group.
"""

from __future__ import annotations

import statistics
import time
from typing import Final

from pipeplan.hardware_profiles.recompute_overhead import nonnegative_line

SIZES: Final = (2, 8, 16, 32)  # Linear(8, 8) + ReLU pairs in a stage: as many parameter groups
STEPS, WARMUP = 30, 5


def _extra_s(pairs: int) -> float:
    """The split backward's time beyond the whole backward of a stage of `pairs` tiny Linear + ReLU pairs.

    A whole and a split step alternate, each with its own forward; the median of the pairs' differences is kept,
    so the machine's drift between pairs cancels.
    """
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    layers: list[torch.nn.Module] = []
    for _ in range(pairs):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, 8, requires_grad=True)  # a stage past the first: its input needs a gradient

    def whole() -> float:
        t0 = time.perf_counter()
        out = model(x)
        out.backward(torch.ones_like(out))
        return time.perf_counter() - t0

    def split() -> float:
        t0 = time.perf_counter()
        out = model(x)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)
        return time.perf_counter() - t0

    extra = []
    for i in range(WARMUP + STEPS):
        a, b = whole(), split()
        if i >= WARMUP:
            extra.append(b - a)
        x.grad = None
        model.zero_grad(set_to_none=True)
    return statistics.median(extra)


def split_backward_overhead_s() -> tuple[float, float]:
    """(seconds per split backward, seconds per parameter group), both >= 0, on the calling thread.

    A least-squares line through stages of several sizes (each pair is one group: torch groups a Linear's weight
    and bias at its addmm), as for the checkpoint's overhead (hardware_profiles/recompute_overhead.py).
    """
    return nonnegative_line([(_extra_s(k), k) for k in SIZES])
