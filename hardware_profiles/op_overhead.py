"""The runtime's cost per pipeline op, measured on a real two-rank pipeline (`profiles calibrate`).

Compute times and link times do not add up to a pipeline's iteration on this
kind of machine: around every forward or backward of a microbatch,
torch.distributed.pipelining does Python bookkeeping, posts its sends and
receives and waits on them; gloo copies every tensor through the kernel's
loopback socket on the same cores that compute, and a tensor arriving while
the receiving core computes waits for that core's gloo thread. On a 2-stage
GPT example that was ~1 ms per op, 8-15% of the step, which no FLOP or
bandwidth figure contains.

So we run the schedules the runtime uses (GPipe and 1F1B, M = 8) on two
processes with identical MLP stages, record when every op starts and ends, and
charge each op the time between "could start" and "started": ready = max(end of
the rank's previous op, end of the op it depends on on the other rank + the idle
link's transfer time). That gap grows with the tensors the op sends and
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
# The schedules measured here: those of pipeplan.schedules that torch.distributed.pipelining runs with one
# model chunk per rank (a torch class, not interleaved). The others have no figure of their own and take
# 1F1B's (HardwareProfile.overhead_for): interleaved and PipeDream post and wait on their sends as 1F1B does.
SCHEDULES: Final[tuple[ScheduleName, ...]] = ("gpipe", "1f1b")
assert all(facts(s).torch_class is not None and not facts(s).interleaves for s in SCHEDULES)

Event: TypeAlias = tuple[str, int, float, float]
"""(kind "F"/"B", microbatch, start_s, end_s), perf_counter clock (shared by processes)."""


def message_bytes(shape: str) -> int:
    """The activation (and its gradient) one op of the 2-stage pipeline sends or receives."""
    return SHAPES[shape][0] * WIDTH * 4


def run_pipeline(rank: int) -> dict[str, list[list[Event]]]:
    """Run every (shape, schedule) on an initialised 2-rank gloo group; this rank's events per measured step,
    keyed "shape/schedule"."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    out: dict[str, list[list[Event]]] = {}
    for shape, (rows, layers) in SHAPES.items():
        for name in SCHEDULES:
            torch.manual_seed(rank)
            module = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
            stage = PipelineStage(module, rank, 2, torch.device("cpu"))
            events: list[Event] = []
            fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

            def timed(fn: Callable[..., Any], kind: str, events: list[Event] = events) -> Callable[..., Any]:
                def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    result = fn(chunk, *args, **kwargs)
                    events.append((kind, int(chunk), t0, time.perf_counter()))
                    return result
                return run

            # Instance attributes shadowing torch's methods, to time each call (mypy forbids assigning to a method).
            stage.forward_one_chunk = timed(fwd, "F")  # type: ignore[method-assign]
            stage.backward_one_chunk = timed(bwd, "B")  # type: ignore[method-assign]
            cls = Schedule1F1B if name == "1f1b" else ScheduleGPipe
            schedule = cls(stage, MICROBATCHES, loss_fn=lambda output, target: output.sum())
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


def op_gaps_s(first: list[Event], second: list[Event], transfer_s: float) -> list[float]:
    """Per op of one step of a 2-stage pipeline: start - the time it could have started (>= 0).

    A forward on the second rank depends on the same microbatch's forward on the
    first; a backward on the first rank on the second's backward; every op also
    waits for its rank's previous op. Cross-rank dependencies include the
    transfer (`transfer_s`), which the simulator already charges to the link.
    """
    end = {(0, kind, mb): t1 for kind, mb, _, t1 in first}
    end.update({(1, kind, mb): t1 for kind, mb, _, t1 in second})
    gaps = []
    for rank, events in ((0, first), (1, second)):
        prev = None
        for kind, mb, t0, t1 in events:
            dep_key = (0, "F", mb) if (rank, kind) == (1, "F") else (1, "B", mb) if (rank, kind) == (0, "B") else None
            ready = [prev] if prev is not None else []
            if dep_key is not None and dep_key in end:
                ready.append(end[dep_key] + transfer_s)
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
                compute += [t1 - t0 for _, _, t0, t1 in a + b]
            points.append((nbytes, statistics.mean(gaps)))
            detail[f"{shape}_{name}"] = {"gap_us": round(points[-1][1] * 1e6, 1),
                                          "compute_per_op_ms": round(statistics.mean(compute) * 1e3, 3)}
        (b0, g0), (b1, g1) = points
        per_byte[name] = max(0.0, (g1 - g0) / (b1 - b0))
        fixed[name] = max(0.0, g0 - per_byte[name] * b0)
    return fixed, per_byte, detail
