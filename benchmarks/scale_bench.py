"""Planning models that need pipelines, on this machine: wall time and peak memory of `pipeplan analyze`.

    python benchmarks/scale_bench.py [--write-results] [--only NAME ...]

Each case is the command a user types, run in a fresh process under /usr/bin/time
(wall seconds and peak resident memory of the whole process tree's largest
process), against the targets of issue 15. The models are traced without their
weights (catalogue profiles use no measured layer times), so a 405B-parameter
configuration plans on a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Planning at scale (`benchmarks/scale_bench.py`)"
GIB = 2**30


@dataclass(frozen=True)
class Case:
    name: str
    args: list[str]
    wall_s: float  # target
    rss_gib: float | None  # target (None: none stated)
    must_fit: bool


CASES = [
    Case("llama-3-70b, README's example", ["analyze", "examples/llama-3-70b.json", "--seq-len", "4096", "--profile",
                                          "h100-sxm", "--gpus", "64", "-b", "256"], 60, 4, True),
    # nothing fits under `pipeplan run`'s autocast on 16 GPUs: the time to say by how much and what would fit
    # (planner/diagnose.py; on 64 GPUs a 32-stage pipeline now fits, as README says)
    Case("llama-3-70b, nothing fits", ["analyze", "examples/llama-3-70b.json", "--seq-len", "8192", "--profile",
                                       "h100-sxm", "--gpus", "16", "-b", "256"], 60, 4, False),
    # the larger jobs as a framework trains them (DeepSpeed's recipe: 16-bit weights and activations), which is
    # how they are planned for one; under `pipeplan run`'s autocast neither fits these GPU counts at 8,192 tokens
    Case("llama-3-70b", ["analyze", "examples/llama-3-70b.json", "--seq-len", "8192", "--profile", "h100-sxm",
                         "--gpus", "256", "-b", "1024", "--mixed-precision", "deepspeed"], 60, 4, True),
    Case("llama-3.1-405b", ["analyze", "examples/llama-3.1-405b.json", "--seq-len", "8192", "--profile", "h100-sxm",
                            "--gpus", "1024", "-b", "1024", "--mixed-precision", "deepspeed"], 120, 6, False),
    Case("llama-2-7b model file", ["analyze", "examples/llama2_7b.py", "--profile", "a100-80gb-sxm", "--gpus", "32",
                                   "-b", "512"], 60, 4, False),
    Case("gpt-2 small", ["analyze", "examples/gpt.py", "--entry", "build_gpt2_small", "--profile", "a100-80gb-sxm",
                         "--gpus", "8"], 10, None, True),
]


def pipeplan_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("pipeplan")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeplan"]


def run_case(case: Case) -> dict[str, object]:
    """Run one command; its wall time, peak RSS, exit code and (when it planned) the plan's headline."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "time.txt"
        cmd = ["/usr/bin/time", "-f", "%e %M", "-o", str(stats), *pipeplan_cmd(), *case.args, "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, COLUMNS="160"))
        wall = time.perf_counter() - t0
        fields = stats.read_text().split()
    out: dict[str, object] = {"wall_s": wall, "rss_gib": int(fields[-1]) * 1024 / GIB, "exit": proc.returncode}
    if proc.returncode == 0:
        plan = json.loads(proc.stdout)["plan"]
        p = plan["predicted"]
        out["plan"] = (f"{plan['schedule']}, {len(plan['stages']) // plan['chunks']} stages"
                       f"{' x ' + str(plan['chunks']) + ' chunks' if plan['chunks'] > 1 else ''}"
                       f" x {plan['data_parallel']} replicas, M={plan['microbatches']}"
                       f"{', recompute' if plan['recompute'] else ''}"
                       f"{', ' + plan['sharding'] if plan.get('sharding', 'none') != 'none' else ''}; "
                       f"{p['samples_per_s']:.2f} samples/s, "
                       f"peak {p['peak_memory_bytes'] / GIB:.1f} GiB")
        out["layers"] = plan["graph"]["layers"]
    else:
        out["plan"] = (proc.stderr.strip().splitlines() or ["(no message)"])[-1][:240]
    return out


def table(rows: list[tuple[Case, dict[str, object]]], load: float) -> str:
    lines = [
        "Command: `python benchmarks/scale_bench.py --write-results`: each row is `pipeplan <command> --json` in a "
        "fresh process under `/usr/bin/time` (wall time; peak RSS of the process).  ",
        f"Machine: {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB, "
        f"load average at start {load:.1f}.",
        "",
        "| case | command | layers | wall s (target) | peak RSS GiB (target) | result |",
        "|---|---|---:|---:|---:|---|",
    ]
    for case, r in rows:
        wall, rss = float(r["wall_s"]), float(r["rss_gib"])  # type: ignore[arg-type]
        ok_wall = "✓" if wall < case.wall_s else "✗"
        rss_txt = f"{rss:.2f}" + (f" (< {case.rss_gib}) {'✓' if rss < case.rss_gib else '✗'}" if case.rss_gib else "")
        fit = "" if r["exit"] == 0 or not case.must_fit else " ✗ (must fit)"
        lines.append(f"| {case.name} | `pipeplan {' '.join(case.args)}` | {r.get('layers', '—')} | "
                     f"{wall:.1f} (< {case.wall_s:.0f}) {ok_wall} | {rss_txt} | exit {r['exit']}: {r['plan']}{fit} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true", help="rewrite this section of benchmarks/RESULTS.md")
    ap.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = [(c, run_case(c)) for c in CASES if args.only is None or c.name in args.only]
    body = table(rows, load)
    print(body)
    if args.write_results:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from results import write_section

        write_section(HEADING, body)


if __name__ == "__main__":
    main()
