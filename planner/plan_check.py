"""Validate a plan.json document before `Plan.from_dict` builds it: every field, then the plan's shape.

`show` renders a plan and `run` trains it, so a plan with a stage removed, a
layer in two stages, a device the plan does not have or a microbatch count its
schedule cannot run must be refused at load, naming the file and the field,
not after seconds of work (or, worse, rendered as if it were whole).
"""

from __future__ import annotations

import os
from typing import Any

from pipeplan.fields import Fields
from pipeplan.schedules import SCHEDULE_NAMES, microbatch_problem

HINT = "re-create it with `pipeplan analyze -o`"
STAGE_PREDICTED = ("fwd_s", "bwd_s", "compute_s", "send_s", "allreduce_s", "op_overhead_s", "fwd_comm_s", "bwd_comm_s",
                   "optimizer_s", "wgrad_s", "fresh_grad_s", "recompute_s", "wgrad_recompute_s")


def check_plan_doc(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    f = Fields(path, HINT)
    schedule = f.string(f.require(doc, "schedule", "schedule"), "schedule")
    if schedule not in SCHEDULE_NAMES:
        raise f.fail("schedule", schedule, f"one of {', '.join(SCHEDULE_NAMES)}")
    m = f.integer(f.require(doc, "microbatches", "microbatches"), "microbatches", low=1)
    batch = f.integer(f.require(doc, "batch_size", "batch_size"), "batch_size", low=1)
    d = f.integer(doc.get("data_parallel", 1), "data_parallel", low=1)
    chunks = f.integer(doc.get("chunks", 1), "chunks", low=1)
    devices = f.integer(doc.get("devices", 0), "devices")
    if batch % (m * d):
        raise f.fail("batch_size", batch, f"divisible by microbatches x data_parallel = {m} x {d}")
    graph = f.mapping(f.require(doc, "graph", "graph"), "graph")
    stages = f.items(f.require(doc, "stages", "stages"), "stages", empty=False)
    indices = [s.get("index") if isinstance(s, dict) else None for s in stages]
    if all(isinstance(i, int) for i in indices) and indices != list(range(len(stages))):
        raise f.fail("stages", f"stages {indices}", "numbered 0, 1, ... in order (a stage was removed or reordered)")
    for i, stage in enumerate(stages):
        _check_stage(f, stage, i, devices)
    _check_coverage(f, stages, graph)
    pipeline = len(stages) // chunks
    if len(stages) % chunks:
        raise f.fail("chunks", chunks, f"a divisor of the {len(stages)} stages")
    problem = microbatch_problem(schedule, pipeline, m)
    if problem:
        raise f.fail("microbatches", m, f"what {schedule} can run: it {problem}")
    for key, value in f.mapping(f.require(doc, "predicted", "predicted"), "predicted").items():
        if key == "fits":
            f.boolean(value, "predicted.fits")
        else:
            f.number(value, f"predicted.{key}", low=-ROUNDING)
    _check_descriptive(f, doc, graph)


ROUNDING = 1e-9
"""Predicted fractions and times come from float arithmetic: a bubble of -2.2e-16 is a zero, not an error."""


def _check_descriptive(f: Fields, doc: dict[str, Any], graph: dict[str, Any]) -> None:
    """The fields `show` prints and `run` reads besides the stages: right types, so no reader trips on them."""
    f.string(f.require(doc, "profile", "profile"), "profile")
    for key in ("dtype", "optimizer", "optimizer_kernels", "times", "sharding", "mixed_precision", "recompute_granularity"):
        if key in doc:
            f.string(doc[key], key)
    f.boolean(doc.get("recompute", False), "recompute")
    f.boolean(doc.get("collectives_overlap", True), "collectives_overlap")
    f.boolean(doc.get("receives_wait", False), "receives_wait")
    if f.number(doc.get("overlap_slowdown", 0.0), "overlap_slowdown") >= 1:
        raise f.fail("overlap_slowdown", doc["overlap_slowdown"], "a fraction below 1 (0.189: compute 18.9% slower)")
    for i, group in enumerate(f.items(doc.get("tied_stages", []), "tied_stages")):
        for stage in f.items(group, f"tied_stages[{i}]"):
            if f.integer(stage, f"tied_stages[{i}]") >= len(doc["stages"]):
                raise f.fail(f"tied_stages[{i}]", stage, f"a stage index below {len(doc['stages'])}")
    f.items(doc.get("alternatives", []), "alternatives")
    for i, alt in enumerate(doc.get("alternatives", [])):
        f.mapping(alt, f"alternatives[{i}]")
    f.strings(doc.get("notes", []), "notes")
    f.mapping(doc.get("solver", {}), "solver")
    for key in ("model_file", "entry", "name", "op_fingerprint"):
        f.optional_string(graph.get(key), f"graph.{key}")
    f.string(f.require(graph, "fingerprint", "graph.fingerprint"), "graph.fingerprint")
    if graph.get("trace_batch_size") is not None:
        f.integer(graph["trace_batch_size"], "graph.trace_batch_size", low=1)


def _check_stage(f: Fields, stage: Any, i: int, devices: int) -> None:
    field = f"stages[{i}]"
    f.mapping(stage, field)
    f.integer(f.require(stage, "index", f"{field}.index"), f"{field}.index", low=i, high=i)
    f.strings(f.require(stage, "layers", f"{field}.layers"), f"{field}.layers", empty=False)
    ranks = f.items(f.require(stage, "devices", f"{field}.devices"), f"{field}.devices", empty=False)
    for j, rank in enumerate(ranks):
        f.integer(rank, f"{field}.devices[{j}]", high=devices - 1 if devices else None)
    f.integer(stage.get("replicas", 1), f"{field}.replicas", low=1)
    if stage.get("device_type") is not None:  # optional (mixed clusters): a profile name
        f.string(stage["device_type"], f"{field}.device_type")
    for key, value in f.mapping(stage.get("predicted", {}), f"{field}.predicted").items():
        if key in STAGE_PREDICTED or key.endswith("_bytes"):
            f.number(value, f"{field}.predicted.{key}", low=-ROUNDING)


def _check_coverage(f: Fields, stages: list[dict[str, Any]], graph: dict[str, Any]) -> None:
    """Every layer in exactly one stage, and as many layers as the traced graph had."""
    owner: dict[str, int] = {}
    for i, stage in enumerate(stages):
        for name in stage["layers"]:
            if name in owner:
                raise f.fail(f"stages[{i}].layers", name, f"layers of this stage only (stage {owner[name]} has it too)")
            owner[name] = i
    count = graph.get("layers")
    if count is not None and f.integer(count, "graph.layers", low=1) != len(owner):
        raise f.fail("stages", f"{len(owner)} layers", f"all {count} layers of graph {graph.get('name', '')!r} "
                     "(a stage was removed or edited)")
