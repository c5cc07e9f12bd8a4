"""Rich rendering of a plan the way an ML engineer reads it.

Order follows the questions people ask: what model is this, how is it split,
how fast will it go and will it fit, and is the planner worth it compared with
just cutting the model into equal layer counts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipeplan.cli.console import stdout_console
from pipeplan.cli.fmt import fmt_bytes, fmt_count, fmt_flops, fmt_in, fmt_pct, fmt_seconds, shorten, table_time_unit
from pipeplan.cli.summary import stage_params
from pipeplan.planner.configs import SHARDING_NAMES


def shown_path(path: str) -> str:
    """A recorded (absolute) path as the user would type it: relative to the working folder when inside it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else path
    except (OSError, ValueError):
        return path


def model_table(summary: dict[str, Any]) -> Table:
    """Model summary from graph_summary() / plan_graph_summary()."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    source = summary.get("source") or {}
    t.add_row("model", str(summary.get("name")))
    if source.get("model_file"):
        entry = f" ({source['entry']})" if source.get("entry") else ""
        t.add_row("file", f"{shown_path(source['model_file'])}{entry}")
    t.add_row("layers", str(summary.get("layers")))
    if summary.get("parameters") is not None:
        trainable = summary.get("trainable_parameters", summary["parameters"])
        frozen = f"; {fmt_count(trainable)} trainable, the rest frozen" if trainable < summary["parameters"] else ""
        t.add_row("parameters", f"{fmt_count(summary['parameters'])} ({fmt_bytes(summary['param_bytes'])} fp32{frozen})")
    if summary.get("fwd_flops_per_sample") is not None:
        t.add_row(
            "FLOPs / sample",
            f"{fmt_flops(summary['fwd_flops_per_sample'])} forward, {fmt_flops(summary['bwd_flops_per_sample'])} backward",
        )
    if summary.get("trace_batch_size") is not None:
        device = source.get("device")
        t.add_row("traced at", f"batch {summary['trace_batch_size']}" + (f" on {device}" if device else ""))
    notes = summary.get("notes") or []
    for note in notes[:3]:
        t.add_row("note", Text(str(note), style="yellow"))
    if len(notes) > 3:
        t.add_row("", Text(f"(+{len(notes) - 3} more notes in the graph file)", style="dim"))
    return t


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def plan_header(plan, profile=None) -> Text:
    k = len(plan.stages)
    chunks = max(1, plan.chunks)
    device = f" ({profile.device})" if profile is not None else ""
    if plan.schedule == "interleaved" and chunks > 1:
        shape = f"{_plural(k // chunks, 'stage')} × {chunks} chunks"
    else:
        shape = _plural(k, "stage")
    d = getattr(plan, "data_parallel", 1) or 1
    reps = [s.replicas for s in plan.stages]
    if d > 1:
        shape += f" × {d} data-parallel replicas"
    elif any(r > 1 for r in reps):
        shape += f", stage replicas {'/'.join(str(r) for r in reps)}"
    text = Text()
    available = (plan.solver or {}).get("search", {}).get("devices_available")
    of = f" (of {available} available)" if available and available != plan.devices else ""
    devices = _mixed_devices(plan) if plan.mixed else f"{plan.devices} × {shown_path(plan.device_profile)}"
    text.append(f"{devices}{device}{of}", style="bold")
    text.append(
        f": {plan.schedule}, {shape}, {plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''} of "
        f"{plan.microbatch_size} (batch {plan.batch_size}), {plan.dtype}{_recipe(plan)}, {plan.optimizer}"
        f"{'' if plan.optimizer_kernels == 'auto' else f' ({plan.optimizer_kernels} kernels)'}"
        f"{_recompute(plan)}{_sharding(plan)}"
    )
    solver = plan.solver or {}
    if solver.get("name"):
        gap = solver.get("gap")
        extra = f", gap {100 * gap:.2g}%" if isinstance(gap, (int, float)) and gap > 1e-6 else ""
        took = f" in {fmt_seconds(solver['time_s'])}" if solver.get("time_s") is not None else ""
        text.append(f"\nsolver: {solver['name']} ({solver.get('status', '?')}{extra}){took}", style="dim")
    return text


def _mixed_devices(plan) -> str:
    """A mixed plan's devices per type, in pipeline order: "8 × a100-80gb-sxm + 8 × v100-32gb-sxm2"."""
    counts: dict[str, int] = {}
    for s in plan.stages:
        counts[str(s.device_type)] = counts.get(str(s.device_type), 0) + s.replicas
    return " + ".join(f"{n} × {name}" for name, n in counts.items())


def _type_runs(types: list[str]) -> str:
    """Stages per device type in pipeline order: "a100-80gb-sxm:3+v100-32gb-sxm2:1"."""
    runs: list[list[Any]] = []
    for t in types:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return "+".join(f"{t}:{n}" for t, n in runs)


def _recipe(plan) -> str:
    """Which mixed-precision memory recipe a 16-bit plan assumed."""
    return f" ({plan.mixed_precision} recipe)" if plan.dtype in ("bf16", "fp16") else ""


def _recompute(plan) -> str:
    """The plan's recomputation as the header says it: nothing, per stage, or per block."""
    if not plan.recompute:
        return ""
    return ", recomputation per block" if plan.recompute_granularity == "block" else ", recomputation"


def _sharding(plan) -> str:
    if plan.sharding == "none":
        return ""
    reps = max((s.replicas for s in plan.stages), default=1)
    return f", {SHARDING_NAMES[plan.sharding]} over {reps} replicas"


def device_holds(plan) -> str:
    """What the fullest device keeps at its peak: each term of costmodels/memory.stage_memory."""
    s = max(plan.stages, key=lambda st: st.predicted.memory_bytes)
    p = s.predicted
    parts = [f"weights {fmt_bytes(p.weights_bytes)}", f"grads {fmt_bytes(p.grad_bytes)}",
             f"optimizer {fmt_bytes(p.optimizer_bytes - p.grad_bytes)}"]
    if p.gathered_bytes:
        parts.append(f"gathered layers {fmt_bytes(p.gathered_bytes)}")
    parts.append(f"activations {fmt_bytes(p.activation_bytes)}")
    return f"stage {s.index}: " + ", ".join(parts)


def _layer_span(layers: list[str]) -> str:
    if not layers:
        return "—"
    if len(layers) == 1:
        return shorten(layers[0], 40)
    return f"{shorten(layers[0], 20)} → {shorten(layers[-1], 20)}"


def _devices(devices: list[int]) -> str:
    if not devices:
        return "—"
    if len(devices) > 2 and devices == list(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}–{devices[-1]}"
    step = devices[1] - devices[0] if len(devices) > 3 else 0
    if step > 1 and devices == list(range(devices[0], devices[-1] + 1, step)):  # pipeline-major: every step-th
        return f"{devices[0]},{devices[1]},…,{devices[-1]}"
    return ",".join(str(d) for d in devices)


def stage_table(plan, graph=None, capacity_bytes: int | None = None,
                type_capacity: dict[str, int] | None = None) -> Table:
    """Per-stage table: layers, parameters, per-microbatch times, sends, peak memory against capacity.

    Times share one unit (in the title) so the columns stay narrow enough for an
    ordinary terminal; the all-reduce column appears only when stages are replicated.
    A mixed-cluster plan adds a "device type" column, and memory is against each type's own
    capacity (`type_capacity`: profile name -> usable bytes).
    """
    scale, unit = table_time_unit([x for s in plan.stages for x in (s.predicted.fwd_s, s.predicted.bwd_s, s.predicted.send_s)])
    allreduce = any(s.predicted.allreduce_s for s in plan.stages)
    title = f"Stages ({unit} per microbatch" + ("; all-reduce once per iteration" if allreduce else "")
    if plan.mixed and type_capacity:
        title += "; memory peak per device, % of its type's usable)"
    else:
        title += f"; memory peak per device, % of {fmt_bytes(capacity_bytes)} usable)" if capacity_bytes else ")"
    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column("stage", justify="right", no_wrap=True)
    t.add_column("devices", no_wrap=True)
    if plan.mixed:
        t.add_column("device type", no_wrap=True)
    t.add_column("layers (from → to)", ratio=1, min_width=12)  # the one column that wraps in a narrow terminal
    t.add_column("#", justify="right", no_wrap=True)
    params = stage_params(plan, graph)
    show_params = any(p is not None for p in params)
    if show_params:
        t.add_column("params", justify="right", no_wrap=True)
    t.add_column("fwd", justify="right", no_wrap=True)
    t.add_column("bwd", justify="right", no_wrap=True)
    t.add_column("send", justify="right", no_wrap=True)
    if allreduce:
        t.add_column("all-reduce", justify="right", no_wrap=True)
    t.add_column("memory", justify="right", no_wrap=True)
    last = max((s.index for s in plan.stages), default=0)
    for s, p in zip(plan.stages, params, strict=True):
        pred = s.predicted
        row = [str(s.index), _devices(s.devices), *([str(s.device_type)] if plan.mixed else []),
               _layer_span(s.layers), str(len(s.layers))]
        if plan.mixed:
            capacity_bytes = (type_capacity or {}).get(str(s.device_type))
        if show_params:
            row.append(fmt_count(p))
        row += [fmt_in(pred.fwd_s, scale), fmt_in(pred.bwd_s, scale)]
        if s.index == last and not pred.send_bytes:
            row.append("—")
        else:
            row.append(f"{fmt_bytes(pred.send_bytes)}, {fmt_in(pred.send_s, scale)}")
        if allreduce:
            row.append(fmt_in(pred.allreduce_s, scale))
        if capacity_bytes:
            frac = pred.memory_bytes / capacity_bytes
            style = "red" if frac > 1 else ("yellow" if frac > 0.9 else "green")
            row.append(Text(f"{fmt_bytes(pred.memory_bytes)} ({100 * frac:.0f}%)", style=style))
        else:
            row.append(fmt_bytes(pred.memory_bytes))
        t.add_row(*row)
    return t


def prediction_table(plan, capacity_bytes: int | None = None) -> Table:
    p = plan.predicted
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    it = fmt_seconds(p.iteration_s)
    overheads = [s.predicted.op_overhead_s for s in plan.stages]
    if any(overheads):  # a calibrated local profile: say the runtime's share is in the number
        lo, hi = min(overheads), max(overheads)
        per_op = fmt_seconds(hi) if hi - lo < 0.05 * hi else f"{fmt_seconds(lo)}–{fmt_seconds(hi)}"
        it += f" (incl. the runtime's {per_op} per op)"
    t.add_row("iteration time", it)
    t.add_row("throughput", f"{p.samples_per_s:,.1f} samples/s")
    t.add_row("bubble", fmt_pct(p.bubble_fraction))
    t.add_row("achieved / peak FLOP/s", fmt_pct(p.achieved_flops_fraction))
    mem = fmt_bytes(p.peak_memory_bytes)
    if capacity_bytes:
        mem += f" of {fmt_bytes(capacity_bytes)} usable ({100 * p.peak_memory_bytes / capacity_bytes:.0f}%)"
    t.add_row("peak memory / device", mem)
    if plan.stages and plan.stages[0].predicted.memory_bytes:
        t.add_row("fullest device holds", device_holds(plan))
    return t


def baseline_line(plan, baseline, capacity_bytes: int | None = None) -> Text:
    """One line: the planned split against the naive equal-layers split with the same K/d/M/schedule."""
    if baseline is None:
        return Text("equal-layers split: not evaluated (single stage or not applicable)", style="dim")
    b = baseline.predicted
    counts = [len(s.layers) for s in baseline.stages]
    counts_txt = "/".join(str(c) for c in counts) if len(counts) <= 8 else f"{min(counts)}–{max(counts)}"
    text = Text("vs equal-layers split ")
    text.append(f"({counts_txt} layers)", style="dim")
    text.append(f": {b.samples_per_s:,.1f} samples/s, peak {fmt_bytes(b.peak_memory_bytes)}")
    if (capacity_bytes and b.peak_memory_bytes > capacity_bytes) or not b.fits:  # mixed: each type's own capacity
        text.append(" — does not fit in memory", style="red")
    if [len(s.layers) for s in plan.stages] == counts:
        text.append(" → the same split as this plan")
    elif b.samples_per_s > 0:
        ratio = plan.predicted.samples_per_s / b.samples_per_s
        text.append(" → this plan is ")
        text.append(f"{ratio:.2f}× {'faster' if ratio >= 1 else 'as fast'}", style="bold green" if ratio > 1.005 else "bold")
    return text


def alternatives_table(plan, limit: int = 5) -> Table | None:
    """Runners-up from Plan.alternatives (summaries written by the search)."""
    alts = (plan.alternatives or [])[:limit]
    if not alts:
        return None
    # Rows that differ only in rank placement would read the same: name it when the search kept more than one.
    best_layout = (plan.solver or {}).get("layout", "stage-major")
    placements = len({best_layout} | {a.get("layout", "stage-major") for a in alts}) > 1
    t = Table(title="Runners-up", title_justify="left", header_style="bold",
              caption=f"the plan above places ranks {best_layout}" if placements else None, caption_justify="left")
    mixed = any(a.get("device_types") for a in alts)  # a mixed cluster's runners-up: stages per device type
    for col in ("schedule", "K×d", "M", "recompute", "samples/s", "peak memory") + (("placement",) if placements else ()) \
            + (("stages per device type",) if mixed else ()):
        t.add_column(col, justify="left" if col in ("schedule", "placement", "stages per device type") else "right")
    for a in alts:
        chunks = a.get("chunks") or 1
        sched = str(a.get("schedule")) + (f" (v={chunks})" if chunks > 1 else "")
        d = a.get("data_parallel")
        if d is None or a.get("schedule") == "pipedream":  # per-stage replicas there
            reps = a.get("replicas") or [1]
            d = reps if isinstance(reps, int) else ("/".join(map(str, reps)) if len(set(reps)) > 1 else reps[0])
        sps = a.get("samples_per_s")
        if a.get("sharding", "none") != "none":
            sched += f", {SHARDING_NAMES[a['sharding']]}"
        rc = ("per block" if a.get("recompute_granularity") == "block" else "on") if a.get("recompute") else "off"
        t.add_row(sched, f"{a.get('stages')}×{d}", str(a.get("microbatches")), rc,
                  f"{sps:,.1f}" if isinstance(sps, (int, float)) else "—", fmt_bytes(a.get("peak_memory_bytes")),
                  *((a.get("layout", "stage-major"),) if placements else ()),
                  *((_type_runs(a.get("device_types") or []),) if mixed else ()))
    return t


def plan_report(plan, *, model_summary: dict[str, Any], graph=None, profile=None, baseline=None, with_baseline: bool = True,
                type_capacity: dict[str, int] | None = None) -> Group:
    """Everything `analyze`, `plan` and `show` print, as one renderable (a mixed plan: `type_capacity`, no profile)."""
    capacity = int(profile.usable_memory_bytes) if profile is not None else None
    if type_capacity and capacity is None:  # mixed: the capacity beside the peak (planner/mixed_predict.py)
        capacity = plan.predicted.memory_capacity_bytes
    parts: list[Any] = [model_table(model_summary), Text(""), plan_header(plan, profile),
                        stage_table(plan, graph, capacity, type_capacity), prediction_table(plan, capacity)]
    if with_baseline:
        parts.append(baseline_line(plan, baseline, capacity))
    alts = alternatives_table(plan)
    if alts is not None:
        parts.append(alts)
    for note in plan.notes or []:
        parts.append(Text(f"note: {note}", style="yellow"))
    return Group(*parts)


def compare_table(rows: list[dict[str, Any]]) -> Table:
    """`compare`: one row per profile, fastest first as given."""
    t = Table(title="Best plan per profile", title_justify="left", header_style="bold")
    for col, just in (("profile", "left"), ("K×d", "right"), ("M", "right"), ("schedule", "left"), ("samples/s", "right"),
                      ("iteration", "right"), ("bubble", "right"), ("peak memory", "right"), ("headroom", "right")):
        t.add_column(col, justify=just)
    for r in rows:
        if not r["feasible"]:
            t.add_row(str(r["profile"]), "—", "—", "—", "—", "—", "—", "—", Text(str(r["error"] or "no plan"), style="red"))
            continue
        reps = r["replicas"]
        d = reps if isinstance(reps, int) else max(reps)
        sched = r["schedule"] + (f" (v={r['chunks']})" if r["schedule"] == "interleaved" else "") + (" +rc" if r["recompute"] else "")
        sched += f", {SHARDING_NAMES[r['sharding']]}" if r.get("sharding", "none") != "none" else ""
        head = r["memory_headroom_fraction"]
        t.add_row(
            r["profile"],
            f"{r['stages']}×{d}",
            str(r["microbatches"]),
            sched,
            f"{r['samples_per_s']:,.1f}",
            fmt_seconds(r["iteration_s"]),
            fmt_pct(r["bubble_fraction"]),
            fmt_bytes(r["peak_memory_bytes"]),
            Text(f"{fmt_bytes(r['memory_headroom_bytes'])} ({fmt_pct(head)})", style="green" if head and head > 0.1 else "yellow"),
        )
    return t


def print_report(renderable, console: Console | None = None) -> None:
    (console or stdout_console()).print(renderable)


def judged_split_report(judged) -> Group:
    """`--split` / `--split-from`: the user's split beside the best plan, its stages and why it is slower.

    One headline in the words people ask it ("1.31x slower than the best, stage 0 at
    97% of memory"), then the split's own stage table and the reasons
    (planner/frameworks/judge.py)."""
    plan, best = judged.plan, judged.best
    cap = plan.predicted.memory_capacity_bytes or None
    full = max(plan.stages, key=lambda s: s.predicted.memory_bytes)
    ratio = judged.slowdown
    head = Text(f"your split ({judged.split.source}): ", style="bold")
    if ratio > 1.005:
        head.append(f"{ratio:.2f}x slower than the best", style="bold red" if ratio > 1.1 else "bold yellow")
    elif ratio < 0.995:
        head.append(f"{1 / ratio:.2f}x faster than the best plan found", style="bold green")
    else:
        head.append("as fast as the best", style="bold green")
    head.append(f" ({plan.predicted.samples_per_s:,.1f} vs {best.predicted.samples_per_s:,.1f} samples/s)")
    if cap:
        frac = full.predicted.memory_bytes / cap
        head.append(f", stage {full.index} at {100 * frac:.0f}% of memory",
                    style="red" if frac > 1 else ("yellow" if frac > 0.9 else ""))
        if not plan.predicted.fits:
            head.append(" — does not fit", style="red")
    parts: list[Any] = [Text(""), head, stage_table(plan, None, cap)]
    if judged.config_note:
        parts.append(Text(f"note: {judged.config_note}", style="dim"))
    parts += [Text(f"why: {reason}") for reason in judged.reasons]
    return Group(*parts)
