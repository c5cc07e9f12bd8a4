"""fp16 plans train in fp16 with dynamic loss scaling (runtime/loss_scale.py), held against torch's own GradScaler:
its update rule (aten's `_amp_update_scale_`), its unscale-and-check kernel, and one process training the same
model under CPU autocast with `torch.amp.GradScaler`, written out here (not the runtime's code)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from pipeplan.runtime.loss_scale import LossScaler, unscale_grads
from runtime_helpers import REPO, hand_plan, reference_steps, run_cli, run_cli_here, run_worker

MODEL = REPO / "examples" / "gpt.py"  # a batch-mean cross-entropy: fp16 overflows it from a scale of 2^24


def test_the_scale_moves_as_torchs_grad_scaler_moves_it():
    """A random run of clean and overflowing steps: the same scale after each as aten's in-place update."""
    rng = random.Random(0)
    ours = LossScaler(scale=2.0 ** 10, growth_interval=3)
    scale, tracker = torch.full((1,), 2.0 ** 10), torch.zeros(1, dtype=torch.int32)
    skipped = 0
    for _ in range(200):
        inf = rng.random() < 0.2
        skipped += inf
        ours.update(inf)
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(inf)), 2.0, 0.5, 3)
        assert ours.scale == float(scale) and ours.good_steps == int(tracker)
    assert ours.skipped_steps == skipped > 0
    assert LossScaler.from_state(ours.state()) == ours


def test_unscaling_divides_in_place_and_flags_an_inf_or_a_nan_anywhere():
    a, b = torch.tensor([2.0, 4.0]), torch.tensor([8.0], dtype=torch.float64)
    assert float(unscale_grads([a, b], 2.0, torch.device("cpu"))) == 0.0
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [4.0]
    assert float(unscale_grads([a, torch.tensor([float("nan")])], 2.0, torch.device("cpu"))) == 1.0
    assert float(unscale_grads([torch.tensor([float("inf")]), b], 2.0, torch.device("cpu"))) == 1.0


def grad_scaler_reference(batch: int, steps: int, microbatches: int, init_scale: float, device: str = "cpu"):
    """(losses, final scale, skipped steps): one process under fp16 autocast and torch.amp.GradScaler, SGD lr 0.01,
    the microbatches' gradients accumulated as the pipeline's (runtime_helpers.reference_steps). Each skipped step
    halves the scale and these runs are far shorter than its growth interval (2000), so the skipped steps are
    log2(initial / final)."""
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    losses, _, _ = reference_steps(str(MODEL), batch, steps, microbatches=microbatches, autocast=torch.float16,
                                   scaler=scaler, device=device)
    scale = scaler.get_scale()
    return losses, scale, round(math.log2(init_scale / scale))


FP16_CASES = {  # name -> (schedule, stages, data-parallel replicas, sharding): two ranks each
    "1f1b-2-1-none": ("1f1b", 2, 1, "none"), "zb-h1-2-1-none": ("zb-h1", 2, 1, "none"),
    "1f1b-1-2-none": ("1f1b", 1, 2, "none"), "1f1b-1-2-zero2": ("1f1b", 1, 2, "zero2"),
}
FP16_BATCH, FP16_STEPS, FP16_INIT = 8, 6, 2.0 ** 24


def _fp16_microbatches(stages: int) -> int:
    return 4 if stages > 1 else 2


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    """Every case's plan in one torchrun (runtime_helpers.run_worker), from a scale that overflows fp16."""
    tmp = tmp_path_factory.mktemp("fp16")
    paths = []
    for name, (schedule, stages, replicas, sharding) in FP16_CASES.items():
        paths.append(tmp / f"{name}.json")
        hand_plan(str(MODEL), stages=stages, devices=stages, schedule=schedule, microbatches=_fp16_microbatches(stages),
                  batch_size=FP16_BATCH, dtype="fp16", data_parallel=replicas, sharding=sharding).save(paths[-1])
    run_dir = tmp / "run"
    run_dir.mkdir()
    run_worker(paths, 2, "--steps", str(FP16_STEPS), "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01",
               "--initial-loss-scale", str(FP16_INIT), "--run-dir", str(run_dir), timeout=600)
    return {name: (run_dir / str(i), path) for i, (name, path) in enumerate(zip(FP16_CASES, paths, strict=True))}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FP16_CASES))
def test_an_fp16_plan_skips_the_steps_grad_scaler_skips_and_trains_like_it(fp16_runs, case):
    """2-stage 1F1B and zero-bubble pipelines, 2 data-parallel replicas, and 2 replicas under ZeRO-2, from a scale
    that overflows fp16 (2^24): the run skips the steps the single-process GradScaler skips, ends at its scale, and
    its losses agree to fp16's rounding. `pipeplan run` would warn of nothing (no precision or recipe note) and
    report what the rank results summarize to (test_a_resumed_fp16_run_keeps_its_loss_scale runs it)."""
    from pipeplan.planner.plan import load_plan
    from pipeplan.precision import precision_note, recipe_note
    from pipeplan.runtime.report import summarize

    run_dir, path = fp16_runs[case]
    plan = load_plan(path)
    assert precision_note(plan.dtype, plan.schedule) is None
    assert recipe_note(plan.dtype, plan.mixed_precision, plan.schedule) is None
    doc = summarize(json.loads((run_dir / "result.json").read_text()), plan)
    _, stages, replicas, _ = FP16_CASES[case]
    losses, scale, skipped = grad_scaler_reference(FP16_BATCH, FP16_STEPS, _fp16_microbatches(stages) * replicas,
                                                   FP16_INIT)
    assert 0 < skipped < FP16_STEPS  # some steps overflowed, later ones trained
    assert doc["loss_scale"]["scale"] == scale and doc["loss_scale"]["skipped_steps"] == skipped
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(losses), rtol=2e-3, atol=1e-4)
    assert doc["losses"][-1] < doc["losses"][0]


@pytest.mark.slow
def test_a_resumed_fp16_run_keeps_its_loss_scale(tmp_path):
    """Three steps with a checkpoint, then --resume to six: the losses and scale of six steps run straight."""
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="1f1b", microbatches=2, batch_size=8, dtype="fp16")
    plan.save(tmp_path / "plan.json")
    common = ("--warmup", "0", "--optimizer", "sgd", "--lr", "0.01", "--initial-loss-scale", str(2.0 ** 24), "--json")
    first = run_cli("run", str(tmp_path / "plan.json"), "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"),
                    "--checkpoint-every", "3", *common, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "warning" not in first.stderr  # no precision or recipe note for fp16 under 1F1B
    resumed = run_cli("run", str(tmp_path / "plan.json"), "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"),
                      "--resume", *common, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    losses, scale, skipped = grad_scaler_reference(8, 6, 2, 2.0 ** 24)
    doc = json.loads(resumed.stdout)
    assert doc["loss_scale"]["scale"] == scale and doc["loss_scale"]["skipped_steps"] == skipped
    torch.testing.assert_close(torch.tensor(doc["losses"][-3:]), torch.tensor(losses[3:]), rtol=2e-3, atol=1e-4)


def test_an_fp16_step_is_priced_with_its_unscaling_and_flag_instead_of_its_divisions():
    """fp16 against bf16, the same split on one GPU profile (equal peaks, so equal layers): the update adds the
    flag's all-reduce over all four devices (the unscaling pass takes the place of the division by M, the same
    pass over the same gradients), and the data-parallel sync makes one pass fewer (no division: the loss was
    weighted before the backward)."""
    from pipeplan.costmodels.comm import allreduce_time_s, group_link
    from pipeplan.costmodels.grad_passes import gradient_pass_s
    from pipeplan.costmodels.memory import model_state_bytes
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.predict import evaluate
    from search_fixtures import gpt_like

    g = gpt_like(blocks=4, hidden=256, seq=128, vocab=1000, batch=4)
    a100 = load_profile("a100-80gb-sxm")
    assert a100.flops_for("fp16") == a100.flops_for("bf16")
    plans = {d: evaluate(g, a100, [0, 0, 0, 1, 1, 1], data_parallel=2, schedule="1f1b", microbatches=2,
                         batch_size=16, dtype=d) for d in ("bf16", "fp16")}
    flag = allreduce_time_s(4, 4, group_link(a100, [0, 1, 2, 3]))
    for s in range(2):
        bf16, fp16 = plans["bf16"].stages[s].predicted, plans["fp16"].stages[s].predicted
        params = sum(g.layers[i].param_bytes for i in range(3 * s, 3 * s + 3))
        grad = model_state_bytes(params, optimizer="adam", dtype="bf16").grad_bytes  # autocast's fp32 gradients
        tensors = len({p for i in range(3 * s, 3 * s + 3) for p in g.layers[i].params})
        assert fp16.optimizer_s - bf16.optimizer_s == pytest.approx(flag)
        assert bf16.allreduce_s - fp16.allreduce_s == pytest.approx(gradient_pass_s(grad, profile=a100,
                                                                                    tensors=tensors))
        assert fp16.fwd_s == bf16.fwd_s and fp16.bwd_s == bf16.bwd_s


def test_the_initial_loss_scale_is_checked_before_anything_starts(tmp_path):
    plan = hand_plan(str(MODEL), stages=1, devices=1, schedule="1f1b", microbatches=1, batch_size=4, dtype="fp16")
    plan.save(tmp_path / "fp16.json")
    r = run_cli_here("run", str(tmp_path / "fp16.json"), "--initial-loss-scale", "-1")
    assert r.returncode == 2 and "--initial-loss-scale" in r.stderr and "Traceback" not in r.stderr
    fp32 = hand_plan(str(MODEL), stages=1, devices=1, schedule="1f1b", microbatches=1, batch_size=4)
    fp32.save(tmp_path / "fp32.json")
    r = run_cli_here("run", str(tmp_path / "fp32.json"), "--initial-loss-scale", "1024")
    assert r.returncode == 2 and "trains in fp32 without loss scaling" in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_an_fp16_plan_on_a_gpu_scales_its_loss_as_grad_scaler_does_on_it(tmp_path):
    """The same check on CUDA (NCCL, one process on the one GPU, fp16 on tensor cores), against GradScaler there."""
    plan = hand_plan(str(MODEL), stages=1, devices=1, schedule="1f1b", microbatches=2, batch_size=8, dtype="fp16")
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "6", "--warmup", "0", "--optimizer", "sgd", "--lr",
                "0.01", "--initial-loss-scale", str(2.0 ** 24), "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    losses, scale, skipped = grad_scaler_reference(8, 6, 2, 2.0 ** 24, device="cuda")
    assert doc["loss_scale"]["scale"] == scale and doc["loss_scale"]["skipped_steps"] == skipped
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(losses), rtol=5e-3, atol=1e-3)
