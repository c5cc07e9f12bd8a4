"""`pipeplan export plan.json --to torchtitan|megatron|deepspeed`: the plan as the framework's own settings.

A plan the framework cannot express (a cut inside a decoder block, names that do
not map, a schedule or ZeRO level it lacks) exits 2 saying exactly why; with
`--nearest` the closest plan it can run is re-predicted (from `--graph`, or the
model file the plan records) and exported, its cost printed beside the original's.
"""

from __future__ import annotations

import json
from typing import Any

import click

EXPORT_FORMAT = "pipeplan.export/v1"


def _graph_for(plan, plan_file: str, graph_file: str | None):
    """The plan's graph: --graph (a graph.json, model.py or config.json), else the model file the plan records."""
    from pathlib import Path

    from pipeplan.cli.workflow import load_input_graph
    from pipeplan.errors import UserError
    from pipeplan.planner.plan import planned_from

    info = plan.graph or {}
    source = graph_file or info.get("model_file")
    if not source or not Path(source).is_file():
        raise UserError(f"{plan_file}: --nearest re-predicts the plan and needs its graph",
                        "pass --graph GRAPH (the graph.json, model.py or config.json the plan was made from)")
    if graph_file and Path(graph_file).suffix.lower() == ".json" and _is_graph(graph_file):
        graph = load_input_graph(graph_file)
    else:
        graph = load_input_graph(source, seq_len=info.get("seq_len"), depth=info.get("depth"),
                                 trace_batch_size=info.get("trace_batch_size"), time_layers=plan.times == "measured")
    want = info.get("fingerprint")
    if want and not planned_from(graph, info):
        raise UserError(f"{source} is not the graph {plan_file} was planned from "
                        f"(fingerprint {graph.fingerprint()} != {want})", "pass the plan's own graph with --graph")
    return graph


def _is_graph(path: str) -> bool:
    from pipeplan.cli.workflow import json_kind

    return json_kind(path) == "graph"


def _summary(plan) -> dict[str, Any]:
    p = plan.predicted
    return {"samples_per_s": p.samples_per_s, "iteration_s": p.iteration_s, "peak_memory_bytes": p.peak_memory_bytes,
            "fits": p.fits, "schedule": plan.schedule, "sharding": plan.sharding,
            "layer_counts": [len(s.layers) for s in plan.stages]}


def _render(doc: dict[str, Any]) -> str:
    from pipeplan.cli.fmt import fmt_bytes

    lines = []
    if not doc["exact"]:
        o, n = doc["original"], doc["nearest"]
        lines += [f"{doc['framework']} cannot express {doc['plan_file']} as planned: {doc['reason']}",
                  "nearest plan it can run: " + "; ".join(n["changes"]),
                  f"  planned: {o['samples_per_s']:,.1f} samples/s, peak {fmt_bytes(o['peak_memory_bytes'])}",
                  f"  nearest: {n['samples_per_s']:,.1f} samples/s, peak {fmt_bytes(n['peak_memory_bytes'])}"
                  f" ({n['samples_per_s'] / o['samples_per_s']:.3f}x the planned throughput"
                  f"{'' if n['fits'] else ', DOES NOT FIT in memory'})", ""]
    for label, text in doc["snippets"].items():
        lines += [f"# --- {label} ---", text.rstrip("\n"), ""]
    lines += [f"# note: {note}" for note in doc["notes"]]
    return "\n".join(lines)


@click.command("export")
@click.argument("plan_file", metavar="PLAN.json")
@click.option("--to", "framework", required=True, type=click.Choice(["torchtitan", "megatron", "deepspeed"]),
              help="The framework whose settings to print.")
@click.option("--nearest", is_flag=True, help="When the framework cannot express the plan, export the nearest plan "
                                              "it can, re-predicted, with its cost beside the plan's.")
@click.option("--graph", "graph_file", default=None,
              help="The plan's graph (graph.json, model.py or config.json) for --nearest [default: the plan's model file].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (pipeplan.export/v1, docs/cli.md).")
def export(plan_file, framework, nearest, graph_file, as_json):
    """Print PLAN.json as torchtitan, Megatron-LM or DeepSpeed settings (docs/frameworks-*.md)."""
    from pipeplan.cli.workflow import load_profile
    from pipeplan.errors import UserError
    from pipeplan.planner.frameworks import Inexpressible, export_plan
    from pipeplan.planner.plan import load_plan

    plan = load_plan(plan_file)
    doc: dict[str, Any] = {"format": EXPORT_FORMAT, "framework": framework, "plan_file": plan_file, "exact": True,
                           "reason": None, "original": _summary(plan), "nearest": None}
    try:
        exp = export_plan(plan, framework)
    except Inexpressible as e:
        if not nearest:
            raise UserError(f"{plan_file}: {framework} cannot express this plan: {e}",
                            "pass --nearest for the nearest plan it can run, with its predicted cost") from None
        if plan.mixed:
            raise UserError(f"{plan_file}: {framework} cannot express this plan ({e}); --nearest re-plans on one "
                            "device type and this plan is for a mixed cluster",
                            "re-plan with --cluster and the options the message names") from None
        from pipeplan.planner.frameworks.nearest import nearest_plan

        try:
            near, changes = nearest_plan(plan, framework, _graph_for(plan, plan_file, graph_file),
                                         load_profile(plan.device_profile))
            exp = export_plan(near, framework)
        except Inexpressible as e2:
            raise UserError(f"{plan_file}: {framework} cannot express this plan ({e}) and has no nearest plan: {e2}",
                            "re-plan with the options the message names") from None
        doc.update(exact=False, reason=str(e), nearest={**_summary(near), "changes": changes, "plan": near.to_dict()})
    if plan.mixed:  # frameworks place pipeline rank s by launch order: the user puts it on its device type
        exp.notes.append("mixed cluster: launch the ranks so that pipeline stage s runs on its device type ("
                         + ", ".join(f"stage {st.index}: {st.device_type}" for st in plan.stages) + ")")
    doc.update(exp.to_dict())
    click.echo(json.dumps(doc) if as_json else _render(doc))
