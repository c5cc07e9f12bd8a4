"""The nearest plan a framework can run, re-predicted, for a plan it cannot express as it is.

Nearest means the fewest changes, each one named: every cut inside a unit (a
decoder block) moves to the closer unit boundary (`names.nearest_unit_split`);
for Megatron the final norm and output layer join the last stage and GPipe
and ZB-H1 become 1F1B (Megatron has neither); a ZeRO level the framework lacks becomes
the closest it has (torchtitan: ZeRO-1 -> FSDP2 without resharding, i.e. ZeRO-2;
Megatron and DeepSpeed: ZeRO-2/3 -> ZeRO-1). The changed plan goes through
`predict`, like every other plan.

When those changes cannot make the plan expressible (DeepSpeed has no
interleaving, Megatron no V schedule, no framework runs PipeDream: the
framework's exporter is the judge) or the changed plan no longer fits
in memory (ZeRO-3 -> ZeRO-1 on a 70B model), the nearest plan is a new one:
the search re-run within what the framework can run (`FRAMEWORK_SPACE`), its
best plan then moved to block boundaries as above.
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.choices import Sharding, ShardingRequest
from pipeplan.costmodels.graph import Graph
from pipeplan.errors import InfeasibleError
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.frameworks.common import plan_units
from pipeplan.planner.frameworks.names import Inexpressible, assignment_from_units, nearest_unit_split, unit_split
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import predict
from pipeplan.planner.replay import config_of, request_of
from pipeplan.schedules import ScheduleRequest, facts

__all__ = ["nearest_plan"]

_SHARDING: dict[str, dict[str, Sharding]] = {"torchtitan": {"zero1": "zero2"}, "megatron": {"zero2": "zero1", "zero3": "zero1"},
             "deepspeed": {"zero2": "zero1", "zero3": "zero1"}}

FRAMEWORK_SPACE: dict[str, tuple[tuple[ScheduleRequest, ...], ShardingRequest]] = {
    # (schedules the framework runs, the highest ZeRO level pipeplan exports for it; the search tries the lower ones)
    "megatron": (("1f1b", "interleaved"), "zero1"),  # megatron.py: no GPipe; ZeRO-1 = --use-distributed-optimizer
    "deepspeed": (("1f1b",), "zero1"),  # deepspeed.py: TrainSchedule only; PipelineModule refuses ZeRO-2/3
    "torchtitan": (("auto",), "auto"),  # torchtitan.py: its schedules cover pipeplan's synchronous ones; FSDP2
}


def _megatron_post_last(split: list[list[int]], post: set[int]) -> list[list[int]]:
    moved = [[u for u in units if u not in post] for units in split[:-1]] + [split[-1]]
    moved[-1] = sorted({*moved[-1], *(u for units in split for u in units if u in post)})
    if any(not units for units in moved):
        raise Inexpressible("moving the final norm and output layer to the last stage empties a stage")
    return moved


def nearest_plan(plan: Plan, framework: str, graph: Graph, profile: HardwareProfile) -> tuple[Plan, list[str]]:
    """(the nearest expressible plan, predicted; the changes made), or Inexpressible when there is none.

    The fewest named changes first; a re-planned one when they cannot express the plan or it stops fitting.
    """
    why = ""
    try:
        near, changes = _expressible(plan, framework, graph, profile)
        if near.predicted.fits or not plan.predicted.fits:
            return near, changes
        why = f"{'; '.join(changes)} does not fit in memory"
    except Inexpressible as e:
        why = str(e)
    for best in _replanned(plan, framework, graph, profile):
        try:
            near, changes = _expressible(best, framework, graph, profile)
        except Inexpressible:
            continue
        if near.predicted.fits:
            return near, [f"re-planned within what {framework} runs ({why}): {config_of(best).describe()}", *changes]
    raise Inexpressible(f"{why}, and no plan {framework} can run fits: re-plan with more devices")


def _replanned(plan: Plan, framework: str, graph: Graph, profile: HardwareProfile) -> list[Plan]:
    """The plans the search keeps within the framework's schedules and ZeRO levels, fastest first."""
    from pipeplan.planner.search import search

    schedules, sharding = FRAMEWORK_SPACE[framework]
    found: list[Plan] = []
    for schedule in schedules:
        request = replace(request_of(plan), schedule=schedule, sharding=sharding)
        try:
            result = search(graph, profile, request)
        except InfeasibleError:
            continue
        found += [result.best, *result.alternatives]
    return sorted((p for p in found if p.predicted.fits), key=lambda p: -p.predicted.samples_per_s)


def _expressible(plan: Plan, framework: str, graph: Graph, profile: HardwareProfile) -> tuple[Plan, list[str]]:
    """`_adjusted`, held to the framework's own exporter: a plan the changes leave inexpressible (a schedule they
    do not map) is not a nearest plan (it was returned, and `export --nearest` failed on it)."""
    from pipeplan.planner.frameworks import export_plan

    near, changes = _adjusted(plan, framework, graph, profile)
    export_plan(near, framework)
    return near, changes


def _adjusted(plan: Plan, framework: str, graph: Graph, profile: HardwareProfile) -> tuple[Plan, list[str]]:
    """The plan with the fewest named changes that make it expressible, predicted (Inexpressible: none do)."""
    if plan.schedule in ("pipedream", "pipedream-2bw"):
        raise Inexpressible(f"no framework runs {plan.schedule}'s asynchronous schedule")
    if framework == "deepspeed" and plan.chunks > 1:
        raise Inexpressible("DeepSpeed has no interleaved schedule")
    pu = plan_units(plan)
    changes: list[str] = []
    try:
        split = unit_split(pu.units, pu.stage_of_layer)
    except Inexpressible as e:
        split = nearest_unit_split(pu.units, pu.stage_of_layer)
        changes.append(f"cuts moved to block boundaries ({e})")
    cfg, request = config_of(plan), request_of(plan)
    if framework == "megatron":
        post = {u for u, unit in enumerate(pu.units.units) if unit.kind not in ("embed", "block")}
        moved = _megatron_post_last(split, post)
        if moved != split:
            changes.append("final norm and output layer moved to the last stage (Megatron's loss stage)")
        split = moved
        if cfg.schedule == "gpipe":
            cfg = replace(cfg, schedule="1f1b")
            changes.append("schedule gpipe -> 1f1b (Megatron has no GPipe)")
        elif facts(cfg.schedule).splits_backward and cfg.chunks == 1:  # ZB-H1: 1F1B's order with W split off
            changes.append(f"schedule {cfg.schedule} -> 1f1b (Megatron has no zero-bubble schedule)")
            cfg = replace(cfg, schedule="1f1b")
    level = _SHARDING[framework].get(cfg.sharding)
    if level:
        changes.append(f"sharding {cfg.sharding} -> {level} (the closest {framework} has)")
        cfg, request = replace(cfg, sharding=level), replace(request, sharding=level)
    by_name = dict(zip(pu.units.layer_names, assignment_from_units(pu.units, split), strict=True))
    try:
        assignment = [by_name[layer.name] for layer in graph.layers]
    except KeyError as e:
        raise Inexpressible(f"the graph has layer {e.args[0]!r}, which the plan does not") from None
    new = predict(graph, profile, assignment, cfg, request,
                  solver={"name": f"nearest {framework}", "changes": changes}).plan
    return new, changes
