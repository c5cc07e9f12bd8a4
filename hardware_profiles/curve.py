"""Efficiency by kernel size: a measured curve of achieved/peak against FLOPs per kernel.

Why a curve and not one number: a GPU reaches its matrix peak only on large kernels.
A 256x256x256 GEMM on an H100 fills a fraction of its 132 SMs and runs at a few per
cent of peak; an 8192^3 one at ~80%. With one efficiency, a deep pipeline's small
microbatches are priced as if their GEMMs ran like the big ones. `profiles calibrate`
on CUDA (calibrate_cuda.py) times each op kind at several sizes and stores the points;
costmodels/part_costs.py reads the efficiency at a part's FLOPs per kernel.

Definition (so that per-kernel time is not counted twice): for a kernel of F FLOPs
that took t seconds, efficiency = F / (peak * (t - t_kernel)), where t_kernel is the
profile's `kernel_overhead_us` and peak its `peak_tflops` for the dtype. The cost model
prices a kernel as F / (peak * efficiency) + t_kernel, which gives back t at every
measured point.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

Curve = tuple[tuple[float, float], ...]  # ((flops_per_kernel, efficiency), ...), flops strictly increasing

MAX_CURVE_POINTS = 64  # bounded: a profile is read by every command; 64 sizes is 2 per octave over 2^32
MIN_CURVE_POINTS = 2


def interpolate(curve: Sequence[tuple[float, float]], flops_per_kernel: float) -> float:
    """Efficiency at `flops_per_kernel`: linear in log(FLOPs) between points, the end values outside.

    Log-linear because the points are measured at sizes that double (GEMM FLOPs grow 8x per
    doubling of n) and efficiency rises roughly with the log of the size until the GPU is full
    (Hockney's n_1/2 curve, r = r_inf * n / (n + n_half), is linear in log n around n_half).
    Clamped at the ends: no extrapolation beyond what was measured.
    """
    if not curve:
        raise ValueError("empty efficiency curve")
    xs = [p[0] for p in curve]
    if flops_per_kernel <= xs[0]:
        return float(curve[0][1])
    if flops_per_kernel >= xs[-1]:
        return float(curve[-1][1])
    i = bisect.bisect_right(xs, flops_per_kernel)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (math.log(flops_per_kernel) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return float(y0 + w * (y1 - y0))


def curve_keys(kind: str, base: str, dtype: str | None) -> list[str]:
    """Lookup order of a part kind's curve, as `efficiency_for` looks up single efficiencies."""
    return [f"{k}@{dtype}" for k in (kind, base) if dtype] + [kind, base]


def point_efficiency(flops: float, time_s: float, peak_flops: float, kernel_overhead_s: float) -> float:
    """Efficiency of one measured kernel of `flops` FLOPs taking `time_s`: F / (peak * (t - t_kernel)).

    A kernel hardly longer than the per-kernel time (tiny kernels, timing noise) keeps at
    least a fifth of its time as compute, so the efficiency stays finite.
    """
    if flops <= 0 or time_s <= 0 or peak_flops <= 0:
        raise ValueError("flops, time and peak must be positive")
    compute_s = max(time_s - kernel_overhead_s, 0.2 * time_s)
    return flops / (peak_flops * compute_s)


def mean_by_channels(rows: Iterable[tuple[float, float, float]]) -> tuple[Curve, Curve]:
    """(forward, backward) ((channels, factor), ...), channels increasing, from (channels, forward factor, backward
    factor) rows, rows of equal channels averaged: the `channel_factors` a sweep writes (calibrate_cuda's
    convolutions, costmodels/norm_calibration's batch norms)."""
    by_c: dict[float, list[tuple[float, float]]] = {}
    for c, fwd, bwd in rows:
        by_c.setdefault(float(c), []).append((fwd, bwd))
    items = sorted(by_c.items())
    return (tuple((c, sum(f for f, _ in v) / len(v)) for c, v in items),
            tuple((c, sum(b for _, b in v) / len(v)) for c, v in items))
