"""Run the robustness suite and record how many bad inputs it tried and how each ended.

    python benchmarks/bad_inputs_bench.py [--no-write]

Runs tests/test_bad_inputs_*.py under pytest with PIPEPLAN_BAD_INPUTS_LOG set, so
every case that went through tests/bad_inputs.expect_user_error (exit 2, one
line naming the file or option, no traceback, no stdout, no output or temp file
left) is logged. Each run gets a fresh TMPDIR; afterwards the bench checks that
no `pipeplan-run-*` folder is left in it and that no process started by the suite
(torchrun, a runtime worker or `pipeplan run`) is still alive. The table
counts cases per test file and family (test function) and writes the
"Robustness" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from results import write_section  # noqa: E402

SUITE = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_bad_inputs_*.py"))
MARKERS = ("pipeplan.runtime.worker", "torch.distributed.run", "pipeplan run")


def live_suite_processes(tmp: str) -> list[str]:
    """Command lines of live processes that mention the suite's TMPDIR (everything it started does)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if tmp in env and any(m in cmd for m in MARKERS):
            found.append(cmd[:120])
    return found


def run_suite() -> tuple[int, list[dict], float, list[str], list[str]]:
    tmp = tempfile.mkdtemp(prefix="bad-inputs-bench-")
    log = Path(tmp) / "cases.jsonl"
    env = {**os.environ, "PIPEPLAN_BAD_INPUTS_LOG": str(log), "TMPDIR": tmp}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider", *SUITE],
                       cwd=REPO, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    print(r.stdout[-1500:])
    time.sleep(2)
    cases = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    leftovers = [p.name for p in Path(tmp).glob("pipeplan-run-*")]
    return r.returncode, cases, wall_s, leftovers, live_suite_processes(tmp)


def table(cases: list[dict]) -> str:
    per = Counter(c["test"].split("[")[0] for c in cases)
    rows = ["| test file :: family | cases |", "|---|---:|"]
    rows += [f"| `{name}` | {n} |" for name, n in sorted(per.items())]
    rows.append(f"| **all** | **{len(cases)}** |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    rc, cases, wall_s, leftovers, alive = run_suite()
    body = table(cases)
    verdict = (f"pytest exit {rc}; {len(cases)} bad-input cases, each ended in exit 2 with one line naming the file or "
               "option, no traceback, nothing on stdout, no output or temp file left; and the signal cases (SIGTERM and "
               "SIGINT to `pipeplan run`, SIGTERM to `profiles calibrate`) exited 128 + the signal with no child left "
               "10 s later" if rc == 0 else
               f"pytest exit {rc}: some cases did not end as they should (see the output above)")
    after = (f"TMPDIR after the suite: {len(leftovers)} `pipeplan-run-*` folders left; processes of the suite still "
             f"alive 2 s after it ended: {len(alive)}")
    print(body, verdict, after, sep="\n\n")
    if alive:
        print("\n".join(alive))
    if args.no_write:
        return
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    write_section("## Robustness (`benchmarks/bad_inputs_bench.py`)",
                  f"Command: `python benchmarks/bad_inputs_bench.py` ({machine}; suite wall time {wall_s:.0f} s).\n\n"
                  f"Suite: {', '.join(f'`{s}`' for s in SUITE)}. Every case runs through "
                  "`tests/bad_inputs.expect_user_error`.\n\n"
                  f"{body}\n\n{verdict}.\n\n{after}.")


if __name__ == "__main__":
    main()
