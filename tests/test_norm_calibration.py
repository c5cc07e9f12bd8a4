"""Batch norm by channel count on a calibrated GPU: `profiles calibrate` (CUDA) times training-mode batch norms of
16-2048 channels (calibrate_cuda.measure_norm_sweep) and the profile gets "norm" factors that make the cost model
give back each measured time (costmodels/norm_calibration.py). No GPU here: the sweep's ops run on the CPU against
torch's own autograd, and the factors are checked against a hand count of a batch norm's bytes and against a model
traced by pipeplan.trace; tests/test_gpu_cuda.py times one on a GPU."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from click.testing import CliRunner

import pipeplan
from pipeplan.cli.main import cli
from pipeplan.costmodels import trace
from pipeplan.costmodels.compute import efficiency_for
from pipeplan.costmodels.norm_calibration import (
    FACTOR_RANGE,
    SWEEP_KEY,
    batch_norm_part,
    norm_channel_factors,
    with_batch_norm_factors,
)
from pipeplan.costmodels.part_costs import TRAFFIC_FACTORS, kernel_overheads_s, parts_roofline_s
from pipeplan.hardware_profiles import calibrate_cuda
from pipeplan.hardware_profiles.loader import load_profile, read_profile_file, save_profile

KERNEL_S = 3e-6


def _gpu_profile(**changes):
    """The H200 catalogue profile as a calibration leaves it: a per-kernel time, no host floor to hide a norm."""
    base = dataclasses.replace(load_profile("h200"), name="t", kernel_overhead_s=KERNEL_S, dispatch_s=0.0,
                               dispatch_by_kind_s={})
    return dataclasses.replace(base, **changes)


def test_the_sweep_times_the_ops_autograd_runs_for_a_batch_norm(monkeypatch):
    """Each timed forward gives F.batch_norm's output and each timed backward autograd's three gradients, for the
    tensors the sweep made: the ops and their arguments are the ones a training step runs."""
    monkeypatch.setattr(calibrate_cuda, "NORM_SWEEP", ((16, 6, 4), (64, 3, 2)))
    checked = []

    def time_s(fn, calls):
        assert calls == calibrate_cuda.NORM_SWEEP_CALLS
        out = fn()
        if len(fn.args) == 7:  # forward: (x, weight, bias, running mean, running var, momentum, eps)
            x, w, b = fn.args[:3]
            ref = torch.nn.functional.batch_norm(x, torch.zeros_like(w), torch.ones_like(w), w, b, training=True)
            torch.testing.assert_close(out[0], ref)
        else:  # backward: (grad out, x, weight, ...)
            gy, x, w = fn.args[:3]
            x, w, b = x.clone().requires_grad_(), w.clone().requires_grad_(), torch.zeros_like(w, requires_grad=True)
            y = torch.nn.functional.batch_norm(x, None, None, w, b, training=True)
            for got, want in zip(out[:3], torch.autograd.grad(y, (x, w, b), gy), strict=True):
                torch.testing.assert_close(got, want)
        checked.append(x.dtype)
        return 1e-3

    for dtype in ("fp32", "bf16"):
        rows = calibrate_cuda.measure_norm_sweep(dtype, device="cpu", time_s=time_s)
        assert rows == [[16, 6, 4, 1e-3, 1e-3], [64, 3, 2, 1e-3, 1e-3]]
    assert checked == [torch.float32] * 4 + [torch.bfloat16] * 4


def test_the_sweeps_shapes_each_hold_2_to_the_25_elements():
    assert [c * hw * hw * n for c, hw, n in calibrate_cuda.NORM_SWEEP] == [2 ** 25] * len(calibrate_cuda.NORM_SWEEP)
    assert [c for c, _, _ in calibrate_cuda.NORM_SWEEP] == [16, 32, 64, 128, 256, 512, 1024, 2048]


@pytest.mark.parametrize("dtype, element_bytes", [("fp32", 4), ("bf16", 2)])
def test_a_factor_is_the_batch_norms_bytes_at_the_memory_bandwidth_over_the_measured_time(dtype, element_bytes):
    """Hand count: nn.BatchNorm2d(C) on (N, C, HW, HW) reads x and writes y (N C HW^2 elements each) and reads its
    weight, bias and running statistics (4 C fp32); TRAFFIC_FACTORS['norm'] passes of that forward and backward."""
    prof = _gpu_profile()
    bw = prof.mem_bw_bytes_per_s * efficiency_for(prof, "norm", dtype)[1]
    rows = [[16, 32, 64, 4e-4, 9e-4], [16, 32, 64, 6e-4, 1.1e-3], [256, 8, 64, 1e-4, 2e-4]]
    fwd, bwd = norm_channel_factors(rows, prof, dtype)
    assert [c for c, _ in fwd] == [16.0, 256.0] == [c for c, _ in bwd]
    f_passes, b_passes = TRAFFIC_FACTORS["norm"]

    def factors(c, hw, n, fwd_s, bwd_s):
        moved = (2 * n * c * hw * hw * 4 + 4 * c * 4) * element_bytes / 4  # traced fp32 bytes, in the dtype's
        return (f_passes * moved / bw / (fwd_s - KERNEL_S), b_passes * moved / bw / (bwd_s - 2 * KERNEL_S))

    narrow = [factors(*r) for r in rows[:2]]
    assert fwd[0][1] == pytest.approx((narrow[0][0] + narrow[1][0]) / 2, rel=1e-3)  # rows of equal channels
    assert bwd[0][1] == pytest.approx((narrow[0][1] + narrow[1][1]) / 2, rel=1e-3)
    assert (fwd[1][1], bwd[1][1]) == pytest.approx(factors(*rows[2]), rel=1e-3)


def test_a_row_not_slower_than_its_kernels_fixed_time_is_skipped():
    prof = _gpu_profile()
    fwd, bwd = norm_channel_factors([[16, 32, 64, KERNEL_S, 1e-3], [64, 16, 64, 1e-4, 2e-4]], prof, "fp32")
    assert [c for c, _ in fwd] == [64.0] == [c for c, _ in bwd]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_traced_models_batch_norm_is_priced_at_the_measured_time_of_its_shape(tmp_path, dtype):
    """The factors are taken against batch_norm_part; a batch norm inside a model that pipeplan.trace traced (at
    another batch, beside a convolution) must come out at the sweep's time for its shape: the two byte counts agree."""
    model = tmp_path / "convbn.py"
    model.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        def build_model():
            return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(32 * 8 * 8, 10))

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 3, 8, 8),)
    """))
    g = pipeplan.trace(str(model), 2, repeats=1, time_layers=False, fvcore_check=False)
    bn = [p for layer in g.layers for p in layer.parts if p.kind == "norm"]
    assert len(bn) == 1 and bn[0].channels == 32
    n = 40_000  # 330 MB of x and y in fp32: ~0.1 ms at the H200's bandwidth
    rows = [[16, 8, n, 3e-4, 7e-4], [32, 8, n, 2e-4, 5e-4], [64, 8, n, 1.5e-4, 4e-4]]
    prof = with_batch_norm_factors(_gpu_profile(calibration={SWEEP_KEY: {dtype: rows}}))
    if dtype == "fp32":
        assert set(k for k in prof.channel_factors if k.startswith("norm")) == {"norm"}
    else:
        assert set(k for k in prof.channel_factors if k.startswith("norm")) == {"norm@bf16"}
    fwd_s, bwd_s = parts_roofline_s(bn, prof, dtype=dtype, ratio=n / 2)
    assert (fwd_s, bwd_s) == pytest.approx((2e-4, 5e-4), rel=1e-6)
    f = [f for c, f in prof.channel_factors["norm" if dtype == "fp32" else "norm@bf16"][0] if c == 32][0]
    assert FACTOR_RANGE[0] < f < FACTOR_RANGE[1]  # unclamped: the identity above is the model's, not a bound's
    unfactored = parts_roofline_s(bn, _gpu_profile(), dtype=dtype, ratio=n / 2)
    assert unfactored[0] - KERNEL_S == pytest.approx((fwd_s - KERNEL_S) * f)


def test_with_factors_replaces_the_norm_factors_keeps_the_rest_and_round_trips(tmp_path):
    conv = {"conv3x3@fp32": (((16.0, 0.2), (256.0, 1.2)), ((16.0, 0.1), (256.0, 0.9)))}
    old_norm = {"norm": (((16.0, 0.5), (128.0, 1.0)), ((16.0, 0.5), (128.0, 1.0)))}
    sweep = {"fp32": [[16, 64, 512, 5e-4, 1.2e-3], [128, 32, 256, 2e-4, 5e-4]],
             "bf16": [[16, 64, 512, 3e-4, 8e-4], [128, 32, 256, 1e-4, 3e-4]]}
    prof = _gpu_profile(channel_factors={**conv, **old_norm}, calibration={SWEEP_KEY: sweep})
    out = with_batch_norm_factors(prof)
    assert set(out.channel_factors) == {"conv3x3@fp32", "norm", "norm@bf16"}
    assert out.channel_factors["conv3x3@fp32"] == conv["conv3x3@fp32"]
    assert out.channel_factors["norm"] == norm_channel_factors(sweep["fp32"], _gpu_profile(), "fp32")
    assert out.channel_factors["norm"] != old_norm["norm"]
    assert out.sources[:-1] == prof.sources and "norm_calibration" in out.sources[-1]
    path = tmp_path / "p.yaml"
    save_profile(out, path)
    back = read_profile_file(path).channel_factors
    assert set(back) == set(out.channel_factors)
    for key, sides in out.channel_factors.items():
        for got, want in zip(back[key], sides, strict=True):
            assert [c for c, _ in got] == [c for c, _ in want]
            assert [f for _, f in got] == pytest.approx([f for _, f in want], rel=1e-4)  # written rounded
    bare = _gpu_profile(calibration={})
    assert with_batch_norm_factors(bare) is bare  # nothing measured: nothing written


def test_the_part_is_the_tracers_for_each_swept_shape():
    """One norm part per shape, its channels the module's, its bytes x and y at batch 1 plus 4 C fp32 parameters."""
    for c, hw, _ in calibrate_cuda.NORM_SWEEP[:3]:
        part = batch_norm_part(c, hw)
        assert (part.channels, part.ops, part.param_bytes) == (c, 1, 16 * c)
        assert part.bytes_moved == 2 * c * hw * hw * 4 + 16 * c


def test_calibrate_on_cuda_writes_the_factors_from_its_sweep(tmp_path, monkeypatch):
    """The CLI's CUDA path turns the measured sweep into factors before it writes the profile (the measurement
    stood in for: no GPU here)."""
    sweep = {"fp32": [[16, 64, 512, 5e-4, 1.2e-3], [128, 32, 256, 2e-4, 5e-4]]}
    measured = _gpu_profile(calibration={"device_type": "cuda", SWEEP_KEY: sweep})
    monkeypatch.setattr(calibrate_cuda, "calibrate_cuda", lambda **_: measured)
    monkeypatch.setattr(trace, "resolve_device", lambda device: "cuda")  # as on a machine with a GPU
    out = tmp_path / "gpu.yaml"
    r = CliRunner().invoke(cli, ["profiles", "calibrate", "--device", "cuda", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    got = read_profile_file(out)
    assert set(got.channel_factors) == {"norm"}
    assert [c for c, _ in got.channel_factors["norm"][0]] == [16.0, 128.0]
    assert kernel_overheads_s(got)[0] == KERNEL_S
