"""Activation recomputation for a plan with `recompute`: each stage keeps only its inputs and re-runs its forward
inside the backward, as the planner prices it (docs/cost-models.md, "Recomputation"; GPipe §2.3).

The stage module's forward runs under `torch.utils.checkpoint.checkpoint` with `use_reentrant=False`: autograd saves
nothing inside it but the inputs, and the first backward that needs a saved tensor re-runs the forward. The step
equals one without recomputation:
- the RNG state is restored for the re-run (checkpoint's `preserve_rng_state`), so dropout draws the same masks;
- the re-run leaves the module's buffers as it found them: a training-mode BatchNorm would otherwise update its
  running statistics (and `num_batches_tracked`) a second time per microbatch. Its output does not depend on them
  (training mode normalises with the batch's own statistics), so only the double update is undone.
Patching the instance's `forward` keeps the module itself (its parameter names, state dict and optimizer) as it was.

A plan recomputed per block (`recompute_granularity: block`, as the frameworks checkpoint each decoder layer) gets
a checkpoint per block instead (`recompute_blocks`): the stage runs as one module per block (runtime/split.py cuts
the program at every block by the rule it cuts stages by), each checkpointed as above, so a microbatch keeps every
block's inputs and its backward re-runs one block at a time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint


class _BuffersKept:
    """Restores every buffer of a module on exit: the re-run's running-statistics updates are undone.

    A class, not a generator: checkpoint may enter the re-run context more than once (a zero-bubble backward
    split into B and W re-runs the forward for each), and a generator-based context manager enters once.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.kept = [(b, b.detach().clone()) for b in self.module.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, old in self.kept:
                b.copy_(old)
        self.kept = []


def _contexts(module: torch.nn.Module) -> tuple[contextlib.AbstractContextManager[None],
                                                contextlib.AbstractContextManager[None]]:
    """checkpoint's (forward, re-run) contexts: nothing around the forward, buffers kept around the re-run."""
    return contextlib.nullcontext(), _BuffersKept(module)


def recompute(module: torch.nn.Module) -> torch.nn.Module:
    """Make `module` recompute its forward during backward instead of keeping its activations; returns it."""
    module.forward = functools.partial(  # type: ignore[method-assign]
        checkpoint, module.forward, use_reentrant=False, context_fn=functools.partial(_contexts, module))
    return module


def recompute_blocks(module: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """Make the stage `module` run as its `blocks` (runtime/split.Split.block_modules: one module per block, holding
    the stage module's own parameters and buffers), each checkpointed as `recompute` does; returns it.

    A microbatch then keeps every block's inputs (a value passed on through several blocks is one tensor, kept
    once) and its backward re-runs one block at a time. The stage module still owns, names and steps the
    parameters; `_BuffersKept` of each block restores the very buffers its re-run updates.
    """
    steps = [recompute(block) for block in blocks]

    def forward(*values: torch.Tensor) -> tuple:
        for step in steps:
            values = step(*values)
        return values

    module.forward = forward  # type: ignore[method-assign]  (the blocks stay unregistered: no new state-dict keys)
    return module


def functional_forward(module: torch.nn.Module, params: dict[str, torch.Tensor], inputs: tuple,
                       recompute_it: bool) -> tuple:
    """`module` run with `params` in place of its own (PipeDream's stashed weight versions).

    With recomputation the whole functional call is checkpointed, so the forward re-run inside the backward
    sees the same stashed version as the forward did, not whatever the module holds by then.
    """
    if not recompute_it:
        return torch.func.functional_call(module, params, inputs)
    return checkpoint(torch.func.functional_call, module, params, inputs, use_reentrant=False,
                      context_fn=functools.partial(_contexts, module))
