"""A model whose weights cannot fit this machine's free RAM is refused before it is built for real.

Why: past the RAM, Linux's OOM killer ends the process (exit 137, no message) rather than torch raising an
error pipeplan can turn into one; `pipeplan trace examples/llama-3-70b.json` was killed that way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.costmodels import model_file
from pipeplan.costmodels.model_file import OutOfMemory, available_ram_bytes
from pipeplan.costmodels.trace import trace

ROOT = Path(__file__).resolve().parents[1]

WIDE = """import torch
def build_model():  # 8192 x 8192 + 8192 weights and as many gradients: 0.50 GiB
    return torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.ReLU())
def example_inputs(batch_size):
    return (torch.randn(batch_size, 8192),)
"""

# 10^12 parameters: no machine this runs on has 8 TB free, and on the meta device it costs nothing
TERA = """import torch
def build_model():
    return torch.nn.Linear(1_000_000, 1_000_000)
def example_inputs(batch_size):
    return (torch.randn(batch_size, 1_000_000),)
"""


def test_available_ram_is_at_most_the_machines():
    free = available_ram_bytes()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    import os

    assert 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_model_whose_weights_and_gradients_exceed_the_free_ram_is_refused_before_it_is_built(tmp_path, monkeypatch):
    path = tmp_path / "wide.py"
    path.write_text(WIDE)
    need = 2 * (8192 * 8192 + 8192) * 4  # fp32 weights and their gradients
    monkeypatch.setattr(model_file, "available_ram_bytes", lambda: need - 1)
    with pytest.raises(OutOfMemory) as err:
        trace(str(path), 1, fvcore_check=False)
    assert f"need {need / 2**30:,.2f} GiB" in err.value.message
    assert "--no-times" in err.value.hint
    monkeypatch.setattr(model_file, "available_ram_bytes", lambda: need)
    assert trace(str(path), 1, fvcore_check=False, repeats=1).param_bytes == need // 2  # just enough: built


def test_trace_of_a_model_too_big_for_any_ram_exits_2_with_one_line(tmp_path):
    path = tmp_path / "tera.py"
    path.write_text(TERA)
    r = subprocess.run([sys.executable, "-m", "pipeplan", "trace", str(path), "-b", "1", "-o", str(tmp_path / "g.json")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "too big for this machine's RAM" in r.stderr
    assert "need 7,450.59 GiB" in r.stderr  # 2 x (10^12 + 10^6) x 4 bytes
    assert not (tmp_path / "g.json").exists()
    r = subprocess.run([sys.executable, "-m", "pipeplan", "trace", str(path), "--no-times", "-b", "1", "-o",
                        str(tmp_path / "g.json"), "--no-fvcore-check"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]  # without weights it traces


def test_run_refuses_a_plan_whose_processes_cannot_all_build_the_model(tmp_path, monkeypatch):
    """`pipeplan run` starts one process per device of this node and each builds the whole model before it keeps
    its stages: per_node copies of the weights must fit the free RAM, checked before torchrun starts."""
    from pipeplan.errors import UserError
    from pipeplan.runtime.launch import check_builds_fit
    from runtime_helpers import hand_plan

    path = tmp_path / "wide.py"
    path.write_text(WIDE)
    plan = hand_plan(str(path), stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=2)
    weights = (8192 * 8192 + 8192) * 4
    monkeypatch.setattr(model_file, "available_ram_bytes", lambda: 2 * weights - 1)
    with pytest.raises(UserError) as err:
        check_builds_fit(plan, per_node=2)
    assert f"({weights / 2**30:,.2f} GiB)" in err.value.message and "--nnodes" in err.value.hint
    check_builds_fit(plan, per_node=1)  # one copy fits
    monkeypatch.setattr(model_file, "available_ram_bytes", lambda: 2 * weights)
    check_builds_fit(plan, per_node=2)
