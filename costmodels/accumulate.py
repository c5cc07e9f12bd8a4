"""What a backward spends adding its weight gradients into existing ones, which a step's first backward skips.

Why: autograd's AccumulateGrad adds each new weight gradient into `param.grad`
in place when a gradient is already there, and takes the new tensor as it is
(no copy) when there is none. The runtime clears gradients at the start of every
step (`zero_grad(set_to_none=True)`), so each stage's first backward of a step
writes fresh gradients and microbatches 2..M accumulate; PipeDream clears them
after every update, so all its backwards are fresh. The tracer times the
accumulating backward (costmodels/measure.py keeps the gradients between its
steps), the one a stage runs most often. What the first one saves is one
in-place add per parameter: it reads the old gradient and the new one and writes
the sum. By hand on examples/mlp.py (5.1M parameters) at 64 rows the adds took 1.7-2.1 ms
of a 20-25 ms backward, and autograd's backward into fresh gradients ran 2.0-2.4 ms
faster than into existing ones: a plan with one microbatch saves that every step.

Measured, not priced from bytes: the add is memory-bound and its speed depends
on where the gradients sit in the caches. Each parameter's add is timed on the
gradients the timed steps left (the old one as a real backward finds it, the new
one just written, as a freshly computed gradient is), in backward order.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from pipeplan.costmodels.instrument import take_out_excess


def accumulate_times(owned: Sequence[Sequence[torch.nn.Parameter]], marks: Any, *, passes: int,
                     plain: bool = False) -> list[float]:
    """Per layer: the median over `passes` sweeps of the time adding its parameters' gradients in place takes.

    `owned[i]`: the parameters layer i owns (a tied one is owned by its first user, as its bytes are); a
    parameter without a gradient (frozen, or unused by this loss) accumulates nothing. `marks`: the trace's
    clock (costmodels.measure.Marks; CUDA events on a GPU). Leaves the gradients changed: call it last.

    plain=True (a CUDA trace): the marks around each add cost host time the GPU waits through. On an H200 every
    add read 25-27 µs, GPT-2's 149 adds of 498 MB of gradients as much as a 32x32 U-Net's 36 adds of 0.5 MB
    (2026-11-27), where reading two and writing one copy of GPT-2's gradients takes about 0.5 ms at its copy
    bandwidth. So the adds are also timed as one run with a mark at each end, and the excess comes out per add
    (instrument.take_out_excess).
    """
    runs = [_sweep(owned, marks) for _ in range(max(1, passes))]
    times = [statistics.median(r[i] for r in runs) for i in range(len(owned))]
    if not plain:
        return times
    whole = statistics.median(_plain_sweep(owned, marks) for _ in range(max(1, passes)))
    adds = [sum(1 for p in layer if p.grad is not None) for layer in owned]
    return take_out_excess(times, adds, whole)[0]


def _sweep(owned: Sequence[Sequence[torch.nn.Parameter]], marks: Any) -> list[float]:
    """One add per parameter with a gradient, last layer first (backward's order)."""
    spans: list[list[tuple[Any, Any]]] = [[] for _ in owned]
    with torch.no_grad():
        for i in reversed(range(len(owned))):
            for p in owned[i]:
                if p.grad is None:
                    continue
                new = torch.ones_like(p.grad)  # written just now, as a freshly computed gradient is
                start = marks.mark()
                p.grad.add_(new)
                spans[i].append((start, marks.mark()))
                del new
    marks.wait()
    return [sum(marks.elapsed_s(a, b) for a, b in layer) for layer in spans]


def _plain_sweep(owned: Sequence[Sequence[torch.nn.Parameter]], marks: Any) -> float:
    """The same adds in the same order with one mark at each end; the added tensors are made before the first mark,
    one per gradient shape (not one per parameter: a real trace holds the model, its gradients and activations)."""
    with torch.no_grad():
        grads = [p.grad for i in reversed(range(len(owned))) for p in owned[i] if p.grad is not None]
        ones = {(g.shape, g.dtype, g.device): torch.ones_like(g) for g in grads}
        start = marks.mark()
        for g in grads:
            g.add_(ones[(g.shape, g.dtype, g.device)])
        end = marks.mark()
    marks.wait()
    return float(marks.elapsed_s(start, end))
