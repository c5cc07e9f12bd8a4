"""The optimizer step's time (costmodels/optimizer_step.py) and its place in the simulated iteration."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from pipeplan.costmodels.grad_passes import grad_scale_s
from pipeplan.costmodels.optimizer_step import optimizer_step_s
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.simulate import simulate


def test_bytes_per_parameter_follow_the_kernels():
    """torch's foreach Adam moves 72 B per fp32 parameter (7 passes, counted in the module docstring); a fused
    kernel 28 (read p, g, m, v; write p, m, v); mixed precision also makes the 16-bit weight copy (read 4, write 2)."""
    h100 = load_profile("h100-sxm")
    local = dataclasses.replace(h100, local=True)
    n = 1_000_000  # parameters
    bw = h100.mem_bw_bytes_per_s  # a local profile's bandwidth is what its core measured: taken whole
    gpu_bw = 0.80 * bw  # the catalogue's h100 names no memory efficiency: compute's 0.80 default, as for its layers
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=h100) == pytest.approx(28 * n / gpu_bw)
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=True, profile=h100) == pytest.approx(34 * n / gpu_bw)
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=local) == pytest.approx(72 * n / bw)
    assert optimizer_step_s(4 * n, optimizer="sgd", mixed_precision=False, profile=local) == pytest.approx(12 * n / bw)
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_step_s(4, optimizer="lamb", mixed_precision=False, profile=h100)


def test_a_step_streams_at_the_profiles_memory_efficiency_like_its_layers():
    """A profile that says its streaming kernels reach half the datasheet's bandwidth steps the optimizer, copies a
    stashed weight version and divides gradients at half of it (compute.streaming_bandwidth_bytes_per_s); one that
    says nothing takes the 0.80 its memory-bound layers take. On the H100 (RESULTS, GPU (g)) fused Adam moved GPT-2's
    28 B a parameter at 60% of the datasheet's 3.35 TB/s."""
    from pipeplan.costmodels.optimizer_step import stash_copy_s

    h100 = load_profile("h100-sxm")
    half = dataclasses.replace(h100, efficiency={**h100.efficiency, "memory": 0.5})
    n = 1_000_000
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=half) == \
        pytest.approx(28 * n / (0.5 * h100.mem_bw_bytes_per_s))
    assert stash_copy_s(4 * n, profile=half) == pytest.approx(8 * n / (0.5 * h100.mem_bw_bytes_per_s))
    assert stash_copy_s(4 * n, profile=h100) == pytest.approx(8 * n / (0.8 * h100.mem_bw_bytes_per_s))
    # a local profile's bandwidth is the copy rate calibrate measured: a copy takes it whole, an update does not
    local = dataclasses.replace(half, local=True)
    assert stash_copy_s(4 * n, profile=local) == pytest.approx(8 * n / h100.mem_bw_bytes_per_s)
    assert optimizer_step_s(4 * n, optimizer="sgd", mixed_precision=False, profile=local) == \
        pytest.approx(12 * n / (0.5 * h100.mem_bw_bytes_per_s))
    big = 8 * 10**9  # gradient bytes in one tensor: the per-tensor kernel time is lost in the rounding
    assert grad_scale_s(big, profile=half, tensors=1) / grad_scale_s(big, profile=h100, tensors=1) == pytest.approx(0.8 / 0.5, rel=1e-3)


def test_the_frameworks_kernels_override_the_profiles_default_and_its_measurements():
    """`kernels` says how the framework steps (pipeplan.choices.OptimizerKernels): "foreach" prices torch's passes
    (AdamW 80 B a parameter, what Composer's DecoupledAdamW loop moves too) on a GPU profile, "fused" 28 B on a
    local one; a profile's measured rates are of the runtime's own step, so only "auto" takes them."""
    h100 = load_profile("h100-sxm")
    n, bw = 1_000_000, h100.mem_bw_bytes_per_s
    assert optimizer_step_s(4 * n, optimizer="adamw", mixed_precision=False, profile=h100, kernels="foreach") == \
        pytest.approx(80 * n / (0.80 * bw))
    assert optimizer_step_s(4 * n, optimizer="adamw", mixed_precision=False, profile=h100, kernels="fused") == \
        pytest.approx(28 * n / (0.80 * bw))
    measured = dataclasses.replace(h100, local=True, optimizer_param_s={"adam": 3e-9}, optimizer_tensor_s={"adam": 5e-5},
                                   optimizer_step_s={"adam": 1e-4})
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=measured, tensors=10) == \
        pytest.approx(n * 3e-9 + 10 * 5e-5 + 1e-4)
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=measured, tensors=10,
                            kernels="fused") == pytest.approx(28 * n / bw)
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=measured, tensors=10,
                            kernels="foreach") == pytest.approx(72 * n / bw)


def test_a_plan_keeps_its_frameworks_kernels_and_prices_them_after_the_last_backward(tmp_path):
    """Data parallelism on one stage: the optimizer runs after everything, so a plan stepping with foreach kernels
    is longer than the fused one by exactly the two steps' difference (one replica's ZeRO-free update of every
    parameter). The plan file keeps the setting, and a re-prediction from it (what `show` draws) agrees."""
    from pipeplan.planner.plan import load_plan
    from pipeplan.planner.predict import evaluate
    from pipeplan.planner.replay import request_of, simulate_plan
    from search_fixtures import gpt_like

    h100 = load_profile("h100-sxm")
    g = gpt_like(blocks=2, hidden=64, seq=16, vocab=100, batch=4)
    plans = {k: evaluate(g, h100, [0] * len(g.layers), schedule="1f1b", microbatches=1, batch_size=8,
                         data_parallel=2, optimizer="adamw", optimizer_kernels=k) for k in ("fused", "foreach")}
    params = sum(layer.param_bytes for layer in g.layers) / 4
    assert plans["foreach"].predicted.iteration_s - plans["fused"].predicted.iteration_s == \
        pytest.approx((80 - 28) * params / (0.80 * h100.mem_bw_bytes_per_s))
    path = tmp_path / "plan.json"
    plans["foreach"].save(path)
    loaded = load_plan(path)
    assert loaded.optimizer_kernels == "foreach" and request_of(loaded).optimizer_kernels == "foreach"
    assert simulate_plan(loaded, g, h100).iteration_s == pytest.approx(plans["foreach"].predicted.iteration_s)


def test_on_a_gpu_the_hosts_per_tensor_time_overlaps_the_passes_and_on_a_cpu_it_adds():
    """The H200's calibration (hardware_profiles/measured/nvidia-h200-calibrated.yaml: 15.3 µs a tensor, 0.023 ns
    a parameter for Adam) against torch.optim.Adam's step measured there (benchmarks/RESULTS.md, GPU): GPT-2,
    124M parameters in 148 tensors, 3.12 ms; the sum of the two terms said 5.1 ms (+64%)."""
    from pathlib import Path

    from pipeplan.hardware_profiles.loader import read_profile_file

    gpu = read_profile_file(Path(__file__).parents[1] / "hardware_profiles" / "measured" / "nvidia-h200-calibrated.yaml")
    per_tensor, per_param = gpu.optimizer_tensor_s["adam"], gpu.optimizer_param_s["adam"]
    fixed = gpu.optimizer_step_s["adam"]
    params, tensors = 124_439_808, 148
    step = optimizer_step_s(4 * params, optimizer="adam", mixed_precision=False, profile=gpu, tensors=tensors)
    assert step == pytest.approx(max(params * per_param, tensors * per_tensor) + fixed)
    assert step == pytest.approx(3.12e-3, rel=0.05)
    # the 32x32 ResNet, 2,852,304 parameter bytes / 4 in 62 tensors: 1.26 ms measured
    assert optimizer_step_s(2_852_304, optimizer="adam", mixed_precision=False, profile=gpu, tensors=62) == \
        pytest.approx(1.26e-3, rel=0.10)
    cpu = dataclasses.replace(gpu, local=True)
    assert optimizer_step_s(4 * params, optimizer="adam", mixed_precision=False, profile=cpu, tensors=tensors) == \
        pytest.approx(params * per_param + tensors * per_tensor + fixed)
    assert optimizer_step_s(0, optimizer="adam", mixed_precision=False, profile=gpu) == 0.0  # nothing to step


def test_a_measured_rate_per_parameter_replaces_the_bytes():
    """A calibrated profile prices the update at its measured seconds per parameter (plus per tensor); the
    half-precision weight copy, which the timed torch.optim step does not include, stays bytes / bandwidth;
    an optimizer it did not measure keeps the bytes model."""
    local = dataclasses.replace(load_profile("h100-sxm"), local=True, optimizer_param_s={"adam": 3e-9},
                                optimizer_tensor_s={"adam": 50e-6})
    n, bw = 1_000_000, local.mem_bw_bytes_per_s
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=False, profile=local, tensors=10) == \
        pytest.approx(n * 3e-9 + 10 * 50e-6)
    assert optimizer_step_s(4 * n, optimizer="adam", mixed_precision=True, profile=local, tensors=10) == \
        pytest.approx(n * 3e-9 + 6 * n / bw + 10 * 50e-6)
    assert optimizer_step_s(4 * n, optimizer="sgd", mixed_precision=False, profile=local) == pytest.approx(12 * n / bw)


def test_each_device_steps_after_its_last_backward_and_all_reduce():
    """2 stages, GPipe, M = 2, F = 1, B = 2, no sends: stage 1 runs F at 1-3, B at 3-7; stage 0 F at 0-2 and
    B at 5-7, 7-9 (each behind stage 1's). Stage 0 all-reduces 9 -> 10 and steps 10 -> 10.5; stage 1 steps
    7 -> 10. The iteration ends when the later device has stepped."""
    one, two = Fraction(1), Fraction(2)
    base = simulate("gpipe", [one, one], [two, two], [0, 0], 2, allreduce_s=[one, 0])
    assert base.iteration_s == 10
    got = simulate("gpipe", [one, one], [two, two], [0, 0], 2, allreduce_s=[one, 0],
                   optimizer_s=[Fraction(1, 2), Fraction(3)])
    assert got.iteration_s == Fraction(21, 2)
    steps = sorted((e.device, e.start_s, e.end_s) for e in got.events if e.kind == "optimizer")
    assert steps == [(0, 10, Fraction(21, 2)), (1, 7, 10)]


def test_an_asynchronous_schedule_folds_the_update_into_the_backward():
    with pytest.raises(ValueError, match="fold the per-microbatch update"):
        simulate("pipedream", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 2, optimizer_s=[1.0, 1.0])


@pytest.mark.parametrize("schedule,stashes", [("pipedream", True), ("pipedream-2bw", True), ("1f1b", False)])
def test_asynchronous_updates_also_copy_the_weights_into_a_stash(schedule, stashes):
    """PipeDream (every update) and 2BW (every window) clone each stage's weights into a new version:
    2 bytes moved per weight byte at the bandwidth the profile's streaming kernels reach, on top of the optimizer step."""
    from cli_fixtures import chain_graph
    from pipeplan.planner.configs import Config
    from pipeplan.planner.predict_inputs import stage_inputs
    from pipeplan.planner.problem import build_problem
    from pipeplan.planner.request import PlanRequest

    graph = chain_graph()
    profile = load_profile("a100-80gb-sxm")
    request = PlanRequest(devices=2, batch_size=4, stages=2, microbatches=2, schedule=schedule, optimizer="sgd")
    problem = build_problem(graph, profile, microbatch_size=2)
    n = problem.n
    assignment = [0] * (n // 2) + [1] * (n - n // 2)
    cfg = Config(schedule=schedule, stages=2, data_parallel=1, microbatches=2, chunks=1, recompute=False)
    x = stage_inputs(problem, profile, graph, assignment, cfg, request, [1, 1], [[0], [1]])
    params = [sum(l.param_bytes for l, a in zip(graph.layers, assignment, strict=True) if a == s) for s in (0, 1)]
    step = [optimizer_step_s(b, optimizer="sgd", mixed_precision=False, profile=profile, tensors=t)
            for b, t in zip(params, _tensors(graph, assignment), strict=True)]
    streaming = profile.mem_bw_bytes_per_s * profile.efficiency.get("memory", 0.80)  # as its layers stream
    copy = [2 * b / streaming if stashes else 0.0 for b in params]
    # 1F1B and 2BW divide the gradients by M = 2 before each update; async PipeDream updates every microbatch
    scale = [grad_scale_s(b, profile=profile, tensors=t) if schedule != "pipedream" else 0.0
             for b, t in zip(params, _tensors(graph, assignment), strict=True)]
    assert all(b > 0 for b in params)
    assert x.optimizer == pytest.approx([s + c + g for s, c, g in zip(step, copy, scale, strict=True)])


def _tensors(graph, assignment) -> list[int]:
    return [len({p for l, a in zip(graph.layers, assignment, strict=True) if a == s for p in l.params}) for s in (0, 1)]


def test_a_steps_fixed_part_is_one_tiny_tensors_step_less_its_per_tensor_time(monkeypatch, tmp_path):
    """hardware_profiles/optimizer_overhead.per_step_s on a clock the test sets, and the profile field's round trip."""
    from pipeplan.hardware_profiles import optimizer_overhead
    from pipeplan.hardware_profiles.loader import read_profile_file, save_profile

    monkeypatch.setattr(optimizer_overhead, "step_s", lambda name, tensors, *a, **k: 250e-6 + 15e-6 * tensors)
    fixed = optimizer_overhead.per_step_s({"adam": 15e-6, "sgd": 400e-6})
    assert fixed["adam"] == pytest.approx(250e-6) and "sgd" not in fixed  # a disturbed figure is left out
    prof = dataclasses.replace(load_profile("h200"), name="t", optimizer_step_s={"adam": 250e-6})
    save_profile(prof, tmp_path / "p.yaml")
    assert read_profile_file(tmp_path / "p.yaml").optimizer_step_s == pytest.approx({"adam": 250e-6})
