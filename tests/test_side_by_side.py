"""A local plan on several devices is re-predicted at the slowdown its own stages show computing side by side
(runtime/side_by_side.py, planner/replay.with_measured_slowdown, cli/device_like.measure_slowdown_like_device)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.costmodels.trace import trace
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.local_device import (
    PROBE_ROUNDS,
    DeviceLikeThreads,
    alone_and_together,
    slowdown_from_probes,
)
from pipeplan.planner.overlap import overlap_share
from pipeplan.planner.plan import load_plan
from pipeplan.planner.predict import evaluate
from pipeplan.planner.replay import MEASURED_SLOWDOWN_KEY, MEASURED_SPLIT_KEY, simulate_plan, with_measured_slowdown
from pipeplan.planner.simulate import Event
from pipeplan.runtime.side_by_side import measure_slowdown, stages_by_device

HERE = Path(__file__).resolve().parent
MODEL = HERE / "split_cost_model.py"  # 16 Linear(64) + ReLU pairs
HALF = [0] * 16 + [1] * 16


@pytest.fixture(scope="module")
def graph():
    with DeviceLikeThreads(1):
        return trace(str(MODEL), 16, repeats=1, fvcore_check=False)


def two_stage_plan(graph, profile, schedule="1f1b"):
    return evaluate(graph, profile, HALF, schedule=schedule, microbatches=2, batch_size=32, times="measured",
                    optimizer="sgd")


def test_each_device_runs_the_stages_placed_on_it():
    stage = lambda i, devices: SimpleNamespace(index=i, devices=devices)  # noqa: E731
    interleaved = SimpleNamespace(stages=[stage(0, [0]), stage(1, [1]), stage(2, [0]), stage(3, [1])])
    assert stages_by_device(interleaved) == [[0, 2], [1, 3]]
    v = SimpleNamespace(stages=[stage(0, [0]), stage(1, [1]), stage(2, [1]), stage(3, [0])])
    assert stages_by_device(v) == [[0, 3], [1, 2]]
    replicated = SimpleNamespace(stages=[stage(0, [0, 2]), stage(1, [1, 3])])
    assert stages_by_device(replicated) == [[0], [1], [0], [1]]


def test_alone_and_together_takes_its_barrier_and_sees_serialised_work():
    """Two threads whose steps hold one lock for 20 ms: alone each takes 20 ms, together one waits for the other, so
    the slowest per round takes twice as long: `slowdown_from_probes` reads 2 (within timer and scheduler noise)."""
    lock, barrier, out = threading.Lock(), threading.Barrier(2), {}

    def step():
        with lock:
            time.sleep(0.02)

    def rank(r):
        out[r] = alone_and_together(step, r, 2, barrier=barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(len(out[r][0]) == PROBE_ROUNDS and len(out[r][1]) == PROBE_ROUNDS for r in range(2))
    assert 1.8 < slowdown_from_probes([out[0], out[1]]) < 2.3


def test_overlap_share_is_the_compute_that_runs_beside_another_devices():
    ev = lambda d, kind, a, b: Event(d, d, 0, 0, kind, a, b)  # noqa: E731
    # device 0 computes 0-2 s, device 1 1-3 s: each overlaps the other for 1 s of its 2
    assert overlap_share([ev(0, "fwd", 0, 2), ev(1, "bwd", 1, 3)]) == pytest.approx(0.5)
    # sends and all-reduces are not compute; a device's own spans are not counted twice
    assert overlap_share([ev(0, "fwd", 0, 2), ev(0, "wgrad", 1, 2), ev(1, "send", 0, 2), ev(1, "recompute", 2, 3)]) == 0
    # three devices: 0 (0-4 s) overlaps 1 (0-1) and 2 (3-4): 2 of its 4 s; 1 and 2 wholly: (2 + 1 + 1) / 6
    assert overlap_share([ev(0, "fwd", 0, 4), ev(1, "fwd", 0, 1), ev(2, "bwd", 3, 4)]) == pytest.approx(4 / 6)
    assert overlap_share([ev(0, "fwd", 0, 1)]) == 0 and overlap_share([]) == 0


def test_the_measured_slowdown_replaces_the_probes_on_the_compute_that_overlaps(graph, tmp_path):
    prof = load_profile("a100-80gb")  # concurrency_slowdown 1: the traced times as they are
    assert prof.concurrency_slowdown == 1.0
    # data parallel: both replicas compute every op at once, so all of the measurement is charged
    dp = evaluate(graph, prof, [0] * 32, schedule="1f1b", microbatches=2, batch_size=32, data_parallel=2,
                  times="measured", optimizer="sgd")
    dp.alternatives = [{"schedule": "gpipe", "iteration_s": 1.0}]  # the search's runners-up
    measured = with_measured_slowdown(dp, graph, prof, 1.25)
    assert measured.alternatives == dp.alternatives  # re-predicting the plan leaves them as they were
    assert measured.stages[0].predicted.fwd_s == pytest.approx(1.25 * dp.stages[0].predicted.fwd_s, rel=1e-12)
    assert measured.stages[0].predicted.bwd_s == pytest.approx(1.25 * dp.stages[0].predicted.bwd_s, rel=1e-12)
    assert measured.solver[MEASURED_SLOWDOWN_KEY] == pytest.approx(1.25)
    # a 2-stage pipeline of 2 microbatches: its stages compute at once only part of the step, at the share the
    # simulated step (at no slowdown) shows
    plan = two_stage_plan(graph, prof)
    alone = simulate_plan(plan, graph, prof)
    share = overlap_share(alone.events)
    assert 0 < share < 1
    measured = with_measured_slowdown(plan, graph, prof, 1.25)
    factor = 1 + 0.25 * share
    for before, after in zip(plan.stages, measured.stages, strict=True):
        assert after.predicted.fwd_s == pytest.approx(factor * before.predicted.fwd_s, rel=1e-12)
        assert after.predicted.bwd_s == pytest.approx(factor * before.predicted.bwd_s, rel=1e-12)
    assert measured.predicted.iteration_s > plan.predicted.iteration_s
    assert measured.solver[MEASURED_SLOWDOWN_KEY] == pytest.approx(factor)
    assert any("1.250x slower than alone" in n and f"charged {factor:.3f}x" in n for n in measured.notes)
    measured.save(tmp_path / "plan.json")
    again = load_plan(str(tmp_path / "plan.json"))
    assert simulate_plan(again, graph, prof).iteration_s == pytest.approx(measured.predicted.iteration_s, rel=1e-12)


def test_the_stages_are_timed_side_by_side_in_their_own_processes(graph):
    plan = two_stage_plan(graph, dataclasses.replace(load_profile("a100-80gb"), local=True))
    slowdown = measure_slowdown(plan)
    if slowdown is None:  # fewer than 2 usable cores
        pytest.skip("needs 2 cores")
    assert 1.0 <= slowdown < 3.0  # clamped at 1, as calibrate's probe
    assert mp.active_children() == []
    one = evaluate(graph, load_profile("a100-80gb"), [0] * 32, schedule="1f1b", microbatches=2, batch_size=32,
                   times="measured", optimizer="sgd")
    assert measure_slowdown(one) is None  # one device: nothing side by side


def test_a_device_that_fails_is_reported_and_no_process_is_left(graph):
    plan = two_stage_plan(graph, load_profile("a100-80gb"))
    plan.graph["model_file"] = str(HERE / "no_such_model.py")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    with pytest.raises(RuntimeError, match="device [01]: UserError"):
        measure_slowdown(plan)
    assert mp.active_children() == []


def test_a_plan_whose_stages_cannot_be_built_keeps_the_probes_figure(graph):
    from pipeplan.cli.device_like import measure_slowdown_like_device
    from pipeplan.planner.search import SearchResult

    local = dataclasses.replace(load_profile("a100-80gb"), local=True)
    plan = two_stage_plan(graph, local)
    plan.graph["model_file"] = str(HERE / "no_such_model.py")
    result = SearchResult(best=plan, alternatives=[], baseline=None, evaluated=1)
    out = measure_slowdown_like_device(graph, local, None, result)
    if len(os.sched_getaffinity(0)) < 2:
        assert out.best is plan
        return
    assert out.best is plan and MEASURED_SLOWDOWN_KEY not in plan.solver
    assert any("could not be timed side by side" in n for n in plan.notes)


def test_analyze_on_a_local_profile_times_the_plans_stages_side_by_side(tmp_path):
    """With zero bubble both measurements land in the plan."""
    local = dataclasses.replace(load_profile("a100-80gb-sxm"), name="test-local", local=True)
    save_profile(local, tmp_path / "local.yaml")
    result = CliRunner().invoke(cli, ["analyze", str(MODEL), "--gpus", "2", "-b", "32", "-m", "2", "--stages", "2",
                                      "--schedule", "zb-h1", "--repeats", "1", "--profile", str(tmp_path / "local.yaml"),
                                      "--json", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)
    plan = load_plan(str(tmp_path / "plan.json"))
    if len(os.sched_getaffinity(0)) < 2:
        assert MEASURED_SLOWDOWN_KEY not in plan.solver
        return
    assert 1.0 <= plan.solver[MEASURED_SLOWDOWN_KEY] < 3.0 and MEASURED_SPLIT_KEY in plan.solver
    # the second refinement re-predicts the plan and keeps the first one's note
    assert any("timed side by side" in n for n in plan.notes)
    assert any("split backward's extra" in n for n in plan.notes)


@pytest.mark.parametrize("best_figure,rival_figure,margin,swapped,rival_timed", [
    (3.0, 1.0, 0.05, True, True),  # slower at its own figure than the runner-up at its own: they change places
    (3.0, 1.0, 10.0, False, True),  # ... unless the runner-up is not faster by the margin
    (3.0, 4.0, 0.05, False, True),  # the runner-up could win at the probe's figure, and does not at its own
    (1.0, 4.0, 0.05, False, False),  # the best holds at its own figure: the runner-up is not timed
])
def test_the_runner_up_is_timed_where_it_could_win_and_the_faster_is_reported(graph, monkeypatch, best_figure,
                                                                               rival_figure, margin, swapped,
                                                                               rival_timed):
    from pipeplan.cli.device_like import measure_slowdown_like_device
    from pipeplan.planner.search import SearchResult

    monkeypatch.setattr("pipeplan.cli.device_like.SWAP_MARGIN", margin)
    local = dataclasses.replace(load_profile("a100-80gb"), local=True)  # concurrency_slowdown 1: the probe's figure
    first, second = sorted((two_stage_plan(graph, local, "gpipe"), two_stage_plan(graph, local, "1f1b")),
                           key=lambda p: -p.predicted.samples_per_s)  # as the search ranks them
    figures = {first.schedule: best_figure, second.schedule: rival_figure}
    timed: list[str] = []

    def fake_measure(plan, threads=1):
        timed.append(plan.schedule)
        return figures[plan.schedule]

    monkeypatch.setattr("pipeplan.runtime.side_by_side.measure_slowdown", fake_measure)
    result = SearchResult(best=first, alternatives=[second], baseline=first, evaluated=2)
    out = measure_slowdown_like_device(graph, local, None, result)
    assert timed == ([first.schedule, second.schedule] if rival_timed else [first.schedule])
    at_own = {p.schedule: with_measured_slowdown(p, graph, local, figures[p.schedule]).predicted.iteration_s
              for p in (first, second)}
    winner = second if swapped else first
    assert out.best.schedule == winner.schedule
    assert out.best.predicted.iteration_s == pytest.approx(at_own[winner.schedule], rel=1e-12)
    assert [p.schedule for p in out.alternatives] == [p.schedule for p in (first, second) if p is not winner]
    assert (out.baseline is None) == swapped  # the equal-layers baseline was the other plan's configuration
    assert any("re-predicted its two fastest plans" in n for n in out.best.notes) == swapped
    if rival_timed and not swapped:  # the runner-up keeps its own figure among the alternatives
        assert out.alternatives[0].predicted.iteration_s == pytest.approx(at_own[second.schedule], rel=1e-12)
    # the plan file's runners-up are the result's, as they now stand
    assert [(a["schedule"], a["iteration_s"]) for a in out.best.alternatives] == \
        [(p.schedule, p.predicted.iteration_s) for p in out.alternatives]
