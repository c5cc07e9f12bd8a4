"""The tracer's pluggable clock (costmodels/measure.py) and the --device plumbing, on the CPU (CI has no GPU).

A fake deferred clock stands in for CUDA events: its marks have no time until `wait()`,
so a per-layer total read before the end of the step would fail. Expected totals are
counted independently (nodes per layer from the graph), not read back from the ledger.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils import _pytree as pytree

from pipeplan.cli.main import cli
from pipeplan.costmodels import measure
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure, resolve_device
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")


def test_cpu_marks_give_the_same_sums_as_reading_the_clock_inline():
    readings = [0.5, 0.75, 1.125, 2.0, 2.0625, 3.5]
    inline = [0.0, 0.0]
    it = iter(readings)
    last = next(it)
    for i, now in enumerate(it):  # the pre-change code: acc[layer] += now - last
        inline[i % 2] += now - last
        last = now
    clock = iter(readings)
    marks = measure.Marks(lambda: next(clock))
    ledger = measure.Ledger(marks, 2)
    prev = marks.mark()
    for i in range(len(readings) - 1):
        now = marks.mark()
        ledger.charge(i % 2, prev, now)
        prev = now
    assert ledger.totals() == inline  # exactly: the same float additions in the same order


class _Tick:
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


class FakeEvents(measure.Marks):
    """Deferred marks like CUDA events: each mark is one tick later, readable only after wait()."""

    def __init__(self) -> None:
        super().__init__(lambda: 0.0)
        self.counter = itertools.count()
        self.waited = False
        self.waits = 0

    def mark(self) -> _Tick:
        self.waited = False
        return _Tick(next(self.counter))

    def elapsed_s(self, a: _Tick, b: _Tick) -> float:
        assert self.waited, "an interval was read before the step's synchronize"
        return float(b.n - a.n)

    def wait(self) -> None:
        self.waited = True
        self.waits += 1


def test_deferred_marks_charge_each_layer_its_own_nodes_and_wait_once_per_ledger():
    spec = load_model_file(str(ROOT / "examples" / "mlp.py"), "build_model")
    model = spec.build()
    inputs, target = spec.example_inputs(4), spec.example_target(4)
    ep, graph = export_structure(spec, 4, model=model, inputs=inputs)
    layer_of = {n: i for i, layer in enumerate(graph.layers) for n in layer.nodes}
    n = len(graph.layers)
    args = measure.program_args(ep, model, list(pytree.tree_leaves(inputs)))
    marks = FakeEvents()
    fwd, bwd, step, b, hooks = measure._one_step(ep, model, spec, args, target, layer_of, n, marks)
    # Forward: one tick per node of a layer (a mark before and after it), plus the loss's tick on the last layer.
    nodes = [sum(1 for node in ep.graph.nodes if layer_of.get(node.name) == i) for i in range(n)]
    expected = [float(c) for c in nodes]
    expected[-1] += 1.0
    assert fwd == expected
    assert all(b >= 0 for b in bwd) and sum(bwd) > 0
    # Backward: one tick per hooked autograd node (each hook marks once) between the pass's first and last marks,
    # so the hook counts `_unhooked_backward` spreads a CUDA trace's excess over are the marks that cost it.
    assert sum(bwd) == sum(hooks) + 1 and all(h >= 1 for h in hooks)
    assert all(x >= 0 for x in b) and 0 < sum(b) < sum(bwd)  # B alone runs fewer nodes than the full backward
    assert marks.waits == 3  # the forward ledger, the input-gradient one and the backward one, each once
    assert step == pytest.approx(sum(fwd) + sum(bwd) + 2 * n + 3, abs=4 * n + 8)  # every mark lies inside the step, B's pass left out
    for p in model.parameters():
        p.grad = None


def test_marks_for_a_cpu_device_are_perf_counter_marks():
    m = measure.marks_for(torch.device("cpu"))
    assert type(m) is measure.Marks
    a = m.mark()
    assert m.elapsed_s(a, a + 0.25) == 0.25


@no_gpu
def test_device_cuda_without_a_gpu_is_a_user_error_exit_2(tmp_path):
    for args in (["trace", str(ROOT / "examples" / "mlp.py"), "--device", "cuda", "-o", str(tmp_path / "g.json")],
                 ["profiles", "calibrate", "--device", "cuda", "-o", str(tmp_path / "p.yaml")]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, r.output
        assert "--device cuda" in r.output and "no CUDA GPU" in r.output
        assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "g.json").exists() and not (tmp_path / "p.yaml").exists()


def test_auto_device_follows_the_gpu_and_the_profile(monkeypatch):
    cpu_local = load_profile("h100-sxm")
    from dataclasses import replace

    cpu_local = replace(cpu_local, local=True, calibration={"threads_per_device": 1})
    gpu_local = replace(cpu_local, calibration={"device_type": "cuda"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(UserError):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("auto", load_profile("h100-sxm")) == "cuda"
    assert resolve_device("auto", cpu_local) == "cpu"  # a calibrated CPU profile's device is one core
    assert resolve_device("auto", gpu_local) == "cuda"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(UserError):
        resolve_device("tpu")
