"""The search never emits a plan the runtime refuses: every schedule at its smallest legal microbatch count runs.

The rules are torch's, written here from its source (torch/distributed/pipelining/schedules.py), not
imported from pipeplan: Schedule1F1B raises when microbatches < stages; ScheduleInterleaved1F1B when
microbatches are not a multiple of max(1, microbatches // stages). The runtime test then trains the
search's plans at the smallest count each schedule allows and compares with single-process training.
"""

from __future__ import annotations

import json

import pytest
import torch

from cli_fixtures import chain_graph
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.configs import configurations
from pipeplan.planner.request import PlanRequest
from runtime_helpers import EXAMPLES, reference_steps, run_worker


def torch_refuses(schedule: str, stages: int, microbatches: int) -> bool:
    if schedule == "1f1b":
        return microbatches < stages
    if schedule == "interleaved":
        return microbatches % max(1, microbatches // stages) != 0
    return False


@pytest.mark.parametrize("batch", [1, 6, 8, 24])
def test_no_configuration_torch_refuses(batch):
    request = PlanRequest(devices=8, batch_size=batch, schedule="auto")
    seen = set()
    for K in range(1, 9):
        for d in range(1, 8 // K + 1):
            for c in configurations(request, K, d, n_layers=16):
                assert not torch_refuses(c.schedule, c.stages, c.microbatches), c
                seen.add((c.schedule, K, c.microbatches))
    # the search still offers every schedule where torch runs it: one microbatch on 2+ stages is gpipe's
    assert ("gpipe", 2, 1) in seen
    if batch >= 8:
        assert ("1f1b", 8, 8) in seen and ("interleaved", 4, 4) in seen


def test_explicit_flags_torch_refuses_are_user_errors():
    with pytest.raises(UserError, match="--schedule 1f1b needs at least as many microbatches as stages"):
        PlanRequest(devices=4, batch_size=8, stages=4, microbatches=2, schedule="1f1b")
    with pytest.raises(UserError, match="--schedule interleaved needs a microbatch count that is a multiple"):
        PlanRequest(devices=4, batch_size=12, stages=4, microbatches=6, schedule="interleaved")


def test_one_microbatch_on_two_stages_is_planned_as_gpipe():
    """The reported case: the search picked 1F1B with 1 microbatch on 2 stages, which torch refuses."""
    from pipeplan.planner.search import search

    plan = search(chain_graph(), load_profile("a100-80gb-sxm"),
                  PlanRequest(devices=2, batch_size=4, stages=2, microbatches=1)).best
    assert (plan.schedule, len(plan.stages), plan.microbatches) == ("gpipe", 2, 1)
    assert all(not torch_refuses(a["schedule"], 2, a["microbatches"]) for a in plan.alternatives)


@pytest.mark.slow
def test_each_schedule_runs_at_its_smallest_microbatch_count(tmp_path):
    """mlp.py on 2 devices: gpipe at 1 microbatch, 1f1b at 2, interleaved (2 chunks) at 2, and the auto
    search at 1; the search's own plans, trained by the runtime, equal single-process training."""
    from pipeplan.costmodels.trace import trace
    from pipeplan.planner.search import search

    model, batch = str(EXAMPLES / "mlp.py"), 8
    cases = [("gpipe", 1), ("1f1b", 2), ("interleaved", 2), ("auto", 1)]
    profile = load_profile("a100-80gb-sxm")
    plans, expected = [], []
    for schedule, m in cases:
        graph = trace(model, batch_size=batch // m, time_layers=False)
        request = PlanRequest(devices=2, batch_size=batch, stages=2, microbatches=m, schedule=schedule, data_parallel=1,
                              chunks=2 if schedule == "interleaved" else None, optimizer="sgd")
        plan = search(graph, profile, request).best
        assert not torch_refuses(plan.schedule, 2, plan.microbatches)
        path = tmp_path / f"{schedule}.json"
        plan.save(path)
        plans.append(str(path))
        expected.append((plan.schedule, m))
    assert expected == [("gpipe", 1), ("1f1b", 2), ("interleaved", 2), ("gpipe", 1)]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_worker(plans, 2, "--steps", "2", "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01", "--run-dir", str(run_dir))
    for i, (_, m) in enumerate(cases):
        result = json.loads((run_dir / str(i) / "result.json").read_text())
        losses = next(x["losses"] for x in result["ranks"] if x["losses"] is not None)
        ref, _, _ = reference_steps(model, batch, 2, microbatches=m)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)
