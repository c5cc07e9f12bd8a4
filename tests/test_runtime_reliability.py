"""Reliability of `pipeplan run`: a killed rank stops the run quickly and names its stage, a
resumed run reproduces the uninterrupted losses, and bad plans exit 2 with one line.

Two torchrun runs share a module fixture: run A checkpoints every 2 steps and has rank 1
killed at step 3 (tests/runtime_fault_worker.py, started instead of the worker through the
hidden --worker-script option); run B resumes from A's checkpoint. B's losses must equal an
uninterrupted single-process run's (which test_runtime_equivalence shows equals an
uninterrupted pipelined run). Adam, so the optimizer state must be restored too.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from runtime_helpers import REPO, hand_plan, reference_steps, run_cli, run_cli_here

MODEL = REPO / "tests" / "runtime_model_unet.py"
FAULT_WORKER = REPO / "tests" / "runtime_fault_worker.py"  # the worker, with a step hook that kills a rank
EXIT_WORKER = REPO / "tests" / "runtime_exit_worker.py"  # the worker, with an exit handler that leaves a mark
BATCH, M, STEPS, LR = 8, 4, 4, 0.01


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    hand_plan(str(MODEL), stages=2, devices=2, schedule="1f1b", microbatches=M, batch_size=BATCH, optimizer="adam").save(path)
    return path


@pytest.fixture(scope="module")
def killed_run(plan_path, tmp_path_factory):
    ckpt, tmp = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("tmpdir")
    log = tmp_path_factory.mktemp("log") / "run.log"
    t0 = time.monotonic()
    r = run_cli("run", str(plan_path), "--steps", str(STEPS), "--warmup", "0", "--lr", str(LR),
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--worker-script", str(FAULT_WORKER),
                "--log", str(log),
                env={"PIPEPLAN_TEST_KILL_RANK": "1", "PIPEPLAN_TEST_KILL_STEP": "3", "TMPDIR": str(tmp)}, timeout=120)
    assert list(tmp.iterdir()) == []  # the failed run removed its run folder (and torchrun's, torch's temp files)
    return r, time.monotonic() - t0, ckpt, log


@pytest.mark.slow
def test_killed_rank_stops_every_rank_and_names_its_stage(killed_run):
    r, elapsed, _, log = killed_run
    assert r.returncode == 1
    assert elapsed < 60
    assert r.stderr.strip().splitlines() == [
        f"error: rank 1 (stage 1) failed (exit code 9); all ranks were stopped (every rank's output: {log})"]
    text = log.read_text()  # --log keeps torchrun's report, which the run folder took with it
    assert "failed (exitcode: 9) local_rank: 1" in text


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_losses(killed_run, plan_path, tmp_path):
    _, _, ckpt, _ = killed_run
    manifest = json.loads((ckpt / "latest.json").read_text())
    assert manifest["step"] == 2  # step 4's checkpoint never happened: rank 1 died at step 3
    assert not (ckpt / "step-000004").exists() or not (ckpt / "step-000004" / "manifest.json").exists()
    trace = tmp_path / "trace.json"
    r = run_cli("run", str(plan_path), "--steps", str(STEPS), "--warmup", "0", "--lr", str(LR),
                "--checkpoint-dir", str(ckpt), "--resume", "--json", "--chrome-trace", str(trace), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["first_step"] == 2
    assert doc["resumed"] == {"step": 2, "dir": str(ckpt), "skipped": []}
    assert r.stderr.strip().splitlines() == [f"resumed from the checkpoint of step 2 in {ckpt}"]
    ref, _, _ = reference_steps(str(MODEL), BATCH, STEPS, microbatches=M, optimizer="adam", lr=LR)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref[2:]), rtol=1e-4, atol=1e-6)
    # the --json document and the chrome trace (measured devices 0-1, simulated 100-101)
    m = doc["measured"]
    assert m["iteration_s"] > 0 and m["samples_per_s"] == pytest.approx(BATCH / m["iteration_s"])
    assert [s["index"] for s in m["stages"]] == [0, 1]
    for s in m["stages"]:
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["compute_s"] <= m["iteration_s"] * 1.05
        assert s["peak_memory_bytes"] >= s["weights_bytes"] + s["grad_bytes"] + s["optimizer_bytes"] > 0
        # adam: exp_avg + exp_avg_sq, plus a 4-byte step counter per parameter tensor (< 16 tensors per stage here)
        assert 2 * s["grad_bytes"] < s["optimizer_bytes"] <= 2 * s["grad_bytes"] + 4 * 16
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert {0, 1} <= pids and {100, 101} <= pids


def test_too_many_devices_exits_2(tmp_path):
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=4)
    plan.save(tmp_path / "p.json")
    r = run_cli_here("run", str(tmp_path / "p.json"), "--steps", "2", "--nproc-per-node", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("error: the plan uses 2 devices") and len(r.stderr.strip().splitlines()) == 1


def test_async_pipedream_checkpoints_are_refused_plainly(tmp_path):
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="pipedream", microbatches=2, batch_size=4)
    plan.save(tmp_path / "p.json")
    r = run_cli_here("run", str(tmp_path / "p.json"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--checkpoint-every", "1")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoints of an asynchronous PipeDream run" in lines[0]


@pytest.mark.slow
def test_fingerprint_mismatch_exits_2(tmp_path):
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=4)
    plan.graph["fingerprint"] = "sha256:" + "0" * 32
    plan.save(tmp_path / "p.json")
    r = run_cli("run", str(tmp_path / "p.json"), "--steps", "2")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no longer matches the plan" in lines[0]


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_like_one_node(plan_path):
    """--nnodes/--node-rank/--master-addr/--master-port: two launchers (one rank each) rendezvous over TCP
    and train the same losses as single-process training."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [sys.executable, "-m", "pipeplan", "run", str(plan_path), "--steps", "3", "--warmup", "0", "--lr", str(LR),
              "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [subprocess.Popen(common + ["--node-rank", str(i)] + (["--json"] if i == 0 else []), cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for i in range(2)]
    out = [p.communicate(timeout=180) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-1500:] for o in out]
    assert "results are reported on node 0" in out[1][1]
    doc = json.loads(out[0][0])
    assert doc["plan"]["devices"] == 2 and [s["rank"] for s in doc["measured"]["stages"]] == [0, 1]
    ref, _, _ = reference_steps(str(MODEL), BATCH, 3, microbatches=M, optimizer="adam", lr=LR)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_plan_traced_at_batch_1_runs_at_another_microbatch(tmp_path):
    """Hugging Face's mask code exports differently at batch 1 (another fingerprint, the same layers): a plan
    traced at the default batch 1 and run at microbatch 2 trains, and equals single-process training."""
    from pipeplan.costmodels.model_file import load_model_file
    from pipeplan.costmodels.trace import export_structure
    from pipeplan.errors import UserError
    from pipeplan.planner.plan import load_plan
    from pipeplan.runtime.worker import load_split_model

    model = REPO / "tests" / "runtime_model_hf_gpt2.py"
    plan = hand_plan(str(model), stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=4)
    _, at_1 = export_structure(load_model_file(str(model)), 1)
    assert at_1.fingerprint() != plan.graph["fingerprint"]  # the case: batch 1 exports another program
    plan.graph.update(fingerprint=at_1.fingerprint(), trace_batch_size=1)
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "0", "--optimizer", "sgd", "--lr",
                "0.01", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ref, _, _ = reference_steps(str(model), 4, 2, microbatches=2)
    torch.testing.assert_close(torch.tensor(json.loads(r.stdout)["losses"]), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    renamed = json.loads((tmp_path / "plan.json").read_text())
    renamed["stages"][1]["layers"][0] += "_x"  # other layer names: still refused, where every rank checks its plan
    (tmp_path / "bad.json").write_text(json.dumps(renamed))  # (the exit 2 of that: test_fingerprint_mismatch_exits_2)
    with pytest.raises(UserError, match="no longer matches the plan"):
        load_split_model(load_plan(tmp_path / "bad.json"))


@pytest.mark.slow
def test_a_finished_rank_leaves_without_python_finalization(plan_path, tmp_path):
    """Every rank ends through runtime/worker.leave_without_finalizing once its work is done: its exit handlers do
    not run (torch's C++ teardown during finalization aborted a finished rank now and then), the run succeeds."""
    marks = tmp_path / "marks"
    marks.mkdir()
    r = run_cli("run", str(plan_path), "--steps", "2", "--warmup", "0", "--json", "--worker-script", str(EXIT_WORKER),
                env={"PIPEPLAN_TEST_MARK_DIR": str(marks)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["measured"]["steps_measured"] == 2
    assert list(marks.iterdir()) == []
