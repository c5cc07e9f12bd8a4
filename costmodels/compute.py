"""Compute cost: how long a layer's forward and backward take on a target device.

The graph carries FLOPs and bytes moved for every layer, measured once on the
tracing machine; a roofline turns them into time on any profile, including
hardware the user does not have. A roofline alone is optimistic (nothing
reaches peak), so each kind of op gets an efficiency: the fraction of peak
compute a well-tuned kernel of that kind reaches in published measurements.
Profiles may override any of them (`HardwareProfile.efficiency`, keys are
graph.LAYER_KINDS plus "memory" for the bandwidth fraction).

Numbers and where they come from are in docs/cost-models.md; several are
judgements between published figures and are labelled so.
"""

from __future__ import annotations

from pipeplan.choices import DTYPES
from pipeplan.costmodels.graph import LAYER_KINDS, Graph, Layer, backward_free
from pipeplan.costmodels.memory import activation_bytes_scale
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.curve import Curve, curve_keys, interpolate
from pipeplan.hardware_profiles.profile import HardwareProfile

# Achieved / peak compute per op kind on a datacenter accelerator (see docs/cost-models.md).
DEFAULT_EFFICIENCY: dict[str, float] = {
    # Large GEMMs: cuBLAS reaches ~70-80% of A100/H100 tensor peak on large shapes
    # (NVIDIA "Matrix Multiplication Background" user guide); Megatron-LM reaches 52%
    # of peak for a whole 1T model including every overhead (Narayanan et al. 2021,
    # §5.1: 163 of 312 TFLOP/s). 0.70 for one GEMM-bound layer is our judgement in between.
    "matmul": 0.70,
    # cuDNN convolutions run as implicit GEMMs but with lower utilisation on small
    # channel counts; MLPerf ResNet-50 submissions sit well below GEMM efficiency. Judgement.
    "conv": 0.60,
    # FlashAttention-2 (Dao 2023, abstract): "50-73% of the theoretical maximum FLOPs/s
    # on A100"; unfused attention is lower still. Judgement: 0.50, the low end.
    "attention": 0.50,
    # The kinds below are memory-bound: their time is set by `DEFAULT_MEMORY_EFFICIENCY`
    # and the compute figure only matters for unusually FLOP-heavy instances. They run
    # on the vector (non-tensor-core) units, see `peak_flops_for_kind`.
    "embedding": 0.50,
    "norm": 0.50,
    "elementwise": 0.50,
    "other": 0.50,
}

# Achieved / peak memory bandwidth for streaming kernels. Commonly reported STREAM /
# bandwidthTest copies on A100/H100 reach roughly 80-90% of HBM peak (not re-verified
# against a primary source here); framework elementwise/norm kernels somewhat less.
# Judgement: 0.80.
DEFAULT_MEMORY_EFFICIENCY = 0.80

# A calibrated local profile stores ACHIEVED rates as its peaks, so unless it says
# otherwise nothing is discounted again.
LOCAL_DEFAULT_EFFICIENCY = 1.0

# Kinds whose FLOPs run on matrix units (tensor cores / MXUs) and so use the dtype's peak.
MATRIX_KINDS = ("matmul", "conv", "attention")

# Backward reads the saved activations, the output gradient and the weights and writes
# the input gradient and the weight gradient: about twice forward's traffic. Judgement,
# consistent with backward doing two GEMMs per forward GEMM (Narayanan et al. 2021, App.).
BACKWARD_BYTES_FACTOR = 2.0

# The kind each finer cost-part kind (graph.PART_KINDS) is a case of: its efficiency and peak unless a profile
# names it.
PART_BASE_KIND = {"conv3x3": "conv", "dropout": "elementwise"}

TIMES = ("model", "measured", "roofline")

# How `local_times_note` starts, so `pipeplan run` can repeat it under a measured-vs-predicted table.
LOCAL_TIMES_NOTE_PREFIX = "stage times are"


def roofline_time_s(flops: float, bytes_moved: float, peak_flops: float, mem_bw_bytes_per_s: float,
                    compute_efficiency: float, memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY) -> float:
    """Roofline time: the slower of doing the FLOPs and moving the bytes.

    Source: Williams, Waterman & Patterson, "Roofline: an insightful visual
    performance model for multicore architectures" (CACM 2009): attainable
    FLOP/s = min(peak, intensity * bandwidth), i.e. time = max(F / P, B / W),
    here with P and W derated by achieved-versus-peak efficiencies.
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError("flops and bytes_moved must be >= 0")
    if peak_flops <= 0 or mem_bw_bytes_per_s <= 0:
        raise ValueError("peak_flops and mem_bw_bytes_per_s must be > 0")
    # > 1 is legal: a calibrated profile may rate a kind relative to the matmul peak.
    if compute_efficiency <= 0 or memory_efficiency <= 0:
        raise ValueError("efficiencies must be > 0")
    compute_s = flops / (peak_flops * compute_efficiency)
    memory_s = bytes_moved / (mem_bw_bytes_per_s * memory_efficiency)
    return max(compute_s, memory_s)


def efficiency_for(profile: HardwareProfile, kind: str, dtype: str | None = None,
                   flops_per_kernel: float | None = None) -> tuple[float, float]:
    """(compute, memory) efficiency of an op kind on a profile in a dtype.

    Looked up as the profile's "kind@dtype" (tensor-core and CUDA-core paths differ:
    a GEMM in bf16 is not a GEMM in fp32), then its "kind", then, for the part kinds
    graph.PART_KINDS adds, the kind they refine (conv3x3 -> conv, dropout ->
    elementwise), then the defaults above. With `flops_per_kernel`, a measured
    `efficiency_curve` found in the same order comes first: its efficiency at that size
    (hardware_profiles/curve.py: log-linear between points, clamped at the ends).
    """
    eff = profile.efficiency or {}
    base = PART_BASE_KIND.get(kind, kind)
    default_c = LOCAL_DEFAULT_EFFICIENCY if profile.local else DEFAULT_EFFICIENCY.get(base, DEFAULT_EFFICIENCY["other"])
    default_m = LOCAL_DEFAULT_EFFICIENCY if profile.local else DEFAULT_MEMORY_EFFICIENCY
    keys = curve_keys(kind, base, dtype)
    compute = next((eff[k] for k in keys if k in eff), default_c)
    curve = efficiency_curve_for(profile, kind, dtype) if flops_per_kernel is not None else None
    if curve is not None and flops_per_kernel is not None and flops_per_kernel > 0:
        compute = interpolate(curve, flops_per_kernel)
    memory = next((eff[k] for k in ([f"memory@{dtype}"] if dtype else []) + ["memory"] if k in eff), default_m)
    return float(compute), float(memory)


def streaming_bandwidth_bytes_per_s(profile: HardwareProfile, *, copy: bool = False) -> float:
    """Bytes a second a streaming pass (an optimizer step, a weight copy, a pass over the gradients) achieves on a
    profile: its bandwidth times its memory efficiency, the rule every memory-bound layer is priced by
    (`efficiency_for`). A plain `copy` on a local profile takes its bandwidth whole: that is the copy rate
    calibrate measured there, and its memory efficiency is elementwise ops' share of it (hardware_profiles/
    calibrate.py); a GPU calibration stores its copy rate as that efficiency, so there the two agree.

    Why not the datasheet's bandwidth: no kernel streams at it. On the H100 (benchmarks/RESULTS.md, GPU (g)) torch's
    fused Adam moved GPT-2's 28 bytes a parameter at 2.0 TB/s and calibrate's copy ran at 2.43, against 3.35 on
    the datasheet (60% and 73%); the H200 copied at 58% of its 4.8. The catalogue priced the optimizer step at
    the datasheet's figure, 41% under the measured step, while the layers beside it took the 0.80 default.
    """
    if copy and profile.local:
        return profile.mem_bw_bytes_per_s
    return profile.mem_bw_bytes_per_s * efficiency_for(profile, "elementwise")[1]


def efficiency_curve_for(profile: HardwareProfile, kind: str, dtype: str | None) -> Curve | None:
    """The profile's efficiency curve for a part kind in a dtype (same lookup order as `efficiency_for`), or None."""
    curves = getattr(profile, "efficiency_curve", None) or {}
    base = PART_BASE_KIND.get(kind, kind)
    return next((curves[k] for k in curve_keys(kind, base, dtype) if k in curves), None)


def peak_flops_for_kind(profile: HardwareProfile, kind: str, dtype: str) -> float:
    """Peak FLOP/s an op kind can use in a dtype.

    Matrix kinds use the dtype's (tensor-core) peak via `HardwareProfile.flops_for`.
    Vector kinds (norm, elementwise, embedding, other) run on the non-tensor units
    even in mixed precision (NVIDIA A100/H100 whitepapers: tensor cores only do
    matrix-multiply-accumulate), so they use the fp32 figure where the profile has
    one (TPUs list none; they use the dtype's figure).
    """
    if kind not in MATRIX_KINDS:
        fp32 = profile.peak_flops.get("fp32")
        if fp32:
            return float(fp32)
    return profile.flops_for(dtype)


def layer_bytes(layer: Layer, *, ratio: float = 1.0, weight_bytes: int | None = None) -> tuple[float, float]:
    """(forward, backward) memory traffic of a layer in traced (fp32) bytes, at `ratio` x the traced batch.

    The traced `bytes_moved` counts every op's inputs and outputs, weights included.
    Weights are read once per pass whatever the batch, so that part stays fixed
    and the rest (activations) scales with the batch; backward moves
    BACKWARD_BYTES_FACTOR x forward's traffic.
    Embeddings are different: the forward gathers only the indexed rows (about
    the output's size), not the table; the backward writes a dense gradient of
    the whole table (PyTorch's aten embedding_dense_backward, the default
    sparse=False) and scatter-adds the output gradient into it.
    """
    w = layer.param_bytes if weight_bytes is None else weight_bytes
    w = min(w, layer.bytes_moved)
    activations = layer.bytes_moved - w
    if layer.kind == "embedding" and w > 0:
        gathered = (activations + layer.output_bytes) * ratio  # indices + rows read + output written
        return gathered, w + BACKWARD_BYTES_FACTOR * gathered
    fwd = w + activations * ratio
    return fwd, fwd * BACKWARD_BYTES_FACTOR


def layer_roofline_s(layer: Layer, profile: HardwareProfile, *, dtype: str = "fp32",
                     samples: float | None = None, batch_size: int = 1,
                     weight_bytes: int | None = None) -> tuple[float, float]:
    """(fwd_s, bwd_s) of one layer for `samples` samples by roofline (the layer was traced at `batch_size`).

    A layer with cost parts (graph.CostPart, what `pipeplan trace` records) is priced
    part by part (`costmodels.kernels.parts_roofline_s`); one without (an older or
    hand-written graph) as one op of its kind, as follows.
    FLOPs scale linearly with samples; traffic as in `layer_bytes` (`weight_bytes`:
    all parameter bytes the layer reads, default the ones it owns). Mixed
    precision halves all traffic (16-bit activations and weight copies;
    `memory.activation_bytes_scale`). Backward uses the traced bwd_flops.
    """
    if batch_size <= 0:
        raise ValueError("batch_size must be > 0")
    ratio = 1.0 if samples is None else float(samples) / batch_size
    if layer.parts:
        from pipeplan.costmodels.part_costs import parts_roofline_s  # it imports this module

        return parts_roofline_s(layer.parts, profile, dtype=dtype, ratio=ratio)
    kind = layer.kind if layer.kind in LAYER_KINDS else "other"
    peak = peak_flops_for_kind(profile, kind, dtype)
    ce, me = efficiency_for(profile, kind, dtype)
    scale = activation_bytes_scale(dtype)
    fwd_bytes, bwd_bytes = layer_bytes(layer, ratio=ratio, weight_bytes=weight_bytes)
    fwd = roofline_time_s(layer.fwd_flops * ratio, fwd_bytes * scale, peak, profile.mem_bw_bytes_per_s, ce, me)
    bwd = roofline_time_s(layer.bwd_flops * ratio, bwd_bytes * scale, peak, profile.mem_bw_bytes_per_s, ce, me)
    return fwd, bwd


def used_param_bytes(graph: Graph) -> list[int]:
    """Parameter bytes each layer reads: the ones it owns plus shared ones owned by an earlier layer.

    A tied LM head reads the embedding table every pass even though the embedding
    layer owns it (graph.SharedParam: the first user owns).
    """
    used = [l.param_bytes for l in graph.layers]
    for sp in graph.shared_params:
        for name in sp.layers[1:]:
            try:
                used[graph.index(name)] += sp.bytes
            except KeyError:  # a shared parameter naming a layer the graph lacks: nothing reads it here
                continue
    return used


def has_cost_counts(graph: Graph) -> bool:
    """Whether the graph carries FLOPs or bytes for a roofline (imported PipeDream profiles carry only times)."""
    return any(l.fwd_flops or l.bwd_flops or l.bytes_moved for l in graph.layers)


# Measured times are fp32 times: a local profile uses them for these dtypes only (a GPU's for fp32 alone).
MEASURED_DTYPES = ("fp32", "tf32")


def measured_times_wanted(profile: HardwareProfile, *, times: str, dtype: str) -> bool:
    """Whether a plan on `profile` would take layer times from the trace (else they can be left untimed).

    --times measured always does; the default ("model") does on a local profile in fp32
    (`uses_measured_times`); a catalogue profile prices layers by roofline (unless a CUDA trace of its GPU is
    planned on it, or `analyze` re-times its plan on this machine's GPU: cli/device_like.py).
    """
    return times == "measured" or (times == "model" and profile.local and dtype in MEASURED_DTYPES)


def traced_dtype(graph: Graph) -> str:
    """The precision the graph's layers were timed in (`pipeplan trace --dtype`; fp32 where it does not say)."""
    return str(graph.source.get("dtype", "fp32"))


def _timed_here(graph: Graph, profile: HardwareProfile, dtype: str) -> bool:
    """Timings in the plan's dtype taken on the device the profile describes: this machine's CPU for a local
    profile, or the GPU the profile is (`timed_on_profile_gpu`) for a CUDA trace. Measured times could apply."""
    if not any(l.fwd_s > 0 for l in graph.layers):
        return False
    device, traced = graph.source.get("device"), traced_dtype(graph)
    if device == "cuda":  # the trace's dtype only: on a GPU tf32 and bf16 matmuls run on other units than fp32's
        return dtype == traced and timed_on_profile_gpu(graph, profile)
    same = dtype == traced or (traced == "fp32" and dtype in MEASURED_DTYPES)  # a CPU has no tf32 units
    return same and profile.local and device == "cpu"


def timed_on_profile_gpu(graph: Graph, profile: HardwareProfile) -> bool:
    """Whether a CUDA trace ran on the GPU `profile` describes (`profile_is_gpu`).

    Why measured times beat the roofline there: the trace's CUDA events time what the GPU really ran, host-bound
    layers included (a 32x32 ResNet's kernels wait for eager PyTorch to issue them; benchmarks/RESULTS.md, GPU).
    """
    name = graph.source.get("device_name")
    return bool(name) and profile_is_gpu(profile, str(name))


def profile_is_gpu(profile: HardwareProfile, device_name: str) -> bool:
    """Whether `profile` describes the GPU torch names `device_name`: the GPU a calibrated profile measured, or
    the catalogue profile that name matches (gpu_catalog.catalog_match: "NVIDIA H100 80GB HBM3" is h100-sxm)."""
    from pipeplan.hardware_profiles.gpu_catalog import catalog_match

    calibration = getattr(profile, "calibration", None) or {}
    if calibration.get("device_type") == "cuda":
        return calibration.get("device_name") == device_name
    sheet = catalog_match(device_name)
    return sheet is not None and sheet.name == profile.name and not profile.local


def device_threads(profile: HardwareProfile) -> int:
    """Threads one local device runs (`calibration["threads_per_device"]`, 1 when not recorded)."""
    return int((getattr(profile, "calibration", None) or {}).get("threads_per_device", 1))


def _timed_on_device_threads(graph: Graph, profile: HardwareProfile) -> bool:
    """Whether the trace ran on one device's thread count (a graph that does not record it is taken to have)."""
    threads = graph.source.get("threads")
    return threads is None or int(threads) == device_threads(profile)


def uses_measured_times(graph: Graph, profile: HardwareProfile, dtype: str) -> bool:
    """Whether times="model" should take the graph's own measurements on this profile.

    Yes when the graph was timed in the plan's dtype on the device the profile describes (`_timed_here`: a bf16
    request on an fp32 trace goes through the roofline with the bf16 peak) and the graph actually has timings (imported or
    hand-made graphs may not). A local "device" is one core running `calibration["threads_per_device"]`
    threads; when the graph records how many threads timed it (source["threads"]) and that differs, its times
    are not one device's times, so the roofline is used instead. On a GPU, as on a CPU, another microbatch
    size scales them linearly (`local_times_note` says so): the search must price every configuration it
    compares the same way (the roofline at one size against measured times at another picked the roofline's,
    optimistic by 3x on the H200's 32x32 ResNet), and `analyze` re-times the one it chooses (cli/device_like.py).
    """
    if not _timed_here(graph, profile, dtype):
        return False
    return graph.source.get("device") == "cuda" or _timed_on_device_threads(graph, profile)


def local_times_note(graph: Graph, profile: HardwareProfile, *, dtype: str, times: str, samples: int) -> str | None:
    """Why a plan on this machine's profile may not match `pipeplan run`, and the trace that would, or None.

    On a local profile the prediction can only be checked against `pipeplan run`
    when stage times are a device's own measured times at the shapes it runs: one
    core with `threads_per_device` threads, at the microbatch size. A trace on all
    cores falls back to the roofline (here 1.5-2x optimistic on skinny matmuls);
    one at another batch is scaled linearly, and a CPU's time per sample is not
    constant in the batch (5x between 1 and 32 rows on examples/mlp.py here).
    A GPU's measured times are used in the dtype they were timed in only, and scale as a CPU's: a host-bound layer takes as long at half
    the batch, so the note says when they were scaled.
    """
    traced = traced_dtype(graph)
    if (times == "model" and dtype != traced and graph.source.get("device") == "cuda"
            and _timed_here(graph, profile, traced)):
        return (f"{LOCAL_TIMES_NOTE_PREFIX} the roofline's in {dtype}: the trace timed {graph.source.get('device_name')} "
                f"in {traced}; plan with --dtype {traced} to use its measured times, or trace with --dtype {dtype}")
    if times != "model" or not _timed_here(graph, profile, dtype):
        return None
    if graph.source.get("device") == "cuda":
        if samples == graph.batch_size:
            return None
        return (f"{LOCAL_TIMES_NOTE_PREFIX} measured times scaled from the traced batch {graph.batch_size} on "
                f"{graph.source.get('device_name')} to the microbatch {samples}, and a layer that waits for the host "
                f"does not scale; for a prediction to compare with `pipeplan run`, trace at the microbatch size "
                f"(`pipeplan trace MODEL --device cuda -b {samples}`, or `analyze` on this GPU)")
    threads = device_threads(profile)
    redo = (f"for a prediction to compare with `pipeplan run`, trace like a device: "
            f"OMP_NUM_THREADS={threads} with --trace-batch-size {samples} (and this plan's -m)")
    if not _timed_on_device_threads(graph, profile):
        return (f"{LOCAL_TIMES_NOTE_PREFIX} the roofline's (optimistic for small layers): the trace ran on "
                f"{graph.source.get('threads')} threads and a {profile.name} device is {threads}; {redo}")
    if samples != graph.batch_size:
        return (f"{LOCAL_TIMES_NOTE_PREFIX} measured times scaled from the traced batch {graph.batch_size} to the microbatch "
                f"{samples}, and a CPU's time per sample changes with the batch; {redo}")
    return None


def layer_times_s(graph: Graph, profile: HardwareProfile, *, dtype: str = "fp32", times: str = "model",
                  samples: int | None = None) -> tuple[list[float], list[float]]:
    """Per-layer (fwd_s, bwd_s) lists for `samples` samples (default: the traced batch size).

    times="measured": the graph's measured times, scaled linearly with samples.
    times="model": roofline on the profile, except where the graph was timed on the
    device the profile describes (`uses_measured_times`: this machine's CPU for a local
    profile, as issue 3 asks; the profile's GPU for a CUDA trace in fp32).
    times="roofline": always the roofline (what the calibration test checks).
    A graph with timings but no FLOP or byte counts at all (an imported PipeDream
    profile) can only be planned with its measured times, so every mode uses them;
    the check is per graph so measured and modelled times are never mixed.
    """
    if times not in TIMES:
        raise UserError(f"unknown times mode {times!r}", f"use one of: {', '.join(TIMES)}")
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}", f"use one of: {', '.join(DTYPES)}")
    batch = graph.batch_size
    n = batch if samples is None else samples
    if n <= 0:
        raise ValueError("samples must be > 0")
    measured_only = not has_cost_counts(graph) and any(l.fwd_s > 0 or l.bwd_s > 0 for l in graph.layers)
    if times == "measured" or measured_only or (times == "model" and uses_measured_times(graph, profile, dtype)):
        ratio = n / batch
        return [l.fwd_s * ratio for l in graph.layers], [l.bwd_s * ratio for l in graph.layers]
    fwd, bwd = [], []
    for layer, used, free in zip(graph.layers, used_param_bytes(graph), backward_free(graph), strict=True):
        f, b = layer_roofline_s(layer, profile, dtype=dtype, samples=n, batch_size=batch, weight_bytes=used)
        fwd.append(f)
        bwd.append(0.0 if free else b)  # a frozen prefix's layers run no backward (graph.backward_free)
    return fwd, bwd
