"""Measure THIS machine's GPU into a hardware profile (`pipeplan profiles calibrate` on CUDA).

What is measured, and how each number is defined (every one is written with its source):
- Efficiency curves (hardware_profiles/curve.py): GEMMs (square n x n x n, fp32, tf32, bf16),
  3x3 convolutions (fp32 and bf16, 128 channels at 28x28, batch varied) and causal
  scaled-dot-product attention (fp32 and bf16, 12 heads of 64, sequence varied), each
  point (FLOPs per kernel, F / (peak * (t - t_kernel))) with FLOPs counted as torch's
  FlopCounterMode counts them (2 per multiply-add; attention 4*B*H*S^2*D whether
  causal or not, as the tracer counts it) and peak the datasheet's.
- Times per kernel come from CUDA-graph replays of many back-to-back kernels timed with
  CUDA events (median of the replays): a graph removes the host from the loop, so small
  kernels are timed as the GPU runs them, not as fast as Python launches them.
- kernel_overhead_us: GPU time per 1-element kernel in the same graph replays.
- dispatch_us: host time per eager op that autograd records (x * 1.0 with x requiring
  grad), back-to-back without synchronizing: eager PyTorch's floor per op.
- dispatch_us_by_kind: the same by op kind and pass (calibrate_dispatch.py).
- channel_factors: 3x3 convolutions of 16-256 channels (`measure_conv_sweep`, kept as
  `calibration.conv3x3_sweep`), each channel count's efficiency over the conv3x3 curve's; training-mode batch
  norms of 16-2048 channels (`measure_norm_sweep`, kept as `calibration.batch_norm_sweep`), turned into
  "norm@dtype" factors by the cost model that prices them (costmodels/norm_calibration.py: the layer import
  order keeps the tracer's byte count out of this package).
- optimizer_us_per_tensor / optimizer_ns_per_param / optimizer_us_per_step: the runtime's step on the GPU,
  torch.optim's fused kernels (pipeplan/optimizers.py; optimizer_overhead.py); `calibration.adam_step_us_by_tensors`: Adam over 1, 16, 64 tensors.
- memory bandwidth: a 1 GiB device-to-device copy, bytes read + written over time;
  `efficiency.memory` = measured / datasheet.
- peak_tflops: the datasheet's (the catalogue profile matching the device name); the
  best measured GEMM rate per dtype is recorded beside it under `calibration`. Without
  a matching catalogue profile, the measured best is the peak.
- Links: NCCL send/recv ping-pong, all-reduce, reduce-scatter and all-gather between GPUs 0 and 1 when two or more
  are visible (calibrate_nccl.py). With one GPU nothing can be measured (NCCL refuses two
  ranks on one GPU), so the links are the catalogue profile's, with that written beside them.
"""

from __future__ import annotations

import datetime
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from pipeplan.errors import UserError
from pipeplan.hardware_profiles.curve import interpolate, mean_by_channels, point_efficiency
from pipeplan.hardware_profiles.gpu_catalog import catalog_match
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.units import GIB

Progress = Callable[[str, int, int], None]

MATMUL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)  # n of an n x n x n GEMM
CONV_BATCHES = (1, 4, 16, 64, 256)  # N of a 3x3 convolution, C_in = C_out = 128, 28 x 28, padding 1
CONV_SHAPE = (128, 28)
CONV_SWEEP = ((16, 32), (32, 16), (64, 8), (128, 4), (64, 32), (128, 16), (256, 8))  # (C, HW), batch below
CONV_SWEEP_BATCH = 256
# (C, HW, N) of an NCHW batch norm, 2^25 elements each (128 MiB in fp32: past an H100's 50 MB L2, so HBM): 16 to
# 2048 channels, a CIFAR ResNet's stem to ResNet-50's last stage; one thread block reduces each channel.
NORM_SWEEP = ((16, 64, 512), (32, 64, 256), (64, 32, 512), (128, 32, 256), (256, 16, 512), (512, 16, 256),
              (1024, 8, 512), (2048, 8, 256))
NORM_SWEEP_CALLS = 20  # per graph: ~0.1-1 ms a call on an H100, a few ms a replay
BN_MOMENTUM, BN_EPS = 0.1, 1e-5  # nn.BatchNorm2d's defaults
ATTENTION_SEQS = (128, 256, 512, 1024, 2048, 4096)  # S of causal SDPA, batch 8, 12 heads of 64
ATTENTION_SHAPE = (8, 12, 64)
COPY_BYTES = GIB  # far beyond the H100's 50 MB L2, so this is HBM bandwidth
TARGET_REPLAY_FLOPS = 2e12  # kernels per graph: about 2 TFLOP per replay (~3-30 ms)
MAX_KERNELS_PER_GRAPH = 200
REPLAYS = 7
DTYPE_NAMES = ("fp32", "tf32", "bf16")


def _torch() -> Any:
    import torch

    return torch


def warm_on_side_stream(fn: Callable[[], object], calls: int = 3) -> None:
    """`calls` warm-up calls of `fn` on a side stream, then a synchronize: what CUDA graph capture requires first
    (its allocations and lazy initialisation must not happen inside the capture)."""
    torch = _torch()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def time_per_call_s(fn: Callable[[], object], calls: int) -> float:
    """Median GPU seconds per `fn()` over REPLAYS replays of a CUDA graph of `calls` back-to-back calls.

    Falls back to timing `calls` eager calls between two events when `fn` cannot be
    captured (that then includes launch gaps if the host is slower than the GPU).
    """
    torch = _torch()
    warm_on_side_stream(fn)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run: Callable[[], object] = graph.replay
    except Exception:  # not capturable: time eagerly
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(calls):
                fn()
    run()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return float(statistics.median(times))


def _calls(flops: float) -> int:
    return max(1, min(MAX_KERNELS_PER_GRAPH, int(TARGET_REPLAY_FLOPS / flops)))


def _dtype(name: str) -> Any:
    torch = _torch()
    return torch.bfloat16 if name == "bf16" else torch.float32


def measure_matmul(dtype_name: str) -> list[tuple[float, float]]:
    """(FLOPs, seconds) per GEMM for each size; tf32 is fp32 with torch.backends.cuda.matmul.allow_tf32."""
    torch = _torch()
    out = []
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    try:
        for n in MATMUL_SIZES:
            a, b = (torch.randn(n, n, device="cuda", dtype=_dtype(dtype_name)) for _ in range(2))
            c = torch.empty_like(a)
            flops = 2.0 * n ** 3
            out.append((flops, time_per_call_s(functools.partial(torch.mm, a, b, out=c), _calls(flops))))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return out


def measure_conv(dtype_name: str) -> list[tuple[float, float]]:
    """(FLOPs, seconds) per 3x3 convolution (2*N*H*W*C_out*C_in*9, torch's conv_flop_count) for each batch."""
    torch = _torch()
    c, hw = CONV_SHAPE
    out = []
    for n in CONV_BATCHES:
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=_dtype(dtype_name))
        w = torch.randn(c, c, 3, 3, device="cuda", dtype=_dtype(dtype_name))
        flops = 2.0 * n * hw * hw * c * c * 9
        conv = functools.partial(torch.nn.functional.conv2d, x, w, padding=1)
        out.append((flops, time_per_call_s(conv, _calls(flops))))
    return out


def measure_conv_sweep(dtype_name: str) -> list[list[float]]:
    """[C, HW, N, FLOPs, forward s, backward s] per 3x3 convolution of C -> C channels at HW x HW, batch N.

    The shapes of a CIFAR-size ResNet's stages and wider ones: cuDNN's efficiency at equal FLOPs depends on the
    channel count (the implicit GEMM's reduction is C x 9), which the batch-varied curve above does not show.
    Backward is aten.convolution_backward for the input and weight gradients, as autograd calls it.
    """
    torch = _torch()
    out = []
    for c, hw in CONV_SWEEP:
        n = CONV_SWEEP_BATCH
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=_dtype(dtype_name))
        w = torch.randn(c, c, 3, 3, device="cuda", dtype=_dtype(dtype_name))
        gy = torch.randn_like(x)
        flops = 2.0 * n * hw * hw * c * c * 9
        fwd = time_per_call_s(functools.partial(torch.nn.functional.conv2d, x, w, padding=1), _calls(flops))
        bwd = time_per_call_s(functools.partial(torch.ops.aten.convolution_backward, gy, x, w, None, [1, 1], [1, 1],
                                                [1, 1], False, [0, 0], 1, [True, True, False]), _calls(2 * flops))
        out.append([c, hw, n, flops, fwd, bwd])
    return out


def measure_norm_sweep(dtype_name: str, *, device: str = "cuda",
                       time_s: Callable[[Callable[[], object], int], float] | None = None) -> list[list[float]]:
    """[C, HW, N, forward s, backward s] per training-mode batch norm of NORM_SWEEP's shapes, as autograd runs
    one: aten._batch_norm_with_update forward (statistics, normalisation, running-statistics update) and
    aten.batch_norm_backward with its saved mean, inverse std and reserve (cuDNN's or the native kernels, whichever
    torch picks for the shape). In bf16 the input is bf16 and the affine parameters and statistics fp32, as a
    convolution's output meets an nn.BatchNorm2d under torch.autocast (batch_norm is on neither autocast list).

    Why: an NCHW batch norm reduces each channel in one thread block, so few channels leave the GPU's bandwidth
    idle (cunn's kernel on a Titan X: 1.89x as long per element at 16 channels as at 128-512, the GP102 profiles'
    `channel_factors`), and a calibrated profile priced batch norms at the copy's bandwidth: the 32x32 ResNet's
    17-64% under their traced times on an H200 (RESULTS, "GPU: predicted against measured" (a)).
    `device`/`time_s`: tests run the same ops on the CPU with a wall-clock timer (default: CUDA graphs, events).
    """
    torch = _torch()
    time_s = time_s or time_per_call_s
    ops = torch.ops.aten
    out = []
    for c, hw, n in NORM_SWEEP:
        x = torch.randn(n, c, hw, hw, device=device, dtype=_dtype(dtype_name))
        w, b = torch.ones(c, device=device), torch.zeros(c, device=device)
        mean, var = torch.zeros(c, device=device), torch.ones(c, device=device)
        fwd = functools.partial(ops._batch_norm_with_update, x, w, b, mean, var, BN_MOMENTUM, BN_EPS)
        _, saved_mean, saved_rstd, reserve = fwd()
        gy = torch.randn_like(x)
        bwd = functools.partial(ops.batch_norm_backward, gy, x, w, mean, var, saved_mean, saved_rstd, True, BN_EPS,
                                [True, True, True], reserve)
        out.append([c, hw, n, time_s(fwd, NORM_SWEEP_CALLS), time_s(bwd, NORM_SWEEP_CALLS)])
        del x, gy, reserve
    return out


def _has_batch_norm_ops() -> bool:
    aten = _torch().ops.aten
    return hasattr(aten, "_batch_norm_with_update") and hasattr(aten, "batch_norm_backward")


def measure_attention(dtype_name: str) -> list[tuple[float, float]]:
    """(FLOPs, seconds) per causal SDPA forward, FLOPs 4*B*H*S^2*D (torch's sdpa_flop_count) for each S."""
    torch = _torch()
    b, h, d = ATTENTION_SHAPE
    out = []
    for s in ATTENTION_SEQS:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=_dtype(dtype_name)) for _ in range(3))
        flops = 4.0 * b * h * s * s * d
        fn = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True)
        out.append((flops, time_per_call_s(fn, _calls(flops))))
    return out


def measure_copy_bytes_per_s() -> float:
    """Device-to-device copy of COPY_BYTES: (read + written bytes) / median time."""
    torch = _torch()
    x = torch.empty(COPY_BYTES // 4, device="cuda")
    y = torch.empty_like(x)
    t = time_per_call_s(lambda: y.copy_(x), 5)
    return 2.0 * COPY_BYTES / t


def measure_kernel_overhead_s() -> float:
    """GPU seconds per 1-element kernel, back to back in a CUDA graph (launch + tail, no work)."""
    torch = _torch()
    x = torch.zeros(1, device="cuda")
    return time_per_call_s(lambda: x.add_(1.0), 1000)


def measure_dispatch_s(ops: int = 2000) -> dict[str, float]:
    """Host seconds per eager op issued back to back: a plain in-place add and an op autograd records."""
    torch = _torch()
    x = torch.zeros(1, device="cuda")
    g = torch.zeros(1, device="cuda", requires_grad=True)
    out = {}
    ops_by_label: dict[str, Callable[[], object]] = {"plain": lambda: x.add_(1.0), "autograd": lambda: g * 1.0}
    for label, fn in ops_by_label.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ops):
            fn()
        out[label] = (time.perf_counter() - t0) / ops
        torch.cuda.synchronize()
    return out


def curve(points: list[tuple[float, float]], peak_flops: float, kernel_s: float) -> list[tuple[float, float]]:
    """The measured (FLOPs, seconds) as (FLOPs, efficiency) points (curve.point_efficiency), FLOPs increasing."""
    return [(f, point_efficiency(f, t, peak_flops, kernel_s)) for f, t in sorted(points)]


def channel_factors(sweep: list[list[float]], curve: tuple[tuple[float, float], ...], peak_flops: float,
                    kernel_s: float) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """(forward, backward) ((channels, factor), ...) from `measure_conv_sweep`'s rows: each row's efficiency
    (curve.point_efficiency; backward: its two kernels, 2F FLOPs) over the batch-varied curve's at the row's
    forward FLOPs per kernel (the backward's kernels each have that many), averaged over rows of equal channels.

    Why: the curve is measured at 128 channels; on the H200 a 16-channel convolution of the same FLOPs ran at a
    fifth of it forward and a twelfth backward, and a 256-channel one at 1.2x and 0.9x.
    """
    rows = []
    for c, _hw, _n, flops, fwd_s, bwd_s in sweep:
        ref = interpolate(curve, flops)
        rows.append((c, point_efficiency(flops, fwd_s, peak_flops, kernel_s) / ref,
                     point_efficiency(2 * flops, bwd_s, peak_flops, 2 * kernel_s) / ref))
    return mean_by_channels(rows)


def calibrate_cuda(*, name: str = "local-gpu", progress: Progress | None = None) -> HardwareProfile:
    """Measure GPU 0 into a profile (see the module docstring for every definition)."""
    torch = _torch()
    if not torch.cuda.is_available():
        raise UserError("profiles calibrate --device cuda: no CUDA GPU is visible",
                        "run on a machine with a GPU, or calibrate the CPU with --device cpu")

    def step(phase: str, i: int, n: int) -> None:
        if progress is not None:
            progress(phase, i, n)

    torch.cuda.set_device(0)
    device = torch.cuda.get_device_name(0)
    stamp = f"measured by pipeplan profiles calibrate on {device}, {datetime.date.today().isoformat()}"
    sheet = catalog_match(device)
    step("kernel overhead and dispatch", 0, 7)
    kernel_s = measure_kernel_overhead_s()
    dispatch = measure_dispatch_s()
    step("memory bandwidth", 1, 7)
    copy_bw = measure_copy_bytes_per_s()
    raw: dict[str, list[tuple[float, float]]] = {}
    step("GEMMs", 2, 7)
    for d in DTYPE_NAMES:
        raw[f"matmul@{d}"] = measure_matmul(d)
    step("3x3 convolutions", 3, 7)
    for d in ("fp32", "bf16"):
        raw[f"conv3x3@{d}"] = measure_conv(d)
    step("attention", 4, 7)
    for d in ("fp32", "bf16"):
        raw[f"attention@{d}"] = measure_attention(d)
    facts = {"total_memory": int(torch.cuda.get_device_properties(0).total_memory),
             "torch": str(torch.__version__), "cuda": str(torch.version.cuda), **_host_and_shape_facts(step)}
    return build_profile(name=name, device=device, stamp=stamp, sheet=sheet, raw=raw, kernel_s=kernel_s,
                         dispatch=dispatch, copy_bw=copy_bw, links=_links(stamp, sheet), facts=facts)


def _host_and_shape_facts(step: Callable[[str, int, int], None]) -> dict[str, Any]:
    """`build_profile`'s facts beyond the curves: host time per op kind, the optimizer step, the convolution sweep."""
    from pipeplan.hardware_profiles import optimizer_overhead
    from pipeplan.hardware_profiles.calibrate_dispatch import measure_dispatch_by_kind

    step("per-kind dispatch, convolution and batch-norm shapes", 5, 7)
    by_kind = measure_dispatch_by_kind("cuda")
    sweep = {d: measure_conv_sweep(d) for d in ("fp32", "bf16")}
    # torch's training-mode batch-norm ops as autograd runs them (torch 2.3 on); without them no norm factors
    norms = {d: measure_norm_sweep(d) for d in ("fp32", "bf16")} if _has_batch_norm_ops() else {}
    step("optimizer step", 6, 7)
    optimizer_s = optimizer_overhead.per_tensor_s("cuda")
    param_s = optimizer_overhead.per_param_s(optimizer_s, "cuda")
    fixed_s = optimizer_overhead.per_step_s(optimizer_s, "cuda")
    o = optimizer_overhead
    adam_us = {str(n): round(o.step_s("adam", n, o.NUMEL, o.STEPS, o.WARMUP, "cuda") * 1e6, 2) for n in (1, 16, 64)}
    step("done", 7, 7)
    return {"optimizer_tensor_s": optimizer_s, "optimizer_param_s": param_s, "optimizer_step_s": fixed_s,
            "dispatch_by_kind": by_kind,
            "extra": {"adam_step_us_by_tensors": adam_us,
                      "conv3x3_sweep": {d: [[float(v) for v in row] for row in rows] for d, rows in sweep.items()},
                      "batch_norm_sweep": {d: [[float(v) for v in row] for row in rows] for d, rows in norms.items()}}}


def _links(stamp: str, sheet: HardwareProfile | None) -> dict[str, Any]:
    """NCCL links measured between GPUs 0 and 1, or (one GPU) the catalogue's, and what was done."""
    torch = _torch()
    count = torch.cuda.device_count()
    if count >= 2:
        from pipeplan.hardware_profiles.calibrate_nccl import measure_nccl

        return measure_nccl(stamp)
    why = f"NCCL not measured: {count} GPU visible and NCCL refuses two ranks on one GPU"
    if sheet is None:
        return {"note": why + "; no catalogue profile matches this device, so the links are placeholders",
                "intra_node": Link("nvlink", 450e9, 3e-6), "inter_node": Link("infiniband", 50e9, 5e-6),
                "collectives": {}, "devices_per_node": count}
    return {"note": f"{why}; intra_node and inter_node are catalogue {sheet.name}'s (hardware_profiles/catalog/{sheet.name}.yaml)",
            "intra_node": sheet.intra_node, "inter_node": sheet.inter_node, "collectives": {},
            "devices_per_node": count}


def _peaks(sheet: HardwareProfile | None, raw: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float | None],
                                                                                                 dict[str, float]]:
    """(peak FLOP/s per dtype written to the profile, best measured GEMM FLOP/s per dtype)."""
    best = {d: max(f / t for f, t in raw[f"matmul@{d}"]) for d in DTYPE_NAMES}
    if sheet is not None:
        return dict(sheet.peak_flops), best
    return {"fp32": best["fp32"], "tf32": best["tf32"], "bf16": best["bf16"], "fp16": best["bf16"]}, best


def build_profile(*, name: str, device: str, stamp: str, sheet: HardwareProfile | None,
                  raw: dict[str, list[tuple[float, float]]], kernel_s: float, dispatch: dict[str, float],
                  copy_bw: float, links: dict[str, Any], facts: dict[str, Any]) -> HardwareProfile:
    """The profile from the measurements (pure: tests build one from made-up numbers).

    `facts`: the device's total_memory (bytes), the torch and CUDA versions, optionally the optimizer step's
    measured seconds per tensor and per parameter (`optimizer_tensor_s`, `optimizer_param_s`), the host seconds
    per op by kind (`dispatch_by_kind`, calibrate_dispatch.py) and `extra`
    measurements kept under `calibration` for the record (Adam's step by tensor count, convolution shapes).
    """
    peaks, best = _peaks(sheet, raw)
    curves = {}
    for key, points in raw.items():
        peak = peaks.get(key.split("@")[1]) or best["fp32"]
        curves[key] = tuple(curve(points, float(peak), kernel_s))
    sweep = facts.get("extra", {}).get("conv3x3_sweep", {})
    factors = {f"conv3x3@{d}": channel_factors(rows, curves[f"conv3x3@{d}"], float(peaks.get(d) or best["fp32"]),
                                                kernel_s)
               for d, rows in sweep.items() if len(rows) >= 2 and f"conv3x3@{d}" in curves}
    total = int(facts["total_memory"])
    datasheet_bw = sheet.mem_bw_bytes_per_s if sheet is not None else copy_bw
    sources = [
        f"efficiency_curve: {stamp}, CUDA-graph replays timed with CUDA events; efficiency = F / (peak * (t - "
        "kernel_overhead)), peak = peak_tflops",
        f"kernel_overhead_us: {stamp}, 1-element add_ kernels back to back in a CUDA graph",
        f"dispatch_us: {stamp}, host time per eager autograd-recorded op (x * 1.0), no synchronize",
        f"channel_factors: {stamp}, 3x3 convolutions of 16-256 channels (calibration.conv3x3_sweep) against "
        "the conv3x3 curve at their FLOPs (calibrate_cuda.channel_factors)",
        f"dispatch_us_by_kind: {stamp}, host time per op of each kind on tiny tensors, forward and backward, the "
        "slope between 1 and 32 ops (hardware_profiles/calibrate_dispatch.py)",
        f"optimizer_us_per_tensor / optimizer_ns_per_param / optimizer_us_per_step: {stamp}, the step `pipeplan "
        "run` takes on the GPU, torch.optim's fused kernels (pipeplan/optimizers.py; hardware_profiles/"
        "optimizer_overhead.py), synchronized",
        f"memory_bandwidth_gbps / efficiency.memory: {stamp}, {COPY_BYTES // GIB} GiB device-to-device copy "
        f"{copy_bw / 1e9:.0f} GB/s (read + written) against the datasheet's {datasheet_bw / 1e9:.0f} GB/s",
        f"memory_gib: {stamp}, torch.cuda.get_device_properties total_memory; usable = total - 1 GiB "
        "(CUDA context and NCCL buffers, as the catalogue)",
        "peak_tflops: " + (f"datasheet, catalogue {sheet.name} (hardware_profiles/catalog/{sheet.name}.yaml)" if sheet is not None
                           else f"{stamp}, best GEMM rate per dtype (no catalogue profile matches)"),
        "links: " + links["note"],
    ]
    return HardwareProfile(
        name=name, device=device, memory_bytes=total, usable_memory_bytes=max(total - GIB, GIB),
        mem_bw_bytes_per_s=datasheet_bw, peak_flops=peaks, devices_per_node=max(1, int(links["devices_per_node"])),
        intra_node=links["intra_node"], inter_node=links["inter_node"],
        efficiency={"memory": min(2.0, copy_bw / datasheet_bw)}, sources=tuple(sources),
        collectives=links["collectives"], kernel_overhead_s=kernel_s, dispatch_s=dispatch["autograd"],
        dispatch_by_kind_s=dict(facts.get("dispatch_by_kind", {})),
        efficiency_curve=curves, channel_factors=factors, notes=links["note"], optimizer_tensor_s=dict(facts.get("optimizer_tensor_s", {})),
        optimizer_param_s=dict(facts.get("optimizer_param_s", {})),
        optimizer_step_s=dict(facts.get("optimizer_step_s", {})),
        calibration={"device_type": "cuda", "device_name": device, "torch": facts["torch"],
                     "cuda": facts["cuda"], "date": datetime.date.today().isoformat(),
                     "best_gemm_tflops": {d: round(v / 1e12, 2) for d, v in best.items()},
                     "copy_gbps": round(copy_bw / 1e9, 1), "dispatch_plain_us": round(dispatch["plain"] * 1e6, 3),
                     "catalogue_match": sheet.name if sheet is not None else None, **facts.get("extra", {})},
    )
