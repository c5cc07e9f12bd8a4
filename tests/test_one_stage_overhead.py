"""The runtime's time per op of a one-stage plan (one device, or data-parallel replicas of one stage): GPipe's and
1F1B's loops with no messages, timed by `profiles calibrate` apart from the two-rank pipeline's gaps
(hardware_profiles/op_overhead.alone_overhead_s), stored in the profile and charged to one-stage plans only."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.op_overhead import ALONE_SCHEDULES, ALONE_SHAPES, STEP, alone_key, alone_overhead_s
from test_op_overhead import BASE  # a two-device profile without measured figures


def one_step(start_s: float, op_s: list[float], per_op_s: float) -> list[tuple]:
    """A step of a one-stage loop: its ops back to back, `per_op_s` of the loop's own time before each, and the
    STEP event spanning them."""
    events, t = [], start_s
    for i, d in enumerate(op_s):
        t += per_op_s
        events.append(("F" if i % 2 == 0 else "B", 0, i // 2, t, t + d, 0.0))
        t += d
    return [*events, (STEP, 0, 0, start_s, t, 0.0)]


def test_the_loops_own_time_per_op_is_recovered_and_a_hiccup_step_is_not_charged():
    """Steps of 8 microbatches (16 ops of unequal lengths) with 80 µs (gpipe) and 50 µs (1f1b) of the loop's own
    time per op: the charge gives back those figures; of 3 steps a rank records per shape, one that stalled 30 ms
    (the OS) does not move the median."""
    want = {"gpipe": 8e-5, "1f1b": 5e-5}
    per_rank: list[dict] = [{}, {}]
    for r in (0, 1):
        for shape in ALONE_SHAPES:
            for name in ALONE_SCHEDULES:
                ops = [3e-3 + 1e-4 * (i % 3) for i in range(16)]
                clean = one_step(0.0, ops, want[name])
                stalled = one_step(1.0, ops, want[name])
                stalled[-1] = (STEP, 0, 0, 1.0, stalled[-1][4] + 0.03, 0.0)
                per_rank[r][alone_key(shape, name)] = [clean, stalled, one_step(2.0, ops, want[name])]
    assert alone_overhead_s(per_rank) == pytest.approx(want, rel=1e-9)


def test_schedules_not_measured_alone_are_left_out():
    per_rank: list[dict] = [{alone_key("small", "1f1b"): [one_step(0.0, [1e-3, 2e-3], 1e-4)]}, {}]
    assert alone_overhead_s(per_rank) == pytest.approx({"1f1b": 1e-4})


def test_profile_keeps_the_one_stage_figure_and_uses_it_for_one_stage_ops_only(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + "op_overhead_us: {gpipe: 250, 1f1b: 200}\nop_overhead_us_per_mib: {1f1b: 100}\n"
                    "op_overhead_us_alone: {gpipe: 90, 1f1b: 60}\n")
    prof = load_profile(str(path))
    assert prof.op_overhead_alone_s == pytest.approx({"gpipe": 9e-5, "1f1b": 6e-5})
    assert prof.overhead_for("1f1b", alone=True) == pytest.approx(6e-5)
    assert prof.overhead_for("gpipe", alone=True) == pytest.approx(9e-5)
    assert prof.overhead_for("1f1b", 2**20) == pytest.approx(2e-4 + 1e-4)  # a pipeline's op: as before
    # a one-stage plan of a schedule whose loop was not timed alone (ZB-H1's torch class, PipeDream's own loop):
    # the pipeline's terms, as before this figure existed
    assert prof.overhead_for("zb-h1", alone=True) == prof.overhead_for("zb-h1") == pytest.approx(2e-4)
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(str(tmp_path / "again.yaml")).op_overhead_alone_s == pytest.approx(prof.op_overhead_alone_s)
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "one stage: gpipe 90 µs, 1f1b 60 µs" in next(x for x in r.output.splitlines() if "runtime per op" in x)


@pytest.mark.parametrize("value, words", [("{1f1b: -5}", "op_overhead_us_alone.1f1b"),
                                          ("{ring: 5}", "ring"), ("60", "mapping")])
def test_a_bad_one_stage_figure_exits_2_naming_the_field(tmp_path, value, words):
    path = tmp_path / "box.yaml"
    path.write_text(BASE + f"op_overhead_us_alone: {value}\n")
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)])
    assert r.exit_code == 2, r.output
    assert "op_overhead_us_alone" in r.stderr and words in r.stderr


def _planned(tmp_path, stages: int, overhead_yaml: str, name: str) -> dict:
    """`pipeplan plan` of a small chain, 1F1B with M = 4 of 4 on `stages` stages, with a profile carrying
    `overhead_yaml`: the plan file."""
    from cli_fixtures import chain_graph

    chain_graph().save(tmp_path / "graph.json")
    (tmp_path / f"{name}.yaml").write_text(BASE + overhead_yaml)
    out = tmp_path / f"{name}.json"
    args = ["plan", str(tmp_path / "graph.json"), "-p", str(tmp_path / f"{name}.yaml"), "--gpus", str(stages),
            "--stages", str(stages), "-m", "4", "-b", "16", "--schedule", "1f1b", "-o", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_a_one_stage_plan_is_charged_the_one_stage_figure_and_a_pipeline_is_not(tmp_path):
    """One stage, M = 4: 8 ops one after another on one device, so the iteration moves by exactly 8 x (250 - 60)
    µs between a profile without the one-stage figure and one with it; a 2-stage plan's ops keep the pipeline's."""
    pipeline = "op_overhead_us: {1f1b: 250}\n"
    before = _planned(tmp_path, 1, pipeline, "before")
    after = _planned(tmp_path, 1, pipeline + "op_overhead_us_alone: {1f1b: 60}\n", "after")
    assert [s["predicted"]["op_overhead_s"] for s in after["stages"]] == pytest.approx([6e-5])
    assert [s["predicted"]["op_overhead_s"] for s in before["stages"]] == pytest.approx([2.5e-4])
    moved = before["predicted"]["iteration_s"] - after["predicted"]["iteration_s"]
    assert moved == pytest.approx(8 * (250 - 60) * 1e-6, rel=1e-6)
    two = _planned(tmp_path, 2, pipeline + "op_overhead_us_alone: {1f1b: 60}\n", "two")
    assert [s["predicted"]["op_overhead_s"] for s in two["stages"]] == pytest.approx([2.5e-4, 2.5e-4])
