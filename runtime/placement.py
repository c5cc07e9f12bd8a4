"""Which ranks run which stages, and which torch schedule class runs a plan: the checks the launcher makes before
starting any process and each worker makes again; how the replicas' losses make a step's, and how many steps make
one round of a replicated PipeDream stage, which the workers and the launcher's report both compute. Kept free of
torch, so that `pipeplan run` refuses a plan it cannot run without first importing torch.distributed.pipelining
(about a second on this machine's cores)."""

from __future__ import annotations

import math

from pipeplan.errors import UserError
from pipeplan.schedules import facts, stage_device


def stage_ranks(plan) -> dict[int, list[int]]:
    """stage index -> its ranks, one per data-parallel replica of the whole pipeline.

    torch's schedules run stage i on rank i mod P of a pipeline's process group (the V schedules on
    rank i, then 2P - 1 - i: pipeplan.schedules.stage_device), whose ranks are in increasing order, so
    each replica's pipeline devices must increase with the stage index (both of planner.predict.place's
    layouts do).
    """
    if not facts(plan.schedule).flushes:  # asynchronous PipeDream: stages replicated one by one
        from pipeplan.runtime.pipedream import check_async_plan

        return check_async_plan(plan)
    if not facts(plan.schedule).replicates_whole_pipeline or any(len(s.devices) != s.replicas for s in plan.stages):
        raise UserError(
            "this plan replicates stages individually (PipeDream); the runtime runs only whole-pipeline replicas",
            "plan with --schedule 1f1b or gpipe",
        )
    reps = {s.replicas for s in plan.stages}
    d = getattr(plan, "data_parallel", 1) or 1
    if reps != {d}:
        raise UserError(f"stages have {sorted(reps)} replicas but the plan's data_parallel is {d}",
                        "re-plan: every stage must have data_parallel replicas")
    ranks = {s.index: list(s.devices) for s in plan.stages}
    n = len(plan.stages)
    p = len({ranks[s][0] for s in ranks})
    for r in range(d):
        pipe = [ranks[s][r] for s in range(min(p, n))]
        for s in range(n):
            want = stage_device(plan.schedule, s, p)
            if ranks[s][r] != pipe[want] or (s < p and s and pipe[s] <= pipe[s - 1]):
                raise UserError(
                    f"stage {s} is placed on device {ranks[s][r]}, but torch.distributed.pipelining runs stage {s} "
                    f"on pipeline rank {want} (stages go {'in a V' if want != s % p else 'round-robin'} over "
                    "increasing device ranks)",
                    "re-plan with the default placement",
                )
    return ranks


def rank_stages(ranks: dict[int, list[int]], rank: int) -> tuple[int, list[int]]:
    """(replica index, stages) of a rank."""
    for s in sorted(ranks):
        if rank in ranks[s]:
            r = ranks[s].index(rank)
            return r, sorted(t for t in ranks if ranks[t][r] == rank)
    return -1, []


def torch_schedule_class(schedule: str) -> str:
    """The torch.distributed.pipelining class that runs `schedule` (pipeplan.schedules), else the refusal.

    One place for the message: the launcher checks before starting processes, the worker again.
    """
    name = facts(schedule).torch_class
    if name is None:  # asynchronous schedules run in runtime/pipedream.py, not under a torch class
        raise UserError(
            f"asynchronous PipeDream ({schedule}: weight stashing, no flush) is not supported by "
            "torch.distributed.pipelining's classes; the runtime runs it in runtime/pipedream.py's own loop",
            "plan with --schedule 1f1b (PipeDream-Flush), which runs with the same partition",
        )
    return name


def combine_losses(per_replica: list[list[float]], mean: bool) -> list[float]:
    """Global loss per step from each replica's: the mean for batch-mean losses, else the sum."""
    if not per_replica:
        return []
    steps = zip(*per_replica, strict=True)  # every replica's last stage logs one loss per step of the same loop
    return [sum(xs) / len(xs) if mean else sum(xs) for xs in steps]


def whole_rounds(plan, steps: int, warmup: int) -> int:
    """The fewest steps, at least `steps`, that are whole rounds (`steps_per_round`) and measure one round after
    `warmup`: what `pipeplan run`'s default --steps grows to, so a plan runs as the planner emitted it
    (runtime/pipedream.check_async_steps refuses anything else). `steps` itself wherever a round is one step:
    every plan but PipeDream's whose replica counts do not divide a step's microbatches."""
    r = steps_per_round(plan)
    return -(-max(steps, warmup + r) // r) * r


def steps_per_round(plan) -> int:
    """Steps of `pipeplan run` that give every replica of every PipeDream stage a microbatch: 1 elsewhere.

    PipeDream sends microbatch m to replica m mod r of a stage (runtime/pipedream.py), and a step is
    plan.microbatches microbatches. With fewer microbatches a step than replicas (1 stage x 2 replicas, M = 1),
    the replicas take turns by step and run side by side: each replica's steps alternate one round's time and
    none. The fewest steps whose microbatches are a multiple of every replica count is that round.
    PipeDream-2BW replicates whole pipelines, each running every step: 1.
    """
    if plan.schedule != "pipedream":
        return 1
    need = math.lcm(*(len(s.devices) for s in plan.stages))
    return need // math.gcd(need, plan.microbatches)
