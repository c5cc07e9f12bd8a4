"""Issue 19 point 2: PipeDream-2BW (Narayanan et al., ICML 2021, §3.1) planned with its memory and run.

The runtime (real torchrun + gloo runs of runtime/pipedream_2bw.py) against tests/pipedream_2bw_reference.py
(the paper's update rule in one process): losses and final parameters at rtol 1e-4 for the examples the
PipeDream tests run (skips: U-Nets; tied weights: the GPTs), on 2 stages and on 2 stages x 2 pipeline
replicas. Memory against the formula (two weight versions on every stage), the simulator against a hand
computation of the 1F1B steady state, and the search's 2BW plans against the runtime's rule and a run.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipedream_2bw_reference import two_bw_reference
from pipedream_reference import assert_dumped_equal
from pipeplan.costmodels import memory
from pipeplan.planner.configs import configurations
from pipeplan.planner.plan import load_plan
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.simulate import simulate
from pipeplan.runtime.pipedream import admitted, local_order
from pipeplan.runtime.pipedream_2bw import window_version
from pipeplan.schedules import SCHEDULES, microbatch_problem
from runtime_helpers import EXAMPLES, hand_plan, reference_steps, run_cli, run_cli_here
from test_pipedream_runtime import CASES, LR, _available, torchrun

STEPS = 4  # windows 2 and 3 use a shadow version one update behind the newest
LAYOUTS = {  # name -> (stages, whole-pipeline replicas, cases)
    "2stages": (2, 1, sorted(CASES)),
    "2stages-x2": (2, 2, ["mlp", "t-gpt-tied", "resnet"]),
}


def two_bw_plan(case: str, stages: int, replicas: int):
    model_file, batch, m = CASES[case]
    return hand_plan(str(model_file), stages=stages, devices=stages, schedule="pipedream-2bw", microbatches=m,
                     batch_size=batch * replicas, data_parallel=replicas)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request, tmp_path_factory):
    name = request.param
    stages, replicas, cases = LAYOUTS[name]
    cases = [c for c in cases if _available(c)]
    tmp = tmp_path_factory.mktemp(name)
    paths = []
    for c in cases:
        path = tmp / f"{c}.json"
        two_bw_plan(c, stages, replicas).save(path)
        paths.append(path)
    run_dir, dump = tmp / "run", tmp / "params"
    run_dir.mkdir()
    r = torchrun(paths, stages * replicas, run_dir, dump, "--steps", str(STEPS))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return name, cases, paths, run_dir, dump


@pytest.mark.slow
def test_2bw_run_equals_reference(layout_run):
    from pipeplan.runtime.report import summarize

    name, cases, paths, run_dir, dump = layout_run
    for i, (case, path) in enumerate(zip(cases, paths, strict=True)):
        plan = load_plan(path)
        out = run_dir / str(i) if len(cases) > 1 else run_dir
        doc = summarize(json.loads((out / "result.json").read_text()), plan)
        ref_losses, ref_params, ref_buffers, used = two_bw_reference(plan, STEPS, lr=LR)
        assert used == [0, 0, 1, 2]
        _, initial, _, _ = two_bw_reference(plan, 0)
        moved = max(float((ref_params[s][n] - initial[s][n]).abs().max()) for s in initial for n in initial[s])
        assert moved > 1e-5, f"{case}: the run barely trained, so equality would prove little"
        torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda s, case=case: f"{name} {case} losses: {s}")
        assert doc["measured"]["steps_measured"] == STEPS
        folder = dump / str(i) if len(cases) > 1 else dump
        assert assert_dumped_equal(plan, folder, ref_params, ref_buffers, f"{name} {case}") > 0


def test_reference_is_not_synchronous_training():
    """2BW's delayed update is not synchronous SGD: window 0 sees W(0) in both, window 1 does not (so the
    runtime comparison above could tell a run that used the newest version)."""
    plan = two_bw_plan("mlp", 2, 1)
    model_file, batch, m = CASES["mlp"]
    losses, _, _, _ = two_bw_reference(plan, 3, lr=0.05)
    sync, _, _ = reference_steps(str(model_file), batch, 3, microbatches=m, lr=0.05)
    assert losses[0] == pytest.approx(sync[0], rel=1e-5)
    assert losses[1] != pytest.approx(sync[1], rel=1e-4)


def versions_held(K: int, M: int, s: int, windows: int = 5) -> int:
    """Most weight versions stage s holds at once along local_order (one update per window of M backwards):
    the newest (its module) and those its in-flight microbatches use; fails if a forward asks for a version
    not made yet."""
    updates, inflight, most = 0, {}, 1
    for kind, i in local_order(windows * M, admitted([1] * K, s)):
        if kind == "F":
            inflight[i] = window_version(i, M)
            assert inflight[i] <= updates, (K, M, s, i)
        else:
            del inflight[i]
            updates += (i + 1) % M == 0
        most = max(most, len({updates, *inflight.values()}))
    return most


@pytest.mark.parametrize("K,M", [(2, 2), (2, 4), (3, 3), (4, 4), (4, 6), (3, 8)])
def test_1f1b_order_needs_only_two_versions(K, M):
    """Played along the runtime's 1F1B order, the rule asks on every stage for the shadow and the newest
    version only (the paper's two), for every window M >= K."""
    assert max(versions_held(K, M, s) for s in range(K)) == 2


def test_memory_keeps_two_versions_on_every_stage():
    """weights = 2 x one copy (ICML 2021 §3.1) on every stage, activations of 1F1B's K - s microbatches;
    PipeDream keeps K - s versions instead. The asynchronous loop holds a gradient receive buffer per in-flight
    microbatch (runtime/pipedream_comm.post_grad_recvs); pipeplan's 1F1B (pipeplan/lean_gpipe.py) the inputs in
    flight, the gradient it sent last and one gradient buffer, and each in-flight microbatch's output
    (memory.receive_buffers, kept_outputs). RangeMemory agrees with stage_memory."""
    K, M = 4, 8
    kw = dict(param_bytes=400, saved_bytes_per_mb=1000, input_bytes_per_mb=100, output_bytes_per_mb=50,
              stages=K, microbatches=M, optimizer="adam", dtype="fp32", recompute=False)
    for s in range(K):
        two = memory.stage_memory(schedule="pipedream-2bw", stage=s, **kw)
        one = memory.stage_memory(schedule="1f1b", stage=s, **kw)
        pd = memory.stage_memory(schedule="pipedream", stage=s, **kw)
        assert two.weight_versions == 2 and two.weights_bytes == 2 * 400
        # a stashed copy per in-flight microbatch beside the module's own weights (schedules._stashed_per_inflight)
        assert pd.weight_versions == K - s + 1 and pd.weights_bytes == (K - s + 1) * 400
        assert two.inflight == K - s and two.activation_bytes == one.activation_bytes == (K - s) * 1000
        grad_buffers = (K - s) if s < K - 1 else 0  # the last stage receives no gradient
        assert two.buffer_bytes == pd.buffer_bytes == 100 + 50 * grad_buffers
        assert one.buffer_bytes == 100 * (1 if s == 0 else K - s + 1) + 50 * (s < K - 1) + 50 * (K - s)
        assert two.total_bytes == one.total_bytes + 400 + two.buffer_bytes - one.buffer_bytes
    rm = memory.RangeMemory(param_bytes=[400, 400, 400, 400], saved_bytes=[1000] * 4, cut_bytes=[50] * 4,
                            input_bytes=100, schedule="pipedream-2bw", stages=K, microbatches=M, chunks=1,
                            recompute=False, optimizer="adam", dtype="fp32")
    for s in range(K):
        assert rm(s, s, s + 1) == memory.stage_memory(
            schedule="pipedream-2bw", stage=s, param_bytes=400, saved_bytes_per_mb=1000,
            input_bytes_per_mb=100 if s == 0 else 50, output_bytes_per_mb=50 if s < K - 1 else 0, stages=K,
            microbatches=M, optimizer="adam", dtype="fp32", recompute=False,
            largest_layer_param_bytes=400).total_bytes  # 2BW accumulates a window's gradients: one in flight


def test_predicted_iteration_is_the_1f1b_steady_state_plus_the_update():
    """Hand computation: without a flush the window of M microbatches takes M x (f + b) of the slowest stage
    (1F1B's steady state, no fill or drain), then each device stalls for its all-reduce and optimizer step."""
    r = simulate("pipedream-2bw", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 4, allreduce_s=[0.5, 0.25],
                 optimizer_s=[0.25, 0.25])
    assert r.pipeline_s == pytest.approx(4 * 3.0) and r.iteration_s == pytest.approx(12 + 0.75)
    r = simulate("pipedream-2bw", [1.0, 2.0], [2.0, 3.0], [0.0, 0.0], 4)
    assert r.iteration_s == pytest.approx(4 * 5.0)  # the last stage is the bottleneck
    flushed = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 4)
    assert flushed.iteration_s == pytest.approx((4 + 2 - 1) * 3.0)  # 1F1B pays the fill and drain
    assert simulate("pipedream-2bw", [1.0] * 3, [2.0] * 3, [0.0] * 3, 3).inflight_peak == [3, 2, 1]


def test_schedule_facts_and_search_space():
    """2BW: no flush, whole-pipeline replicas, window M >= K (ICML 2021 §3.1); not in "auto"; "all" and
    --schedule pipedream-2bw enumerate only windows the runtime runs."""
    rule = SCHEDULES["pipedream-2bw"]
    assert not rule.flushes and rule.replicates_whole_pipeline and rule.torch_class is None
    assert microbatch_problem("pipedream-2bw", 4, 3) and microbatch_problem("pipedream-2bw", 4, 4) is None
    assert "pipedream-2bw" not in PlanRequest(devices=4, batch_size=8).schedules
    for schedule in ("all", "pipedream-2bw"):
        request = PlanRequest(devices=4, batch_size=16, schedule=schedule)
        seen = [c for K in (1, 2, 4) for d in (1, 2) if K * d <= 4
                for c in configurations(request, K, d, 10) if c.schedule == "pipedream-2bw"]
        assert seen and all(c.microbatches >= c.stages and 16 % (c.microbatches * c.data_parallel) == 0
                            for c in seen)


@pytest.mark.slow
def test_planner_2bw_plan_runs(tmp_path):
    """`pipeplan plan --schedule pipedream-2bw` then `pipeplan run`: the plan the search picks (stages, whole-
    pipeline replicas, window) trains as the reference says; the report sets measured beside predicted."""
    graph, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    r = run_cli("trace", str(EXAMPLES / "mlp.py"), "-o", str(graph), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli_here("plan", str(graph), "-p", "t4", "--gpus", "4", "--batch-size", "16", "--schedule", "pipedream-2bw",
                     "--stages", "2", "-o", str(plan_path))
    assert r.returncode == 0, r.stderr[-2000:]
    plan = load_plan(plan_path)
    assert plan.schedule == "pipedream-2bw" and plan.microbatches >= len(plan.stages)
    r = run_cli("run", str(plan_path), "--steps", "3", "--warmup", "0", "--optimizer", "sgd", "--lr", str(LR),
                "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    ref_losses, _, _, _ = two_bw_reference(plan, 3, lr=LR)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    assert doc["predicted"]["iteration_s"] > 0 and doc["measured"]["iteration_s"] > 0


def test_vertical_sync_is_refused(tmp_path):
    """--vertical-sync is PipeDream's option; 2BW already gives a microbatch one version on every stage."""
    plan = two_bw_plan("mlp", 2, 1)
    plan.save(tmp_path / "p.json")
    r = run_cli_here("run", str(tmp_path / "p.json"), "--steps", "2", "--vertical-sync")
    assert r.returncode == 2 and "--vertical-sync applies to asynchronous PipeDream" in r.stderr, r.stderr


def test_plan_file_with_a_short_window_is_refused(tmp_path):
    """A plan file whose window is shorter than the pipeline is refused at load, naming the field (the paper's
    m >= d; with M <= K - 2 the first stage's 1F1B order even reaches a window before it has made that
    window's shadow version)."""
    from pipeplan.errors import UserError

    plan = two_bw_plan("mlp", 2, 1)
    plan.microbatches = 1
    plan.save(tmp_path / "p.json")
    with pytest.raises(UserError, match="microbatches"):
        load_plan(tmp_path / "p.json")
    for K, M in ((3, 1), (4, 2), (5, 3)):  # M <= K - 2: stage 0 would need a shadow it has not made yet
        with pytest.raises(AssertionError):
            versions_held(K, M, 0)


@pytest.mark.parametrize("replicas, held", [([1, 1, 1], [3, 2, 1]), ([1, 2], [3, 1]), ([2, 1], [2, 1]),
                                            ([1, 3, 2], [6, 2, 1]), ([2, 2], [2, 1])])
def test_pipedream_memory_counts_what_the_runtime_admits(replicas, held):
    """Async PipeDream with stages replicated one by one: a replica of stage s holds the microbatches it
    admits, ceil((r_s + ... + r_{K-1}) / r_s) (hand-computed `held`; SOSP'19 §3.2's NOAM on the input
    stage), not K - s, in activations and stashed weight copies alike (one each, beside the module's own
    weights); the runtime admits the same count."""
    K = len(replicas)
    kw = dict(param_bytes=400, saved_bytes_per_mb=1000, input_bytes_per_mb=100, output_bytes_per_mb=50,
              stages=K, microbatches=4, optimizer="sgd", dtype="fp32", recompute=False, schedule="pipedream")
    for s in range(K):
        m = memory.stage_memory(stage=s, stage_replicas=replicas, **kw)
        assert m.inflight == held[s] == admitted(replicas, s)
        assert m.weight_versions == held[s] + 1 and m.activation_bytes == held[s] * 1000
        assert memory.stage_memory(stage=s, **kw).inflight == K - s  # replicas unknown: K - s
        two = memory.stage_memory(**{**kw, "schedule": "pipedream-2bw"}, stage=s, stage_replicas=replicas)
        assert two.inflight == K - s  # whole pipelines replicated: per-stage counts do not apply


def test_pipedream_prediction_uses_the_admitted_count():
    """The planner's prediction of a PipeDream plan whose second stage has 2 replicas charges stage 0 with
    ceil(3 / 1) = 3 stashed weight versions and microbatches (2 without the replication), each version a copy
    beside the module's own weights."""
    from pipeplan.planner.configs import Config
    from pipeplan.planner.predict import predict
    from search_fixtures import gpt_like, profile

    g = gpt_like(blocks=4, hidden=64, seq=16, vocab=100, batch=4)
    n = len(g.layers)
    assignment = [0] * (n // 2) + [1] * (n - n // 2)
    request = PlanRequest(devices=3, batch_size=8, schedule="pipedream")
    got = {}
    for reps in ((1, 2), (1, 1)):
        cfg = Config(schedule="pipedream", stages=2, data_parallel=max(reps), microbatches=4, stage_replicas=reps)
        got[reps] = predict(g, profile(40), assignment, cfg, request).plan.stages[0].predicted
    assert got[(1, 2)].weights_bytes * 3 == got[(1, 1)].weights_bytes * 4
    assert got[(1, 2)].activation_bytes > got[(1, 1)].activation_bytes
