"""benchmarks/gloo_experiments.py: receives posted at the start of a step, gloo's I/O threads at SCHED_IDLE.

The experiments benchmarks/RESULTS.md reports ("Defaults only") are only worth their numbers if the moved receives
still get the messages meant for them: checked against torch's own lowering (`_add_send_recv` over torch's own
compute orders) and the rule gloo matches messages by, between two ranks the k-th receive posted takes the k-th
message sent.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Loaded from its file, not through sys.path: benchmarks/ first on the path would shadow tests' own modules.
_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gloo_experiments.py"
_SPEC = importlib.util.spec_from_file_location("gloo_experiments", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
gx = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gx)
receives_first = gx.receives_first

S = pytest.importorskip("torch.distributed.pipelining.schedules")
RECV = (S.RECV_F, S.RECV_B)


def interleaved_orders(K: int, v: int, M: int) -> dict[int, list]:
    """torch's ScheduleInterleaved1F1B compute order per rank (the attributes its order needs, no process group)."""
    sched = S.ScheduleInterleaved1F1B.__new__(S.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches, sched._num_stages = K, v, M, K * v
    sched.number_of_rounds = max(1, M // K)
    sched.microbatches_per_round = M // sched.number_of_rounds
    orders = {}
    for rank in range(K):
        sched.rank = rank
        orders[rank] = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
    return orders


def zbv_orders(K: int, M: int) -> dict[int, list]:
    """torch's ScheduleZBVZeroBubble compute order per rank."""
    sched = S.ScheduleZBVZeroBubble.__new__(S.ScheduleZBVZeroBubble)
    sched.pp_group_size, sched._n_microbatches = K, M
    sched.num_stages = sched._num_stages = 2 * K
    return {rank: [a for a in sched._calculate_single_rank_operations(rank) if a is not None] for rank in range(K)}


def lowered(orders: dict[int, list], stage_rank) -> object:
    """A multi-stage runtime schedule object holding torch's lowering of `orders` (no stages, no process group)."""
    sched = S._PipelineScheduleRuntime.__new__(S._PipelineScheduleRuntime)
    sched.pipeline_order_with_comms = S._add_send_recv({r: list(a) for r, a in orders.items()}, stage_rank,
                                                       num_stages=1 + max(a.stage_index for o in orders.values()
                                                                          for a in o))
    return sched


def messages(order: dict[int, list], stage_rank) -> dict[tuple[int, int], tuple[list, list]]:
    """Per (sender, receiver): the messages in the order the sender sends them and the receiver posts receives."""
    out: dict[tuple[int, int], tuple[list, list]] = {}
    for rank, actions in order.items():
        for a in actions:
            kind, s = a.computation_type, a.stage_index
            if kind == S.SEND_F:
                out.setdefault((rank, stage_rank(s + 1)), ([], []))[0].append(("F", s + 1, a.microbatch_index))
            elif kind == S.SEND_B:
                out.setdefault((rank, stage_rank(s - 1)), ([], []))[0].append(("B", s - 1, a.microbatch_index))
            elif kind == S.RECV_F:
                out.setdefault((stage_rank(s - 1), rank), ([], []))[1].append(("F", s, a.microbatch_index))
            elif kind == S.RECV_B:
                out.setdefault((stage_rank(s + 1), rank), ([], []))[1].append(("B", s, a.microbatch_index))
    return out


CASES = [("interleaved", K, v, M) for K in (2, 3, 4) for v in (2, 3) for M in (K, 2 * K, 3 * K)]
CASES += [("zb-v", K, 2, M) for K in (2, 3, 4) for M in (2 * K, 2 * K + 1, 3 * K)]


@pytest.mark.parametrize("schedule,K,v,M", CASES)
def test_receives_first_keeps_every_pair_of_ranks_matched(schedule, K, v, M):
    if schedule == "interleaved":
        orders, stage_rank = interleaved_orders(K, v, M), (lambda s: s % K)
    else:
        orders, stage_rank = zbv_orders(K, M), (lambda s: s if s < K else 2 * K - 1 - s)
    sched = lowered(orders, stage_rank)
    before = {r: list(a) for r, a in sched.pipeline_order_with_comms.items()}
    assert receives_first(sched)
    after = sched.pipeline_order_with_comms
    for rank in before:
        recvs = [a for a in before[rank] if a.computation_type in RECV]
        assert after[rank][:len(recvs)] == recvs  # every receive first, in torch's order
        assert after[rank][len(recvs):] == [a for a in before[rank] if a.computation_type not in RECV]
    pairs = messages(after, stage_rank)
    assert pairs and pairs == messages(before, stage_rank)
    for (src, dst), (sent, posted) in pairs.items():
        assert sent == posted, (src, dst)  # the k-th receive gets the k-th message, as before the move


def test_receives_first_leaves_other_schedules_alone():
    assert not receives_first(object())
    sched = S._PipelineScheduleRuntime.__new__(S._PipelineScheduleRuntime)
    sched.pipeline_order_with_comms = None
    assert not receives_first(sched)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
def test_idle_gloo_threads_lowers_gloo_only():
    """In a fresh process with a gloo group: its I/O threads end at SCHED_IDLE, the main thread as it was."""
    code = (
        "import os, torch.distributed as dist\n"
        "from torch.distributed import HashStore\n"
        "dist.init_process_group('gloo', store=HashStore(), rank=0, world_size=1)\n"
        f"import sys; sys.path.insert(0, {str(_PATH.parent)!r})\n"
        "from gloo_experiments import gloo_io_threads, idle_gloo_threads\n"
        "tids = gloo_io_threads()\n"
        "print(len(tids), idle_gloo_threads(), all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids),\n"
        "      os.sched_getscheduler(0) == os.SCHED_OTHER)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    found, lowered_count, idle, main_unchanged = out.stdout.split()
    assert int(found) >= 1 and int(lowered_count) == int(found)
    assert idle == "True" and main_unchanged == "True"
