"""Point-to-point messages of the asynchronous PipeDream loop (runtime/pipedream.py): tensors with headers.

torch.distributed.pipelining cannot run a schedule without a flush, so the loop sends
its own activations and gradients. An activation goes with a small header (rank,
dtype, shape) because a stage learns its inputs' shapes only from what it receives; a
gradient needs none (it has the shape of the activation the receiver sent). Sends are
non-blocking (`isend`) and kept until `drain`: a stage never waits on a downstream
receive, so the only waits are the schedule's own data dependencies. Messages between
two ranks go in one direction per kind (activations downstream, gradients upstream) and
in microbatch order on both sides, so the default tag suffices (gloo keeps a pair's
messages in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS  # ndim, dtype code, up to MAX_DIMS sizes


@dataclass
class Outbox:
    """Sends in flight: each request with the tensor it reads (kept alive until the send completes)."""

    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, dst), t))
        if len(self.pending) > 64:  # forget completed sends so a long run does not keep every tensor
            self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]

    def drain(self) -> None:
        for w, _ in self.pending:
            w.wait()
        self.pending.clear()


def header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise RuntimeError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1] = t.dim(), DTYPES.index(t.dtype)
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def send_activations(tensors: tuple[torch.Tensor, ...], dst: int, box: Outbox) -> None:
    for t in tensors:
        box.send(header(t), dst)
        box.send(t, dst)


def recv_activations(count: int, src: int) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        h = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(h, src)
        ndim, code = int(h[0]), int(h[1])
        t = torch.empty([int(x) for x in h[2:2 + ndim]], dtype=DTYPES[code])
        dist.recv(t, src)
        out.append(t)
    return out


def send_grads(inputs: list[torch.Tensor], grads: list[torch.Tensor | None], dst: int, box: Outbox) -> None:
    """One gradient per floating-point input (zeros where the input did not reach the loss)."""
    for x, g in zip(inputs, grads, strict=True):
        if x.is_floating_point():
            box.send(g if g is not None else torch.zeros_like(x), dst)


def recv_grads(outputs: tuple[torch.Tensor, ...], src: int) -> list[torch.Tensor | None]:
    """The gradients `send_grads` sends for these outputs (None for the non-floating ones)."""
    out: list[torch.Tensor | None] = []
    for o in outputs:
        if not o.is_floating_point():
            out.append(None)
            continue
        g = torch.empty(o.shape, dtype=o.dtype)
        dist.recv(g, src)
        out.append(g)
    return out
