"""How often the DP's memory agrees with the prediction's, on searches where memory binds.

    python benchmarks/dp_memory_bench.py [--write-results]

The DP prices a layer range with `RangeMemory` (prefix sums, a device of several virtual stages as copies of the
range); every partition it returns is predicted, and the prediction walks each device over its order
(planner/walks.py). A DP partition the prediction finds over memory is lost to that configuration unless the search
asks the DP again under less (`search.REFITS`). Each case is `pipeplan analyze` run in this process three ways:
the DP without the sends torch keeps to the step's end (as before they were priced there) and no refits; with the
sends; with the sends and refits (the default). Counted over every configuration the search partitions: DP
partitions predicted, those over memory, the refits' partitions and those of them that fit, and the plan found.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## The DP's memory against the prediction's (`benchmarks/dp_memory_bench.py`)"

CASES = [
    ("llama-3-70b, README's example", ["analyze", "examples/llama-3-70b.json", "--seq-len", "4096", "--profile",
                                       "h100-sxm", "--gpus", "64", "-b", "256"]),
    ("llama-3-70b, 256 GPUs", ["analyze", "examples/llama-3-70b.json", "--seq-len", "8192", "--profile", "h100-sxm",
                               "--gpus", "256", "-b", "1024", "--mixed-precision", "deepspeed"]),
    ("llama-2-7b model file", ["analyze", "examples/llama2_7b.py", "--profile", "a100-80gb-sxm", "--gpus", "32",
                               "-b", "512"]),
]
MODES = [("counts, no refit", False, 0), ("sends, no refit", True, 0), ("sends + refits (default)", True, None)]


def run(args: list[str], sends: bool, refits: int | None) -> tuple[Counter, dict, float]:
    """One analysis in this process with the DP's pricing and refits as asked: the counts, the plan, seconds."""
    from pipeplan.cli.main import cli
    from pipeplan.planner import problem, search

    counts: Counter = Counter()
    real_walks, real_keeps, real_refits = problem.walks, problem.keeps_sends, search.REFITS
    consider, predict_new = search._Search.consider, search._Search.predict_new

    def counted_predict_new(self, cfg, parts, mb, seen, capacity):
        self._refitting = capacity < self.cap
        return predict_new(self, cfg, parts, mb, seen, capacity)

    def counted_consider(self, cfg, part, mb):
        failed = len(self.failures)
        plan = consider(self, cfg, part, mb)
        if part.solver.get("name") == "dp" and getattr(self, "_refitting", None) is not None:
            kind = "refit" if self._refitting else "dp"
            counts[kind] += 1
            if plan is None and len(self.failures) > failed and self.failures[-1].how == "exact":
                counts[kind + " over"] += 1
            elif plan is not None:
                counts[kind + " fits"] += 1
        return plan

    problem.walks, problem.keeps_sends = (real_walks, real_keeps) if sends else ((lambda s: False), (lambda s: False))
    search.REFITS = real_refits if refits is None else refits
    search._Search.consider, search._Search.predict_new = counted_consider, counted_predict_new
    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                cli.main(args=[*args, "--json"], prog_name="pipeplan")
    finally:
        problem.walks, problem.keeps_sends, search.REFITS = real_walks, real_keeps, real_refits
        search._Search.consider, search._Search.predict_new = consider, predict_new
    return counts, json.loads(out.getvalue())["plan"], time.perf_counter() - t0


def describe(plan: dict) -> str:
    p = plan["predicted"]
    chunks = f" x {plan['chunks']} chunks" if plan["chunks"] > 1 else ""
    return (f"{plan['schedule']} {len(plan['stages']) // plan['chunks']} stages{chunks} x {plan['data_parallel']}, "
            f"M={plan['microbatches']}, {plan['sharding']}: {p['samples_per_s']:.2f} samples/s, "
            f"{p['peak_memory_bytes'] / 2**30:.2f} GiB")


def table() -> str:
    lines = [
        "Command: `python benchmarks/dp_memory_bench.py --write-results` (each case `pipeplan analyze ... --json` in one "
        "process, three ways).  ",
        f"Machine: {os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.1f}.  ",
        "DP pricing: `counts`, a walked device's kept outputs counted as for one stage a device (the sends not priced; "
        "the caches already keyed on M and the granularity, so not quite the old search); `sends`, the sends torch "
        "keeps to the step's end priced at the device's fullest point; `refits`, a DP partition the prediction finds "
        "over memory asked again under the capacity less the excess. Counted over every configuration partitioned: "
        "DP partitions predicted and those over memory (each lost to its configuration), the refits' partitions and "
        "those that fit; the plan found; s: wall time of the analysis.",
        "",
        "| case | DP pricing | DP partitions predicted | over memory | refits predicted | refits that fit | plan found | s |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, args in CASES:
        for mode, sends, refits in MODES:
            counts, plan, seconds = run(args, sends, refits)
            lines.append(f"| {name} | {mode} | {counts['dp']} | {counts['dp over']} | {counts['refit']} | "
                         f"{counts['refit fits']} | {describe(plan)} | {seconds:.0f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true", help="rewrite this section of benchmarks/RESULTS.md")
    args = ap.parse_args()
    os.chdir(ROOT)
    body = table()
    if args.write_results:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from results import write_section

        write_section(HEADING, body)


if __name__ == "__main__":
    main()
