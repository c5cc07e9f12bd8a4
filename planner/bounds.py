"""Lower bounds on an iteration that let the search skip configurations without changing its answer.

Before partitioning a configuration, `split_within` asks whether any split of the chain could beat the best plan so
far (every device busy all the time; without interleaving, each device's ramp and drain counted, as
`iteration_lower_bound` counts them); after partitioning, `iteration_lower_bound` bounds the partition before it is
simulated. A balanced 1F1B's bound is the closed form (M + K - 1) stage times, so a pipeline whose bubble alone
loses to the best is skipped: Llama-3.1-405B on 1,024 H100s simulated 1,088 partitions before these counted the
bubble, 265 after (benchmarks/RESULTS.md). Neither bound can discard a configuration that would have beaten the
best, so pruning changes the work, not the answer (runners-up are the best of what was evaluated).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["split_within", "chain_ramp", "iteration_lower_bound"]


def split_within(compute_s: Sequence[float], stages: int, limit: float, *, microbatches: int = 1,
                 ramp_s: Sequence[float] | None = None) -> bool:
    """Whether some contiguous split into `stages` (or fewer) keeps every stage's cost within `limit`.

    A stage of layers a..b-1 costs `microbatches` times their compute, plus `ramp_s[a]` (a prefix sum, n + 1
    entries) where given: `iteration_lower_bound`'s ramp and drain of a device whose stage starts at layer a
    (`chain_ramp`). Greedy packing decides it exactly: a stage starting later reaches no less far, as a layer adds
    at most its compute to the ramp and `microbatches` times it to the work. Fewer stages suffice for `stages`:
    splitting one never raises a cost by that same argument.
    """
    prefix = [microbatches * x for x in itertools.accumulate(compute_s, initial=0.0)]
    n = len(compute_s)
    a = 0
    for _ in range(stages):
        a = max(a, bisect.bisect_right(prefix, prefix[a] + limit - (ramp_s[a] if ramp_s is not None else 0.0)) - 1)
        if a >= n:
            return True
    return False


def chain_ramp(fwd_s: Sequence[float], bwd_s: Sequence[float], *, tail: bool) -> list[float]:
    """`split_within`'s `ramp_s` for one stage a device: what must run before a device whose stage starts at
    layer a can begin (the first microbatch's forwards of layers < a) and, with `tail`, after its last op ends
    (the last microbatch's backwards of those layers), as `iteration_lower_bound` counts them."""
    return list(itertools.accumulate((f + (b if tail else 0.0) for f, b in zip(fwd_s, bwd_s, strict=True)),
                                     initial=0.0))


def iteration_lower_bound(fwd_s: Sequence[float], bwd_s: Sequence[float], busy_s: Sequence[float],
                          assignment: Sequence[int], device_of: Sequence[int], microbatches: int, *,
                          tail: bool) -> float:
    """A flushing schedule's iteration can be no shorter than any device's ramp, work and drain.

    Device k computes `microbatches * busy_s[k]` (its stages' forward + backward + recompute for one
    microbatch). It cannot start before the first microbatch's forward has run through every stage below
    its lowest one (`fwd_s`, per layer: plain forwards), and where its last op is a whole backward (no W
    deferred: `tail`) the last microbatch's gradient must then run back through those same stages (`bwd_s`,
    plain backwards; a recompute can run before its gradient arrives). Sends only add to both. For a
    balanced 1F1B this is (M + K - 1) times a stage: the closed form (Narayanan et al. 2021, §2.2), where
    `M * max(busy_s)` alone leaves out the bubble. Used to skip simulating partitions that cannot win.
    """
    stages = max(assignment) + 1
    stage_f, stage_b = [0.0] * stages, [0.0] * stages
    for i, s in enumerate(assignment):
        stage_f[s] += fwd_s[i]
        stage_b[s] += bwd_s[i]
    before_f = list(itertools.accumulate(stage_f, initial=0.0))
    before_b = list(itertools.accumulate(stage_b, initial=0.0))
    lowest: dict[int, int] = {}
    for s in range(stages):
        lowest.setdefault(device_of[s], s)
    return max(before_f[s] + microbatches * busy_s[k] + (before_b[s] if tail else 0.0) for k, s in lowest.items())
