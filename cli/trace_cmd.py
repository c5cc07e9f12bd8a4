"""`pipeplan trace model.py`: trace a model into a measured layer graph (pipeplan.graph/v1).

Progress goes to stderr, the summary to stdout (or, with --json, the graph document
and nothing else), and the file is written atomically only after everything
succeeded, so a failed trace never leaves a graph behind.
"""

from __future__ import annotations

import contextlib
import json
import sys

import click
from rich.console import Console
from rich.table import Table

from pipeplan._io import check_destination
from pipeplan.cli.console import stdout_console
from pipeplan.cli.fmt import fmt_bytes, fmt_count, fmt_flops, fmt_ms, fmt_seconds, shorten
from pipeplan.cli.options import MAX_DEPTH, MAX_REPEATS, MAX_SEQ_LEN, MAX_TRACE_BATCH_SIZE, count, device_option
from pipeplan.cli.progress import progress_display
from pipeplan.errors import UserError


@click.command("trace")
@click.argument("model_file", type=click.Path(dir_okay=True))
@click.option("--batch-size", "-b", type=count(MAX_TRACE_BATCH_SIZE), default=8, show_default=True,
              help="Samples per batch to trace at (costs are for this batch).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="graph.json", show_default=True,
              help="Graph file to write (pipeplan.graph/v1, see docs/graph-format.md).")
@click.option("--entry", default="build_model", show_default=True, help="Builder function in the model file.")
@click.option("--depth", type=count(MAX_DEPTH), default=None,
              help="Group ops by modules at this nesting depth [default: leaf modules].")
@click.option("--repeats", type=count(MAX_REPEATS), default=None,
              help="Timed training steps after the warm-up [default: as many as fit in ~10 s, 1 to 10].")
@click.option("--seq-len", type=count(MAX_SEQ_LEN), default=None,
              help="Training sequence length when MODEL_FILE is a Hugging Face config.json "
                   "[default: its max_position_embeddings, at most 4096].")
@click.option("--no-times", is_flag=True,
              help="Do not time layers: trace without weights (no parameter memory) for planning on catalogue "
                   "profiles, whose roofline needs FLOPs and bytes only.")
@click.option("--no-fvcore-check", is_flag=True, help="Skip the fvcore FLOP cross-check.")
@device_option
@click.option("--dtype", type=click.Choice(["fp32", "tf32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Precision the layers are timed in, as `pipeplan run` trains a plan of it (bf16, fp16: "
                   "torch.autocast); "
                   "a plan takes the times in that dtype only.")
@click.option("--json", "as_json", is_flag=True, help="Print the graph document to stdout instead of the summary.")
@click.option("--debug", is_flag=True, hidden=True)
def trace(model_file, batch_size, output, entry, depth, repeats, seq_len, no_times, no_fvcore_check, device, dtype,
          as_json, debug):
    """Trace MODEL_FILE (defines build_model and example_inputs, or is a Hugging Face config.json) into a measured layer graph."""
    from pipeplan.costmodels.trace import resolve_device
    from pipeplan.costmodels.trace import trace as run_trace

    check_destination(output, "-o")
    device = resolve_device(device) if not no_times else "cpu"  # --device cuda without a GPU: exit 2 before tracing
    if no_times and repeats is not None:
        raise UserError("--repeats counts timed steps, but --no-times times nothing", "drop one of them")
    if no_times and dtype != "fp32":
        raise UserError(f"--dtype {dtype} is the precision layers are timed in, but --no-times times nothing",
                        "drop one of them; a plan's --dtype sets the roofline's precision")
    # With --json, stdout carries the document only: whatever the user's code prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with quiet, progress_display(enabled=True) as phases:
        graph = run_trace(model_file, batch_size, entry=entry, depth=depth, repeats=repeats,
                          progress=phases("trace: "), fvcore_check=not no_fvcore_check, seq_len=seq_len,
                          time_layers=not no_times, device=device, dtype=dtype)
    graph.save(output)
    if as_json:
        click.echo(json.dumps(graph.to_dict(), indent=1))
        return
    print_summary(graph, output)


def print_summary(graph, output: str | None = None, console: Console | None = None, top: int = 10) -> None:
    console = console or stdout_console()  # piped: no padding, no cells wrapped at 80 columns
    t = graph.totals()
    step_s = sum(l.fwd_s + l.bwd_s for l in graph.layers)
    head = Table(title=f"{graph.name}: traced at batch {graph.batch_size}", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("layers", f"{t['layers']} ({len(graph.edges)} edges)")
    frozen = t["frozen_param_bytes"]
    trainable = f"; {fmt_count((t['param_bytes'] - frozen) // 4)} trainable, the rest frozen" if frozen else ""
    head.add_row("parameters", f"{fmt_count(t['param_bytes'] // 4)} ({fmt_bytes(t['param_bytes'])} fp32{trainable})")
    head.add_row("forward FLOPs", fmt_flops(t["fwd_flops"]))
    head.add_row("backward FLOPs", fmt_flops(t["bwd_flops"]))
    head.add_row("peak saved activations", fmt_bytes(t["peak_activation_bytes"]))
    timed = graph.source.get("timed") is not False
    if timed:
        head.add_row("measured step (fwd + bwd)", f"{fmt_seconds(step_s)} (median of {graph.source.get('repeats')})")
    else:
        how = "without weights" if graph.source.get("weights") == "meta" else "with real weights"
        head.add_row("measured step (fwd + bwd)", f"not timed (--no-times; traced {how})")
    for s in graph.shared_params:
        head.add_row("shared parameter", f"{s.name} ({fmt_bytes(s.bytes)}) used by {', '.join(s.layers)}")
    if output:
        head.add_row("written", str(output))
    console.print(head)

    def weight(l):
        return l.fwd_s + l.bwd_s if timed else l.fwd_flops + l.bwd_flops

    heavy = sorted(graph.layers, key=weight, reverse=True)[:top]
    table = Table(title=f"heaviest {len(heavy)} layers by {'time' if timed else 'FLOPs'}")
    for col in ("layer", "kind"):
        table.add_column(col)
    for col in ("fwd ms", "bwd ms", "share", "fwd FLOPs", "params", "saved", "output"):
        table.add_column(col, justify="right")
    total = sum(weight(l) for l in graph.layers)
    for l in heavy:
        share = weight(l) / total if total else 0.0
        fwd_ms, bwd_ms = (fmt_ms(l.fwd_s), fmt_ms(l.bwd_s)) if timed else ("-", "-")
        table.add_row(shorten(l.name, 32), l.kind, fwd_ms, bwd_ms, f"{share:.1%}",
                      fmt_flops(l.fwd_flops), fmt_bytes(l.param_bytes), fmt_bytes(l.saved_bytes),
                      fmt_bytes(l.output_bytes))
    console.print(table)
    for note in graph.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
