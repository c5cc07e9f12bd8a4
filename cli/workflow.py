"""The steps `analyze`, `plan`, `compare` and `show` share: get a graph, search, write outputs.

Heavy imports (torch, the planner) happen inside the functions so `pipeplan
--help` stays fast and a command's flags are checked before anything slow runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from pipeplan._io import atomic_write_bytes, atomic_write_json
from pipeplan.cli.report import shown_path
from pipeplan.errors import UserError

MODEL_SUFFIXES = (".py",)
MAX_SNIFF_BYTES = 4 * 1024 * 1024  # a Hugging Face config.json is a few KiB; a bigger .json is a graph


def json_kind(path: str) -> str:
    """What a .json file is, by content: "graph" (has "format"), "config" (has "model_type") or "other"."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_SNIFF_BYTES:
            return "graph"
        doc = json.loads(p.read_text(encoding="utf-8"))
    except RecursionError:  # nested past json's limit: the graph reader says so, naming the file
        return "graph"
    except (OSError, ValueError):
        return "other"
    if isinstance(doc, dict) and "format" in doc:
        return "graph"
    return "config" if isinstance(doc, dict) and "model_type" in doc else "other"


def is_model_file(path: str) -> bool:
    """A model.py, or a Hugging Face config.json (by content: a graph.json is a .json too)."""
    suffix = Path(path).suffix.lower()
    return suffix in MODEL_SUFFIXES or (suffix == ".json" and Path(path).is_file() and json_kind(path) == "config")


def load_input_graph(
    path: str,
    *,
    entry: str | None = None,
    trace_batch_size: int | None = None,
    depth: int | None = None,
    repeats: int | None = None,
    seq_len: int | None = None,
    progress: Callable | None = None,
    time_layers: bool = True,
    device: str = "cpu",
    dtype: str = "fp32",
):
    """A model.py or a Hugging Face config.json is traced (once, at a small batch); a graph.json or
    PipeDream graph.txt is loaded. A .json that is neither a graph nor a config goes to the config
    reader, whose error says what a config needs.

    time_layers=False (see `layer_times_wanted`) traces without weights and without timing; `device` is where
    layers are timed ("cpu", or "cuda" where analyze re-times a plan on this machine's GPU), `dtype` in what."""
    if not Path(path).exists():
        raise UserError(f"{path}: no such file", "pass a model.py, a graph.json from `pipeplan trace`, or a PipeDream graph.txt")
    if Path(path).is_dir():
        raise UserError(f"{path}: is a folder", "pass a model.py, a graph.json or a PipeDream graph.txt")
    suffix = Path(path).suffix.lower()
    if suffix in MODEL_SUFFIXES or (suffix == ".json" and json_kind(path) != "graph"):
        from pipeplan.cli.options import DEFAULT_TRACE_BATCH_SIZE
        from pipeplan.costmodels.trace import trace

        return trace(
            str(Path(path).resolve()),
            trace_batch_size or DEFAULT_TRACE_BATCH_SIZE,
            entry=entry or "build_model",
            depth=depth,
            repeats=repeats,
            progress=progress,
            seq_len=seq_len,
            time_layers=time_layers,
            device=device,
            dtype=dtype,
        )
    used = [flag for flag, value in (("--entry", entry), ("--trace-batch-size", trace_batch_size), ("--depth", depth), ("--repeats", repeats), ("--seq-len", seq_len)) if value is not None]
    if used:
        raise UserError(f"{' and '.join(used)} only apply when tracing a model.py or a Hugging Face config.json, but {path} is a saved graph", f"drop {', '.join(used)}")
    return load_saved_graph(path)


def load_saved_graph(path: str, *, profiled_batch_size: int | None = None):
    """graph.json (pipeplan.graph/v1) or a PipeDream graph.txt; a model.py is refused with a pointer to `analyze`.

    A PipeDream file's times are per profiled minibatch, a size it does not record:
    `profiled_batch_size` supplies it (only meaningful for such files).
    """
    if is_model_file(path):
        raise UserError(f"{path} is a model file; `pipeplan plan` reads a saved graph", "use `pipeplan analyze` for a model.py, or `pipeplan trace` it first")
    from pipeplan.costmodels.load import load_any_graph

    if profiled_batch_size is not None and Path(path).suffix.lower() == ".json":
        raise UserError(f"--profiled-batch-size only applies to a PipeDream graph.txt, but {path} is a pipeplan graph",
                        "drop --profiled-batch-size (the graph records its own batch size)")
    return load_any_graph(path, batch_size=profiled_batch_size or 1)


def load_profile(name: str):
    from pipeplan.hardware_profiles import load_profile as _load

    return _load(name)


def plan_profile(recorded: str, plan_file: str, load=None):
    """The plan's profile: a name, or the YAML path it was made with; failing that, a YAML of that name beside
    the plan file (a plan and its profile copied together to another folder or machine)."""
    from pathlib import Path

    from pipeplan.errors import UserError

    load = load or load_profile
    try:
        return load(recorded)
    except UserError:
        if not recorded.endswith((".yaml", ".yml")):
            raise
        folder = Path(plan_file).parent
        for candidate in (folder / recorded, folder / Path(recorded).name):  # a relative path, then the name
            if candidate.is_file() and candidate.resolve() != Path(recorded).resolve():
                return load(str(candidate))
        raise


def layer_times_wanted(profiles, request) -> bool:
    """Whether planning `request` on any of `profiles` uses measured layer times, so a model.py is timed.

    Only a local profile (this machine) in fp32 or --times measured use them; on a catalogue
    profile the roofline prices layers from FLOPs and bytes, which a weight-free trace gives exactly.
    """
    from pipeplan.costmodels.compute import measured_times_wanted

    return any(measured_times_wanted(p, times=request.times, dtype=request.for_profile(p).training_dtype)
               for p in profiles)


def check_layer_times(graph, profile, request) -> None:
    """A graph traced without layer times cannot be planned with measured ones: say so, and how to get them."""
    from pipeplan.costmodels.compute import measured_times_wanted

    if graph.source.get("timed") is not False:
        return
    resolved = request.for_profile(profile)
    if not measured_times_wanted(profile, times=resolved.times, dtype=resolved.training_dtype):
        return
    why = "--times measured" if resolved.times == "measured" else f"the local profile {profile.name} (fp32)"
    raise UserError(
        f"graph {graph.name!r} was traced without layer times (weight-free), and {why} plans with measured times",
        "trace the model with times (`pipeplan trace` without --no-times, or `pipeplan analyze MODEL` "
        "on this profile), or plan it on a catalogue profile with --times model",
    )


def run_search(graph, profile, request, progress: Callable | None = None):
    """planner.search.search with the CLI's request; InfeasibleError passes through as a user error."""
    from pipeplan.planner.search import search

    check_layer_times(graph, profile, request)
    return search(graph, profile, request, progress=progress)


def write_outputs(plan, graph, profile, *, output: str | None, plot: str | None, chrome_trace: str | None, sim=None) -> Any:
    """Plan file, PNG and Chrome trace; each written atomically. Returns the SimResult used (or None)."""
    if output:
        plan.save(output)
    if plot or chrome_trace:
        if sim is None:
            sim = simulate_for(plan, graph, profile)
        if plot:
            from pipeplan.cli.plots import schedule_png

            atomic_write_bytes(plot, schedule_png(plan, sim, capacity_bytes=capacity_of(profile), title=plot_title(plan, graph)))
        if chrome_trace:
            from pipeplan.planner.timeline import chrome_trace as to_chrome

            atomic_write_json(chrome_trace, to_chrome(sim.events, title=f"pipeplan: {plan.graph.get('name', '')} on {shown_path(plan.device_profile)}"))
    return sim


def simulate_for(plan, graph, profile):
    """The simulated timeline of a plan: exact from the graph when we have it, else from the plan's own numbers."""
    from pipeplan.planner.replay import simulate_from_plan, simulate_plan

    if graph is not None and profile is not None:
        return simulate_plan(plan, graph, profile)
    return simulate_from_plan(plan)


def capacity_of(profile) -> int | None:
    return int(profile.usable_memory_bytes) if profile is not None else None


def plot_title(plan, graph=None) -> str:
    name = plan.graph.get("name") or (graph.name if graph is not None else "model")
    k = len(plan.stages)
    d = getattr(plan, "data_parallel", 1) or 1
    shape = f"{k} stage{'s' if k != 1 else ''}"
    if plan.schedule == "interleaved" and plan.chunks > 1:
        shape = f"{k // plan.chunks} stages × {plan.chunks} chunks"
    if d > 1:
        shape += f" × {d} data-parallel replicas (one replica drawn)"
    return (
        f"{name} on {plan.devices}× {shown_path(plan.device_profile)}: {plan.schedule}, {shape}, "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}"
    )
