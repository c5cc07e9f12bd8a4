"""The asynchronous loop's messages (runtime/pipedream_comm.py) between two real gloo processes: activations
through receives posted a microbatch ahead arrive intact when their shapes, dtypes or count of changed tensors
change between microbatches, and gradients through receives posted with the forward."""

from __future__ import annotations

import os
import socket

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


def _worker(rank: int, port: int, queue) -> None:
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
        box.drain()
        queue.put((rank, ok, sorted(inbox.posted)))
    finally:
        dist.destroy_process_group()


def test_posted_receives_survive_shape_and_dtype_changes():
    import torch.multiprocessing as mp

    kinds = [[(t.shape, t.dtype) for t in activations(m)] for m in range(len(SHAPES))]
    assert [m for m in range(1, len(SHAPES)) if kinds[m] != kinds[m - 1]] == [2, 3, 4, 6]  # the cases

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (ok, left)) for r, ok, left in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results[1][0] == [True] * len(SHAPES)  # every activation as sent
    assert results[0][0] == [True] * len(SHAPES)  # every gradient back through its posted receive
    assert results[1][1] == []  # no receive left posted



def test_calibration_sends_the_runtime_header():
    """`profiles calibrate` writes the asynchronous loop out (hardware_profiles sits below runtime, so it keeps its
    own copy of the header length): the messages it times must be the runtime's."""
    from pipeplan.hardware_profiles import pipeline_ops
    from pipeplan.runtime import pipedream_comm

    assert pipeline_ops.HEADER_LEN == pipedream_comm.HEADER_LEN == 2 + pipedream_comm.MAX_DIMS
