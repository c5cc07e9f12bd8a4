"""The chain partition of a mixed pipeline: stage s on device type types[s], exact by dynamic programming.

Each stage is priced with its own type's layer times and checked against its own
type's capacity, so the usual bottleneck DP over a chain (Narayanan et al.,
PipeDream SOSP'19 §3.1; `planner/dp.py`) only needs the per-stage arrays: f[s][b]
= min over a of max(f[s-1][a], cost(s, a, b)), cost = the stage's compute plus
sending its output over the link to the next stage. O(K n^2) per placement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StageCosts", "mixed_chain_dp", "stage_cost", "assignment_of"]

INF = float("inf")


@dataclass(frozen=True)
class StageCosts:
    """What the DP needs, per layer and device type: compute (fwd + bwd [+ recompute]) of one microbatch."""

    compute_s: Sequence[Sequence[float]]  # [type][layer]
    send_s: Callable[[int, int], float]  # (stage, cut after layer b-1) -> seconds to send its output
    memory: Callable[[int, int, int], int]  # (stage, a, b) -> bytes of a device holding layers [a, b)
    capacity_bytes: Sequence[int]  # per stage: its type's usable memory


def stage_cost(c: StageCosts, types: Sequence[int], prefix: Sequence[Sequence[float]], s: int, a: int, b: int) -> float:
    """Seconds stage s holding layers [a, b) is busy per microbatch; inf when it does not fit."""
    if c.memory(s, a, b) > c.capacity_bytes[s]:
        return INF
    return _time(c, types, prefix, s, a, b)


def _time(c: StageCosts, types: Sequence[int], prefix: Sequence[Sequence[float]], s: int, a: int, b: int) -> float:
    """Compute of layers [a, b) on stage s's type plus sending its output."""
    t = types[s]
    n = len(c.compute_s[t])
    return prefix[t][b] - prefix[t][a] + (c.send_s(s, b) if b < n else 0.0)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def mixed_chain_dp(c: StageCosts, types: Sequence[int]) -> tuple[float, list[int]] | None:
    """(bottleneck seconds, stage of each layer) minimising the busiest stage; None when nothing fits."""
    K, n = len(types), len(c.compute_s[0])
    if K > n:
        return None
    prefix = [_prefix(row) for row in c.compute_s]
    f = [[INF] * (n + 1) for _ in range(K + 1)]
    arg = [[0] * (n + 1) for _ in range(K + 1)]
    f[0][0] = 0.0
    for s in range(1, K + 1):
        for b in range(s, n - (K - s) + 1):  # every later stage keeps a layer
            best, where = INF, 0
            for a in range(s - 1, b):
                if f[s - 1][a] >= best:
                    continue
                v = max(f[s - 1][a], _time(c, types, prefix, s - 1, a, b))
                if v < best and c.memory(s - 1, a, b) <= c.capacity_bytes[s - 1]:  # memory only when it would win
                    best, where = v, a
            f[s][b], arg[s][b] = best, where
    if f[K][n] == INF:
        return None
    cuts, b = [], n
    for s in range(K, 0, -1):
        cuts.append(b)
        b = arg[s][b]
    return f[K][n], assignment_of(sorted(cuts), n)


def assignment_of(ends: Sequence[int], n: int) -> list[int]:
    """Stage of each layer from each stage's end (exclusive, ascending; the last is n)."""
    out, s = [], 0
    for i in range(n):
        while i >= ends[s]:
            s += 1
        out.append(s)
    return out
