"""The runtime's passes over a stage's gradients besides the optimizer (costmodels/grad_passes.py): dividing by M
after the last backward, and the data-parallel sync's copies around its all-reduce. Each formula by hand, then
held out against the runtime's (and torch's) own code on this machine, priced from a profile calibrated here."""

from __future__ import annotations

import dataclasses
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from pipeplan.costmodels.grad_passes import dp_flatten_s, grad_scale_s
from pipeplan.hardware_profiles import load_profile
from timing_pairs import ratios_until_within


def test_a_pass_reads_and_writes_each_gradient_once():
    """8 bytes per fp32 parameter at the bandwidth streaming kernels reach and a kernel per tensor, no less than the host's dispatch
    per tensor (one eager op each); a calibrated profile takes its plain SGD step (one in-place op, 12 bytes a
    parameter) scaled to 8 bytes, and its per-tensor time. The data-parallel sync makes two such passes."""
    a100 = load_profile("a100-80gb-sxm")
    n, t = 10_000_000, 4
    streaming = 0.80 * a100.mem_bw_bytes_per_s  # what its memory-bound layers get: compute's default efficiency
    assert grad_scale_s(4 * n, profile=a100, tensors=t) == pytest.approx(8 * n / streaming + t * 3e-6)
    assert grad_scale_s(4 * 1000, profile=a100, tensors=100) == pytest.approx(100 * 8e-6)  # host-bound
    local = dataclasses.replace(a100, local=True, optimizer_param_s={"sgd": 0.6e-9}, optimizer_tensor_s={"sgd": 2e-6})
    assert grad_scale_s(4 * n, profile=local, tensors=t) == pytest.approx(n * 0.4e-9 + t * 2e-6)
    assert dp_flatten_s(4 * n, profile=local, tensors=t) == pytest.approx(2 * (n * 0.4e-9 + t * 2e-6))


@pytest.fixture(scope="module")
def stage():
    """A stage of 8 Linear(1024, 1024) with gradients, timed on one thread under the runtime's allocator setting
    (as `profiles calibrate` measures)."""
    from pipeplan.hardware_profiles.allocator import keep_freed_memory

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    keep_freed_memory()
    yield torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    torch.set_num_threads(threads)


def _calibrated_profile():
    """A local profile with this machine's plain SGD step, measured now as `profiles calibrate` measures it."""
    from pipeplan.hardware_profiles.optimizer_overhead import per_param_s, per_tensor_s

    per_tensor = per_tensor_s()
    return dataclasses.replace(load_profile("a100-80gb-sxm"), local=True, optimizer_tensor_s=per_tensor,
                               optimizer_param_s=per_param_s(per_tensor))


def _within_2x(ratio: float) -> bool:
    return 0.5 < ratio < 2.0


def _median_s(module, fn, reps: int = 25, warmup: int = 5) -> float:
    """Median seconds of `fn` over `module`'s gradients, set to ones first: a pass divides them in place, and
    tries enough would take them to subnormal floats, which a CPU divides far slower."""
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    times = []
    for _ in range(reps + warmup):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def _param_bytes(module) -> int:
    return 4 * sum(p.numel() for p in module.parameters())


def test_torchs_own_gradient_division_takes_what_the_profile_predicts(stage):
    """torch's `_PipelineStageBase.scale_grads`, the code every schedule runs after a stage's last backward."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def pair() -> tuple[float, float]:
        predicted = grad_scale_s(_param_bytes(stage), profile=_calibrated_profile(), tensors=16)
        return _median_s(stage, lambda: _PipelineStageBase.scale_grads(SimpleNamespace(submod=stage), 4)), predicted

    ratios = ratios_until_within(pair, _within_2x)
    assert _within_2x(ratios[-1]), ratios


def test_the_data_parallel_syncs_copies_take_what_the_profile_predicts(stage, monkeypatch):
    """runtime/worker.average_replica_grads with its all-reduce taken out (calibrate prices that on its own):
    what is left is its concatenation, division and clones."""
    from pipeplan.runtime import worker

    monkeypatch.setattr(worker.dist, "all_reduce", lambda *args, **kwargs: None)

    def pair() -> tuple[float, float]:
        predicted = dp_flatten_s(_param_bytes(stage), profile=_calibrated_profile(), tensors=16)
        return _median_s(stage, lambda: worker.average_replica_grads({0: stage}, {0: None}, 2, True), reps=15), predicted

    ratios = ratios_until_within(pair, _within_2x)
    assert _within_2x(ratios[-1]), ratios
    # no third pass: every gradient is a view of the one reduced buffer
    assert len({p.grad.untyped_storage().data_ptr() for p in stage.parameters()}) == 1
