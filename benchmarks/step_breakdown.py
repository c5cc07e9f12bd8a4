"""Where a pipeline step's time goes on each rank of `pipeplan run`: compute, waiting on receives, posting sends and
receives, and the rest (torch's bookkeeping between actions, the loss, scaling the gradients).

One command (prints a table; record it in benchmarks/RESULTS.md by hand with the machine):

    python benchmarks/step_breakdown.py PLAN.json [--steps 30] [--rounds 2] [--variants default,first+idle]

For plans that torch's multi-stage schedule runtime runs (interleaved 1F1B, zero bubble, ZB-V, DualPipeV): the
runtime's own worker with a recorder around every op, receive wait and post (benchmarks/step_breakdown_worker.py).
Per rank, the median over measured steps of each part of `schedule.step` (the update after it is not included),
and how many posts a step took over 1 ms: a post is ~0.1 ms; one that takes milliseconds waited for the pair's
lock, which gloo's I/O thread takes when a message arrives (RESULTS.md, "Defaults only"). --variants runs each
round once per variant, alternating: `default` (the runtime as it is), `idle` (gloo's I/O threads at SCHED_IDLE),
`first` (every receive posted at the step's start), `first+idle` (both; benchmarks/gloo_experiments.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "step_breakdown_worker.py"
VARIANTS = ("default", "idle", "first", "first+idle")
PARTS = ("compute", "receive wait", "post")
SLOW_POST_S = 1e-3


def run_once(plan: str, steps: int, warmup: int, variant: str) -> tuple[dict, list[list[dict]]]:
    """`pipeplan run` with the recorder: (its --json result, per rank the measured steps' records)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PIPEPLAN_BREAKDOWN_DIR": tmp, "PIPEPLAN_BREAKDOWN_VARIANT": variant}
        r = subprocess.run(["pipeplan", "run", plan, "--steps", str(steps), "--warmup", str(warmup), "--json",
                            "--worker-script", str(WORKER)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"pipeplan run failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        paths = sorted(Path(tmp).glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
        ranks = [json.loads(p.read_text())[warmup:] for p in paths]
    return json.loads(r.stdout), ranks


def rank_row(steps: list[dict]) -> dict[str, float]:
    """Medians over steps (ms) of the step, each part, the rest, and the count of slow posts a step."""
    per_step = []
    for s in steps:
        parts = {p: sum(b - a for what, a, b in s["intervals"] if what == p) for p in PARTS}
        total = s["end"] - s["start"]
        parts["other"] = total - sum(parts.values())
        parts["step"] = total
        parts["slow posts"] = sum(1 for what, a, b in s["intervals"] if what == "post" and b - a > SLOW_POST_S)
        per_step.append(parts)
    return {k: statistics.median(p[k] for p in per_step) * (1 if k == "slow posts" else 1e3) for k in per_step[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="default", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: each of {', '.join(VARIANTS)}")
    print(f"Command: `python benchmarks/step_breakdown.py {Path(args.plan).name} --steps {args.steps} --rounds "
          f"{args.rounds} --variants {args.variants}`\n")
    print("| round | variant | iteration ms, measured (predicted) | rank | schedule step ms | compute | "
          "receive waits | posting | other | posts over 1 ms a step |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for rnd in range(1, args.rounds + 1):
        for variant in variants:
            result, ranks = run_once(args.plan, args.steps, args.warmup, variant)
            it = f"{result['measured']['iteration_s'] * 1e3:.1f} ({result['predicted']['iteration_s'] * 1e3:.1f})"
            for rank, steps in enumerate(ranks):
                row = rank_row(steps)
                print(f"| {rnd} | {variant} | {it} | {rank} | {row['step']:.1f} | "
                      f"{row['compute']:.1f} | {row['receive wait']:.1f} | {row['post']:.1f} | {row['other']:.1f} | "
                      f"{row['slow posts']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
