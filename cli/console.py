"""The console tables go to: full width on a terminal, wide enough when piped.

Piped without COLUMNS, rich assumes 80 columns and squeezes the tables until the
numbers end in "…", which is exactly when people save the output to a file.
"""

from __future__ import annotations

import os

from rich.console import Console


def stdout_console(width: int = 140) -> Console:
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=width)
