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

with n the whole (unsharded) tensor's bytes. Larger groups extrapolate with the
same ring formulas.

Each size's time is the mean of its repeats, not the best: it is what a run
pays. With each rank pinned to one core (as the runtime's are) gloo's collectives
are bimodal: measured here, a 256 KiB all-reduce took 0.46 ms at best and 3.3 ms
in the median (a reduce-scatter 3.0 and 4.1 ms), the rank's communication thread
waiting for its core; the best times priced a ZeRO-2 plan's reduce-scatter at
0.6 ms where the run spent 7 ms.

Sizes inside the measured range are priced off the measured curve
(`link_at_size`); the Link's line prices the sizes outside it, so it is the chord
through the smallest and the largest size (`chord`): latency from the smallest
message, bandwidth from the largest, the usual two-point alpha-beta estimate, and
a price that meets the measured curve at both ends. A least-squares line over all
four sizes (weights 1/t^2, used before) let the middle sizes, which the curve
prices anyway, pull it: on a noisy host it priced 16 MiB at 5.6 ms where that
same calibration had measured 14.8.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from pipeplan.hardware_profiles.profile import Link
from pipeplan.units import KIB, MIB

SIZES = (16 * KIB, 256 * KIB, 4 * MIB, 16 * MIB)  # whole-tensor bytes (even, so each rank's half is whole)
REPS = (24, 16, 8, 4)
WARMUP = 2
# n/bw and latency factors of each collective's ring time for a group of two (see the module doc)
RING_FACTORS = {"allreduce": (1.0, 2.0), "reduce_scatter": (0.5, 1.0), "all_gather": (0.5, 1.0)}


def reduce_scatter_op(dist: Any) -> Any:
    """torch.distributed's reduce-scatter into one tensor: `reduce_scatter_single` from torch 2.13, where the old
    name `reduce_scatter_tensor` (the same arguments) warns on every call, on every rank; the old name before."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_op(dist: Any) -> Any:
    """The same for all-gather into one tensor: `all_gather_single`, formerly `all_gather_into_tensor`."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _clock_s(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def round_trips_s(dist: Any, rank: int, buf: Any, reps: int, warmup: int,
                  timed: Callable[[Callable[[], None]], float] = _clock_s) -> list[float]:
    """Seconds of each of `reps` round trips of `buf` between ranks 0 and 1 (after `warmup` untimed ones), rank 0
    sending first; `timed` runs one trip and says how long it took (the clock, or CUDA events on a GPU). The send
    link's calibrations (gloo: `calibrate`, NCCL: `calibrate_nccl`) take half a trip as one message's time."""

    def trip() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return [timed(trip) for _ in range(reps + warmup)][warmup:]


def time_collectives(dist: Any, torch: Any) -> dict[str, dict[int, float]]:
    """Mean seconds per size of each collective (call on both ranks of an initialised 2-rank group)."""
    out: dict[str, dict[int, float]] = {op: {} for op in RING_FACTORS}
    reduce_scatter, all_gather = reduce_scatter_op(dist), all_gather_op(dist)
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
                    reduce_scatter(half, whole)
                else:
                    all_gather(whole, half)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
            out[op][nbytes] = sum(times) / len(times)
    return out


def chord(by_size: dict[int, float]) -> tuple[float, float]:
    """(intercept s, slope s per byte) of the line t = a + b n through the smallest and the largest size's times
    (two or more sizes are needed). Where that line would cross zero above size 0 (the smallest message faster per
    byte than the chord, a noisy run), the line through the origin and the largest size: a latency cannot be
    negative, and the largest size's time, the one extrapolated from, is kept."""
    if len(by_size) < 2:
        raise ValueError("a line needs two or more sizes")
    (n_lo, t_lo), (n_hi, t_hi) = min(by_size.items()), max(by_size.items())
    slope = max((t_hi - t_lo) / (n_hi - n_lo), 0.0)
    intercept = t_lo - slope * n_lo
    if intercept < 0:
        return 0.0, t_hi / n_hi
    return intercept, slope


def links_from_times(times: dict[str, dict[int, float]]) -> dict[str, Link]:
    """Per collective, the Link whose ring time for two ranks is the chord through the smallest and largest sizes."""
    links = {}
    for op, by_size in times.items():
        k_bw, k_lat = RING_FACTORS[op]
        intercept, slope = chord(by_size)  # intercept >= 0, slope >= 0
        slope = max(slope, 1e-15)  # seconds per byte: a bandwidth needs a slope above 0
        latency = intercept / k_lat
        links[op] = Link(kind="gloo " + op.replace("_", "-"), bandwidth_bytes_per_s=k_bw / slope, latency_s=latency)
    return links


def time_at_size_s(by_size_s: dict[int, float], nbytes: float) -> float | None:
    """The two-rank time at `nbytes` read off the measured sizes: log-log linear between the two around it, None
    outside the measured range (where the chord, `links_from_times`, prices it)."""
    sizes = sorted(by_size_s)
    if len(sizes) < 2 or not sizes[0] <= nbytes <= sizes[-1]:
        return None
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if nbytes <= hi:
            w = math.log(nbytes / lo) / math.log(hi / lo)
            return math.exp((1 - w) * math.log(by_size_s[lo]) + w * math.log(by_size_s[hi]))
    return None  # pragma: no cover - the range check above returns before


def link_at_size(link: Link, op: str, by_size_s: dict[int, float], nbytes: float) -> Link:
    """The link a collective of `nbytes` is priced with: `link` (the chord, `links_from_times`) keeping its latency,
    its bandwidth set so the two-rank ring time at `nbytes` is the measured curve's there (`time_at_size_s`).

    Why: gloo's time per byte is not one number. Measured on this machine's two cores (one profile): an all-reduce
    took 200 µs at 16 KiB, 1498 at 256 KiB, 4399 at 4 MiB and 12610 at 16 MiB, and a least-squares line through
    them priced 256 KiB at 434 µs; examples/gpt.py's 550 KB of gradients all-reduced in 2.1-2.4 ms in `pipeplan run`
    against 0.6 on the line (benchmarks/RESULTS.md, "Defaults only"). Larger groups keep the ring formulas with this
    bandwidth. Outside the measured sizes, or where the curve is under the line's latency, the line as it is.
    """
    t = time_at_size_s(by_size_s, nbytes)
    k_bw, k_lat = RING_FACTORS[op]
    if t is None or t <= k_lat * link.latency_s or nbytes <= 0:
        return link
    return Link(kind=link.kind, bandwidth_bytes_per_s=k_bw * nbytes / (t - k_lat * link.latency_s),
                latency_s=link.latency_s)
