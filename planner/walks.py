"""Which devices' memory is walked op by op, over which order, and what their sends leave live.

torch 2.13's multi-stage runtime (`_PipelineScheduleRuntime`: interleaved 1F1B, ZB-H1, ZB-V, DualPipeV) keeps every
send's tensor until the step's end (costmodels/memory.py `Sends`), so a device's peak depends on where in its order
it falls. The prediction walks each device of several virtual stages over its order with each stage's own bytes
(planner/predict_inputs.py); the partitioner, which asks about thousands of layer ranges, and the counts of ZB-H1's
one-stage devices price the sends live at the device's fullest point of a walk with unit counts
(`kept_send_counts`). All read the orders and the cuts here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pipeplan.costmodels.memory import Sends, kept_model_outputs, left_live
from pipeplan.planner.configs import Config
from pipeplan.planner.simulate import device_orders
from pipeplan.schedules import facts, stage_device
from pipeplan.v_orders import walk

__all__ = ["keeps_sends", "walks", "walk_orders", "cut_sends", "kept_send_counts"]

Order = list[tuple[str, int, int]]


def keeps_sends(schedule: str) -> bool:
    """Whether the schedule runs on torch's multi-stage runtime, which keeps every send to the step's end (the
    schedules with a receive buffer per microbatch, `memory.receive_buffers`): interleaved, ZB-H1, ZB-V, DualPipeV."""
    rule = facts(schedule)
    return rule.torch_class is not None and not rule.receives_per_microbatch


def walks(schedule: str) -> bool:
    """Whether a device's memory is walked over its order rather than counted: schedules that run several virtual
    stages a device on torch's multi-stage runtime (interleaved, ZB-V, DualPipeV).

    ZB-H1 runs on the same runtime with one stage a device and stays with the counts (its sends added,
    `kept_send_counts`): walked, its recomputed last stage read -7.8% on the CPU runtime (its B keeps 110 MiB a
    microbatch for W where the trace's deferred gradients less the loss's saves give 46; the counts' model output,
    kept at every point, stands in for the rest and read -0.0%)."""
    rule = facts(schedule)
    return rule.torch_class is not None and rule.interleaves


def walk_orders(config: Config, P: int) -> list[Order]:
    """Each device's order (`simulate.device_orders`), a whole backward as "BW" (it ends its microbatch's hold, as in a
    V's order): built once for all P devices, whose walks read one each."""
    return list(_orders(config.schedule, P, config.chunks, config.microbatches))


@lru_cache(maxsize=64)
def _orders(schedule: str, P: int, chunks: int, microbatches: int) -> tuple[Order, ...]:
    splits = facts(schedule).splits_backward
    return tuple([("BW" if kind == "B" and not splits else kind, s, m) for kind, s, m in order]
                 for order in device_orders(schedule, P, chunks, microbatches))


def cut_sends(schedule: str, P: int, in_bytes: Sequence[int], out_bytes: Sequence[int], model_out_bytes: int) -> Sends:
    """The `Sends` every device of the plan shares: each cut's bytes where it crosses to another device (0 where both
    stages are on one), the model's output; each device sets its own `accumulating`."""
    S = len(in_bytes)

    def crosses(a: int, b: int) -> bool:
        return stage_device(schedule, a, P) != stage_device(schedule, b, P)

    return Sends(out=[int(o) if s < S - 1 and crosses(s, s + 1) else 0 for s, o in enumerate(out_bytes)],
                 grad=[int(i) if s > 0 and crosses(s, s - 1) else 0 for s, i in enumerate(in_bytes)],
                 model_out=int(model_out_bytes), last=S - 1, accumulating=0)


def kept_send_counts(config: Config) -> list[tuple[int, int, int]]:
    """Per device of a schedule that keeps its sends (`keeps_sends`), the sends live at its fullest point: (outputs
    sent, input gradients sent, model outputs kept), counted where its order holds the most (chunk-)microbatches,
    the last such op.

    What the partitioner's memory (costmodels/memory.py `RangeMemory`) adds for them, a device being made of copies
    of the chunk it prices, and what the counts add for ZB-H1's devices (one stage each, not walked). Sends only grow
    through a step while the held microbatches peak in the steady state and fall in the drain, each backward freeing
    a microbatch's saved bytes for one cut's gradient sent, so the walk's peak is the last op where the most are
    held whenever a chunk saves more than it sends (every layered model; a walked device's prediction walks it
    exactly and has the last word). A device counted, not walked, keeps the counts' model outputs
    (`kept_model_outputs`: see `walks` for what they stand in for)."""
    counts = list(_kept_send_counts(config.schedule, config.stages, config.chunks, config.microbatches))
    if walks(config.schedule):
        return counts
    model_outs = kept_model_outputs(config.schedule, config.stages, config.microbatches)
    last = stage_device(config.schedule, config.virtual_stages - 1, config.stages)
    return [(outs, grads, model_outs if p == last else 0) for p, (outs, grads, _) in enumerate(counts)]


@lru_cache(maxsize=4096)  # one search prices hundreds of (schedule, P, chunks, M), its block hint the same again
def _kept_send_counts(schedule: str, P: int, chunks: int, microbatches: int) -> tuple[tuple[int, int, int], ...]:
    S = P * chunks
    ones = cut_sends(schedule, P, [1] * S, [1] * S, 0)
    counting = (ones._replace(grad=[0] * S), ones._replace(out=[0] * S), Sends([0] * S, [0] * S, 1, S - 1, 0))
    out = []
    for order in _orders(schedule, P, chunks, microbatches):
        held = [h for _, _, h, _ in walk(order)]
        fullest = len(held) - 1 - held[::-1].index(max(held)) if held else 0
        out.append(tuple(left_live(order, sends)[fullest] if order else 0 for sends in counting))
    return tuple(out)  # type: ignore[arg-type]
