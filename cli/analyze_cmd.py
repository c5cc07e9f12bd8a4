"""`pipeplan analyze model.py --profile P --gpus N`: trace, plan and report in one go.

Everything slow (tracing, searching) happens after every flag, the profile and
the output paths have been checked, so a typo costs milliseconds, not a trace.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import click

from pipeplan.cli.console import stdout_console
from pipeplan.cli.options import check_output_paths, output_options, planning_options, profile_option, trace_options
from pipeplan.planner.request import PlanRequest


def quiet_stdout(active: bool):
    """With --json, anything the user's model.py prints while being traced goes to stderr, not into the document."""
    import contextlib
    import sys

    return contextlib.redirect_stdout(sys.stderr) if active else contextlib.nullcontext()


def run_analysis(
    load: Callable[[Callable, Any], object],
    *,
    profile_name: str,
    request: PlanRequest,
    output: str | None,
    as_json: bool,
    plot: str | None,
    chrome_trace: str | None,
) -> None:
    """Shared by `analyze` and `plan`: `load(phases, profile)` returns the graph (tracing if it must)."""
    from pipeplan.cli.progress import progress_display
    from pipeplan.cli.summary import analyze_document, graph_summary
    from pipeplan.cli.workflow import load_profile, run_search, write_outputs

    check_output_paths(output=output, plot=plot, chrome_trace=chrome_trace)
    profile = load_profile(profile_name)
    request = request.for_profile(profile)
    dtype = request.training_dtype
    profile.flops_for(dtype)  # an unsupported precision (fp32 on a TPU) fails here, before any work
    with quiet_stdout(as_json), progress_display() as phases:
        graph = load(phases, profile)
        result = run_search(graph, profile, request, progress=phases("plan: "))
    write_outputs(result.best, graph, profile, output=output, plot=plot, chrome_trace=chrome_trace)
    if as_json:
        click.echo(json.dumps(analyze_document(result, graph, profile, dtype)))
        return
    from pipeplan.cli.report import plan_report

    console = stdout_console()
    console.print(plan_report(result.best, model_summary=graph_summary(graph), graph=graph, profile=profile, baseline=result.baseline))
    for flag, path in (("plan", output), ("plot", plot), ("Chrome trace", chrome_trace)):
        if path:
            console.print(f"[dim]wrote {flag}: {path}[/dim]")


@click.command("analyze")
@click.argument("model", metavar="MODEL.py|GRAPH")
@profile_option
@planning_options()
@trace_options
@output_options
def analyze(model, profile, request, entry, trace_batch_size, depth, repeats, seq_len, output, as_json, plot, chrome_trace):
    """Trace MODEL.py (or read a saved graph.json / PipeDream graph.txt), find the best pipeline plan, report it.

    The model is traced once at a small batch (--trace-batch-size, default 1);
    per-layer FLOPs, bytes and times scale per sample to the microbatch size.
    Layers are timed only when the plan uses the times (a local profile, or
    --times measured); otherwise the model is traced without weights.
    """
    from pipeplan.cli.workflow import layer_times_wanted, load_input_graph

    def load(phases, loaded_profile):
        timed = layer_times_wanted([loaded_profile], request)
        return load_input_graph(model, entry=entry, trace_batch_size=trace_batch_size, depth=depth, repeats=repeats,
                                seq_len=seq_len, progress=phases("trace: "), time_layers=timed)

    run_analysis(load, profile_name=profile, request=request, output=output, as_json=as_json, plot=plot, chrome_trace=chrome_trace)
