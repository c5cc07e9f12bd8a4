"""A calibrated local profile predicts real layer times through the roofline (issue 3).

The profile comes from one real `pipeplan profiles calibrate --budget-s 8`, shared with test_calibrate.py
(conftest.real_calibration). The layers are timed here on one
thread (as the calibration measures, and as the runtime runs one rank per core),
best of several repeats after warm-up, as calibration itself times. The prediction
uses `layer_times_s(..., times="roofline")`, never the measured-times shortcut,
with FLOPs from FlopCounterMode and bytes from the tensors' sizes, which is what
the tracer records for a layer.

What this test can promise on any CI host, and what it cannot: the accuracy
target (within 25% on a quiet machine) is a performance figure about one
machine, so it lives in `benchmarks/calibrate_bench.py` and benchmarks/RESULTS.md
(the same conv shapes, GEMMs and copies; 1-20% there). Here the check is the one
that separates a bug from a machine: measured / predicted must lie in
[1/1.5, 1.9]. A unit slip (MACs counted as FLOPs, backward FLOPs dropped or
doubled) is a factor of 2 or more, outside that band. Noise only ever adds time:
CI hosts have measured layers 12-40% (and a copy 56%) slower than the calibration
predicted, from neighbours and sustained-load clocks no in-VM check can see.
Layers are re-measured (up to 3 windows, per-layer best kept) before a miss counts.
Cost: the shared calibration plus ~5-15 s of layer timing.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.costmodels import compute
from pipeplan.costmodels.graph import Graph, Layer

pytestmark = pytest.mark.slow  # one calibration (~12 s idle) + layer timing

LOW, HIGH = 1 / 1.5, 1.9  # measured / predicted: inside, noise; outside, a unit slip
REPEATS = 7
WINDOWS = 3

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


def _best_cpu_s(fn) -> float:
    """Best thread CPU time of REPEATS runs: other processes cannot inflate CPU time,
    and the minimum is what calibration reports too."""
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


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
        fwd_s = _best_cpu_s(lambda: module(x))
    fwd_bwd_s = _best_cpu_s(lambda: module(x).backward(grad))
    return layer, fwd_s, max(fwd_bwd_s - fwd_s, 0.0)


def _measure_all() -> dict[str, tuple[Layer, float, float]]:
    torch.manual_seed(0)
    out = {}
    for name, (kind, factory, shape) in CASES.items():
        out[name] = _measure_layer(name, kind, factory(), torch.randn(*shape, requires_grad=True))
    return out


def _ratios(profile, measured) -> dict[str, tuple[float, float, float]]:
    """name -> (predicted s, measured s, measured / predicted), per layer forward and for fwd+bwd of all."""
    layers = [m[0] for m in measured.values()]
    graph = Graph(name="layers", layers=layers, edges=[], batch_size=1, source={"device": "cpu"})
    fwd, bwd = compute.layer_times_s(graph, profile, times="roofline")
    res = {}
    for i, (name, (_, f_s, _)) in enumerate(measured.items()):
        res[f"{name} fwd"] = (fwd[i], f_s, f_s / fwd[i])
    pred_all = sum(fwd) + sum(bwd)
    meas_all = sum(f + b for _, f, b in measured.values())
    res["all layers fwd+bwd"] = (pred_all, meas_all, meas_all / pred_all)
    return res


def _inside(ratios) -> bool:
    return all(LOW < r < HIGH for _, _, r in ratios.values())


def _describe(profile, ratios) -> str:
    rows = [f"{k}: predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms (x{r:.2f})" for k, (p, m, r) in ratios.items()]
    return (f"fp32 peak {profile.flops_for('fp32') / 1e9:.1f} GFLOP/s, efficiency {profile.efficiency}; "
            + "; ".join(rows))


def _best_of(a, b):
    """Per layer, the faster of two measurement windows (Layer records are the same)."""
    return {k: (a[k][0], min(a[k][1], b[k][1]), min(a[k][2], b[k][2])) for k in a}


@pytest.fixture(scope="module")
def outcome(real_calibration):
    """(profile, measured, ratios) after up to WINDOWS measurement windows."""
    from pipeplan.hardware_profiles import load_profile

    result, path, _ = real_calibration
    assert result.exit_code == 0, result.stderr
    profile = load_profile(str(path))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = _measure_all()
        for _ in range(WINDOWS - 1):
            if _inside(_ratios(profile, measured)):
                break
            time.sleep(1.0)
            measured = _best_of(measured, _measure_all())
        return profile, measured, _ratios(profile, measured)
    finally:
        torch.set_num_threads(before)


def test_calibrate_gives_a_local_profile(outcome):
    profile = outcome[0]
    assert profile.local
    assert compute.uses_measured_times(
        Graph(name="g", layers=[Layer("x", fwd_s=1.0)], edges=[], batch_size=1, source={"device": "cpu"}),
        profile, "fp32")


def test_roofline_on_calibrated_profile_predicts_real_layers(outcome):
    profile, _, ratios = outcome
    if _inside(ratios):
        return
    busy, why = _busy(profile)
    if busy and all(r < HIGH for _, _, r in ratios.values()):
        # a starved calibration measures low peaks, so predictions come out slow, never fast
        pytest.skip(f"calibration starved ({why}), its peaks are low: {_describe(profile, ratios)}")
    pytest.fail(f"measured / predicted outside [{LOW:.2f}, {HIGH}] after {WINDOWS} windows: "
                + _describe(profile, ratios))


def test_measured_shortcut_is_not_what_was_tested(outcome):
    """Guard: on a local profile times="model" takes measured times, so the test above must use "roofline"."""
    profile, measured, _ = outcome
    layer = measured["linear_2048"][0]
    timed = Layer(**{**layer.__dict__, "fwd_s": 123.0, "bwd_s": 456.0})
    graph = Graph(name="g", layers=[timed], edges=[], batch_size=1, source={"device": "cpu"})
    assert compute.layer_times_s(graph, profile, times="model") == ([123.0], [456.0])
    assert compute.layer_times_s(graph, profile, times="roofline")[0][0] < 1.0
