"""PNG pictures of a plan: the simulated schedule as a Gantt chart with memory bars, and `compare`'s bar chart.

Drawn on matplotlib's Agg canvas directly (no pyplot), so nothing global changes
for a caller who imports pipeplan in a notebook, and the result is PNG bytes the
caller writes atomically.
"""

from __future__ import annotations

import colorsys
import io
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from pipeplan.cli.fmt import fmt_count, fmt_seconds
from pipeplan.planner.configs import SHARDING_NAMES
from pipeplan.units import GIB, MIB

KIND_COLOURS = {
    "fwd": "#4C72B0",  # blue: forward
    "bwd": "#55A868",  # green: backward
    "wgrad": "#2E8B57",  # darker green: zero bubble's weight-gradient pass W, split from the backward
    "recompute": "#8172B2",  # purple: forward recomputed during backward
    "allreduce": "#C44E52",  # red: gradient all-reduce among replicas
    "optimizer": "#CCB974",  # sand: the optimizer step after the gradients are reduced
    "send": "#8C8C8C",
    "recv": "#8C8C8C",
}
IDLE_COLOUR = "#F7E1E1"  # pale red row background: what shows through is the bubble
COMPUTE_KINDS = ("fwd", "bwd", "wgrad", "recompute", "allreduce", "optimizer")


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Lighter shade per model chunk (interleaved schedule) so chunks are told apart."""
    if chunks <= 1:
        return to_rgb(colour)
    h, l, s = colorsys.rgb_to_hls(*to_rgb(colour))
    l = min(0.85, l + 0.22 * chunk / max(1, chunks - 1))
    return colorsys.hls_to_rgb(h, l, s)


def _png(fig: Figure, dpi: int = 120) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def _time_unit(total_s: float) -> tuple[float, str]:
    if total_s >= 2:
        return 1.0, "s"
    if total_s >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def draw_gantt(ax, events: Sequence[Any], *, devices: int | None = None, chunks: int = 1, iteration_s: float | None = None) -> list:
    """One row per device (device 0 on top): compute blocks labelled with the microbatch, sends as thin bars.

    Returns the legend handles (the caller places the legend where it has room).
    """
    devs = sorted({e.device for e in events}) if devices is None else list(range(devices))
    if not devs:
        ax.text(0.5, 0.5, "no events", ha="center", va="center", transform=ax.transAxes)
        return []
    end_s = max([e.end_s for e in events] + [iteration_s or 0.0])
    scale, unit = _time_unit(end_s)
    width = end_s * scale
    row = {d: i for i, d in enumerate(devs)}
    # Idle background first: everything not covered by a block is a bubble.
    for i in row.values():
        ax.broken_barh([(0, width)], (i - 0.4, 0.8), facecolors=IDLE_COLOUR, edgecolor="none", zorder=0)
    # Label a block only when it is wide enough to hold its text. Blocks are drawn one collection per row,
    # colour and kind (a collection per block takes minutes for a 32-stage, 128-microbatch iteration).
    min_label = width / 100
    sends: dict[int, list[tuple[float, float]]] = {}
    bars: dict[tuple[int, tuple[float, float, float], bool], list[tuple[float, float]]] = {}
    for e in events:
        if e.device not in row:
            continue
        i = row[e.device]
        x, w = e.start_s * scale, max((e.end_s - e.start_s) * scale, 0.0)
        if e.kind in ("send", "recv"):
            if e.kind == "send":
                sends.setdefault(i, []).append((x, w))
            continue
        colour = _shade(KIND_COLOURS.get(e.kind, "#999999"), getattr(e, "chunk", 0), chunks)
        bars.setdefault((i, colour, e.kind == "allreduce"), []).append((x, w))
        if e.kind not in ("allreduce", "optimizer") and w >= min_label and e.microbatch is not None and e.microbatch >= 0:
            l = colorsys.rgb_to_hls(*colour)[1]
            ax.text(x + w / 2, i - 0.02, str(e.microbatch), ha="center", va="center", fontsize=7 if w >= width / 60 else 5.5,
                    color="white" if l < 0.6 else "black", zorder=3)
    for i, spans in sends.items():
        ax.broken_barh(spans, (i + 0.28, 0.12), facecolors=KIND_COLOURS["send"], edgecolor="none", zorder=2)
    for (i, colour, hatched), spans in bars.items():
        ax.broken_barh(spans, (i - 0.3, 0.56), facecolors=colour, edgecolor="white", linewidth=0.4, zorder=1,
                       hatch="//" if hatched else None)
    ax.set_yticks(range(len(devs)))
    ax.set_yticklabels([f"device {d}" for d in devs])
    ax.set_ylim(len(devs) - 0.5, -0.5)
    ax.set_xlim(0, width * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = {e.kind for e in events}
    handles = [Patch(facecolor=KIND_COLOURS["fwd"], label="forward (microbatch #)"), Patch(facecolor=KIND_COLOURS["bwd"], label="backward")]
    if chunks > 1:
        handles.append(Patch(facecolor=_shade(KIND_COLOURS["fwd"], chunks - 1, chunks), label=f"lighter: later chunks (of {chunks})"))
    if "wgrad" in kinds:
        handles.append(Patch(facecolor=KIND_COLOURS["wgrad"], label="weight gradient (W)"))
    if "recompute" in kinds:
        handles.append(Patch(facecolor=KIND_COLOURS["recompute"], label="recompute"))
    if "allreduce" in kinds:
        handles.append(Patch(facecolor=KIND_COLOURS["allreduce"], hatch="//", label="gradient all-reduce"))
    if "optimizer" in kinds:
        handles.append(Patch(facecolor=KIND_COLOURS["optimizer"], label="optimizer step"))
    if "send" in kinds:
        handles.append(Patch(facecolor=KIND_COLOURS["send"], label="send"))
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle (bubble)"))
    return handles


def _stage_list(indices: list[int]) -> str:
    """A device's stages under a bar, short enough not to run into its neighbour's."""
    if len(indices) <= 3:
        return ",".join(f"S{i}" for i in indices)
    return f"S{indices[0]},S{indices[1]},…,S{indices[-1]}"


def draw_memory(ax, plan, capacity_bytes: int | None) -> None:
    """Stacked per-stage peak memory (weights, gradients + optimizer state, activations) against the capacity line.

    When the plan uses a small share of the device, the axis zooms to the bars and
    the capacity is written in the corner instead of flattening the bars to nothing.
    """
    stages = sorted(plan.stages, key=lambda s: s.index)
    labels = [f"S{s.index}" for s in stages]
    if plan.chunks > 1:
        # Interleaved: a device holds several virtual stages and the prediction is per
        # device, so draw one bar per device rather than the same bar once per chunk.
        pipe = max(1, len(stages) // plan.chunks)
        labels = [f"dev {d}\n" + _stage_list([s.index for s in stages[d::pipe]]) for d in range(pipe)]
        stages = stages[:pipe]
    xs = list(range(len(stages)))
    peak = max([s.predicted.memory_bytes for s in stages] + [1])
    unit, scale = ("GiB", GIB) if max(peak, capacity_bytes if capacity_bytes and capacity_bytes < 1.5 * peak else 0) >= GIB else ("MiB", MIB)
    # ZeRO-2/3's gathered full-size layers are weights (and a layer's gradient) in flight: drawn with the weights
    weights = [(s.predicted.weights_bytes + s.predicted.gathered_bytes) / scale for s in stages]
    optim = [s.predicted.optimizer_bytes / scale for s in stages]
    total = [s.predicted.memory_bytes / scale for s in stages]
    acts = [max(0.0, t - w - o) for t, w, o in zip(total, weights, optim, strict=True)]
    ax.bar(xs, weights, color="#4C72B0", label="weights")
    ax.bar(xs, optim, bottom=weights, color="#DD8452", label="grads + optimizer")
    ax.bar(xs, acts, bottom=[w + o for w, o in zip(weights, optim, strict=True)], color="#55A868", label="activations + buffers")
    top = max(total + [0.0])
    if capacity_bytes:
        cap = capacity_bytes / scale
        if cap <= 1.5 * top:
            ax.axhline(cap, color="#C44E52", linestyle="--", linewidth=1.2, label=f"usable {capacity_bytes / GIB:.1f} GiB")
            top = max(top, cap)
        else:
            ax.set_title(f"peak memory per {'device' if plan.chunks > 1 else 'stage'} (% of {capacity_bytes / GIB:.1f} GiB usable, off scale)", fontsize=10, loc="left")
        for x, t in zip(xs, total, strict=True):
            pct = 100 * t / cap
            ax.text(x, t + top * 0.02, f"{pct:.0f}%" if pct >= 1 else f"{pct:.2g}%", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    ax.set_xlim(-0.6, max(len(xs), 4) - 0.4)  # a lone stage keeps a bar's width, not the panel's
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8 if len(xs) <= 16 else 6)
    ax.set_ylabel(f"{unit} per device")
    if not ax.get_title(loc="left"):
        ax.set_title(f"peak memory per {'device' if plan.chunks > 1 else 'stage'} (% of usable)", fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def schedule_png(plan, sim, *, capacity_bytes: int | None = None, title: str = "") -> bytes:
    """Gantt of the simulated iteration, its legend, then memory bars and the plan's settings; PNG bytes."""
    devices = sorted({e.device for e in sim.events})
    n = max(1, len(devices))
    gantt_h = max(1.4, 0.45 * n + 0.6)
    fig = Figure(figsize=(13, gantt_h + 0.5 + 2.6 + 0.9))
    gs = fig.add_gridspec(3, 2, height_ratios=[gantt_h, 0.5, 2.6], width_ratios=[3, 1.6], hspace=0.35, wspace=0.3)
    gantt = fig.add_subplot(gs[0, :])
    handles = draw_gantt(gantt, sim.events, chunks=max(1, plan.chunks), iteration_s=sim.iteration_s)
    pred = plan.predicted
    gantt.set_title(
        f"{title}\niteration {fmt_seconds(pred.iteration_s)} · {pred.samples_per_s:,.1f} samples/s · "
        f"bubble {100 * sim.bubble_fraction:.1f}%",
        fontsize=10,
        loc="left",
    )
    key = fig.add_subplot(gs[1, :])
    key.axis("off")
    key.legend(handles=handles, loc="center", ncol=len(handles), frameon=False, fontsize=8)
    mem = fig.add_subplot(gs[2, 0])
    draw_memory(mem, plan, capacity_bytes)
    info = fig.add_subplot(gs[2, 1])
    info.axis("off")
    mh, ml = mem.get_legend_handles_labels()
    info.legend(mh, ml, loc="upper left", fontsize=8, frameon=False, title="memory", title_fontsize=8)
    lines = [f"schedule: {plan.schedule}" + (f" (v={plan.chunks})" if plan.chunks > 1 else ""),
             f"microbatches: {plan.microbatches} × {plan.microbatch_size}",
             f"data-parallel replicas: {getattr(plan, 'data_parallel', 1)}",
             f"dtype: {plan.dtype}, optimizer: {plan.optimizer}",
             f"recomputation: {('per block' if plan.recompute_granularity == 'block' else 'on') if plan.recompute else 'off'}",
             f"sharding: {SHARDING_NAMES[plan.sharding]}"]
    info.text(0.0, 0.0, "\n".join(lines), va="bottom", ha="left", fontsize=9, family="monospace", transform=info.transAxes)
    return _png(fig)


LOG_AXIS_SPAN = 30.0
"""Largest/smallest bar beyond which compare's axis turns logarithmic (a bar under 1/30 is a sliver)."""


def compare_axis_is_log(values: Sequence[float]) -> bool:
    """Whether the feasible bars span more than LOG_AXIS_SPAN (infeasible rows, drawn as 0, do not count)."""
    positive = [v for v in values if v > 0]
    return len(positive) > 1 and max(positive) / min(positive) > LOG_AXIS_SPAN


def compare_png(rows: list[dict[str, Any]], *, title: str = "") -> bytes:
    """Horizontal bars of predicted samples/s per profile, annotated with the best configuration."""
    n = max(1, len(rows))
    fig = Figure(figsize=(9, 1.2 + 0.55 * n))
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(len(rows)))
    values = [r["samples_per_s"] or 0.0 for r in rows]
    colours = ["#4C72B0" if r["feasible"] else "#CCCCCC" for r in rows]
    ax.barh(ys, values, color=colours)
    top = max(values + [1e-9])
    log = compare_axis_is_log(values)  # 3.6K beside 4M: a linear axis draws the small bar as nothing
    left = min(v for v in values if v > 0) / 2 if log else 0.0
    for y, r, v in zip(ys, rows, values, strict=True):
        if r["feasible"]:
            reps = r["replicas"] if isinstance(r["replicas"], int) else max(r["replicas"])
            used = 100 * (1 - (r["memory_headroom_fraction"] or 0))
            label = (f" {fmt_count(v)}/s   {r['stages']} stage{'s' if r['stages'] != 1 else ''} × {reps} replica{'s' if reps != 1 else ''}, "
                     f"M={r['microbatches']}, {r['schedule']}, {used:.0f}% memory")
        else:
            label = " no feasible plan"
        ax.text(max(v, left), y, label, va="center", ha="left", fontsize=8)  # log axes have no 0
    ax.set_yticks(ys)
    ax.set_yticklabels([r["profile"] for r in rows])
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
        ax.set_xlim(left, top * 30)
        ax.set_xlabel("predicted samples/s (log scale)")
    else:
        ax.set_xlim(0, top * 1.9)
        ax.set_xlabel("predicted samples/s")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_count(x)))
    ax.set_title(title, fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return _png(fig)
