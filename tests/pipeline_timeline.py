"""Synthetic op timelines of a 2-rank pipeline with a known delay per op (oracle for the overhead tests)."""

from __future__ import annotations

from collections.abc import Callable

from pipeplan.hardware_profiles.op_overhead import CHUNKS, SHAPES, depends_on, shape_schedules
from pipeplan.schedules import local_order, stage_device
from pipeplan.v_orders import zbv_order


def orders(schedule: str, M: int, chunks: int | None = None) -> tuple[list, list]:
    """Op order (kind, stage, microbatch) of each of 2 ranks, as torch's schedules run them for GPipe, 1F1B and
    ZB-V (rank r holds stages r and 3 - r; pipeplan/v_orders.py, checked op for op against torch), and the
    asynchronous loop for PipeDream; for interleaved (stages r and r + 2 on rank r) a valid depth-first order
    (forwards of stage r, then r + 2, backwards the other way round) and for ZB-H1 1F1B's with each W right
    after its B (the gaps do not depend on which valid order). `chunks`: interleaved's stages a rank (CHUNKS'
    unless given): rank r holds r, r + 2, ...; forwards stage by stage up, backwards down."""
    if schedule == "zb-v":
        v = [zbv_order(r, 2, M) for r in (0, 1)]
        return v[0], v[1]
    if schedule == "pipedream":
        mine = [[(kind, r, m) for kind, m in local_order(M, 2 - r)] for r in (0, 1)]
        return mine[0], mine[1]
    if schedule == "zb-h1":
        one = orders("1f1b", M)
        split = [[op for kind, s, m in one[r] for op in ([(kind, s, m)] + ([("W", s, m)] if kind == "B" else []))]
                 for r in (0, 1)]
        return split[0], split[1]
    if schedule == "gpipe":
        gpipe = [[("F", r, m) for m in range(M)] + [("B", r, m) for m in range(M)] for r in (0, 1)]
        return gpipe[0], gpipe[1]
    if schedule == "interleaved":
        mine = [list(range(r, 2 * (chunks or CHUNKS[schedule]), 2)) for r in (0, 1)]
        inter = [[("F", s, m) for s in mine[r] for m in range(M)] + [("B", s, m) for s in mine[r][::-1]
                                                                    for m in range(M)] for r in (0, 1)]
        return inter[0], inter[1]
    first = [("F", 0, 0)] + [op for m in range(1, M) for op in (("F", 0, m), ("B", 0, m - 1))] + [("B", 0, M - 1)]
    second = [op for m in range(M) for op in (("F", 1, m), ("B", 1, m))]
    return first, second


def timeline(schedule: str, M: int, f: float, b: float, gap: float, transfer: float,
             stolen: float = 0.0, gap_of: Callable[[str, int], float] | None = None,
             chunks: int | None = None) -> tuple[list, list]:
    """Events of a pipeline in which every op starts exactly `gap` after it could have (a dependency on the other
    rank: `transfer` after it ended; the schedule's placement says which rank a stage is on), plus `gap_of(kind,
    stage)` where given, and during every op other threads used `stolen` seconds of CPU. `chunks` as `orders`."""
    order = orders(schedule, M, chunks)
    stages = 2 * (chunks or CHUNKS[schedule])
    events: list[list] = [[], []]
    end: dict = {}
    ptr, free = [0, 0], [None, None]
    while ptr[0] < len(order[0]) or ptr[1] < len(order[1]):
        for r in (0, 1):
            while ptr[r] < len(order[r]):
                kind, stage, m = order[r][ptr[r]]
                dep = depends_on(kind, stage, m, stages)
                if dep is not None and dep not in end:
                    break
                cross = dep is not None and stage_device(schedule, dep[1], 2) != r
                ready = [t for t in (free[r], end[dep] + (transfer if cross else 0.0) if dep else None) if t is not None]
                start = (max(ready) if ready else 0.0) + gap + (gap_of(kind, stage) if gap_of else 0.0)
                stop = start + (f if kind == "F" else b)
                events[r].append((kind, stage, m, start, stop, stolen))
                end[(kind, stage, m)] = free[r] = stop
                ptr[r] += 1
    return events[0], events[1]


def messages(schedule: str, kind: str, stage: int) -> int:
    """Messages an op of the calibration's 2-rank pipeline sends or receives: one per neighbouring stage on the
    other rank (written from the placement, not from the code under test); a W none."""
    last = 2 * CHUNKS[schedule] - 1
    here = stage_device(schedule, stage, 2)
    return 0 if kind == "W" else sum(1 for n in (stage - 1, stage + 1) if 0 <= n <= last
                                     and stage_device(schedule, n, 2) != here)


def mean_messages(schedule: str, M: int) -> float:
    """Messages a forward or backward of the calibration's pipeline sends or receives, on average (`messages`): the
    factor between one message's bytes and the bytes an op moves, which the per-byte term is fitted against."""
    ops = [(kind, stage) for kind, stage, _ in sum(orders(schedule, M), []) if kind != "W"]
    return sum(messages(schedule, kind, stage) for kind, stage in ops) / len(ops)


def charged_per_op(schedule: str, M: int, gap: float) -> float:
    """What the fit charges each forward and backward when every op (W too) starts `gap` late: the gaps' sum over
    the forwards and backwards that have one (all ops but rank 0's first)."""
    first, second = orders(schedule, M)
    ops = first + second
    return gap * (len(ops) - 1) / (sum(1 for kind, *_ in ops if kind != "W") - 1)


def per_rank_events(steps_of: Callable[[str, str], list[tuple[list, list]]]) -> list[dict]:
    """Both ranks' events as `pipeline_ops.run_pipeline` returns them (per "shape/schedule", a list of steps), for
    every measured schedule and stage shape: `steps_of(schedule, shape)` gives each step's (rank 0, rank 1)
    timelines."""
    per_rank: list[dict] = [{}, {}]
    for shape in SHAPES:
        for schedule in shape_schedules(shape):
            steps = steps_of(schedule, shape)
            for r in (0, 1):
                per_rank[r][f"{shape}/{schedule}"] = [step[r] for step in steps]
    return per_rank
