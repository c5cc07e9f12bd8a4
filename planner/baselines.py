"""The partitioners people use today, re-implemented from their algorithms, as baselines.

pipeplan's claim is that its plans beat these; the benchmark measures that on
the same cost model. All return contiguous assignments (stage of each layer).

- equal_layers: the same number of layers per stage (remainder to the first
  stages), DeepSpeed's partition_method="uniform" / the naive split.
- deepspeed_parameters: DeepSpeed PipelineModule(partition_method="parameters"):
  per-layer parameter counts balanced by `runtime/utils.py: partition_balanced`,
  a linear-partition DP that minimises the spread (heaviest minus lightest part),
  keeping one (max, min) pair per state and preferring later split points on ties.
- torchgpipe_balance_by_time: torchgpipe.balance.balance_by_time: measured
  per-layer times split by `blockpartition.solve` ("Block Partitions of
  Sequences", Barany et al., arXiv 1308.2452): normalise the times to [0, 1],
  start from equal layer counts, then repeatedly move one layer from the block
  next to the lightest block towards it until max <= min + 1.
"""

from __future__ import annotations

import numpy as np


def _from_sizes(sizes: list[int]) -> list[int]:
    return [s for s, size in enumerate(sizes) for _ in range(size)]


def equal_layers(n: int, stages: int) -> list[int]:
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    base, extra = divmod(n, stages)
    return _from_sizes([base + (1 if s < extra else 0) for s in range(stages)])


def deepspeed_parameters(param_counts: list[float], stages: int) -> list[int]:
    n, m = len(param_counts), stages
    if not 1 <= m <= n:
        raise ValueError(f"cannot split {n} layers into {m} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(param_counts, dtype=np.float64))])
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    dp_max[0, 0] = 0.0
    dp_cost[0, 0] = 0.0
    for i in range(1, n + 1):
        part = prefix[i] - prefix[:i]  # weight of [k, i) for k = 0..i-1
        for j in range(1, min(i, m) + 1):
            hi = np.maximum(dp_max[:i, j - 1], part)
            lo = np.minimum(dp_min[:i, j - 1], part)
            cost = hi - lo
            best = np.min(cost)
            if not np.isfinite(best):
                continue
            k = int(np.flatnonzero(cost == best)[-1])  # ">=" in the original: the last k wins ties
            dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = best, hi[k], lo[k], k
    ends = [n]
    for j in range(m, 0, -1):
        ends.append(int(position[ends[-1], j]))
    ends.reverse()
    return _from_sizes([b - a for a, b in zip(ends[:-1], ends[1:], strict=True)])


def torchgpipe_balance_by_time(times: list[float], stages: int, *, max_moves: int = 1_000_000) -> list[int]:
    n, k = len(times), stages
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    lo, span = min(times), max(times) - min(times)
    seq = [0.0] * n if span == 0 else [(t - lo) / span for t in times]
    splits = [n // k * (x + 1) for x in range(k - 1)] + [n]

    def size(i: int) -> float:
        return sum(seq[(splits[i - 1] if i > 0 else 0):splits[i]])

    # A move shifts one split, which changes the two blocks beside it: only those are re-summed (the same
    # slice sums as torchgpipe's, so every comparison, and the result, is unchanged).
    keyed = [(size(i), i) for i in range(k)]  # min/max over (size, index) pairs break ties as torchgpipe does
    moves, seen = 0, set()
    while True:
        max_size, p = max(keyed)
        while True:
            if (p, *splits) in seen:  # back at an earlier state: torchgpipe's moves cycle forever here
                raise ValueError(f"balance_by_time cycles on this input after {moves} moves")
            seen.add((p, *splits))
            min_size, q = min(keyed)
            if max_size <= min_size + 1:
                starts = [0] + splits[:-1]
                sizes = [b - a for a, b in zip(starts, splits, strict=True)]
                if min(sizes) < 1:  # torchgpipe's moves can empty a block; its result is then unusable
                    raise ValueError(f"balance_by_time left an empty stage ({sizes})")
                return _from_sizes(sizes)
            if any(a > b for a, b in zip([0, *splits], [*splits, n], strict=True)):
                raise ValueError(f"balance_by_time emptied a stage after {moves} moves (torchgpipe's moves can)")
            if moves >= max_moves:
                raise ValueError(f"balance_by_time did not converge in {moves} moves")
            moves += 1
            if p < q:
                h = q - 1
                splits[h] -= 1
                moved = h
            else:
                h = q + 1
                splits[q] += 1
                moved = q
            keyed[moved], keyed[moved + 1] = (size(moved), moved), (size(moved + 1), moved + 1)
            if p == h:
                break
