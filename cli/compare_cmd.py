"""`pipeplan compare model.py --profiles a,b,c --gpus N`: the best plan on each of several systems.

The model is traced once (tracing measures the model, not the target), and
each profile gets its own full search, so rows differ in stages, microbatches
and schedule as well as in speed: what one would really run on each system.
"""

from __future__ import annotations

import json

import click

from pipeplan.cli.options import planning_options, trace_options


def _split_profiles(value: str) -> list[str]:
    from pipeplan.errors import UserError

    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise UserError("--profiles is empty", "list profile names separated by commas, e.g. a100-80gb-sxm,h100-sxm")
    if len(set(names)) != len(names):
        raise UserError(f"--profiles lists a profile twice: {value}", "list each profile once")
    return names


def _clusters(specs: tuple[str, ...], link: str | None) -> list:
    """The --cluster rows' clusters, parsed before tracing (a bad spec costs no trace)."""
    from pipeplan.cli.options import load_cluster
    from pipeplan.errors import UserError

    if link is not None and not specs:
        raise UserError("--cluster-link needs --cluster", "drop --cluster-link, or give --cluster")
    return [load_cluster(spec, link) for spec in specs]


def _cluster_row(graph, cluster, request) -> dict:
    """A --cluster row: the mixed-cluster search (planner/mixed_search.py), or why it has no plan."""
    from pipeplan.cli.summary import cluster_row
    from pipeplan.errors import UserError
    from pipeplan.planner.mixed_search import cluster_request, mixed_search

    resolved = cluster_request(request, cluster)
    try:
        return cluster_row(cluster, mixed_search(graph, cluster, resolved).best, resolved.training_dtype)
    except UserError as e:  # infeasible or an option a mixed cluster does not take: a row saying so
        return cluster_row(cluster, None, resolved.training_dtype, error=str(e))


@click.command("compare")
@click.argument("model", metavar="MODEL.py|GRAPH")
@click.option("--profiles", "profiles_arg", required=True, help="Comma-separated profile names or .yaml paths.")
@planning_options()
@trace_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout (schema: docs/cli.md).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG bar chart of samples/s per profile.")
@click.option("--cluster", "clusters_arg", multiple=True,
              help="Also a row for this mixed cluster, PROFILE:COUNT,PROFILE:COUNT (repeatable; its own device count, "
                   "not --gpus).")
@click.option("--cluster-link", default=None, help="Link between each --cluster's groups: GBPS[,LATENCY_US].")
def compare(model, profiles_arg, request, entry, trace_batch_size, depth, repeats, seq_len, as_json, plot, clusters_arg,
            cluster_link):
    """Compare the best pipeline plan for MODEL.py (or a saved graph) across hardware profiles."""
    from pipeplan._io import atomic_write_bytes
    from pipeplan.cli.analyze_cmd import quiet_stdout
    from pipeplan.cli.options import check_output_paths
    from pipeplan.cli.progress import progress_display
    from pipeplan.cli.summary import compare_row, graph_summary
    from pipeplan.cli.workflow import layer_times_wanted, load_input_graph, load_profile, run_search
    from pipeplan.errors import InfeasibleError, UserError

    check_output_paths(plot=plot)
    profiles = [load_profile(name) for name in _split_profiles(profiles_arg)]  # unknown names fail before tracing
    clusters = _clusters(clusters_arg, cluster_link)
    rows = []
    with quiet_stdout(as_json), progress_display() as phases:
        graph = load_input_graph(model, entry=entry, trace_batch_size=trace_batch_size, depth=depth, repeats=repeats,
                                 seq_len=seq_len, progress=phases("trace: "),
                                 time_layers=layer_times_wanted(profiles + [g.profile for c in clusters
                                                                            for g in c.groups], request))
        for profile in profiles:
            resolved = request.for_profile(profile)
            dtype = resolved.training_dtype
            try:
                profile.flops_for(dtype)
                result = run_search(graph, profile, resolved, progress=phases(f"{profile.name}: "))
                rows.append(compare_row(profile, result.best, dtype))
            except InfeasibleError as e:  # does not fit this system: a row saying so, not a failed command
                rows.append(compare_row(profile, None, dtype, error=str(e)))
            except UserError as e:
                if len(profiles) == 1:
                    raise
                rows.append(compare_row(profile, None, dtype, error=str(e)))
        rows += [_cluster_row(graph, c, request) for c in clusters]
    if not any(r["feasible"] for r in rows):
        raise InfeasibleError(
            f"no profile has a feasible plan for {graph.name}: " + "; ".join(f"{r['profile']}: {r['error']}" for r in rows),
            "add devices (--gpus), enable --recompute on, or use a smaller batch",
        )
    title = f"{graph.name}: best plan per profile, {request.devices} devices, batch {request.batch_size}"
    if plot:
        from pipeplan.cli.plots import compare_png

        atomic_write_bytes(plot, compare_png(rows, title=title))
    if as_json:
        click.echo(json.dumps({"graph": graph_summary(graph), "devices": request.devices, "batch_size": request.batch_size, "profiles": rows}))
        return
    from pipeplan.cli.console import stdout_console
    from pipeplan.cli.report import compare_table

    console = stdout_console()
    table = compare_table(rows)
    table.title = title
    console.print(table)
    if plot:
        console.print(f"[dim]wrote plot: {plot}[/dim]")
