"""Issue 19 point 4: without a flush, the stages that hold a tied parameter meet at every update.

runtime/pipedream.update sums a tied parameter's gradients over its holders (a GPT's embedding on the first
stage and its LM head on the last) before each optimizer step, so a holder cannot finish an update before
every holder has run that microbatch's backward. Independent values: on 2 stages with free transfers, the
hand-derived steady state of asynchronous 1F1B (stage 0 runs F(m+1) before B(m); stage 1 runs F(m+1) once
its update of m has met stage 0's backward of m) has period b0 + max(f0, f1 + b1) with the tie and
max(f0 + b0, f1 + b1) without. PipeDream-2BW meets once per window: a balanced pipeline (no slack to absorb
the wait) loses stage 0's backward b0 per window.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction as Fr
from pathlib import Path

import pytest

from pipeplan.planner.simulate import simulate


@pytest.mark.parametrize("seed", range(8))
def test_pipedream_tied_period_is_the_hand_value(seed):
    rng = random.Random(seed)
    f0, b0, f1, b1 = (Fr(rng.randint(1, 12), 4) for _ in range(4))
    M = rng.choice([2, 3, 4, 6])
    tied = simulate("pipedream", [f0, f1], [b0, b1], [0, 0], M, tied_stages=[[0, 1]])
    free = simulate("pipedream", [f0, f1], [b0, b1], [0, 0], M)
    assert tied.iteration_s == M * (b0 + max(f0, f1 + b1))
    assert free.iteration_s == M * max(f0 + b0, f1 + b1)


def test_2bw_meets_once_per_window():
    f, b, M = [Fr(1), Fr(1)], [Fr(2), Fr(2)], 4
    free = simulate("pipedream-2bw", f, b, [0, 0], M)
    tied = simulate("pipedream-2bw", f, b, [0, 0], M, tied_stages=[[0, 1]])
    assert free.iteration_s == M * 3
    assert tied.iteration_s == M * 3 + b[0]


def test_flushing_schedules_and_untied_stages_are_unchanged():
    f, b = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        assert simulate(schedule, f, b, [0.1] * 3, 6, tied_stages=[[0, 2]]).iteration_s == \
            simulate(schedule, f, b, [0.1] * 3, 6).iteration_s
    assert simulate("pipedream", f, b, [0.1] * 3, 6, tied_stages=[[1]]).iteration_s == \
        simulate("pipedream", f, b, [0.1] * 3, 6).iteration_s
    with pytest.raises(ValueError, match="tied_stages"):
        simulate("pipedream", f, b, [0.1] * 3, 6, tied_stages=[[0, 3]])


def test_a_tied_gpt_plan_records_its_holders_and_replays_them(tmp_path):
    """The planner passes the tied embedding's holders to the simulator, the plan keeps them, and `show`'s
    replay from the plan alone gives the same iteration time, longer than without the meeting."""
    from pipeplan.costmodels.trace import trace
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.plan import load_plan
    from pipeplan.planner.predict import evaluate
    from pipeplan.planner.replay import simulate_from_plan
    from runtime_helpers import EXAMPLES

    profile = load_profile("a100-80gb-sxm")
    for model, tied in ((Path(__file__).parent / "runtime_model_gpt.py", [[0, 1]]), (EXAMPLES / "mlp.py", [])):
        graph = trace(str(model), batch_size=2, time_layers=False)
        n = len(graph.layers)
        assignment = [0] * (n // 2) + [1] * (n - n // 2)
        plan = evaluate(graph, profile, assignment, schedule="pipedream", microbatches=4, batch_size=8)
        assert plan.tied_stages == tied
        path = tmp_path / "plan.json"
        plan.save(path)
        doc = json.loads(path.read_text())
        assert doc.get("tied_stages", []) == tied and ("tied_stages" in doc) == bool(tied)
        assert simulate_from_plan(load_plan(path)).iteration_s == pytest.approx(plan.predicted.iteration_s,
                                                                                 rel=1e-9)
        if tied:
            plan.tied_stages = []
            assert simulate_from_plan(plan).iteration_s < plan.predicted.iteration_s
