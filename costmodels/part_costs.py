"""Per-op-kind pricing of a layer: each cost part (graph.CostPart) gets its own roofline, plus per-kernel time.

Why not one roofline per layer: a grouped layer (a decoder block, a ResNet
bottleneck) mixes GEMMs that are compute-bound with norms, residual adds,
activations and dropout that are memory-bound. max(FLOPs / peak, bytes / bandwidth)
over the whole layer lets the GEMMs' FLOPs hide the other ops' traffic, which on a
GPU runs in separate kernels after the GEMMs, not beside them. So the time of a
layer is the sum over its parts, each part max(compute, memory) at its own
efficiency, plus what every kernel costs whatever its size.

Three effects that a FLOP and byte count alone misses, each with its source:

* Training-mode traffic (`TRAFFIC_FACTORS`). The trace counts each op's inputs and
  outputs once. PyTorch's CUDA kernels for norms read their input twice (a
  statistics pass, then the normalisation) and their backward reads input and
  output gradient twice (a reduction, then the elementwise pass); dropout writes a
  mask (counted at trace time); an elementwise op's backward reads the output
  gradient and one saved tensor and writes one gradient.
* Winograd 3x3 convolutions (`WINOGRAD_SPEEDUP`): fewer multiplies than the direct
  FLOPs on the FP32 (CUDA-core) path.
* Channels-first convolutions on tensor cores (`layout_traffic`): cuDNN's tensor-core
  kernels work in NHWC, so an NCHW (PyTorch's default) convolution in fp16, bf16 or
  tf32 transposes its tensors there and back, memory traffic the FLOPs do not show.
* Per-kernel time (`kernel_overhead_s`, `dispatch_s`): a GPU kernel cannot take less
  than its launch and tail, and eager PyTorch spends host time per op; with small
  microbatches (deep pipelines) these dominate. A fixed time t0 per kernel is the
  same model as an efficiency curve by op size, Hockney's r = r_inf * n / (n + n_half)
  (Hockney & Jesshope, Parallel Computers 2, 1988, §1.3.3), with n_half = t0 * r_inf:
  time = (F + F_half) / (peak * efficiency).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.costmodels.compute import (
    BACKWARD_BYTES_FACTOR,
    PART_BASE_KIND,
    efficiency_curve_for,
    efficiency_for,
    peak_flops_for_kind,
    roofline_time_s,
)
from pipeplan.costmodels.graph import CostPart
from pipeplan.costmodels.memory import activation_bytes_scale
from pipeplan.hardware_profiles.curve import interpolate
from pipeplan.hardware_profiles.profile import HardwareProfile

# (forward, backward) traffic as a multiple of the traced forward bytes of a part.
TRAFFIC_FACTORS: dict[str, tuple[float, float]] = {
    # PyTorch aten/src/ATen/native/cuda/Normalization.cuh (batch_norm_collect_statistics, then
    # batch_norm_elemt; backward: batch_norm_backward_reduce, then batch_norm_backward_elemt) and
    # layer_norm_kernel.cu (RowwiseMoments then the forward kernel; the backward's gamma/beta
    # reduction then the input-gradient kernel): forward reads x twice and writes y, 3 tensors
    # against the traced 2; backward reads x and dy twice and writes dx, 5 against 2.
    "norm": (1.5, 2.5),
    # y = f(x): backward reads dy and the saved x (or y) and writes dx, 3 tensors against forward's
    # 2 (aten's *_backward kernels, e.g. threshold_backward for relu, gelu_backward).
    "elementwise": (1.0, 1.5),
    # Forward reads x, writes y and a 1-byte mask (the mask is in the traced bytes); backward reads dy
    # and the mask and writes dx: as much as forward (aten native_dropout_backward).
    "dropout": (1.0, 1.0),
}

# cuDNN's Winograd algorithms for 3x3 stride-1 convolutions: F(2x2, 3x3) takes 16 multiplies where
# direct convolution takes 36, 2.25x fewer (Lavin & Gray, CVPR 2016, §4.1), at the price of transforms
# that move more bytes. Applied to the FP32 CUDA-core path only: in fp16/bf16/tf32 cuDNN runs 3x3
# convolutions as implicit GEMMs on tensor cores (NVIDIA cuDNN developer guide, "Tensor Core
# operations"). Judgement: the F(2x2) figure, not F(4x4)'s 4x, as the typical gain.
WINOGRAD_SPEEDUP = 2.25

# NVIDIA's tensor cores run convolutions natively in NHWC; with PyTorch's default NCHW tensors cuDNN transposes the
# input to NHWC before each convolution and the output back after (MosaicML Composer, "Channels Last" method card:
# "the NCHW tensor must be transposed to NHWC before the convolution and transposed back to NCHW after"; NVIDIA's
# DeepLearningExamples run their mixed-precision ResNet-50 with --memory-format nhwc for this reason, configs.yml).
# On the FP32 CUDA-core path cuDNN has NCHW kernels and no transpose. Each transpose reads and writes its tensor:
# forward moves input and output twice more; backward transposes the output gradient in, the input gradient out and
# the input again for the weight gradient, three tensors against forward's two (Judgement: 1.5x forward's).
LAYOUT_DTYPES = ("fp16", "bf16", "tf32")
LAYOUT_FACTORS = (2.0, 3.0)

# Kernels a backward runs per forward kernel: a GEMM's or convolution's backward computes the input
# gradient and the weight gradient as two kernels (Narayanan et al. 2021, App.); elementwise ops one.
# Judgement: 2.
BACKWARD_KERNELS_FACTOR = 2.0

# GPU time per kernel however small: launch latency between dependent kernels plus the tail of the
# last wave. CUDA kernel launch latency is a few microseconds (NVIDIA CUDA C++ Best Practices Guide,
# "Kernel launch overhead"; CUDA Graphs were introduced to remove it). Judgement: 3 µs.
DEFAULT_KERNEL_OVERHEAD_S = 3e-6
# Host time eager PyTorch spends per op (Python, autograd, dispatcher, cudaLaunchKernel): 5-25 µs per
# op (jiahuanglin.xyz "From PyTorch op to kernel launch" table; He, "Making Deep Learning Go Brrrr
# From First Principles", 2022, the overhead-bound regime). The GPU runs ahead of the host, so this
# bounds a layer's time from below rather than adding to it. Judgement: 8 µs.
DEFAULT_DISPATCH_S = 8e-6


def kernel_overheads_s(profile: HardwareProfile) -> tuple[float, float]:
    """(per-kernel GPU time, per-op host time) of a profile: its own figures, else the defaults above.

    A local (calibrated CPU) profile runs ops synchronously on the cores it times, so
    its per-op cost is inside its measured rates: 0 unless it records one.
    """
    default_k = 0.0 if profile.local else DEFAULT_KERNEL_OVERHEAD_S
    default_d = 0.0 if profile.local else DEFAULT_DISPATCH_S
    k = profile.kernel_overhead_s
    d = profile.dispatch_s
    return (default_k if k is None else k), (default_d if d is None else d)


def channel_factor(part: CostPart, profile: HardwareProfile, dtype: str) -> tuple[float, float]:
    """(forward, backward) multipliers on a part's efficiency for its channel count, from the profile's
    `channel_factors` ("kind@dtype", then "kind"; 1 where it has none, or the part no channels). A convolution's
    factors multiply its compute efficiency, a norm's its memory efficiency (`parts_roofline_s`).

    Why, convolutions: an implicit-GEMM convolution's tile is as wide as its channels allow; the H200's 16-channel
    3x3 convolutions ran at 0.19x (forward) and 0.08x (backward) of the 128-channel curve at their FLOPs, its
    256-channel ones at 1.2x and 0.9x (hardware_profiles/measured/nvidia-h200-calibrated.yaml).
    Norms: a channels-first batch norm reduces each channel in one thread block (export._batch_norm_channels), so
    64 channels keep few blocks on a GPU's multiprocessors; torch's cunn kernel on a Titan X (Maxwell) took 1.45x as
    long per element at 64 channels as at 128-512, 1.89x at 16 (the GP102 profiles' `channel_factors`).
    """
    if not part.channels:
        return 1.0, 1.0
    factors = profile.channel_factors.get(f"{part.kind}@{dtype}") or profile.channel_factors.get(part.kind)
    if factors is None:
        return 1.0, 1.0
    return interpolate(factors[0], part.channels), interpolate(factors[1], part.channels)


def host_floor_s(parts: Sequence[CostPart], profile: HardwareProfile) -> tuple[float, float] | None:
    """(forward, backward) host seconds to issue a layer's ops, from the profile's per-kind figures, or None where
    it has none (then ops x `dispatch_s` bounds each pass, as before).

    Why per kind: measured on an H200's host (torch 2.11, hardware_profiles/measured/nvidia-h200-calibrated.yaml),
    a ReLU costs 13 µs forward and 50 µs backward, a training-mode batch norm 60 and 110, a convolution 29-33 and
    74-81 (hardware_profiles/calibrate_dispatch.py), where one `x * 1.0` took 10: priced at that one figure the
    32x32 ResNet's calibrated step was 72% under `pipeplan run`, with these 41%. A "norm" part takes batch
    norm's figure; a kind the profile lacks takes `dispatch_s` (backward: x BACKWARD_KERNELS_FACTOR).
    """
    by_kind = profile.dispatch_by_kind_s
    if not by_kind:
        return None
    _, d = kernel_overheads_s(profile)
    fallback = (d, d * BACKWARD_KERNELS_FACTOR)
    fwd = sum(part.ops * by_kind.get(part.kind, fallback)[0] for part in parts)
    bwd = sum(part.ops * by_kind.get(part.kind, fallback)[1] for part in parts)
    return fwd, bwd


def part_bytes(part: CostPart, ratio: float) -> tuple[float, float]:
    """(forward, backward) traffic of a part at `ratio` x the traced batch, in traced (fp32) bytes.

    Weight reads stay fixed and activations scale with the batch; an embedding's
    forward gathers rows (about its output, counted in the activations twice: read and
    written) and its backward writes the whole table's dense gradient (as
    compute.layer_bytes).
    """
    w = part.param_bytes
    act = part.bytes_moved - w
    if part.kind == "embedding" and w > 0:
        gathered = 2 * act * ratio
        return gathered, w + BACKWARD_BYTES_FACTOR * gathered
    f_factor, b_factor = TRAFFIC_FACTORS.get(part.kind, (1.0, BACKWARD_BYTES_FACTOR))
    fwd = w + act * ratio
    return fwd * f_factor, fwd * b_factor


def layout_traffic(part: CostPart, profile: HardwareProfile, dtype: str, ratio: float) -> tuple[float, float]:
    """(forward, backward) traced (fp32) bytes a channels-first convolution part moves transposing to NHWC and back.

    Only on an NVIDIA GPU profile (cuDNN; a calibrated CPU runs its own kernels, TPUs and AMD GPUs other libraries),
    in a tensor-core dtype, and not where the profile has a measured efficiency curve for the kind: that
    measurement holds whatever the library did with the layout it was timed in (as `effective_flops`).
    """
    if (not part.layout_bytes or dtype not in LAYOUT_DTYPES or profile.gpu_vendor() != "nvidia"
            or efficiency_curve_for(profile, part.kind, dtype)):
        return 0.0, 0.0
    moved = part.layout_bytes * ratio
    return LAYOUT_FACTORS[0] * moved, LAYOUT_FACTORS[1] * moved


def effective_flops(part: CostPart, profile: HardwareProfile, dtype: str) -> tuple[float, float]:
    """(forward, backward) FLOPs the hardware really executes for a part (Winograd: fewer).

    A measured efficiency curve for the part's kind already holds whatever algorithm the
    library picked (its points are direct FLOPs over measured time), so it gets the direct FLOPs.
    """
    if (part.kind == "conv3x3" and dtype == "fp32" and not profile.local
            and efficiency_curve_for(profile, part.kind, dtype) is None):
        return part.fwd_flops / WINOGRAD_SPEEDUP, part.bwd_flops / WINOGRAD_SPEEDUP
    return float(part.fwd_flops), float(part.bwd_flops)


def parts_roofline_s(parts: Sequence[CostPart], profile: HardwareProfile, *, dtype: str,
                     ratio: float) -> tuple[float, float]:
    """(fwd_s, bwd_s) of a layer's parts at `ratio` x the traced batch: summed rooflines plus kernel time.

    Per pass: sum over parts of max(FLOPs / (peak * eff), bytes / (bandwidth * eff))
    + kernels x per-kernel time, and no less than the host's time to issue the ops (`host_floor_s`, else
    ops x host dispatch time). A profile
    with an `efficiency_curve` for a part's kind gives eff at the part's FLOPs per kernel
    (forward: FLOPs / ops; backward: FLOPs / (ops x BACKWARD_KERNELS_FACTOR)); the curve
    is defined net of the per-kernel time (hardware_profiles/curve.py), so adding it here
    does not count it twice.
    """
    kernel_s, dispatch_s = kernel_overheads_s(profile)
    scale = activation_bytes_scale(dtype)
    fwd = bwd = 0.0
    ops = 0
    for part in parts:
        base = PART_BASE_KIND.get(part.kind, part.kind)
        peak = peak_flops_for_kind(profile, base, dtype)
        f_flops, b_flops = effective_flops(part, profile, dtype)
        f_bytes, b_bytes = part_bytes(part, ratio)
        f_layout, b_layout = layout_traffic(part, profile, dtype, ratio)
        f_bytes, b_bytes = f_bytes + f_layout, b_bytes + b_layout
        kernels = max(part.ops, 1)
        narrow_f, narrow_b = channel_factor(part, profile, dtype)
        on_memory = part.kind == "norm"  # a norm's channels limit its bandwidth; a convolution's, its FLOP rate
        ce, me = efficiency_for(profile, part.kind, dtype, f_flops * ratio / kernels)
        ce, me = (ce, me * narrow_f) if on_memory else (ce * narrow_f, me)
        fwd += roofline_time_s(f_flops * ratio, f_bytes * scale, peak, profile.mem_bw_bytes_per_s, ce, me)
        ce, me = efficiency_for(profile, part.kind, dtype, b_flops * ratio / (kernels * BACKWARD_KERNELS_FACTOR))
        ce, me = (ce, me * narrow_b) if on_memory else (ce * narrow_b, me)
        bwd += roofline_time_s(b_flops * ratio, b_bytes * scale, peak, profile.mem_bw_bytes_per_s, ce, me)
        ops += part.ops
    bwd_ops = ops * BACKWARD_KERNELS_FACTOR
    host = host_floor_s(parts, profile) or (ops * dispatch_s, bwd_ops * dispatch_s)
    return max(fwd + ops * kernel_s, host[0]), max(bwd + bwd_ops * kernel_s, host[1])
