"""`pipeplan run` with bad flags, bad checkpoints and signals: one line, exit 2 (or 128+signal), nothing left behind.

The resume cases build their checkpoints in-process (runtime/checkpoint.py) with the
plan's fingerprint, so they are refused before any process starts; the signal cases
run the real launcher, torchrun and workers and look for survivors in /proc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bad_inputs import expect_user_error
from pipeplan.runtime import checkpoint as ckpt
from runtime_helpers import EXAMPLES, REPO, hand_plan


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "mlp-plan.json"
    hand_plan(str(EXAMPLES / "mlp.py"), stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=8).save(path)
    return path


def write_checkpoint(root: Path, plan_path: Path, step: int) -> Path:
    """A complete checkpoint of `step` for the plan's two stages; returns stage 1's shard."""
    fingerprint = json.loads(plan_path.read_text())["graph"]["fingerprint"]
    m = torch.nn.Linear(2, 2)
    for stage in (0, 1):
        ckpt.save_shard(root, step, stage, m, None)
    ckpt.save_manifest(root, step, stages=2, fingerprint=fingerprint, losses=[])
    return ckpt.step_dir(root, step) / "stage-1.pt"


def test_resume_from_a_missing_folder(plan_path, tmp_path):
    missing = tmp_path / "nowhere"
    expect_user_error(["run", plan_path, "--checkpoint-dir", missing, "--resume"], names=["--resume", str(missing)])
    assert not missing.exists()


def test_resume_from_an_empty_folder(plan_path, tmp_path):
    expect_user_error(["run", plan_path, "--checkpoint-dir", tmp_path, "--resume"],
                      names=["--resume", "no intact checkpoint", str(tmp_path)])


def test_resume_from_a_checkpoint_at_or_past_steps(plan_path, tmp_path):
    write_checkpoint(tmp_path, plan_path, 4)
    for steps in ("4", "2"):
        expect_user_error(["run", plan_path, "--steps", steps, "--checkpoint-dir", tmp_path, "--resume"],
                          names=["at step 4", f"--steps {steps}"])


def test_resume_from_a_truncated_only_checkpoint(plan_path, tmp_path):
    shard = write_checkpoint(tmp_path, plan_path, 2)
    shard.write_bytes(shard.read_bytes()[:100])
    expect_user_error(["run", plan_path, "--checkpoint-dir", tmp_path, "--resume"],
                      names=["no intact checkpoint", str(shard), "100 bytes"])


def test_resume_from_a_checkpoint_with_a_bad_manifest(plan_path, tmp_path):
    write_checkpoint(tmp_path, plan_path, 2)
    manifest = ckpt.step_dir(tmp_path, 2) / "manifest.json"
    doc = json.loads(manifest.read_text())
    for field, value in (("step", "two"), ("stages", 0), ("shards", ["a.pt", "b.pt"]), ("fingerprint", 7)):
        manifest.write_text(json.dumps({**doc, field: value}))
        expect_user_error(["run", plan_path, "--checkpoint-dir", tmp_path, "--resume"], names=[str(manifest), field])
    manifest.write_text(json.dumps(doc)[:40])
    expect_user_error(["run", plan_path, "--checkpoint-dir", tmp_path, "--resume"], names=[str(manifest), "invalid JSON"])


@pytest.mark.parametrize("args, names", [
    (["--warmup", "5", "--steps", "2"], ["--warmup", "--steps 2"]),
    (["--warmup", "2", "--steps", "2"], ["--warmup", "--steps 2"]),
    (["--checkpoint-every", "2"], ["--checkpoint-dir"]),
    (["--resume"], ["--checkpoint-dir"]),
    (["--steps", "0"], ["--steps"]),
    (["--nnodes", "3"], ["3 nodes"]),
    (["--nnodes", "2", "--node-rank", "2"], ["--node-rank 2", "--nnodes 2"]),
    (["--master-port", "70000"], ["--master-port"]),
    (["--lr", "nan"], ["--lr"]),
    (["--lr", "-0.1"], ["--lr"]),
    (["--lr", "1e999"], ["--lr"]),
    (["--steps", "-3"], ["--steps"]),
    (["--steps", "ten"], ["--steps"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--checkpoint-every", "-2", "--checkpoint-dir", "ck"], ["--checkpoint-every"]),
    (["--optimizer", "lion"], ["--optimizer"]),
])
def test_bad_run_flags(plan_path, args, names):
    expect_user_error(["run", plan_path, *args], names=names)


def test_chrome_trace_destination_is_checked_before_the_run(plan_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target in (tmp_path / "no" / "trace.json", blocker / "trace.json"):
        expect_user_error(["run", plan_path, "--chrome-trace", target], names=["--chrome-trace", str(target.parent)],
                          outputs=[target])


def _read_only(monkeypatch, folder: Path) -> None:
    """`folder` unwritable: chmod where that binds (not as root), else os.access answers as on a read-only mount."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root ignores modes
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == folder and mode & os.W_OK
                            else real(p, mode, **kw))


def test_output_folders_are_checked_before_the_run(plan_path, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    _read_only(monkeypatch, locked)
    try:
        for option, extra in (("--checkpoint-dir", ["--checkpoint-every", "1"]), ("--dump-params", [])):
            for target, why in ((blocker / "sub", "cannot create"), (blocker, "is a file"), (locked, "not writable")):
                expect_user_error(["run", plan_path, option, target, *extra], names=[option, str(target), why])
        for target, why in ((tmp_path / "no" / "run.log", "does not exist"), (locked / "run.log", "not writable")):
            expect_user_error(["run", plan_path, "--log", target], names=["--log", str(target), why], outputs=[target])
        expect_user_error(["run", plan_path, "--log", tmp_path], names=["--log", str(tmp_path), "is a directory"])
    finally:
        locked.chmod(0o755)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "locked"]


def test_an_unusable_temp_folder_is_a_user_error(plan_path, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    expect_user_error(["run", plan_path], names=[str(tmp_path / "gone"), "TMPDIR"])


def test_resume_from_a_file_or_a_damaged_shard_the_workers_would_load(plan_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    expect_user_error(["run", plan_path, "--checkpoint-dir", blocker, "--resume"], names=["--checkpoint-dir", str(blocker)])
    shard = write_checkpoint(tmp_path / "ck", plan_path, 2)
    manifest = ckpt.read_manifest(ckpt.step_dir(tmp_path / "ck", 2) / "manifest.json")
    shard.write_bytes(b"\0" * shard.stat().st_size)  # damaged after the launcher's check: what a rank sees
    with pytest.raises(ckpt.UserError, match="stage-1.pt does not match its SHA-256"):
        ckpt.load_shard(manifest, 1, torch.nn.Linear(2, 2), None)
    del manifest["shard_sha256"], manifest["shard_bytes"]  # a manifest without them (older format): torch's error
    with pytest.raises(ckpt.UserError, match="stage-1.pt: unreadable checkpoint shard"):
        ckpt.load_shard(manifest, 1, torch.nn.Linear(2, 2), None)


def _survivors(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and str(os.getpid()) != proc.name:
            found.append(f"{proc.name}: {cmd[:150]}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_torchrun_and_every_worker(plan_path, tmp_path, signum):
    """What a batch scheduler's cancel (SIGTERM) or Ctrl-C (SIGINT) does: all gone within 10 s, no temp folder."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeplan", "run", str(plan_path), "--steps", "100000", "--warmup", "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len([s for s in _survivors(str(plan_path)) if "runtime.worker" in s]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers never started"
            time.sleep(0.5)
        time.sleep(2)  # training
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 128 + signum, err
        assert [l for l in err.splitlines() if l.strip()] == [
            f"error: stopped by {signal.Signals(signum).name}: torchrun and every worker were stopped"]
        while _survivors(str(plan_path)) and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        assert _survivors(str(plan_path)) == []
        assert list(tmp_path.glob("pipeplan-run-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_killed_launcher_takes_torchrun_and_every_worker_with_it(plan_path, tmp_path):
    """SIGKILL (the OOM killer, a scheduler's last resort) cannot be forwarded: Linux's parent-death signal
    stops torchrun, and each worker's stops it if torchrun goes too; all gone within 10 s."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeplan", "run", str(plan_path), "--steps", "100000", "--warmup", "0"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len([s for s in _survivors(str(plan_path)) if "runtime.worker" in s]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers never started"
            time.sleep(0.5)
        proc.kill()
        proc.wait(timeout=5)
        t0 = time.monotonic()
        while _survivors(str(plan_path)) and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        assert _survivors(str(plan_path)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in _survivors(str(plan_path)):  # never leave a test's processes behind
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


@pytest.mark.slow
def test_sigterm_during_calibrate_stops_its_link_processes(tmp_path):
    out = tmp_path / "local.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "pipeplan", "profiles", "calibrate", "-o", str(out), "--quiet",
                             "--budget-s", "5"],  # the least: the compute loops before the link processes are short
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (kids := _children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "calibrate never started its link processes"
            time.sleep(0.2)
        time.sleep(1)
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 143, err
        assert [l for l in err.splitlines() if l.strip()] == ["error: stopped by SIGTERM"]
        t0 = time.monotonic()
        while [k for k in kids if Path(f"/proc/{k}").exists()] and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        assert [k for k in kids if Path(f"/proc/{k}").exists()] == []
        assert not out.exists() and not list(tmp_path.glob(".*.tmp"))
    finally:
        if proc.poll() is None:
            proc.kill()
