"""Plans of a graph traced on an H100 against `pipeplan run` on it, the runtime stepping torch's fused optimizer
(CPU tests; the data are tests/data/gpu/*-h100.*, from benchmarks/gpu_bench.py and gpu_step_breakdown.py on the
lent machine, 2026-11-27, and its calibration, hardware_profiles/measured/nvidia-h100-80gb-hbm3-calibrated.yaml).

Why: on the H200 the runtime stepped torch's default (foreach) Adam, 1.3-1.5 ms of host-bound launches on the small
CNNs, which a catalogue profile, pricing the fused kernel GPU frameworks step with, left out: its plans read
25-26% under those runs (tests/test_gpu_measured_times.py). The runtime now steps fused on CUDA
(pipeplan/optimizers.py); this is the first run of it, the measurements independent of the planner (another
process, NCCL, the median step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.costmodels.graph import load_graph
from pipeplan.hardware_profiles.loader import load_profile, read_profile_file
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.search import search

DATA = Path(__file__).parent / "data" / "gpu"
CALIBRATED = Path(__file__).parents[1] / "hardware_profiles" / "measured" / "nvidia-h100-80gb-hbm3-calibrated.yaml"


def _predicted_s(name: str, profile, times: str = "model") -> float:
    g = load_graph(DATA / f"{name}-h100.graph.json")
    request = PlanRequest(devices=1, batch_size=g.batch_size, microbatches=1, stages=1, dtype="fp32",
                          recompute="off", times=times)
    return search(g, profile, request).best.predicted.iteration_s


def _runs(name: str) -> dict:
    return json.loads((DATA / f"{name}-h100.run.json").read_text())


@pytest.mark.parametrize("profile", ["calibrated", "h100-sxm"])
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_a_plan_on_the_traced_h100_predicts_both_runs_of_it_within_10_percent(name, profile):
    """The graph's CUDA-event times on the H100's calibration or its catalogue profile (which takes the trace's
    times on the GPU that traced it), against two runs on that machine: the default plan's, and that of
    `pipeplan analyze --profile h100-sxm` minutes later (its own trace; same configuration). Read -3% to +1%.
    The 32x32 U-Net is left out: two runs of its one plan measured 3.98 and 5.91 ms (host-bound: replayed as a
    CUDA graph its step takes 1.44 ms), so its prediction (6.2-6.5 ms) has no single number to meet."""
    p = read_profile_file(CALIBRATED) if profile == "calibrated" else load_profile(profile)
    predicted = _predicted_s(name, p)
    runs = _runs(name)
    for measured in (runs["iteration_s"], runs["analyze_run"]["iteration_s"]):
        assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_catalogue_roofline_alone_is_right_for_gpt2_and_far_under_for_the_small_resnet(name):
    """Without the trace's times: GPT-2's large GEMMs are what the roofline prices (+5%), the 32x32 ResNet's
    narrow convolutions and eager host are not (-78%); why a plan on the GPU takes its traced times."""
    measured = _runs(name)["iteration_s"]
    roof = _predicted_s(name, load_profile("h100-sxm"), times="roofline")
    if name == "gpt":
        assert abs(roof - measured) / measured < 0.10
    else:
        assert roof < 0.3 * measured
