"""How much of a simulated step's compute runs while another device computes too.

A side-by-side slowdown (cores sharing caches and DRAM) is measured with every
device computing at once (runtime/side_by_side.py). In a pipeline the devices
compute at once only part of the time: examples/mlp.py's 1F1B plan, 2 stages and
2 microbatches, runs ~43% of its compute with the other device idle in the bubble, and
charged on all of its compute the measured 1.19-1.25x read that plan 9-14% slower
than `pipeplan run` measured it (benchmarks/RESULTS.md, "Defaults only"). So the
slowdown is charged in proportion: 1 + (s - 1) x the share of compute that overlaps
another device's (planner/replay.with_measured_slowdown).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeplan.planner.simulate import COMPUTE_KINDS


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `spans` as sorted, disjoint (start, end) pairs."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered_s(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Seconds of `spans` (disjoint, sorted) inside `cover` (disjoint, sorted)."""
    total, j = 0.0, 0
    for a, b in spans:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def overlap_share(events: Iterable[Any]) -> float:
    """Of the devices' compute seconds (forwards, backwards, W and re-runs), the share during which at least one
    other device computes too; 0 with no compute."""
    busy: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.kind in COMPUTE_KINDS:
            busy.setdefault(e.device, []).append((e.start_s, e.end_s))
    own = {d: merged(spans) for d, spans in busy.items()}
    total = sum(b - a for spans in own.values() for a, b in spans)
    if total <= 0:
        return 0.0
    shared = sum(covered_s(own[d], merged(s for o, spans in own.items() if o != d for s in spans)) for d in own)
    return shared / total
