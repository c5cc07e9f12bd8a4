"""`pipeplan show plan.json`: the report (and pictures) of a saved plan.

A plan file carries per-stage predictions (forward, backward, recompute, send
and all-reduce times per microbatch), which is all the schedule simulator needs,
so `--plot` and `--chrome-trace` work from the plan alone. With `--graph` the
model summary and per-stage parameter counts come back too, and the timeline is
re-simulated from the graph exactly as the search did.
"""

from __future__ import annotations

import json

import click

from pipeplan.cli.options import check_output_paths


def _type_capacities(plan, plan_file: str, load, notes: list[str]) -> dict[str, int]:
    """Usable bytes per device type of a mixed plan's stages; a type whose profile is gone gets a note."""
    from pipeplan.cli.workflow import plan_profile
    from pipeplan.errors import UserError

    capacity = {}
    for name in dict.fromkeys(str(s.device_type) for s in plan.stages):
        try:
            capacity[name] = int(plan_profile(name, plan_file, load).usable_memory_bytes)
        except UserError as e:
            notes.append(f"profile {name!r} not found ({e}); its stages' memory capacity not shown")
    return capacity


@click.command("show")
@click.argument("plan_file", metavar="PLAN.json")
@click.option("--graph", "graph_file", default=None, help="The plan's graph.json, for the model summary and parameter counts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout (schema: docs/cli.md).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG of the simulated schedule and memory.")
@click.option("--chrome-trace", type=click.Path(dir_okay=False), default=None, help="Write the simulated timeline as Chrome trace-event JSON.")
def show(plan_file, graph_file, as_json, plot, chrome_trace):
    """Report a saved PLAN.json (from `pipeplan analyze -o` or `pipeplan plan -o`)."""
    from pipeplan.cli.summary import graph_summary, plan_graph_summary, profile_summary
    from pipeplan.cli.workflow import load_profile, load_saved_graph, plan_profile, write_outputs
    from pipeplan.errors import UserError
    from pipeplan.planner.plan import load_plan, planned_from

    check_output_paths(plot=plot, chrome_trace=chrome_trace)
    plan = load_plan(plan_file)
    graph = None
    if graph_file:
        graph = load_saved_graph(graph_file)
        want = plan.graph.get("fingerprint")
        if want and not planned_from(graph, plan.graph):
            raise UserError(
                f"{graph_file} is not the graph {plan_file} was planned from (fingerprint {graph.fingerprint()} != {want})",
                "pass the graph.json the plan was made from, or drop --graph",
            )
    notes: list[str] = []
    type_capacity = None
    if plan.mixed:  # a mixed cluster's plan: one profile per device type, each stage's own capacity
        profile, type_capacity = None, _type_capacities(plan, plan_file, load_profile, notes)
    else:
        try:
            profile = plan_profile(plan.device_profile, plan_file, load_profile)
        except UserError as e:  # a user profile that moved: the report just loses the capacity column
            profile = None
            notes.append(f"profile {plan.device_profile!r} not found ({e}); memory capacity not shown")
    write_outputs(plan, graph if profile is not None else None, profile, output=None, plot=plot, chrome_trace=chrome_trace)
    summary = graph_summary(graph) if graph is not None else plan_graph_summary(plan)
    if as_json:
        click.echo(json.dumps({
            "plan": plan.to_dict(),
            "graph": summary,
            "profile": profile_summary(profile, plan.dtype) if profile is not None else None,
            "notes": notes,
        }))
        return
    from pipeplan.cli.console import stdout_console
    from pipeplan.cli.report import plan_report

    console = stdout_console()
    console.print(plan_report(plan, model_summary=summary, graph=graph, profile=profile, with_baseline=False,
                              type_capacity=type_capacity))
    for note in notes:
        console.print(f"[yellow]note: {note}[/yellow]")
    for flag, path in (("plot", plot), ("Chrome trace", chrome_trace)):
        if path:
            console.print(f"[dim]wrote {flag}: {path}[/dim]")
