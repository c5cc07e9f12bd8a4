"""The asynchronous loop's messages (runtime/pipedream_comm.py) between two real gloo processes: activations
through receives posted a microbatch ahead arrive intact when their shapes, dtypes or count of changed tensors
change between microbatches, and gradients through receives posted with the forward."""

from __future__ import annotations

import socket

from pipedream_comm_worker import SHAPES, activations, worker


def test_posted_receives_survive_shape_and_dtype_changes():
    import torch.multiprocessing as mp

    kinds = [[(t.shape, t.dtype) for t in activations(m)] for m in range(len(SHAPES))]
    assert [m for m in range(1, len(SHAPES)) if kinds[m] != kinds[m - 1]] == [2, 3, 4, 6]  # the cases

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (ok, left, freed)) for r, ok, left, freed in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results[1][0] == [True] * len(SHAPES)  # every activation as sent
    assert results[0][0] == [True] * len(SHAPES)  # every gradient back through its posted receive
    assert results[1][1] == []  # no receive left posted
    assert results[0][2]  # a sent tensor is let go once its send is done, before the run's end



def test_calibration_sends_the_runtime_header():
    """`profiles calibrate` writes the asynchronous loop out (hardware_profiles sits below runtime, so it keeps its
    own copy of the header length): the messages it times must be the runtime's."""
    from pipeplan.hardware_profiles import pipeline_ops
    from pipeplan.runtime import pipedream_comm

    assert pipeline_ops.HEADER_LEN == pipedream_comm.HEADER_LEN == 2 + pipedream_comm.MAX_DIMS
