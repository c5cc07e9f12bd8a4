"""Receive buffers of a device that runs several virtual stages (interleaved 1F1B, ZB-V, DualPipeV): torch's
PipelineStage allocates M per direction for each of them at that stage's own cut (costmodels/memory.py
`chunk_receive_bytes`), where the device's largest cut for every chunk counted buffers it never held."""

from __future__ import annotations

import pytest

from pipeplan.costmodels.memory import chunk_receive_bytes, receive_buffers, stage_memory
from pipeplan.schedules import device_stages

MIB = 2**20
M = 4


def test_equal_cuts_give_the_counts_times_the_cut():
    """With every cut alike, the per-stage sum is `receive_buffers`' counts times that cut, on every device of
    every multi-stage schedule: the same buffers, counted one stage at a time."""
    for schedule, chunks in (("interleaved", 2), ("interleaved", 3), ("zb-v", 2), ("dualpipev", 2)):
        P = 2
        S = P * chunks
        cut = 3 * MIB
        in_bytes, out_bytes = [cut] * S, [cut] * (S - 1) + [0]
        for p in range(P):
            mine = device_stages(schedule, p, P, chunks)
            ins, grads = receive_buffers(schedule, P, p, M, chunks, M)
            assert chunk_receive_bytes(schedule, mine, in_bytes, out_bytes, M) == (ins + grads) * cut, (schedule, p)


def test_a_v_device_holds_each_chunks_own_buffers():
    """ZB-V on 2 devices, cuts of 2, 2 and 10 MiB (the recomputed GPT of benchmarks/RESULTS.md, "Peak memory"):
    device 1 runs stages 1 and 2, so M input buffers of 2 MiB for each and M gradient buffers of 2 MiB (stage 1)
    and 10 MiB (stage 2); device 0 runs stage 0 (the microbatch itself, 1 KiB, once; M gradient buffers of 2 MiB)
    and stage 3 (M input buffers of 10 MiB, no gradient: it computes the loss)."""
    in_bytes = [1024, 2 * MIB, 2 * MIB, 10 * MIB]
    out_bytes = [2 * MIB, 2 * MIB, 10 * MIB, 0]
    assert device_stages("zb-v", 1, 2, 2) == [1, 2] and device_stages("zb-v", 0, 2, 2) == [0, 3]
    assert chunk_receive_bytes("zb-v", [1, 2], in_bytes, out_bytes, M) == M * (2 + 2) * MIB + M * (2 + 10) * MIB
    assert chunk_receive_bytes("zb-v", [0, 3], in_bytes, out_bytes, M) == 1024 + M * 2 * MIB + M * 10 * MIB
    # priced at the largest cut, device 1's gradient buffers were 8 x 10 MiB: 32 MiB more than it holds
    ins, grads = receive_buffers("zb-v", 2, 1, M, 2, M)
    assert ins * 2 * MIB + grads * 10 * MIB - chunk_receive_bytes("zb-v", [1, 2], in_bytes, out_bytes, M) == 32 * MIB


def test_one_stage_a_device_and_per_microbatch_loops_keep_the_counts():
    """None (the counts times the cut are exact) for one stage a device, for GPipe's and 1F1B's lazy loops, which
    hold buffers per microbatch in flight, and for PipeDream's own loop."""
    assert chunk_receive_bytes("zb-h1", [1], [MIB] * 2, [MIB, 0], M) is None
    assert chunk_receive_bytes("1f1b", [0, 1], [MIB] * 2, [MIB, 0], M) is None
    assert chunk_receive_bytes("pipedream", [0, 1], [MIB] * 2, [MIB, 0], M) is None


def test_stage_memory_takes_the_summed_bytes_in_place_of_the_counts():
    common = dict(param_bytes=0, saved_bytes_per_mb=0, input_bytes_per_mb=10 * MIB, output_bytes_per_mb=10 * MIB,
                  schedule="zb-v", stages=2, stage=1, microbatches=M, optimizer="sgd", dtype="fp32", recompute=False,
                  chunks=2)
    counted = stage_memory(**common)
    summed = stage_memory(**common, receive_bytes=5 * MIB)
    ins, grads = receive_buffers("zb-v", 2, 1, M, 2, counted.inflight)
    assert counted.buffer_bytes - summed.buffer_bytes == pytest.approx((ins + grads) * 10 * MIB - 5 * MIB)
    assert counted.total_bytes - summed.total_bytes == counted.buffer_bytes - summed.buffer_bytes
