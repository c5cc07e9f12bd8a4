"""Timing tests that hold a measurement against a reference timed seconds apart (a trace against an eager step, a
calibrated profile against the code it prices) on a shared host whose speed drifts between the two."""

from __future__ import annotations

from collections.abc import Callable


def ratios_until_within(pair: Callable[[], tuple[float, float]], within: Callable[[float], bool],
                        attempts: int = 3) -> list[float]:
    """measured / reference of `pair()` (each call times both afresh, back to back) until `within` accepts a ratio,
    at most `attempts` times; the caller asserts `within` on the last. A reference that is not positive is a miss
    (the ratio is NaN). A model off by more than the bound misses on every try; a neighbour that slowed one side
    of one pair does not fail the test (in CI one pair read 0.494 against a bound of 0.5, another 1.61 against 1.6)."""
    ratios: list[float] = []
    for _ in range(attempts):
        measured, reference = pair()
        ratios.append(measured / reference if reference > 0 else float("nan"))
        if within(ratios[-1]):
            break
    return ratios
