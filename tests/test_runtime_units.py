"""Fast unit tests of the runtime's pure parts: checkpoints, failure parsing, placement, loss
combination, the saved-tensor memory meter. No processes are started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeplan.errors import UserError
from pipeplan.planner.plan import Plan, Prediction, Stage
from pipeplan.runtime import checkpoint as ckpt
from pipeplan.runtime.launch import LaunchOptions, failed_rank, shared_cores_warning, torchrun_command
from pipeplan.runtime.measure import SavedTensorMeter
from pipeplan.runtime.placement import combine_losses, rank_stages, stage_ranks, torch_schedule_class
from pipeplan.schedules import SCHEDULES


def _plan(devices: list[list[int]], schedule="1f1b", data_parallel=1) -> Plan:
    stages = [Stage(index=i, layers=[f"l{i}"], devices=d, replicas=len(d)) for i, d in enumerate(devices)]
    return Plan(graph={"fingerprint": "sha256:x"}, profile="p", schedule=schedule, microbatches=2, batch_size=8,
                stages=stages, predicted=Prediction(), devices=len({r for d in devices for r in d}),
                data_parallel=data_parallel)


def test_checkpoint_ignores_step_without_manifest(tmp_path):
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    for stage in (0, 1):
        ckpt.save_shard(tmp_path, 2, stage, m, opt)
    ckpt.save_manifest(tmp_path, 2, stages=2, fingerprint="sha256:x", losses=[1.0, 0.5])
    ckpt.save_shard(tmp_path, 4, 0, m, opt)  # step 4 interrupted: one shard, no manifest
    latest, skipped = ckpt.latest(tmp_path, stages=2, fingerprint="sha256:x")
    assert skipped == []
    assert latest["step"] == 2 and latest["losses"] == [1.0, 0.5]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 2
    m2 = torch.nn.Linear(2, 2)
    opt2 = torch.optim.Adam(m2.parameters())
    ckpt.load_shard(latest, 1, m2, opt2)
    assert torch.equal(m2.weight, m.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(UserError, match="another model or plan"):
        ckpt.latest(tmp_path, stages=2, fingerprint="sha256:other")
    with pytest.raises(RuntimeError, match="missing"):
        ckpt.save_manifest(tmp_path, 4, stages=2, fingerprint="sha256:x", losses=[])


def _two_checkpoints(root):
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in (2, 4):
        for stage in (0, 1):
            ckpt.save_shard(root, step, stage, m, opt)
        ckpt.save_manifest(root, step, stages=2, fingerprint="sha256:x", losses=[])
    return ckpt.step_dir(root, 4) / "stage-1.pt"


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "bytes, the manifest says"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "does not match its SHA-256"),
    (lambda p: p.unlink(), "is missing"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage, why):
    shard = _two_checkpoints(tmp_path)
    damage(shard)
    latest, skipped = ckpt.latest(tmp_path, stages=2, fingerprint="sha256:x")
    assert latest["step"] == 2
    assert len(skipped) == 1 and "step 4" in skipped[0] and why in skipped[0] and str(shard) in skipped[0]


def test_no_intact_checkpoint_and_a_bad_manifest(tmp_path):
    _two_checkpoints(tmp_path)
    for step in (2, 4):
        (ckpt.step_dir(tmp_path, step) / "stage-0.pt").write_bytes(b"")
    latest, skipped = ckpt.latest(tmp_path, stages=2, fingerprint="sha256:x")
    assert latest is None and len(skipped) == 2
    manifest = ckpt.step_dir(tmp_path, 4) / "manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "step": -3}))
    with pytest.raises(UserError, match=r"manifest.json: step is -3: must be an integer >= 0"):
        ckpt.latest(tmp_path, stages=2, fingerprint="sha256:x")


def test_failed_rank_from_torchrun_report(tmp_path):
    log = """[rank0]: RuntimeError: Connection closed by peer
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:42:06
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
"""
    assert failed_rank(log, tmp_path, 2) == (1, "exit code -9")
    (tmp_path / "status-rank0").write_text("done\n")
    assert failed_rank("no report", tmp_path, 2) == (1, "no exit status")


def test_combine_losses_over_replicas():
    assert combine_losses([[1.0, 2.0], [3.0, 4.0]], mean=True) == [2.0, 3.0]
    assert combine_losses([[1.0, 2.0], [3.0, 4.0]], mean=False) == [4.0, 6.0]
    assert combine_losses([], mean=True) == []


def test_stage_placement():
    assert stage_ranks(_plan([[0], [1]])) == {0: [0], 1: [1]}
    inter = _plan([[0], [1], [0], [1]], schedule="interleaved")
    assert rank_stages(stage_ranks(inter), 1) == (0, [1, 3])
    dp = _plan([[0, 1], [2, 3]], data_parallel=2)  # stage-major: pipelines (0, 2) and (1, 3)
    assert rank_stages(stage_ranks(dp), 3) == (1, [1])
    with pytest.raises(UserError, match="round-robin"):
        stage_ranks(_plan([[1], [0]]))
    assert stage_ranks(_plan([[0], [1]], schedule="pipedream")) == {0: [0], 1: [1]}
    assert stage_ranks(_plan([[0, 1], [2]], schedule="pipedream")) == {0: [0, 1], 1: [2]}
    with pytest.raises(UserError, match="one stage per device"):
        stage_ranks(_plan([[0], [0]], schedule="pipedream"))
    with pytest.raises(UserError, match="data_parallel"):
        stage_ranks(_plan([[0, 1], [2]]))


def test_schedules_map_to_torch_classes_or_are_refused():
    """pipeplan.schedules names the torch class; the runtime runs it, or refuses with the one message."""
    from torch.distributed import pipelining

    for name, f in SCHEDULES.items():
        if f.torch_class is None:
            with pytest.raises(UserError, match="asynchronous PipeDream .* not supported"):
                torch_schedule_class(name)
        else:
            assert torch_schedule_class(name) == f.torch_class and hasattr(pipelining, f.torch_class)


def test_torchrun_starts_the_worker_module_unless_a_test_names_a_script(tmp_path):
    cmd = torchrun_command("p.json", 2, LaunchOptions(steps=3), str(tmp_path))
    assert cmd[cmd.index("--standalone") + 1:][:3] == ["-m", "pipeplan.runtime.worker", str(Path("p.json").resolve())]
    script = tmp_path / "fault.py"
    cmd = torchrun_command("p.json", 2, LaunchOptions(steps=3, worker_script=str(script)), str(tmp_path))
    assert cmd[cmd.index("--standalone") + 1:][:2] == [str(script), str(Path("p.json").resolve())]
    assert "pipeplan.runtime.worker" not in cmd


def test_saved_tensor_meter_counts_each_storage_once_and_releases():
    meter = SavedTensorMeter(weight_storages=set())
    a = torch.randn(1000, requires_grad=True)
    with meter.hooks():
        b = a.exp()  # saves its result b (4000 bytes)
        c = b.sin()  # saves its input: b again, the same storage
        d = (c * 2).sum()
    assert meter.peak == 4000 and meter.current == 4000
    d.backward()
    del b, c, d
    assert meter.current == 0 and meter.peak == 4000


def test_pin_to_core_binds_each_local_rank_to_its_own_core_only_when_ranks_fit():
    import os

    from pipeplan.hardware_profiles.local_device import pin_to_core

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    try:
        assert pin_to_core(len(cores) - 1, len(cores)) == cores[-1]
        assert os.sched_getaffinity(0) == {cores[-1]}
        os.sched_setaffinity(0, before)
        assert pin_to_core(0, len(cores) + 1) is None  # more ranks than cores: leave it alone
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)


def test_saved_tensor_meter_leaves_out_weights_and_their_views():
    """A Linear saves weight.t(), a new tensor on the weight's memory: it is weight, not activation."""
    from pipeplan.runtime.measure import weight_storages

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.BatchNorm1d(64))
    x = torch.randn(8, 64)
    meter = SavedTensorMeter(weight_storages([model]))
    with meter.hooks():
        model(x).sum().backward()
    # saved activations, 8 x 64 fp32 = 2048 bytes each: x (first Linear), the first ReLU's output (saved by it
    # and by the second Linear: once), the second ReLU's output (by it, and as BatchNorm's input), and
    # BatchNorm's per-channel batch mean and inverse std (64 floats each)
    assert meter.peak == 3 * 2048 + 2 * 256


def test_meter_disabled_steps_run_without_hooks():
    """The worker meters only untimed steps: a disabled meter must not see saved tensors."""
    from pipeplan.runtime.measure import StageStats, StepClock, instrument

    meter = SavedTensorMeter(weight_storages=set())
    w = torch.randn(50, 50, requires_grad=True)

    class FakeStage:  # just the two methods instrument() wraps
        def forward_one_chunk(self, i, *a, **k):
            return (torch.randn(10, 50) @ w).relu().sum()

        def backward_one_chunk(self, i, *a, **k):
            return None

    st = FakeStage()
    instrument(st, StageStats(index=0), StepClock(), meter)
    meter.enabled = False
    st.forward_one_chunk(0)
    assert meter.peak == 0
    meter.enabled = True
    out = st.forward_one_chunk(1)
    assert meter.peak > 0
    del out


def test_the_loss_counts_in_the_last_stages_forward():
    """torch's schedules compute the loss after forward_one_chunk; its time joins that forward (the trace's
    accounting), on recorded steps only, and the forward's event ends when the loss does."""
    import time

    from pipeplan.runtime.measure import StageStats, StepClock, instrument, timed_loss

    class FakeStage:
        def forward_one_chunk(self, i, *a, **k):
            return torch.ones(3)

        def backward_one_chunk(self, i, *a, **k):
            return None

    def slow_loss(output, target):
        time.sleep(0.05)
        return output.sum()

    stats, clock, st = StageStats(index=1), StepClock(), FakeStage()
    instrument(st, stats, clock)
    loss_fn = timed_loss(slow_loss, stats, clock)
    st.forward_one_chunk(0)
    assert float(loss_fn(torch.ones(3), None)) == 3.0 and stats.fwd_s == []  # not recording: nothing timed
    clock.start(recording=True)
    st.forward_one_chunk(0)
    alone = stats.fwd_s[0]
    loss_fn(torch.ones(3), None)
    assert stats.fwd_s[0] >= alone + 0.05
    kind, mb, start, end = stats.events[0]
    assert (kind, mb) == ("fwd", 0) and end - start >= 0.05


def test_checkpointing_a_sharded_plan_is_refused_before_launch(tmp_path):
    from pipeplan.runtime.launch import check_plan

    model = tmp_path / "m.py"
    model.write_text("")
    plan = _plan([[0, 1], [2, 3]], data_parallel=2)
    plan.graph["model_file"] = str(model)
    plan.sharding = "zero1"
    with pytest.raises(UserError, match="checkpoints of a sharded plan"):
        check_plan(plan, LaunchOptions(steps=2, checkpoint_dir=str(tmp_path / "ck")))
    plan.sharding = "none"
    assert check_plan(plan, LaunchOptions(steps=2, checkpoint_dir=str(tmp_path / "ck"))) == 4


def test_device_peak_counts_every_stage_a_device_holds():
    """Interleaved: a device holds several stages, and the plan predicts the device's peak; on the CPU each
    stage record has its own state and the rank's one activation meter, on CUDA every record has the device's."""
    from pipeplan.runtime.worker import device_peak_bytes

    stages = [{"weights_bytes": 10, "grad_bytes": 10, "optimizer_bytes": 20, "activation_bytes": 7,
               "peak_memory_bytes": 47},
              {"weights_bytes": 5, "grad_bytes": 5, "optimizer_bytes": 10, "activation_bytes": 7,
               "peak_memory_bytes": 27}]
    assert device_peak_bytes(stages, torch.device("cpu")) == 40 + 20 + 7
    cuda = [{**s, "peak_memory_bytes": 90} for s in stages]
    assert device_peak_bytes(cuda, torch.device("cuda")) == 90


def test_the_meters_op_log_leaves_out_the_updates_between_ops_and_the_gradients():
    """PipeDream's loop updates between its ops: `SavedTensorMeter.op` logs the forwards and backwards into one
    log and leaves out what the updates make (Adam's state, model state) and every storage that was a `.grad`.
    Reference: the same forward and backward logged alone (`StorageLog`), their gradients left out by hand."""
    from pipeplan.costmodels.transient import StorageLog
    from pipeplan.runtime.measure import state_keys, weight_storages

    def fwd_bwd(model):
        x = torch.randn(64, 512)
        model(x).square().mean().backward()

    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
    log = StorageLog(lambda: 0, state_keys([ref_model]))
    with log:
        fwd_bwd(ref_model)
    want = log.peak_bytes(log.live_ids(p.grad for p in ref_model.parameters()))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters())
    meter = SavedTensorMeter(weight_storages([model]), state_keys([model]))
    for _ in range(2):
        with meter.op([model]):
            fwd_bwd(model)
        opt.step()  # Adam's state (2 x the weights) is made here, outside the log
        model.zero_grad(set_to_none=True)
    meter.close_ops()
    assert want > 0 and meter.step_peak == want


def test_cpu_ranks_beyond_the_cores_are_warned_about_and_gpu_ranks_are_not():
    """Each CPU rank is one thread that a local profile prices as a core of its own: more ranks than cores take turns.
    Measured here (2 cores): examples/mlp.py planned for 4 devices (1 stage x 4 replicas) ran at 125 ms a step
    against 17.4 predicted (benchmarks/RESULTS.md, "More devices than cores"). A warning names how many machines would hold them; GPU ranks have their own check."""
    assert shared_cores_warning(2, 0, 2) is None
    assert shared_cores_warning(1, 0, 2) is None
    w = shared_cores_warning(4, 0, 2)
    assert w is not None and w.startswith("warning: 4 processes") and "run on 2 machines" in w
    assert "run on 3 machines" in (shared_cores_warning(5, 0, 2) or "")
    assert shared_cores_warning(4, 8, 2) is None  # CUDA ranks: check_plan compares them with the GPUs
