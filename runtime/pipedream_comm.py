"""Point-to-point messages of the asynchronous PipeDream loop (runtime/pipedream.py): tensors with headers.

torch.distributed.pipelining cannot run a schedule without a flush, so the loop sends
its own activations and gradients. An activation goes with a small header (rank,
dtype, shape) because a stage learns its inputs' shapes only from what it receives; a
gradient needs none (it has the shape of the activation the receiver sent). Sends are
non-blocking (`isend`), each kept until a reaper thread has seen it complete (`Outbox`):
a stage never waits on a downstream receive, so the only waits are the schedule's own
data dependencies. A gradient's receive is posted when the forward sends its activation
(`post_grad_recvs`), so it can arrive while the stage computes. Messages between two
ranks go in one direction per kind (activations downstream, gradients upstream) and in
microbatch order on both sides, so the default tag suffices (gloo keeps a pair's
messages in order).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS  # ndim, dtype code, up to MAX_DIMS sizes


@dataclass
class Outbox:
    """Sends in flight, each request with the tensor it reads (kept alive until the send completes), and the
    headers of the activations last sent to each rank (what that rank has posted receives for: `Inbox`).

    gloo's send requests cannot be polled: `is_completed()` stays False until `wait()` is called, so a list
    pruned by polling kept every tensor sent in a run alive, and scanned all of them at every send (examples/gpt.py
    under 2BW: ~1.4 ms more per microbatch's sends, growing with the run). A reaper thread waits on the requests
    in order instead (`wait` releases the GIL) and drops each tensor when its send is done; the loop never blocks
    on a send.
    """

    last_sent: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _queue: queue.SimpleQueue[tuple[Any, torch.Tensor] | None] = field(default_factory=queue.SimpleQueue)
    _reaper: threading.Thread | None = None
    _errors: list[BaseException] = field(default_factory=list)

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="pipeplan-send-reaper", daemon=True)
            self._reaper.start()
        self._queue.put((dist.isend(t, dst), t))

    def _reap(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item[0].wait()
            except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread by `drain`
                self._errors.append(e)
                return
            del item  # the tensor goes now, not when the next send arrives

    def drain(self) -> None:
        """Wait until every send has completed (a send that failed raises here)."""
        if self._reaper is not None:
            self._queue.put(None)
            self._reaper.join()
            self._reaper = None
        if self._errors:
            raise self._errors[0]


def header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise RuntimeError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1] = t.dim(), DTYPES.index(t.dtype)
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def empty_like_header(h: torch.Tensor) -> torch.Tensor:
    ndim, code = int(h[0]), int(h[1])
    return torch.empty([int(x) for x in h[2:2 + ndim]], dtype=DTYPES[code])


def send_activations(tensors: tuple[torch.Tensor, ...], dst: int, box: Outbox) -> None:
    """Each tensor after its header. Once `dst` has received from this rank it has posted, for the next
    message, buffers shaped like the last one (`Inbox.post`): a tensor of another shape or dtype sends a
    filler of the posted size in its place and follows after all of them, so every posted receive matches."""
    heads, last = [header(t) for t in tensors], box.last_sent.get(dst)
    late = []
    for i, (t, h) in enumerate(zip(tensors, heads, strict=True)):
        box.send(h, dst)
        if last is None or torch.equal(last[i], h):
            box.send(t, dst)
        else:
            box.send(empty_like_header(last[i]), dst)
            late.append(t)
    for t in late:
        box.send(t, dst)
    box.last_sent[dst] = heads


def recv_activations(count: int, src: int) -> list[torch.Tensor]:
    """Blocking: each header, then its tensor (the first message from `src`, which nothing was posted for)."""
    out = []
    for _ in range(count):
        h = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(h, src)
        t = empty_like_header(h)
        dist.recv(t, src)
        out.append(t)
    return out


Posted: TypeAlias = list[tuple[Any, torch.Tensor, Any, torch.Tensor]]  # per tensor: header request and buffer, data's


@dataclass
class Inbox:
    """Activation receives posted a microbatch ahead, so gloo moves the next activation while the stage computes.

    gloo sends a message only once its receive is posted; posted when the forward needed it, a 2 MiB activation
    crossed while both cores computed (examples/gpt.py cut inside the attention). Buffers are shaped like the
    last activations from the same rank; `send_activations` keeps to that (a filler, then the tensor, on a change).
    """

    last: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # src -> headers of its last activations
    posted: dict[int, tuple[int, Posted]] = field(default_factory=dict)  # microbatch -> (src, its receives)

    def post(self, m: int, src: int) -> None:
        """Post microbatch m's receives from `src` (nothing before the first message from it: shapes unknown)."""
        if src not in self.last:
            return
        recvs = []
        for h in self.last[src]:
            head, data = torch.empty(HEADER_LEN, dtype=torch.int64), empty_like_header(h)
            recvs.append((dist.irecv(head, src), head, dist.irecv(data, src), data))
        self.posted[m] = (src, recvs)

    def receive(self, m: int, count: int, src: int) -> list[torch.Tensor]:
        """Microbatch m's `count` activations from `src`: through its posted receives, else blocking."""
        if m not in self.posted:
            out = recv_activations(count, src)
        else:
            posted_src, recvs = self.posted.pop(m)
            assert posted_src == src, (m, posted_src, src)
            out = []
            for (wh, head, wd, data), guess in zip(recvs, self.last[src], strict=True):
                wh.wait()
                wd.wait()
                out.append(data if torch.equal(head, guess) else empty_like_header(head))
            for t, (*_, data) in zip(out, recvs, strict=True):
                if t is not data:  # data was the filler; the tensor follows
                    dist.recv(t, src)
        self.last[src] = [header(t) for t in out]
        return out


def send_grads(inputs: list[torch.Tensor], grads: list[torch.Tensor | None], dst: int, box: Outbox) -> None:
    """One gradient per floating-point input (zeros where the input did not reach the loss)."""
    for x, g in zip(inputs, grads, strict=True):
        if x.is_floating_point():
            box.send(g if g is not None else torch.zeros_like(x), dst)


GradRecv: TypeAlias = tuple[Any, torch.Tensor] | None  # (irecv request, its buffer); None for a non-float output


def post_grad_recvs(outputs: tuple[torch.Tensor, ...], src: int) -> list[GradRecv]:
    """Receives for the gradients `send_grads` will send for these outputs, posted as the forward sends them.

    gloo moves a message only once its receive is posted (the sender waits for the receiver's "ready"), so a
    gradient received when the backward starts crosses then, with both cores busy: on examples/gpt.py cut
    inside the attention (2 MiB a message) that made every asynchronous op 20-70% slower than traced, and
    PipeDream-2BW 40-80% slower than predicted; posted here, as torch's schedules post theirs, ~+15% in a
    direct probe (docs/runtime.md). Messages of a pair stay in order (posted in microbatch order, sent in
    microbatch order).
    """
    return [(dist.irecv(g, src), g) if o.is_floating_point() else None
            for o in outputs for g in [torch.empty(o.shape, dtype=o.dtype)]]


def wait_grads(posted: list[GradRecv]) -> list[torch.Tensor | None]:
    """The gradients of `post_grad_recvs`, once arrived (None for the non-floating outputs)."""
    out: list[torch.Tensor | None] = []
    for item in posted:
        if item is not None:
            item[0].wait()
        out.append(None if item is None else item[1])
    return out
