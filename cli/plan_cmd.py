"""`pipeplan plan graph.json --profile P --gpus N`: plan from a saved trace, without re-tracing.

Tracing is the slow, machine-bound step; planning is cheap and is what people
repeat while trying profiles and options, so it has its own command.
"""

from __future__ import annotations

import click

from pipeplan.cli.options import (
    MAX_BATCH_SIZE,
    count,
    optional_profile_option,
    output_options,
    planning_options,
    split_options,
)


@click.command("plan")
@click.argument("graph_file", metavar="GRAPH")
@optional_profile_option
@planning_options(with_cluster=True)
@output_options
@click.option("--profiled-batch-size", type=count(MAX_BATCH_SIZE), default=None,
              help="For a PipeDream graph.txt: the minibatch size its times were measured at (the file does not "
                   "record it; PipeDream's image models used 64-256). Without it, times count as per sample.")
@split_options
def plan(graph_file, profile, request, cluster, output, as_json, plot, chrome_trace, profiled_batch_size, split, split_from):
    """Find the best pipeline plan for a saved GRAPH (graph.json from `pipeplan trace`, or a PipeDream graph.txt)."""
    from pipeplan.cli.analyze_cmd import run_analysis
    from pipeplan.cli.workflow import load_saved_graph
    from pipeplan.errors import UserError

    def load(phases, _profile):  # a saved graph needs no profile to load
        from pathlib import Path

        if Path(graph_file).is_dir():
            raise UserError(f"{graph_file}: is a folder", "pass a graph.json from `pipeplan trace` or a PipeDream graph.txt")
        if not Path(graph_file).is_file():
            raise UserError(f"{graph_file}: no such file", "pass a graph.json from `pipeplan trace` or a PipeDream graph.txt")
        return load_saved_graph(graph_file, profiled_batch_size=profiled_batch_size)

    run_analysis(load, profile_name=profile, request=request, output=output, as_json=as_json, plot=plot, chrome_trace=chrome_trace,
                 split=split, split_from=split_from, cluster=cluster)
