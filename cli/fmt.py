"""Human units for the report: binary bytes, adaptive seconds, SI counts.

Everything inside pipeplan is SI (bytes, seconds, FLOP); only the CLI turns
numbers into text, here, so every table rounds the same way.
"""

from __future__ import annotations

import math

from pipeplan.units import GIB, KIB, MIB


def fmt_bytes(n: float | int | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if abs(n) < 100 * scale else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "—"
    if s == 0:
        return "0"
    if abs(s) >= 1:
        return f"{s:.3g} s" if abs(s) < 100 else f"{s:.0f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_ms(s: float) -> str:
    """Milliseconds with three significant digits, for table columns that share a unit."""
    v = s * 1e3
    if v == 0:
        return "0"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def table_time_unit(values_s) -> tuple[float, str]:
    """One unit for a whole column set (s, ms or µs), picked so the largest value reads naturally."""
    top = max((abs(v) for v in values_s if v), default=0.0)
    if top >= 10:
        return 1.0, "s"
    if top >= 1e-4 or top == 0:
        return 1e3, "ms"
    return 1e6, "µs"


def fmt_in(s: float, scale: float) -> str:
    """A time already known to be in a column's unit: three significant digits."""
    v = s * scale
    if v == 0:
        return "0"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def fmt_count(n: float | int | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def fmt_flops(n: float | int | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOP"


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage; rounding noise below 0.05% prints as 0.0% (never "-0.0%")."""
    if x is None:
        return "—"
    return f"{100 * x if abs(x) >= 5e-4 else 0.0:.1f}%"


def shorten(name: str, width: int = 28) -> str:
    """Keep the informative tail of a long dotted layer name."""
    if len(name) <= width:
        return name
    return "…" + name[-(width - 1):]
