"""Judging a user's split beside the best plan: how much slower, how full, and why.

The split is predicted by `planner/predict.predict`, the path every plan and
baseline goes through, under the configuration (schedule, replicas,
microbatches, recomputation, sharding) of the best plan with the split's stage
count: the overall best when its stage count matches, else the best of a search
restricted to that count. So the ratio compares partitions and says separately
when the configuration differs too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeplan.costmodels.graph import Graph
from pipeplan.errors import InfeasibleError
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.configs import Config
from pipeplan.planner.frameworks.split import UserSplit
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import predict
from pipeplan.planner.replay import config_of
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import ScheduleName, runs_block_checkpoints, stage_device

__all__ = ["Judgement", "judge_split", "config_for_split"]


@dataclass
class Judgement:
    split: UserSplit
    plan: Plan  # the user's split, predicted
    best: Plan
    config_note: str  # "" when judged under the best plan's own configuration
    reasons: list[str]

    @property
    def slowdown(self) -> float:
        """Best samples/s over the split's (> 1: the split is slower)."""
        sps = self.plan.predicted.samples_per_s
        return self.best.predicted.samples_per_s / sps if sps > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        cap = self.plan.predicted.memory_capacity_bytes or 1
        return {"source": self.split.source, "layer_counts": [len(s.layers) for s in self.plan.stages],
                "chunks": self.split.chunks, "samples_per_s": self.plan.predicted.samples_per_s,
                "iteration_s": self.plan.predicted.iteration_s, "slowdown_vs_best": self.slowdown,
                "fits": self.plan.predicted.fits, "peak_memory_bytes": self.plan.predicted.peak_memory_bytes,
                "stage_memory_fractions": [s.predicted.memory_bytes / cap for s in self.plan.stages],
                "config_note": self.config_note, "why": self.reasons, "plan": self.plan.to_dict()}


def config_for_split(graph: Graph, profile: HardwareProfile, request: PlanRequest, best: Plan,
                     virtual_stages: int, chunks: int, schedule: ScheduleName | None = None) -> tuple[Config, str]:
    """The configuration to judge a split of `virtual_stages` stages under, and what differs from the best's;
    `schedule`: the one the split's framework settings name (it decides where the stages go)."""
    cfg = config_of(best)
    if cfg.virtual_stages == virtual_stages and cfg.chunks == chunks and schedule in (None, cfg.schedule):
        return cfg, ""
    from pipeplan.planner.search import search

    P = virtual_stages // chunks
    if P > request.devices:
        raise ValueError(f"the split has {P} pipeline stages but --gpus is {request.devices}")
    schedule = schedule or ("interleaved" if chunks > 1 else (best.schedule if best.chunks == 1 else "1f1b"))
    # a schedule that splits its backward checkpoints whole stages (pipeplan.schedules.runs_block_checkpoints)
    granularity = request.recompute_granularity if runs_block_checkpoints(schedule) else "stage"
    narrowed = replace(request, stages=P, chunks=chunks if chunks > 1 else None, schedule=schedule,
                       data_parallel=None, top=1, recompute_granularity=granularity)
    try:
        other = config_of(search(graph, profile, narrowed).best)
    except InfeasibleError:
        concrete = cfg.recompute_granularity if granularity == "auto" or not cfg.recompute else granularity
        other = Config(schedule=schedule, stages=P, data_parallel=1, microbatches=cfg.microbatches,
                       chunks=chunks, recompute=cfg.recompute, recompute_granularity=concrete, sharding="none")
        return other, (f"no configuration with {P} pipeline stages fits; judged with 1 replica, "
                       f"{cfg.microbatches} microbatches, {schedule}")
    why = (f"its settings name {schedule}" if cfg.virtual_stages == virtual_stages and cfg.chunks == chunks
           else f"the best plan has {cfg.virtual_stages} stages")
    return other, f"{why}; the split is judged under the best configuration with {virtual_stages}: {other.describe()}"


def _reasons(mine: Plan, best: Plan) -> list[str]:
    """Where the split loses: its slowest stage against the best plan's, and its fullest device."""
    out = []
    ms = max(mine.stages, key=lambda s: s.predicted.compute_s)
    mine_dev, best_dev = max(_device_compute_s(mine)), max(_device_compute_s(best))
    if mine_dev > 1.02 * best_dev:
        mean = sum(s.predicted.compute_s for s in mine.stages) / len(mine.stages)
        out.append(f"stage {ms.index} ({_span(ms.layers)}, {len(ms.layers)} layers) computes "
                   f"{1e3 * ms.predicted.compute_s:.3g} ms per microbatch, {ms.predicted.compute_s / mean:.2f}x its "
                   f"stages' mean; the busiest device computes {1e3 * mine_dev:.3g} ms per microbatch, the best "
                   f"plan's {1e3 * best_dev:.3g} ms")
    cap = mine.predicted.memory_capacity_bytes
    if cap:
        full = max(mine.stages, key=lambda s: s.predicted.memory_bytes)
        p = full.predicted
        out.append(f"stage {full.index} at {100 * p.memory_bytes / cap:.0f}% of memory "
                   f"(weights {p.weights_bytes / 2**30:.1f} GiB, gradients + optimizer "
                   f"{p.optimizer_bytes / 2**30:.1f} GiB, activations {p.activation_bytes / 2**30:.1f} GiB)"
                   + ("" if p.memory_bytes <= cap else ": it does not fit"))
    if mine.predicted.bubble_fraction > best.predicted.bubble_fraction + 0.02:
        out.append(f"bubble {100 * mine.predicted.bubble_fraction:.0f}% against the best plan's "
                   f"{100 * best.predicted.bubble_fraction:.0f}%")
    return out


def _device_compute_s(plan: Plan) -> list[float]:
    """Compute per microbatch of each pipeline device: its chunks summed (pipeplan.schedules.stage_device)."""
    P = max(1, len(plan.stages) // max(1, plan.chunks))
    per = [0.0] * P
    for s in plan.stages:
        per[stage_device(plan.schedule, s.index, P)] += s.predicted.compute_s
    return per


def _span(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"


def judge_split(graph: Graph, profile: HardwareProfile, request: PlanRequest, best: Plan,
                split: UserSplit) -> Judgement:
    """The user's split predicted beside `best` (request must already be resolved for the profile)."""
    K = max(split.assignment) + 1
    if K % split.chunks:
        raise ValueError(f"{K} stages do not divide into {split.chunks} chunks per rank")
    cfg, note = config_for_split(graph, profile, request, best, K, split.chunks, split.schedule)
    plan = predict(graph, profile, split.assignment, cfg, request,
                   solver={"name": "your split", "source": split.source}).plan
    return Judgement(split, plan, best, note, _reasons(plan, best))
