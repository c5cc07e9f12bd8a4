"""A zero-bubble plan on a local profile is re-predicted with its own stages' split-backward extras, timed the way
torch runs them (runtime/split_cost.py, planner/replay.with_split_extra, cli/device_like.measure_split_like_device)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.costmodels.split_backward import split_backward_extra_s
from pipeplan.costmodels.trace import trace
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.local_device import DeviceLikeThreads
from pipeplan.planner.plan import load_plan
from pipeplan.planner.predict import evaluate
from pipeplan.planner.replay import MEASURED_SPLIT_KEY, simulate_plan, with_split_extra
from pipeplan.runtime.split_cost import measure_split_extra_s
from timing_pairs import ratios_until_within

HERE = Path(__file__).resolve().parent
MODEL = HERE / "split_cost_model.py"
HALF = [0] * 16 + [1] * 16  # the model's 32 modules, 16 a stage


@pytest.fixture(scope="module")
def graph():
    with DeviceLikeThreads(1):
        return trace(str(MODEL), 16, repeats=1, fvcore_check=False)


def zb_plan(graph, profile):
    return evaluate(graph, profile, HALF, schedule="zb-h1", microbatches=2, batch_size=32, times="measured",
                    optimizer="sgd")


def test_measured_extras_replace_the_model_and_a_replay_reproduces_them(graph, tmp_path):
    prof = dataclasses.replace(load_profile("a100-80gb"), split_backward_s=1e-4, split_backward_group_s=5e-5)
    plan = zb_plan(graph, prof)
    modelled = split_backward_extra_s(graph.layers[16:], per_split_s=1e-4, per_group_s=5e-5,
                                      mem_bw_bytes_per_s=prof.mem_bw_bytes_per_s)
    # the model's own numbers as the "measurement": the same plan
    same = with_split_extra(plan, graph, prof, [0.0, modelled])
    assert same.predicted.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-12)
    measured = with_split_extra(plan, graph, prof, [0.0, 0.05])
    p0, p1 = plan.stages[1].predicted, measured.stages[1].predicted
    assert p1.bwd_s - p0.bwd_s == pytest.approx(0.05 - modelled)
    assert p1.wgrad_s - p0.wgrad_s == pytest.approx(0.05 - modelled)
    assert measured.stages[0].predicted.bwd_s == pytest.approx(plan.stages[0].predicted.bwd_s)
    # each of the two microbatches' W on the last stage ends the iteration later by the difference, at least once
    assert measured.predicted.iteration_s >= plan.predicted.iteration_s + (0.05 - modelled) - 1e-12
    assert measured.solver[MEASURED_SPLIT_KEY] == [0.0, 0.05]
    assert any("split backward's extra" in n and "50.00 ms" in n for n in measured.notes)
    measured.save(tmp_path / "plan.json")
    again = load_plan(str(tmp_path / "plan.json"))
    assert simulate_plan(again, graph, prof).iteration_s == pytest.approx(measured.predicted.iteration_s, rel=1e-12)


def test_a_measurement_must_cover_every_stage(graph):
    plan = zb_plan(graph, load_profile("a100-80gb"))
    with pytest.raises(ValueError, match="3 measured split extras for 2 stages"):
        with_split_extra(plan, graph, load_profile("a100-80gb"), [0.0, 1e-3, 1e-3])


def _direct_extra_s(pairs: int = 15) -> float:
    """The second stage's extra timed without pipeplan: the model's second half as a plain nn.Sequential, whole
    backward against torch's B + W, alternating."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    spec = {}
    exec(compile(MODEL.read_text(), str(MODEL), "exec"), spec)
    stage = spec["build_model"]()[16:]
    x = torch.randn(8, 64, requires_grad=True)

    def whole():
        out = stage(x)
        g = torch.ones_like(out)
        t0 = time.perf_counter()
        out.backward(g)
        return time.perf_counter() - t0

    def split():
        out = stage(x)
        g = torch.ones_like(out)
        t0 = time.perf_counter()
        _, groups = stage_backward_input([out], [g], [x], stage.parameters())
        stage_backward_weight(stage.parameters(), groups)
        return time.perf_counter() - t0

    for _ in range(3):
        whole(), split()
    return statistics.median(split() - whole() for _ in range(pairs))


def test_the_split_is_timed_on_each_stage_but_the_first(graph):
    """Stage 1 (8 Linear + ReLU pairs, 8 parameter groups) against the same half built directly: the same extra
    within a factor of two (the machine's speed drifts; the extra is host work, ~50 µs a group); stage 0's is 0."""
    plan = zb_plan(graph, load_profile("a100-80gb"))
    extras = []

    def pair() -> tuple[float, float]:
        with DeviceLikeThreads(1):
            extras.append(measure_split_extra_s(plan, pairs=15))
            direct = _direct_extra_s()
        assert direct > 0
        return extras[-1][1], direct

    def within(ratio: float) -> bool:
        return 0.5 < ratio < 2.0

    ratios = ratios_until_within(pair, within)
    assert within(ratios[-1]), (ratios, extras)
    assert all(len(extra) == 2 and extra[0] == 0.0 for extra in extras)


def test_analyze_on_a_local_profile_times_a_zero_bubble_plans_split(tmp_path, no_side_by_side):
    local = dataclasses.replace(load_profile("a100-80gb-sxm"), name="test-local", local=True)
    save_profile(local, tmp_path / "local.yaml")
    with DeviceLikeThreads(1):
        result = CliRunner().invoke(cli, ["analyze", str(MODEL), "--gpus", "2", "-b", "32", "-m", "2", "--stages", "2",
                                          "--schedule", "zb-h1", "--repeats", "1", "--profile",
                                          str(tmp_path / "local.yaml"), "--json", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)
    plan = load_plan(str(tmp_path / "plan.json"))
    measured = plan.solver[MEASURED_SPLIT_KEY]
    assert len(measured) == 2 and measured[0] == 0.0 and measured[1] > 0
    assert any("split backward's extra" in n for n in plan.notes)


def test_a_plan_whose_stages_cannot_be_built_keeps_the_models_figure(graph, monkeypatch):
    """The measurement refines a plan; where it fails (here: the model file is gone) the plan stands, with a note."""
    from pipeplan.cli.device_like import measure_split_like_device
    from pipeplan.planner.search import SearchResult

    local = dataclasses.replace(load_profile("a100-80gb"), local=True)
    plan = zb_plan(graph, local)
    plan.graph["model_file"] = str(HERE / "no_such_model.py")
    result = SearchResult(best=plan, alternatives=[], baseline=None, evaluated=1)
    out = measure_split_like_device(graph, local, None, result)
    assert out.best is plan and MEASURED_SPLIT_KEY not in plan.solver
    assert any("could not be timed" in n for n in plan.notes)
