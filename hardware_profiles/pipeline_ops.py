"""Running the pipelines whose op timings `op_overhead.py` turns into the runtime's cost per op.

Each function runs on one of the two ranks `profiles calibrate` spawns (an initialised gloo group, each rank
pinned to a core as the runtime's are) and returns that rank's events: torch.distributed.pipelining's
schedules with every forward, backward and W timed, the runtime's asynchronous PipeDream loop written out
with its messages, and the same stage ops with no pipeline around them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipeplan.hardware_profiles.op_overhead import (
    ALONE_SCHEDULES,
    ALONE_SHAPES,
    CHUNKS,
    HIDDEN,
    MICROBATCHES,
    MORE_CHUNKS,
    MORE_CHUNKS_SCHEDULES,
    MORE_CHUNKS_SHAPES,
    SHAPES,
    SOLO,
    STEP,
    STEPS,
    TENSORS,
    TORCH_SCHEDULES,
    WARMUP,
    WIDTH,
    Event,
    alone_key,
    chunks_shape,
    shape_schedules,
)
from pipeplan.schedules import ScheduleName, device_stages, facts, local_order

HEADER_LEN = 10  # int64s sent before every activation by the asynchronous loop (runtime/pipedream_comm.HEADER_LEN)


def cpu_clocks() -> tuple[float, float]:
    """(this process's CPU time, this thread's): their difference over an op is what the process's other threads,
    gloo's copying messages, took from the core while the op ran (the rank is pinned to one core)."""
    return time.process_time(), time.thread_time()


def stolen_since(clocks: tuple[float, float]) -> float:
    """CPU time the process's other threads used since `cpu_clocks()` returned `clocks` (>= 0)."""
    proc, thread = cpu_clocks()
    return max(0.0, (proc - clocks[0]) - (thread - clocks[1]))


def run_pipeline(rank: int, rounds: int) -> dict[str, list[list[Event]]]:
    """Run every (shape, schedule) `rounds` times (op_overhead.ROUNDS, or one under a short budget: calibrate.py) on
    an initialised 2-rank gloo group; this rank's events per measured step, keyed "shape/schedule" (the
    asynchronous loop has no steps: a list of its measured microbatches' ops per run)."""
    import torch
    import torch.distributed as dist

    out: dict[str, list[list[Event]]] = {}
    alone_groups = [dist.new_group([r]) for r in range(2)]  # collective: every rank creates both, in order
    for round_ in range(rounds):
        for shape in ALONE_SHAPES:
            rows, layers = SHAPES[shape]
            for name in ALONE_SCHEDULES:
                dist.barrier()
                out.setdefault(alone_key(shape, name), []).extend(_alone_steps(name, rows, layers, alone_groups[rank]))
        for shape, (rows, layers) in SHAPES.items():
            hidden = HIDDEN.get(shape, WIDTH)
            if round_ == 0:
                torch.manual_seed(rank)
                dist.barrier()
                out[f"{shape}/{SOLO}"] = [solo_events(rank, rows, layers, hidden)]
            for name in shape_schedules(shape):
                torch.manual_seed(rank)
                dist.barrier()
                out.setdefault(f"{shape}/{name}", []).extend(
                    _torch_steps(rank, name, rows, layers, TENSORS[shape], hidden) if name in TORCH_SCHEDULES
                    else [_async_events(rank, rows, layers, hidden)])
        for shape in MORE_CHUNKS_SHAPES:
            rows, layers = SHAPES[shape]
            for name in MORE_CHUNKS_SCHEDULES:
                torch.manual_seed(rank)
                dist.barrier()
                out.setdefault(f"{chunks_shape(shape)}/{name}", []).extend(
                    _torch_steps(rank, name, rows, layers, chunks=MORE_CHUNKS))
    return out


def solo_events(rank: int, rows: int, layers: int, hidden: int = WIDTH) -> list[Event]:
    """The stage's forwards and backwards with no pipeline around them, both ranks at once (so they carry the
    slowdown of two busy cores, which the prediction has from `concurrency_slowdown`): what an op of the
    pipelines takes beyond them is gloo's and the schedule's (`excess_us` in the calibration detail)."""
    import torch

    module = _stage_module(layers, hidden=hidden)
    params = list(module.parameters())
    events: list[Event] = []
    for i in range(WARMUP + (STEPS - WARMUP) * MICROBATCHES):
        inp = torch.randn(rows, WIDTH, requires_grad=rank == 1)  # the last stage's input gradient, as in a pipeline
        t0 = time.perf_counter()
        out = module(inp)
        t1 = time.perf_counter()
        torch.autograd.grad(out.sum(), [inp, *params] if rank == 1 else params)
        t2 = time.perf_counter()
        if i >= WARMUP:
            events += [("F", rank, i, t0, t1, 0.0), ("B", rank, i, t1, t2, 0.0)]  # no messages: nothing stolen
    return events


def _stage_module(layers: int, tensors_in: int = 1, tensors_out: int = 1, hidden: int = WIDTH) -> Any:
    """`layers` x Linear(WIDTH) + ReLU, or with `hidden` narrower than WIDTH `layers` x a bottleneck Linear(WIDTH,
    hidden) + ReLU + Linear(hidden, WIDTH) + ReLU (at hidden = WIDTH / 4 half a Linear(WIDTH)'s multiply-adds a
    row: twice the rows, a cut twice as large, at equal compute); with several tensors in, it stacks their rows
    first, with several out it returns its output's rows in that many equal parts, a cut of several tensors."""
    import torch
    import torch.nn as nn

    def layer() -> list[nn.Module]:
        if hidden == WIDTH:
            return [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        return [nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, WIDTH), nn.ReLU()]

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[m for _ in range(layers) for m in layer()])

        def forward(self, *xs: Any) -> Any:
            out = self.layers(xs[0] if tensors_in == 1 else torch.cat(xs))
            # copies, not views: torch's split backward detaches a stage's outputs in place, which views refuse
            return out if tensors_out == 1 else tuple(part.clone() for part in out.chunk(tensors_out))

    return Stage()


def _torch_steps(rank: int, name: ScheduleName, rows: int, layers: int, tensors: int = 1,
                 hidden: int = WIDTH, chunks: int | None = None, microbatches: int = MICROBATCHES
                 ) -> list[list[Event]]:
    """`name` under its torch.distributed.pipelining class, every forward and backward (and W) timed, its stages
    where the runtime puts them (pipeplan.schedules.stage_device): stage s on rank s % 2, or ZB-V's V (stages 0 and
    3 on rank 0, 1 and 2 on rank 1, the hand-over from 1 to 2 without a transfer). Every cut carries `tensors`
    tensors (the model's input and the last stage's output stay one). `chunks`: stages a rank, CHUNKS[name] unless
    given (interleaved runs at MORE_CHUNKS too); `microbatches`: MICROBATCHES unless given (benchmarks/chunks_probe.py
    varies both)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from pipeplan.lean_gpipe import single_stage_schedule

    chunks = CHUNKS[name] if chunks is None else chunks
    n_stages = 2 * chunks
    mine = device_stages(name, rank, 2, chunks)  # the runtime's placement (runtime/placement.stage_ranks)
    events: list[Event] = []
    stages: list[Any] = []
    for index in mine:  # in model order, as the runtime lists a rank's stages
        module = _stage_module(layers, 1 if index == 0 else tensors, 1 if index == n_stages - 1 else tensors, hidden)
        stage = pipelining.PipelineStage(module, index, n_stages, torch.device("cpu"))
        _time_ops(stage, index, events)
        stages.append(stage)
    loss = lambda output, target: output.sum()  # noqa: E731
    cls = getattr(pipelining, str(facts(name).torch_class))
    # as runtime/worker.build_schedule: the multi-stage classes (interleaving, zero bubble) take the rank's stage
    # list, the others its one stage
    multi = facts(name).interleaves or facts(name).splits_backward
    schedule = cls(stages, microbatches, loss_fn=loss) if multi else \
        single_stage_schedule(cls, stages[0], microbatches, loss_fn=loss)  # GPipe, 1F1B: the runtime's loops
    # the rank with stage 0 feeds the inputs, the one with the last stage the targets (ZB-V's rank 0: both)
    args = (torch.randn(rows * microbatches, WIDTH),) if 0 in mine else ()
    kwargs = {"target": torch.zeros(rows * microbatches)} if n_stages - 1 in mine else {}
    steps = []
    for i in range(STEPS):
        dist.barrier()
        events.clear()
        schedule.step(*args, **kwargs)
        if i >= WARMUP:
            steps.append(list(events))
    return steps


def _time_ops(stage: Any, index: int, events: list[Event]) -> None:
    """Record every forward, backward and W of `stage` in `events` (kind, stage, microbatch, start, end, stolen
    CPU): instance attributes shadowing torch's methods (mypy forbids assigning to a method)."""
    def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            clocks, t0 = cpu_clocks(), time.perf_counter()
            result = fn(chunk, *args, **kwargs)
            events.append((kind, index, int(chunk), t0, time.perf_counter(), stolen_since(clocks)))
            return result
        return run

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W")


def _alone_steps(name: ScheduleName, rows: int, layers: int, group: Any) -> list[list[Event]]:
    """`name`'s loop over one stage with no messages, as the runtime runs a one-stage plan (runtime/worker.
    build_schedule), on a group of this rank alone: per measured step its forwards and backwards, and a STEP
    event spanning `schedule.step` (op_overhead.alone_overhead_s charges what lies outside the ops)."""
    import torch
    from torch.distributed import pipelining

    from pipeplan.lean_gpipe import single_stage_schedule

    events: list[Event] = []
    stage = pipelining.PipelineStage(_stage_module(layers), 0, 1, torch.device("cpu"), group=group)
    _time_ops(stage, 0, events)
    cls = getattr(pipelining, str(facts(name).torch_class))
    schedule = single_stage_schedule(cls, stage, MICROBATCHES, loss_fn=lambda output, target: output.sum())
    x, target = torch.randn(rows * MICROBATCHES, WIDTH), torch.zeros(rows * MICROBATCHES)
    steps = []
    for i in range(STEPS):
        events.clear()
        t0 = time.perf_counter()
        schedule.step(x, target=target)
        if i >= WARMUP:
            steps.append([*events, (STEP, 0, 0, t0, time.perf_counter(), 0.0)])
    return steps


def _async_events(rank: int, rows: int, layers: int, hidden: int = WIDTH) -> list[Event]:
    """PipeDream's asynchronous 1F1B on two ranks as runtime/pipedream.py runs it: `local_order` with K - s
    admitted, no flush; each activation an isend of a header and the tensor, its gradient's receive posted
    with it; each gradient an isend; the next activation's receives posted when one arrives
    (runtime/pipedream_comm.py). Ops of the first WARMUP x M microbatches are not kept. An op's span is its
    compute alone: from when its receive returned to before its sends, which gloo starts in the caller's thread
    once the peer has posted the receive (0.3-0.4 ms an isend of a 512 KiB tensor in examples/gpt.py), so
    they fall in the gaps with the waiting. No optimizer step (the simulator prices it in the backward)."""
    import torch
    import torch.distributed as dist

    module, peer = _stage_module(layers, hidden=hidden), 1 - rank
    params = list(module.parameters())
    x, header = torch.randn(rows, WIDTH), torch.zeros(HEADER_LEN, dtype=torch.int64)
    events: list[Event] = []
    sent: list[tuple[Any, torch.Tensor]] = []  # (request, the tensor it reads) until the end: gloo's cannot be polled
    inflight: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}

    def post_activation() -> tuple[Any, Any, torch.Tensor]:
        head, data = torch.empty(HEADER_LEN, dtype=torch.int64), torch.empty(rows, WIDTH)
        return dist.irecv(head, peer), dist.irecv(data, peer), data

    ahead = post_activation() if rank == 1 else None  # the next activation's receives, posted a microbatch ahead
    n = STEPS * MICROBATCHES
    for kind, m in local_order(n, 2 - rank):
        if kind == "F":
            if ahead is not None:
                ahead[0].wait()
                ahead[1].wait()
                inp = ahead[2].requires_grad_()
                ahead = post_activation() if m + 1 < n else None
            else:
                inp = x
            clocks, t0 = cpu_clocks(), time.perf_counter()
            out = module(inp)
            t1 = time.perf_counter()
            stolen = stolen_since(clocks)  # before its sends, which are the gaps' (gloo starts them in this thread)
            grad: Any = None
            if rank == 0:  # the activation out, its gradient's receive posted with it
                act, grad = out.detach(), torch.empty_like(out)
                sent += [(dist.isend(header, peer), header), (dist.isend(act, peer), act)]
                grad = (dist.irecv(grad, peer), grad)
            inflight[m] = (inp, out, grad)
        else:
            inp, out, grad = inflight.pop(m)
            if rank == 0:
                grad[0].wait()
            clocks, t0 = cpu_clocks(), time.perf_counter()
            if rank == 1:
                grads = torch.autograd.grad(out.sum(), [inp, *params])
            else:
                torch.autograd.grad(out, params, grad[1])
            t1 = time.perf_counter()
            stolen = stolen_since(clocks)
            if rank == 1:  # the input gradient back, after the op's clocks (its send is the gaps')
                sent.append((dist.isend(grads[0], peer), grads[0]))
        if m >= WARMUP * MICROBATCHES:
            events.append((kind, rank, m, t0, t1, stolen))
    for w, _ in sent:
        w.wait()
    return events
