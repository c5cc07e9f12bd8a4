"""One validation pass for pipeplan's JSON inputs (graph, plan, checkpoint manifest), naming file and field.

A loader walks its document once through a `Fields` checker before building
anything from it, so every wrong type, negative count, NaN or out-of-range value
is a one-line user error such as

    graph.json: layers[3] ('fc2').param_bytes is -5: must be an integer >= 0

instead of a ValueError from deep inside a cost model. Quoted values are cut
short: a hostile file can hold megabytes in one field, and the message stays
one line. (The profile YAML has its own checker in hardware_profiles/loader.py,
which knows units.)
"""

from __future__ import annotations

import math
import os
from typing import Any

from pipeplan.errors import UserError

__all__ = ["Fields", "quote", "shorten"]


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters, "..." marking the cut: a message must stay one short line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote(value: Any, limit: int = 60, *, bare: bool = False) -> str:
    """A value for a one-line message: its repr (its str with `bare`), shortened."""
    return shorten(str(value) if bare else repr(value), limit)


class Fields:
    """Checks fields of one file; every failure names the file, the field path and what it must be."""

    def __init__(self, path: str | os.PathLike[str], hint: str):
        self.path = str(path)
        self.hint = hint

    def fail(self, field: str, value: Any, must: str) -> UserError:
        return UserError(f"{self.path}: {field} is {quote(value)}: must be {must}", self.hint)

    def require(self, doc: Any, key: str, field: str) -> Any:
        if not isinstance(doc, dict):
            raise self.fail(field.rsplit(".", 1)[0] or "the document", doc, "a JSON object")
        if key not in doc:
            raise UserError(f"{self.path}: {field} is missing", self.hint)
        return doc[key]

    def integer(self, value: Any, field: str, low: int = 0, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            must = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
            raise self.fail(field, value, must)
        return value

    def number(self, value: Any, field: str, low: float = 0.0) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= low
        if not ok:
            raise self.fail(field, value, f"a finite number >= {low:g}")
        return float(value)

    def string(self, value: Any, field: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value):
            raise self.fail(field, value, "a non-empty string" if not empty else "a string")
        return value

    def optional_string(self, value: Any, field: str) -> str | None:
        return None if value is None else self.string(value, field, empty=True)

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, value, "true or false")
        return value

    def items(self, value: Any, field: str, *, empty: bool = True) -> list[Any]:
        if not isinstance(value, list) or (not empty and not value):
            raise self.fail(field, value, "a list" if empty else "a non-empty list")
        return value

    def mapping(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, value, "a JSON object")
        return value

    def strings(self, value: Any, field: str, *, empty: bool = True) -> list[str]:
        items = self.items(value, field, empty=empty)
        for i, item in enumerate(items):
            self.string(item, f"{field}[{i}]")
        return items
