"""Synthetic op timelines of a 2-rank pipeline with a known delay per op (oracle for the overhead tests)."""

from __future__ import annotations


def orders(schedule: str, M: int) -> tuple[list, list]:
    """Op order of each of 2 ranks, as torch's ScheduleGPipe / Schedule1F1B run them."""
    if schedule == "gpipe":
        one = [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
        return one, list(one)
    first = [("F", 0)] + [op for m in range(1, M) for op in (("F", m), ("B", m - 1))] + [("B", M - 1)]
    second = [op for m in range(M) for op in (("F", m), ("B", m))]
    return first, second


def timeline(schedule: str, M: int, f: float, b: float, gap: float, transfer: float) -> tuple[list, list]:
    """Events of a pipeline in which every op starts exactly `gap` after it could have."""
    order = orders(schedule, M)
    events: list[list] = [[], []]
    end: dict = {}
    ptr, free = [0, 0], [None, None]
    while ptr[0] < len(order[0]) or ptr[1] < len(order[1]):
        for r in (0, 1):
            while ptr[r] < len(order[r]):
                kind, m = order[r][ptr[r]]
                dep = (0, "F", m) if (r, kind) == (1, "F") else (1, "B", m) if (r, kind) == (0, "B") else None
                if dep is not None and dep not in end:
                    break
                ready = [t for t in (free[r], end[dep] + transfer if dep else None) if t is not None]
                start = (max(ready) if ready else 0.0) + gap
                stop = start + (f if kind == "F" else b)
                events[r].append((kind, m, start, stop))
                end[(r, kind, m)] = free[r] = stop
                ptr[r] += 1
    return events[0], events[1]
