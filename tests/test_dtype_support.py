"""A 16-bit timing that fails: the user's model in that dtype (exit 2, one line) or pipeplan's own run (internal).

costmodels/dtype_support.py tells them apart by the model's own eager step under the same autocast.
"""

from __future__ import annotations

import pytest
import torch

from pipeplan.costmodels import measure
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import trace
from pipeplan.errors import UserError
from runtime_helpers import REPO, run_cli

LSTM = REPO / "tests" / "data" / "lstm_lm.py"


def _eager_lstm_fails(dtype: torch.dtype = torch.float16) -> bool:
    """torch's own answer, independent of pipeplan: one autocast step of the model in `dtype` on this CPU (oneDNN's
    LSTM refuses fp16 on most CPUs, and bf16 on some: an AVX2-only AMD EPYC refuses both)."""
    spec = load_model_file(str(LSTM))
    model = spec.build()
    try:
        with torch.autocast("cpu", dtype=dtype):
            loss = spec.loss(model(*spec.example_inputs(2)), spec.example_target(2))
        loss.backward()
    except RuntimeError:
        return True
    return False


def test_a_model_torch_cannot_train_in_fp16_here_is_a_user_error(tmp_path):
    if not _eager_lstm_fails():
        pytest.skip("this CPU trains an LSTM in fp16")
    with pytest.raises(UserError, match=r"does not train in fp16 on this CPU: torch fails on it under autocast"):
        trace(str(LSTM), 2, dtype="fp16", repeats=1, fvcore_check=False)
    out = tmp_path / "graph.json"
    r = run_cli("trace", str(LSTM), "-b", "2", "--dtype", "fp16", "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr and not out.exists()
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1 and "--dtype" in r.stderr
    if _eager_lstm_fails(torch.bfloat16):  # the same answer for bf16 where torch gives it
        with pytest.raises(UserError, match=r"does not train in bf16 on this CPU"):
            trace(str(LSTM), 2, dtype="bf16", repeats=1, fvcore_check=False)
    else:
        assert trace(str(LSTM), 2, dtype="bf16", repeats=1, fvcore_check=False).source["dtype"] == "bf16"


def test_a_failure_the_eager_model_does_not_have_stays_internal(monkeypatch):
    """The mlp trains in bf16 eagerly, so a RuntimeError from the timed program is pipeplan's, not the model's."""
    def broken(*args, **kwargs):
        raise RuntimeError("Tensor dtype mismatch! Expected: Float, Got: c10::BFloat16")

    monkeypatch.setattr(measure, "time_pass", broken)
    with pytest.raises(RuntimeError, match="dtype mismatch") as info:
        trace(str(REPO / "examples" / "mlp.py"), 2, dtype="bf16", repeats=1, fvcore_check=False)
    assert not isinstance(info.value, UserError)
