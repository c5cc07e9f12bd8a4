"""The baseline partitioners (DeepSpeed, torchgpipe, equal layers) on hand-checked inputs."""

from __future__ import annotations

import pytest

from pipeplan.planner.baselines import deepspeed_parameters, equal_layers, torchgpipe_balance_by_time


def _sizes(assignment):
    return [assignment.count(s) for s in range(max(assignment) + 1)]


def test_equal_layers():
    assert _sizes(equal_layers(7, 3)) == [3, 2, 2]
    assert _sizes(equal_layers(4, 4)) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        equal_layers(2, 3)


def test_deepspeed_parameters_minimises_the_spread():
    # [1,1,1,1 | 10,1]: spread 11-4 = 7 beats 12-3 = 9 and 14-1 = 13
    assert _sizes(deepspeed_parameters([1, 1, 1, 1, 10, 1], 2)) == [4, 2]
    # against brute force on the spread for 3 parts (DeepSpeed's DP is exact for 2 parts;
    # for more it keeps one (max, min) per state, so only check it is a valid split)
    w = [5, 1, 1, 8, 2, 2, 9, 1]
    got = _sizes(deepspeed_parameters(w, 2))
    best = min(
        (max(sum(w[:k]), sum(w[k:])) - min(sum(w[:k]), sum(w[k:])), k) for k in range(1, len(w))
    )
    assert sum(w[: got[0]]) - sum(w[got[0]:]) in (best[0], -best[0])
    three = _sizes(deepspeed_parameters(w, 3))
    assert len(three) == 3 and sum(three) == len(w) and min(three) >= 1


def test_torchgpipe_block_partition_stops_within_one_normalised_unit():
    # normalised times [0,0,0,0,1,0]: equal counts already satisfy max <= min + 1
    assert _sizes(torchgpipe_balance_by_time([1, 1, 1, 1, 10, 1], 2)) == [3, 3]
    # heavy head, normalised [1, 1, 0, ..., 0]: from [5 | 5] (2 vs 0) the algorithm moves the
    # first block's last layer over until the blocks weigh 1 and 1: sizes [1, 9]
    assert _sizes(torchgpipe_balance_by_time([10, 10, 1, 1, 1, 1, 1, 1, 1, 1], 2)) == [1, 9]


def test_balance_by_time_refuses_to_return_an_invalid_partition():
    # torchgpipe's block-moving heuristic empties a block on this input at k=7; a partition with an
    # empty stage (or the wrong number of layers) must never reach the planner.
    times = [1, 1, 4, 1, 1, 1, 8, 1, 1, 2, 1, 1]
    with pytest.raises(ValueError, match="emptied a stage"):
        torchgpipe_balance_by_time(times, 7)
    for k in (1, 2, 3, 4, 5, 6, 8, 12):
        a = torchgpipe_balance_by_time(times, k)
        assert len(a) == len(times) and sorted(set(a)) == list(range(k)) and a == sorted(a)
