"""`pipeplan trace`: the file it writes, --json, and one line + exit 2 for every kind of bad model file."""

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeplan.cli.main import cli
from pipeplan.costmodels.graph import load_graph

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAST = ["--repeats", "1", "--no-fvcore-check", "--batch-size", "4"]


def run(*args):
    return CliRunner().invoke(cli, list(args))


def error_lines(result):
    return [line for line in result.output.splitlines() if line.startswith("error:")]


def test_trace_writes_graph_and_prints_summary(tmp_path):
    out = tmp_path / "graph.json"
    result = run("trace", str(EXAMPLES / "mlp.py"), "-o", str(out), *FAST)
    assert result.exit_code == 0, result.output
    g = load_graph(out)
    assert g.batch_size == 4 and len(g.layers) == 13
    assert "heaviest" in result.output and "parameters" in result.output
    assert g.layer("0").param_bytes == (256 * 2048 + 2048) * 4


def test_json_prints_one_document(tmp_path):
    out = tmp_path / "g.json"
    chatty = tmp_path / "chatty.py"  # a model file that prints must not spoil stdout
    chatty.write_text("print('building!')\n" + (EXAMPLES / "mlp.py").read_text())
    result = CliRunner().invoke(cli, ["trace", str(chatty), "-o", str(out), "--json", *FAST])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # stdout holds the document and nothing else
    assert doc["format"] == "pipeplan.graph/v1"
    assert doc == json.loads(out.read_text())


BAD = {
    "syntax": ("def build_model(:\n", [], "syntax error at line 1"),
    "no_builder": ("import torch\ndef example_inputs(b):\n    return (torch.ones(b, 2),)\n", [],
                   "no function build_model"),
    "no_entry": ("import torch, torch.nn as nn\ndef build_model():\n    return nn.Linear(2, 2)\n"
                 "def example_inputs(b):\n    return (torch.ones(b, 2),)\n", ["--entry", "build_big"],
                 "no function build_big"),
    "raises": ("import torch\ndef build_model():\n    raise RuntimeError('weights missing')\n"
               "def example_inputs(b):\n    return (torch.ones(b, 2),)\n", [],
               "build_model() raised RuntimeError: weights missing (line 3)"),
    "forward_raises": ("""
        import torch, torch.nn as nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(2, 3)
            def forward(self, x):
                return self.l(x) @ torch.ones(4, 4)
        def build_model():
            return M()
        def example_inputs(b):
            return (torch.ones(b, 2),)
    """, [], "torch.export could not trace build_model() in model.py (line 8)"),
    "data_dependent": ("""
        import torch, torch.nn as nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(2, 2)
            def forward(self, x):
                y = self.l(x)
                if y.sum() > 0:
                    return y * 2
                return y
        def build_model():
            return M()
        def example_inputs(b):
            return (torch.ones(b, 2),)
    """, [], "data-dependent control flow"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_model_files_exit_2_with_one_line(tmp_path, case):
    text, extra, message = BAD[case]
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(text))
    out = tmp_path / "graph.json"
    result = run("trace", str(model), "-o", str(out), *FAST, *extra)
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1, result.output
    assert str(model) in lines[0] and message in lines[0]
    assert "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [model]  # nothing written, not even a temp file


def test_missing_file_and_bad_output_folder(tmp_path):
    result = run("trace", str(tmp_path / "nope.py"), "-o", str(tmp_path / "g.json"))
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {tmp_path / 'nope.py'}: no such model file (check the path to model.py)"]
    result = run("trace", str(EXAMPLES / "mlp.py"), "-o", str(tmp_path / "no" / "g.json"))
    assert result.exit_code == 2 and "does not exist" in error_lines(result)[0]


def test_debug_shows_the_traceback(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(BAD["raises"][0]))
    result = run("--debug", "trace", str(model), "-o", str(tmp_path / "g.json"), *FAST)
    assert result.exit_code != 0
    assert result.exc_info is not None and "weights missing" in str(result.exc_info[1])


def test_frozen_model_is_a_user_error(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build_model():
            m = nn.Linear(2, 2)
            m.requires_grad_(False)
            return m
        def example_inputs(b):
            return (torch.ones(b, 2),)
        def example_target(b):
            return torch.zeros(b, 2)
        def loss_fn(out, target):
            return ((out - target) ** 2).mean()
    """))
    result = run("trace", str(model), "-o", str(tmp_path / "g.json"), *FAST)
    assert result.exit_code == 2, result.output
    assert "does not depend on any parameter that requires a gradient" in error_lines(result)[0]
