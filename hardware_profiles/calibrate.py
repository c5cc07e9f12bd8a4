"""Measure THIS machine into an ordinary hardware profile (`pipeplan profiles calibrate`).

The runtime runs one rank per CPU core with one intra-op thread, so a "device"
here is one core: every compute and memory measurement runs under
`torch.set_num_threads(1)`, and `devices_per_node` is the number of cores.

What is measured, and why each number is defined the way it is:
- peak fp32 FLOP/s = the best achieved rate over a few GEMM shapes typical of
  Linear layers (a roofline peak must be reachable, not a datasheet figure);
  `efficiency.matmul` = geometric mean of achieved/peak over those shapes, so the
  cost model's matmul prediction matches a typical layer, not only the best one.
- bf16: the same GEMMs in bfloat16; kept only if at least `BF16_MIN_SPEEDUP` x the
  fp32 peak (a real fast path such as AVX512-BF16/AMX). Slower bf16 is recorded
  under `calibration` but left null, so planning with bf16 uses the fp32 rate.
- `efficiency.conv` = achieved FLOP/s of 3x3 convolutions / fp32 peak (may exceed
  1: oneDNN convolutions can beat a plain GEMM); FLOPs as torch's conv_flop_count
  (2·N·Hout·Wout·Cout·Cin/groups·Kh·Kw).
- `efficiency.attention` = scaled_dot_product_attention FLOP/s (4·B·H·S²·D) / peak.
- memory bandwidth = a copy of 32 MiB tensors (beyond a typical L3), counted as read + write
  bytes; `efficiency.memory` = geometric mean of the bytes/s of elementwise add and
  relu on the same tensors / the copy bandwidth (see `measure_memory`).
- links: ping-pong between two processes over torch.distributed (gloo on
  127.0.0.1; NCCL is not used on CPU): latency = half the round trip of a 4-byte
  message; bandwidth = bytes / (one-way time - latency) for the largest message.
Every timing is the best (minimum) of its repeats: a profile describes what the
machine can do, and other processes on a shared machine only ever add time, so
the minimum is the estimate that does not depend on how busy the machine was
during calibration (a median on a loaded 2-core box moved by 2-3x in our runs).
On a quiet machine the minimum and the tracer's medians agree within a few %.
The ops of one phase are timed round-robin over one window (`_interleaved_best_s`),
so that a burst of load lowers none of them alone.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from pipeplan._procs import reap
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import collectives, op_overhead, optimizer_overhead, pipeline_ops
from pipeplan.hardware_profiles.allocator import keep_freed_memory
from pipeplan.hardware_profiles.loader import save_profile  # noqa: F401 - the interface names it here too
from pipeplan.hardware_profiles.local_device import (
    become_local_device,
    concurrency_probe,
    memory_concurrency_probe,
    rank_slowdowns,
    slowdown_from_probes,
)
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.hardware_profiles.recompute_overhead import checkpoint_overhead_s
from pipeplan.hardware_profiles.split_backward_overhead import split_backward_overhead_s
from pipeplan.units import KIB, MIB

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    import torch

BF16_MIN_SPEEDUP = 1.05
BF16_GIVE_UP = 0.5  # a first bf16 GEMM below this x the fp32 peak ends the bf16 timing (measure_bf16_matmul)
BUSY_SHARE = 0.85  # below this CPU share during the timing loops, the profile warns
# Each timed op is short (~1-3 ms at ~100 GFLOP/s per core) on purpose: on a busy
# machine an op that outlasts a scheduler time slice is almost never timed whole,
# so only short ops let the best-of-repeats see the machine's real speed.
MATMUL_SHAPES = ((256, 512, 512), (128, 1024, 1024), (512, 768, 256), (64, 1024, 2048))  # (M, K, N)
CONV_SHAPES = ((4, 64, 32), (4, 128, 16), (4, 32, 56))  # (N, C_in = C_out, H = W), 3x3, padding 1
# One tensor's size for the memory loop: working sets of 2-3 tensors are 2-3x the 32 MiB L3
# of typical servers, so there this is DRAM bandwidth. Cache-resident activations run faster
# than it predicts (documented in docs/profile-format.md). On hosts with a much larger shared
# L3 (a 260 MiB one measured ~25 GB/s at this size, ~13 GB/s from 128 MiB up) it is partly a
# cache rate: the rate activations of tens of MiB see, which is what the cost model prices.
MEMORY_BYTES = 32 * MIB
P2P_SIZES = (4, 64 * KIB, MIB, 16 * MIB)
P2P_REPS = (200, 40, 20, 10)

Progress = Callable[[str, int, int], None]
Probe: TypeAlias = tuple[list[float], list[float]]  # local_device.concurrency_probe: (alone, together) step times
PipelineEvents: TypeAlias = dict[str, list[list[op_overhead.Event]]]  # pipeline_ops.run_pipeline, one rank's
# one-way link times, each rank's pipeline events, compute probes and memory probes (local_device), collectives
P2PResult: TypeAlias = tuple[dict[int, float], list[PipelineEvents], list[Probe], list[Probe],
                             dict[str, dict[int, float]]]
_T = TypeVar("_T")


# ---------------------------------------------------------------- timing
def _interleaved_best_s(fns: list[Callable[[], object]], window_s: float, min_rounds: int = 5,
                        max_rounds: int = 100) -> list[float]:
    """Best wall time of each fn, timed round after round (each once per round) over one window.

    Why interleaved: a neighbour's burst on a shared host lasts from tens of ms to seconds.
    Timed one op after another, each in its own short slot, a burst that covers one slot
    lowers that op's rate alone; a CI run measured the convolutions at 55 GFLOP/s in their
    slot while the same host ran a larger 3x3 convolution at 84 a minute later. Round-robin,
    every op's minimum is taken over the whole window, and the ratios between ops (the
    efficiencies) are measured under the same conditions.
    """
    for fn in fns:
        fn()  # warm-up: first-call dispatch and allocation
    best = [math.inf] * len(fns)
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() - start < window_s):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        rounds += 1
    return best


def cpu_share(wall0: float, cpu0: float) -> float:
    """CPU time this process got / wall time since (wall0, cpu0); about 1.0 when measuring
    on one thread undisturbed, lower when other processes compete for the core."""
    wall = time.perf_counter() - wall0
    return (time.process_time() - cpu0) / wall if wall > 0 else 1.0


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# ---------------------------------------------------------------- compute / memory
Kernel: TypeAlias = tuple[float, Callable[[], object]]  # (FLOPs of one call, the call)


def matmul_kernels(dtype: torch.dtype) -> list[Kernel]:
    """One GEMM per MATMUL_SHAPES, 2·M·K·N FLOPs each."""
    import torch

    out: list[Kernel] = []
    for m, k, n in MATMUL_SHAPES:
        a = torch.randn(m, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        out.append((2 * m * k * n, functools.partial(torch.mm, a, b)))
    return out


def conv_kernels() -> list[Kernel]:
    """One 3x3 convolution per CONV_SHAPES (stride 1, padding 1: Hout = H), 2·N·H·W·C²·9 FLOPs each."""
    import torch
    import torch.nn.functional as F

    out: list[Kernel] = []
    for n, c, h in CONV_SHAPES:
        x = torch.randn(n, c, h, h)
        w = torch.randn(c, c, 3, 3)
        out.append((2 * n * h * h * c * c * 9, functools.partial(F.conv2d, x, w, padding=1)))
    return out


def attention_kernel() -> Kernel:
    """scaled_dot_product_attention at B=4, H=8, S=256, D=64: 4·B·H·S²·D FLOPs (QK^T and PV)."""
    import torch
    import torch.nn.functional as F

    b, h, s, d = 4, 8, 256, 64
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    return 4 * b * h * s * s * d, functools.partial(F.scaled_dot_product_attention, q, k, v)


def measure_compute(window_s: float) -> tuple[list[float], list[float], float]:
    """Achieved fp32 FLOP/s of (each GEMM, each convolution, attention), all timed interleaved."""
    import torch

    gemms, convs = matmul_kernels(torch.float32), conv_kernels()
    kernels = [*gemms, *convs, attention_kernel()]
    rates = [f / t for (f, _), t in zip(kernels, _interleaved_best_s([fn for _, fn in kernels], window_s), strict=True)]
    return rates[:len(gemms)], rates[len(gemms):-1], rates[-1]


def measure_bf16_matmul(window_s: float, fp32_peak: float) -> list[float]:
    """Achieved bf16 FLOP/s of each GEMM; only the first one when it runs below half the fp32 peak.

    Why the early stop: bf16 is kept only as a fast path (>= BF16_MIN_SPEEDUP x fp32). A CPU
    without one runs bf16 GEMMs through a slow fallback (~1 GFLOP/s on this repo's VM), where
    timing all four shapes at least five times each took 7.4 s of an 8 s calibration budget.
    One call at under half the fp32 rate settles the question: noise would have to halve it.
    """
    import torch

    kernels = matmul_kernels(torch.bfloat16)
    flops, first = kernels[0]
    first_rate = flops / _interleaved_best_s([first], 0.0, min_rounds=1)[0]
    if first_rate < BF16_GIVE_UP * fp32_peak:
        return [first_rate]
    times = _interleaved_best_s([fn for _, fn in kernels], window_s)
    return [f / t for (f, _), t in zip(kernels, times, strict=True)]


def measure_memory(cap_s: float) -> tuple[float, list[float]]:
    """(copy bytes/s, [add bytes/s, relu bytes/s]) on tensors beyond the last-level cache.

    Copy counts read + write (the STREAM convention), add 2 reads + 1 write, relu
    1 read + 1 write. The three are timed interleaved, round after round, so that
    other processes competing for DRAM bandwidth affect all three alike and the
    efficiency ratio stays meaningful on a shared machine. Outputs are
    preallocated (`out=`): a fresh large tensor costs page faults, which are the
    allocator's behaviour, not the memory system's bandwidth.
    """
    import torch

    n = MEMORY_BYTES // 4
    x, y, z = torch.ones(n), torch.ones(n), torch.empty(n)
    ops: dict[str, tuple[int, Callable[[], object]]] = {
        "copy": (2 * MEMORY_BYTES, lambda: z.copy_(x)),
        "add": (3 * MEMORY_BYTES, lambda: torch.add(x, y, out=z)),
        "relu": (2 * MEMORY_BYTES, lambda: torch.clamp_min(x, 0.0, out=z)),
    }
    times = _interleaved_best_s([fn for _, fn in ops.values()], cap_s, min_rounds=3, max_rounds=40)
    bw = {k: nbytes / t for (k, (nbytes, _)), t in zip(ops.items(), times, strict=True)}
    return bw["copy"], [bw["add"], bw["relu"]]


# ---------------------------------------------------------------- point to point
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # typeshed: an address of any shape; AF_INET's is (host, port)
        return port


def _p2p_worker(rank: int, port: int, queue: Queue[tuple[str, Any]], rounds: int) -> None:
    """One of two ranks: ping-pong fixed counts (both ranks must agree on them), then a small pipeline's
    `rounds` (pipeline_ops.run_pipeline)."""
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import datetime

    import torch
    import torch.distributed as dist

    become_local_device(rank, 2)  # as the runtime's ranks are: the pipeline's op gaps depend on it
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        one_way: dict[int, float] = {}
        for nbytes, reps in zip(P2P_SIZES, P2P_REPS, strict=True):
            buf = torch.zeros(max(1, nbytes // 4))
            one_way[nbytes] = min(collectives.round_trips_s(dist, rank, buf, reps, warmup=2)) / 2
        collective_times = collectives.time_collectives(dist, torch)
        slowdown = concurrency_probe(rank, 2)
        memory_slowdown = memory_concurrency_probe(rank, 2)
        events = pipeline_ops.run_pipeline(rank, rounds)
        gathered: list[Any] = [None, None]  # all_gather_object fills it with each rank's (probes, events)
        dist.all_gather_object(gathered, (slowdown, memory_slowdown, events))
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", (one_way, [g[2] for g in gathered], [g[0] for g in gathered], [g[1] for g in gathered],
                              collective_times)))
    except Exception as e:  # reported to the parent, which raises
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def measure_p2p(rounds: int = op_overhead.ROUNDS, timeout_s: float = 240.0) -> P2PResult:
    """One-way seconds per message size between two spawned processes over gloo, both ranks'
    op timings from `pipeline_ops.run_pipeline` (`rounds` of it), and each rank's `concurrency_probe` and
    `memory_concurrency_probe` (alone, together).

    `timeout_s` bounds a hang, not the work: the whole phase (spawn, link, collectives, probes and six
    schedules' pipelines, two rounds of four shapes) ran ~38 s on this repo's 2-core VM with the host quiet
    (interleaved at 4 stages a rank on one shape adds ~5 s; one round saves ~25 s);
    one round of two shapes had run 20 s quiet and 41 s under its neighbours' load, so 240 s leaves ~3x.
    A process that dies without an answer (killed, or its spawn failed) ends the wait at once."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork after OpenMP/MKL init can deadlock
    queue: Queue[tuple[str, Any]] = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, queue, rounds), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    interrupted = True  # SIGTERM/Ctrl-C while waiting: kill the link processes at once, not after the joins
    try:
        status, payload = _answer(queue, procs, timeout_s)
        interrupted = False
    finally:
        reap(procs, 0 if interrupted else 5)
    if status != "ok":
        raise UserError(
            f"could not measure process-to-process bandwidth over torch.distributed (gloo): {payload}",
            "check that 127.0.0.1 accepts local TCP connections",
        )
    result: P2PResult = payload  # what _p2p_worker's rank 0 put with "ok"
    return result


def _answer(queue: Queue[tuple[str, Any]], procs: list[Any], timeout_s: float,
            poll_s: float = 1.0) -> tuple[str, Any]:
    """Rank 0's ("ok", result) or a rank's ("error", why); ("error", ...) too once a process has died without
    one (it cannot come any more: its partner waits on it) or `timeout_s` has passed."""
    import queue as queues

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=poll_s)
        except queues.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or all(p.exitcode is not None for p in procs):
                try:  # an answer put just before the exit
                    return queue.get(timeout=poll_s)
                except queues.Empty:
                    pass
                why = ", ".join(f"rank {r} exited with code {code}" for r, code in dead) or "both ranks exited"
                return "error", f"{why} without an answer"
    return "error", f"no answer within {timeout_s:g} s"


def link_from_p2p(one_way: dict[int, float]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from one-way times: t(n) = latency + n / bandwidth."""
    latency = one_way[min(one_way)]
    big = max(one_way)
    transfer = max(one_way[big] - latency, 1e-9)
    return big / transfer, latency


# ---------------------------------------------------------------- machine facts
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cgroup_limit_bytes() -> int | None:
    """The container's memory limit (cgroup v2 memory.max), when there is one."""
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_total_bytes() -> int:
    """MemTotal from /proc/meminfo (no psutil), capped by a container's cgroup limit; falls back to sysconf."""
    limit = _cgroup_limit_bytes()
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    return min(total, limit) if limit else total
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise UserError("cannot read the machine's memory size", "calibrate on Linux, or write the profile by hand") from None


def core_count() -> int:
    """The cores this process may run on (a container's or taskset's limit), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- the whole thing
def calibrate(*, budget_s: float = 45.0, progress: Progress | None = None, name: str = "local") -> HardwareProfile:
    """Measure this machine (one core = one device) into a local profile; see the module doc.

    `budget_s` caps the compute and memory timing loops, which stop sooner once their
    rounds agree (~5 s here at any budget); the link, collective and pipeline measurements
    on two spawned processes take ~40-55 s on top on this repo's 2-core VM (`measure_p2p`),
    ~25 s less below op_overhead.TWO_ROUNDS_BUDGET_S, where the pipelines run one round.
    """
    import torch

    report = progress or (lambda *_: None)
    t_start = time.perf_counter()
    # ~5 s of the budget goes to spawning the link processes; the rest is spread over the
    # timing windows: 8 caps for the 4 GEMMs, 3 convolutions and attention timed together,
    # 4 for bf16 (when it has a fast path), 3 for memory = 15.
    cap = max(0.1, (budget_s - 5.0) / 15 * 0.8)

    def step(label: str, fn: Callable[[], _T]) -> _T:
        report(label, 0, 1)
        value = fn()
        report(label, 1, 1)
        return value

    keep_freed_memory()  # as the runtime's ranks run (hardware_profiles/allocator.py)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        fp32, conv, attn = step("fp32 matmul, conv and attention", lambda: measure_compute(8 * cap))
        try:
            bf16 = step("bf16 matmul", lambda: measure_bf16_matmul(4 * cap, max(fp32)))
        except RuntimeError:  # no bf16 GEMM on this build/CPU
            bf16 = []
        copy_bw, elem = step("memory bandwidth", lambda: measure_memory(3 * cap))
        optimizer_s = step("optimizer step", optimizer_overhead.per_tensor_s)
        param_s = step("optimizer step (large tensors)", lambda: optimizer_overhead.per_param_s(optimizer_s))
        recompute_s, recompute_tensor_s = step("recomputation's checkpoint", checkpoint_overhead_s)
        split_s, split_group_s = step("zero bubble's split backward", split_backward_overhead_s)
    finally:
        torch.set_num_threads(prev_threads)
    share = cpu_share(wall0, cpu0)
    rounds = op_overhead.ROUNDS if budget_s >= op_overhead.TWO_ROUNDS_BUDGET_S else 1
    one_way, pipeline_events, slowdowns, memory_slowdowns, collective_times = step(
        "link, collectives, pipeline ops and two busy cores (2 processes, gloo)", lambda: measure_p2p(rounds))
    link_bw, link_lat = link_from_p2p(one_way)
    def transfer_s(nbytes: int) -> float:  # the idle link's time for a message
        return link_lat + nbytes / link_bw

    overhead_s, overhead_per_byte_s, overhead_per_tensor_s, overhead_detail = op_overhead.op_overhead_s(
        pipeline_events, transfer_s)
    alone_s = op_overhead.alone_overhead_s(pipeline_events)
    more_chunks_s, more_chunks_detail = op_overhead.chunks_overhead_s(pipeline_events, transfer_s, overhead_per_byte_s)
    overhead_detail.update(more_chunks_detail)
    peak32 = max(fp32)
    peak16 = max(bf16) if bf16 else None

    bf16_ok = peak16 is not None and peak16 >= BF16_MIN_SPEEDUP * peak32
    cores = core_count()
    mem_total = memory_total_bytes()
    per_core = mem_total // cores
    link = Link(kind="loopback", bandwidth_bytes_per_s=link_bw, latency_s=link_lat)

    def clamp(x: float) -> float:  # the loader's accepted range
        return min(2.0, max(0.01, x))

    def gf(xs: list[float]) -> list[float]:
        return [round(x / 1e9, 2) for x in xs]

    return HardwareProfile(
        name=name,
        device=f"{cpu_name()} (1 core, 1 thread)",
        memory_bytes=per_core,
        usable_memory_bytes=int(per_core * 0.8),
        mem_bw_bytes_per_s=copy_bw,
        peak_flops={"fp32": peak32, "tf32": None, "fp16": None, "bf16": peak16 if bf16_ok else None},
        devices_per_node=cores,
        intra_node=link,
        inter_node=link,
        efficiency={
            "matmul": clamp(_geomean([x / peak32 for x in fp32])),
            "conv": clamp(_geomean([x / peak32 for x in conv])),
            "attention": clamp(attn / peak32),
            "memory": clamp(_geomean([x / copy_bw for x in elem])),
        },
        sources=(f"measured by `pipeplan profiles calibrate` on {platform.node()} at "
                 f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",),
        local=True,
        op_overhead_s=overhead_s,
        op_overhead_s_per_byte=overhead_per_byte_s,
        op_overhead_s_per_tensor=overhead_per_tensor_s,
        op_overhead_alone_s=alone_s,
        op_overhead_more_chunks_s=more_chunks_s,
        concurrency_slowdown=min(4.0, max(1.0, slowdown_from_probes(slowdowns))),
        memory_concurrency_slowdown=min(4.0, max(1.0, slowdown_from_probes(memory_slowdowns))),
        collectives=collectives.links_from_times(collective_times),
        optimizer_tensor_s=optimizer_s,
        optimizer_param_s=param_s,
        recompute_overhead_s=recompute_s,
        recompute_tensor_s=recompute_tensor_s,
        split_backward_s=split_s,
        split_backward_group_s=split_group_s,
        notes=(
            "One device = one CPU core running one thread. Memory is MemTotal split evenly over the cores; "
            "usable is 80% of that (the OS, Python and torch need the rest). The inter-node link is the "
            "measured loopback link: a local profile describes one machine."
            + ("" if bf16_ok else " bf16 has no fast path here, so it is planned at the fp32 rate.")
            + (f" WARNING: calibration got only {share:.0%} of a core (a busy machine): the numbers are "
               "pessimistic; re-run `pipeplan profiles calibrate` when the machine is quiet." if share < BUSY_SHARE else "")
        ),
        calibration={
            "torch": str(torch.__version__),
            "threads_per_device": 1,
            "budget_s": float(budget_s),
            "pipeline_rounds": rounds,
            "elapsed_s": round(time.perf_counter() - t_start, 2),
            "cpu_share": round(share, 3),
            "matmul_shapes_mkn": [list(s) for s in MATMUL_SHAPES],
            "matmul_fp32_gflops": gf(fp32),
            "matmul_bf16_gflops": gf(bf16),
            "bf16_fast_path": bf16_ok,
            "conv3x3_shapes_nch": [list(s) for s in CONV_SHAPES],
            "conv_fp32_gflops": gf(conv),
            "attention_fp32_gflops": round(attn / 1e9, 2),
            "copy_gbps": round(copy_bw / 1e9, 2),
            "elementwise_add_relu_gbps": gf(elem),
            "p2p_one_way_us": {int(k): round(v * 1e6, 2) for k, v in sorted(one_way.items())},
            "collectives_us": {op: {int(k): round(v * 1e6, 1) for k, v in sorted(ts.items())}
                               for op, ts in collective_times.items()},
            "op_overhead": overhead_detail,
            "optimizer_us_per_tensor": {k: round(v * 1e6, 2) for k, v in optimizer_s.items()},
            "optimizer_ns_per_param": {k: round(v * 1e9, 3) for k, v in param_s.items()},
            "recompute_us": {"per_region": round(recompute_s * 1e6, 1),
                             "per_saved_tensor": round(recompute_tensor_s * 1e6, 2)},
            "split_backward_us": {"per_split": round(split_s * 1e6, 1), "per_group": round(split_group_s * 1e6, 2)},
            "concurrency_slowdown_per_rank": [round(x, 3) for x in rank_slowdowns(slowdowns)],
            "memory_concurrency_slowdown_per_rank": [round(x, 3) for x in rank_slowdowns(memory_slowdowns)],
            "memory_total_bytes": mem_total,
        },
    )
