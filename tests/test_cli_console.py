"""Piped output keeps whole numbers: rich would squeeze tables to 80 columns and end them in '…'."""

import io

from pipeplan.cli.console import stdout_console
from pipeplan.cli.run_report import render_table

DOC = {  # the shape runtime.report.summarize returns
    "plan": {"schedule": "1f1b", "stages": 2, "microbatches": 8},
    "losses": [2.773],
    "measured": {"iteration_s": 3.55899, "samples_per_s": 1150.9, "steps_measured": 3,
                 "stages": [{"index": i, "rank": i, "fwd_s": 0.12066, "bwd_s": 0.23861, "compute_s": 2.95895,
                             "wait_s": 0.60005, "peak_memory_bytes": 112 << 20} for i in range(2)]},
    "predicted": {"iteration_s": 2.90793, "samples_per_s": 1408.6,
                  "stages": [{"index": i, "fwd_s": 0.10962, "bwd_s": 0.2069, "compute_s": 0.31652,
                              "memory_bytes": 104 << 20} for i in range(2)]},
}


def test_piped_run_table_is_not_truncated(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = stdout_console()
    assert not console.is_terminal and console.width >= 140
    console.file = io.StringIO()
    render_table(DOC, console)
    text = console.file.getvalue()
    assert "…" not in text
    assert "120.66" in text and "2958.95" in text  # ms per microbatch and per step, in full


def test_an_fp16_run_says_its_loss_scale_and_the_steps_it_skipped():
    console = stdout_console()
    console.file = io.StringIO()
    render_table({**DOC, "loss_scale": {"scale": 1048576.0, "skipped_steps": 4}}, console)
    assert "loss scale: 1048576 after the last step; 4 step(s) skipped" in console.file.getvalue()
    console.file = io.StringIO()
    render_table(DOC, console)
    assert "loss scale" not in console.file.getvalue()


def test_columns_wins_when_set(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert stdout_console().width == 100


def test_piped_trace_summary_keeps_cells_whole(monkeypatch, capsys):
    """`pipeplan trace ... | cat` printed "33.6" and "MFLOP" on two lines, every line padded to 80 columns."""
    from cli_fixtures import chain_graph
    from pipeplan.cli.fmt import fmt_flops
    from pipeplan.cli.trace_cmd import print_summary

    monkeypatch.delenv("COLUMNS", raising=False)
    graph = chain_graph()
    print_summary(graph, "graph.json")
    lines = capsys.readouterr().out.splitlines()
    assert lines and [line for line in lines if line != line.rstrip()] == []
    heaviest = max(graph.layers, key=lambda l: l.fwd_s + l.bwd_s)
    cell = fmt_flops(heaviest.fwd_flops)
    assert " " in cell  # "4.19 MFLOP": the value and its unit, which a narrow table splits
    assert any(cell in line and "│" in line for line in lines)


def test_recompute_plans_compare_the_backward_with_its_rerun(monkeypatch):
    """With recomputation the measured backward re-runs the forward up to its last save (runtime/recompute.py), so
    its prediction column is backward + one re-run: in a plan from before `recompute_s`, the one compute_s counts,
    206.90 + (347.14 - 316.52) = 237.52 ms; in a newer plan its `recompute_s`, 206.90 + 20.00 = 226.90."""
    monkeypatch.delenv("COLUMNS", raising=False)
    for extra, expected in (({}, "237.52"), ({"recompute_s": 0.02}, "226.90")):
        console = stdout_console()
        console.file = io.StringIO()
        stages = [{**st, "compute_s": 0.34714, **extra} for st in DOC["predicted"]["stages"]]
        render_table({**DOC, "plan": {**DOC["plan"], "recompute": True},
                      "predicted": {**DOC["predicted"], "stages": stages}}, console)
        text = console.file.getvalue()
        assert expected in text and "206.90" not in text and "recomputed forward" in text


def test_zero_bubble_compares_the_b_pass(monkeypatch):
    """Under zero bubble the run times B apart from W (runtime/measure.py), so the column is B's prediction:
    the backward less W (100 ms), plus one re-run, but on the first stage, whose B torch leaves empty. An older
    plan's compute_s held two re-runs, B's and W's: 106.90 + 30.62 / 2 = 122.21 ms on stage 1."""
    monkeypatch.delenv("COLUMNS", raising=False)
    console = stdout_console()
    console.file = io.StringIO()
    stages = [{**st, "compute_s": 0.34714, "wgrad_s": 0.1} for st in DOC["predicted"]["stages"]]
    render_table({**DOC, "plan": {**DOC["plan"], "schedule": "zb-h1", "recompute": True},
                  "predicted": {**DOC["predicted"], "stages": stages}}, console)
    rows = [line for line in console.file.getvalue().splitlines() if "120.66" in line]
    assert len(rows) == 2 and "106.90" in rows[0] and "122.21" in rows[1]


def test_the_backward_prediction_counts_the_fresh_ones(monkeypatch):
    """bwd_s prices a backward that adds into existing gradients; the run's mean over M microbatches counts the
    step's first, which writes fresh ones (costmodels/accumulate.py): 206.90 - 16.00 / 8 = 204.90 ms under 1F1B;
    asynchronous PipeDream clears the gradients after every update, so all its backwards are fresh: 190.90."""
    monkeypatch.delenv("COLUMNS", raising=False)
    for schedule, expected in (("1f1b", "204.90"), ("pipedream", "190.90")):
        console = stdout_console()
        console.file = io.StringIO()
        stages = [{**st, "compute_s": st["fwd_s"] + st["bwd_s"], "fresh_grad_s": 0.016}
                  for st in DOC["predicted"]["stages"]]
        render_table({**DOC, "plan": {**DOC["plan"], "schedule": schedule},
                      "predicted": {**DOC["predicted"], "stages": stages}}, console)
        text = console.file.getvalue()
        assert expected in text and "206.90" not in text
