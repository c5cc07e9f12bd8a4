"""Click options shared by `analyze`, `plan` and `compare`, and their checks.

The three commands plan the same way, so the flags are declared once here and
arrive in the command as one `PlanRequest` (planner/request.py), built once and
passed whole to the search. The checks that need several flags at once
(microbatches dividing the batch, stages against devices) are the request's own,
so every command, and every library caller, rejects the same combinations with
the same message; the output paths are checked here, before any work.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import click

from pipeplan._io import check_destination
from pipeplan.choices import (
    DEFAULT_MIXED_PRECISION,
    DTYPE_CHOICES,
    MIXED_PRECISIONS,
    OPTIMIZER_KERNELS,
    OPTIMIZERS,
    RECOMPUTE_CHOICES,
    RECOMPUTE_GRANULARITY_CHOICES,
    SHARDING_CHOICES,
    SOLVERS,
    TIMES,
)
from pipeplan.errors import UserError
from pipeplan.planner.request import PlanRequest
from pipeplan.schedules import SEARCH_SCHEDULE_CHOICES

# "all" (async PipeDream too) is a library option; the command line names schedules one by one.
SCHEDULE_CHOICES = tuple(c for c in SEARCH_SCHEDULE_CHOICES if c != "all")

DEFAULT_BATCH_SIZE = 64
# Tracing runs the model for real (warm-up + timed repeats); per-layer FLOPs and
# bytes scale linearly with the batch, so the cost models only need one small
# trace. Batch 1 keeps GPT-2-small's trace well inside the 90 s budget.
DEFAULT_TRACE_BATCH_SIZE = 1
DEFAULT_MAX_SEQ_LEN = 4096  # costmodels/hf_config.py's cap on the default --seq-len (kept equal by a test)

# Upper bounds of the counting flags, far beyond any real job but small enough that the search stays quick:
# unbounded, `--gpus 1e23` or `-b 1e25` ran until the machine was out of memory (the search enumerates
# devices and the divisors of the batch) and `-m 1e6` simulated a million microbatches per candidate.
MAX_DEVICES = 2**18
MAX_BATCH_SIZE = 2**24
MAX_MICROBATCHES = 4096
MAX_TRACE_BATCH_SIZE = 2**16
MAX_SEQ_LEN = 2**20
MAX_DEPTH = 64
MAX_REPEATS = 1000


def count(most: int) -> click.IntRange:
    """A positive count of at most `most` (click names the flag and the range when a value is outside it)."""
    return click.IntRange(min=1, max=most)


def _choice(values) -> click.Choice:
    return click.Choice(values, case_sensitive=False)


def planning_options(*, with_profile: bool = True, with_cluster: bool = False) -> Callable:
    """Decorator adding the planning flags; the command receives them as one `request: PlanRequest`.

    with_cluster: --cluster/--cluster-link too, which replace --profile and --gpus; the command then receives
    `cluster` (a `planner.cluster.Cluster`, or None) and `profile` None with it."""

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, gpus, batch_size, microbatches, schedule, stages, solver, dtype, optimizer, recompute,
                    recompute_granularity, times, sharding, mixed_precision, optimizer_kernels, **kw):
            if with_cluster:
                gpus = _cluster_or_devices(kw, gpus)
            request = PlanRequest(devices=gpus, batch_size=batch_size, microbatches=microbatches,
                                  schedule=schedule.lower(), stages=stages, solver=solver.lower(),
                                  dtype=dtype.lower(), optimizer=optimizer.lower(), recompute=recompute.lower(),
                                  recompute_granularity=recompute_granularity.lower(),
                                  times=times.lower(), sharding=sharding.lower(), mixed_precision=mixed_precision.lower(),
                                  optimizer_kernels=optimizer_kernels.lower())
            return f(*args, request=request, **kw)

        decorators = [
            click.option("--gpus", "--devices", "gpus", type=count(MAX_DEVICES), required=not with_cluster,
                         help="Number of accelerators available" + (" (or --cluster)." if with_cluster else ".")),
            click.option("--batch-size", "-b", type=count(MAX_BATCH_SIZE), default=DEFAULT_BATCH_SIZE, show_default=True, help="Global batch size (samples per iteration)."),
            click.option("--microbatches", "-m", type=count(MAX_MICROBATCHES), default=None, help="Microbatches per iteration (default: searched)."),
            click.option("--schedule", type=_choice(SCHEDULE_CHOICES), default="auto", show_default=True, help="Pipeline schedule."),
            click.option("--stages", "-k", type=count(MAX_DEVICES), default=None, help="Pipeline stages (default: searched)."),
            click.option("--solver", type=_choice(SOLVERS), default="auto", show_default=True, help="Partitioner: DP for chains, ILP for DAGs."),
            click.option("--dtype", type=_choice(DTYPE_CHOICES), default="auto", show_default=True,
                         help="Training precision; auto = fp32 on a local profile, else bf16 mixed precision (fp16 where there is no "
                              "bf16; fp32 where no 16-bit rate beats fp32, as on Pascal)."),
            click.option("--optimizer", type=_choice(OPTIMIZERS), default="adam", show_default=True, help="Optimizer (sets its state memory)."),
            click.option("--optimizer-kernels", type=_choice(OPTIMIZER_KERNELS), default="auto", show_default=True,
                         help="How the framework steps the optimizer: fused (one pass: torchtitan, Megatron, DeepSpeed) "
                              "or foreach (torch.optim's default passes: torch without fused=True, Composer); auto = "
                              "how `pipeplan run` steps on the profile's device (CPU: torch's defaults; GPU: fused)."),
            click.option("--recompute", type=_choice(RECOMPUTE_CHOICES), default="auto", show_default=True, help="Activation recomputation."),
            click.option("--recompute-granularity", type=_choice(RECOMPUTE_GRANULARITY_CHOICES), default="stage",
                         show_default=True,
                         help="What one checkpoint covers: a stage (keeps each microbatch's stage input, re-runs the "
                              "stage) or each block (keeps every decoder block's input, re-runs one block at a time, "
                              "as Megatron-LM, DeepSpeed and torchtitan recompute; each layer of a model without "
                              "numbered blocks; gpipe, 1f1b and interleaved only); auto tries both."),
            click.option("--sharding", type=_choice(SHARDING_CHOICES), default="auto", show_default=True,
                         help="Sharded data parallelism over each stage's replicas: auto = the fastest ZeRO level that "
                              "fits wherever there are replicas (ZeRO-1 moves no more than an all-reduce); on a local "
                              "profile unsharded too (gloo's collectives run in series there)."),
            click.option("--mixed-precision", type=_choice(MIXED_PRECISIONS), default=DEFAULT_MIXED_PRECISION, show_default=True,
                         help="bf16/fp16 memory recipe: torch.autocast as `pipeplan run` trains (autocast: fp32 "
                              "state and a 16-bit copy of the weights, 18 B/param; activations in the dtypes autocast "
                              "leaves them), or a framework's, with 16-bit activations: 16-bit gradients (deepspeed, "
                              "16 B/param with Adam) or fp32 gradients (megatron: bf16 18 B/param, fp16 20; also "
                              "torchtitan's FSDP)."),
            click.option("--times", type=_choice(TIMES), default="model", show_default=True,
                         help="Layer times: 'model' takes the trace's measurements where it timed the profile's device "
                              "(this CPU, or that GPU in fp32), else the roofline; 'measured' always "
                              "the trace's; 'roofline' always the cost model."),
        ]
        if with_cluster:
            decorators += cluster_options
        for d in reversed(decorators):
            wrapper = d(wrapper)
        return wrapper

    return decorate


cluster_options = [
    click.option("--cluster", default=None,
                 help="A mixed cluster instead of --profile/--gpus: PROFILE:COUNT,PROFILE:COUNT (e.g. "
                      "a100-80gb-sxm:8,v100-32gb-sxm2:8); each stage runs on one device type (docs/mixed-clusters.md)."),
    click.option("--cluster-link", default=None,
                 help="Link between the --cluster groups: GBPS[,LATENCY_US] [default: the slower of the groups' "
                      "inter-node links]."),
]


def load_cluster(spec: str, link: str | None = None):
    """A --cluster spec as a `Cluster` (profiles loaded, counts bounded like --gpus)."""
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.cluster import parse_cluster

    return parse_cluster(spec, load_profile, max_count=MAX_DEVICES, link=link)


def _cluster_or_devices(kw: dict, gpus: int | None) -> int:
    """--cluster replaces --profile and --gpus: parse it into kw["cluster"]; the device count to plan for."""
    spec, link = kw.pop("cluster"), kw.pop("cluster_link")
    kw["cluster"] = None
    if spec is None:
        if link is not None:
            raise UserError("--cluster-link needs --cluster", "drop --cluster-link, or give --cluster")
        if kw.get("profile") is None:
            raise UserError("missing --profile", "give --profile NAME and --gpus N, or --cluster PROFILE:N,PROFILE:N")
        if gpus is None:
            raise UserError("missing --gpus", "give --gpus N (the accelerators available), or --cluster")
        return gpus
    if kw.get("profile") is not None or gpus is not None:
        used = " and ".join(f for f, v in (("--profile", kw.get("profile")), ("--gpus", gpus)) if v is not None)
        raise UserError(f"--cluster replaces --profile and --gpus, but {used} is given too",
                        f"drop {used}, or drop --cluster")
    kw["cluster"] = load_cluster(spec, link)
    return int(kw["cluster"].devices)


def profile_option(f):
    return click.option("--profile", "-p", required=True, help="Hardware profile: catalogue name (see `pipeplan profiles list`) or a .yaml path.")(f)


def optional_profile_option(f):
    """--profile for commands that also take --cluster (then the one or the other is required)."""
    return click.option("--profile", "-p", default=None,
                        help="Hardware profile: catalogue name (see `pipeplan profiles list`) or a .yaml path "
                             "(or --cluster).")(f)


def trace_options(f):
    """Flags that only matter when the input is a model.py (or a Hugging Face config.json) that must be traced first."""
    decorators = [
        click.option("--entry", default=None, help="Builder function in model.py [default: build_model]."),
        click.option("--trace-batch-size", type=count(MAX_TRACE_BATCH_SIZE), default=None,
                     help=f"Batch size to trace at [default: {DEFAULT_TRACE_BATCH_SIZE}]; costs scale per sample."),
        click.option("--depth", type=count(MAX_DEPTH), default=None, help="Module depth to group layers at [default: leaf modules]."),
        click.option("--repeats", type=count(MAX_REPEATS), default=None, help="Timed repeats per layer while tracing [default: adaptive]."),
        click.option("--seq-len", type=count(MAX_SEQ_LEN), default=None,
                     help=f"Training sequence length of a Hugging Face config.json model [default: its max_position_embeddings, at most {DEFAULT_MAX_SEQ_LEN}]."),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f


def device_option(f):
    """--device for commands that time layers: where the trace runs (costmodels.trace.resolve_device)."""
    return click.option("--device", "device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                        show_default=True,
                        help="Where layers are timed: cuda (CUDA events) or cpu; auto picks cuda when a GPU is "
                             "visible (not for a calibrated CPU profile).")(f)


def output_options(f):
    """Where results go: plan file, --json, PNG plot, Chrome trace."""
    decorators = [
        click.option("--output", "-o", type=click.Path(dir_okay=False), default=None, help="Write the plan to this JSON file."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout (schema: docs/cli.md)."),
        click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG of the simulated schedule and memory."),
        click.option("--chrome-trace", type=click.Path(dir_okay=False), default=None, help="Write the simulated timeline as Chrome trace-event JSON."),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f


def split_options(f):
    """A split to judge beside the best plan: `--split` (boundaries or block counts) or `--split-from` (a framework's)."""
    decorators = [
        click.option("--split", default=None,
                     help="Judge this split beside the best plan: the layers that start stages 2..K "
                          "(model.layers.8,model.layers.16) or blocks per stage (8,8,8,8)."),
        click.option("--split-from", default=None,
                     help="Judge a framework's split: a torchtitan .toml, a DeepSpeed .json {num_stages, "
                          "partition_method}, a file of Megatron-LM arguments, or deepspeed:K:METHOD."),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f


def option_given(name: str) -> bool:
    """Whether the running command's option `name` (its Python name) was given, not left at its default."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source is not ParameterSource.DEFAULT


def check_split_flags(split: str | None, split_from: str | None) -> None:
    """One split at a time; a --split-from file must exist (checked before the trace and the search)."""
    if split is not None and split_from is not None:
        raise UserError("--split and --split-from both name a split", "judge one split at a time")
    if split_from is not None and not split_from.startswith("deepspeed:") and not Path(split_from).is_file():
        raise UserError(f"--split-from {split_from}: no such file",
                        "pass a torchtitan .toml, a DeepSpeed .json, a file of Megatron arguments or deepspeed:K:METHOD")


def check_output_paths(*, output=None, plot=None, chrome_trace=None) -> None:
    """Fail before the (possibly long) trace and search, not after them."""
    if plot is not None and Path(plot).suffix.lower() != ".png":
        raise UserError(f"--plot {plot}: the plot is a PNG image", "name the file *.png")
    for flag, value in (("-o/--output", output), ("--plot", plot), ("--chrome-trace", chrome_trace)):
        if value is not None:
            check_destination(value, flag)
    paths = [p for p in (output, plot, chrome_trace) if p is not None]
    if len({str(Path(p).resolve()) for p in paths}) != len(paths):
        raise UserError("two outputs name the same file", "give -o, --plot and --chrome-trace different paths")
