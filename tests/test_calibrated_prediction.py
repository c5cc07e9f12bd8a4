"""A calibrated local profile predicts real layer times through the roofline (issue 3, "Done when").

The profile comes from `calibrate(budget_s=10)`. The layers are timed here on one
thread (as the calibration measures, and as the runtime runs one rank per core),
median of several repeats after warm-up. The prediction uses
`layer_times_s(..., times="roofline")`, never the measured-times shortcut, with
FLOPs from FlopCounterMode and bytes from the tensors' sizes, which is what the
tracer records for a layer.

Noise: layers are timed with the thread's CPU clock (`time.thread_time`), which
other processes on a shared machine cannot inflate; calibrate() times with the
wall clock, so on an overloaded machine its peaks come out low. A miss is
therefore retried once with a fresh calibration on a quiet machine; when the
calibration itself got less than 85% of a core (it records that share) a miss
skips the test, with the numbers in the message, rather than failing on someone
else's load. On an idle machine (CI) two misses are a failure. Typical errors seen
while developing: 1-18% per layer forward, 11-18% for fwd+bwd of all layers.
Cost: one calibration (~12 s idle) plus ~5 s of layer timing.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.costmodels import compute
from pipeplan.costmodels.graph import Graph, Layer

pytestmark = pytest.mark.slow  # one calibration (~12 s idle) + layer timing

TOLERANCE = 0.25
REPEATS = 5

CASES = {
    # name: (kind, module factory, input shape); forwards of 1-3 GFLOP (~15-40 ms on one core)
    "linear_2048": ("matmul", lambda: nn.Linear(2048, 2048), (256, 2048)),
    "linear_1024x4096": ("matmul", lambda: nn.Linear(1024, 4096), (256, 1024)),
    "conv3x3_64": ("conv", lambda: nn.Conv2d(64, 64, 3, padding=1), (4, 64, 56, 56)),
    "conv3x3_128": ("conv", lambda: nn.Conv2d(128, 128, 3, padding=1), (4, 128, 28, 28)),
}


def _busy(profile=None) -> tuple[bool, str]:
    """Was this process starved of its core while calibrating? (Then wall-clock peaks are low.)

    The calibration records the share of a core it got (CPU time / wall time);
    a lagging 1-minute load average would also count the processes that tests
    before this one have already finished.
    """
    share = ((profile.calibration or {}).get("cpu_share") if profile is not None else None)
    if share is not None:
        return share < 0.85, f"calibration got {share:.0%} of a core"
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    return load > cores, f"load average {load:.1f} on {cores} cores"


def _median_cpu_s(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _measure_layer(name: str, kind: str, module: nn.Module, x: torch.Tensor) -> tuple[Layer, float, float]:
    """The Layer record the tracer would write, plus measured fwd and bwd medians."""
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    with FlopCounterMode(display=False) as fc:
        out = module(x)
    grad = torch.ones_like(out)
    with FlopCounterMode(display=False) as bc:
        out.backward(grad)
    out_bytes = out.numel() * out.element_size()
    layer = Layer(name, kind=kind, fwd_flops=fc.get_total_flops(), bwd_flops=bc.get_total_flops(),
                  param_bytes=param_bytes, output_bytes=out_bytes,
                  bytes_moved=x.numel() * x.element_size() + out_bytes + param_bytes)
    with torch.no_grad():
        fwd_s = _median_cpu_s(lambda: module(x))
    fwd_bwd_s = _median_cpu_s(lambda: module(x).backward(grad))
    return layer, fwd_s, max(fwd_bwd_s - fwd_s, 0.0)


def _measure_all() -> dict[str, tuple[Layer, float, float]]:
    torch.manual_seed(0)
    out = {}
    for name, (kind, factory, shape) in CASES.items():
        out[name] = _measure_layer(name, kind, factory(), torch.randn(*shape, requires_grad=True))
    return out


def _errors(profile, measured) -> dict[str, tuple[float, float, float]]:
    """name -> (predicted s, measured s, relative error), per layer forward and for fwd+bwd of all."""
    layers = [m[0] for m in measured.values()]
    graph = Graph(name="layers", layers=layers, edges=[], batch_size=1, source={"device": "cpu"})
    fwd, bwd = compute.layer_times_s(graph, profile, times="roofline")
    res = {}
    for i, (name, (_, f_s, _)) in enumerate(measured.items()):
        res[f"{name} fwd"] = (fwd[i], f_s, abs(fwd[i] - f_s) / f_s)
    pred_all = sum(fwd) + sum(bwd)
    meas_all = sum(f + b for _, f, b in measured.values())
    res["all layers fwd+bwd"] = (pred_all, meas_all, abs(pred_all - meas_all) / meas_all)
    return res


def _describe(profile, errors) -> str:
    rows = [f"{k}: predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms ({e:.0%})" for k, (p, m, e) in errors.items()]
    return (f"fp32 peak {profile.flops_for('fp32') / 1e9:.1f} GFLOP/s, efficiency {profile.efficiency}; "
            + "; ".join(rows))


@pytest.fixture(scope="module")
def outcome():
    try:
        from pipeplan.hardware_profiles.calibrate import calibrate
    except ImportError as e:  # the PROFILES helper's module; the interface is fixed
        pytest.skip(f"hardware_profiles.calibrate not available: {e}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        attempts = []
        for _ in range(2):
            profile = calibrate(budget_s=10.0)
            measured = _measure_all()
            errors = _errors(profile, measured)
            attempts.append((profile, measured, errors))
            if all(e <= TOLERANCE for _, _, e in errors.values()) or _busy(profile)[0]:
                break  # passed, or no point re-measuring on an overloaded machine (the test skips)
        return attempts
    finally:
        torch.set_num_threads(before)


def test_calibrate_gives_a_local_profile(outcome):
    profile = outcome[-1][0]
    assert profile.local
    assert compute.uses_measured_times(
        Graph(name="g", layers=[Layer("x", fwd_s=1.0)], edges=[], batch_size=1, source={"device": "cpu"}),
        profile, "fp32")


def test_roofline_on_calibrated_profile_predicts_layers_within_25_percent(outcome):
    profile, _, errors = outcome[-1]
    if all(e <= TOLERANCE for _, _, e in errors.values()):
        return
    busy, why = _busy(profile)
    message = f"after {len(outcome)} calibrations: " + _describe(profile, errors)
    if busy:
        pytest.skip(f"machine overloaded ({why}); calibrate's wall-clock peaks are unreliable: {message}")
    pytest.fail(message)


def test_measured_shortcut_is_not_what_was_tested(outcome):
    """Guard: on a local profile times="model" takes measured times, so the test above must use "roofline"."""
    profile, measured, _ = outcome[-1]
    layer = measured["linear_2048"][0]
    timed = Layer(**{**layer.__dict__, "fwd_s": 123.0, "bwd_s": 456.0})
    graph = Graph(name="g", layers=[timed], edges=[], batch_size=1, source={"device": "cpu"})
    assert compute.layer_times_s(graph, profile, times="model") == ([123.0], [456.0])
    assert compute.layer_times_s(graph, profile, times="roofline")[0][0] < 1.0
