"""Host time eager PyTorch spends per op, by op kind and pass: what bounds a GPU layer whose kernels are tiny.

Why per kind: one `x * 1.0` (calibrate_cuda.measure_dispatch_s) is the cheapest op autograd records. A
convolution goes through cuDNN's plan cache, a training-mode batch norm launches several kernels and saves its
statistics, and a backward runs one autograd node per op plus the weight's AccumulateGrad; these cost the host
several times a multiply's. A layer of such ops on a small tensor takes what the host takes to issue them.

How: for each kind, L independent ops on tiny tensors (each on its own leaf input, as a model's layers are, and
with its own weights), issued back to back without synchronizing, then one `torch.autograd.backward` over the L
outputs. Host seconds at L = 1 and L = LONG give the slope per op, for the forward and for forward + backward;
the slope leaves out what a step pays once (the backward call's engine start, the final synchronize). The
tensors are tiny, so the GPU finishes each kernel before the host issues the next and the host clock is the op's
cost. On a CPU device the same loop times the ops' whole work (tests run it there).

Why sweeps: one kind's points take a few milliseconds all told, so a single disturbance of the host (another
process scheduled on the core for ~10 ms) covers every round of a point and the median of ROUNDS cannot see past
it (a CI run on a busy host measured a ReLU's backward at 3x its figure, above a convolution's). SWEEPS passes
over all kinds (a sweep takes ~0.2 s on this repo's CPU), and each kind keeps the median of its sweeps' figures:
one disturbance spoils at most one sweep of a kind.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

LONG = 32  # ops per timed batch at the long end of the slope
ROUNDS = 7  # timed batches per point; the median is kept
SWEEPS = 3  # passes over all kinds; each kind keeps the median of its passes' figures (module docstring)
Timer = Callable[[], float]


def _op_builders(torch: Any, device: Any) -> dict[str, Callable[[], tuple[Callable[[Any], Any], Any]]]:
    """kind -> a builder of (op, leaf input) on `device`: one op as a model's layer of that part kind calls it."""
    nn, F = torch.nn, torch.nn.functional

    def module(m: Any, shape: tuple[int, ...]) -> tuple[Callable[[Any], Any], Any]:
        m = m.to(device)
        return m, torch.randn(*shape, device=device, requires_grad=True)

    def embedding() -> tuple[Callable[[Any], Any], Any]:
        emb = nn.Embedding(64, 16).to(device)
        idx = torch.randint(0, 64, (2, 8), device=device)
        return (lambda _x: emb(idx)), torch.zeros(1, device=device)

    def attention() -> tuple[Callable[[Any], Any], Any]:
        return (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True)), \
            torch.randn(1, 2, 8, 16, device=device, requires_grad=True)

    return {
        "matmul": lambda: module(nn.Linear(16, 16), (4, 16)),
        "conv3x3": lambda: module(nn.Conv2d(8, 8, 3, padding=1, bias=False), (1, 8, 8, 8)),
        "conv": lambda: module(nn.Conv2d(8, 8, 1, bias=False), (1, 8, 8, 8)),
        "norm": lambda: module(nn.BatchNorm2d(8), (2, 8, 4, 4)),
        "layer_norm": lambda: module(nn.LayerNorm(16), (4, 16)),
        "elementwise": lambda: (F.relu, torch.randn(4, 16, device=device, requires_grad=True)),
        "dropout": lambda: module(nn.Dropout(0.1), (4, 16)),
        "embedding": embedding,
        "attention": attention,
        "other": lambda: module(nn.AdaptiveAvgPool2d(1), (1, 8, 4, 4)),
    }


def _host_s(torch: Any, ops: Sequence[tuple[Callable[[Any], Any], Any]], backward: bool, sync: Callable[[], None],
            clock: Timer) -> float:
    """Host seconds to issue the ops' forwards (and one backward over all their outputs), median of ROUNDS."""
    times = []
    for _ in range(ROUNDS + 2):  # two warm-up rounds: cuDNN plans, allocator blocks, autograd's first graph
        sync()
        t0 = clock()
        outs = [op(x) for op, x in ops]
        if backward:
            roots = [o for o in outs if o.requires_grad]
            torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
        t1 = clock()
        del outs
        sync()
        times.append(t1 - t0)
    return float(statistics.median(times[2:]))


def slope_s(at_one: float, at_long: float, long: int = LONG) -> float:
    """Seconds per op from batch times at 1 and `long` ops (the fixed part cancels); never negative."""
    return max(0.0, (at_long - at_one) / (long - 1))


def _sweep(torch: Any, ops_by_kind: dict[str, list[tuple[Callable[[Any], Any], Any]]],
           seeds: Sequence[tuple[Callable[[Any], Any], Any]], sync: Callable[[], None],
           clock: Timer) -> dict[str, tuple[float, float]]:
    """One pass over every kind: kind -> (forward, backward) seconds per op (measure_dispatch_by_kind)."""
    seed = slope_s(_host_s(torch, seeds[:1], False, sync, clock), _host_s(torch, seeds, False, sync, clock))
    out = {}
    for kind, ops in ops_by_kind.items():
        fwd = slope_s(_host_s(torch, ops[:1], False, sync, clock), _host_s(torch, ops, False, sync, clock))
        both = slope_s(_host_s(torch, ops[:1], True, sync, clock), _host_s(torch, ops, True, sync, clock))
        out[kind] = (fwd, max(0.0, both - fwd - seed))
    return out


def measure_dispatch_by_kind(device: Any, clock: Timer = time.perf_counter) -> dict[str, tuple[float, float]]:
    """kind -> (forward, backward) host seconds per op on `device`, the median of SWEEPS sweeps (module docstring).

    The backward's figure excludes the ones_like seeds (one per output, the same count at both ends of the slope
    as the forward ops, so their cost is taken out with the forward's: forward + backward - forward - seeds).
    """
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    seeds = [(torch.ones_like, torch.zeros(4, 16, device=dev)) for _ in range(LONG)]
    ops_by_kind = {kind: [build() for _ in range(LONG)] for kind, build in _op_builders(torch, dev).items()}
    sweeps = [_sweep(torch, ops_by_kind, seeds, sync, clock) for _ in range(SWEEPS)]
    return {kind: (float(statistics.median(s[kind][0] for s in sweeps)),
                   float(statistics.median(s[kind][1] for s in sweeps))) for kind in ops_by_kind}
