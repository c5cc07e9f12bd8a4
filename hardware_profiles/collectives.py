"""Time gloo's collectives between two local ranks and fit the links the cost model prices them with.

A CPU's gloo all-reduce is far slower than two sends over its loopback link:
it reduces in memory on the CPU and copies through the sockets (measured here:
a data-parallel all-reduce waited 12x what the send link predicted). So
`profiles calibrate` times the three collectives the runtime uses (all-reduce;
reduce-scatter and all-gather for ZeRO, runtime/sharding.py) at a few sizes and
stores, per collective, the Link for which costmodels.comm's ring formulas give
those times for a group of two:

    all-reduce:                  t(n) = n / bw + 2 * latency      (2 (r-1)/r n/bw + 2 (r-1) lat, r = 2)
    reduce-scatter, all-gather:  t(n) = n / (2 bw) + latency      ((r-1)/r n/bw + (r-1) lat, r = 2)

with n the whole (unsharded) tensor's bytes, fitted through the smallest and
the largest size. Larger groups extrapolate with the same ring formulas.
"""

from __future__ import annotations

import time
from typing import Any

from pipeplan.hardware_profiles.profile import Link
from pipeplan.units import KIB, MIB

SIZES = (16 * KIB, 256 * KIB, 4 * MIB, 16 * MIB)  # whole-tensor bytes (even, so each rank's half is whole)
REPS = (20, 10, 6, 3)
WARMUP = 2
# n/bw and latency factors of each collective's ring time for a group of two (see the module doc)
RING_FACTORS = {"allreduce": (1.0, 2.0), "reduce_scatter": (0.5, 1.0), "all_gather": (0.5, 1.0)}


def time_collectives(dist: Any, torch: Any) -> dict[str, dict[int, float]]:
    """Best seconds per size of each collective (call on both ranks of an initialised 2-rank group)."""
    out: dict[str, dict[int, float]] = {op: {} for op in RING_FACTORS}
    for nbytes, reps in zip(SIZES, REPS, strict=True):
        whole, half = torch.ones(nbytes // 4), torch.ones(nbytes // 8)
        for op in RING_FACTORS:
            times = []
            for i in range(reps + WARMUP):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "allreduce":
                    dist.all_reduce(whole)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(half, whole)
                else:
                    dist.all_gather_into_tensor(whole, half)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
            out[op][nbytes] = min(times)
    return out


def links_from_times(times: dict[str, dict[int, float]]) -> dict[str, Link]:
    """Per collective, the Link whose ring time for two ranks passes through the smallest and largest sizes."""
    links = {}
    for op, by_size in times.items():
        k_bw, k_lat = RING_FACTORS[op]
        n0, n1 = min(by_size), max(by_size)
        slope = max((by_size[n1] - by_size[n0]) / (n1 - n0), 1e-15)  # seconds per byte
        latency = max((by_size[n0] - n0 * slope) / k_lat, 0.0)
        links[op] = Link(kind="gloo " + op.replace("_", "-"), bandwidth_bytes_per_s=k_bw / slope, latency_s=latency)
    return links
