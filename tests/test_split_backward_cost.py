"""Zero bubble's split backward costs more than a whole backward (costmodels/split_backward.py): torch's graph walk
and one autograd call per parameter group (measured by calibrate), and each parameter's gradient reduction
reading the output gradient back from memory."""

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeplan.costmodels.graph import Layer
from pipeplan.costmodels.split_backward import cold_gradient_bytes, split_backward_extra_s
from pipeplan.costmodels.trace import trace
from pipeplan.hardware_profiles import load_profile, split_backward_overhead
from pipeplan.planner.predict import evaluate

HERE = Path(__file__).resolve().parent


def test_cold_bytes_count_each_parameter_tensor_up_to_weight_and_bias():
    linear = Layer(name="fc", output_bytes=1000, params=["fc.weight", "fc.bias"], param_bytes=8)
    no_bias = Layer(name="conv", output_bytes=300, params=["conv.weight"], param_bytes=4)
    three = Layer(name="x", output_bytes=10, params=["x.a", "x.b", "x.c"], param_bytes=12)  # capped at two
    analytic = Layer(name="a", output_bytes=7, param_bytes=4)  # parameter bytes, no names: one tensor
    glue = Layer(name="relu", output_bytes=5000)  # no parameters: no reduction in W
    assert cold_gradient_bytes([linear, no_bias, three, analytic, glue]) == 2000 + 300 + 20 + 7
    # 4 parameter groups (fc, conv, x, the unnamed one): per split + per group + bytes at the bandwidth
    extra = split_backward_extra_s([linear, no_bias, three, analytic, glue], per_split_s=1e-4, per_group_s=5e-5,
                                   mem_bw_bytes_per_s=1e9)
    assert extra == pytest.approx(1e-4 + 4 * 5e-5 + 2327 / 1e9)


def test_calibrates_fit_gives_back_its_line(monkeypatch):
    monkeypatch.setattr(split_backward_overhead, "_extra_s", lambda pairs: 2e-4 + 6e-5 * pairs)
    assert split_backward_overhead.split_backward_overhead_s() == pytest.approx((2e-4, 6e-5))
    monkeypatch.setattr(split_backward_overhead, "_extra_s", lambda pairs: 1e-3 - 1e-6 * pairs)  # noise: never < 0
    per_split, per_group = split_backward_overhead.split_backward_overhead_s()
    assert per_group == 0.0 and per_split == pytest.approx(1e-3 - 1e-6 * 14.5)


def test_torch_makes_one_group_per_linear_of_calibrates_stage():
    """The count the fit divides by: torch's own `get_param_groups` on the calibration's stage."""
    from torch.distributed.pipelining._backward import stage_backward_input

    model = torch.nn.Sequential(*[m for _ in range(5) for m in (torch.nn.Linear(8, 8), torch.nn.ReLU())])
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    assert len(groups) == 5


def test_calibrated_overhead_predicts_a_stage_it_was_not_fitted_on():
    """Measured on this machine: a stage of 24 tiny pairs (the fit used 2, 8, 16 and 32) costs what the line says
    beyond its whole backward, within a factor of two (the machine's speed drifts; the terms are ~50 µs a group)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_split, per_group = split_backward_overhead.split_backward_overhead_s()
        measured = split_backward_overhead._extra_s(24)
    finally:
        torch.set_num_threads(threads)
    assert 0.5 < (per_split + 24 * per_group) / measured < 2.0, (per_split, per_group, measured)


@pytest.fixture(scope="module")
def graph():
    return trace(str(HERE / "recompute_model_tail.py"), 8, repeats=2, fvcore_check=False)


def test_a_split_backward_costs_its_extra_on_every_stage_but_the_first(graph):
    """ZB-H1 against 1F1B on the same split: stage 1's backward (and its W) grows by the formula's extra, stage 0,
    whose W torch runs as one whole backward, by nothing."""
    base = load_profile("a100-80gb")
    prof = dataclasses.replace(base, split_backward_s=1e-4, split_backward_group_s=5e-5)
    split = [0, 0, 0, 0, 1, 1, 1, 1]
    kw = dict(microbatches=2, batch_size=16, times="measured")
    whole, zb = evaluate(graph, prof, split, schedule="1f1b", **kw), evaluate(graph, prof, split, schedule="zb-h1", **kw)
    extra = split_backward_extra_s(graph.layers[4:], per_split_s=1e-4, per_group_s=5e-5,
                                   mem_bw_bytes_per_s=prof.mem_bw_bytes_per_s)
    assert extra > 1e-4
    assert zb.stages[0].predicted.bwd_s == pytest.approx(whole.stages[0].predicted.bwd_s)
    assert zb.stages[1].predicted.bwd_s - whole.stages[1].predicted.bwd_s == pytest.approx(extra)
    plain = evaluate(graph, base, split, schedule="zb-h1", **kw)  # no host terms: the cold bytes alone
    # stage 1 holds one module with parameters (its Linear(32, 4)): one group
    assert zb.stages[1].predicted.wgrad_s - plain.stages[1].predicted.wgrad_s == pytest.approx(1e-4 + 5e-5)
