"""Timing tests that hold a measurement against a reference timed seconds apart (a trace against an eager step, a
calibrated profile against the code it prices) on a shared host whose speed drifts between the two."""

from __future__ import annotations

from collections.abc import Callable


def ratios_until_within(pair: Callable[[], tuple[float, float]], low: float, high: float,
                        attempts: int = 3) -> list[float]:
    """measured / reference of `pair()` (each call times both afresh, back to back) until one ratio lands in
    [low, high], at most `attempts` times; the caller asserts on the last. A model off by more than the bound
    misses on every try; a neighbour that slowed one side of one pair does not fail the test (in CI one pair read
    0.494 against a bound of 0.5, another 1.61 against 1.6)."""
    ratios: list[float] = []
    for _ in range(attempts):
        measured, reference = pair()
        ratios.append(measured / reference)
        if low <= ratios[-1] <= high:
            break
    return ratios
