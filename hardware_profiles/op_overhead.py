"""The runtime's cost per pipeline op, measured on a real two-rank pipeline (`profiles calibrate`).

Compute times and link times do not add up to a pipeline's iteration on this
kind of machine: around every forward or backward of a microbatch,
torch.distributed.pipelining does Python bookkeeping, posts its sends and
receives and waits on them; gloo copies every tensor through the kernel's
loopback socket on the same cores that compute, and a tensor arriving while
the receiving core computes waits for that core's gloo thread. On a 2-stage
GPT example that was ~1 ms per op, 8-15% of the step, which no FLOP or
bandwidth figure contains.

So we run (pipeline_ops.py) the schedules the runtime uses on two processes with
identical MLP stages, each pinned to a core as the runtime's ranks are: GPipe, 1F1B
and ZB-H1 (one stage a rank), interleaved 1F1B (two stages a rank, r and r + 2; and
four, for the fixed term of plans with more stages a device: MORE_CHUNKS) and ZB-V
(two stages a rank in a V, r and 3 - r: the first and last stage on rank 0, the turn
from stage 1 to 2 on rank 1 with no transfer), each placed as the
runtime places it (pipeplan.schedules.stage_device), under
torch.distributed.pipelining, and PipeDream's asynchronous 1F1B the way
runtime/pipedream.py runs it (its own loop and messages, no flush; PipeDream-2BW
runs the same). We record when every op starts and ends,
and charge each op the time between "could start" and "started": ready = max(end of
the rank's previous op, end of the op it depends on + the idle link's transfer time
when that op ran on the other rank). That gap grows with the tensors the op sends
and receives, so three stage shapes with the same compute and activations of
0.25, 1 and 2 MiB are run, and per schedule the gaps are fitted (least squares) as
`fixed + per_byte x bytes the op sends and receives` (per shape, the median over
steps of a step's mean gap, as the runtime reports its median step). It also grows with the tensors a cut carries:
torch posts one gloo message per tensor, and skip connections make cuts of several
(examples/unet.py's up to 4). So the larger shape runs again with its cut sent as 4
tensors of the same bytes, and what that adds is charged per extra tensor (a probe
by hand, 1F1B on 2 ranks: ~0.45 ms a step for each extra tensor a rank sends or
receives, benchmarks/RESULTS.md). The schedule simulator adds that to every forward
and backward (planner/predict.py; a zero-bubble W's gap, ZB-H1's and ZB-V's, is
charged to the forwards and backwards, which is where the simulator adds it).

gloo's threads copy messages on the core that computes (a rank and its threads are
pinned to one core), so an op also runs longer by the CPU they take while it runs.
That part is read off CPU clocks, not wall time: per op, the process's CPU time less
the computing thread's (`stolen_us` in the calibration detail; pipeline_ops.cpu_clocks),
fitted per schedule like the gap and charged with it. Other tenants of the host do not
move CPU clocks, so it repeats between calibrations (interleaved, 1 MiB messages:
250 and 275 µs per op; 1F1B 25-44 µs), where the wall-clock excess over the same ops
timed alone (`excess_us`, recorded, not charged) swung examples/gpt.py's interleaved
prediction by +-20%. Measured in examples/gpt.py's runs (by hand, 2 rounds, CPU clocks
around every op): gloo's threads took 36-43 ms a step from interleaved's ops, 16-18 ms
from ZB-V's, 14-15 ms from DualPipeV's and 3-4 ms from 1F1B's (ops ~450 ms a step):
two stages a rank send and receive three times the messages of one, and mostly while
the rank computes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from pipeplan.schedules import ScheduleName, facts

WIDTH = 512
# name: (rows per microbatch, layers per stage), a layer Linear(WIDTH) + ReLU, or with a HIDDEN width a bottleneck
# Linear(WIDTH, hidden) + ReLU + Linear(hidden, WIDTH) + ReLU. Equal compute (2^27 multiply-adds a forward, ~3 ms
# at ~100 GFLOP/s per core); activations of 256 KiB, 1 MiB and 2 MiB; "split" is "large" with its cut sent as
# TENSORS["split"] tensors of a quarter each (the same bytes), as a cut that skip connections cross is.
SHAPES = {"small": (128, 4), "large": (512, 1), "split": (512, 1), "wide": (1024, 1)}
HIDDEN: Final[dict[str, int]] = {"wide": 128}
TENSORS: Final[dict[str, int]] = {"small": 1, "large": 1, "split": 4, "wide": 1}
# The one-tensor shapes the per-byte line is fitted through (least squares). With "small" and "large" alone the
# line spanned 0.75 MiB: GPipe's slope read 111 and 0 µs/MiB in two calibrations of one runtime benchmark, where a
# probe over 0.25-4 MiB put it at ~185; GPipe on examples/unet.py (a 1.75 MiB cut) was that benchmark's one miss
# (benchmarks/RESULTS.md).
LINE_SHAPES: Final[tuple[str, ...]] = ("small", "large", "wide")
MICROBATCHES = 8
STEPS, WARMUP = 5, 2
# Every shape and schedule is run this many times, the rounds one after another over all of them, so that the
# medians over steps span the whole measurement: run once each, a shape's few steps all fell within a fraction of a
# second, and a passing burst of the host's other tenants moved one schedule's fitted terms 2-8x between
# calibrations (1F1B per extra tensor 55 and 434 µs, GPipe fixed 332 and 102 µs, runtime_bench 2026-11-27). In 2
# rounds of 3 timed steps, three calibrations in a row gave 290, 385 and 392 µs and 466, 396 and 438 µs; the
# phase took ~30 s instead of ~20 (~38 s since the "wide" shape). A calibration asked for less than
# TWO_ROUNDS_BUDGET_S (`--budget-s`) runs one round: ~25 s sooner, its op overheads the noisier for it.
ROUNDS = 2
TWO_ROUNDS_BUDGET_S = 30.0
# The schedules measured here: GPipe, 1F1B and ZB-H1 (one stage a rank), interleaved 1F1B (two a rank: twice
# the ops, each posting its own sends and receives; taking 1F1B's figure for it left examples/gpt.py's
# interleaved plans 16-20% slower than predicted), ZB-V (two a rank in a V, the turn a hand-over on one rank,
# split backwards: with interleaved's figure its examples/gpt.py iteration ran ~12% slower than predicted,
# benchmarks/RESULTS.md) and asynchronous PipeDream (the runtime's own loop and messages, not
# torch's; its figure had been 1F1B's). The others take the nearest measured one (HardwareProfile.overhead_for:
# DualPipeV ZB-V's).
TORCH_SCHEDULES: Final[tuple[ScheduleName, ...]] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SCHEDULES: Final[tuple[ScheduleName, ...]] = (*TORCH_SCHEDULES, "pipedream")
assert all(facts(s).torch_class is not None for s in TORCH_SCHEDULES) and facts("pipedream").torch_class is None
# stages per rank; ZB-V's is the only count its torch class runs (ScheduleFacts.fixed_chunks)
CHUNKS: Final[dict[str, int]] = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2, "pipedream": 1}
assert CHUNKS["zb-v"] == facts("zb-v").fixed_chunks
# A rank holding more stages pays more an op than `CHUNKS` shows: interleaved 1F1B on these ranks (the "small" shape,
# benchmarks/chunks_probe.py, two runs, benchmarks/RESULTS.md) left 339-711 µs an op between its ops with 2 stages a
# rank, 638-971 with 4 and 823-1427 with 8, at 8 and at 2 microbatches; the messages an op (1.5, 1.75, 1.875) explain
# a small part of it: an op with two messages after one with two cost 485-995 µs at 2 stages a rank, 820-1161 at 4.
# examples/wide_mlp.py's plan with 4 stages a device (the search's chunks are 2, 4 and 8,
# planner/configs.CHUNK_CHOICES) ran 12-29% slower than its prediction at 2 stages' figure. So interleaved runs at
# MORE_CHUNKS stages a rank as well, at M = MICROBATCHES as everywhere here, for the fixed term at that count
# (`chunks_overhead_s`); 8 stages a rank take it too. One shape, not the line's three: the growth read alike at 1 MiB
# (large shape, M = 8: 577 -> 838 µs, 1.45x; small 1.38-1.57x), and the phase adds ~6 s to calibrate. Not at M = 4,
# which would halve that: the probe read 4 stages a rank at 646 µs an op there against 830 at M = 8 (2 stages a rank
# 403 and 528), and the 2-stage figure it is set against is measured at M = 8.
MORE_CHUNKS: Final = 4
MORE_CHUNKS_SCHEDULES: Final[tuple[ScheduleName, ...]] = ("interleaved",)
MORE_CHUNKS_SHAPES: Final[tuple[str, ...]] = ("small",)
SOLO = "solo"  # the key of the ops timed outside any pipeline (pipeline_ops.solo_events)
# A plan of one stage (one device, or data-parallel replicas of one stage) runs GPipe's or 1F1B's loop with no
# messages (runtime/worker.build_schedule). Charged the two-rank pipeline's fixed term, which holds posting and
# waiting on gloo, tests/runtime_model_unet.py's one-stage 1F1B plan (two ops, 2 ms a step) read 6-18% under its
# prediction in every defaults-only run (benchmarks/RESULTS.md); its loop's own time was ~100 µs an op against
# the 193 µs charged. So those loops are timed with one stage on each rank alone (pipeline_ops._alone_steps).
ALONE_SCHEDULES: Final[tuple[ScheduleName, ...]] = ("gpipe", "1f1b")
ALONE_SHAPES: Final[tuple[str, ...]] = ("small", "large")
STEP = "step"  # the kind of the event that spans a one-stage loop's whole `schedule.step`

Event: TypeAlias = tuple[str, int, int, float, float, float]
"""(kind "F"/"B"/"W" (or STEP), stage, microbatch, start_s, end_s, stolen_s), perf_counter clock (shared by processes); "B"
is a zero-bubble schedule's input-gradient pass, "W" its weight-gradient pass. `stolen_s`: CPU time the process's
other threads (gloo's, copying messages) used while the op ran (`time.process_time` less `time.thread_time`)."""


def multiply_adds(shape: str) -> int:
    """A stage's forward multiply-adds per microbatch at `shape` (the shapes keep it equal)."""
    rows, layers = SHAPES[shape]
    hidden = HIDDEN.get(shape)
    return rows * layers * (WIDTH * WIDTH if hidden is None else 2 * WIDTH * hidden)


def stage_text(shape: str) -> str:
    """How the calibration detail describes a shape's stage."""
    rows, layers = SHAPES[shape]
    hidden = HIDDEN.get(shape)
    layer = f"Linear({WIDTH}) + ReLU" if hidden is None else f"(Linear({WIDTH}, {hidden}) + ReLU + Linear({hidden}, " \
        f"{WIDTH}) + ReLU)"
    return f"{layers} x {layer}, {rows}-row microbatches, the cut as {TENSORS[shape]} tensor(s), M={MICROBATCHES}"


assert len({multiply_adds(s) for s in SHAPES}) == 1, "the shapes' stages must compute alike"


def message_bytes(shape: str) -> int:
    """The activation (and its gradient) one op of the 2-stage pipeline sends or receives."""
    return SHAPES[shape][0] * WIDTH * 4


def depends_on(kind: str, stage: int, mb: int, stages: int) -> tuple[str, int, int] | None:
    """The op (kind, stage, microbatch) an op waits for besides its rank's previous one: a forward for the
    previous stage's forward, a backward for the next stage's backward (the last stage's for its own forward), a
    zero-bubble W for its own B (on the same rank). Placement-free: whether the dependency crossed ranks is
    `op_gaps_s`'s question (the V's stages 1 and 2 share a rank)."""
    if kind == "W":
        return ("B", stage, mb)
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    return ("B", stage + 1, mb) if stage < stages - 1 else ("F", stage, mb)


def op_gaps_s(first: list[Event], second: list[Event], transfer_s: float) -> list[tuple[str, float]]:
    """Per op of one step of a pipeline on 2 ranks: (its kind, start - the time it could have started (>= 0)).

    Every op waits for its rank's previous op and for the op it depends on (`depends_on`); a dependency on
    the other rank includes the transfer (`transfer_s`), which the simulator already charges to the link. Each
    stage's rank is read off the events, so any placement works: round-robin, or ZB-V's V, where the last
    stage is on rank 0 and stage 1 hands its output to stage 2 on the same rank (no transfer).
    """
    return [(op[0], gap) for op, _, gap in op_gaps(first, second, transfer_s)]


def op_gaps(first: list[Event], second: list[Event], transfer_s: float) -> list[tuple[Event, Event | None, float]]:
    """`op_gaps_s` with each gap's op and its rank's previous op (None for a rank's first), for a reader that
    sorts the gaps by more than the op's kind (benchmarks/chunks_probe.py)."""
    end, rank_of = {}, {}
    for rank, events in ((0, first), (1, second)):
        for kind, stage, mb, _, t1, _ in events:
            end[(kind, stage, mb)] = t1
            rank_of[stage] = rank
    stages = len(rank_of)
    gaps: list[tuple[Event, Event | None, float]] = []
    for rank, events in ((0, first), (1, second)):
        prev: Event | None = None
        for op in events:
            kind, stage, mb, t0 = op[:4]
            dep = depends_on(kind, stage, mb, stages)
            ready = [prev[4]] if prev is not None else []
            if dep is not None and dep in end:
                ready.append(end[dep] + (transfer_s if rank_of[dep[1]] != rank else 0.0))
            if ready:
                gaps.append((op, prev, max(0.0, t0 - max(ready))))
            prev = op
    return gaps


def shape_schedules(shape: str) -> tuple[ScheduleName, ...]:
    """The schedules run at `shape`: all of them with one tensor at the cut; the torch schedules only with several
    (PipeDream's own loop sends each tensor of a cut as its own message as well, and takes their figure,
    `HardwareProfile.overhead_for`)."""
    return SCHEDULES if TENSORS[shape] == 1 else TORCH_SCHEDULES


def messages_per_op(first: list[Event], second: list[Event]) -> float:
    """The mean number of messages a forward or backward sends or receives in this step: one per neighbouring stage
    on the other rank (a cut between two stages of one rank, the turn of a V, is a hand-over in memory)."""
    per_stage = stage_messages(first, second)
    counts = [per_stage[stage] for kind, stage, *_ in first + second if kind != "W"]
    return sum(counts) / max(1, len(counts))


def stage_messages(first: list[Event], second: list[Event]) -> dict[int, int]:
    """Per stage of this step, the messages each of its forwards and backwards sends or receives: one per
    neighbouring stage on the other rank."""
    rank_of = {stage: rank for rank, events in enumerate((first, second)) for _, stage, *_ in events}
    last = max(rank_of)
    return {stage: sum(1 for n in (stage - 1, stage + 1) if 0 <= n <= last and rank_of[n] != rank)
            for stage, rank in rank_of.items()}


def op_overhead_s(
    per_rank: list[dict[str, list[list[Event]]]], transfer_s: Callable[[int], float]
) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, Any]]:
    """Per schedule: (fixed seconds per op, seconds per byte the op sends or receives, seconds per tensor its
    messages carry beyond one each), and the raw figures.

    An op's charge is its gap (`op_gaps_s`) plus the CPU that gloo's threads took from it (`stolen_s`), per
    forward or backward (per shape the median over steps of a step's sum over its forwards and backwards,
    `_charge_parts`): a zero-bubble W's gap and theft are charged to them, where the simulator adds them.
    `transfer_s(nbytes)` is the idle link's time for a message. Every op of the 2-stage pipeline (and of ZB-V's V:
    its hand-over from stage 1 to 2 stays on the rank) sends or receives exactly one activation or gradient, an op
    of interleaved's middle stages two, so the one-tensor shapes' charges (LINE_SHAPES) give a line through (the
    bytes an op sends and receives on average, charge) (`least_squares_line`), the bytes the prediction charges
    (`HardwareProfile.overhead_for`; fitted against one message's bytes, interleaved's slope read 1.5x what an op
    pays, and examples/unet.py's interleaved plan, cuts of 1-2 MiB, ran 12-18% faster than predicted). The
    "split" shape sends the large shape's bytes as several tensors: what it is charged beyond the large shape, over
    the extra tensors of an op's messages (`messages_per_op`), is the per-tensor term (clamped at 0 too). The detail
    also keeps how much longer the ops ran than alone (`pipeline_ops.solo_events`; the module doc says why that
    wall-clock figure is not what is charged).
    """
    fixed: dict[str, float] = {}
    per_byte: dict[str, float] = {}
    per_tensor: dict[str, float] = {}
    detail: dict[str, Any] = {"stages": {s: stage_text(s) for s in SHAPES}}
    for name in SCHEDULES:
        charge, moved = {}, {}
        for shape in SHAPES:
            if name not in shape_schedules(shape):
                continue
            gap_s, stolen_s, excess_s, compute_s = _charge_parts(per_rank, shape, name,
                                                                 transfer_s(message_bytes(shape)))
            charge[shape] = gap_s + stolen_s
            moved[shape] = messages_per_op(*_steps(per_rank, f"{shape}/{name}")[0])
            detail[f"{shape}_{name}"] = {"gap_us": round(gap_s * 1e6, 1), "stolen_us": round(stolen_s * 1e6, 1),
                                          "excess_us": round(excess_s * 1e6, 1),
                                          "compute_per_op_ms": round(compute_s * 1e3, 3),
                                          "messages_per_op": round(moved[shape], 3)}
        # against the bytes an op sends and receives in all, as the prediction charges them (overhead_for): one
        # message's bytes times the messages an op has (1.5 in interleaved's 4 stages on 2 ranks, where the middle
        # stages' ops both receive and send; 1 in the others)
        fixed[name], per_byte[name] = least_squares_line([(message_bytes(s) * moved[s], charge[s])
                                                          for s in LINE_SHAPES])
        if "split" in charge:
            extra = (TENSORS["split"] - 1) * moved["split"]
            per_tensor[name] = max(0.0, (charge["split"] - charge["large"]) / extra)
    return fixed, per_byte, per_tensor, detail


def chunks_shape(shape: str) -> str:
    """The shape part of the key of `shape`'s pipelines run at MORE_CHUNKS stages a rank (run_pipeline's output is
    keyed "shape/schedule")."""
    return f"{shape}@{MORE_CHUNKS}"


def chunks_overhead_s(per_rank: list[dict[str, list[list[Event]]]], transfer_s: Callable[[int], float],
                      per_byte: dict[str, float]) -> tuple[dict[str, float], dict[str, Any]]:
    """Per schedule of MORE_CHUNKS_SCHEDULES: the fixed seconds an op with MORE_CHUNKS stages a rank (the term
    `op_overhead_s` gives at CHUNKS), and the raw figures. Each MORE_CHUNKS_SHAPES shape's charge (gap + stolen CPU,
    as `op_overhead_s` takes it) less the schedule's per-byte term at that pipeline's bytes an op (the slope
    measured at CHUNKS); the mean over the shapes, clamped at 0."""
    fixed: dict[str, float] = {}
    detail: dict[str, Any] = {}
    for name in MORE_CHUNKS_SCHEDULES:
        terms = []
        for shape in MORE_CHUNKS_SHAPES:
            key = chunks_shape(shape)
            if f"{key}/{name}" not in per_rank[0]:
                continue
            gap_s, stolen_s, _, compute_s = _charge_parts(per_rank, key, name, transfer_s(message_bytes(shape)))
            moved = messages_per_op(*_steps(per_rank, f"{key}/{name}")[0])
            terms.append(gap_s + stolen_s - per_byte.get(name, 0.0) * message_bytes(shape) * moved)
            detail[f"{key}_{name}"] = {"gap_us": round(gap_s * 1e6, 1), "stolen_us": round(stolen_s * 1e6, 1),
                                       "compute_per_op_ms": round(compute_s * 1e3, 3),
                                       "messages_per_op": round(moved, 3)}
        if terms:
            fixed[name] = max(0.0, statistics.mean(terms))
    return fixed, detail


def alone_key(shape: str, name: str) -> str:
    """The key of the one-stage loop's steps at `shape` under `name` (pipeline_ops.run_pipeline's output)."""
    return f"{shape}/{name}/alone"


def alone_overhead_s(per_rank: list[dict[str, list[list[Event]]]]) -> dict[str, float]:
    """Per schedule of ALONE_SCHEDULES, the seconds per op its one-stage loop spends outside the forwards and
    backwards: per measured step (its STEP event's span - the ops' time) / ops, the median over both ranks' steps
    at every ALONE_SHAPES shape. Why per step and not op_gaps_s's gaps: with no other rank nothing else delays an
    op, and the step's start (splitting the batch) and end (scaling the gradients) are the loop's too; the
    simulator adds the charge to every op of a one-stage plan (HardwareProfile.overhead_for)."""
    out: dict[str, float] = {}
    for name in ALONE_SCHEDULES:
        per_op = []
        for rank in per_rank:
            for shape in ALONE_SHAPES:
                for events in rank.get(alone_key(shape, name), []):
                    ops = [e for e in events if e[0] != STEP]
                    span = sum(e[4] - e[3] for e in events if e[0] == STEP)
                    per_op.append(max(0.0, span - sum(e[4] - e[3] for e in ops)) / max(1, len(ops)))
        if per_op:
            out[name] = statistics.median(per_op)
    return out


def least_squares_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (bytes, charge), each clamped at 0: a noisy run may
    make larger messages look cheaper (slope 0: the intercept is then the mean charge)."""
    mean_b = statistics.mean(b for b, _ in points)
    mean_g = statistics.mean(g for _, g in points)
    slope = sum((b - mean_b) * (g - mean_g) for b, g in points) / sum((b - mean_b) ** 2 for b, _ in points)
    slope = max(0.0, slope)
    return max(0.0, mean_g - slope * mean_b), slope


def _charge_parts(per_rank: list[dict[str, list[list[Event]]]], shape: str, name: str,
                  transfer_s: float) -> tuple[float, float, float, float]:
    """(gap, stolen CPU, mean time beyond the solo ops, mean op time), per forward or backward of `name` at
    `shape`."""
    solo_key = f"{shape}/{SOLO}"
    solo = [{kind: statistics.mean(t1 - t0 for k, _, _, t0, t1, _ in rank[solo_key][0] if k == kind)
             for kind in "FB"} for rank in per_rank] if solo_key in per_rank[0] else None
    step_gaps: list[float] = []
    step_stolen: list[float] = []
    durations: list[float] = []
    excess, ops = 0.0, 0
    for a, b in _steps(per_rank, f"{shape}/{name}"):
        gaps = op_gaps_s(a, b, transfer_s)
        step_gaps.append(sum(g for _, g in gaps) / max(1, sum(1 for kind, _ in gaps if kind != "W")))
        step_stolen.append(sum(e[5] for e in a + b) / max(1, sum(1 for e in a + b if e[0] != "W")))
        for rank, events in enumerate((a, b)):
            for kind, _, _, t0, t1, _ in events:
                durations.append(t1 - t0)
                excess += (t1 - t0) - (solo[rank].get(kind, 0.0) if solo else t1 - t0)  # a W: all of it
                ops += kind != "W"
    # The runtime reports the median step (runtime/report.py), so a step whose ops met a hiccup of the OS or of
    # gloo's threads (single gaps of 5-18 ms here, against a typical 0.2-1 ms) is not what it measures: the
    # charge is the median over steps of each step's mean gap. The mean over all ops swung 2-10x between
    # calibrations with one such hiccup in or out.
    return (statistics.median(step_gaps), statistics.median(step_stolen), excess / ops,
            statistics.mean(durations))


def _steps(per_rank: list[dict[str, list[list[Event]]]], key: str) -> list[tuple[list[Event], list[Event]]]:
    """Both ranks' events of `key`, step by step (both record the same steps, pipeline_ops.run_pipeline); the
    asynchronous loop, which has no steps, records one list per run, each cut here into runs of MICROBATCHES
    microbatches, as long as a flushing schedule's step."""
    first, second = per_rank[0][key], per_rank[1][key]
    if key.rsplit("/", 1)[-1] in TORCH_SCHEDULES:
        return list(zip(first, second, strict=True))
    out = []
    for a, b in zip(first, second, strict=True):
        runs = sorted({e[2] // MICROBATCHES for e in a + b})
        out += [([e for e in a if e[2] // MICROBATCHES == r], [e for e in b if e[2] // MICROBATCHES == r])
                for r in runs]
    return out
