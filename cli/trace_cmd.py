"""`pipeplan trace model.py`: trace a model into a measured layer graph (pipeplan.graph/v1).

Progress goes to stderr, the summary to stdout (or, with --json, the graph document
and nothing else), and the file is written atomically only after everything
succeeded, so a failed trace never leaves a graph behind.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from pipeplan.cli.fmt import fmt_bytes, fmt_count, fmt_flops, fmt_ms, fmt_seconds, shorten
from pipeplan.cli.progress import progress_display
from pipeplan.errors import UserError


@click.command("trace")
@click.argument("model_file", type=click.Path(dir_okay=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=8, show_default=True,
              help="Samples per batch to trace at (costs are for this batch).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="graph.json", show_default=True,
              help="Graph file to write (pipeplan.graph/v1, see docs/graph-format.md).")
@click.option("--entry", default="build_model", show_default=True, help="Builder function in the model file.")
@click.option("--depth", type=click.IntRange(min=1), default=None,
              help="Group ops by modules at this nesting depth [default: leaf modules].")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Timed training steps after the warm-up [default: as many as fit in ~10 s, 1 to 10].")
@click.option("--no-fvcore-check", is_flag=True, help="Skip the fvcore FLOP cross-check.")
@click.option("--json", "as_json", is_flag=True, help="Print the graph document to stdout instead of the summary.")
@click.option("--debug", is_flag=True, hidden=True)
def trace(model_file, batch_size, output, entry, depth, repeats, no_fvcore_check, as_json, debug):
    """Trace MODEL_FILE (defines build_model and example_inputs) into a measured layer graph."""
    from pipeplan.costmodels.trace import trace as run_trace

    folder = Path(output).parent
    if str(folder) and not folder.is_dir():
        raise UserError(f"-o {output}: folder {folder} does not exist", "create it or pick another output path")
    # With --json, stdout carries the document only: whatever the user's code prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with quiet, progress_display(enabled=True) as phases:
        graph = run_trace(model_file, batch_size, entry=entry, depth=depth, repeats=repeats,
                          progress=phases("trace: "), fvcore_check=not no_fvcore_check)
    graph.save(output)
    if as_json:
        click.echo(json.dumps(graph.to_dict(), indent=1))
        return
    print_summary(graph, output)


def print_summary(graph, output: str | None = None, console: Console | None = None, top: int = 10) -> None:
    console = console or Console()
    t = graph.totals()
    step_s = sum(l.fwd_s + l.bwd_s for l in graph.layers)
    head = Table(title=f"{graph.name}: traced at batch {graph.batch_size}", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("layers", f"{t['layers']} ({len(graph.edges)} edges)")
    head.add_row("parameters", f"{fmt_count(t['param_bytes'] // 4)} ({fmt_bytes(t['param_bytes'])} fp32)")
    head.add_row("forward FLOPs", fmt_flops(t["fwd_flops"]))
    head.add_row("backward FLOPs", fmt_flops(t["bwd_flops"]))
    head.add_row("peak saved activations", fmt_bytes(t["peak_activation_bytes"]))
    head.add_row("measured step (fwd + bwd)", f"{fmt_seconds(step_s)} (median of {graph.source.get('repeats')})")
    for s in graph.shared_params:
        head.add_row("shared parameter", f"{s.name} ({fmt_bytes(s.bytes)}) used by {', '.join(s.layers)}")
    if output:
        head.add_row("written", str(output))
    console.print(head)

    heavy = sorted(graph.layers, key=lambda l: l.fwd_s + l.bwd_s, reverse=True)[:top]
    table = Table(title=f"heaviest {len(heavy)} layers by time")
    for col in ("layer", "kind"):
        table.add_column(col)
    for col in ("fwd ms", "bwd ms", "share", "fwd FLOPs", "params", "saved", "output"):
        table.add_column(col, justify="right")
    for l in heavy:
        share = (l.fwd_s + l.bwd_s) / step_s if step_s else 0.0
        table.add_row(shorten(l.name, 32), l.kind, fmt_ms(l.fwd_s), fmt_ms(l.bwd_s), f"{share:.1%}",
                      fmt_flops(l.fwd_flops), fmt_bytes(l.param_bytes), fmt_bytes(l.saved_bytes),
                      fmt_bytes(l.output_bytes))
    console.print(table)
    for note in graph.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
