"""Can a configuration fit at all? Quick answers before the DP, and how far off it is when nothing does.

Memory itself has one model, `costmodels.memory` (`stage_memory`, and its
per-range form `RangeMemory` that the partitioner calls); this module only asks
it questions: the model state no split can avoid, and whether a greedy packing
of the layers fits, which is exact when memory grows with a range (the DP's own
assumption), so configurations that cannot fit are recognised without the DP.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.choices import DEFAULT_MIXED_PRECISION
from pipeplan.costmodels.memory import RangeMemory, model_state_bytes

__all__ = ["state_lower_bound", "greedy_fits", "least_capacity"]


def state_lower_bound(param_bytes: Sequence[int], stages: int, *, optimizer: str, dtype: str,
                      frozen_param_bytes: Sequence[int], mixed_precision: str = DEFAULT_MIXED_PRECISION,
                      sharding: str = "none", shards: int = 1) -> int:
    """Model state no partition can avoid on its busiest device: the total spread evenly, and the largest layer's
    (`frozen_param_bytes`: of each layer's, those without gradients)."""
    def state(nbytes: int, frozen: int) -> int:
        return model_state_bytes(nbytes, optimizer=optimizer, dtype=dtype, mixed_precision=mixed_precision,
                                 sharding=sharding, shards=shards, frozen_bytes_fp32=frozen).total_bytes

    total = state(sum(param_bytes), sum(frozen_param_bytes))
    one = max((state(p, z) for p, z in zip(param_bytes, frozen_param_bytes, strict=True)), default=0)
    return max(-(-total // stages), one)


def greedy_fits(mem: RangeMemory, stages: int, capacity: int) -> bool:
    """Can [0, n) be cut into `stages` ranges that each fit? Greedy longest prefixes:
    exact when memory grows with a range (the DP's own assumption)."""
    a, n = 0, mem.n
    for s in range(stages):
        last = n - (stages - 1 - s)  # leave a layer for every later stage
        if a >= last or mem(s, a, a + 1) > capacity:
            return False
        b = a + 1
        if s == stages - 1:
            b = n
        else:
            while b < last and mem(s, a, b + 1) <= capacity:
                b += 1
        if mem(s, a, b) > capacity:
            return False
        a = b
    return a == n


def least_capacity(mem: RangeMemory, stages: int, start: int) -> int:
    """Smallest capacity the greedy can fit (to 0.1%): how far a configuration is from fitting."""
    lo, hi = start, max(start, 1) * 2
    while not greedy_fits(mem, stages, hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        if greedy_fits(mem, stages, mid):
            hi = mid
        else:
            lo = mid
    return hi
