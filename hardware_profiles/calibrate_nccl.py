"""NCCL send/receive and all-reduce between GPUs 0 and 1 of this node (`profiles calibrate` on CUDA).

Only run with two or more GPUs visible: NCCL refuses two ranks on one GPU. Written
for `calibrate_cuda`, it has not run on a machine of this project's (the lent one has
one GPU); the fits are the CPU calibration's (calibrate.link_from_p2p for the
send/receive link, collectives.links_from_times for the all-reduce ring).

- send/receive: ping-pong of P2P_SIZES bytes; one-way = half the median round trip;
  latency = the smallest message's one-way time, bandwidth = largest / (its one-way - latency).
- all-reduce: median time per size in ALLREDUCE_SIZES, fitted to the two-rank ring formula.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from pipeplan.errors import UserError
from pipeplan.hardware_profiles import collectives
from pipeplan.hardware_profiles.gpu_catalog import catalog_match
from pipeplan.hardware_profiles.profile import Link
from pipeplan.units import KIB, MIB

P2P_SIZES = (4, 64 * KIB, MIB, 16 * MIB, 256 * MIB)
ALLREDUCE_SIZES = (64 * KIB, MIB, 16 * MIB, 256 * MIB)
REPS = 20
WARMUP = 5


def _worker(rank: int, port: int, queue: Any) -> None:
    """One of two ranks on GPU `rank`: ping-pong, then all-reduce; rank 0 reports (one_way, allreduce)."""
    import datetime

    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        os.environ.setdefault("NCCL_DEBUG", "WARN")
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
        one_way = {n: _ping_pong(dist, torch, rank, n) for n in P2P_SIZES}
        reduce = {n: _allreduce(dist, torch, n) for n in ALLREDUCE_SIZES}
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", (one_way, reduce)))
    except Exception as e:  # reported to the parent, which raises
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def _timed(torch: Any, fn: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def _ping_pong(dist: Any, torch: Any, rank: int, nbytes: int) -> float:
    buf = torch.zeros(max(1, nbytes // 4), device="cuda")

    def trip() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    times = [_timed(torch, trip) for _ in range(REPS + WARMUP)][WARMUP:]
    return float(statistics.median(times)) / 2


def _allreduce(dist: Any, torch: Any, nbytes: int) -> float:
    buf = torch.ones(nbytes // 4, device="cuda")
    times = []
    for _ in range(REPS + WARMUP):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(_timed(torch, lambda: dist.all_reduce(buf)))
    return float(statistics.median(times[WARMUP:]))


def measure_nccl(stamp: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """The links `calibrate_cuda` writes: intra_node and all-reduce measured; inter_node from the catalogue."""
    import torch
    import torch.multiprocessing as mp

    from pipeplan.hardware_profiles.calibrate import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout_s)
    except Exception:
        status, payload = "error", f"no answer within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise UserError(f"could not measure NCCL between GPUs 0 and 1: {payload}", "check NCCL with nvidia-smi topo -m")
    one_way, reduce = payload
    return links_from_measurements(one_way, reduce, torch.cuda.get_device_name(0), torch.cuda.device_count(), stamp)


def links_from_measurements(one_way: dict[int, float], reduce: dict[int, float], device_name: str, devices: int,
                            stamp: str) -> dict[str, Any]:
    """What `calibrate_cuda` writes from the two ranks' times (pure: tested with made-up numbers)."""
    from pipeplan.hardware_profiles.calibrate import link_from_p2p

    bw, lat = link_from_p2p(one_way)
    ring = collectives.links_from_times({"allreduce": reduce})["allreduce"]
    sheet = catalog_match(device_name)
    inter = sheet.inter_node if sheet is not None else Link("infiniband", 50e9, 5e-6)
    where = f"catalogue {sheet.name}'s" if sheet is not None else "a placeholder (no catalogue match)"
    # NVLink moves hundreds of GB/s per direction, PCIe 4/5 x16 at most ~25-50 GB/s: the measured rate tells them apart
    return {"note": f"intra_node and collectives.allreduce {stamp}, NCCL between GPUs 0 and 1; inter_node is {where}",
            "intra_node": Link("nvlink" if bw > 100e9 else "pcie", bw, lat),
            "inter_node": inter,
            "collectives": {"allreduce": Link("nccl all-reduce", ring.bandwidth_bytes_per_s, ring.latency_s)},
            "devices_per_node": devices}
