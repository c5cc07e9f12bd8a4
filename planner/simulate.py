"""Event-driven simulation of pipeline schedules (GPipe, 1F1B, PipeDream, interleaved 1F1B, zero bubble).

Closed forms such as (M+K-1)(t_f+t_b) only hold for uniform stages and free
communication; real partitions are neither, so the planner predicts iteration
time by playing the schedule out op by op. The same timeline is kept so it can
be drawn (`cli/plots.py`) and exported (`planner/timeline.py`).

Model of execution (docs/plan-format.md repeats it for users):

- Each device runs its compute ops (forward "F", backward "B", and "recompute"
  just before a B, and again before a zero-bubble W: the runtime's checkpointing
  re-runs the forward for each backward pass, `recompute_w_s` for a W) one at a
  time, in the fixed order the schedule prescribes. The first stage's split B
  re-runs nothing (torch runs that stage's whole backward as its W).
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
- `receives_wait=True`: the transfer starts only once the receiving device has
  also reached the op (and the link is free), and the op starts when it ends,
  so the consumer waits the whole transfer. That is how the torch schedules post
  receives: torch.distributed.pipelining posts an op's receives when it comes
  to the op and waits on them before computing (torch 2.13 schedules.py,
  `_step_microbatches`: `get_fwd_recv_ops(i)`, wait, then `forward_one_chunk`),
  and ProcessGroupNCCL makes its stream wait for the work already queued on the
  compute stream before a receive (`pointToPoint`: "First let NCCL streams wait
  for input tensors allocation streams"), so the transfer starts after the
  receiver's previous op. Senders still go on computing. The default (False)
  starts the transfer at the producer's end: a runtime that posts receives ahead
  (PipeDream's loop, runtime/pipedream_comm.py) or copies on streams of its own
  beside compute (torchgpipe/copy.py), or a caller whose per-op time already
  holds the wait (a local profile's calibrated gap, op_overhead.py).
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
- "pipedream-2bw": the same 1F1B stream without flush, plus once per window of
  M microbatches the pipeline replicas' all-reduce and the optimizer step
  (`_window_update_s`; Narayanan et al., ICML 2021, §3.1).
- "interleaved": interleaved 1F1B (Narayanan et al., SC'21) in torch's ScheduleInterleaved1F1B order,
  which the runtime runs (Megatron-LM's differs only at M == K). The stage lists have K*v entries
  (virtual stages in model order); virtual stage s runs on device s % K as its
  chunk s // K. M must be a multiple of K.
- "zb-h1": zero bubble (Qi et al., ICLR 2024, §3.1), as torch's ScheduleInterleavedZeroBubble orders it
  with one stage per device: each backward is an input-gradient op "B" (bwd_s - wgrad_s; it alone is
  on the critical path to the previous stage) and a weight-gradient op "W" (wgrad_s) run later; stage s
  has 1F1B's warm-up and defers its W's by s microbatches, which fill the cool-down bubble. A
  microbatch's activations (and its gradient all-reduce's readiness) last until its W ends.
- "zb-v" and "dualpipev": the V-shaped zero-bubble schedules (Qi et al. 2024 §6; DeepSeek-V3 §3.2.1), two
  chunks per device placed in a V (virtual stage s on device s for s < K, else 2K - 1 - s), in torch's own
  op orders (pipeplan/v_orders.py). DualPipeV also runs whole backwards ("BW": B and W at once, the
  input gradient sent when both end), and its overlapped forward+backward pairs one after the other.

Without a flush, the stages that hold one tied parameter (`tied_stages`, e.g. a GPT's embedding and LM
head) sum its gradients at every update (runtime/pipedream.update): a rendezvous op "U" after each such
backward waits for every holder's backward of that microbatch (2BW: of the window's last). On 2 stages
that makes PipeDream's period b0 + max(f0, f1 + b1) instead of max(f0 + b0, f1 + b1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from pipeplan.errors import UserError
from pipeplan.schedules import ScheduleFacts, device_stages, facts, interleaved_warmup_forwards, stage_device
from pipeplan.v_orders import v_order

COMPUTE_KINDS = ("fwd", "bwd", "recompute", "wgrad")

Order = list[tuple[str, int, int]]
"""One device's ops in the order it runs them: (kind, virtual stage, microbatch); kind "F", "B", "W" (zero
bubble's weight gradient, after its "B"), "BW" (a whole backward in a schedule that otherwise splits them) or
"U" (without a flush: a tied parameter's update, after every holder's backward of that microbatch)."""
MemDelta = tuple[float, int, int]
"""(time, 0 for a free / 1 for an allocation, bytes): frees sort before allocations at the same instant."""


@dataclass
class Event:
    device: int
    stage: int  # virtual stage (model order); equals the device except for interleaved
    chunk: int
    microbatch: int
    kind: str  # "fwd", "bwd", "wgrad" (zero bubble's W), "send", "recv", "allreduce", "recompute", "optimizer"
    start_s: float
    end_s: float
    peer: int = -1  # for "send": the receiving device


@dataclass
class SimResult:
    iteration_s: float
    bubble_fraction: float  # idle share of the devices' time before the trailing all-reduce
    events: list[Event]
    peak_memory_bytes: list[int]  # per device; empty without events (`simulate`)
    memory_timeline: list[tuple[float, int, int]]  # (time_s, device, bytes in use), in time order; empty without events
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


def _order_zb_h1(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """One stage's ZB-H1 order as (kind, microbatch): torch's `_get_1f1b_rank_ops` with one local stage,
    `enable_zero_bubble=True` and `num_1f1b_microbatches = rank` (ScheduleInterleavedZeroBubble):
    warm-up min(K - s - 1, M) forwards, then F B pairs, each followed by the W of the oldest pending
    backward once s backwards are pending; the cool-down's B's likewise, then the remaining W's."""
    warm = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warm)]
    done_b = done_w = 0
    for op in range(warm, microbatches + warm):  # torch: op < M is an F B pair, then the cool-down's B's
        if op < microbatches:
            order.append(("F", op))
        order.append(("B", done_b))
        done_b += 1
        if op - warm >= stage:
            order.append(("W", done_w))
            done_w += 1
    order += [("W", m) for m in range(done_w, microbatches)]
    return order


def _interleaved_op(kind: str, k: int, device: int, devices: int, chunks: int) -> tuple[str, int, int]:
    """The k-th forward (or backward) of `device` in Megatron's interleaved order, as (kind, virtual stage, mb).

    Microbatches go in groups of `devices`: a group runs through chunk 0, then chunk 1, ...
    (backwards visit the chunks in reverse), so consecutive ops of a device stay on one chunk
    for `devices` microbatches.
    """
    group = k % (devices * chunks)
    chunk = group // devices
    if kind == "B":
        chunk = chunks - 1 - chunk
    mb = (k // (devices * chunks)) * devices + k % devices
    return (kind, chunk * devices + device, mb)


def device_orders(schedule: str, devices: int, chunks: int, microbatches: int) -> list[Order]:
    """Per device, the ordered list of (kind, virtual stage, microbatch)."""
    K, v, M = devices, chunks, microbatches
    if schedule == "gpipe":
        return [[("F", d, m) for m in range(M)] + [("B", d, m) for m in range(M)] for d in range(K)]
    if facts(schedule).placement == "v":
        return [v_order(schedule, d, K, M) for d in range(K)]
    if facts(schedule).splits_backward:
        return [[(k, d, m) for k, m in _order_zb_h1(d, K, M)] for d in range(K)]
    if not facts(schedule).interleaves or v == 1:  # interleaved with one chunk is plain 1F1B
        return [[(k, d, m) for k, m in _order_1f1b(d, K, M)] for d in range(K)]
    # Interleaved: torch's ScheduleInterleaved1F1B (`_get_warmup_ops`), which the runtime runs. Megatron-LM's
    # forward_backward_pipelining_with_interleaving has the same warm-up except when M == K: it then runs
    # all M*v forwards first, where torch keeps the formula (fewer forwards in flight on the later devices).
    total = M * v
    orders = []
    for d in range(K):
        warm = interleaved_warmup_forwards(K, d, M, v)
        order = [_interleaved_op("F", k, d, K, v) for k in range(warm)]
        for i in range(total - warm):
            order += [_interleaved_op("F", warm + i, d, K, v), _interleaved_op("B", i, d, K, v)]
        order += [_interleaved_op("B", k, d, K, v) for k in range(total - warm, total)]
        orders.append(order)
    return orders


# ---------------------------------------------------------------------------
# Inputs

_Num = TypeVar("_Num", int, float)


@dataclass(frozen=True)
class _SimInputs:
    """`simulate`'s arguments once checked: every per-stage tuple has one entry per virtual stage.

    Absent optional lists become zeros (ints, so exact Fraction inputs stay exact).
    """

    schedule: ScheduleFacts
    stages: int  # S, virtual stages (K * chunks)
    devices: int  # K
    device_of: tuple[int, ...]  # the device of each virtual stage (pipeplan.schedules.stage_device)
    chunks: int
    microbatches: int  # M
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    send: tuple[float, ...]  # boundary s -> s+1; the last entry (no boundary) is never used
    recompute: tuple[float, ...]  # the re-run before a B or a whole backward
    recompute_w: tuple[float, ...]  # the re-runs a zero-bubble W makes (simulate's recompute_w_s)
    activation_bytes: tuple[int, ...]
    recompute_bytes: tuple[int, ...]
    static_bytes: tuple[int, ...]  # per device
    allreduce: tuple[float, ...]  # all zero without a flush
    optimizer: tuple[float, ...] = ()  # each stage's optimizer step after its all-reduce (flushing schedules)
    wgrad: tuple[float, ...] = ()  # the weight-gradient part W of each bwd (zero bubble; empty otherwise)
    tied: tuple[tuple[int, ...], ...] = ()  # without a flush: stages whose updates meet (a tied parameter's holders)
    fresh: tuple[float, ...] = ()  # of bwd (W), what a backward into fresh gradients saves (_fresh_times)
    keep_first: bool = False  # recomputation spares each stage's first backward (simulate's recompute_last=False)
    receives_wait: bool = False  # a transfer starts once its consumer reaches the op (simulate's receives_wait)

    @property
    def update_every(self) -> int:
        """Microbatches per update: gradients are cleared after it, so the next backward writes fresh ones."""
        return self.microbatches // self.schedule.fresh_backwards(self.microbatches)


def _check_lengths(name: str, values: Iterable[_Num], n: int) -> tuple[_Num, ...]:
    """`values` as a tuple, after checking it has `n` entries, none negative."""
    out = tuple(values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries, expected {n}")
    if any(x < 0 for x in out):
        raise ValueError(f"{name} has a negative entry")
    return out


def _optional(name: str, values: Sequence[_Num] | None, n: int) -> tuple[_Num, ...]:
    """A checked optional list, zeros when absent."""
    if values is None:
        return (0,) * n  # int zeros, exact whatever number type the other lists use
    return _check_lengths(name, values, n)


def _check_shape(schedule: str, stages: int, microbatches: int, chunks: int) -> ScheduleFacts:
    """The schedule's facts after checking that stages, microbatches and chunks fit it.

    Kept apart from the list checks so the errors come in the order users meet
    them: the schedule name, then the pipeline's shape, then the per-stage lists.
    """
    schedule_facts = facts(schedule)
    if stages < 1:
        raise ValueError("no stages to simulate")
    if microbatches < 1:
        raise UserError(f"microbatches must be at least 1, got {microbatches}")
    if not schedule_facts.interleaves and chunks != 1:
        raise ValueError(f"chunks={chunks} only applies to the interleaved schedule")
    if schedule_facts.fixed_chunks and chunks != schedule_facts.fixed_chunks:
        raise ValueError(f"{schedule} runs exactly {schedule_facts.fixed_chunks} chunks per device, not {chunks}")
    problem = schedule_facts.microbatch_rule(stages // chunks, microbatches) if schedule_facts.placement == "v" else None
    if problem:  # torch's V orders are only defined within its rule
        raise UserError(f"{schedule} {problem}, got {microbatches}")
    if chunks < 1 or stages % chunks:
        raise ValueError(f"{stages} virtual stages cannot be split into {chunks} chunks per device")
    K = stages // chunks
    if schedule_facts.placement == "loop" and schedule_facts.interleaves and chunks > 1 and microbatches % K:
        raise UserError(
            f"the interleaved schedule needs the microbatch count to be a multiple of the {K} pipeline devices, "
            f"got {microbatches}",
            f"use {K * max(1, round(microbatches / K))} microbatches or another schedule",
        )
    return schedule_facts


def _allreduce_times(schedule: ScheduleFacts, allreduce_s: Sequence[float] | None, stages: int) -> tuple[float, ...]:
    """Per-stage all-reduce times; async PipeDream has no iteration end to all-reduce at (PipeDream-2BW
    all-reduces once per window: `_window_update_s`)."""
    if schedule.updates_each_microbatch:
        if allreduce_s is not None and any(allreduce_s):
            raise ValueError(f"{schedule.name}: fold weight synchronisation into the stage times; "
                             "allreduce_s is not used")
        return (0,) * stages
    return _optional("allreduce_s", allreduce_s, stages)


def _optimizer_times(schedule: ScheduleFacts, optimizer_s: Sequence[float] | None, stages: int) -> tuple[float, ...]:
    """Per-stage optimizer step times; async PipeDream updates after every backward (fold it in)."""
    if schedule.updates_each_microbatch and optimizer_s is not None and any(optimizer_s):
        raise ValueError(f"{schedule.name}: fold the per-microbatch update into the stage times; optimizer_s is not used")
    return _optional("optimizer_s", None if schedule.updates_each_microbatch else optimizer_s, stages)


def _wgrad_times(schedule: ScheduleFacts, wgrad_s: Sequence[float] | None, bwd: tuple[float, ...]) -> tuple[float, ...]:
    """Each stage's weight-gradient time W, part of its bwd_s (zero bubble only).

    Without measured times, half the backward: a Linear's (and a convolution's) input gradient and weight
    gradient are each 2*m*n*k FLOPs (Qi et al. 2024 §2 take T_B = T_W), the rule docs/graph-format.md
    states for graphs without the split. A schedule that runs whole backwards takes no W.
    """
    if not schedule.splits_backward:
        if wgrad_s is not None and any(wgrad_s):
            raise ValueError(f"{schedule.name} runs whole backwards; wgrad_s is not used")
        return ()
    if wgrad_s is None:
        return tuple(b / 2 for b in bwd)
    w = _check_lengths("wgrad_s", wgrad_s, len(bwd))
    if any(x > b for x, b in zip(w, bwd, strict=True)):
        raise ValueError("wgrad_s has an entry larger than its stage's bwd_s (W is part of the backward)")
    return w


def _fresh_times(fresh_s: Sequence[float] | None, bwd: tuple[float, ...], wgrad: tuple[float, ...]) -> tuple[float, ...]:
    """What each stage's first backward of an update saves by writing fresh gradients (costmodels/accumulate.py):
    part of its backward, of its W where the schedule splits the backward (W makes the weight gradients)."""
    if fresh_s is None:
        return ()
    out = _check_lengths("fresh_grad_s", fresh_s, len(bwd))
    if any(x > w for x, w in zip(out, wgrad or bwd, strict=True)):
        raise ValueError("fresh_grad_s has an entry larger than its stage's weight-gradient time (it is part of it)")
    return out


def _tied_groups(schedule: ScheduleFacts, tied_stages: Sequence[Sequence[int]] | None,
                 stages: int) -> tuple[tuple[int, ...], ...]:
    """Groups of two or more stages that hold one tied parameter. Only schedules without a flush use them:
    there each update sums the holders' gradients (runtime/pipedream.update), so a holder cannot finish an
    update before every holder has run that microbatch's backward. A flush already waits for everyone."""
    groups = tuple(tuple(sorted(set(g))) for g in (tied_stages or ()) if len(set(g)) > 1)
    if any(not 0 <= x < stages for g in groups for x in g):
        raise ValueError(f"tied_stages names a stage outside 0..{stages - 1}")
    return groups if not schedule.flushes else ()


def _update_points(inp: _SimInputs, stream: int) -> list[Order]:
    """Per device, its ops with a rendezvous ("U", stage, m) after every backward that ends an update of a
    tied stage: each microbatch for PipeDream, the last of each window of M for PipeDream-2BW."""
    orders = device_orders(inp.schedule.name, inp.devices, inp.chunks, stream)
    if not inp.tied:  # the search's inner loop: no copy of the orders
        return orders
    every = inp.update_every
    tied = {s for g in inp.tied for s in g}
    return [[op for kind, s, m in order
             for op in ([(kind, s, m), ("U", s, m)] if kind == "B" and s in tied and m % every == every - 1
                        else [(kind, s, m)])]
            for order in orders]


def _validate(
    schedule: str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_s: Sequence[float],
    microbatches: int,
    chunks: int,
    static_bytes: Sequence[int] | None,
    activation_bytes_per_mb: Sequence[int] | None,
    allreduce_s: Sequence[float] | None,
    recompute_s: Sequence[float] | None,
    recompute_bytes: Sequence[int] | None,
    optimizer_s: Sequence[float] | None = None,
    wgrad_s: Sequence[float] | None = None,
    tied_stages: Sequence[Sequence[int]] | None = None,
    fresh_grad_s: Sequence[float] | None = None,
    recompute_w_s: Sequence[float] | None = None,
    recompute_last: bool = True,
    receives_wait: bool = False,
) -> _SimInputs:
    """Check and normalise `simulate`'s arguments (see its docstring), raising on the first problem."""
    S = len(fwd_s)
    schedule_facts = _check_shape(schedule, S, microbatches, chunks)
    K = S // chunks
    fwd = _check_lengths("fwd_s", fwd_s, S)
    bwd = _check_lengths("bwd_s", bwd_s, S)
    send = list(send_s)
    if len(send) == S - 1:
        send.append(0)
    wgrad = _wgrad_times(schedule_facts, wgrad_s, bwd)
    recompute = _optional("recompute_s", recompute_s, S)
    if recompute_w_s is not None and not schedule_facts.splits_backward:
        raise ValueError(f"{schedule} runs whole backwards; recompute_w_s is not used")
    if not recompute_last and (schedule_facts.splits_backward or not schedule_facts.flushes):
        raise ValueError(f"recompute_last=False spares one microbatch of a flushing schedule's whole backwards, not {schedule}'s")
    return _SimInputs(
        schedule=schedule_facts, stages=S, devices=K, chunks=chunks, microbatches=microbatches,
        device_of=tuple(stage_device(schedule, s, K) for s in range(S)),
        fwd=fwd, bwd=bwd, send=_check_lengths("send_s", send, S),
        recompute=recompute,
        recompute_w=recompute if recompute_w_s is None else _check_lengths("recompute_w_s", recompute_w_s, S),
        activation_bytes=_optional("activation_bytes_per_mb", activation_bytes_per_mb, S),
        recompute_bytes=_optional("recompute_bytes", recompute_bytes, S),
        static_bytes=_optional("static_bytes", static_bytes, K),
        allreduce=_allreduce_times(schedule_facts, allreduce_s, S),
        optimizer=_optimizer_times(schedule_facts, optimizer_s, S),
        wgrad=wgrad,
        tied=_tied_groups(schedule_facts, tied_stages, S),
        fresh=_fresh_times(fresh_grad_s, bwd, wgrad),
        keep_first=not recompute_last,
        receives_wait=receives_wait,
    )


# ---------------------------------------------------------------------------
# Event loop


def _stream_length(inp: _SimInputs) -> int:
    """Microbatches to play out: M, or without a flush enough that M of them lie in the steady state."""
    M, K = inp.microbatches, inp.devices
    if inp.schedule.flushes:
        return M
    rounds = 3 + math.ceil(2 * K / M)
    return M * rounds


@dataclass
class _Run:
    """What the event loop fills in, per (virtual stage, microbatch): None until that op has run."""

    f_start: list[list[float | None]]
    f_end: list[list[float | None]]
    f_arrive: list[list[float | None]]  # forward output available at the next stage's device
    b_end: list[list[float | None]]
    b_arrive: list[list[float | None]]  # input gradient available at the previous stage's device
    w_end: list[list[float | None]]  # zero bubble: the W op's end (else the backward's end)
    free: list[float]  # per device: when its last op ended
    mem_deltas: list[list[MemDelta]]  # per device
    events: list[Event]

    @classmethod
    def empty(cls, stages: int, devices: int, stream: int) -> _Run:
        """Nothing run yet: every device free at time 0 (int, so Fraction times stay exact)."""
        def slots() -> list[list[float | None]]:
            return [[None] * stream for _ in range(stages)]

        return cls(f_start=slots(), f_end=slots(), f_arrive=slots(), b_end=slots(), b_arrive=slots(), w_end=slots(),
                   free=[0] * devices, mem_deltas=[[] for _ in range(devices)], events=[])


class _Links:
    """Directional device-to-device links (full duplex), each FIFO: a send starts when its tensor
    is ready and the link has finished the previous send."""

    def __init__(self, devices: int, events: list[Event] | None) -> None:
        self.devices = devices
        self.events = events  # None: do not record send events
        self.free: dict[tuple[int, int], float] = {}

    def send(self, src_dev: int, dst_dev: int, ready: float, dur: float, stage: int, mb: int) -> float:
        """When a tensor ready at `ready` on src_dev has arrived at dst_dev (at once on the same device)."""
        if src_dev == dst_dev:
            return ready
        key = (src_dev, dst_dev)
        start = max(ready, self.free.get(key, 0))
        end = start + dur
        self.free[key] = end
        if self.events is not None and dur:
            self.events.append(Event(src_dev, stage, stage // self.devices, mb, "send", start, end, dst_dev))
        return end


def _play(inp: _SimInputs, orders: list[Order], run: _Run, keep_events: bool) -> None:
    """Run every device's order: each device runs its next op once its input has arrived, until all are done.

    One function with the op rules inline, not a helper per op: this loop is the
    search's inner loop and a call per attempted op doubles its time.
    """
    S, K = inp.stages, inp.devices
    fwd, bwd, sends, act, rbytes = inp.fwd, inp.bwd, inp.send, inp.activation_bytes, inp.recompute_bytes
    rec, rec_w = _rerun_before_b(inp), inp.recompute_w
    f_start, f_end, f_arrive, b_end, b_arrive = run.f_start, run.f_end, run.f_arrive, run.b_end, run.b_arrive
    free, mem_deltas, w_end = run.free, run.mem_deltas, run.w_end
    split, wgrad = inp.schedule.splits_backward, inp.wgrad or (0,) * S
    fresh, every = inp.fresh or (0,) * S, inp.update_every  # the first backward of an update writes fresh gradients
    events = run.events if keep_events else None
    send = _Links(K, events).send
    dev = inp.device_of
    waits = inp.receives_wait  # the transfer is played at the consumer (below), not at the producer's end
    tied = {s: g for g in inp.tied for s in g}
    ptr = [0] * K
    kept = 0 if inp.keep_first else -1  # the microbatch recomputation spares (kept whole): the first to go back
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(K):
            order = orders[d]
            while ptr[d] < len(order):
                kind, s, m = order[ptr[d]]
                if kind == "U":  # a tied parameter's update: after every holder's backward of m
                    ends = [b_end[h][m] for h in tied[s]]
                    if any(e is None for e in ends):
                        break
                    end = max(free[d], *cast(list[float], ends))
                    if events is not None and end > free[d]:
                        events.append(Event(d, s, s // K, m, "allreduce", free[d], end))
                elif kind == "W":  # zero bubble: after this stage's B of m, frees m's activations
                    b_done = b_end[s][m]
                    if b_done is None:
                        break
                    start = max(free[d], b_done)
                    if rec_w[s] and events is not None:  # recomputation re-runs the forward for W too (_busy_s)
                        events.append(Event(d, s, s // K, m, "recompute", start, start + rec_w[s]))
                    start += rec_w[s]
                    end = start + wgrad[s] - (fresh[s] if m % every == 0 else 0)
                    w_end[s][m] = end
                    mem_deltas[d].append((end, 0, -(act[s] + rbytes[s])))
                    if events is not None:
                        events.append(Event(d, s, s // K, m, "wgrad", start, end))
                elif kind == "F":
                    ready = 0 if s == 0 else f_arrive[s - 1][m]
                    if ready is None:
                        break
                    start = max(free[d], ready)
                    if waits and s > 0:
                        start = send(dev[s - 1], d, start, sends[s - 1], s - 1, m)
                    end = start + fwd[s]
                    f_start[s][m] = start
                    f_end[s][m] = end
                    f_arrive[s][m] = send(d, dev[s + 1], end, sends[s], s, m) if s + 1 < S and not waits else end
                    mem_deltas[d].append((start, 1, act[s] + (rbytes[s] if m == kept else 0)))
                    if events is not None:
                        events.append(Event(d, s, s // K, m, "fwd", start, end))
                else:
                    forward_end = f_end[s][m]
                    ready = forward_end if s == S - 1 else b_arrive[s + 1][m]
                    if ready is None or forward_end is None:
                        break
                    start = max(free[d], ready, forward_end)
                    if waits and s < S - 1:
                        start = send(dev[s + 1], d, start, sends[s], s + 1, m)
                    whole = not split or kind == "BW"
                    r = inp.recompute[s] if whole else rec[s]
                    if m == kept:  # its activations were kept whole at its forward: nothing to re-run
                        pass
                    elif r or rbytes[s]:
                        mem_deltas[d].append((start, 1, rbytes[s]))
                        if events is not None and r:
                            events.append(Event(d, s, s // K, m, "recompute", start, start + r))
                        start = start + r
                    saved = fresh[s] if whole and m % every == 0 else 0
                    end = start + bwd[s] - (0 if whole else wgrad[s]) - saved
                    b_end[s][m] = end
                    b_arrive[s][m] = send(d, dev[s - 1], end, sends[s - 1], s, m) if s > 0 and not waits else end
                    if whole:
                        w_end[s][m] = end
                        mem_deltas[d].append((end, 0, -(act[s] + rbytes[s])))
                    if events is not None:
                        events.append(Event(d, s, s // K, m, "bwd", start, end))
                        if split and kind == "BW" and wgrad[s]:  # drawn as its two parts, like B then W
                            events[-1].end_s = end - (wgrad[s] - saved)
                            events.append(Event(d, s, s // K, m, "wgrad", end - (wgrad[s] - saved), end))
                free[d] = end
                ptr[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{inp.schedule.name} schedule deadlocked (internal error in the op orders)")


# ---------------------------------------------------------------------------
# Measurements on a finished run


def _device_stages(inp: _SimInputs) -> list[list[int]]:
    """Per device, the virtual stages it runs (model order)."""
    return [device_stages(inp.schedule.name, d, inp.devices, inp.chunks) for d in range(inp.devices)]


def _rerun_before_b(inp: _SimInputs) -> tuple[float, ...]:
    """The re-run before each stage's backward op; under zero bubble, before its split B (none on the first
    stage: ScheduleFacts.b_reruns). A whole backward ("BW") re-runs it on every stage."""
    return tuple(inp.schedule.b_reruns(s) * r for s, r in enumerate(inp.recompute))


def _busy_s(inp: _SimInputs, orders: list[Order]) -> list[float]:
    """Compute time of each device in one iteration of M microbatches (`orders`: the ops `_play` ran).

    With recomputation a backward split into B and W re-runs the forward for each pass (non-reentrant
    checkpointing frees the re-run's tensors after B, so W makes them again: runtime/recompute.py): a B
    (but the first stage's, `_rerun_before_b`) and a whole backward ("BW") once, a W `recompute_w` (once
    per parameter group in torch).
    """
    busy: list[float] = [0] * inp.devices
    fresh_backwards = inp.schedule.fresh_backwards(inp.microbatches)
    split = inp.schedule.splits_backward
    for s in range(inp.stages):
        reruns = 0 if split else (inp.microbatches - (1 if inp.keep_first else 0)) * inp.recompute[s]
        busy[inp.device_of[s]] += inp.microbatches * (inp.fwd[s] + inp.bwd[s]) + reruns
        busy[inp.device_of[s]] -= fresh_backwards * (inp.fresh[s] if inp.fresh else 0)
    if split and (any(inp.recompute) or any(inp.recompute_w)):
        rerun = {"B": _rerun_before_b(inp), "BW": inp.recompute, "W": inp.recompute_w}
        for order in orders:
            for kind, s, m in order:
                if kind in rerun and m < inp.microbatches:
                    busy[inp.device_of[s]] += rerun[kind][s]
    return busy


def _steady_state_s(inp: _SimInputs, b_end: list[list[float]], stream: int) -> float:
    """Without a flush: time for M consecutive microbatches, measured on the last stage (it never
    waits on a warm-up of its own) well inside the stream."""
    M = inp.microbatches
    i1 = stream - 2 * M - inp.devices
    return b_end[inp.stages - 1][i1 + M] - b_end[inp.stages - 1][i1]


def _window_update_s(inp: _SimInputs) -> float:
    """Without a flush, the update once per window of M microbatches (PipeDream-2BW, ICML 2021 §3.1: the
    window's gradients all-reduced across pipeline replicas, then one optimizer step): each device stalls
    for its all-reduce plus its step between the window's last backward and its next op, and the
    devices of a 1F1B pipeline in its steady state wait on each other, so the window lengthens by the
    longest stall. 0 for async PipeDream (its updates are in the stage times)."""
    per_device = [0.0] * inp.devices
    for s in range(inp.stages):
        per_device[inp.device_of[s]] += inp.allreduce[s] + inp.optimizer[s]
    return max(per_device)


def _allreduce_end(inp: _SimInputs, b_end: list[list[float]], pipeline_s: float, events: list[Event] | None) -> float:
    """When the iteration ends: each stage's all-reduce starts after its last backward, one at a time per
    device's comm channel (stages in the order they finish), overlapping with remaining compute; then each
    device steps its stages' optimizers (they need the reduced gradients, and its compute is free by then).
    Appends the all-reduce and optimizer events to `events` unless it is None."""
    K = inp.devices
    iteration_s = pipeline_s
    comm_free: list[float] = [0] * K
    for s in sorted(range(inp.stages), key=lambda s: max(b_end[s])):
        if inp.allreduce[s]:
            d = inp.device_of[s]
            start = max(max(b_end[s]), comm_free[d])
            comm_free[d] = start + inp.allreduce[s]
            iteration_s = max(iteration_s, comm_free[d])
            if events is not None:
                events.append(Event(d, s, s // K, -1, "allreduce", start, start + inp.allreduce[s]))
    for d, mine in enumerate(_device_stages(inp)):
        t = max([comm_free[d], *(max(b_end[s]) for s in mine)])
        for s in mine:
            if inp.optimizer[s]:
                if events is not None:
                    events.append(Event(d, s, s // K, -1, "optimizer", t, t + inp.optimizer[s]))
                t += inp.optimizer[s]
        iteration_s = max(iteration_s, t)
    return iteration_s


def _memory_timeline(
    static_bytes: Sequence[int], mem_deltas: list[list[MemDelta]]
) -> tuple[list[tuple[float, int, int]], list[int]]:
    """(time, device, bytes in use) in time order, and each device's peak. Frees before allocations at
    the same instant, so a microbatch handing its memory to the next does not count both."""
    timeline: list[tuple[float, int, int]] = []
    peaks = []
    for d, deltas in enumerate(mem_deltas):
        use = static_bytes[d]
        peak = use
        timeline.append((0, d, use))
        for t, _, delta in sorted(deltas, key=lambda x: (x[0], x[1])):
            use += delta
            peak = max(peak, use)
            timeline.append((t, d, use))
        peaks.append(int(peak))
    timeline.sort(key=lambda x: (x[0], x[1]))
    return timeline, peaks


def _peak_count(f_start: list[list[float]], b_end: list[list[float]], stages: Iterable[int]) -> int:
    """Most microbatches whose forward on one of `stages` has started and backward not ended, at once."""
    stages = list(stages)
    marks = sorted([(f, 1) for s in stages for f in f_start[s]] + [(b, 0) for s in stages for b in b_end[s]])
    n = best = 0
    for _, up in marks:
        n += 1 if up else -1
        best = max(best, n)
    return best


def _bubbles(busy: list[float], pipeline_s: float, devices: int) -> tuple[float, float]:
    """(idle share of the devices' time, Megatron's bubble overhead pipeline_s / busiest compute - 1)."""
    ideal = max(busy) if max(busy) else 1
    if pipeline_s:
        return 1 - sum(busy) / (devices * pipeline_s), pipeline_s / ideal - 1
    return 0, 0


# ---------------------------------------------------------------------------
# Simulation


def simulate(
    schedule: str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_s: Sequence[float],
    microbatches: int,
    *,
    chunks: int = 1,
    static_bytes: Sequence[int] | None = None,
    activation_bytes_per_mb: Sequence[int] | None = None,
    allreduce_s: Sequence[float] | None = None,
    recompute_s: Sequence[float] | None = None,
    recompute_bytes: Sequence[int] | None = None,
    optimizer_s: Sequence[float] | None = None,
    wgrad_s: Sequence[float] | None = None,
    tied_stages: Sequence[Sequence[int]] | None = None,
    fresh_grad_s: Sequence[float] | None = None,
    recompute_w_s: Sequence[float] | None = None,
    recompute_last: bool = True,
    receives_wait: bool = False,
    keep_events: bool = True,
) -> SimResult:
    """Play a pipeline schedule out and measure time, bubbles and memory.

    All lists are per (virtual) stage in model order, except `static_bytes`,
    which is per device. `send_s[i]` is the time to move one microbatch's
    tensors across boundary i (stage i to i+1; its gradient goes back in the
    same time); a list of K-1 entries is accepted too. Times may be any
    numbers supporting + and max (Fractions give exact results in tests).
    `optimizer_s[i]` is stage i's optimizer step, run by its device after the
    stage's all-reduce (flushing schedules; without a flush it belongs in bwd_s).
    `wgrad_s[i]` is the weight-gradient part of bwd_s[i], for a schedule that splits backwards (zero
    bubble; default half of bwd_s, see _wgrad_times).
    `tied_stages`: groups of stages holding one tied parameter; without a flush each holder's update waits
    for every holder's backward of the same microbatch (PipeDream; 2BW: of the window's last), then all go on.
    `fresh_grad_s[i]`: what stage i's first backward after its gradients were cleared saves (part of its W under
    zero bubble): its first of the iteration, every one for async PipeDream, a window's first for PipeDream-2BW.
    `recompute_w_s[i]`: with recomputation under zero bubble, the forward re-runs each W of stage i makes (torch
    re-runs it once per parameter group: costmodels/recompute.weight_grad_passes); default `recompute_s`, one.
    `recompute_last=False`: recomputation spares one microbatch per stage, the first whose backward runs, which keeps
    its activations whole (torchgpipe's default, `GPipe(checkpoint="except_last")` in its API docs: it runs the
    backwards last microbatch first, so the one it does not checkpoint, the last, is the first to go back; in the
    orders here backwards run first microbatch first, so microbatch 0 is spared and held whole from its forward,
    more memory than torchgpipe holds). Flushing schedules with whole backwards only. pipeplan's runtime re-runs
    every microbatch, so its plans never set it; it models frameworks that do.
    `receives_wait=True`: a tensor crosses its link only once the receiving device reaches the op that needs it,
    and that op waits for it (torch.distributed.pipelining's receives, module docstring); False: from the
    producer's end.
    `keep_events=False` skips building the Event list, the memory timeline and the peaks (the search's fast path,
    whose predictions read the times only: their memory is costmodels/memory.py's).
    """
    inp = _validate(schedule, fwd_s, bwd_s, send_s, microbatches, chunks, static_bytes, activation_bytes_per_mb,
                    allreduce_s, recompute_s, recompute_bytes, optimizer_s, wgrad_s, tied_stages, fresh_grad_s,
                    recompute_w_s, recompute_last, receives_wait)
    stream = _stream_length(inp)
    run = _Run.empty(inp.stages, inp.devices, stream)
    orders = _update_points(inp, stream)
    _play(inp, orders, run, keep_events)
    # every op has run, so every slot is filled
    f_start = cast(list[list[float]], run.f_start)
    b_end = cast(list[list[float]], run.w_end)  # a stage's backward (and its gradients) end with its W
    events = run.events

    if inp.schedule.flushes:
        pipeline_s = max(max(row) for row in b_end)
        iteration_s = _allreduce_end(inp, b_end, pipeline_s, events if keep_events else None)
    else:
        pipeline_s = _steady_state_s(inp, b_end, stream)
        iteration_s = pipeline_s + _window_update_s(inp)
    # the search's fast path reads the time only (its memory is costmodels/memory.py's): no timeline, no peaks
    timeline, peaks = _memory_timeline(inp.static_bytes, run.mem_deltas) if keep_events else ([], [])
    S, K = inp.stages, inp.devices
    busy = _busy_s(inp, orders)
    bubble_fraction, bubble_overhead = _bubbles(busy, pipeline_s, K)
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
        inflight_peak=[_peak_count(f_start, b_end, [s]) for s in range(S)] if keep_events else [],
        inflight_device_peak=[_peak_count(f_start, b_end, mine) for mine in _device_stages(inp)] if keep_events else [],
    )
