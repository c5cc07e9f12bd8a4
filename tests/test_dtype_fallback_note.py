"""A dtype the device has no fast path for is priced at its fp32 rate (HardwareProfile.flops_for); the plan says so
and names the fast dtype (bf16 on a V100 was planned 8x slower than fp16 without a word)."""

from __future__ import annotations

from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.predict import evaluate
from pipeplan.planner.predict_report import dtype_fallback_note
from search_fixtures import gpt_like


def test_bf16_on_a_v100_notes_its_fp32_rate_and_fp16():
    v100 = load_profile("v100-32gb-sxm2")
    assert v100.peak_flops.get("bf16") is None and v100.flops_for("bf16") == v100.peak_flops["fp32"]
    note = dtype_fallback_note(v100, "bf16")
    fp32, fp16 = v100.peak_flops["fp32"] / 1e12, v100.peak_flops["fp16"] / 1e12
    assert note == (f"v100-32gb-sxm2 has no bf16 fast path: bf16 is priced at its fp32 rate, {fp32:.3g} TFLOP/s; "
                    f"--dtype fp16 runs at {fp16:.3g}")
    plan = evaluate(gpt_like(blocks=2), v100, [0, 0, 1, 1], schedule="1f1b", microbatches=4, batch_size=8,
                    dtype="bf16")
    assert note in plan.notes


def test_no_note_where_the_dtype_has_its_own_rate():
    for name, dtype in (("v100-32gb-sxm2", "fp16"), ("v100-32gb-sxm2", "fp32"), ("h100-sxm", "bf16"),
                        ("a100-80gb-sxm", "tf32"), ("tpu-v5p", "bf16")):
        assert dtype_fallback_note(load_profile(name), dtype) is None, (name, dtype)
    t4 = load_profile("t4")  # fp16 tensor cores, no bf16 path: the note names fp16 again
    assert dtype_fallback_note(t4, "bf16").endswith(f"--dtype fp16 runs at {t4.peak_flops['fp16'] / 1e12:.3g}")
