"""The interleaved schedule as the runtime runs it: torch's ScheduleInterleaved1F1B.

The simulator's per-device order and the memory model's in-flight count are checked against torch's own
`pipeline_order` (built by `_calculate_single_rank_operations`, the order its runtime executes). Megatron-LM's
order differs only when the microbatch count equals the pipeline size (it then runs every forward first);
its export says so.
"""

from __future__ import annotations

import pytest

from pipeplan.planner.simulate import device_orders, simulate
from pipeplan.schedules import inflight_microbatches

S = pytest.importorskip("torch.distributed.pipelining.schedules")
KIND = {"F": "F", "B": "B"}  # torch's FORWARD, FULL_BACKWARD


def torch_order(K: int, v: int, M: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's order for one rank, idle slots dropped (its constructor's attributes set by hand: no process group)."""
    sched = S.ScheduleInterleaved1F1B.__new__(S.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = K, v, M
    sched.number_of_rounds = max(1, M // K)
    sched.microbatches_per_round = M // sched.number_of_rounds
    return [(KIND[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(rank) if a is not None]


CASES = [(K, v, K * g) for K in (2, 3, 4) for v in (2, 3, 4) for g in (1, 2, 3)]


@pytest.mark.parametrize("K,v,M", CASES)
def test_simulated_order_is_torchs(K, v, M):
    ours = device_orders("interleaved", K, v, M)
    for rank in range(K):
        assert ours[rank] == torch_order(K, v, M, rank), (K, v, M, rank)


@pytest.mark.parametrize("K,v,M", CASES)
def test_inflight_count_is_the_peak_of_torchs_order(K, v, M):
    for rank in range(K):
        live = peak = 0
        for kind, _, _ in torch_order(K, v, M, rank):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert inflight_microbatches("interleaved", K, rank, M, chunks=v) == peak, (K, v, M, rank)


def test_microbatches_equal_to_devices_keep_the_warm_up_formula():
    """M == K: torch warms device d up with 2(K-d-1) + (v-1)K forwards, where Megatron runs all M*v first.
    On 2 devices x 2 chunks with 2 microbatches the last device holds 3 chunk-microbatches, not 4."""
    assert [inflight_microbatches("interleaved", 2, d, 2, chunks=2) for d in range(2)] == [4, 3]
    r = simulate("interleaved", [1.0] * 4, [2.0] * 4, [0.0] * 3, 2, chunks=2, static_bytes=[0, 0],
                 activation_bytes_per_mb=[1] * 4)
    assert r.peak_memory_bytes == [4, 3]
