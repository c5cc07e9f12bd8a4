"""What a "device" of a local profile is at run time: one CPU core running one thread.

`profiles calibrate` measures under exactly this setup and the runtime's ranks run
under it, so both call `become_local_device`; a profile measured one way and used
another would mispredict by the difference.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pipeplan.hardware_profiles.allocator import keep_freed_memory


def pin_to_core(local_rank: int, local_world: int) -> int | None:
    """Bind this process (and the threads it starts later, e.g. gloo's) to its own core; returns the core.

    Unpinned, the scheduler moves the compute thread and the gloo I/O threads of
    both ranks between the cores, which cost a small model (GPT example, ~2 ms per
    microbatch) about 10-15% of its step in our runs; pinned, each rank keeps its
    core and its cache. Done only when this node's ranks fit on the cores the
    process may use (never several ranks on one core).
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None
    if local_world > len(cores) or local_rank >= len(cores):
        return None
    os.sched_setaffinity(0, {cores[local_rank]})
    return cores[local_rank]


def become_local_device(local_rank: int, local_world: int) -> int | None:
    """Pin to a core, keep freed memory mapped, run torch with one intra-op and one inter-op thread; returns the core."""
    import torch

    keep_freed_memory()
    core = pin_to_core(local_rank, local_world)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)  # no inter-op pool competing for the core
    except RuntimeError:  # already set, or parallel work started (called twice in one process)
        pass
    return core


# The probe is a small training step, not a GEMM that sits in L2: pipeline stages stream
# weights and activations through the shared L3 and DRAM, where two busy cores also collide
# (in one side-by-side probe here a 512x512 GEMM loop read 0.95-1.1 and a Linear(1024) stack
# 1.07-1.16; minutes later the host made both read far more, the GEMM loop 1.8-1.9).
PROBE_WIDTH, PROBE_LAYERS, PROBE_ROWS = 1024, 4, 256  # one training step ~0.15 s at ~100 GFLOP/s
PROBE_STEPS, PROBE_ROUNDS = 2, 8  # ~7 s in all: the host's load swings within seconds


def concurrency_probe(rank: int, world: int) -> tuple[list[float], list[float]]:
    """This rank's step times computing alone and with every rank computing at once, per round (call on all ranks).

    The other calibration timings run on one core while the rest of the machine
    idles, and so does the tracer; a pipeline keeps all its cores busy, and on
    a VM two vCPUs may be one physical core's hyperthreads or share it with other
    tenants. Alone and together alternate PROBE_ROUNDS times so that a change of
    the host's load during the measurement hits both sides; `slowdown_from_probes`
    combines the ranks' rounds.
    """
    import torch

    torch.manual_seed(rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(PROBE_WIDTH, PROBE_WIDTH) for _ in range(PROBE_LAYERS)])
    x = torch.randn(PROBE_ROWS, PROBE_WIDTH)

    def step() -> None:
        for _ in range(PROBE_STEPS):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

    return alone_and_together(step, rank, world)


def memory_concurrency_probe(rank: int, world: int) -> tuple[list[float], list[float]]:
    """As `concurrency_probe`, for the memory-bound step every rank of a plan takes at the same moment: Adam's
    update (as the runtime builds it) over the tensors `optimizer_overhead.per_param_s` prices a parameter on,
    beyond the last-level cache. Its cores share DRAM's bandwidth, which the compute probe hardly touches."""
    from pipeplan.hardware_profiles.optimizer_overhead import LARGE_NUMEL, LARGE_TENSORS, optimizer_over

    opt = optimizer_over("adam", LARGE_TENSORS, LARGE_NUMEL)

    def step() -> None:
        for _ in range(PROBE_STEPS):
            opt.step()

    return alone_and_together(step, rank, world)


def alone_and_together(step: Callable[[], None], rank: int, world: int,
                       barrier: Callable[[], object] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of `step()` on this rank alone (each rank in turn, the others waiting) and with every rank at once,
    PROBE_ROUNDS times each after one warm-up (call on all ranks; `barrier` waits for all of them, by default that of
    the initialised process group)."""
    import time

    if barrier is None:
        import torch.distributed as dist

        barrier = dist.barrier

    def timed() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    timed()  # warm-up
    alone: list[float] = []
    together: list[float] = []
    for _ in range(PROBE_ROUNDS):
        for r in range(world):
            barrier()
            if r == rank:
                alone.append(timed())
        barrier()
        together.append(timed())
    barrier()
    return alone, together


def slowdown_from_probes(probes: list[tuple[list[float], list[float]]]) -> float:
    """The factor a pipeline's stage compute pays with all cores busy: mean over rounds of the slowest rank's
    together / alone time.

    The slowest rank, not the average, because pipeline stages run in lock-step: a
    stage waits for its neighbour's activation or gradient, so every microbatch
    finishes at the pace of whichever core was slower just then, whether one vCPU is
    persistently slower (a busy hyperthread sibling) or the two take turns (other
    tenants). Averaging the ranks under-predicted 2-stage runs here by 5-10%.
    Sums of alone times, not minima: the contention's average effect is what a
    pipeline pays.
    """
    alone_s = [sum(a) / len(a) for a, _ in probes]
    rounds = min(len(t) for _, t in probes)
    return sum(max(t[i] / a for a, (_, t) in zip(alone_s, probes, strict=True)) for i in range(rounds)) / rounds


def rank_slowdowns(probes: list[tuple[list[float], list[float]]]) -> list[float]:
    """Each rank's own together / alone ratio (kept in the calibration record)."""
    return [sum(t) / sum(a) * len(a) / len(t) for a, t in probes]


class DeviceLikeThreads:
    """`with DeviceLikeThreads(n):` this process computes like one local device (one core, `n` threads), then
    gets its cores and thread count back.

    `analyze` re-times the chosen configuration's layers under it (cli/device_like.py): a trace on all
    cores gives times no rank of `pipeplan run` sees, since each rank is pinned to one core with
    `threads_per_device` threads (`become_local_device`). Inter-op threads cannot change once torch has
    started work, and the tracer runs no inter-op work, so they are left alone.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._cores: set[int] | None = None
        self._torch_threads = 0

    def __enter__(self) -> DeviceLikeThreads:
        import torch

        self._torch_threads = torch.get_num_threads()
        try:
            self._cores = set(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {min(self._cores)})
        except (AttributeError, OSError):  # not Linux: threads only
            self._cores = None
        torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self._torch_threads)
        if self._cores is not None:
            os.sched_setaffinity(0, self._cores)
