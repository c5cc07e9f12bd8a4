"""Throughput bounds that let the search skip configurations without changing its answer.

Before partitioning a configuration, an upper bound on its throughput (every
device busy all the time, none faster than the best memory-blind split of the
chain) is compared with the best plan so far; after partitioning, the bound is
tightened with the partition's busiest device before simulating. Neither bound
can discard a configuration that would have beaten the best, so pruning changes
the work, not the answer.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["min_bottleneck"]


def min_bottleneck(compute_s: Sequence[float], stages: int) -> float:
    """Smallest possible slowest-stage compute of a contiguous split (no sends, no memory caps).

    Greedy packing decides "fits in T?" exactly for sums; bisection on T to 1e-9 relative,
    returning a value never above the true optimum (it is used as a lower bound).
    """
    prefix = list(itertools.accumulate(compute_s, initial=0.0))
    n = len(compute_s)
    if stages >= n:
        return max(compute_s, default=0.0)

    def fits(T: float) -> bool:
        a = 0
        for _ in range(stages):
            a = bisect.bisect_right(prefix, prefix[a] + T) - 1
            if a >= n:
                return True
        return a >= n

    lo, hi = max(max(compute_s), prefix[-1] / stages), prefix[-1]
    if fits(lo):
        return lo
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo
