"""One entry point for every graph file pipeplan reads.

Commands accept either our own graph JSON or a PipeDream profile; deciding which
by content (not only by extension) keeps `pipeplan plan x.txt` and renamed files
working and gives one clear error for anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeplan.costmodels.graph import Graph, load_graph
from pipeplan.errors import UserError


def load_any_graph(path: str | os.PathLike[str], *, batch_size: int = 1) -> Graph:
    """*.json -> pipeplan graph (pipeplan.graph/v1); PipeDream graph.txt -> imported graph.

    `batch_size` only applies to PipeDream profiles (they do not record it).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such graph file", "pass a graph.json from `pipeplan trace` or a PipeDream graph.txt")
    if p.suffix.lower() == ".json":
        return load_graph(p)
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror})", "check the file's permissions") from None
    text = head.decode("utf-8", errors="replace").lstrip()
    if text.startswith("{"):
        return load_graph(p)
    if "forward_compute_time=" in text:
        from pipeplan.costmodels.pipedream_import import load_pipedream_graph

        return load_pipedream_graph(p, batch_size=batch_size)
    raise UserError(f"{p}: neither a pipeplan graph JSON nor a PipeDream graph.txt",
                    "pass a graph.json from `pipeplan trace` or a PipeDream profiler graph.txt")
