"""A plan trains in its dtype (pipeplan/precision.py): bf16 under torch.autocast in `pipeplan run`, and the tracer
times layers the same way (`pipeplan trace --dtype`), so a bf16 plan's prediction and its run are the same step.

Why: on a GPU profile `--dtype auto` plans bf16, and `pipeplan run` trained every plan in fp32: a default plan's
prediction was held against another step than the one it priced.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeplan.precision import precision_note, trained_dtype, training_precision
from runtime_helpers import REPO, hand_plan, reference_steps, run_cli

MODEL = REPO / "tests" / "runtime_model_gpt.py"  # a small GPT with tied embeddings: matmuls autocast casts


def test_which_dtype_a_plan_trains_in_and_what_the_run_says_otherwise():
    assert [trained_dtype(d) for d in ("fp32", "tf32", "bf16", "fp16")] == ["fp32", "tf32", "bf16", "fp32"]
    assert precision_note("bf16") is None and precision_note("fp32") is None
    note = precision_note("fp16") or ""
    assert note.startswith("warning: this plan is fp16; pipeplan run trains it in fp32") and "--dtype bf16" in note


def test_the_training_precision_casts_matmuls_in_bf16_only_and_restores_the_matmul_setting():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    before = torch.get_float32_matmul_precision()
    with training_precision("bf16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
    with training_precision("tf32", torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == "high" and (a @ b).dtype == torch.float32
    with training_precision("fp16", torch.device("cpu")):  # trained in fp32 (no loss scaling)
        assert (a @ b).dtype == torch.float32
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.slow
def test_a_bf16_plan_runs_in_bf16_like_a_single_process_under_autocast(tmp_path):
    """`pipeplan run` of a 2-stage 1F1B bf16 plan (gloo, two processes, activations crossing in bf16) against one
    process training the same model under CPU autocast (independent: tests/runtime_helpers.reference_steps): the
    losses agree to bf16's rounding over microbatches, and the fp32 reference is farther from them than that."""
    batch, m = 8, 4
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="1f1b", microbatches=m, batch_size=batch, dtype="bf16")
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "3", "--warmup", "0", "--optimizer", "sgd", "--lr",
                "0.01", "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = torch.tensor(json.loads(r.stdout)["losses"])
    bf16, _, _ = reference_steps(str(MODEL), batch, 3, microbatches=m, autocast=torch.bfloat16)
    fp32, _, _ = reference_steps(str(MODEL), batch, 3, microbatches=m)
    torch.testing.assert_close(losses, torch.tensor(bf16), rtol=2e-3, atol=1e-5)
    assert float((losses - torch.tensor(fp32)).abs().max()) > 5 * float((losses - torch.tensor(bf16)).abs().max())


def test_an_fp16_plan_says_it_trains_in_fp32(tmp_path):
    plan = hand_plan(str(MODEL), stages=1, devices=1, schedule="1f1b", microbatches=1, batch_size=4, dtype="fp16")
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "1", "--warmup", "0", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: this plan is fp16; pipeplan run trains it in fp32" in r.stderr + r.stdout
