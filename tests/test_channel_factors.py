"""Efficiency by channel count (profile `channel_factors`). A convolution's: calibrate derives it from a sweep of
3x3 convolutions, the trace records each convolution part's channels, and the roofline scales the curve's
efficiency by it. A batch norm's: the trace records a channels-first batch norm's channels, and the roofline scales
its memory efficiency by the GP102 profiles' factors, read from a published benchmark
(costmodels/part_costs.channel_factor)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeplan.costmodels.graph import CostPart
from pipeplan.costmodels.part_costs import channel_factor, kernel_overheads_s, parts_roofline_s
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.calibrate_cuda import channel_factors
from pipeplan.hardware_profiles.curve import point_efficiency
from pipeplan.hardware_profiles.loader import load_profile, read_profile_file, save_profile

ROOT = Path(__file__).resolve().parents[1]
CURVE = ((1e8, 0.5), (1e10, 1.0))
PEAK, KERNEL_S = 50e12, 1e-6


def test_factors_are_each_rows_efficiency_over_the_curves_at_its_flops_averaged_per_channel_count():
    f = 1e9  # the curve reads 0.75 here (log-linear between 1e8 and 1e10)
    rows = [[16, 32, 256, f, 1e-4, 4e-4], [64, 8, 256, f, 3e-5, 8e-5], [64, 32, 256, 1e10, 2e-4, 5e-4]]
    fwd, bwd = channel_factors(rows, CURVE, PEAK, KERNEL_S)
    assert [c for c, _ in fwd] == [16.0, 64.0] and [c for c, _ in bwd] == [16.0, 64.0]
    assert fwd[0][1] == pytest.approx(point_efficiency(f, 1e-4, PEAK, KERNEL_S) / 0.75)
    assert bwd[0][1] == pytest.approx(point_efficiency(2 * f, 4e-4, PEAK, 2 * KERNEL_S) / 0.75)
    want = (point_efficiency(f, 3e-5, PEAK, KERNEL_S) / 0.75 + point_efficiency(1e10, 2e-4, PEAK, KERNEL_S) / 1.0) / 2
    assert fwd[1][1] == pytest.approx(want)


def _profile(factors):
    base = dataclasses.replace(load_profile("h200"), name="t", efficiency_curve={"conv3x3@fp32": CURVE})
    return dataclasses.replace(base, channel_factors=factors)


def test_a_narrow_convolution_is_priced_at_its_channels_factor_and_a_wide_one_beyond_the_sweep_at_the_end():
    factors = {"conv3x3@fp32": (((16.0, 0.2), (256.0, 1.2)), ((16.0, 0.1), (256.0, 0.9)))}
    prof = _profile(factors)
    narrow = CostPart("conv3x3", fwd_flops=int(1e12), bwd_flops=int(2e12), bytes_moved=1000, ops=1, channels=16)
    assert channel_factor(narrow, prof, "fp32") == (0.2, 0.1)
    assert channel_factor(dataclasses.replace(narrow, channels=64), prof, "fp32")[0] == pytest.approx(0.7)
    assert channel_factor(dataclasses.replace(narrow, channels=1024), prof, "fp32") == (1.2, 0.9)
    assert channel_factor(dataclasses.replace(narrow, channels=0), prof, "fp32") == (1.0, 1.0)  # unknown
    assert channel_factor(narrow, prof, "bf16") == (1.0, 1.0)  # nothing measured for bf16
    with_f = parts_roofline_s([narrow], prof, dtype="fp32", ratio=1.0)
    without = parts_roofline_s([narrow], _profile({}), dtype="fp32", ratio=1.0)
    kernel = kernel_overheads_s(prof)[0]  # per kernel; the backward runs two
    assert with_f[0] - kernel == pytest.approx((without[0] - kernel) / 0.2)
    assert with_f[1] - 2 * kernel == pytest.approx((without[1] - 2 * kernel) / 0.1)


def test_the_factors_round_trip_through_yaml_and_bad_ones_are_refused(tmp_path):
    factors = {"conv3x3@fp32": (((16.0, 0.2), (256.0, 1.2)), ((16.0, 0.1), (256.0, 0.9)))}
    path = tmp_path / "p.yaml"
    save_profile(_profile(factors), path)
    assert read_profile_file(path).channel_factors == factors
    text = path.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("conv3x3@fp32:\n    forward:", "convx@fp32:\n    forward:", 1))
    with pytest.raises(UserError, match="convx"):
        read_profile_file(bad)
    bad.write_text(text.replace("    backward:", "    sideways:", 1))
    with pytest.raises(UserError, match="channel_factors"):
        read_profile_file(bad)


def test_the_trace_records_each_convolutions_narrower_channel_count(tmp_path):
    """examples/resnet.py: a 3-channel stem, then 16, 32, 64 and 128 channels; a downsampling block's first 3x3
    convolution (stride 2: a "conv" part) reads its input's channels, the narrower side."""
    out = tmp_path / "g.json"
    r = subprocess.run([sys.executable, "-m", "pipeplan", "trace", "examples/resnet.py", "-b", "2", "--no-times",
                        "--no-fvcore-check", "-o", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    layers = {l["name"]: {p["kind"]: p.get("channels") for p in l.get("parts", [])}
              for l in json.loads(out.read_text())["layers"]}
    assert layers["stem.0"] == {"conv3x3": 3}
    assert layers["blocks.0.conv1"]["conv3x3"] == 16 and layers["blocks.5.conv2"]["conv3x3"] == 64  # 8x8 outputs
    assert layers["blocks.7.conv2"] == {"conv": 128}  # 4x4 outputs: below Winograd's WINOGRAD_MIN_OUTPUT_SIDE
    assert layers["blocks.2.conv1"]["conv"] == 16  # 16 -> 32, stride 2
    assert layers["blocks.2.shortcut.0"]["conv"] == 16  # 1x1, 16 -> 32
    assert "conv3x3" not in layers["fc"] and "channels" not in json.dumps(layers["fc"])


def test_the_h200s_factors_are_what_its_own_sweep_gives():
    """The committed profile's factors were computed after its run from its stored sweep: the same function
    gives them back."""
    p = read_profile_file(ROOT / "hardware_profiles" / "measured" / "nvidia-h200-calibrated.yaml")
    for dtype, rows in p.calibration["conv3x3_sweep"].items():
        want = channel_factors(rows, p.efficiency_curve[f"conv3x3@{dtype}"], p.peak_flops[dtype], p.kernel_overhead_s)
        got = p.channel_factors[f"conv3x3@{dtype}"]
        for side in (0, 1):
            assert [c for c, _ in got[side]] == [c for c, _ in want[side]]
            assert [f for _, f in got[side]] == pytest.approx([f for _, f in want[side]], rel=1e-6)


def test_the_trace_records_a_channels_first_batch_norms_channels_and_nothing_for_other_norms(tmp_path):
    import pipeplan

    path = tmp_path / "norms.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class Net(nn.Module):
            def __init__(self, last):
                super().__init__()
                self.last = last
                self.bn = nn.BatchNorm2d(24)
                self.bn1d = nn.BatchNorm1d(12)
                self.ln = nn.LayerNorm(6)

            def forward(self, x):
                y = self.bn(x.contiguous(memory_format=torch.channels_last) if self.last else x)
                return self.ln(self.bn1d(y.flatten(2)[:, :12]))

        def build_nchw():
            return Net(False)

        def build_nhwc():
            return Net(True).to(memory_format=torch.channels_last)

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 24, 2, 3),)
    """))
    norms = {}
    for entry in ("build_nchw", "build_nhwc"):
        g = pipeplan.trace(str(path), 2, depth=1, repeats=1, time_layers=False, fvcore_check=False, entry=entry)
        norms[entry] = {l.name: next(p.channels for p in l.parts if p.kind == "norm")
                        for l in g.layers if any(p.kind == "norm" for p in l.parts)}
    # BatchNorm1d over (N, 12, 6): 12 channels; LayerNorm: none (it reduces rows, not channels)
    assert norms["build_nchw"] == {"bn": 24, "bn1d": 12, "ln": 0}
    assert norms["build_nhwc"] == {"bn": 0, "bn1d": 12, "ln": 0}  # channels-last: reduced across channels


# soumith/cudnn.torch#100 (2016-01-31): torch cunn's SpatialBatchNormalization at batch 64 on a GTX Titan X, ms
CUNN_MS = {16: (112, 4.82), 64: (56, 3.69), 128: (28, 1.23), 256: (14, 0.64), 512: (7, 0.33)}  # channels: (side, ms)


@pytest.mark.parametrize("name", ["titan-x-pascal", "gtx-1080-ti", "p40"])
def test_the_gp102_batch_norm_factors_are_the_published_time_per_element_against_128_to_512_channels(name):
    per_element = {c: ms / (64 * c * side * side) for c, (side, ms) in CUNN_MS.items()}
    wide = sum(per_element[c] for c in (128, 256, 512)) / 3
    prof = load_profile(name)
    for side in prof.channel_factors["norm"]:
        assert [c for c, _ in side] == [16, 64, 128]
        assert [f for _, f in side] == pytest.approx([wide / per_element[16], wide / per_element[64], 1.0], abs=0.005)


def test_a_narrow_batch_norm_is_priced_at_its_memory_efficiency_times_the_factor_in_every_dtype():
    factors = {"norm": (((16.0, 0.5), (128.0, 1.0)), ((16.0, 0.25), (128.0, 1.0)))}
    bn = CostPart("norm", fwd_flops=10**6, bwd_flops=2 * 10**6, bytes_moved=10**9, ops=1, channels=16)
    prof = _profile(factors)
    kernel = kernel_overheads_s(prof)[0]
    for dtype in ("fp32", "bf16"):
        with_f = parts_roofline_s([bn], prof, dtype=dtype, ratio=1.0)
        without = parts_roofline_s([bn], _profile({}), dtype=dtype, ratio=1.0)
        assert with_f[0] - kernel == pytest.approx((without[0] - kernel) / 0.5), dtype  # memory-bound: bytes / bw
        assert with_f[1] - 2 * kernel == pytest.approx((without[1] - 2 * kernel) / 0.25), dtype
    wide = dataclasses.replace(bn, channels=256)
    assert parts_roofline_s([wide], prof, dtype="fp32", ratio=1.0) == parts_roofline_s([wide], _profile({}),
                                                                                      dtype="fp32", ratio=1.0)


def test_profiles_show_says_what_each_kinds_factors_scale():
    r = subprocess.run([sys.executable, "-m", "pipeplan", "profiles", "show", "p40"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    assert "norm by channels" in r.stdout and "x the memory efficiency: forward 16: 0.53, 64: 0.69" in r.stdout
