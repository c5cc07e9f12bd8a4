"""The two processes of tests/test_pipedream_comm.py: rank 0 sends activations whose shapes, dtypes and tensor
counts change between microbatches and receives their gradients; rank 1 receives through posted receives.

A module of its own, imported by name (tests/ is on sys.path through conftest.py, and a spawned child gets the
parent's sys.path): a function defined in the test file pickles as `tests.test_pipedream_comm._worker`, which
a child of a non-editable install cannot import.
"""

from __future__ import annotations

import os

import torch

# (tensors of microbatch m): shapes and dtypes change at m = 2 (one tensor), 3 (both), 4 (back) and 6 (dtype)
SHAPES = [[(4, 3), (2,)], [(4, 3), (2,)], [(5, 3), (2,)], [(1,), (7, 2)], [(4, 3), (2,)], [(4, 3), (2,)],
          [(4, 3), (2,)]]
DTYPES = [torch.float32] * 6 + [torch.float64]


def activations(m: int) -> list[torch.Tensor]:
    """Microbatch m's tensors: values that name the microbatch, so a mismatched receive shows."""
    dtype = DTYPES[m]
    return [torch.arange(torch.Size(s).numel(), dtype=dtype).reshape(s) + 100 * m + 10 * i
            for i, s in enumerate(SHAPES[m])]


def worker(rank: int, port: int, queue) -> None:
    import datetime

    import torch.distributed as dist

    from pipeplan.runtime.pipedream_comm import Inbox, Outbox, post_grad_recvs, send_activations, send_grads, wait_grads

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        box, inbox, ok = Outbox(), Inbox(), []
        for m in range(len(SHAPES)):
            if rank == 0:
                out = activations(m)
                send_activations(tuple(out), 1, box)
                posted = post_grad_recvs(tuple(out), 1)
                grads = wait_grads(posted)
                ok.append(all(torch.equal(g, -t) for g, t in zip(grads, out, strict=True)))
            else:
                got = inbox.receive(m, 2, 0)
                if m + 1 < len(SHAPES):
                    inbox.post(m + 1, 0)  # before the "compute": the next activations can arrive meanwhile
                ok.append(all(torch.equal(g, t) for g, t in zip(got, activations(m), strict=True)))
                send_grads(got, [-t for t in got], 0, box)
        freed = _sent_tensor_is_freed(rank, box)
        box.drain()
        queue.put((rank, ok, sorted(inbox.posted), freed))
    finally:
        dist.destroy_process_group()


def _sent_tensor_is_freed(rank: int, box) -> bool:
    """Rank 0 sends a tensor; once rank 1 has it, the outbox must let go of its storage (gloo's send requests
    cannot be polled, and an outbox that polled them kept every tensor of a run to its end)."""
    import time

    import torch.distributed as dist

    if rank == 1:
        dist.recv(torch.empty(1024), 0)
        dist.barrier()
        return True
    t = torch.ones(1024)
    uses = lambda: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731 - holders of t's memory
    alone = uses()
    box.send(t, 1)
    held = uses() > alone  # the outbox holds it while the send is in flight
    dist.barrier()  # rank 1 has received it
    deadline = time.monotonic() + 10
    while uses() > alone and time.monotonic() < deadline:
        time.sleep(0.01)
    return held and uses() == alone
