"""Grouping corner cases on small hand-written models: reused modules, root code, unused parameters."""

import textwrap

import pytest

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure, trace

REUSED = """
import torch, torch.nn as nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)      # called twice: one weight, two layers
        self.mid = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.ones(16, 4))   # used by root code (a matmul in M.forward)
        self.unused = nn.Linear(3, 3)        # never called

    def forward(self, x):
        h = self.shared(self.inp(x))
        h = self.shared(self.mid(h)) + h     # root code next to a matmul: part of the `root` layer
        return h @ self.scale

def build_model():
    return M()

def example_inputs(b):
    return (torch.randn(b, 8),)
"""


@pytest.fixture
def reused(tmp_path):
    p = tmp_path / "reused.py"
    p.write_text(textwrap.dedent(REUSED))
    return str(p)


def test_reused_module_root_code_and_unused_params(reused):
    spec = load_model_file(reused)
    _, g = export_structure(spec, 3)
    assert [l.name for l in g.layers] == ["inp", "shared", "mid", "shared:2", "root"]
    assert g.layer("root").kind == "matmul" and g.layer("root").params == ["scale"]
    # the reused Linear's weight is charged once (first call), and the sharing is recorded
    shared = {s.name: s.layers for s in g.shared_params}
    assert shared == {"shared.weight": ["shared", "shared:2"], "shared.bias": ["shared", "shared:2"]}
    assert g.layer("shared").param_bytes == (16 * 16 + 16) * 4
    assert g.layer("shared:2").param_bytes == 0
    # the unused Linear still takes memory: it is charged to some layer and noted
    model = spec.build()
    assert g.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert any("not used by forward()" in n and "unused.weight" in n for n in g.notes)
    # the residual `h` (output of the first `shared` call) is read three layers later, by root's add
    assert {(e.src, e.dst) for e in g.edges} == {("inp", "shared"), ("shared", "mid"), ("shared", "root"),
                                                 ("mid", "shared:2"), ("shared:2", "root")}
    # after `shared` only h crosses; after `mid`, h (still live for the add) and mid's output
    assert g.cut_bytes()[1:3] == [3 * 16 * 4, 2 * 3 * 16 * 4]
    assert g.layer("shared").outputs == {g.layer("shared").nodes[-1]: 3 * 16 * 4}
    # bytes_moved of one unfused Linear: read x and the weights, write y
    assert g.layer("inp").bytes_moved == (3 * 8 + 16 * 8 + 16 + 3 * 16) * 4


def test_measured_trace_on_reused_model(reused):
    g = trace(reused, 4, repeats=1, fvcore_check=False)
    # FLOPs by hand: 2*b*(8*16 + 16*16 + 16*16 + 16*4) forward; the reused Linear counted on each call
    assert g.fwd_flops == 2 * 4 * (8 * 16 + 16 * 16 + 16 * 16 + 16 * 4)
    assert g.layer("shared").fwd_flops == g.layer("shared:2").fwd_flops == 2 * 4 * 16 * 16
    # backward of a Linear whose input needs a gradient is 2x forward; the first Linear's input does not
    assert g.layer("inp").bwd_flops == g.layer("inp").fwd_flops
    assert g.layer("shared").bwd_flops == 2 * g.layer("shared").fwd_flops


def test_depth_must_be_positive(reused):
    from pipeplan.errors import UserError

    with pytest.raises(UserError, match="--depth 0"):
        export_structure(load_model_file(reused), 2, depth=0)


def test_real_tensor_counting_matches_fake_tensor_counting(reused):
    """The fallback for ops without fake-tensor support must count exactly what the fake pass counts."""
    from pipeplan.costmodels import measure

    spec = load_model_file(reused)
    model = spec.build()
    ep, g = export_structure(spec, 4, model=model)
    layer_of = {n: i for i, l in enumerate(g.layers) for n in l.nodes}
    inputs = spec.example_inputs(4)
    fake = measure.count_pass(ep, model, spec, inputs, None, layer_of, len(g.layers))
    real = measure.count_pass(ep, model, spec, inputs, None, layer_of, len(g.layers), fake_tensors=False)
    assert (fake.fwd_flops, fake.bwd_flops, fake.saved_bytes) == (real.fwd_flops, real.bwd_flops, real.saved_bytes)
    assert sum(fake.fwd_flops) > 0 and sum(fake.saved_bytes) > 0
    assert all(p.grad is None for p in model.parameters())


def test_layer_times_add_up_to_the_measured_step():
    """Per-layer forward and backward times cover the whole step: nothing big falls between layers."""
    from pathlib import Path

    from pipeplan.costmodels import measure

    spec = load_model_file(str(Path(__file__).resolve().parents[1] / "examples" / "mlp.py"))
    model = spec.build()
    ep, g = export_structure(spec, 32, model=model)
    layer_of = {n: i for i, l in enumerate(g.layers) for n in l.nodes}
    t = measure.time_pass(ep, model, spec, spec.example_inputs(32), spec.example_target(32), layer_of,
                          len(g.layers), repeats=3)
    layers_s = sum(t.fwd_s) + sum(t.bwd_s)
    assert t.repeats == 3 and len(t.step_s) == 3
    assert 0.6 * min(t.step_s) <= layers_s <= 1.2 * max(t.step_s)
    assert sum(t.bwd_s) > 0 and sum(t.fwd_s) > 0
