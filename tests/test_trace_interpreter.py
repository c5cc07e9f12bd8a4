"""The tracer times layers node by node through torch.fx.Interpreter; the runtime runs compiled GraphModules.

On models of small ops the interpreter's Python time per node was most of a layer's measured forward (a 32x32
U-Net's layers summed to 1.95 ms where `pipeplan run`'s stage took 0.87 ms), so costmodels/measure.py times the
compiled program too and takes the excess out per node. Checked against the model's own eager forward, timed
here independently."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pytest
import torch

from timing_pairs import ratios_until_within

HERE = Path(__file__).resolve().parent

MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(16, 16), nn.ReLU())])

def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def _eager_forward_s(model: torch.nn.Module, x: torch.Tensor, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(x).sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_small_op_forward_times_are_the_compiled_programs_not_the_interpreters(tmp_path, monkeypatch):
    """The same model traced with and without the correction, back to back (so under the same machine load),
    and against its own eager forward timed here: the correction removes most of the forward's time."""
    import pipeplan.costmodels.measure as measure
    from pipeplan.costmodels.model_file import load_model_file
    from pipeplan.costmodels.trace import trace

    path = tmp_path / "tiny_ops.py"
    path.write_text(MODEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = load_model_file(str(path))
        eager = _eager_forward_s(spec.build(), spec.example_inputs(4)[0])
        corrected, interpreted = [], []
        for _ in range(3):  # pairs back to back, the least of each as the tracer's own repeats do, until they hold
            # (with 2 pairs always, one interpreted trace that ran fast under load once brought the ratio to 0.91)
            corrected.append(sum(layer.fwd_s for layer in trace(str(path), 4, repeats=5).layers))
            with monkeypatch.context() as m:
                m.setattr(measure, "_compiled_forward", lambda ep, spec, args, target, fwd, *rest: (fwd, 0.0))
                interpreted.append(sum(layer.fwd_s for layer in trace(str(path), 4, repeats=5).layers))
            if _corrected_holds(min(corrected), min(interpreted), eager):
                break
    finally:
        torch.set_num_threads(threads)
    c, i = min(corrected), min(interpreted)
    # 80 ops of a few µs each: node by node the interpreter's time per node was 30-45% of the forward
    # (0.55-0.70 corrected/interpreted here and on CI's machine under load)
    assert c < 0.85 * i, (corrected, interpreted)
    # and what is left is nearer the model's own eager forward than the interpreted times were
    assert abs(math.log(c / eager)) < abs(math.log(i / eager)), (c, i, eager)
    assert 0.3 * eager < c < 3.0 * eager, (c, eager)


def _corrected_holds(c: float, i: float, eager: float) -> bool:
    """The test's three checks on the corrected (c) and interpreted (i) forward sums and the eager forward."""
    return c < 0.85 * i and abs(math.log(c / eager)) < abs(math.log(i / eager)) and 0.3 * eager < c < 3.0 * eager


def test_the_interpreters_excess_comes_out_per_node_never_below_a_proportional_share(monkeypatch):
    """costmodels.measure._compiled_forward on a clock that reads what the test says: layers of 3, 1 and 2 ms
    with 4, 1 and 1 nodes, the compiled program 3 ms: 3 ms of excess over 6 nodes, 0.5 ms a node. Less their
    nodes' share the layers would keep 1, 0.5 and 1.5 ms; none goes below its proportional share 3/6 of what
    it measured (1.5, 0.5, 1.0 ms), so the first keeps 1.5."""
    import pipeplan.costmodels.measure as measure

    clock = iter(t * 1e-3 for _ in range(10) for t in (0.0, 3.0))
    monkeypatch.setattr(measure, "_forward_only", lambda *a: None)
    marks = measure.Marks(lambda: next(clock))
    layer_of = {"a1": 0, "a2": 0, "a3": 0, "a4": 0, "b": 1, "c": 2}
    fwd, per_node = measure._compiled_forward(None, None, [], None, [3e-3, 1e-3, 2e-3], layer_of, 3, marks)
    assert per_node == pytest.approx(0.5e-3)
    assert fwd == pytest.approx([1.5e-3, 0.5e-3, 1.5e-3])


def test_the_collector_runs_once_before_the_timed_steps_and_never_between_them(monkeypatch):
    """A collection before every step left the step's caches cold (costmodels.measure._collector_off); one
    before the warm-up, with the collector off until the last step, is what the tracer does now."""
    import gc

    import pipeplan.costmodels.measure as measure
    from pipeplan.costmodels.trace import trace

    events: list[str] = []
    real_one_step = measure._one_step
    monkeypatch.setattr(measure.gc, "collect", lambda *a: events.append("collect") or 0)
    monkeypatch.setattr(measure, "_one_step", lambda *a, **k: events.append(f"step, gc {gc.isenabled()}")
                        or real_one_step(*a, **k))
    trace(str(HERE / "runtime_model_unet.py"), 8, repeats=3)
    steps = [e for e in events if e.startswith("step")]
    assert len(steps) == 4 and set(steps) == {"step, gc False"}  # the warm-up step and 3 timed ones
    first = events.index(steps[0])
    assert events[first - 1] == "collect" and events[first:first + 4] == steps  # no collection between them
    assert gc.isenabled()


def test_a_tiny_models_traced_step_is_its_eager_step():
    """tests/runtime_model_unet.py at batch 64 (15 ops of ~10-90 µs): its traced forward + backward summed 1.6x
    its eager step here while the tracer collected garbage before every timed step; now within 40% (30% failed
    once in five CI runs at 1.305: a ~1.5 ms step on a shared 2-core host). The eager step is timed in this
    process right after each trace, as a pair, until a pair holds (tests/timing_pairs.py: one median of 200 steps
    read 4.8 ms against a 2.9 ms trace in CI on a host running ~1.6x slower, and a trace taken before a host's
    slowdown read 1.41x its eager step, 2026-11-30; alone both passed)."""
    from pipeplan.costmodels.model_file import load_model_file
    from pipeplan.costmodels.trace import trace

    spec = load_model_file(str(HERE / "runtime_model_unet.py"))
    model, x, target = spec.build(), spec.example_inputs(64)[0], spec.example_target(64)

    def pair() -> tuple[float, float]:
        traced = sum(x.fwd_s + x.bwd_s for x in trace(str(HERE / "runtime_model_unet.py"), 64, repeats=10).layers)
        steps = []
        for _ in range(100):
            t0 = time.perf_counter()
            spec.loss(model(x), target).backward()
            steps.append(time.perf_counter() - t0)
        return traced, statistics.median(steps)

    def within(ratio: float) -> bool:
        return 0.7 < ratio < 1.4

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratios = ratios_until_within(pair, within)
    finally:
        torch.set_num_threads(threads)
    assert within(ratios[-1]), ratios


def test_an_instruments_excess_comes_out_per_item_and_a_cuda_trace_takes_its_hooks_out(monkeypatch):
    """costmodels.measure.take_out_excess, the rule both corrections use, by hand: layers of 0.5, 1.0 and 0.1 ms
    with 1, 4 and 0 hooks against a 1 ms plain pass: 0.6 ms of excess over 5 hooks, 0.12 ms a hook. Less their
    hooks the layers would keep 0.38, 0.52 and 0.1; the floor is each one's share 1/1.6 of what it measured
    (0.3125, 0.625, 0.0625), so the second keeps 0.625. No excess: nothing changes.
    Then `_unhooked_backward` on a clock that reads 1 ms per backward: the same numbers come back."""
    import pipeplan.costmodels.measure as measure

    times, per = measure.take_out_excess([0.5e-3, 1.0e-3, 0.1e-3], [1, 4, 0], 1e-3)
    assert per == pytest.approx(0.12e-3)
    assert times == pytest.approx([0.38e-3, 0.625e-3, 0.1e-3])
    assert measure.take_out_excess([0.5e-3, 0.4e-3], [3, 3], 1e-3) == ([0.5e-3, 0.4e-3], 0.0)

    clock = iter(t * 1e-3 for _ in range(5) for t in (0.0, 1.0))

    class Loss:
        def backward(self) -> None:
            return None

    class Program:
        def graph_module(self, *args):
            return None

    class Spec:
        def loss(self, out, target):
            return Loss()

    monkeypatch.setattr(measure, "user_output", lambda ep, out: out)
    marks = measure.Marks(lambda: next(clock))
    got = measure._unhooked_backward(Program(), Spec(), [], None, [0.5e-3, 1.0e-3, 0.1e-3], [1, 4, 0], 3, marks)
    assert got[0] == pytest.approx([0.38e-3, 0.625e-3, 0.1e-3]) and got[1] == pytest.approx(0.12e-3)
