"""Reaping the helper processes that calibrate and analyze spawn, so that none outlives its caller."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def reap(procs: Iterable[Any], wait_s: float) -> None:
    """Join each process for up to `wait_s` seconds, then kill what is still alive and join it (a hung or
    interrupted helper must not be left behind)."""
    for p in procs:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()
            p.join()
