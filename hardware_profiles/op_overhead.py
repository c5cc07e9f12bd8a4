"""The runtime's cost per pipeline op, measured on a real two-rank pipeline (`profiles calibrate`).

Compute times and link times do not add up to a pipeline's iteration on this
kind of machine: around every forward or backward of a microbatch,
torch.distributed.pipelining does Python bookkeeping, posts its sends and
receives and waits on them; gloo copies every tensor through the kernel's
loopback socket on the same cores that compute, and a tensor arriving while
the receiving core computes waits for that core's gloo thread. On a 2-stage
GPT example that was ~1 ms per op, 8-15% of the step, which no FLOP or
bandwidth figure contains.

So we run the schedules the runtime uses (GPipe and 1F1B, M = 8, one stage a
rank; interleaved 1F1B with two stages a rank, r and r + 2, as the runtime places
them) on two processes with identical MLP stages, record when every op starts and
ends, and charge each op the time between "could start" and "started": ready =
max(end of the rank's previous op, end of the op it depends on + the idle link's
transfer time when that op ran on the other rank). That gap grows with the tensors the op sends and
receives, so two stage shapes with the same compute but 4x different
activations are run, and per schedule the gaps are fitted as
`fixed + per_byte x bytes the op sends and receives`. The schedule simulator adds
that to every op (planner/predict.py). Both ranks are pinned to a core each, as
the runtime's are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from pipeplan.schedules import ScheduleName, facts

WIDTH = 512
# name: (rows per microbatch, Linear(WIDTH) + ReLU layers per stage). Equal compute (512 row-layers,
# ~3 ms forward at ~100 GFLOP/s per core); activations of 256 KiB and 1 MiB.
SHAPES = {"small": (128, 4), "large": (512, 1)}
MICROBATCHES = 8
STEPS, WARMUP = 6, 2
# The schedules measured here: GPipe and 1F1B (one stage a rank) and interleaved 1F1B (two a rank: twice the
# ops, each posting its own sends and receives; taking 1F1B's figure for it left examples/gpt.py's interleaved
# plans 16-20% slower than predicted). The others take 1F1B's (HardwareProfile.overhead_for).
SCHEDULES: Final[tuple[ScheduleName, ...]] = ("gpipe", "1f1b", "interleaved")
assert all(facts(s).torch_class is not None for s in SCHEDULES)
CHUNKS: Final[dict[str, int]] = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # stages per rank

Event: TypeAlias = tuple[str, int, int, float, float]
"""(kind "F"/"B", stage, microbatch, start_s, end_s), perf_counter clock (shared by processes)."""


def message_bytes(shape: str) -> int:
    """The activation (and its gradient) one op of the 2-stage pipeline sends or receives."""
    return SHAPES[shape][0] * WIDTH * 4


def run_pipeline(rank: int) -> dict[str, list[list[Event]]]:
    """Run every (shape, schedule) on an initialised 2-rank gloo group; this rank's events per measured step,
    keyed "shape/schedule"."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    out: dict[str, list[list[Event]]] = {}
    for shape, (rows, layers) in SHAPES.items():
        for name in SCHEDULES:
            torch.manual_seed(rank)
            n_stages = 2 * CHUNKS[name]
            events: list[Event] = []
            stages: list[Any] = []
            for index in range(rank, n_stages, 2):  # stage s on rank s % 2 (runtime/worker.stage_ranks)
                module = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
                stage = PipelineStage(module, index, n_stages, torch.device("cpu"))
                fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

                def timed(fn: Callable[..., Any], kind: str, index: int = index,
                          events: list[Event] = events) -> Callable[..., Any]:
                    def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
                        t0 = time.perf_counter()
                        result = fn(chunk, *args, **kwargs)
                        events.append((kind, index, int(chunk), t0, time.perf_counter()))
                        return result
                    return run

                # Instance attributes shadowing torch's methods, to time each call (mypy forbids assigning to a method).
                stage.forward_one_chunk = timed(fwd, "F")  # type: ignore[method-assign]
                stage.backward_one_chunk = timed(bwd, "B")  # type: ignore[method-assign]
                stages.append(stage)
            loss = lambda output, target: output.sum()  # noqa: E731
            if name == "interleaved":
                schedule: Any = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss)
            else:
                schedule = (Schedule1F1B if name == "1f1b" else ScheduleGPipe)(stages[0], MICROBATCHES, loss_fn=loss)
            x = torch.randn(rows * MICROBATCHES, WIDTH)
            steps = []
            for i in range(STEPS):
                dist.barrier()
                events.clear()
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=torch.zeros(rows * MICROBATCHES))
                if i >= WARMUP:
                    steps.append(list(events))
            out[f"{shape}/{name}"] = steps
    return out


def depends_on(kind: str, stage: int, mb: int, stages: int) -> tuple[str, int, int] | None:
    """The op (kind, stage, microbatch) an op waits for besides its rank's previous one: a forward for the
    previous stage's forward, a backward for the next stage's backward (the last stage's for its own forward)."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    return ("B", stage + 1, mb) if stage < stages - 1 else ("F", stage, mb)


def op_gaps_s(first: list[Event], second: list[Event], transfer_s: float) -> list[float]:
    """Per op of one step of a pipeline on 2 ranks: start - the time it could have started (>= 0).

    Every op waits for its rank's previous op and for the op it depends on (`depends_on`); a dependency on
    the other rank includes the transfer (`transfer_s`), which the simulator already charges to the link.
    """
    end, rank_of = {}, {}
    for rank, events in ((0, first), (1, second)):
        for kind, stage, mb, _, t1 in events:
            end[(kind, stage, mb)] = t1
            rank_of[stage] = rank
    stages = len(rank_of)
    gaps = []
    for rank, events in ((0, first), (1, second)):
        prev = None
        for kind, stage, mb, t0, t1 in events:
            dep = depends_on(kind, stage, mb, stages)
            ready = [prev] if prev is not None else []
            if dep is not None and dep in end:
                ready.append(end[dep] + (transfer_s if rank_of[dep[1]] != rank else 0.0))
            if ready:
                gaps.append(max(0.0, t0 - max(ready)))
            prev = t1
    return gaps


def op_overhead_s(
    per_rank: list[dict[str, list[list[Event]]]], transfer_s: Callable[[int], float]
) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    """Per schedule: (fixed seconds per op, seconds per byte the op sends or receives), and the raw figures.

    `transfer_s(nbytes)` is the idle link's time for a message. Every op of the
    2-stage pipeline sends or receives exactly one activation or gradient, so the
    two shapes' mean gaps give a line through (bytes, gap); its parts are clamped
    at 0 (a noisy run may make the larger messages look cheaper).
    """
    fixed: dict[str, float] = {}
    per_byte: dict[str, float] = {}
    detail: dict[str, Any] = {
        "stages": {s: f"{layers} x Linear({WIDTH}) + ReLU, {rows}-row microbatches, M={MICROBATCHES}"
                   for s, (rows, layers) in SHAPES.items()}}
    for name in SCHEDULES:
        points = []
        for shape in SHAPES:
            nbytes = message_bytes(shape)
            gaps: list[float] = []
            compute: list[float] = []
            # Both ranks record the same STEPS - WARMUP steps (run_pipeline).
            for a, b in zip(per_rank[0][f"{shape}/{name}"], per_rank[1][f"{shape}/{name}"], strict=True):
                gaps += op_gaps_s(a, b, transfer_s(nbytes))
                compute += [t1 - t0 for *_, t0, t1 in a + b]
            points.append((nbytes, statistics.mean(gaps)))
            detail[f"{shape}_{name}"] = {"gap_us": round(points[-1][1] * 1e6, 1),
                                          "compute_per_op_ms": round(statistics.mean(compute) * 1e3, 3)}
        (b0, g0), (b1, g1) = points
        per_byte[name] = max(0.0, (g1 - g0) / (b1 - b0))
        fixed[name] = max(0.0, g0 - per_byte[name] * b0)
    return fixed, per_byte, detail
