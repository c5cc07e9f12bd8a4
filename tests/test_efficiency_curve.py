"""Efficiency curves (hardware_profiles/curve.py): interpolation, the loader's checks, their use in part pricing,
and the calibrated H100 profile committed from a real run (hardware_profiles/measured/).

Expected values come from the formulas written out here (log-linear interpolation with math.log, the
roofline F / (peak * eff) + kernels * t_kernel), not from the code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipeplan.costmodels.graph import CostPart
from pipeplan.costmodels.part_costs import BACKWARD_KERNELS_FACTOR, parts_roofline_s
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.calibrate_cuda import build_profile
from pipeplan.hardware_profiles.curve import MAX_CURVE_POINTS, interpolate, point_efficiency
from pipeplan.hardware_profiles.gpu_catalog import catalog_name
from pipeplan.hardware_profiles.loader import parse_profile, profile_to_dict, read_profile_file, save_profile

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "hardware_profiles" / "measured" / "nvidia-h100-80gb-hbm3-calibrated.yaml"
CURVE = ((1e6, 0.02), (1e9, 0.4), (1e12, 0.8))


def test_interpolation_is_linear_in_log_flops_and_clamped_at_the_ends():
    assert interpolate(CURVE, 1e9) == pytest.approx(0.4)
    x = 3e7  # between 1e6 and 1e9: weight log(x/1e6) / log(1e9/1e6)
    w = math.log(x / 1e6) / math.log(1e3)
    assert interpolate(CURVE, x) == pytest.approx(0.02 + w * (0.4 - 0.02))
    assert interpolate(CURVE, 10.0) == 0.02 and interpolate(CURVE, 1e15) == 0.8


def _doc(curve) -> dict:
    doc = profile_to_dict(load_profile("h100-sxm"))
    doc["efficiency_curve"] = {"matmul@fp32": curve}
    return doc


@pytest.mark.parametrize("curve, words", [
    ([[1e9, 0.5], [1e6, 0.1]], "sort the points"),
    ([[1e6, 0.1]], "list of 2 to 64"),
    ([[float(i + 1), 0.5] for i in range(MAX_CURVE_POINTS + 1)], "list of 2 to 64"),
    ([[1e6, 0.1], [1e9, 80]], "achieved/peak fraction"),
    ([[1e6, 0.1], [1e9, -0.5]], "positive"),
    ([[1e6, 0.1], [1e9]], "pair"),
    ("fast", "list of 2 to 64"),
])
def test_loader_refuses_bad_curves_naming_the_file_and_field(curve, words):
    with pytest.raises(UserError) as e:
        parse_profile(_doc(curve), "my.yaml")
    assert "my.yaml" in e.value.message and "efficiency_curve.matmul@fp32" in e.value.message
    assert words in e.value.message or words in (e.value.hint or "")


def test_loader_refuses_unknown_curve_kinds_and_dtypes():
    for key in ("gemm@fp32", "matmul@fp64"):
        doc = _doc([[1e6, 0.1], [1e9, 0.5]])
        doc["efficiency_curve"] = {key: [[1e6, 0.1], [1e9, 0.5]]}
        with pytest.raises(UserError):
            parse_profile(doc, "my.yaml")


def test_curve_round_trips_through_yaml(tmp_path):
    p = parse_profile(_doc([list(pt) for pt in CURVE]), "x.yaml")
    save_profile(p, tmp_path / "p.yaml")
    assert read_profile_file(tmp_path / "p.yaml").efficiency_curve == {"matmul@fp32": CURVE}


def test_parts_are_priced_at_the_curves_efficiency_for_their_flops_per_kernel():
    base = load_profile("h100-sxm")
    prof = replace(base, efficiency_curve={"matmul@fp32": CURVE}, kernel_overhead_s=2e-6, dispatch_s=0.0)
    part = CostPart(kind="matmul", fwd_flops=4 * 10**9, bwd_flops=8 * 10**9, bytes_moved=1000, ops=4)
    fwd, bwd = parts_roofline_s([part], prof, dtype="fp32", ratio=1.0)
    peak = 66.9e12  # catalog/h100-sxm.yaml peak_tflops.fp32
    f_per_kernel = 4e9 / 4  # 1e9: the curve's point, 0.4
    b_per_kernel = 8e9 / (4 * BACKWARD_KERNELS_FACTOR)  # also 1e9
    assert fwd == pytest.approx(4e9 / (peak * interpolate(CURVE, f_per_kernel)) + 4 * 2e-6)
    assert bwd == pytest.approx(8e9 / (peak * interpolate(CURVE, b_per_kernel)) + 8 * 2e-6)


def test_without_a_curve_pricing_is_the_single_efficiency_one():
    prof = load_profile("h100-sxm")
    part = CostPart(kind="matmul", fwd_flops=4 * 10**9, bwd_flops=8 * 10**9, bytes_moved=1000, ops=4)
    flat = replace(prof, efficiency_curve={"matmul@fp32": ((1.0, 0.7), (2.0, 0.7))})
    # DEFAULT_EFFICIENCY["matmul"] is 0.70, so a flat 0.70 curve must price exactly as no curve does
    assert parts_roofline_s([part], prof, dtype="fp32", ratio=1.0) == pytest.approx(
        parts_roofline_s([part], flat, dtype="fp32", ratio=1.0))


def test_curve_definition_gives_back_the_measured_time_at_each_point():
    """efficiency = F / (peak * (t - t_kernel)): the part's price at a measured size is the measured time."""
    kernel_s = 2e-6
    raw = {"matmul@fp32": [(2.0 * n**3, 2.0 * n**3 / 40e12 + 5e-6) for n in (256, 1024, 4096)],
           "matmul@tf32": [(1e6, 1e-5), (1e9, 1e-4)], "matmul@bf16": [(1e6, 1e-5), (1e9, 1e-4)]}
    sheet = load_profile("h100-sxm")
    links = {"note": "n/a", "intra_node": sheet.intra_node, "inter_node": sheet.inter_node, "collectives": {},
             "devices_per_node": 1}
    prof = build_profile(name="t", device="NVIDIA H100 80GB HBM3", stamp="test", sheet=sheet, raw=raw,
                         kernel_s=kernel_s, dispatch={"plain": 5e-6, "autograd": 9e-6}, copy_bw=3e12, links=links,
                         facts={"total_memory": 80 * 2**30, "torch": "x", "cuda": "y"})
    prof = replace(prof, dispatch_s=0.0)
    for flops, t in raw["matmul@fp32"]:
        part = CostPart(kind="matmul", fwd_flops=int(flops), bwd_flops=0, bytes_moved=0, ops=1)
        assert parts_roofline_s([part], prof, dtype="fp32", ratio=1.0)[0] == pytest.approx(t)
    assert point_efficiency(1e9, 1e-3, 1e12, 0.0) == pytest.approx(1.0)
    assert prof.peak_flops["fp32"] == sheet.peak_flops["fp32"]  # the datasheet's, with the best measured recorded
    assert prof.calibration["best_gemm_tflops"]["fp32"] == pytest.approx(max(f / t for f, t in raw["matmul@fp32"]) / 1e12,
                                                                         abs=0.01)


def test_the_committed_h100_calibration_loads_and_its_curve_rises_with_size():
    p = read_profile_file(MEASURED)
    assert p.device == "NVIDIA H100 80GB HBM3" and p.calibration["device_type"] == "cuda"
    effs = [e for _, e in p.efficiency_curve["matmul@bf16"]]
    assert effs[0] < 0.05 < 0.5 < effs[-1]  # small GEMMs a few % of peak, large ones most of it
    assert yaml.safe_load(MEASURED.read_text())["peak_tflops"]["bf16"] == 989.4  # catalog/h100-sxm.yaml


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"),
    ("NVIDIA L4", "l4"), ("Tesla T4", "t4"), ("Tesla P40", "p40"), ("NVIDIA GeForce RTX 3090", None),
    ("NVIDIA TITAN X (Pascal)", "titan-x-pascal"), ("NVIDIA TITAN Xp", None), ("GeForce GTX 1080 Ti", "gtx-1080-ti"),
])
def test_cuda_names_map_to_catalogue_profiles(name, expected):
    assert catalog_name(name) == expected


def test_nccl_measurements_become_the_links_the_cost_model_prices():
    """calibrate_nccl's fit, fed times made from a known link: t = lat + n / bw one way, and each collective's
    two-rank ring time (collectives.RING_FACTORS: all-reduce n/bw + 2 lat, reduce-scatter and all-gather
    n/(2 bw) + lat)."""
    from pipeplan.hardware_profiles.calibrate_nccl import links_from_measurements

    lat, bw = 8e-6, 350e9
    one_way = {n: lat + n / bw for n in (4, 2**20, 2**28)}
    made = {"allreduce": (12e-6, 180e9, 1.0, 2.0), "reduce_scatter": (9e-6, 200e9, 0.5, 1.0),
            "all_gather": (7e-6, 220e9, 0.5, 1.0)}
    times = {op: {n: k_bw * n / b + k_lat * t for n in (2**16, 2**20, 2**28)}
             for op, (t, b, k_bw, k_lat) in made.items()}
    links = links_from_measurements(one_way, times, "NVIDIA H100 80GB HBM3", 8, "test")
    intra = links["intra_node"]
    assert intra.kind == "nvlink" and intra.latency_s == pytest.approx(lat + 4 / bw)
    assert intra.bandwidth_bytes_per_s == pytest.approx(2**28 / (2**28 / bw - 4 / bw))
    for op, (t, b, _, _) in made.items():
        got = links["collectives"][op]
        assert got.kind == "nccl " + op.replace("_", "-")
        assert got.bandwidth_bytes_per_s == pytest.approx(b) and got.latency_s == pytest.approx(t)
    assert links["inter_node"] == load_profile("h100-sxm").inter_node and links["devices_per_node"] == 8


def test_the_nccl_calibration_runs_its_two_ranks_end_to_end_over_gloo():
    """The processes, messages and collectives `profiles calibrate --device cuda` runs between GPUs 0 and 1, run
    here over gloo on the CPU (no machine of this project's has had two GPUs): every size of every measurement
    comes back from the spawned ranks, a 16 MiB message takes longer than a 4-byte one, and every fitted link has
    a positive bandwidth. (16 MiB, not 1: over gloo on a busy 2-core host a pinned rank's wake-ups are bimodal, and
    a 4-byte message's median read 1.11 ms against 0.89 ms for 1 MiB in a CI run, 2026-12-02; 16 MiB's copy takes
    4-6 ms here, beyond that jitter.)"""
    from pipeplan.hardware_profiles.calibrate_nccl import links_from_measurements, measure_links

    one_way, times = measure_links("gloo", p2p_sizes=(4, 2**24), collective_sizes=(2**16, 2**20), timeout_s=120)
    assert set(one_way) == {4, 2**24} and one_way[2**24] > one_way[4] > 0
    assert set(times) == {"allreduce", "reduce_scatter", "all_gather"}
    assert all(set(by_size) == {2**16, 2**20} and min(by_size.values()) > 0 for by_size in times.values())
    links = links_from_measurements(one_way, times, "a CPU", 2, "test")
    assert links["intra_node"].kind == "pcie" and links["intra_node"].bandwidth_bytes_per_s > 0
    assert all(link.bandwidth_bytes_per_s > 0 and link.latency_s >= 0 for link in links["collectives"].values())