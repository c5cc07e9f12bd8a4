"""Host time of torch's checkpoint around a recomputed region, measured by `profiles calibrate`.

The runtime recomputes a stage with `torch.utils.checkpoint.checkpoint(use_reentrant=False)` (runtime/recompute.py).
Besides re-running the forward, the checkpoint does Python work: per region (saving and forking the RNG state,
the frame that tracks the re-run, stopping it early) and per tensor the forward saves (a pack hook in the forward,
another in the re-run, an unpack in the backward). On one core here regions of 2 to 64 tiny Linear + ReLU pairs
(6 to 192 saved tensors) cost 0.4-0.7 ms to 7-9 ms beyond their forward, backward and re-run: fits of 0-0.7 ms
per region and 25-52 µs per saved tensor, five runs. A GPT-2 block saves ~20 tensors, a ResNet stage ~100:
milliseconds that the re-run's FLOPs do not show. So calibrate times regions of tiny layers (their arithmetic
is microseconds) with and without the checkpoint and fits a line: per region + per saved tensor
(costmodels/recompute.py adds them to the re-run).
"""

from __future__ import annotations

import statistics
import time
from typing import Final

SIZES: Final = (2, 8, 32, 64)  # Linear(8, 8) + ReLU pairs in the regions: 6 to 192 saved tensors
STEPS, WARMUP = 30, 5


def _extra_s(pairs: int) -> tuple[float, int]:
    """(the checkpoint's time beyond forward + backward + one more forward, tensors the forward saves).

    Plain and checkpointed steps alternate and a forward runs between them; the median of each trio's difference
    is kept, so the machine's drift between trios cancels.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    layers: list[torch.nn.Module] = []
    for _ in range(pairs):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, 8, requires_grad=True)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    extra = []
    for i in range(WARMUP + STEPS):
        fwd = timed(lambda: model(x))
        plain = timed(lambda: model(x).sum().backward())
        ck = timed(lambda: checkpoint(model, x, use_reentrant=False).sum().backward())
        if i >= WARMUP:
            extra.append(ck - plain - fwd)
    return statistics.median(extra), saved[0]


def checkpoint_overhead_s() -> tuple[float, float]:
    """(seconds per recomputed region, seconds per tensor its forward saves), both >= 0, on the calling thread.

    A least-squares line through regions of several sizes: two sizes alone let one noisy timing swing the split
    between the terms (this machine's speed drifts by 10-15% within seconds).
    """
    return nonnegative_line([_extra_s(k) for k in SIZES])


def nonnegative_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (time, count) points, each clamped at 0 (a noisy
    timing can tilt the line below zero; a host cost never is)."""
    n_mean = sum(n for _, n in points) / len(points)
    t_mean = sum(t for t, _ in points) / len(points)
    slope = max(0.0, sum((n - n_mean) * (t - t_mean) for t, n in points) / sum((n - n_mean) ** 2 for _, n in points))
    return max(0.0, t_mean - slope * n_mean), slope
