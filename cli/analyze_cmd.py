"""`pipeplan analyze model.py --profile P --gpus N`: trace, plan and report in one go.

Everything slow (tracing, searching) happens after every flag, the profile and
the output paths have been checked, so a typo costs milliseconds, not a trace.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Callable

import click

from pipeplan.cli.console import stdout_console
from pipeplan.cli.options import (
    check_output_paths,
    check_split_flags,
    option_given,
    optional_profile_option,
    output_options,
    planning_options,
    split_options,
    trace_options,
)
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
    split: str | None = None,
    split_from: str | None = None,
    retrace: Callable[[Callable, int, str, str], Any] | None = None,
    cluster: Any = None,
) -> None:
    """Shared by `analyze` and `plan`: `load(phases, profile)` returns the graph (tracing if it must).

    With `split`/`split_from`, the user's split is predicted beside the best plan (planner/frameworks/judge.py).
    `retrace(phases, batch, device, dtype)` traces the model again (a model file, not a saved graph): on a local profile,
    or the profile of the GPU this machine has, the chosen configuration is re-timed like a device before the
    report (cli/device_like.py)."""
    from pipeplan.cli.progress import progress_display
    from pipeplan.cli.summary import analyze_document, graph_summary
    from pipeplan.cli.workflow import load_profile, run_search, write_outputs

    check_output_paths(output=output, plot=plot, chrome_trace=chrome_trace)
    check_split_flags(split, split_from)
    request = framework_recipe(request, split_from)
    if cluster is not None:
        return run_cluster_analysis(load, cluster=cluster, request=request, output=output, as_json=as_json,
                                    unsupported={"--plot": plot, "--chrome-trace": chrome_trace, "--split": split,
                                                 "--split-from": split_from})
    profile = load_profile(profile_name)
    request = request.for_profile(profile)
    dtype = request.training_dtype
    profile.flops_for(dtype)  # an unsupported precision (fp32 on a TPU) fails here, before any work
    with quiet_stdout(as_json), progress_display() as phases:
        graph = load(phases, profile)
        user_split = read_split(graph, split, split_from)  # a bad split fails before the search
        result = run_search(graph, profile, request, progress=phases("plan: "))
        if retrace is not None:
            from pipeplan.cli.device_like import (
                measure_slowdown_like_device,
                measure_split_like_device,
                retime_like_device,
            )

            graph, result = retime_like_device(graph, profile, request, result, lambda b, d, t: retrace(phases, b, d, t),
                                               progress=phases("re-plan on device-like times: "))
            result = measure_split_like_device(graph, profile, request, result)
            result = measure_slowdown_like_device(graph, profile, request, result)
        judged = judge(graph, profile, request, result.best, user_split)
    write_outputs(result.best, graph, profile, output=output, plot=plot, chrome_trace=chrome_trace)
    if as_json:
        doc = analyze_document(result, graph, profile, dtype)
        if judged is not None:
            doc["your_split"] = judged.to_dict()
        click.echo(json.dumps(doc))
        return
    from pipeplan.cli.report import judged_split_report, plan_report

    console = stdout_console()
    console.print(plan_report(result.best, model_summary=graph_summary(graph), graph=graph, profile=profile, baseline=result.baseline))
    if judged is not None:
        console.print(judged_split_report(judged))
    for flag, path in (("plan", output), ("plot", plot), ("Chrome trace", chrome_trace)):
        if path:
            console.print(f"[dim]wrote {flag}: {path}[/dim]")


def run_cluster_analysis(load: Callable[[Callable, Any], object], *, cluster, request: PlanRequest, output: str | None,
                         as_json: bool, unsupported: dict[str, Any]) -> None:
    """`analyze`/`plan --cluster`: the mixed-cluster search (planner/mixed_search.py), its plan file, report or JSON."""
    from pipeplan.cli.progress import progress_display
    from pipeplan.cli.summary import cluster_document, graph_summary
    from pipeplan.cli.workflow import check_layer_times
    from pipeplan.errors import UserError
    from pipeplan.planner.mixed_search import cluster_request, mixed_search

    used = [flag for flag, value in unsupported.items() if value is not None]
    if used:
        raise UserError(f"{' and '.join(used)} {'is' if len(used) == 1 else 'are'} not available with --cluster yet",
                        f"drop {', '.join(used)}")
    request = cluster_request(request, cluster)
    for group in cluster.groups:
        group.profile.flops_for(request.training_dtype)  # an unsupported precision fails before any work
    with quiet_stdout(as_json), progress_display() as phases:
        graph = load(phases, cluster.groups[0].profile)
        for group in cluster.groups:
            check_layer_times(graph, group.profile, request)
        result = mixed_search(graph, cluster, request)
    if output:
        result.best.save(output)
    if as_json:
        click.echo(json.dumps(cluster_document(result, graph, cluster, request.training_dtype)))
        return
    from pipeplan.cli.report import plan_report

    console = stdout_console()
    capacity = {g.profile.name: int(g.profile.usable_memory_bytes) for g in cluster.groups}
    console.print(plan_report(result.best, model_summary=graph_summary(graph), graph=graph, baseline=result.baseline,
                              type_capacity=capacity))
    if output:
        console.print(f"[dim]wrote plan: {output}[/dim]")


def framework_recipe(request: PlanRequest, split_from: str | None) -> PlanRequest:
    """With `--split-from` a framework's settings, the plans are counted as that framework trains: with its
    mixed-precision recipe (planner/frameworks/common.FRAMEWORK_RECIPE) unless `--mixed-precision` is given, and
    recomputed a block at a time unless `--recompute-granularity` is (DeepSpeed, Megatron-LM and torchtitan all
    checkpoint each decoder layer). The user is planning for the framework; the defaults, `pipeplan run`'s torch.autocast
    and one checkpoint per stage, would count its memory as another trainer's. (Under a schedule that splits its
    backward the runtime checkpoints whole stages: there recomputation stays per stage.)"""
    if split_from is None:
        return request
    from pipeplan.planner.frameworks.common import FRAMEWORK_RECIPE
    from pipeplan.planner.frameworks.split import source_framework

    if not option_given("mixed_precision"):
        request = replace(request, mixed_precision=FRAMEWORK_RECIPE[source_framework(split_from)])
    if not option_given("recompute_granularity") and not request.recomputes_whole_stages:
        request = replace(request, recompute_granularity="block")
    return request


def read_split(graph, split: str | None, split_from: str | None):
    """The user's split over the graph's layers (None without one); a bad split is a user error naming the flag."""
    from pipeplan.errors import UserError
    from pipeplan.planner.frameworks.split import parse_split, split_from_source

    names = [layer.name for layer in graph.layers]
    params = [float(layer.param_bytes) for layer in graph.layers]
    try:
        if split is not None:
            return parse_split(split, names, lambda i: params[i] > 0)
        if split_from is not None:
            return split_from_source(split_from, names, params)
    except ValueError as e:
        flag = f"--split {split}" if split is not None else f"--split-from {split_from}"
        raise UserError(f"{flag}: {e}", "see docs/cli.md for the split forms") from None
    return None


def judge(graph, profile, request, best, user_split):
    """The user's split predicted beside the best plan, or None without one."""
    if user_split is None:
        return None
    from pipeplan.errors import UserError
    from pipeplan.planner.frameworks.judge import judge_split

    try:
        return judge_split(graph, profile, request.for_profile(profile), best, user_split)
    except ValueError as e:
        raise UserError(f"your split: {e}") from None


@click.command("analyze")
@click.argument("model", metavar="MODEL.py|GRAPH")
@optional_profile_option
@planning_options(with_cluster=True)
@trace_options
@output_options
@split_options
def analyze(model, profile, request, cluster, entry, trace_batch_size, depth, repeats, seq_len, output, as_json, plot,
            chrome_trace, split, split_from):
    """Trace MODEL.py (or read a saved graph.json / PipeDream graph.txt), find the best pipeline plan, report it.

    The model is traced once at a small batch (--trace-batch-size, default 1);
    per-layer FLOPs, bytes and times scale per sample to the microbatch size.
    Layers are timed only when the plan uses the times (a local profile, or
    --times measured); otherwise the model is traced without weights.
    """
    from pipeplan.cli.workflow import is_model_file, layer_times_wanted, load_input_graph

    def load(phases, loaded_profile):
        timed = layer_times_wanted([loaded_profile], request)
        return load_input_graph(model, entry=entry, trace_batch_size=trace_batch_size, depth=depth, repeats=repeats,
                                seq_len=seq_len, progress=phases("trace: "), time_layers=timed)

    def retrace(phases, batch, device, dtype):
        return load_input_graph(model, entry=entry, trace_batch_size=batch, depth=depth, repeats=repeats,
                                seq_len=seq_len, progress=phases("re-time like a device: "), time_layers=True,
                                device=device, dtype=dtype)

    run_analysis(load, profile_name=profile, request=request, output=output, as_json=as_json, plot=plot, chrome_trace=chrome_trace,
                 split=split, split_from=split_from, retrace=retrace if is_model_file(model) else None, cluster=cluster)
