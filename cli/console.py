"""The consoles tables go to: full width on a terminal; piped, plain lines a program or a file can take.

Piped without COLUMNS, rich assumes 80 columns and squeezes the tables until
cells wrap ("33.6 / MFLOP") or end in "…", exactly when people save the output
to a file; and it pads every line with spaces to the table's width. Piped, the
console is wide enough that no table wraps, and trailing spaces are dropped.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console

PIPED_WIDTH = 400
"""Columns of a piped console: wider than any table pipeplan draws, so none wraps."""


class _StripTrailing:
    """A text stream that drops the spaces rich pads each line with."""

    def __init__(self, out: TextIO):
        self.out = out
        self.pending = ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            self.out.write(line.rstrip(" ") + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.out.write(self.pending.rstrip(" "))
            self.pending = ""
        self.out.flush()

    def isatty(self) -> bool:
        return False


def stdout_console() -> Console:
    """The console for stdout: the terminal's, or piped, PIPED_WIDTH (COLUMNS if set) without padding."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS")
    return Console(file=_StripTrailing(sys.stdout), width=int(columns) if columns and columns.isdigit() else PIPED_WIDTH)

