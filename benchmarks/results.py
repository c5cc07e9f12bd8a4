"""Rewrite one section of benchmarks/RESULTS.md, leaving the others alone.

Each benchmark owns one `## ` section; several run at different times, so each
replaces only its own (appending it the first time), atomically.
"""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
sys.path.insert(0, str(RESULTS.parents[1]))  # a source checkout works without installing

from pipeplan._io import atomic_write_text  # noqa: E402


def write_section(heading: str, body: str, path: Path = RESULTS) -> None:
    """Replace the text under `heading` (up to the next `## ` heading) with `body`."""
    text = path.read_text(encoding="utf-8")
    block = f"{heading}\n\n{body.strip()}\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + block + ("\n" + text[nxt + 1:] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    atomic_write_text(path, text)
    print(f"\nwrote the section {heading!r} to {path}")
