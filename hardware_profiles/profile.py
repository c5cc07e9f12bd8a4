"""The in-memory form of a hardware profile: one device type in one cluster shape.

Units are SI and in the names (bytes, FLOP/s, bytes/s, seconds) so that cost
models never convert. The YAML files use friendlier units (GiB, TFLOP/s, GB/s,
µs); `loader.py` converts and validates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeplan.choices import DTYPES
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.op_overhead import CHUNKS, MORE_CHUNKS
from pipeplan.schedules import facts

# DTYPES is pipeplan.choices' (defined there once); still importable from here for existing callers.
__all__ = ["DTYPES", "HardwareProfile", "Link"]


# Op kinds `dispatch_us_by_kind` may name: the cost parts' kinds (costmodels/graph.PART_KINDS) and layer_norm, which
# calibrate times beside batch norm (a "norm" part is priced at batch norm's figure).
DISPATCH_KINDS = ("matmul", "conv", "conv3x3", "attention", "embedding", "norm", "layer_norm", "elementwise",
                  "dropout", "other")


def more_chunks_fixed_s(at_calibrated_s: float, at_more_s: float, chunks: int, calibrated: int = CHUNKS["interleaved"],
                        more: int = MORE_CHUNKS) -> float:
    """The fixed seconds an op of a plan with `chunks` stages a device: measured at `calibrated` and at `more` stages
    a rank, in a straight line between them, flat outside: 8 stages a rank take 4's, the low side of what they
    measured (gaps an op here, benchmarks/chunks_probe.py: 339-711 µs at 2 stages a rank, 638-971 at 4, 823-1427 at
    8; op_overhead.MORE_CHUNKS)."""
    share = min(1.0, max(0.0, (chunks - calibrated) / (more - calibrated)))
    return at_calibrated_s + share * (at_more_s - at_calibrated_s)


@dataclass(frozen=True)
class Link:
    kind: str  # nvlink, pcie, infiniband, ici, ethernet, xgmi, loopback ...
    bandwidth_bytes_per_s: float  # per device, one direction
    latency_s: float


@dataclass(frozen=True)
class HardwareProfile:
    name: str  # catalogue id, e.g. "a100-80gb-sxm"
    device: str  # human name, e.g. "NVIDIA A100 SXM4 80GB"
    memory_bytes: int  # nominal capacity
    usable_memory_bytes: int  # what a framework can allocate (planner's cap)
    mem_bw_bytes_per_s: float
    peak_flops: dict[str, float | None]  # dtype -> dense FLOP/s; None: unsupported
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    efficiency: dict[str, float] = field(default_factory=dict)  # op kind -> achieved/peak overrides
    sources: tuple[str, ...] = ()
    local: bool = False  # measured on this machine by `profiles calibrate`
    path: str = ""  # file it was loaded from
    aliases: tuple[str, ...] = ()  # other names `load_profile` accepts
    confidence: dict[str, str] = field(default_factory=dict)  # field -> V/S/M (see docs/profile-format.md)
    notes: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)  # raw measurements of a local profile
    # Time the pipeline runtime adds around every forward/backward op of one microbatch
    # (schedule bookkeeping, posting and waiting on sends/receives, waking the peer's
    # communication thread), per schedule. Measured by `profiles calibrate`; empty = not measured.
    op_overhead_s: dict[str, float] = field(default_factory=dict)
    op_overhead_s_per_byte: dict[str, float] = field(default_factory=dict)  # ... plus this per byte sent/received
    # ... plus this per tensor a message carries beyond its first (a cut with skip connections sends several; torch
    # posts one gloo message per tensor)
    op_overhead_s_per_tensor: dict[str, float] = field(default_factory=dict)
    # The per-op time of GPipe's and 1F1B's loops over one stage with no messages (a one-stage plan), in place of
    # the terms above for such a plan (op_overhead.alone_overhead_s); empty = not measured.
    op_overhead_alone_s: dict[str, float] = field(default_factory=dict)
    # The fixed term of `op_overhead_s` for a rank holding op_overhead.MORE_CHUNKS (4) stages or more, measured there
    # (interleaved; op_overhead.chunks_overhead_s); empty = not measured (every count takes op_overhead_s's).
    op_overhead_more_chunks_s: dict[str, float] = field(default_factory=dict)
    # Factor on a device's compute time while the other devices of its node compute too.
    # GPUs: 1. A local profile's cores share caches, memory bandwidth and sometimes a physical
    # core, so `profiles calibrate` measures it (its other timings run on one core alone).
    concurrency_slowdown: float = 1.0
    # Factor on a memory-bound step (the optimizer's update, the gradients' flatten and unscale passes) while every
    # device of the node runs one too: two cores streaming through DRAM share its bandwidth, which the compute probe
    # behind `concurrency_slowdown` barely touches (calibrate's Adam over 8M parameters here: 1.23-1.25x side by side,
    # its compute probe 1.00-1.01x the same minute). Measured by `profiles calibrate`; None: not measured,
    # `concurrency_slowdown` stands for it.
    memory_concurrency_slowdown: float | None = None
    # Collectives as measured within a node ("allreduce", "reduce_scatter", "all_gather"): a Link each, fitted
    # so that costmodels.comm's ring formulas give the measured times of a 2-rank group. A CPU's gloo
    # collectives reduce in memory and copy through the sockets, so they are far slower than its send link
    # suggests. Measured by `profiles calibrate`; empty = priced from intra_node.
    collectives: dict[str, Link] = field(default_factory=dict)
    # Time every kernel takes however small (launch, tail) and host time eager PyTorch spends per op
    # (costmodels/part_costs.py). None: that module's defaults (0 on a local profile).
    kernel_overhead_s: float | None = None
    dispatch_s: float | None = None
    # Host seconds eager PyTorch spends per op by part kind, (forward, backward per forward op): a convolution's
    # or a training-mode norm's cost several x1.0's (hardware_profiles/calibrate_dispatch.py). Measured by
    # `profiles calibrate --device cuda`; empty = `dispatch_s` for every kind.
    dispatch_by_kind_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Achieved/peak by kernel size, "kind" or "kind@dtype" -> ((FLOPs per kernel, efficiency), ...) with FLOPs
    # increasing (hardware_profiles/curve.py says how it is defined and read). Empty: `efficiency` alone.
    efficiency_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # Convolutions' efficiency against their curve by channel count, "kind@dtype" -> (forward, backward), each
    # ((channels, factor), ...) with channels increasing: min(output channels, input channels per group) decides how
    # much of a kernel tile a convolution fills, which FLOPs alone do not say (calibrate_cuda.channel_factors).
    channel_factors: dict[str, tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]] = \
        field(default_factory=dict)
    # Host seconds per parameter tensor of one optimizer step, by optimizer name (torch.optim's per-tensor loop on
    # a CPU; hardware_profiles/optimizer_overhead.py). Measured by `profiles calibrate`; empty = bytes alone.
    optimizer_tensor_s: dict[str, float] = field(default_factory=dict)
    # Seconds per parameter of one optimizer step on tensors beyond the cache, by optimizer name (measured by
    # `profiles calibrate`, hardware_profiles/optimizer_overhead.py). Empty = the bytes its kernels move / the
    # memory bandwidth (catalogue devices: fused kernels, one pass).
    optimizer_param_s: dict[str, float] = field(default_factory=dict)
    # Seconds one optimizer step takes whatever its tensors, by optimizer name (measured by `profiles calibrate
    # --device cuda`: torch.optim's step on a GPU has a fixed host part, ~0.24 ms for Adam on the H200). Empty = 0.
    optimizer_step_s: dict[str, float] = field(default_factory=dict)
    # Host time torch's checkpoint spends around a recomputed stage beyond re-running its forward: per region and
    # per tensor its forward saves (hardware_profiles/recompute_overhead.py). Measured by `profiles calibrate`;
    # 0 = none (catalogue GPUs: host work that overlaps the kernels).
    recompute_overhead_s: float = 0.0
    recompute_tensor_s: float = 0.0
    # Host time zero bubble's split backward (torch's B and W) spends beyond one whole backward: per split and per
    # parameter group (hardware_profiles/split_backward_overhead.py). Measured by `profiles calibrate`; 0 = none.
    split_backward_s: float = 0.0
    split_backward_group_s: float = 0.0

    def memory_slowdown(self) -> float:
        """The factor on a memory-bound step with every device of the node stepping too: the measured
        `memory_concurrency_slowdown`, else (a profile calibrated before it was measured) `concurrency_slowdown`."""
        m = self.memory_concurrency_slowdown
        return self.concurrency_slowdown if m is None else m

    def local_cpu(self) -> bool:
        """Whether this profile is this machine's CPU cores (`profiles calibrate` without a GPU): what a plan for it
        runs on, for the tracer's timing device and autocast's op lists."""
        return self.local and self.calibration.get("device_type") != "cuda"

    def gpu_vendor(self) -> str | None:
        """"nvidia" or "amd" where `device` starts with a GPU maker's name (every catalogue GPU and every profile
        `profiles calibrate` writes on CUDA does), else None: TPUs and this machine's cores. Costs that come from a
        GPU library (cuDNN's layouts, NCCL's kernels sharing SMs with compute) apply only where it says which."""
        maker = self.device.split()[0].lower() if self.device.strip() else ""
        return maker if not self.local and maker in ("nvidia", "amd") else None

    def overhead_for(self, schedule: str, nbytes: int = 0, extra_tensors: int = 0, *, alone: bool = False,
                     chunks: int = 1) -> float:
        """Runtime seconds for one op of `schedule` that sends and receives `nbytes` in all, in messages that carry
        `extra_tensors` tensors beyond one each. `alone`: the op's stage is its plan's only one (no messages), and
        the schedule's one-stage loop was measured (`op_overhead_alone_s`): that figure. Else the schedule's own
        measurement (`profiles calibrate` measures
        GPipe, 1F1B, interleaved, ZB-H1, ZB-V and PipeDream; the per-tensor term the torch schedules only), else
        the nearest measured runtime: PipeDream's for PipeDream-2BW (the same asynchronous loop and messages), ZB-V's
        for DualPipeV (the same V placement, its turn a hand-over on one rank, and split backwards, under the same
        torch runtime posting each op's sends and receives), interleaved's for the schedules with several stages a
        rank (the V schedules in a profile calibrated before ZB-V was measured: each op posting its own sends), else
        1F1B's (and 1F1B's for all of them in a profile calibrated before the others were measured); 0 where nothing
        was measured. `chunks`: the plan's stages a device; where the fixed term was measured at more of them too
        (`op_overhead_more_chunks_s`), it goes from the calibrated count's figure to that one's in a straight line
        and stays there above it (`more_chunks_fixed_s`)."""
        if alone and schedule in self.op_overhead_alone_s:
            return self.op_overhead_alone_s[schedule]
        key = self._nearest(schedule, self.op_overhead_s)
        per_byte = self.op_overhead_s_per_byte.get(key, 0.0)
        per_tensor = self.op_overhead_s_per_tensor.get(self._nearest(schedule, self.op_overhead_s_per_tensor), 0.0)
        fixed = self.op_overhead_s.get(key, 0.0)
        if key in self.op_overhead_more_chunks_s:
            fixed = more_chunks_fixed_s(fixed, self.op_overhead_more_chunks_s[key], chunks)
        return float(fixed + per_byte * nbytes + per_tensor * extra_tensors)

    def op_overhead_text(self) -> str:
        """Each measured schedule's terms of `overhead_for`, for people ("" where nothing was measured)."""
        def terms(k: str, fixed_s: float) -> str:
            out = f"{k} {fixed_s * 1e6:.0f} µs + {self.op_overhead_s_per_byte.get(k, 0.0) * 2**20 * 1e6:.0f} µs/MiB"
            return out + (f" + {self.op_overhead_s_per_tensor[k] * 1e6:.0f} µs/extra tensor"
                          if k in self.op_overhead_s_per_tensor else "")
        alone = ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in self.op_overhead_alone_s.items())
        more = ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in self.op_overhead_more_chunks_s.items())
        return "; ".join([*(terms(k, v) for k, v in self.op_overhead_s.items()),
                          *([f"fixed at {MORE_CHUNKS}+ stages a device: {more}"] if more else []),
                          *([f"one stage: {alone}"] if alone else [])])

    @staticmethod
    def _nearest(schedule: str, measured: dict[str, float]) -> str:
        """The key of `measured` that stands for `schedule` (`overhead_for`'s order), "1f1b" where none does."""
        f = facts(schedule)
        nearest = ((f.name, True), ("pipedream", not f.flushes), ("zb-v", f.placement == "v"),
                   ("interleaved", f.interleaves))
        return next((k for k, ok in nearest if ok and k in measured), "1f1b")

    def link_between(self, device_a: int, device_b: int) -> Link:
        """The link two global device ranks talk over (same node or not)."""
        same = device_a // self.devices_per_node == device_b // self.devices_per_node
        return self.intra_node if same else self.inter_node

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype, falling back as the hardware would.

        "fp32" matmuls may use TF32 tensor cores only if the user allows it, so
        fp32 never falls back to tf32. tf32, bf16 and fp16 fall back to fp32 only:
        a device without a fast path for a 16-bit type still runs it, at about
        its fp32 rate (V100/T4 bf16), never at the rate of the *other* 16-bit type.
        TPUs list no fp32 peak (their matrix units are bf16), so fp32/tf32/fp16
        there is a UserError asking for --dtype bf16 rather than a made-up number.
        """
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
        order = {"fp32": ["fp32"], "tf32": ["tf32", "fp32"], "bf16": ["bf16", "fp32"], "fp16": ["fp16", "fp32"]}[dtype]
        for d in order:
            value = self.peak_flops.get(d)
            if value:
                return float(value)
        have = [d for d in DTYPES if self.peak_flops.get(d)]
        raise UserError(
            f"profile {self.name} has no {dtype} compute rate (it lists only {', '.join(have) or 'none'})",
            f"use --dtype {have[0]}" if have else "add peak_tflops to the profile",
        )
