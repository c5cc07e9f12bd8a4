"""A plan trains in its dtype (pipeplan/precision.py): bf16 under torch.autocast in `pipeplan run`, and the tracer
times layers the same way (`pipeplan trace --dtype`), so a bf16 plan's prediction and its run are the same step.

Why: on a GPU profile `--dtype auto` plans bf16, and `pipeplan run` trained every plan in fp32: a default plan's
prediction was held against another step than the one it priced.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeplan.precision import precision_note, scales_loss, trained_dtype, training_precision
from runtime_helpers import REPO, hand_plan, reference_steps, run_cli, run_cli_here

MODEL = REPO / "tests" / "runtime_model_gpt.py"  # a small GPT with tied embeddings: matmuls autocast casts
UPCAST = REPO / "tests" / "data" / "autocast_upcast.py"


def test_which_dtype_a_plan_trains_in_and_what_the_run_says_otherwise():
    assert [trained_dtype(d) for d in ("fp32", "tf32", "bf16", "fp16")] == ["fp32", "tf32", "bf16", "fp16"]
    assert [trained_dtype("fp16", s) for s in ("1f1b", "gpipe", "pipedream", "pipedream-2bw")] == \
        ["fp16", "fp16", "fp32", "fp32"]
    assert scales_loss("fp16", "1f1b") and not scales_loss("bf16", "1f1b") and not scales_loss("fp16", "pipedream")
    assert precision_note("bf16") is None and precision_note("fp16", "1f1b") is None
    note = precision_note("fp16", "pipedream") or ""
    assert note.startswith("warning: this plan is fp16 under pipedream; pipeplan run trains it in fp32")
    assert "--dtype bf16" in note


def test_the_training_precision_casts_matmuls_in_16_bits_only_and_restores_the_matmul_setting():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    before = torch.get_float32_matmul_precision()
    with training_precision("bf16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
    with training_precision("tf32", torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == "high" and (a @ b).dtype == torch.float32
    with training_precision("fp16", torch.device("cpu")):
        assert (a @ b).dtype == torch.float16
    with training_precision("fp16", torch.device("cpu"), "pipedream"):  # trained in fp32 (no loss scaling)
        assert (a @ b).dtype == torch.float32
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, UPCAST], ids=["gpt", "upcast"])
def test_a_bf16_plan_runs_in_bf16_like_a_single_process_under_autocast(tmp_path, model):
    """`pipeplan run` of a 2-stage 1F1B bf16 plan (gloo, two processes, activations crossing in bf16) against one
    process training the same model under CPU autocast (independent: tests/runtime_helpers.reference_steps): the
    losses agree to bf16's rounding over microbatches, and the fp32 reference is farther from them than that.
    UPCAST's norm upcasts a matmul's bf16 output (`x.to(torch.float32)`), which export records as an assertion
    that x is fp32 (dropped: costmodels/export.py `_without_dtype_asserts`); its stages failed under autocast."""
    batch, m = 8, 4
    plan = hand_plan(str(model), stages=2, devices=2, schedule="1f1b", microbatches=m, batch_size=batch, dtype="bf16")
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "3", "--warmup", "0", "--optimizer", "sgd", "--lr",
                "0.01", "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = torch.tensor(json.loads(r.stdout)["losses"])
    bf16, _, _ = reference_steps(str(model), batch, 3, microbatches=m, autocast=torch.bfloat16)
    fp32, _, _ = reference_steps(str(model), batch, 3, microbatches=m)
    torch.testing.assert_close(losses, torch.tensor(bf16), rtol=2e-3, atol=1e-5)
    assert float((losses - torch.tensor(fp32)).abs().max()) > 5 * float((losses - torch.tensor(bf16)).abs().max())


def test_an_asynchronous_fp16_plan_says_it_trains_in_fp32(tmp_path):
    plan = hand_plan(str(MODEL), stages=2, devices=2, schedule="pipedream", microbatches=1, batch_size=4, dtype="fp16")
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "0", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: this plan is fp16 under pipedream; pipeplan run trains it in fp32" in r.stderr + r.stdout
    r = run_cli_here("run", str(tmp_path / "plan.json"), "--steps", "2", "--initial-loss-scale", "1024")
    assert r.returncode == 2 and "--initial-loss-scale applies to fp16 plans that flush" in r.stderr


def test_a_cuda_trace_is_taken_in_the_dtype_it_was_timed_in_only():
    """An H200 trace of the 32x32 ResNet (tests/data/gpu), as if timed with `trace --dtype bf16`: a bf16 plan on the
    h200 profile takes its times (the step is the layers' sum, less the fresh-gradient saving), an fp32 plan does
    not (the roofline, several times shorter here, with a note saying how to get times in fp32)."""
    import dataclasses
    from pathlib import Path

    from pipeplan.costmodels import compute
    from pipeplan.costmodels.graph import load_graph
    from pipeplan.hardware_profiles.loader import load_profile

    fp32 = load_graph(Path(__file__).parent / "data" / "gpu" / "resnet-h200.graph.json")
    bf16 = dataclasses.replace(fp32, source={**fp32.source, "dtype": "bf16"})
    h200 = load_profile("h200")
    assert compute.traced_dtype(fp32) == "fp32" and compute.traced_dtype(bf16) == "bf16"
    assert compute.uses_measured_times(bf16, h200, "bf16") and not compute.uses_measured_times(bf16, h200, "fp32")
    assert compute.uses_measured_times(fp32, h200, "fp32") and not compute.uses_measured_times(fp32, h200, "bf16")
    assert not compute.uses_measured_times(bf16, h200, "tf32")
    note = compute.local_times_note(bf16, h200, dtype="fp32", times="model", samples=bf16.batch_size) or ""
    assert "the trace timed NVIDIA H200 in bf16; plan with --dtype bf16" in note and "trace with --dtype fp32" in note
    fp16 = compute.local_times_note(bf16, h200, dtype="fp16", times="model", samples=bf16.batch_size) or ""
    assert "trace with --dtype fp16" in fp16  # fp16 plans train in fp16 too (runtime/loss_scale.py)


def test_trace_refuses_a_dtype_it_would_not_time(tmp_path):
    r = run_cli_here("trace", str(MODEL), "-b", "2", "--no-times", "--dtype", "bf16", "-o", str(tmp_path / "g.json"))
    assert r.returncode == 2 and "--no-times times nothing" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "g.json").exists()
