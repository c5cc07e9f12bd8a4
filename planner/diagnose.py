"""When nothing fits: by how much the least-overflowing configuration misses, and what would fit it.

The search records a `Failure` for every configuration it rejects for memory,
with how the shortfall is known; this module turns the closest one into the one
line (and hint) of the `InfeasibleError` a user sees. A number in that line is
real: with that much memory per device the configuration fits (tests check it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pipeplan.costmodels.graph import Graph
from pipeplan.costmodels.memory import RangeMemory, gathered_bytes, is_mixed_precision, model_state_bytes
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.dp import overflow_bytes, partition_dp, partition_fits
from pipeplan.planner.feasibility import greedy_fits, least_capacity
from pipeplan.planner.partition import link_fn
from pipeplan.planner.predict import predict
from pipeplan.planner.problem import Problem
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import stage_device
from pipeplan.units import GIB

__all__ = ["Failure", "Shortfall", "closest_failure", "infeasible_message", "just_enough"]

Shortfall = Literal["state", "greedy", "dp", "exact"]
"""How a failure's bytes are known: a model-state lower bound, the greedy packing or the DP's least overflow (both
sized on demand), or exact (a prediction's peak)."""


@dataclass(frozen=True)
class Failure:
    """A configuration rejected for memory."""

    need_bytes: int
    """Bytes per device it would need (-1 for a greedy or DP failure not yet sized)."""
    how: Shortfall
    config: Config


@dataclass(frozen=True)
class SearchView:
    """What the diagnosis reads of a finished search."""

    graph: Graph
    profile: HardwareProfile
    request: PlanRequest
    failures: Sequence[Failure]
    problem: Callable[[int, bool], Problem]
    """(microbatch size, recompute) -> the problem the search used."""
    memory: Callable[[Config, Problem], RangeMemory]


def closest_failure(view: SearchView) -> Failure:
    """The rejected configuration that needs the least memory per device, the first of equals in search order;
    those whose partition was tried come first (a model-state bound may understate).

    A greedy failure's bytes are the least capacity its packing fits (`least_capacity`, a bisection of ~16
    packings). One whose packing does not fit at the least need found so far needs more (a packing that fits at
    some capacity fits at any larger one), so one packing rules it out and it is not sized: sizing all 2,554 of
    Llama-3-70B's at 8,192 tokens on 64 H100s took 30 s of a 48 s `analyze`. The answer is the one sizing all.
    A DP failure (no partition fits, `partition_dp`) is ruled out the same way by the DP's own feasibility
    (`partition_fits`, one memory walk) and sized by `overflow_bytes`. The search leaves its DPs' overflows unsized
    (`size_overflow=False`): ~15 passes of the DP's memory walk each, read only here. README's `analyze` of Llama-3-70B on 64 H100s met no DP
    failure but sized the infeasible DPs of its refits all the same: it walked the DP's memory for 3.0 s of its
    27 s, 1.1 s without that (one run each).
    """
    best: Failure | None = None
    sized: dict[tuple[int, int, str], int] = {}
    cap = int(view.profile.usable_memory_bytes)
    for f in view.failures:
        if f.how == "state":
            continue
        if f.how in ("greedy", "dp"):
            cfg = f.config
            prob = view.problem(cfg.microbatch_size(view.request.batch_size), cfg.recompute)
            mem = view.memory(cfg, prob)
            key = (id(mem), cfg.virtual_stages, f.how)  # memory models are cached by the search: ids are stable
            if key not in sized:
                if best is not None and _needs_more(view, f, prob, mem, best.need_bytes):
                    continue  # needs more than `best`
                sized[key] = (least_capacity(mem, cfg.virtual_stages, cap) if f.how == "greedy" else
                              cap + overflow_bytes(prob, cfg.virtual_stages, link=link_fn(view.profile, cfg),
                                                   memory_bytes=mem, capacity_bytes=cap))
            f = replace(f, need_bytes=sized[key])
        if best is None or f.need_bytes < best.need_bytes:
            best = f
    return best if best is not None else min(view.failures, key=lambda x: x.need_bytes)


def _needs_more(view: SearchView, f: Failure, prob: Problem, mem: RangeMemory, capacity: int) -> bool:
    """Whether an unsized failure's packing (greedy) or partition (DP) does not fit `capacity`: one check."""
    K = f.config.virtual_stages
    if f.how == "greedy":
        return not greedy_fits(mem, K, capacity)
    return not partition_fits(prob, K, link=link_fn(view.profile, f.config), memory_bytes=mem, capacity_bytes=capacity)


def just_enough(need_bytes: int) -> int:
    """The capacity a sized failure is partitioned at: its need and the sizing's 0.1% precision, with a margin."""
    return need_bytes + max(1, need_bytes // 500)


def _worst_stage(view: SearchView, f: Failure) -> tuple[int, str]:
    """Partition the closest configuration with just enough memory and name its fullest device."""
    cfg, need = f.config, f.need_bytes
    mb = cfg.microbatch_size(view.request.batch_size)
    prob = view.problem(mb, cfg.recompute)
    part = None
    for capacity in (just_enough(need), 2 * need):
        part = partition_dp(prob, cfg.virtual_stages, link=link_fn(view.profile, cfg),
                            memory_bytes=view.memory(cfg, prob), capacity_bytes=capacity)
        if part.assignment:
            break
    if part is None or not part.assignment:
        return need, " (model state alone)"  # as before issue 14: no split found even at twice the bytes
    plan = predict(view.graph, view.profile, part.assignment, replace(cfg, stage_replicas=()), view.request,
                   problem=view.problem(mb, False)).plan
    worst = max(plan.stages, key=lambda s: s.predicted.memory_bytes)
    where = f" on stage {worst.index}" if cfg.chunks == 1 else f" on pipeline device {stage_device(cfg.schedule, worst.index, cfg.stages)}"
    return worst.predicted.memory_bytes, where


def _hints(view: SearchView, f: Failure, need: int) -> list[str]:
    req, cap = view.request, int(view.profile.usable_memory_bytes)
    one_mb = view.problem(1, False)
    hints = []
    frozen = one_mb.frozen

    def state_of(nbytes: int, frozen_bytes: int) -> int:
        return model_state_bytes(nbytes, optimizer=req.optimizer, dtype=req.training_dtype,
                                 mixed_precision=req.mixed_precision, frozen_bytes_fp32=frozen_bytes).total_bytes

    state = state_of(sum(one_mb.param_bytes), sum(frozen))
    largest = max(range(one_mb.n), key=lambda i: state_of(one_mb.param_bytes[i], frozen[i]))
    one = state_of(one_mb.param_bytes[largest], frozen[largest])
    if one > cap:
        hints.append(_layer_too_big(view, one_mb, largest, one))
    else:
        want = max(req.devices + 1, math.ceil(req.devices * need / cap), math.ceil(state / cap))
        hints.append(f"more devices (about {want})")
    if req.sharding in ("none", "zero1", "zero2") and req.devices > 1:
        hints.append("more sharding across replicas (--sharding auto, or zero3)")
    if req.recompute == "off" and f.how != "state":
        hints.append("recomputation (--recompute on)")
    mb = f.config.microbatch_size(req.batch_size)
    if req.batch_size > 1 and f.how != "state" and mb > 1:
        hints.append(f"smaller microbatches (the smallest plan uses {mb} samples each; "
                     "more microbatches or a smaller batch)")
    if req.optimizer in ("adam", "adamw"):
        hints.append("a lighter optimizer (sgd keeps no state)")
    if req.mixed_precision == "autocast" and is_mixed_precision(req.training_dtype):
        hints.append("--mixed-precision megatron or deepspeed if the plan is for that framework (16-bit activations)")
    return hints


def _layer_too_big(view: SearchView, one_mb: Problem, i: int, state_bytes: int) -> str:
    """The hint for a layer whose weights and optimizer state alone exceed a device: where ZeRO-3 may shard them,
    what it still gathers whole to compute that layer (`gathered_bytes`), and so whether it would fit at all."""
    req, cap = view.request, int(view.profile.usable_memory_bytes)
    layer = view.graph.layers[i]
    text = (f"layer {layer.name} alone needs {state_bytes / GIB:.1f} GiB of weights and optimizer state: no pipeline "
            "split fits it")
    if req.sharding not in ("auto", "zero3") or req.devices < 2 or req.schedule in ("pipedream", "pipedream-2bw"):
        return text + "; use a device with more memory or a lighter optimizer"
    held = gathered_bytes(one_mb.trainable[i], optimizer=req.optimizer, dtype=req.training_dtype,
                          mixed_precision=req.mixed_precision, sharding="zero3")
    if held >= cap:
        return (text + f"; ZeRO-3 shards its state over replicas but gathers it to compute, {held / GIB:.1f} GiB of "
                "full-size weights and gradients (its weights and the next layer's, prefetched, and its gradients): "
                "a layer this size has to be split inside (tensor or expert parallelism, which pipeplan does not plan) "
                "or needs a device with more memory")
    replicas = math.ceil(state_bytes / (cap - held))
    return (text + f"; ZeRO-3 over at least {replicas} replicas would hold its share beside the {held / GIB:.1f} GiB "
            "it gathers to compute")


def infeasible_message(view: SearchView, lead: str | None = None, closest: Failure | None = None) -> tuple[str, str]:
    """One line saying by how much the least-overflowing configuration misses, and what would fit it (`lead`, where
    given, first: a change the caller found a fitting plan for; `closest`: `closest_failure(view)`, where the
    caller has it)."""
    req, cap, profile = view.request, int(view.profile.usable_memory_bytes), view.profile
    if not view.failures:
        return (f"no pipeline configuration of {req.devices} devices and batch {req.batch_size} could be built",
                "check --stages/--microbatches against the batch size and the graph's layer count")
    f = closest or closest_failure(view)
    need, stage_txt = (f.need_bytes, " (model state alone)") if f.how == "state" else _worst_stage(view, f)
    over = need - cap
    msg = (f"nothing fits: the smallest plan ({f.config.describe()}) needs {need / GIB:.1f} GiB{stage_txt} but "
           f"{profile.name} has {cap / GIB:.1f} GiB usable ({over / GIB:.1f} GiB, {100 * over / cap:.0f}% over)")
    return msg, "would fit with: " + "; ".join(([lead] if lead else []) + _hints(view, f, need))
