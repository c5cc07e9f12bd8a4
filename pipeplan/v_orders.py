"""Op orders of the V-shaped zero-bubble schedules, ZB-V and DualPipeV, as torch.distributed.pipelining runs them.

Both put two model chunks on each of K ranks in a V: rank r holds virtual stages r and 2K - 1 - r
(torch's `generate_stage_to_rank_mapping(style="v")`), so the first and the last stage share rank 0
and the turn of the V (stages K - 1 and K) is a hand-over on rank K - 1 with no transfer.

The orders below are torch's `_calculate_single_rank_operations` (torch 2.13 schedules.py), rewritten
without torch so the simulator and the memory model (which sit below the runtime) can read them;
tests/test_v_schedules.py checks them op for op against torch's `pipeline_order`. Ops are
(kind, virtual stage, microbatch), kind "F" (forward), "B" (input gradient, zero bubble's I), "W"
(weight gradient) or "BW" (a whole backward: torch's FULL_BACKWARD). DualPipeV's OVERLAP_F_B action is
its forward then its whole backward: torch's runtime runs the sub-actions one after the other unless a
custom overlap function is registered, which pipeplan's runtime does not do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

__all__ = ["VOrder", "zbv_order", "dualpipev_order", "v_order", "walk", "peak_pairs", "held_points", "Point"]

VOrder = list[tuple[str, int, int]]


def zbv_order(rank: int, ranks: int, microbatches: int) -> VOrder:
    """ZB-V (Qi et al., ICLR 2024, §6) on `rank` of `ranks`: torch's ScheduleZBVZeroBubble.

    Warm-up: 2(K - r) - 1 forwards of chunk 0, r pairs (F chunk 1, F chunk 0), K - r triples
    (F, I, W of chunk 1); steady state: (F, I, W) of chunk 0 then of chunk 1 until every forward ran;
    cool-down: I's of both chunks, then I W pairs of chunk 0, then the remaining W's. torch plays at
    least 2K - 1 microbatches and drops the ops of those past M.
    """
    K, M = ranks, microbatches
    n = max(2 * K - 1, M)
    s0, s1 = rank, 2 * K - 1 - rank
    ops: VOrder = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (K - rank) - 1):
        ops.append(("F", s0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [("F", s1, f1), ("F", s0, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(K - rank):
        ops += [("F", s1, f1), ("B", s1, b1), ("W", s1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", s0, f0))
            f0 += 1
        ops += [("B", s0, b0), ("W", s0, b0), ("F", s1, f1), ("B", s1, b1), ("W", s1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [("B", s0, b0), ("B", s1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(K - rank):
        ops += [("B", s0, b0), ("W", s0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [("W", s1, m) for m in range(w1, b1)]
    ops += [("W", s0, m) for m in range(w0, b0)]
    return [op for op in ops if op[2] < M]


class _DualPipeV:
    """The counters of torch's ScheduleDualPipeV order: one microbatch counter per (stage, kind), and the
    queue of weight-gradient passes its input-gradient passes defer."""

    def __init__(self) -> None:
        self.ops: VOrder = []
        self.count: dict[tuple[int, str], int] = {}
        self.pending_w: list[tuple[int, int]] = []

    def add(self, kind: str, stage: int) -> None:
        """One op; a whole backward counts as both of its parts, an input gradient queues its W."""
        key = (stage, "B" if kind == "BW" else kind)
        m = self.count.get(key, 0)
        self.ops.append((kind, stage, m))
        if kind == "BW":
            self.count[(stage, "B")] = m + 1
            self.count[(stage, "W")] = self.count.get((stage, "W"), 0) + 1
            return
        if kind == "B":
            self.pending_w.append((stage, m))
        self.count[key] = m + 1

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        """OVERLAP_F_B: a forward, then a whole backward (run one after the other)."""
        self.add("F", forward_stage)
        self.add("BW", backward_stage)

    def weight(self) -> None:
        """The oldest deferred W, if any."""
        if self.pending_w:
            stage, m = self.pending_w.pop(0)
            self.ops.append(("W", stage, m))
            self.count[(stage, "W")] = self.count.get((stage, "W"), 0) + 1


def dualpipev_order(rank: int, ranks: int, microbatches: int) -> VOrder:
    """DualPipeV (DeepSeek-V3 report §3.2.1, arXiv 2412.19437, cut in half): torch's ScheduleDualPipeV.

    Eight steps per rank: forwards of chunk 0, F0 F1 pairs, (I1 W F1) with zero bubble, the main
    F0+B1 / F1+B0 overlapped pairs, B1 with F1+B0, B1 B0 (the second half as I's), W B0, the last W's.
    """
    K, M, r = ranks, microbatches, rank
    s0, s1 = r, 2 * K - 1 - r
    o = _DualPipeV()
    for _ in range((K - r - 1) * 2):
        o.add("F", s0)
    for _ in range(r + 1):
        o.add("F", s0)
        o.add("F", s1)
    for _ in range(K - r - 1):
        o.add("B", s1)
        o.weight()
        o.add("F", s1)
    for i in range(M - 2 * K + r + 1):
        if i == 0 and r == K - 1:  # torch: not overlapped, to shorten the bubble
            o.add("F", s0)
            o.add("BW", s1)
        else:
            o.overlap(s0, s1)
        o.overlap(s1, s0)
    for _ in range(K - r - 1):
        o.add("BW", s1)
        o.overlap(s1, s0)
    zero_bubble = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        o.add("B" if zero_bubble else "BW", s1)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        o.add("B" if zero_bubble else "BW", s0)
    for _ in range(K - r - 1):
        o.weight()
        o.add("B" if zero_bubble else "BW", s0)
    for _ in range(r + 1):
        o.weight()
    return o.ops


def v_order(schedule: str, rank: int, ranks: int, microbatches: int) -> VOrder:
    """The order of a V schedule by its pipeplan name ("zb-v" or "dualpipev")."""
    if schedule == "zb-v":
        return zbv_order(rank, ranks, microbatches)
    if schedule == "dualpipev":
        return dualpipev_order(rank, ranks, microbatches)
    raise ValueError(f"{schedule!r} is not a V schedule")


def walk(order: Sequence[tuple[str, int, int]], held_by: Callable[[int], int] = lambda stage: 1,
         pending_by: Callable[[int], int] = lambda stage: int(stage != 0)) -> Iterator[tuple[str, int, int, int]]:
    """(kind, virtual stage, held, pending) while each op of a rank's order runs: the one rule of what it holds.

    A forward's activations (`held_by` its stage: 1 to count them, bytes to weigh them) come when it starts and
    stay until the pass that ends its backward (W, or a whole backward BW) is over; a B keeps its weight ops'
    output gradients (`pending_by`) from its end until its W is over. By default the first stage keeps none:
    torch skips its B, whose W is the whole backward (`ScheduleFacts.b_reruns`). A rank runs its ops one at a
    time, so the peak over its order is the peak in time."""
    held = pending = 0
    for kind, stage, _ in order:
        held += held_by(stage) if kind == "F" else 0
        yield kind, stage, held, pending
        pending += pending_by(stage) if kind == "B" else -pending_by(stage) if kind == "W" else 0
        held -= held_by(stage) if kind in ("W", "BW") else 0


def peak_pairs(order: VOrder) -> int:
    """Most (chunk, microbatch) activations a rank holds at once (`walk`)."""
    return max((held for _, _, held, _ in walk(order)), default=0)


Point = tuple[int, int, bool]  # (pairs held, weight passes pending, an op with tensors in flight is running)


def held_points(order: VOrder) -> tuple[Point, ...]:
    """What a rank holds while each op of its order runs, the points no other of their kind exceeds in both counts:
    the peaks its memory can take, whatever the two weigh (costmodels/memory.py, `held_with_deferred`).

    (pairs held, input-gradient passes whose W has not run, busy), counted by `walk`. While F, B or BW runs its
    tensors in flight come on top (busy; a B's own gradients are among them, so it counts the pending before it);
    while W runs, it reads its microbatch's activations and gradients, both still held, and makes only weight
    gradients (not busy).
    """
    seen = {(held, pending, kind != "W") for kind, _, held, pending in walk(order)}
    return tuple(sorted(p for p in seen
                        if not any(q != p and q[2] == p[2] and q[0] >= p[0] and q[1] >= p[1] for q in seen)))
