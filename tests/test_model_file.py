"""Loading model.py: what a good file gives, and one clear UserError per kind of bad file."""

import textwrap

import pytest
import torch

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.errors import UserError

GOOD = """
import torch, torch.nn as nn
def build_model():
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh())
def build_other():
    return nn.Linear(4, 2)
def example_inputs(batch_size):
    return (torch.ones(batch_size, 4),)
"""


def write(tmp_path, text, name="model.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_good_file_builds_and_falls_back_to_sum_loss(tmp_path):
    spec = load_model_file(str(write(tmp_path, GOOD)))
    assert spec.path == str((tmp_path / "model.py").resolve())
    model = spec.build()
    (x,) = spec.example_inputs(5)
    assert x.shape == (5, 4)
    assert spec.example_target(5) is None and spec.train_batches() is None
    out = model(x)
    # no loss_fn: the loss is the sum of the output, so d loss / d out == 1 everywhere
    loss = spec.loss(out, None)
    assert torch.allclose(loss, out.sum())
    assert isinstance(load_model_file(str(tmp_path / "model.py"), "build_other").build(), torch.nn.Linear)


def test_loss_fn_and_dict_outputs(tmp_path):
    p = write(tmp_path, GOOD + textwrap.dedent("""
        def example_target(b):
            return torch.zeros(b, 3)
        def loss_fn(out, target):
            return ((out - target) ** 2).mean()
    """))
    spec = load_model_file(str(p))
    out = torch.tensor([[1.0, 2.0, 3.0]])
    assert spec.loss(out, spec.example_target(1)).item() == pytest.approx(14 / 3)
    # without a target the fallback sums every floating tensor of a dict / tuple output
    spec2 = load_model_file(str(write(tmp_path, GOOD, "m2.py")))
    a = torch.ones(2, requires_grad=True)
    b = torch.full((3,), 2.0, requires_grad=True)
    assert spec2.loss({"logits": a, "aux": (b, torch.arange(3))}, None).item() == pytest.approx(8.0)


@pytest.mark.parametrize(
    "text, entry, message",
    [
        (None, "build_model", "no such model file"),
        ("def build_model(:\n    pass\n", "build_model", "syntax error at line 1"),
        (GOOD, "build_missing", "no function build_missing"),
        ("import torch\ndef example_inputs(b):\n    return (torch.ones(b),)\n", "build_model", "no function build_model"),
        ("import torch\ndef build_model():\n    return 1\n", "build_model", "no function example_inputs"),
        ("raise RuntimeError('boom at import')\n", "build_model", "importing the model file raised RuntimeError: boom at import (line 1)"),
    ],
)
def test_bad_files_name_file_and_cause(tmp_path, text, entry, message):
    path = tmp_path / "model.py" if text is None else write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_model_file(str(path), entry)
    assert str(path.resolve()) in str(err.value)
    assert message in str(err.value)
    assert err.value.hint


def test_errors_inside_user_functions(tmp_path):
    p = write(tmp_path, """
        import torch
        def build_model():
            raise ValueError("no weights here")
        def build_int():
            return 3
        def example_inputs(b):
            return "not a tuple"
    """)
    with pytest.raises(UserError, match=r"build_model\(\) raised ValueError: no weights here \(line 4\)"):
        load_model_file(str(p)).build()
    with pytest.raises(UserError, match=r"build_int\(\) returned int, not a torch.nn.Module"):
        load_model_file(str(p), "build_int").build()
    with pytest.raises(UserError, match=r"example_inputs\(2\) returned str"):
        load_model_file(str(p), "build_int").example_inputs(2)


INITIALISED = """
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 50, bias=False)
        self.proj.weight = self.emb.weight  # tied
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3)
        nn.init.trunc_normal_(self.conv.weight, std=0.02)
        self.extra = nn.Parameter(torch.empty(3, 3, dtype=torch.float64))
        self.extra.data.normal_()  # as Hugging Face's _init_weights does
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
def build_model():
    return Net()
def example_inputs(batch_size):
    return (torch.zeros(batch_size, 4, dtype=torch.long),)
"""


def test_a_build_on_meta_runs_no_initialiser_and_keeps_every_shape_dtype_and_tie(tmp_path, monkeypatch):
    """On meta an initialiser has no values to fill, yet torch's Python reference for a random fill imports
    torch._dynamo (~2 s before every `pipeplan run`, which sizes the model on meta): build_on_meta skips them
    (costmodels/meta_init.py), and the model is the real build's in everything but values."""
    import subprocess
    import sys

    import torch.nn.init as init

    path = write(tmp_path, INITIALISED)
    spec = load_model_file(str(path))
    real = spec.build()
    calls = []
    for name in ("_no_grad_normal_", "_no_grad_uniform_"):
        original = getattr(init, name)
        monkeypatch.setattr(init, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    meta = spec.build_on_meta()
    assert calls == []
    assert meta.proj.weight is meta.emb.weight
    shapes = {n: (t.shape, t.dtype, t.device.type) for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    assert shapes == {n: (t.shape, t.dtype, "meta") for n, t in [*real.named_parameters(), *real.named_buffers()]}
    with torch.device("meta"):  # without the skip the same initialisers do run (on nothing)
        spec.build()
    assert set(calls) == {"_no_grad_normal_", "_no_grad_uniform_"}  # the embedding's, the convolution's bias
    monkeypatch.undo()
    real_again = spec.build()  # and a real build still initialises
    assert real_again.emb.weight.std() > 0.5 and real_again.extra.abs().sum() > 0
    code = ("import sys; from pipeplan.costmodels.model_file import load_model_file; "
            f"load_model_file({str(path)!r}).build_on_meta(); print('torch._dynamo' in sys.modules)")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert fresh.stdout.strip() == "False", fresh.stderr[-2000:]
