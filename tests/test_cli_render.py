"""Report and plot rendering on hand-built plans and real simulator timelines (no search, no tracing)."""

from __future__ import annotations

import struct

import pytest
from matplotlib.figure import Figure
from rich.console import Console

from cli_fixtures import chain_graph, hand_plan
from pipeplan.cli.fmt import fmt_bytes, fmt_count, fmt_flops, fmt_ms, fmt_pct, fmt_seconds, shorten
from pipeplan.cli.plots import GIB, compare_png, draw_gantt, draw_memory, schedule_png
from pipeplan.cli.report import baseline_line, compare_table, plan_report, stage_table
from pipeplan.cli.summary import compare_row, graph_summary, parameter_count, stage_params
from pipeplan.planner.simulate import simulate


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def render(renderable, width: int = 200) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_units():
    assert fmt_bytes(1.5 * 2**30) == "1.50 GiB"
    assert fmt_bytes(3 * 2**20) == "3.00 MiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(150 * 2**30) == "150.0 GiB"
    assert fmt_seconds(0.0123) == "12.3 ms"
    assert fmt_seconds(2.5e-5) == "25 µs"
    assert fmt_seconds(1.5) == "1.5 s"
    assert fmt_ms(0.00125) == "1.25"
    assert fmt_count(124_439_808) == "124M"
    assert fmt_flops(2.9e11) == "290 GFLOP"
    assert fmt_pct(0.1796) == "18.0%"
    assert shorten("transformer.h.11.mlp.c_proj", 12) == "….mlp.c_proj"


def test_graph_summary_counts_per_sample():
    g = chain_graph(batch=4)
    s = graph_summary(g)
    params = sum((p * w + w) for p, w in zip((256,) + tuple(l for l in (256, 256, 1024, 256, 256, 256, 2048, 256, 256, 512, 256)), (256, 256, 1024, 256, 256, 256, 2048, 256, 256, 512, 256, 256), strict=True))
    assert s["parameters"] == params == parameter_count(g.param_bytes)
    assert s["fwd_flops_per_sample"] == g.fwd_flops / 4
    assert s["bwd_flops_per_sample"] == 2 * s["fwd_flops_per_sample"]
    assert s["layers"] == 12 and s["fingerprint"] == g.fingerprint()


def test_stage_table_shows_each_stage_with_memory_against_capacity():
    plan = hand_plan(stages=4)
    g = chain_graph()
    text = render(stage_table(plan, g, capacity_bytes=80 << 30))
    for i in range(4):
        assert f"layers.{3 * i} → layers.{3 * i + 2}" in text
        assert f"{10 + i}.00 GiB ({round(100 * (10 + i) / 80)}%)" in text
    assert "% of 80.00 GiB usable" in text
    # parameters per stage come from the graph's layers
    params = stage_params(plan, g)
    assert params[0] == parameter_count(sum(g.layers[j].param_bytes for j in range(3)))
    assert "4.00 MiB, 0.25" in text and "Stages (ms per microbatch;" in text  # send bytes and time
    # the last stage sends nothing
    last = [line for line in text.splitlines() if "layers.9 → layers.11" in line][0]
    assert "—" in last


def test_report_has_predictions_and_baseline_ratio():
    plan = hand_plan()
    base = hand_plan()
    base.stages[0].layers.append(base.stages[1].layers.pop(0))  # a different split: 4/2/3/3 layers
    base.predicted.samples_per_s = 500.0
    base.predicted.peak_memory_bytes = 90 << 30
    text = render(plan_report(plan, model_summary=graph_summary(chain_graph()), graph=chain_graph(), baseline=base))
    assert "800.0 samples/s" in text
    assert "30.0%" in text and "42.0%" in text  # bubble and achieved FLOP/s fraction
    assert "1.60× faster" in text  # 800 / 500
    line = render(baseline_line(plan, base, capacity_bytes=80 << 30))
    assert "does not fit in memory" in line and "4/2/3/3 layers" in line
    assert "the same split as this plan" in render(baseline_line(plan, hand_plan()))
    assert "gpipe, 4 stages" in text and "8 microbatches of 4 (batch 32)" in text


def test_compare_table_and_rows():
    plan = hand_plan()

    class P:
        name, device, usable_memory_bytes, local = "a100-80gb-sxm", "A100", 80 << 30, False

    row = compare_row(P, plan, "bf16")
    assert row["stages"] == 4 and row["replicas"] == 1 and row["microbatches"] == 8 and row["schedule"] == "gpipe"
    assert row["memory_headroom_bytes"] == (80 << 30) - (13 << 30)
    assert row["memory_headroom_fraction"] == pytest.approx(67 / 80)
    bad = compare_row(P, None, "bf16", error="needs 90 GiB")
    text = render(compare_table([row, bad]))
    assert "800.0" in text and "4×1" in text and "needs 90 GiB" in text


def _sim(K=4, M=8, **kw):
    return simulate("gpipe", [1e-3] * K, [2e-3] * K, [0.25e-3] * (K - 1), M, **kw)


def test_gantt_draws_one_block_per_compute_event_at_its_time():
    sim = _sim()
    fig = Figure()
    ax = fig.add_subplot()
    draw_gantt(ax, sim.events, iteration_s=sim.iteration_s)
    compute = [e for e in sim.events if e.kind in ("fwd", "bwd")]
    # broken_barh collections: K idle backgrounds, then the blocks (one rectangle each, grouped by row and colour)
    sends = [e for e in sim.events if e.kind == "send"]
    blocks = [path for c in ax.collections[4:] for path in c.get_paths()]
    assert len(blocks) == len(compute) + len(sends)
    assert len(ax.collections) - 4 <= 4 * 3  # per device: sends, forward, backward (not one per block)
    starts = sorted(round(p.vertices[:, 0].min(), 9) for p in blocks)
    expect = sorted(round(e.start_s * 1e3, 9) for e in compute + sends)  # drawn in ms
    assert starts == expect
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(str(e.microbatch) for e in compute)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"device {d}" for d in range(4)]


def _bar_heights(ax) -> dict[int, float]:
    heights = {}
    for rect in ax.patches:
        x = round(rect.get_x() + rect.get_width() / 2)
        heights[x] = heights.get(x, 0) + rect.get_height()
    return heights


def test_memory_bars_stack_to_the_stage_peak():
    plan = hand_plan()  # stage i peaks at 10 + i GiB
    ax = Figure().add_subplot()
    draw_memory(ax, plan, 16 << 30)
    heights = _bar_heights(ax)
    assert [round(heights[i], 6) for i in range(4)] == [(10 + i) for i in range(4)]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(16.0)  # capacity line in GiB
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{round(100 * (10 + i) / 16)}%" for i in range(4))
    assert GIB == 2**30
    # far below capacity: the axis zooms to the bars and names the capacity instead of drawing it
    ax = Figure().add_subplot()
    draw_memory(ax, plan, 800 << 30)
    assert not ax.lines and ax.get_ylim()[1] < 20
    assert "800.0 GiB usable, off scale" in ax.get_title(loc="left")


def test_schedule_png_is_a_real_picture(tmp_path):
    plan = hand_plan(stages=4)
    data = schedule_png(plan, _sim(), capacity_bytes=80 << 30, title="tiny-chain")
    w, h = png_size(data)
    assert 900 <= w <= 2500 and 500 <= h <= 2000
    assert len(data) > 20_000


def test_compare_png(tmp_path):
    class P:
        name, device, usable_memory_bytes, local = "h100-sxm", "H100", 80 << 30, False

    rows = [compare_row(P, hand_plan(), "bf16"), compare_row(P, None, "bf16", error="does not fit")]
    w, h = png_size(compare_png(rows, title="x"))
    assert w > 500 and h > 100



@pytest.mark.parametrize("rates, scale", [((3.6e3, 4e6), "log"), ((2e6, 4e6), "linear")])
def test_compare_png_axis_shows_a_small_bar_beside_a_big_one(monkeypatch, rates, scale):
    """3.6K samples/s beside 4M drew as nothing on a linear axis: a span over 30x is drawn on a log axis, said
    in the label, with every label (an infeasible row's too) at a finite place."""
    import pipeplan.cli.plots as plots

    class P:
        device, usable_memory_bytes, local = "H100", 80 << 30, False

    rows = []
    for i, rate in enumerate(rates):
        P.name = f"gpu-{i}"
        row = compare_row(P, hand_plan(), "bf16")
        rows.append({**row, "samples_per_s": rate})
    P.name = "gpu-none"
    rows.append(compare_row(P, None, "bf16", error="does not fit"))
    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    plots.compare_png(rows, title="x")
    ax = figures[0].axes[0]
    assert ax.get_xscale() == scale and ("log scale" in ax.get_xlabel()) == (scale == "log")
    lo, hi = ax.get_xlim()
    assert 0 <= lo < min(rates) and hi > max(rates)
    assert all(lo <= t.get_position()[0] <= hi for t in ax.texts)

def test_progress_phases_become_lines_and_counters_stay_one_line():
    import io

    from pipeplan.cli.progress import progress_display

    console = Console(file=io.StringIO(), width=120, force_terminal=True)  # bars are for terminals only
    with progress_display(console=console) as phases:
        trace = phases("trace: ")
        trace("loading model file", 0, 1)
        trace("loading model file", 1, 1)
        trace("exporting", 0, 1)
        trace("timing layers", 0, 10)
        trace("timing layers", 4, 10)
        plan = phases("plan: ")
        for step in range(5):
            plan(f"{step + 1} stages x 1 replicas", step, 5)
        progress = trace._progress
        descriptions = [t.description for t in progress.tasks]
    assert descriptions == ["trace: loading model file", "trace: exporting", "trace: timing layers", "plan: 5 stages x 1 replicas"]
    assert all(t.completed == t.total for t in progress.tasks)  # finished phases show as complete



def test_piped_progress_is_silent():
    """Piped or logged, a live display would print rows of bar characters and cursor codes: nothing goes out."""
    import io

    from pipeplan.cli.progress import progress_display

    out = io.StringIO()
    with progress_display(console=Console(file=out, width=120)) as phases:
        trace = phases("trace: ")
        for done in range(4):
            trace("timing layers", done, 3)
    assert trace._progress is None and out.getvalue() == ""


def test_runners_up_name_the_placement_when_it_is_what_differs():
    """Two runners-up of one configuration that differ in rank placement used to read as the same row."""
    import dataclasses

    plan = hand_plan()
    row = {"schedule": "1f1b", "stages": 2, "chunks": 1, "data_parallel": 4, "replicas": [4, 4], "devices": 8,
           "microbatches": 8, "recompute": False, "sharding": "none", "samples_per_s": 790.0,
           "peak_memory_bytes": 12 << 30}
    same = dataclasses.replace(plan, alternatives=[{**row, "layout": "stage-major"}, {**row, "samples_per_s": 780.0}])
    assert "placement" not in render(plan_report(same, model_summary=graph_summary(chain_graph())))
    mixed = dataclasses.replace(plan, alternatives=[{**row, "layout": "pipeline-major"}, {**row, "samples_per_s": 780.0}])
    text = render(plan_report(mixed, model_summary=graph_summary(chain_graph())))
    rows = [line for line in text.splitlines() if "1f1b" in line and "│" in line]
    assert len(rows) == 2 and "pipeline-major" in rows[0] and "stage-major" in rows[1]
    assert "placement" in text and "the plan above places ranks stage-major" in text

def test_dtype_auto():
    from dataclasses import replace

    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.request import PlanRequest

    def resolve(dtype, profile):
        return PlanRequest(devices=1, batch_size=1, dtype=dtype).for_profile(profile).dtype

    a100, v100, tpu = (load_profile(n) for n in ("a100-80gb-sxm", "v100-32gb", "tpu-v5p"))
    assert resolve("auto", a100) == "bf16"
    assert resolve("auto", v100) == "fp16"  # Volta has fp16 tensor cores, no bf16
    assert resolve("auto", tpu) == "bf16"
    assert resolve("auto", replace(a100, local=True)) == "fp32"
    for pascal in ("p40", "gtx-1080-ti", "titan-x-pascal"):  # no bf16, fp16 at 1/64 of fp32: the datasheets'
        assert resolve("auto", load_profile(pascal)) == "fp32", pascal
    slow_fp16 = replace(a100, peak_flops={"fp32": 11e12, "tf32": None, "fp16": 11e12 / 64, "bf16": None})
    assert resolve("auto", slow_fp16) == "fp32"  # a 16-bit rate is no reason to train in 16 bits unless it is faster
    assert resolve("tf32", a100) == "tf32"


def test_memory_bars_per_device_for_interleaved_plans():
    plan = hand_plan(stages=4)
    plan.schedule, plan.chunks, plan.microbatches, plan.batch_size = "interleaved", 2, 4, 16
    for s in plan.stages:  # per-device predictions: virtual stages s and s+2 share device s % 2
        s.predicted.memory_bytes = (20 + s.index % 2) << 30
    ax = Figure().add_subplot()
    draw_memory(ax, plan, 30 << 30)
    heights = _bar_heights(ax)
    assert sorted(heights) == [0, 1] and [round(heights[i], 6) for i in (0, 1)] == [20, 21]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["dev 0\nS0,S2", "dev 1\nS1,S3"]
