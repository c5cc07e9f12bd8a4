"""Attention the CPU cannot fuse, counted for a catalogue (GPU) profile as a GPU's fused kernel runs it
(costmodels/gpu_attention.py); for a local profile, as the CPU runs it. Expected values are the kernels' own
arithmetic: what each algorithm keeps for backward, and the multiply-adds of each pass (2 FLOPs each)."""

from pathlib import Path

import pytest

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import trace

DATA = Path(__file__).resolve().parent / "data"
MODEL = str(DATA / "latent_attention.py")
B = 2
F32 = 4


@pytest.fixture
def dims(monkeypatch):
    """The model file's module with value heads `v_dim` wide and attention dropout `dropout` (the file reads them
    when it loads)."""
    def at(v_dim: int, dropout: float = 0.0):
        monkeypatch.setenv("PIPEPLAN_TEST_V_DIM", str(v_dim))
        monkeypatch.setenv("PIPEPLAN_TEST_DROPOUT", str(dropout))
        module = load_model_file(MODEL).module
        assert (module.V_DIM, module.DROPOUT) == (v_dim, dropout)
        return module
    return at


def _core(timed: bool):
    graph = trace(MODEL, B, repeats=1, fvcore_check=False, time_layers=timed)
    return graph, graph.layer("core")


def test_untimed_graph_saves_what_a_fused_kernel_keeps(dims):
    m = dims(16)
    h, q, v, s = m.HEADS, m.Q_DIM, m.V_DIM, m.SEQ
    graph, core = _core(timed=False)
    # queries, keys (q wide), values and output (v wide), one log-sum-exp per row, the dropout RNG's seed and offset
    assert core.saved_bytes == B * h * s * (2 * q + 2 * v) * F32 + B * h * s * F32 + 2 * 8
    assert core.fwd_flops == 2 * B * h * s * s * (q + v)  # scores, then scores x values
    # backward: the scores again, then the gradients of the probabilities, values, queries and keys
    assert core.bwd_flops == 2 * B * h * s * s * (3 * q + 2 * v)
    assert any("runs unfused (value heads 16 wide against 24)" in n for n in graph.notes)


def test_timed_graph_saves_what_the_cpu_keeps(dims):
    m = dims(16)
    h, q, v, s = m.HEADS, m.Q_DIM, m.V_DIM, m.SEQ
    graph, core = _core(timed=True)
    # the unfused math: q and k (its first matmul's operands), the softmax's probabilities (read again by the second
    # matmul: one storage), v
    assert core.saved_bytes == B * h * s * s * F32 + B * h * s * (2 * q + v) * F32
    assert core.fwd_flops == 2 * B * h * s * s * (q + v)
    assert core.bwd_flops == 2 * B * h * s * s * (2 * q + 2 * v)  # no recomputation
    assert not any("runs unfused" in n for n in graph.notes)


def test_one_head_size_is_left_as_the_cpu_counts_it(dims):
    """The CPU fuses it (flash attention for the CPU): both graphs count the same, and no note."""
    m = dims(24)
    untimed, core = _core(timed=False)
    _, timed_core = _core(timed=True)
    assert core.saved_bytes == timed_core.saved_bytes == B * m.HEADS * m.SEQ * (4 * m.Q_DIM + 1) * F32
    assert core.bwd_flops == timed_core.bwd_flops
    assert not any("runs unfused" in n for n in untimed.notes)


def test_dropout_is_counted_as_a_gpus_fused_kernel_keeps_it(dims):
    """The CPU's fused kernel takes no dropout, so it runs the math and saves the probabilities (and the dropped
    ones); a GPU's fused kernel keeps what it keeps without dropout, and the RNG's seed and offset."""
    m = dims(24, dropout=0.1)
    h, q, s = m.HEADS, m.Q_DIM, m.SEQ
    untimed, core = _core(timed=False)
    assert core.saved_bytes == B * h * s * (4 * q + 1) * F32 + 2 * 8
    assert core.bwd_flops == 2 * B * h * s * s * 5 * q
    assert any("runs unfused (dropout 0.1)" in n for n in untimed.notes)
    _, timed_core = _core(timed=True)
    assert timed_core.saved_bytes >= B * h * s * s * F32
