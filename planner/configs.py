"""The search space: one `Config` per point (stages x replicas x microbatches x schedule x chunks x recompute).

Enumeration is kept apart from evaluating a point, so the order in which points
are tried (whole-machine configurations first: good plans early, which makes the
throughput bound prune more) and the rules that skip a point without evaluating
it are read in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from pipeplan.choices import Layout, RecomputeGranularity, Sharding
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import ScheduleName, facts, microbatch_problem, runs_block_checkpoints

__all__ = ["Config", "CHUNK_CHOICES", "SHARDING_NAMES", "configurations", "sharding_levels", "pipedream_microbatch_counts",
           "divisors"]

# Chunks per device tried by the interleaved schedule: the bubble shrinks as 1/v while
# communication grows with v (Megatron-LM §2.2.2), so doubling steps cover the trade-off.
CHUNK_CHOICES = (2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class Config:
    """What a plan fixes besides its partition."""

    schedule: ScheduleName
    stages: int
    """Pipeline devices P (virtual stages = P x chunks)."""
    data_parallel: int
    """Replicas of the pipeline (the largest per-stage count for PipeDream's optimizer)."""
    microbatches: int
    chunks: int = 1
    recompute: bool = False
    recompute_granularity: RecomputeGranularity = "stage"
    """What one checkpoint covers where `recompute` (pipeplan.choices.RecomputeGranularity)."""
    stage_replicas: tuple[int, ...] = ()
    """PipeDream's optimizer: replicas per stage (else `data_parallel` each)."""
    layout: Layout = "stage-major"
    """Rank placement of the replicas (planner/predict.place)."""
    sharding: Sharding = "none"
    """ZeRO level across each stage's replicas (costmodels/memory.model_state_bytes)."""

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def replica_counts(self) -> tuple[int, ...]:
        """Replicas of each virtual stage."""
        return self.stage_replicas or (self.data_parallel,) * self.virtual_stages

    def microbatch_size(self, batch_size: int) -> int:
        """Samples per microbatch; 0 when the batch does not divide."""
        per = self.microbatches * (self.data_parallel if facts(self.schedule).replicates_whole_pipeline else 1)
        return batch_size // per if batch_size % per == 0 else 0

    def describe(self) -> str:
        def n(x: int, what: str) -> str:
            return f"{x} {what}{'' if x == 1 else 's'}"

        if self.stage_replicas:
            return (f"{n(self.stages, 'stage')} with replicas {list(self.stage_replicas)}, "
                    f"{self.microbatches} microbatches, pipedream")
        rc = (", recomputation" + (" per block" if self.recompute_granularity == "block" else "")
              if self.recompute else "")
        rc += f", {SHARDING_NAMES[self.sharding]}" if self.sharding != "none" else ""
        v = f" x {n(self.chunks, 'chunk')}" if self.chunks > 1 else ""
        return (f"{n(self.stages, 'stage')}{v} x {n(self.data_parallel, 'replica')}, "
                f"{n(self.microbatches, 'microbatch')}".replace("microbatchs", "microbatches")
                + f", {self.schedule}{rc}")


SHARDING_NAMES = {"none": "no sharding", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def sharding_levels(request: PlanRequest, schedule: ScheduleName, replicas: int, *,
                    unsharded_too: bool = False) -> tuple[Sharding, ...]:
    """ZeRO levels to try for a configuration, in order: the search partitions at the first that fits
    and predicts the later ones on the same partitions (planner/search.py).

    Sharding needs replicas of whole pipelines that synchronise at a flush (not
    async PipeDream). "auto" starts at ZeRO-1: its reduce-scatter plus all-gather
    moves no more than the all-reduce it replaces (ZeRO §7.2.1) and it holds less,
    so unsharded is never better. ZeRO-2 and ZeRO-3 hold less again but add
    collectives every microbatch (planner/predict_inputs), which may or may not
    hide behind compute, so they are predicted too. (Frameworks differ here:
    DeepSpeed's pipeline engine refuses ZeRO-2/3; Megatron-LM's distributed
    optimizer is ZeRO-1; the bundled runtime runs all three.)

    `unsharded_too` (a local profile, whose plans run on the bundled runtime) tries unsharded first: there
    gloo's reduce-scatter and all-gather, timed apart by `profiles calibrate`, can take longer than its
    all-reduce, and the collectives run in series with compute (predict_inputs.op_times), so the ring
    argument above does not hold.
    """
    rule = facts(schedule)
    if replicas < 2 or not (rule.flushes and rule.replicates_whole_pipeline):
        return ("none",)
    if request.sharding == "auto":
        sharded: tuple[Sharding, ...] = ("zero1", "zero2", "zero3")
        return (("none", *sharded) if unsharded_too else sharded)
    return (request.sharding,)


def divisors(x: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(x) + 1) if x % i == 0]
    return sorted(set(small + [x // i for i in small]))


def shape_pairs(request: PlanRequest, n_layers: int) -> list[tuple[int, int]]:
    """(stages, replicas) pairs that fit the devices, whole-machine configurations first: good plans early prune
    more. (A fixed replica count bounds the stages too: `analyze`'s device-like re-search fixes it.)"""
    pairs = []
    for K in ([request.stages] if request.stages else range(1, min(request.devices, n_layers) + 1)):
        for d in ([request.data_parallel] if request.data_parallel else range(1, request.devices // K + 1)):
            if K * d <= request.devices:
                pairs.append((K, d))
    pairs.sort(key=lambda kd: (-kd[0] * kd[1], kd[0]))
    return pairs


def configurations(request: PlanRequest, K: int, d: int, n_layers: int) -> Iterator[Config]:
    """Every configuration of K pipeline devices x d replicas worth evaluating, in search order."""
    B = request.batch_size
    for sched in request.schedules:
        rule = facts(sched)
        base = B // d if B % d == 0 else 0
        if not rule.replicates_whole_pipeline:
            base = B
        if not base:
            continue
        for M in ([request.microbatches] if request.microbatches else divisors(base)):
            if base % M or microbatch_problem(sched, K, M) or _skipped(request, sched, K, M):
                continue
            for v in _chunk_options(request, sched, K, M, n_layers):
                for rc in request.recompute_options:
                    for g in (request.recompute_granularities if rc else ("stage",)):
                        if g == "block" and not runs_block_checkpoints(sched):
                            continue  # the runtime checkpoints whole stages there
                        yield Config(schedule=sched, stages=K, data_parallel=d, microbatches=M, chunks=v,
                                     recompute=rc, recompute_granularity=g)


def _skipped(request: PlanRequest, sched: ScheduleName, K: int, M: int) -> bool:
    """Points equivalent to another that is tried anyway."""
    if sched == "pipedream" and M < K and not request.microbatches:
        return True  # async: fewer than K microbatches only relabels the same steady state
    if (sched == "gpipe" and (K == 1 or M == 1) and "1f1b" in request.schedules
            and microbatch_problem("1f1b", K, M) is None):
        return True  # identical to 1f1b there (one stage), which is tried
    return False


def _chunk_options(request: PlanRequest, sched: ScheduleName, K: int, M: int, n_layers: int) -> list[int]:
    """Chunks per device: 1, or for an interleaving schedule the choices that fit the layers
    (the microbatch count was checked by `microbatch_problem`)."""
    if not facts(sched).interleaves:
        return [1]
    if K < 2:
        return []
    fixed = facts(sched).fixed_chunks
    if fixed:  # the V schedules: exactly two stages per device, whatever --chunks asks of the others
        return [fixed] if K * fixed <= n_layers and request.chunks in (None, fixed) else []
    v_list = [request.chunks] if request.chunks else list(CHUNK_CHOICES)
    return [v for v in v_list if v >= 2 and K * v <= n_layers]


def pipedream_microbatch_counts(request: PlanRequest) -> list[int]:
    """Microbatch counts for PipeDream's own optimizer (per-stage replication over the hierarchy)."""
    return [request.microbatches] if request.microbatches else divisors(request.batch_size)
