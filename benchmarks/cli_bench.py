"""Wall time of the everyday command on GPT-2 small; target < 90 s on this 2-core machine.

    python benchmarks/cli_bench.py [--write-results]

Runs `pipeplan analyze examples/gpt.py --entry build_gpt2_small --profile a100-80gb-sxm --gpus 8`
as a user would (a fresh process, imports included), reads the per-phase progress
lines it prints on stderr, and prints one table. With --write-results it rewrites the
"CLI" section of benchmarks/RESULTS.md (and nothing else in it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HEADING = "## CLI (`benchmarks/cli_bench.py`)"
TARGET_S = 90.0
ARGS = ["analyze", "examples/gpt.py", "--entry", "build_gpt2_small", "--profile", "a100-80gb-sxm", "--gpus", "8"]


def pipeplan_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("pipeplan")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeplan"]


def run() -> tuple[float, dict, list[tuple[str, str]]]:
    # the progress display draws only on a terminal (cli/progress.py); FORCE_COLOR makes rich draw it into the pipe
    env = dict(os.environ, COLUMNS="160", FORCE_COLOR="1")
    t0 = time.perf_counter()
    proc = subprocess.run(pipeplan_cmd() + ARGS + ["--json"], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"pipeplan failed ({proc.returncode}):\n{proc.stderr}")
    # Progress lines end with the elapsed time of their phase (h:mm:ss); each redraw repeats them, the last counts.
    phases: dict[str, str] = {}
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", proc.stderr).replace("\r", "\n")
    for line in text.splitlines():
        line = re.sub("[━╸╺╾╼]", " ", line)  # the bar; names are padded only to the longest one
        m = re.match(r"\s*\S?\s*(trace: .+?|plan: done)\s{2,}.*?(\d+:\d\d:\d\d)\s*$", line)
        if m:
            phases[m.group(1).strip()] = m.group(2)
    return wall, json.loads(proc.stdout), list(phases.items())


def table(wall: float, doc: dict, phases, load: float) -> str:
    plan = doc["plan"]
    p = plan["predicted"]
    lines = [
        "Command: `python benchmarks/cli_bench.py --write-results`, which times  ",
        f"`pipeplan {' '.join(ARGS)}` in a fresh process (imports, trace at batch 1 x 1024 tokens, search, report).  ",
        f"Machine: {os.cpu_count()} cores, load average at start {load:.1f}.",
        "",
        "| phase (from the progress display) | elapsed (h:mm:ss) |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {elapsed} |" for name, elapsed in phases]
    verdict = "meets" if wall < TARGET_S else "MISSES"
    lines += [
        "",
        f"**Total wall time: {wall:.1f} s** (target < {TARGET_S:.0f} s: {verdict} it). "
        f"Plan found: {plan['schedule']}, {len(plan['stages'])} stage(s) x {plan.get('data_parallel', 1)} replica(s), "
        f"{plan['microbatches']} microbatch(es), {p['samples_per_s']:.1f} samples/s predicted; "
        f"{doc.get('evaluated', 0)} configurations evaluated.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true", help="rewrite the CLI section of benchmarks/RESULTS.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    wall, doc, phases = run()
    body = table(wall, doc, phases, load)
    print(body)
    if args.write_results:
        from results import write_section

        write_section(HEADING, body)


if __name__ == "__main__":
    main()
