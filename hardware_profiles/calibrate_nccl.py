"""NCCL send/receive and collectives between GPUs 0 and 1 of this node (`profiles calibrate` on CUDA).

Only run with two or more GPUs visible: NCCL refuses two ranks on one GPU. Written
for `calibrate_cuda`, it has not run between two GPUs on a machine of this project's (the
lent one has one GPU); the same code runs over gloo on the CPU in the tests
(`measure_links(backend="gloo")`, tests/test_efficiency_curve.py), so its processes, messages
and fits are checked, not NCCL's numbers. The fits are the CPU calibration's
(calibrate.link_from_p2p for the send/receive link, collectives.links_from_times for the rings).

- send/receive: ping-pong of P2P_SIZES bytes; one-way = half the median round trip;
  latency = the smallest message's one-way time, bandwidth = largest / (its one-way - latency).
- all-reduce, reduce-scatter, all-gather (the runtime's: data-parallel gradients, ZeRO): median time per
  whole-tensor size in COLLECTIVE_SIZES, each fitted to its two-rank ring formula (collectives.RING_FACTORS).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from pipeplan._procs import reap
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import collectives
from pipeplan.hardware_profiles.gpu_catalog import catalog_match
from pipeplan.hardware_profiles.profile import Link
from pipeplan.units import KIB, MIB

P2P_SIZES = (4, 64 * KIB, MIB, 16 * MIB, 256 * MIB)
COLLECTIVE_SIZES = (64 * KIB, MIB, 16 * MIB, 256 * MIB)  # even numbers of floats: each rank's half is whole
REPS = 20
WARMUP = 5


def _worker(rank: int, port: int, queue: Any, backend: str, p2p_sizes: tuple[int, ...],
            collective_sizes: tuple[int, ...]) -> None:
    """One of two ranks (on GPU `rank` for NCCL): ping-pong, then the collectives; rank 0 reports (one_way, times)."""
    import datetime

    import torch
    import torch.distributed as dist

    try:
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            os.environ.setdefault("NCCL_DEBUG", "WARN")
            kw["device_id"] = torch.device("cuda", rank)
        device = "cuda" if backend == "nccl" else "cpu"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120), **kw)
        one_way = {n: _ping_pong(dist, torch, rank, n, device) for n in p2p_sizes}
        times = {op: {n: _collective(dist, torch, op, n, device) for n in collective_sizes}
                 for op in collectives.RING_FACTORS}
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", (one_way, times)))
    except Exception as e:  # reported to the parent, which raises
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def _timed(torch: Any, fn: Any, device: str) -> float:
    """Seconds `fn` takes: between CUDA events on a GPU (the work's time on the stream), by the clock on a CPU."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def _ping_pong(dist: Any, torch: Any, rank: int, nbytes: int, device: str) -> float:
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    times = collectives.round_trips_s(dist, rank, buf, REPS, WARMUP, lambda trip: _timed(torch, trip, device))
    return float(statistics.median(times)) / 2


def _collective(dist: Any, torch: Any, op: str, nbytes: int, device: str) -> float:
    """Median seconds of `op` over a whole tensor of `nbytes` (reduce-scatter's output and all-gather's input are
    each rank's half), each repeat started together after a barrier."""
    whole, half = torch.ones(nbytes // 4, device=device), torch.ones(nbytes // 8, device=device)
    run = {"allreduce": lambda: dist.all_reduce(whole),
           "reduce_scatter": lambda: collectives.reduce_scatter_op(dist)(half, whole),
           "all_gather": lambda: collectives.all_gather_op(dist)(whole, half)}[op]
    times = []
    for _ in range(REPS + WARMUP):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(_timed(torch, run, device))
    return float(statistics.median(times[WARMUP:]))


def measure_links(backend: str = "nccl", *, p2p_sizes: tuple[int, ...] = P2P_SIZES,
                  collective_sizes: tuple[int, ...] = COLLECTIVE_SIZES,
                  timeout_s: float = 300.0) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """(one-way seconds by message size, seconds by collective and size) between two spawned ranks."""
    import torch.multiprocessing as mp

    from pipeplan.hardware_profiles.calibrate import _answer, _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue, backend, p2p_sizes, collective_sizes), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:  # a rank that dies without answering ends the wait (calibrate._answer), not the timeout
        status, payload = _answer(queue, procs, timeout_s)
    finally:
        reap(procs, 10)
    if status != "ok":
        raise UserError(f"could not measure {backend} between two ranks: {payload}",
                        "check NCCL with nvidia-smi topo -m" if backend == "nccl" else "check local TCP connections")
    one_way, times = payload
    return one_way, times


def measure_nccl(stamp: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """The links `calibrate_cuda` writes: intra_node and the collectives measured; inter_node from the catalogue."""
    import torch

    one_way, times = measure_links("nccl", timeout_s=timeout_s)
    return links_from_measurements(one_way, times, torch.cuda.get_device_name(0), torch.cuda.device_count(), stamp)


def links_from_measurements(one_way: dict[int, float], times: dict[str, dict[int, float]], device_name: str,
                            devices: int, stamp: str) -> dict[str, Any]:
    """What `calibrate_cuda` writes from the two ranks' times (pure: tested with made-up numbers)."""
    from pipeplan.hardware_profiles.calibrate import link_from_p2p

    bw, lat = link_from_p2p(one_way)
    rings = collectives.links_from_times(times)
    sheet = catalog_match(device_name)
    inter = sheet.inter_node if sheet is not None else Link("infiniband", 50e9, 5e-6)
    where = f"catalogue {sheet.name}'s" if sheet is not None else "a placeholder (no catalogue match)"
    # NVLink moves hundreds of GB/s per direction, PCIe 4/5 x16 at most ~25-50 GB/s: the measured rate tells them apart
    return {"note": f"intra_node and collectives ({', '.join(sorted(rings))}) {stamp}, NCCL between GPUs 0 and 1; "
                    f"inter_node is {where}",
            "intra_node": Link("nvlink" if bw > 100e9 else "pcie", bw, lat),
            "inter_node": inter,
            "collectives": {op: Link("nccl " + op.replace("_", "-"), r.bandwidth_bytes_per_s, r.latency_s)
                            for op, r in rings.items()},
            "devices_per_node": devices}
