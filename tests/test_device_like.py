"""`analyze` on a local profile re-times the chosen configuration like a device before it reports (issue 16)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from cli_invoke import invoke as run
from pipeplan.costmodels.compute import LOCAL_TIMES_NOTE_PREFIX
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import save_profile
from pipeplan.hardware_profiles.local_device import DeviceLikeThreads
from pipeplan.planner.plan import load_plan

MLP = os.path.join(os.path.dirname(__file__), "..", "examples", "mlp.py")


@pytest.fixture(scope="module")
def local_profile(tmp_path_factory):
    """A catalogue profile marked local (this machine's calibration): a device is one core, one thread."""
    p = dataclasses.replace(load_profile("a100-80gb-sxm"), name="test-local", local=True)
    path = tmp_path_factory.mktemp("profiles") / "test-local.yaml"
    save_profile(p, path)
    return path


def test_analyze_reports_times_taken_like_a_device(local_profile, tmp_path):
    """The default trace (all cores, batch 1) is not what a rank sees; the reported plan's graph is the one
    re-traced at the plan's microbatch size on one thread, and the plan carries no note saying otherwise."""
    with DeviceLikeThreads(2):  # the first trace runs on two threads even on a one-core machine
        code, out, err = run(["analyze", MLP, "--gpus", "2", "-b", "64", "--repeats", "1", "--profile", local_profile,
                              "--json", "-o", tmp_path / "plan.json"])
    assert code == 0, err
    doc = json.loads(out)
    plan = load_plan(str(tmp_path / "plan.json"))
    assert doc["graph"]["source"]["threads"] == 1
    assert plan.graph["trace_batch_size"] == plan.microbatch_size == doc["graph"]["trace_batch_size"]
    assert plan.microbatch_size > 1  # so the first trace (batch 1) was indeed replaced
    assert not any(n.startswith(LOCAL_TIMES_NOTE_PREFIX) for n in plan.notes)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_16_bit_plan_is_timed_in_its_dtype_like_a_device(local_profile, tmp_path, dtype):
    """`pipeplan run` trains a bf16 or fp16 plan under autocast (pipeplan/precision.py); on this CPU its layers
    take other times than fp32's (examples/gpt.py's 3-4x the fp32 roofline in fp16 here), so the reported plan's
    graph is re-timed in the plan's dtype like a device, where it was priced at the roofline's 16-bit peak (the
    first trace is fp32's: no measured times in that dtype, and no note said so)."""
    with DeviceLikeThreads(2):
        code, out, err = run(["analyze", MLP, "--gpus", "2", "-b", "64", "--repeats", "1", "--profile", local_profile,
                              "--dtype", dtype, "--json", "-o", tmp_path / "plan.json"])
    assert code == 0, err
    plan = load_plan(str(tmp_path / "plan.json"))
    source = json.loads(out)["graph"]["source"]
    assert source["dtype"] == dtype and source["threads"] == 1 and source["timed"]
    assert plan.graph["trace_batch_size"] == plan.microbatch_size
    assert not any(n.startswith(LOCAL_TIMES_NOTE_PREFIX) for n in plan.notes)


def test_a_saved_graph_is_not_retraced_and_keeps_its_note(local_profile, tmp_path):
    with DeviceLikeThreads(2):
        code, _, err = run(["trace", MLP, "-b", "1", "--repeats", "1", "-o", tmp_path / "graph.json"])
    assert code == 0, err
    code, out, err = run(["plan", tmp_path / "graph.json", "--gpus", "2", "-b", "64", "--profile", local_profile,
                          "-o", tmp_path / "plan.json"])
    assert code == 0, err
    plan = load_plan(str(tmp_path / "plan.json"))
    assert plan.graph["trace_batch_size"] == 1
    assert any(n.startswith(LOCAL_TIMES_NOTE_PREFIX) for n in plan.notes)


def test_device_like_threads_restores_threads_and_cores():
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    with DeviceLikeThreads(1):
        assert torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == {min(cores)}
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == cores


def test_analyze_also_plans_with_a_half_and_a_quarter_of_the_microbatches_unless_the_user_fixed_them(monkeypatch):
    """The first search prices a trace at batch 1 per sample, which favours many small microbatches on a CPU, so
    analyze also searches at about a half and a quarter of its best plan's microbatch count (divisors of the batch),
    skipping a count with no plan, and times each like a device."""
    from types import SimpleNamespace

    from pipeplan.cli import device_like, workflow
    from pipeplan.errors import UserError
    from pipeplan.planner.request import PlanRequest

    asked = []

    def fake_search(graph, profile, request, progress=None):
        asked.append(request.microbatches)
        if request.microbatches == 1:
            raise UserError("no plan", "")
        return f"result at {request.microbatches}"

    monkeypatch.setattr(workflow, "run_search", fake_search)
    for batch, m, want_asked, want in ((64, 8, [4, 2], 2), (36, 6, [3, 1], 1), (64, 2, [1], 0), (64, 1, [], 0)):
        asked.clear()
        got = device_like._with_fewer_microbatches(None, None, PlanRequest(devices=2, batch_size=batch),
                                                   SimpleNamespace(microbatches=m))
        assert asked == want_asked, (batch, m)
        assert got == [f"result at {c}" for c in want_asked if c != 1] and len(got) == want, (batch, m)
    asked.clear()
    fixed = PlanRequest(devices=2, batch_size=64, microbatches=8)
    assert device_like._with_fewer_microbatches(None, None, fixed, SimpleNamespace(microbatches=8)) == []
    assert asked == []


def test_a_plan_with_fewer_microbatches_replaces_the_first_only_when_more_than_the_margin_faster(monkeypatch):
    from types import SimpleNamespace

    from pipeplan.cli import device_like
    from pipeplan.planner import replay

    monkeypatch.setattr(replay, "config_of", lambda plan: SimpleNamespace(describe=lambda: plan.name))

    def result(name, iteration_s):
        plan = SimpleNamespace(name=name, solver={}, notes=[],
                               predicted=SimpleNamespace(iteration_s=iteration_s, samples_per_s=64 / iteration_s))
        runner_up = SimpleNamespace(name=name + "'", solver={}, notes=[])
        return ("graph " + name, SimpleNamespace(best=plan, alternatives=[runner_up]))

    margin = device_like.RETIME_MARGIN
    first, close, faster = result("M=8", 0.2), result("M=4", 0.2 / (1 + margin / 2)), result("M=2", 0.2 / (1 + 2 * margin))
    assert device_like._fastest([first]) is first and first[1].best.notes == []  # nothing compared, nothing said
    assert device_like._fastest([first, close]) is first
    kept = device_like._fastest([first, close, faster])
    assert kept is faster
    compared = kept[1].best.solver[replay.COMPARED_KEY]
    assert compared.startswith("M=8 200.0 ms an iteration; M=4 ") and compared.endswith("M=2 181.8 ms an iteration")
    assert kept[1].alternatives[0].solver[replay.COMPARED_KEY] == compared  # a runner-up that takes over says it too
    assert kept[1].best.notes == [replay.compared_note(compared)]
