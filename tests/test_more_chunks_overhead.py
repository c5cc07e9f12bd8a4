"""The runtime's time per op when a device holds more stages: `profiles calibrate` runs interleaved 1F1B at 4
stages a rank as well as at 2 (hardware_profiles/op_overhead.chunks_overhead_s), the profile keeps that fixed term
(`op_overhead_us_more_chunks`), and a plan is charged along a line between the two counts by its own."""

from __future__ import annotations

import statistics

import pytest
from click.testing import CliRunner

from cli_fixtures import chain_graph
from pipeline_timeline import orders, timeline
from pipeplan import evaluate
from pipeplan.cli.main import cli
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.op_overhead import (
    CHUNKS,
    MORE_CHUNKS,
    MORE_CHUNKS_SHAPES,
    chunks_overhead_s,
    chunks_shape,
    message_bytes,
)
from pipeplan.hardware_profiles.profile import more_chunks_fixed_s
from test_op_overhead import BASE  # a two-device profile without measured figures

MEASURED = "op_overhead_us: {1f1b: 200, interleaved: 500}\nop_overhead_us_more_chunks: {interleaved: 800}\n"


def test_the_fixed_term_goes_in_a_line_from_the_calibrated_count_to_four_and_stays():
    assert (CHUNKS["interleaved"], MORE_CHUNKS) == (2, 4)
    want = {1: 500, 2: 500, 3: 650, 4: 800, 8: 800}  # by hand: 500 + (c - 2) / 2 x 300, clamped to [2, 4]
    assert {c: more_chunks_fixed_s(500, 800, c) for c in want} == pytest.approx(want)
    assert more_chunks_fixed_s(500, 400, 3) == pytest.approx(450)  # a run where 4 measured cheaper: followed too


def test_the_profile_keeps_it_and_charges_interleaved_plans_by_their_chunks(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + MEASURED + "op_overhead_us_per_mib: {interleaved: 100}\n")
    prof = load_profile(str(path))
    assert prof.op_overhead_more_chunks_s == pytest.approx({"interleaved": 8e-4})
    charged = {c: prof.overhead_for("interleaved", 2**20, chunks=c) * 1e6 for c in (2, 3, 4, 8)}
    assert charged == pytest.approx({2: 500 + 100, 3: 650 + 100, 4: 800 + 100, 8: 800 + 100})
    assert prof.overhead_for("1f1b", chunks=4) == pytest.approx(2e-4)  # one stage a device: untouched
    assert prof.overhead_for("zb-v", chunks=2) == pytest.approx(5e-4)  # the V takes interleaved's, at 2
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(str(tmp_path / "again.yaml")).op_overhead_more_chunks_s == pytest.approx({"interleaved": 8e-4})
    path.write_text(BASE + "op_overhead_us: {interleaved: 500}\n")  # calibrated before it was measured
    assert load_profile(str(path)).overhead_for("interleaved", chunks=4) == pytest.approx(5e-4)


def test_profiles_show_states_it(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + MEASURED)
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "fixed at 4+ stages a device: interleaved 800 µs" in r.output


@pytest.mark.parametrize("shapes", [MORE_CHUNKS_SHAPES, ("small", "large")])
def test_the_fit_takes_the_gaps_at_four_stages_a_rank_less_the_per_byte_term(monkeypatch, shapes):
    """Synthetic 2-rank pipelines of 8 stages (4 a rank) in which every op starts 700 µs (small shape) or 900 µs
    (large) after it could have: the fixed term is each shape's gap less the per-byte term at the bytes its ops
    move (ends of the pipeline one message, the 6 middle stages two: 1.75 messages an op), averaged over the shapes
    calibrate runs (one; two as well, for the mean)."""
    monkeypatch.setattr("pipeplan.hardware_profiles.op_overhead.MORE_CHUNKS_SHAPES", shapes)
    link = lambda nbytes: 5e-5 + nbytes / 4e9  # noqa: E731
    gap_us = {s: {"small": 700.0, "large": 900.0}[s] for s in shapes}
    first, second = orders("interleaved", 8, chunks=MORE_CHUNKS)
    assert {s for _, s, _ in first} == {0, 2, 4, 6} and {s for _, s, _ in second} == {1, 3, 5, 7}
    per_rank: list[dict] = [{}, {}]
    for shape, g in gap_us.items():
        n = message_bytes(shape)
        steps = [timeline("interleaved", 8, 3e-3, 6e-3, g * 1e-6, link(n), chunks=MORE_CHUNKS) for _ in range(3)]
        for r in (0, 1):
            per_rank[r][f"{chunks_shape(shape)}/interleaved"] = [step[r] for step in steps]
    per_byte = 1e-4 / 2**20  # 100 µs per MiB moved
    fixed, detail = chunks_overhead_s(per_rank, link, {"interleaved": per_byte})
    want = statistics.mean(g - 100 * message_bytes(s) / 2**20 * 1.75 for s, g in gap_us.items())
    assert fixed["interleaved"] * 1e6 == pytest.approx(want)
    assert detail[f"{chunks_shape(shapes[-1])}_interleaved"]["messages_per_op"] == 1.75
    assert chunks_overhead_s(per_rank, link, {})[0]["interleaved"] * 1e6 == pytest.approx(statistics.mean(
        gap_us.values()))
    assert chunks_overhead_s([{}, {}], link, {}) == ({}, {})  # a calibration without the runs: nothing


def test_a_plan_with_four_stages_a_device_is_charged_the_four_stage_figure(tmp_path):
    """The same 12-layer chain on 2 devices, interleaved at 2 and at 4 chunks (no per-byte term): every stage's
    op is charged 500 and 800 µs, and the iteration grows by at least the difference on the busier device's ops."""
    path = tmp_path / "box.yaml"
    path.write_text(BASE + MEASURED)
    prof = load_profile(str(path))
    graph = chain_graph()
    two = evaluate(graph, prof, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], schedule="interleaved", microbatches=4,
                   batch_size=16, chunks=2)
    four = evaluate(graph, prof, [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7], schedule="interleaved", microbatches=4,
                    batch_size=16, chunks=4)
    assert [s.predicted.op_overhead_s * 1e6 for s in two.stages] == pytest.approx([500] * 4)
    assert [s.predicted.op_overhead_s * 1e6 for s in four.stages] == pytest.approx([800] * 8)
    path.write_text(BASE + "op_overhead_us: {1f1b: 200, interleaved: 500}\n")
    before = evaluate(graph, load_profile(str(path)), [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7], schedule="interleaved",
                      microbatches=4, batch_size=16, chunks=4)
    # a device runs 4 stages x 4 microbatches x (forward, backward) = 32 ops, each 300 µs dearer
    assert four.predicted.iteration_s - before.predicted.iteration_s >= 32 * 300e-6 - 1e-9
