"""A model's own torch.utils.checkpoint calls: traced and run as plain code, since pipeplan plans recomputation.

A reentrant checkpoint (CheckpointFunction) runs its function under no_grad, so torch.export recorded the region
as code that trains nothing and the trace refused the model ("the loss does not depend on any parameter"); a
non-reentrant one was already recorded once, silently. Both now trace as the same model without checkpoints, with
a note saying so (costmodels/export.py `plain_checkpoints`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import pipeplan
from pipeplan.costmodels.export import plain_checkpoints

FILE = str(Path(__file__).parent / "data" / "checkpointed.py")


def _summary(graph):
    return [(l.name, l.fwd_flops, l.bwd_flops, l.param_bytes, l.saved_bytes, l.nodes) for l in graph.layers]


def test_checkpointed_models_trace_as_the_model_without_checkpoints():
    plain = pipeplan.trace(FILE, batch_size=8, entry="build_plain", time_layers=False, repeated_blocks=False)
    assert not any("torch.utils.checkpoint" in n for n in plain.notes)
    for entry in ("build_model", "build_non_reentrant"):
        graph = pipeplan.trace(FILE, batch_size=8, entry=entry, time_layers=False, repeated_blocks=False)
        assert _summary(graph) == _summary(plain), entry
        assert graph.fingerprint() == plain.fingerprint()
        assert any("torch.utils.checkpoint" in n and "--recompute" in n for n in graph.notes), entry


def test_plain_checkpoints_counts_the_calls_and_leaves_torch_as_it_was():
    """Inside, both kinds are counted and a reentrant one calls its function once, with gradients (export records
    a non-reentrant one once by itself); after it, a reentrant checkpoint re-runs its function in backward again,
    as torch does."""
    runs = [0]
    lin = torch.nn.Linear(4, 4)

    def f(x):
        runs[0] += 1
        return lin(x)

    x = torch.randn(2, 4, requires_grad=True)  # a reentrant checkpoint needs an input that requires grad
    with plain_checkpoints() as calls:
        checkpoint(f, x, use_reentrant=True).sum().backward()
        assert runs == [1] and lin.weight.grad is not None
        checkpoint(f, x, use_reentrant=False)
    assert calls == [2]
    assert "apply" not in vars(CheckpointFunction)
    runs[0] = 0
    checkpoint(f, x, use_reentrant=True).sum().backward()
    assert runs == [2]
