"""Event-driven simulation of pipeline schedules (GPipe, 1F1B, PipeDream, interleaved 1F1B).

Closed forms such as (M+K-1)(t_f+t_b) only hold for uniform stages and free
communication; real partitions are neither, so the planner predicts iteration
time by playing the schedule out op by op. The same timeline is kept so it can
be drawn (`cli/plots.py`) and exported (`planner/timeline.py`).

Model of execution (docs/plan-format.md repeats it for users):

- Each device runs its compute ops (forward "F", backward "B", and "recompute"
  just before a B) one at a time, in the fixed order the schedule prescribes.
  An op starts when the device is free and its input has arrived.
- A forward of microbatch m on stage s needs the forward of m on stage s-1; a
  backward of m on stage s needs the backward of m on stage s+1 (and its own
  forward). When the two stages sit on different devices, the tensor crosses a
  directional link: the send starts when the producing op ends and the link is
  free (FIFO), lasts `send_s[boundary]`, and the consumer may start once it ends.
  Gradients travel back over the opposite direction, so links are full duplex.
- Sends overlap with compute: a device keeps computing while its outgoing
  tensors are in flight (a separate comm stream / DMA engine), which is what
  torch.distributed's isend and NCCL do in practice.
- Data-parallel gradient all-reduce of a stage starts when that stage's last
  backward ends, on a per-device comm channel, and overlaps with whatever
  compute remains; the iteration ends when the last compute op or all-reduce does.
- Memory per device: `static_bytes` for the whole run, plus
  `activation_bytes_per_mb[stage]` from the start of a microbatch's forward to
  the end of its backward, plus `recompute_bytes[stage]` from the start of the
  recompute to the end of the backward it feeds.

Schedules (Megatron-LM §2.2, arXiv 2104.04473; GPipe arXiv 1811.06965;
PipeDream SOSP'19):

- "gpipe": all M forwards, then all M backwards (in microbatch order).
- "1f1b": PipeDream-Flush. Stage s warms up with min(K-s-1, M) forwards, then
  alternates one forward and one backward, then drains; flush at the end.
- "pipedream": asynchronous 1F1B with no flush (weight stashing). There is no
  iteration boundary, so a long stream of microbatches is simulated and the
  reported iteration time is the steady-state time of M consecutive
  microbatches. `allreduce_s` is not used: fold weight synchronisation into the
  stage times, as PipeDream's optimizer does.
- "interleaved": Megatron's interleaved 1F1B. The stage lists have K*v entries
  (virtual stages in model order); virtual stage s runs on device s % K as its
  chunk s // K. M must be a multiple of K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeplan.errors import UserError

SIM_SCHEDULES = ("gpipe", "1f1b", "pipedream", "interleaved")
COMPUTE_KINDS = ("fwd", "bwd", "recompute")


@dataclass
class Event:
    device: int
    stage: int  # virtual stage (model order); equals the device except for interleaved
    chunk: int
    microbatch: int
    kind: str  # "fwd", "bwd", "send", "recv", "allreduce", "recompute"
    start_s: float
    end_s: float
    peer: int = -1  # for "send": the receiving device


@dataclass
class SimResult:
    iteration_s: float
    bubble_fraction: float  # idle share of the devices' time before the trailing all-reduce
    events: list[Event]
    peak_memory_bytes: list[int]  # per device
    memory_timeline: list[tuple[float, int, int]]  # (time_s, device, bytes in use), in time order
    pipeline_s: float = 0.0  # when the last compute op ends (pipedream: steady-state time of M microbatches)
    bubble_overhead: float = 0.0  # Megatron's t_pb / t_id: pipeline_s / busiest device's compute - 1
    busy_s: list[float] = field(default_factory=list)  # compute time per device per iteration
    inflight_peak: list[int] = field(default_factory=list)  # most microbatches held at once, per stage
    inflight_device_peak: list[int] = field(default_factory=list)  # most (chunk, microbatch) pairs held, per device


# ---------------------------------------------------------------------------
# Per-device op orders


def _order_1f1b(stage: int, stages: int, microbatches: int, first: int = 0) -> list[tuple[str, int]]:
    """One stage's PipeDream-Flush order as (kind, microbatch) for microbatches first..first+M-1."""
    warm = min(stages - stage - 1, microbatches)
    order = [("F", first + m) for m in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", first + warm + i), ("B", first + i)]
    order += [("B", first + m) for m in range(microbatches - warm, microbatches)]
    return order


def _orders(schedule: str, devices: int, chunks: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per device, the ordered list of (kind, virtual stage, microbatch)."""
    K, v, M = devices, chunks, microbatches
    if schedule == "gpipe":
        return [[("F", d, m) for m in range(M)] + [("B", d, m) for m in range(M)] for d in range(K)]
    if schedule in ("1f1b", "pipedream") or v == 1:  # interleaved with one chunk is plain 1F1B
        return [[(k, d, m) for k, m in _order_1f1b(d, K, M)] for d in range(K)]
    # Interleaved: Megatron-LM forward_backward_pipelining_with_interleaving.
    total = M * v
    orders = []
    for d in range(K):
        if M == K:
            warm = total  # Megatron: all-warmup when microbatches == pipeline size
        else:
            warm = min((K - d - 1) * 2 + (v - 1) * K, total)

        def op(kind: str, k: int) -> tuple[str, int, int]:
            group = k % (K * v)
            chunk = group // K
            if kind == "B":
                chunk = v - 1 - chunk
            mb = (k // (K * v)) * K + k % K
            return (kind, chunk * K + d, mb)

        order = [op("F", k) for k in range(warm)]
        for i in range(total - warm):
            order += [op("F", warm + i), op("B", i)]
        order += [op("B", k) for k in range(total - warm, total)]
        orders.append(order)
    return orders


# ---------------------------------------------------------------------------
# Simulation


def _check_lengths(name: str, values, n: int) -> list:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected {n}")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} has a negative entry")
    return values


def simulate(
    schedule: str,
    fwd_s: list[float],
    bwd_s: list[float],
    send_s: list[float],
    microbatches: int,
    *,
    chunks: int = 1,
    static_bytes: list[int] | None = None,
    activation_bytes_per_mb: list[int] | None = None,
    allreduce_s: list[float] | None = None,
    recompute_s: list[float] | None = None,
    recompute_bytes: list[int] | None = None,
    keep_events: bool = True,
) -> SimResult:
    """Play a pipeline schedule out and measure time, bubbles and memory.

    All lists are per (virtual) stage in model order, except `static_bytes`,
    which is per device. `send_s[i]` is the time to move one microbatch's
    tensors across boundary i (stage i to i+1; its gradient goes back in the
    same time); a list of K-1 entries is accepted too. Times may be any
    numbers supporting + and max (Fractions give exact results in tests).
    `keep_events=False` skips building the Event list (the search's fast path).
    """
    if schedule not in SIM_SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SIM_SCHEDULES)}")
    S = len(fwd_s)
    if S < 1:
        raise ValueError("no stages to simulate")
    if microbatches < 1:
        raise UserError(f"microbatches must be at least 1, got {microbatches}")
    if schedule != "interleaved" and chunks != 1:
        raise ValueError(f"chunks={chunks} only applies to the interleaved schedule")
    if chunks < 1 or S % chunks:
        raise ValueError(f"{S} virtual stages cannot be split into {chunks} chunks per device")
    K = S // chunks
    if schedule == "interleaved" and chunks > 1 and microbatches % K:
        raise UserError(
            f"the interleaved schedule needs the microbatch count to be a multiple of the {K} pipeline devices, got {microbatches}",
            f"use {K * max(1, round(microbatches / K))} microbatches or another schedule",
        )
    fwd = _check_lengths("fwd_s", fwd_s, S)
    bwd = _check_lengths("bwd_s", bwd_s, S)
    send = list(send_s)
    if len(send) == S - 1:
        send.append(0)
    send = _check_lengths("send_s", send, S)
    rec = _check_lengths("recompute_s", recompute_s, S) if recompute_s is not None else [0] * S
    act = _check_lengths("activation_bytes_per_mb", activation_bytes_per_mb, S) if activation_bytes_per_mb is not None else [0] * S
    rbytes = _check_lengths("recompute_bytes", recompute_bytes, S) if recompute_bytes is not None else [0] * S
    static = _check_lengths("static_bytes", static_bytes, K) if static_bytes is not None else [0] * K
    if schedule == "pipedream":
        if allreduce_s is not None and any(allreduce_s):
            raise ValueError("pipedream: fold weight synchronisation into the stage times; allreduce_s is not used")
        allred = [0] * S
    else:
        allred = _check_lengths("allreduce_s", allreduce_s, S) if allreduce_s is not None else [0] * S

    M = microbatches
    if schedule == "pipedream":
        # Enough microbatches that a window of M of them lies in the steady state.
        rounds = 3 + math.ceil(2 * K / M)
        stream = M * rounds
        orders = _orders("pipedream", K, 1, stream)
    else:
        stream = M
        orders = _orders(schedule, K, chunks, M)

    dev = [s % K for s in range(S)]
    f_start = [[None] * stream for _ in range(S)]
    f_end = [[None] * stream for _ in range(S)]
    f_arrive = [[None] * stream for _ in range(S)]  # F output available at the next stage's device
    b_end = [[None] * stream for _ in range(S)]
    b_arrive = [[None] * stream for _ in range(S)]  # B input-gradient available at the previous stage's device
    free = [0] * K
    link_free: dict[tuple[int, int], float] = {}
    events: list[Event] = []
    mem_deltas: list[list[tuple[float, int, int]]] = [[] for _ in range(K)]  # (time, order, delta)
    ptr = [0] * K
    remaining = sum(len(o) for o in orders)

    def _send(src_dev: int, dst_dev: int, ready, dur, stage: int, mb: int):
        if src_dev == dst_dev:
            return ready
        key = (src_dev, dst_dev)
        start = max(ready, link_free.get(key, 0))
        end = start + dur
        link_free[key] = end
        if keep_events and dur:
            events.append(Event(src_dev, stage, stage // K, mb, "send", start, end, dst_dev))
        return end

    while remaining:
        progressed = False
        for d in range(K):
            order = orders[d]
            while ptr[d] < len(order):
                kind, s, m = order[ptr[d]]
                if kind == "F":
                    ready = 0 if s == 0 else f_arrive[s - 1][m]
                    if ready is None:
                        break
                    start = max(free[d], ready)
                    end = start + fwd[s]
                    f_start[s][m] = start
                    f_end[s][m] = end
                    f_arrive[s][m] = _send(d, dev[s + 1], end, send[s], s, m) if s + 1 < S else end
                    mem_deltas[d].append((start, 1, act[s]))
                    if keep_events:
                        events.append(Event(d, s, s // K, m, "fwd", start, end))
                else:
                    ready = f_end[s][m] if s == S - 1 else b_arrive[s + 1][m]
                    if ready is None or f_end[s][m] is None:
                        break
                    start = max(free[d], ready, f_end[s][m])
                    if rec[s] or rbytes[s]:
                        mem_deltas[d].append((start, 1, rbytes[s]))
                        if keep_events and rec[s]:
                            events.append(Event(d, s, s // K, m, "recompute", start, start + rec[s]))
                        start = start + rec[s]
                    end = start + bwd[s]
                    b_end[s][m] = end
                    b_arrive[s][m] = _send(d, dev[s - 1], end, send[s - 1], s, m) if s > 0 else end
                    mem_deltas[d].append((end, 0, -(act[s] + rbytes[s])))
                    if keep_events:
                        events.append(Event(d, s, s // K, m, "bwd", start, end))
                free[d] = end
                ptr[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocked (internal error in the op orders)")

    busy = [0] * K
    for s in range(S):
        busy[dev[s]] += M * (fwd[s] + bwd[s] + rec[s])

    if schedule == "pipedream":
        # Steady state: time for M consecutive microbatches, measured on the last
        # stage (it never waits on a warm-up of its own) well inside the stream.
        i1 = stream - 2 * M - K
        pipeline_s = b_end[S - 1][i1 + M] - b_end[S - 1][i1]
        iteration_s = pipeline_s
    else:
        pipeline_s = max(max(row) for row in b_end)
        iteration_s = pipeline_s
        comm_free = [0] * K
        for s in sorted(range(S), key=lambda s: max(b_end[s])):
            if allred[s]:
                d = dev[s]
                start = max(max(b_end[s]), comm_free[d])
                comm_free[d] = start + allred[s]
                iteration_s = max(iteration_s, comm_free[d])
                if keep_events:
                    events.append(Event(d, s, s // K, -1, "allreduce", start, start + allred[s]))

    # Memory timeline: frees before allocations at the same instant.
    timeline: list[tuple[float, int, int]] = []
    peaks = []
    for d in range(K):
        use = static[d]
        peak = use
        timeline.append((0, d, use))
        for t, _, delta in sorted(mem_deltas[d], key=lambda x: (x[0], x[1])):
            use += delta
            peak = max(peak, use)
            timeline.append((t, d, use))
        peaks.append(int(peak))
    timeline.sort(key=lambda x: (x[0], x[1]))

    def _peak_count(stages_: list[int]) -> int:
        marks = sorted([(f, 1) for s in stages_ for f in f_start[s]] + [(b, 0) for s in stages_ for b in b_end[s]])
        n = best = 0
        for _, up in marks:
            n += 1 if up else -1
            best = max(best, n)
        return best

    inflight = [_peak_count([s]) for s in range(S)]
    inflight_device = [_peak_count(list(range(d, S, K))) for d in range(K)]

    ideal = max(busy) if max(busy) else 1
    if pipeline_s:
        bubble_fraction = 1 - sum(busy) / (K * pipeline_s)
        bubble_overhead = pipeline_s / ideal - 1
    else:
        bubble_fraction = bubble_overhead = 0
    events.sort(key=lambda e: (e.start_s, e.device, e.kind))
    return SimResult(
        iteration_s=iteration_s,
        bubble_fraction=bubble_fraction,
        events=events,
        peak_memory_bytes=peaks,
        memory_timeline=timeline,
        pipeline_s=pipeline_s,
        bubble_overhead=bubble_overhead,
        busy_s=busy,
        inflight_peak=inflight,
        inflight_device_peak=inflight_device,
    )
