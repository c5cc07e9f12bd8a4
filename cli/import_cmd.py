"""`pipeplan import graph.txt -o graph.json`: convert a PipeDream profile once.

Planning reads PipeDream files directly too; converting is for people who want
to inspect, edit or version the graph in pipeplan's documented JSON format.
"""

from __future__ import annotations

import json

import click

from pipeplan.cli.options import MAX_BATCH_SIZE, count


@click.command("import")
@click.argument("pipedream_file", metavar="GRAPH_TXT")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the graph JSON.")
@click.option("--batch-size", type=count(MAX_BATCH_SIZE), default=1, show_default=True,
              help="Minibatch size the profile was taken at (PipeDream files do not record it).")
@click.option("--name", default=None, help="Graph name (default: from the file name).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout instead of a table.")
def import_(pipedream_file, output, batch_size, name, as_json):
    """Convert a PipeDream profiler GRAPH_TXT into a pipeplan graph JSON."""
    from pipeplan._io import check_destination
    from pipeplan.costmodels.pipedream_import import load_pipedream_graph

    check_destination(output, "-o")
    graph = load_pipedream_graph(pipedream_file, batch_size=batch_size, name=name)
    graph.save(output)
    totals = graph.totals()
    summary = {
        "output": output,
        "name": graph.name,
        "layers": totals["layers"],
        "edges": len(graph.edges),
        "param_bytes": totals["param_bytes"],
        "fwd_s": sum(l.fwd_s for l in graph.layers),
        "bwd_s": sum(l.bwd_s for l in graph.layers),
        "inputs": sorted(graph.inputs),
        "fingerprint": graph.fingerprint(),
    }
    if as_json:
        click.echo(json.dumps(summary))
        return
    from rich.table import Table

    from pipeplan.cli.console import stdout_console

    table = Table(title=f"imported {graph.name}", show_header=False)
    table.add_row("layers", str(summary["layers"]))
    table.add_row("edges", str(summary["edges"]))
    table.add_row("parameters", f"{summary['param_bytes'] / 2**20:.1f} MiB")
    table.add_row("forward / backward", f"{summary['fwd_s'] * 1e3:.1f} ms / {summary['bwd_s'] * 1e3:.1f} ms per profiled minibatch")
    table.add_row("inputs", ", ".join(summary["inputs"]) or "-")
    table.add_row("written", output)
    stdout_console().print(table)
