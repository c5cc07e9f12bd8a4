"""Batch norm's price by channel count on a calibrated GPU: `profiles calibrate` (CUDA) times training-mode batch
norms of 16-2048 channels (hardware_profiles/calibrate_cuda.measure_norm_sweep) and this turns those times into
the profile's `channel_factors` for norms, the multiplier on memory efficiency that part_costs.channel_factor
applies to a channels-first batch norm.

Why here, not in hardware_profiles: a factor is measured time against the cost model's own price of the same
layer, and that price rests on the tracer's byte count of a batch norm (costmodels/export.cost_parts) and on
part_costs' traffic factors, which the profile package may not import (imports flow hardware_profiles <-
costmodels). Each sweep row is priced as the tracer would price an nn.BatchNorm2d of its channels: the module is
exported at batch 1 and its norm part (export.cost_parts, as trace.py makes a layer's parts) scaled to the row's
batch, so the factor makes the model give back the measured time (less the per-kernel time the model adds) and
stays right if the byte count changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from pipeplan.costmodels.compute import efficiency_for
from pipeplan.costmodels.export import cost_parts, export_program, param_input_names
from pipeplan.costmodels.graph import CostPart
from pipeplan.costmodels.memory import activation_bytes_scale
from pipeplan.costmodels.model_file import ModelSpec
from pipeplan.costmodels.part_costs import BACKWARD_KERNELS_FACTOR, kernel_overheads_s, part_bytes
from pipeplan.hardware_profiles.curve import mean_by_channels
from pipeplan.hardware_profiles.profile import HardwareProfile

SWEEP_KEY = "batch_norm_sweep"  # calibration.<this>: {dtype: [[C, HW, N, forward s, backward s], ...]}
FACTOR_RANGE = (1e-3, 16.0)  # the loader's bounds on a channel factor, (0, 16]
# Which profile key each measured dtype writes: bf16 its own; fp32 the plain "norm", which every other dtype
# (tf32: the same kernels as fp32; fp16: not measured) falls back to (part_costs.channel_factor's lookup order).
KEY_BY_DTYPE = {"fp32": "norm", "bf16": "norm@bf16"}


@functools.lru_cache(maxsize=64)
def batch_norm_part(channels: int, hw: int) -> CostPart:
    """The norm part the tracer makes of `nn.BatchNorm2d(channels)` on a (1, channels, hw, hw) input (train mode)."""
    model = torch.nn.BatchNorm2d(channels)
    x = torch.randn(1, channels, hw, hw)
    spec = ModelSpec(path="<batch norm sweep>", entry="build_model", module=None)  # type: ignore[arg-type]
    ep = export_program(spec, model, (x,))
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]  # one layer's nodes, as trace.py passes them
    parts = [p for p in cost_parts(nodes, {}, param_input_names(ep), 0) if p.kind == "norm"]
    if len(parts) != 1 or parts[0].channels != channels:
        raise RuntimeError(f"tracing nn.BatchNorm2d({channels}) gave norm parts {parts}, not one of its channels")
    return parts[0]


def memory_s(part: CostPart, batch: int, profile: HardwareProfile, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the part's traffic at `batch` x its traced batch, at factor 1: the memory
    term of part_costs.parts_roofline_s (a batch norm has no FLOPs the tracer counts, so it is the whole roofline)."""
    f_bytes, b_bytes = part_bytes(part, float(batch))
    scale = activation_bytes_scale(dtype)
    bandwidth = profile.mem_bw_bytes_per_s * efficiency_for(profile, part.kind, dtype)[1]
    return f_bytes * scale / bandwidth, b_bytes * scale / bandwidth


def norm_channel_factors(rows: list[list[float]], profile: HardwareProfile, dtype: str
                         ) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """(forward, backward) ((channels, factor), ...) from measure_norm_sweep's rows: the model's memory time at
    factor 1 over the measured time less the kernels' fixed time (the model adds ops x kernel_overhead, backward
    BACKWARD_KERNELS_FACTOR x as many), so that factor x efficiency prices each row at its measured time.
    A row whose time is not above its kernels' is skipped (nothing to scale); rows of equal channels averaged."""
    kernel_s = kernel_overheads_s(profile)[0]
    factors = []
    for c, hw, n, fwd_s, bwd_s in rows:
        part = batch_norm_part(int(c), int(hw))
        mem_f, mem_b = memory_s(part, int(n), profile, dtype)
        net_f, net_b = fwd_s - part.ops * kernel_s, bwd_s - part.ops * BACKWARD_KERNELS_FACTOR * kernel_s
        if net_f > 0 and net_b > 0:
            factors.append((c, _clamp(mem_f / net_f), _clamp(mem_b / net_b)))
    return mean_by_channels(factors)


def _clamp(factor: float) -> float:
    return min(FACTOR_RANGE[1], max(FACTOR_RANGE[0], factor))


def with_batch_norm_factors(profile: HardwareProfile) -> HardwareProfile:
    """`profile` with norm `channel_factors` from its `calibration.batch_norm_sweep` in place of any it had
    (unchanged without a sweep), and a source line saying so. (The factors do not depend on a profile's own norm
    factors: `memory_s` prices at factor 1.)"""
    sweep: dict[str, Any] = (profile.calibration or {}).get(SWEEP_KEY) or {}
    factors = {k: v for k, v in profile.channel_factors.items() if k.split("@")[0] != "norm"}
    for dtype, key in KEY_BY_DTYPE.items():
        fwd, bwd = norm_channel_factors(sweep.get(dtype) or [], profile, dtype)
        if len(fwd) >= 2:
            factors[key] = (fwd, bwd)
    written = sorted(k for k in factors if k.split("@")[0] == "norm")
    if not written:
        return profile
    channels = sorted({int(row[0]) for rows in sweep.values() for row in rows})
    source = (f"channel_factors.{'/'.join(written)}: calibration.{SWEEP_KEY}, training-mode batch norms of "
              f"{channels[0]}-{channels[-1]} channels timed on this GPU (hardware_profiles/calibrate_cuda."
              "measure_norm_sweep), each the model's price of that nn.BatchNorm2d at the copy's bandwidth over its "
              "measured time (costmodels/norm_calibration.py); tf32 and fp16 take fp32's ('norm')")
    return dataclasses.replace(profile, channel_factors=factors, sources=tuple(profile.sources) + (source,))
