"""Where one `pipeplan analyze` spends its time: wall seconds inside a few functions, in one process.

    python benchmarks/analyze_phases.py [ANALYZE ARGS ...]

With no arguments it times README's first command. Each phase is the total wall time spent inside
that function (calls nest: the search's phases are inside `run_search`). The functions are ones
every version of the planner since issue 15 has, so the same script times an older checkout
(copy it out of the tree first). Why not cProfile: its per-call cost doubles the DP's and the
simulator's times, which are millions of small calls.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

README = ["examples/llama-3-70b.json", "--seq-len", "4096", "--profile", "h100-sxm", "--gpus", "64", "-b", "256"]


def _timed(owner: Any, name: str, label: str, spent: Counter[str]) -> None:
    """Replace owner.name with a wrapper adding its wall time to spent[label]."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def main(argv: list[str]) -> int:
    from pipeplan.cli import workflow
    from pipeplan.cli.main import main as cli_main
    from pipeplan.costmodels import fvcheck
    from pipeplan.planner import dp, predict

    spent: Counter[str] = Counter()
    phases = [(workflow, "load_input_graph", "load and trace the model"),
              (fvcheck, "compare", "  of it: fvcore cross-check"),
              (workflow, "run_search", "search"),
              (predict, "_simulate", "  of it: schedule simulations"),
              (dp._Chain, "set_capacity", "  of it: DP memory walks (set_capacity)"),
              (dp._Chain, "reach", "  of it: DP reach passes")]
    for owner, name, label in phases:
        _timed(owner, name, label, spent)
    args = ["analyze", *(argv or README)]
    sys.argv = ["pipeplan", *args]
    t0 = time.perf_counter()
    try:
        cli_main()
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    total = time.perf_counter() - t0
    print(f"pipeplan {' '.join(args)}: exit {code}, {total:.2f} s", file=sys.stderr)
    for _, _, label in phases:
        print(f"{label:42s} {spent[label]:7.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
