"""Issue 19 point 1: asynchronous PipeDream in the runtime equals the single-process reference of its rule.

Real torchrun + gloo runs of runtime/pipedream.py's loop against tests/pipedream_reference.py (the update
rule applied in one process, versions from the closed form): losses and final parameters (every replica's
copy; BatchNorm statistics per replica) at rtol 1e-4, for every example the runtime runs (skips: U-Nets;
tied weights: the GPTs), on 2 and 3 stages, and with stages replicated unequally (2 + 1 on 3 processes).
One torchrun per layout runs all its plans (the worker takes several), so start-up is paid three times.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from pipedream_reference import assert_dumped_equal, pipedream_reference, version_seen
from pipeplan.errors import UserError
from pipeplan.planner.plan import Stage, load_plan
from pipeplan.runtime.pipedream import admitted, local_order
from runtime_helpers import EXAMPLES, REPO, hand_plan, load_dumped, run_cli, run_cli_here, run_worker

TESTS = REPO / "tests"
CASES = {  # name -> (model file, batch size, microbatches per step)
    "mlp": (EXAMPLES / "mlp.py", 8, 4),
    "gpt": (EXAMPLES / "gpt.py", 4, 4),
    "unet": (EXAMPLES / "unet.py", 4, 4),
    "resnet": (EXAMPLES / "resnet.py", 4, 4),
    "hf_gpt2": (TESTS / "runtime_model_hf_gpt2.py", 4, 4),
    "t-unet": (TESTS / "runtime_model_unet.py", 8, 4),
    "t-gpt-tied": (TESTS / "runtime_model_gpt.py", 8, 4),
    "frozen": (TESTS / "data" / "frozen_backbone.py", 8, 4),  # stage 0 of 2 holds frozen parameters only
}
STEPS = 3  # enough microbatches (12) that every stage runs on stale, stashed versions
LR = 5e-4  # 12 SGD updates: at 0.01 the summed-output GPT diverges and float noise, not the rule, would decide
LAYOUTS = {  # name -> (stages, replicas per stage, cases, vertical sync)
    "2stages": (2, [1, 1], sorted(CASES), False),
    "3stages": (3, [1, 1, 1], ["mlp", "t-gpt-tied", "t-unet", "gpt"], False),
    "replicas-2-1": (2, [2, 1], ["mlp", "t-unet"], False),
    "3stages-vertical-sync": (3, [1, 1, 1], ["t-gpt-tied", "t-unet"], True),
    "replicas-1-2-vertical-sync": (2, [1, 2], ["mlp"], True),
}


def _available(case: str) -> bool:
    if case == "hf_gpt2":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return False
    return CASES[case][0].exists()


def pipedream_plan(case: str, stages: int, replicas: list[int]):
    """A hand plan (layers split evenly) made asynchronous, stage s on the next replicas[s] ranks."""
    model_file, batch, m = CASES[case]
    plan = hand_plan(str(model_file), stages=stages, devices=stages, schedule="pipedream", microbatches=m,
                     batch_size=batch)
    first = [sum(replicas[:s]) for s in range(stages)]
    plan.stages = [Stage(index=s.index, layers=s.layers, devices=list(range(first[s.index], first[s.index] + r)),
                         replicas=r) for s, r in zip(plan.stages, replicas, strict=True)]
    plan.devices = sum(replicas)
    return plan


def torchrun(plans: list, nproc: int, run_dir, dump, *extra: str) -> subprocess.CompletedProcess:
    dump.mkdir(parents=True, exist_ok=True)
    return run_worker(plans, nproc, "--steps", str(STEPS), "--warmup", "0", "--optimizer", "sgd", "--lr", str(LR),
                      "--run-dir", str(run_dir), "--dump-params", str(dump), *extra, check=False)


def _launch_key(layout: str) -> tuple[int, bool]:
    """What a launch fixes for every plan it runs: the world size and --vertical-sync."""
    _, replicas, _, vertical = LAYOUTS[layout]
    return sum(replicas), vertical


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """layouts sharing a `_launch_key` -> one torchrun for all their plans (the worker runs them in turn and writes
    plan i's results under run_dir/<i>), made when a layout first asks; each entry (layout, case, results folder,
    dump folder, plan path)."""
    done: dict[tuple[int, bool], list[tuple[str, str, Path, Path, Path]]] = {}

    def run(key: tuple[int, bool]):
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"world{key[0]}{'-vertical-sync' if key[1] else ''}")
            plans = []
            for name in sorted(n for n in LAYOUTS if _launch_key(n) == key):
                stages, replicas, cases, _ = LAYOUTS[name]
                for c in (c for c in cases if _available(c)):
                    plans.append((name, c, tmp / f"{name}-{c}.json"))
                    pipedream_plan(c, stages, replicas).save(plans[-1][2])
            run_dir, dump = tmp / "run", tmp / "params"
            run_dir.mkdir()
            r = torchrun([p for *_, p in plans], key[0], run_dir, dump, *(["--vertical-sync"] if key[1] else []))
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            many = len(plans) > 1
            done[key] = [(name, c, run_dir / str(i) if many else run_dir, dump / str(i) if many else dump, path)
                         for i, (name, c, path) in enumerate(plans)]
        return done[key]
    return run


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request, launches):
    """(layout, [(case, results folder, dump folder, plan path)], vertical sync) of one layout's plans."""
    name = request.param
    runs = [(c, out, dump, path) for layout, c, out, dump, path in launches(_launch_key(name)) if layout == name]
    return name, runs, LAYOUTS[name][3]


@pytest.mark.slow
def test_async_pipedream_equals_reference(layout_run):
    from pipeplan.runtime.report import summarize

    name, runs, vertical = layout_run
    for case, out, folder, path in runs:
        plan = load_plan(path)
        doc = summarize(json.loads((out / "result.json").read_text()), plan)
        ref_losses, ref_params, ref_buffers = pipedream_reference(plan, STEPS, lr=LR, vertical_sync=vertical)
        _, initial, _ = pipedream_reference(plan, 0)
        moved = max(float((ref_params[s][n] - initial[s][n]).abs().max()) for s in initial for n in initial[s])
        assert moved > 1e-5, f"{case}: the run barely trained, so equality would prove little"
        if vertical:  # the option changes what is computed (else the comparison could not tell it was applied)
            plain = pipedream_reference(plan, STEPS, lr=LR)[1]
            assert any(not torch.equal(plain[s][n], ref_params[s][n]) for s in plain for n in plain[s])
        torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda s, case=case: f"{name} {case} losses: {s}")
        assert doc["measured"]["steps_measured"] == STEPS
        assert assert_dumped_equal(plan, folder, ref_params, ref_buffers, f"{name} {case}") > 0
        assert len(load_dumped(folder)) > 0


def test_stale_versions_differ_from_synchronous_training():
    """The rule is not synchronous SGD in disguise: with 3 stages, stage 0's forward of microbatch 2 still
    uses version 0 while the last stage has made two updates (a test that could not tell them apart
    would prove little)."""
    assert [version_seen(m, [1, 1, 1], 0) for m in range(5)] == [0, 0, 0, 1, 2]
    assert [version_seen(m, [1, 1, 1], 2) for m in range(5)] == [0, 1, 2, 3, 4]
    assert [version_seen(m, [2, 1], 0) for m in range(6)] == [0, 0, 0, 0, 1, 1]  # a_0 = ceil(3/2) = 2
    # vertical sync: the last stage uses the input stage's version, not its newest
    assert [version_seen(m, [1, 1, 1], 2, vertical_sync=True) for m in range(5)] == [0, 0, 0, 1, 2]


def test_local_order_is_the_rule_versions():
    """Counting updates along local_order's operations gives the closed-form versions the reference uses."""
    for replicas in ([1, 1], [1, 1, 1, 1], [2, 1], [1, 2], [3, 1, 2]):
        for s, r in enumerate(replicas):
            updates, seen = 0, {}
            for kind, i in local_order(12, admitted(replicas, s)):
                if kind == "F":
                    seen[i] = updates
                else:
                    updates += 1
            for j in range(r):
                assert all(seen[i] == version_seen(i * r + j, replicas, s) for i in range(12))


def _deadlock_free(replicas: list[int], n: int, admit=admitted) -> bool:
    """Run every replica's local_order with blocking receives and per-stage all-reduces after each backward:
    True when all finish. Sends never block (the loop uses isend)."""
    k = len(replicas)
    orders = {(s, j): local_order(n // replicas[s], admit(replicas, s)) for s in range(k) for j in range(replicas[s])}
    pos = dict.fromkeys(orders, 0)
    done: set[tuple[str, int, int]] = set()  # (kind, stage, microbatch)
    rounds: dict[tuple[int, int], int] = {}  # (stage, round) -> replicas arrived
    waiting: set[tuple[int, int]] = set()
    progress = True
    while progress:
        progress = False
        for (s, j), ops in orders.items():
            if pos[(s, j)] >= len(ops):
                continue
            kind, i = ops[pos[(s, j)]]
            m, r = i * replicas[s] + j, replicas[s]
            if (s, j) in waiting:  # in the all-reduce of round i - 1... wait for the others
                if rounds[(s, i)] < r:
                    continue
                waiting.discard((s, j))
                pos[(s, j)] += 1
                progress = True
                continue
            if kind == "F" and s > 0 and ("F", s - 1, m) not in done:
                continue
            if kind == "B" and s < k - 1 and ("B", s + 1, m) not in done:
                continue
            done.add((kind, s, m))
            progress = True
            if kind == "B":
                rounds[(s, i)] = rounds.get((s, i), 0) + 1
                waiting.add((s, j))
            else:
                pos[(s, j)] += 1
    return all(pos[key] >= len(ops) for key, ops in orders.items())


def test_schedule_never_deadlocks():
    for replicas in ([1, 1], [1, 1, 1, 1], [2, 1], [1, 2], [3, 1, 2], [2, 2, 1], [1, 3]):
        assert _deadlock_free(replicas, 12), replicas
    # the simulator does see a deadlock: a downstream stage admitting more than its upstream one
    assert not _deadlock_free([1, 1], 12, admit=lambda replicas, s: 1 if s == 0 else 3)


def test_cli_runs_a_pipedream_plan(tmp_path):
    """`pipeplan run --json` on an asynchronous plan: the report's losses are the reference's."""
    plan = pipedream_plan("t-gpt-tied", 2, [1, 1])
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--warmup", "1", "--optimizer", "sgd",
                "--lr", str(LR), "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    ref_losses, _, _ = pipedream_reference(load_plan(tmp_path / "plan.json"), STEPS, lr=LR)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    assert doc["measured"]["steps_measured"] == STEPS - 1 and doc["measured"]["iteration_s"] > 0


def test_refusals(tmp_path):
    """What the loop cannot run is one line before any process starts: tied weights on stages with different
    replica counts (checked by the workers), ZeRO, and a run whose last round of a replicated stage is short."""
    plan = pipedream_plan("mlp", 2, [2, 1])
    plan.sharding = "zero1"
    plan.save(tmp_path / "zero.json")
    r = run_cli_here("run", str(tmp_path / "zero.json"), "--steps", "2")
    assert r.returncode == 2 and "ZeRO sharding" in r.stderr, r.stderr
    plan = pipedream_plan("mlp", 2, [1, 1])
    plan.stages[0].devices, plan.stages[0].replicas, plan.devices = [0, 2, 3], 3, 4
    plan.stages[1].devices = [1]
    plan.save(tmp_path / "odd.json")
    r = run_cli_here("run", str(tmp_path / "odd.json"), "--steps", "2")  # 2 x 4 microbatches: rounds of 3 do not fit
    assert r.returncode == 2 and "not a multiple of 3" in r.stderr and "--steps a multiple of 3" in r.stderr, r.stderr
    plan = pipedream_plan("t-gpt-tied", 2, [2, 1])
    plan.save(tmp_path / "tied.json")
    r = run_cli("run", str(tmp_path / "tied.json"), "--steps", "2", timeout=180)
    assert r.returncode == 2 and "tied across stages" in r.stderr, r.stderr


@pytest.mark.slow
def test_planner_pipedream_plan_runs(tmp_path):
    """`pipeplan plan --schedule pipedream` then `pipeplan run`: whatever stages and replicas the planner picks
    (today one stage on 3 replicas at 1 microbatch a step, so a round spans 3 steps) train as the reference
    says, and the report sets the measured iteration beside the predicted one."""
    graph, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    r = run_cli("trace", str(EXAMPLES / "mlp.py"), "-o", str(graph), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli_here("plan", str(graph), "-p", "t4", "--gpus", "3", "--batch-size", "8", "--schedule", "pipedream",
                     "-o", str(plan_path))
    assert r.returncode == 0, r.stderr[-2000:]
    plan = load_plan(plan_path)
    assert plan.schedule == "pipedream"
    need = math.lcm(*(s.replicas for s in plan.stages))
    steps = need // math.gcd(need, plan.microbatches)
    steps *= -(-2 // steps)  # at least 2 steps
    r = run_cli("run", str(plan_path), "--steps", str(steps), "--warmup", "0", "--optimizer", "sgd", "--lr", str(LR),
                "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    ref_losses, _, _ = pipedream_reference(plan, steps, lr=LR)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    assert doc["predicted"]["iteration_s"] > 0 and doc["measured"]["iteration_s"] > 0
    assert len(doc["measured"]["stages"]) == sum(s.replicas for s in plan.stages)


def test_vertical_sync_option_is_checked(tmp_path):
    """--vertical-sync on a flushing plan is a user error (every microbatch already sees one version)."""
    plan = hand_plan(str(CASES["mlp"][0]), stages=2, devices=2, schedule="1f1b", microbatches=2, batch_size=4)
    plan.save(tmp_path / "p.json")
    r = run_cli_here("run", str(tmp_path / "p.json"), "--steps", "2", "--vertical-sync")
    assert r.returncode == 2 and "--vertical-sync applies to asynchronous PipeDream" in r.stderr, r.stderr


def test_an_ops_wait_in_its_receive_is_not_counted_as_compute():
    """runtime/pipedream.timed_op: a forward that waits 30 ms for its input and computes 10 ms records 10 ms, its
    span starting when the input arrived (before, stage 1 of a 2-stage mlp run showed 10.9 ms of "forward"
    against 2.1 ms traced: the wait for stage 0)."""
    import time as _time
    from types import SimpleNamespace

    from pipeplan.runtime.measure import StageStats
    from pipeplan.runtime.pipedream import timed_op

    class Stage(SimpleNamespace):
        def forward(self, m):
            _time.sleep(0.03)
            self.received_s += 0.03  # what AsyncStage.forward adds around recv_activations
            _time.sleep(0.01)

    st, stats = Stage(received_s=0.0), StageStats(index=1)
    origin = _time.perf_counter()
    timed_op(st, "F", 0, None, stats, origin)
    (fwd,) = stats.fwd_s
    assert 0.009 < fwd < 0.02
    kind, m, start, end = stats.events[0]
    assert (kind, m) == ("fwd", 0) and start >= 0.03 and end - start == pytest.approx(fwd)


@pytest.mark.slow
def test_replicas_taking_turns_by_step(tmp_path):
    """One stage on 2 replicas at one microbatch a step: step m runs on replica m mod 2, so each replica's steps
    alternate a round's time and none, side by side. The reported iteration is a round's time per step (the
    measured steps' elapsed time over their count; the slowest rank's step reads a whole round, twice that), and
    both replicas' memory is metered (each runs one microbatch of the first round)."""
    from pipeplan.runtime.placement import steps_per_round
    from pipeplan.runtime.report import summarize

    plan = hand_plan(str(EXAMPLES / "mlp.py"), stages=1, devices=1, schedule="pipedream", microbatches=1,
                     batch_size=64)
    plan.stages = [Stage(index=0, layers=plan.stages[0].layers, devices=[0, 1], replicas=2)]
    plan.devices = 2
    assert steps_per_round(plan) == 2
    path, run_dir = tmp_path / "plan.json", tmp_path / "run"
    run_dir.mkdir()
    plan.save(path)
    steps, warmup = 10, 1  # the default warm-up: a replica's first microbatch of step 1 is measured
    run_worker([path], 2, "--steps", str(steps), "--warmup", str(warmup), "--optimizer", "sgd", "--lr", str(LR),
               "--run-dir", str(run_dir))
    result = json.loads((run_dir / "result.json").read_text())
    doc = summarize(result, load_plan(path))
    ranks = [x for x in result["ranks"] if x is not None]
    # Each round of 2 steps: the slower replica's elapsed time over the round, per step; the median of the rounds
    # (a mean over all steps, compared within 30%, failed CI once on this noisy host: one slow round moves a mean).
    rounds = [max(x["step_s"][i] + x["step_s"][i + 1] for x in ranks) / 2 for i in range(0, steps - warmup - 1, 2)]
    assert len(rounds) == (steps - warmup) // 2
    assert doc["measured"]["iteration_s"] == pytest.approx(statistics.median(rounds), rel=1e-12)
    slowest_step = sorted(max(x["step_s"][i] for x in ranks) for i in range(steps - warmup))[(steps - warmup) // 2]
    assert slowest_step > 1.5 * doc["measured"]["iteration_s"]  # what the report read before
    peaks = [s["device_peak_bytes"] for s in doc["measured"]["stages"]]
    assert len(peaks) == 2 and peaks[0] == peaks[1]
    assert all(s["activation_bytes"] > 0 for s in doc["measured"]["stages"])
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(pipedream_reference(plan, steps, lr=LR)[0]),
                               rtol=1e-4, atol=1e-6)


def test_measured_steps_hold_a_round():
    """Replicas taking turns by step are read per round (runtime/report.py), so the measured steps must hold one;
    the fewest steps the refusal names are a multiple of the round that leaves one after the warm-up."""
    from pipeplan.runtime.pipedream import check_async_steps

    plan = pipedream_plan("mlp", 1, [2])
    plan.microbatches = 1
    check_async_steps(plan, 2, warmup=0)
    check_async_steps(plan, 4, warmup=2)
    with pytest.raises(UserError, match=r"measures 1 step\(s\), less than one round of 2.*pass --steps 4 or more"):
        check_async_steps(plan, 2, warmup=1)
    with pytest.raises(UserError, match="pass --steps 6 or more"):
        check_async_steps(plan, 4, warmup=3)
    plan.microbatches = 2  # a replica a microbatch every step: any measured step is a round
    check_async_steps(plan, 2, warmup=1)


def test_whole_rounds():
    """The steps `pipeplan run`'s default grows to: whole rounds, one measured after the warm-up; unchanged where a
    round is one step."""
    from pipeplan.runtime.placement import whole_rounds

    turns = pipedream_plan("mlp", 1, [2])
    turns.microbatches = 1
    assert [whole_rounds(turns, 10, w) for w in (0, 1, 8, 9)] == [10, 10, 10, 12]
    thirds = pipedream_plan("mlp", 2, [3, 1])
    thirds.microbatches = 2  # 2 microbatches a step on 3 replicas: rounds of 3 steps
    assert [whole_rounds(thirds, 10, w) for w in (1, 8)] == [12, 12]
    assert whole_rounds(pipedream_plan("mlp", 2, [2, 1]), 10, 9) == 10  # 4 microbatches a step: rounds of 1


@pytest.mark.slow
def test_default_steps_grow_to_whole_rounds(tmp_path):
    """A plan whose replicas take turns, with a warm-up that leaves less than a round of the default 10 steps: the
    default grows to 12 (said on stderr), and the run measures the round after the warm-up (typed --steps are
    refused as typed: test_measured_steps_hold_a_round)."""
    plan = pipedream_plan("mlp", 1, [2])
    plan.microbatches = 1
    plan.save(tmp_path / "turns.json")
    r = run_cli("run", str(tmp_path / "turns.json"), "--warmup", "9", "--optimizer", "sgd", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "running 12 steps, not the default 10" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["measured"]["steps_measured"] == 3 and len(doc["losses"]) == 12
    assert doc["measured"]["iteration_s"] > 0


def test_steps_per_round():
    """The fewest steps whose microbatches are a multiple of every stage's replica count (runtime/placement.py)."""
    from pipeplan.runtime.placement import steps_per_round

    def plan(replicas, m, schedule="pipedream"):
        p = pipedream_plan("mlp", len(replicas), replicas)
        p.microbatches, p.schedule = m, schedule
        return p

    assert steps_per_round(plan([2], 1)) == 2 and steps_per_round(plan([2, 1], 4)) == 1
    assert steps_per_round(plan([2, 3], 1)) == 6 and steps_per_round(plan([2, 4], 2)) == 2
    assert steps_per_round(plan([2, 3], 2)) == 3
    assert steps_per_round(plan([2], 1, "pipedream-2bw")) == 1 and steps_per_round(plan([1, 1], 1, "1f1b")) == 1
