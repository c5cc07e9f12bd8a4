"""Host time per op by kind (`dispatch_us_by_kind`): measured by calibrate, stored in the profile, and the floor of a
layer's time where its kernels are tiny (costmodels/part_costs.host_floor_s)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeplan.costmodels.graph import CostPart
from pipeplan.costmodels.part_costs import BACKWARD_KERNELS_FACTOR, host_floor_s, parts_roofline_s
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.calibrate_dispatch import measure_dispatch_by_kind, slope_s
from pipeplan.hardware_profiles.loader import load_profile, read_profile_file, save_profile
from pipeplan.hardware_profiles.profile import DISPATCH_KINDS

BY_KIND = {"conv3x3": (20e-6, 75e-6), "norm": (39e-6, 99e-6), "elementwise": (9e-6, 35e-6)}


def _profile(**kw):
    return dataclasses.replace(load_profile("h200"), name="t", dispatch_s=14e-6, **kw)


def test_the_host_floor_is_ops_times_each_kinds_figure_and_dispatch_for_the_rest():
    parts = [CostPart("conv3x3", ops=2), CostPart("norm", ops=1), CostPart("matmul", ops=3)]
    fwd, bwd = host_floor_s(parts, _profile(dispatch_by_kind_s=BY_KIND))
    assert fwd == pytest.approx(2 * 20e-6 + 39e-6 + 3 * 14e-6)
    assert bwd == pytest.approx(2 * 75e-6 + 99e-6 + 3 * 14e-6 * BACKWARD_KERNELS_FACTOR)
    assert host_floor_s(parts, _profile()) is None


def test_tiny_kernels_take_the_host_floor_and_big_ones_their_roofline():
    tiny = [CostPart("conv3x3", fwd_flops=1000, bwd_flops=2000, bytes_moved=1000, ops=1)]
    assert parts_roofline_s(tiny, _profile(dispatch_by_kind_s=BY_KIND), dtype="fp32", ratio=1.0) == \
        pytest.approx((20e-6, 75e-6))
    big = [CostPart("conv3x3", fwd_flops=int(1e13), bwd_flops=int(2e13), bytes_moved=int(1e9), ops=1)]
    with_floor = parts_roofline_s(big, _profile(dispatch_by_kind_s=BY_KIND), dtype="fp32", ratio=1.0)
    assert with_floor == parts_roofline_s(big, _profile(), dtype="fp32", ratio=1.0)
    assert with_floor[0] > 1e-3


def test_the_profile_field_round_trips_and_rejects_a_bad_entry(tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(_profile(dispatch_by_kind_s=BY_KIND), path)
    loaded = read_profile_file(path).dispatch_by_kind_s
    assert set(loaded) == set(BY_KIND)
    for kind, pair in BY_KIND.items():
        assert loaded[kind] == pytest.approx(pair)
    text = path.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("dispatch_us_by_kind:", "dispatch_us_by_kind:\n  relu: [1, 2]"))
    with pytest.raises(UserError, match="relu"):
        read_profile_file(bad)
    bad.write_text(text.replace("dispatch_us_by_kind:", "dispatch_us_by_kind:\n  other: 3"))
    with pytest.raises(UserError, match="forward µs, backward µs"):
        read_profile_file(bad)


def test_slope_takes_out_what_a_batch_pays_once():
    # 1 op: 100 fixed + 10; 32 ops: 100 + 320 -> 10 a op
    assert slope_s(110e-6, 420e-6, 32) == pytest.approx(10e-6)
    assert slope_s(420e-6, 110e-6, 32) == 0.0  # a disturbed run never gives a negative cost


def test_measuring_on_the_cpu_gives_every_kind_a_forward_and_a_backward():
    """The same loop calibrate runs on CUDA, here on the CPU (where it times the ops' whole work)."""
    out = measure_dispatch_by_kind("cpu")
    assert set(out) == set(DISPATCH_KINDS)
    for fwd, bwd in out.values():
        assert 0 <= fwd < 5e-3 and 0 <= bwd < 5e-3
    # a convolution with its weight gradient costs more backward than a ReLU's threshold_backward
    assert out["conv3x3"][1] > out["elementwise"][1]


def test_one_disturbed_sweep_does_not_move_a_kinds_figure(monkeypatch):
    """A host disturbance longer than one kind's few milliseconds spoils every round of a point (a CI run measured
    a ReLU's backward at 3x, above a convolution's); the kinds are swept SWEEPS times and each keeps its median."""
    from pipeplan.hardware_profiles import calibrate_dispatch

    clean = {kind: (2e-6, 10e-6) for kind in DISPATCH_KINDS}
    disturbed = dict(clean, elementwise=(6e-6, 31e-6), conv3x3=(60e-6, 90e-6))
    sweeps = iter([clean, disturbed, {k: (f, b * 0.9) for k, (f, b) in clean.items()}])
    monkeypatch.setattr(calibrate_dispatch, "_sweep", lambda *a, **k: next(sweeps))
    assert calibrate_dispatch.SWEEPS == 3
    out = measure_dispatch_by_kind("cpu")
    for kind in DISPATCH_KINDS:
        assert out[kind] == pytest.approx((2e-6, 10e-6))


def test_profiles_show_lists_a_gpu_calibrations_overheads_and_cuts_its_long_tables():
    from pathlib import Path

    from click.testing import CliRunner

    from pipeplan.cli.main import cli

    path = Path(__file__).parents[1] / "hardware_profiles" / "measured" / "nvidia-h200-calibrated.yaml"
    p = read_profile_file(path)
    r = CliRunner().invoke(cli, ["profiles", "show", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    fwd, bwd = p.dispatch_by_kind_s["norm"]
    assert f"norm {fwd * 1e6:.3g}/{bwd * 1e6:.3g}" in r.output
    assert f"adam {p.optimizer_tensor_s['adam'] * 1e6:.3g} µs a tensor" in r.output
    assert "conv3x3_sweep" in r.output and "the YAML file has it all" in r.output
