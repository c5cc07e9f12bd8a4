"""Plan snapshots: plan.json for every example and every PipeDream profile, to show a refactor changed nothing.

    python benchmarks/plan_snapshot.py trace GRAPHS/           # trace each example once (graph.json, fixed inputs)
    python benchmarks/plan_snapshot.py plan GRAPHS/ OUT/       # plan each graph under several option sets
    python benchmarks/plan_snapshot.py diff OUT_BEFORE/ OUT_AFTER/

Tracing measures layer times on this CPU, so it is done once and the graphs are
kept: the planner is deterministic given a graph, a profile and the options,
and `plan` then writes the same plan.json byte for byte, except for the
wall-clock fields (`time_s` of the search and of the solvers), which `diff`
blanks before comparing. Plans go through the command line (`pipeplan plan`),
which a refactor of the library underneath must keep stable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROFILES_DIR = REPO / "tests" / "data" / "pipedream-profiles"  # PipeDream's 14 published profiles
EXAMPLES = {  # example file -> (entry, trace batch size)
    "mlp.py": ("build_model", 8),
    "wide_mlp.py": ("build_model", 8),
    "resnet.py": ("build_model", 2),
    "unet.py": ("build_model", 2),
    "gpt.py": ("build_model", 2),
    "hf_gpt2.py": ("build_model", 2),
}
# (profile, devices, extra flags): the search's main axes, every schedule, recomputation and the ILP.
EXAMPLE_RUNS = [
    ("a100-80gb-sxm", 8, []),
    ("v100-16gb-sxm2", 16, ["--schedule", "1f1b", "-b", "256"]),
    ("h100-sxm", 4, ["--schedule", "interleaved", "-b", "32"]),
    ("t4", 8, ["--schedule", "gpipe", "--recompute", "on", "--solver", "ilp"]),
    ("a10g", 6, ["--schedule", "pipedream", "--dtype", "fp32", "--optimizer", "sgd"]),
]
PIPEDREAM_RUNS = [
    ("v100-32gb-sxm2", 8, ["--schedule", "pipedream", "--profiled-batch-size", "64", "-b", "256"]),
    ("a100-40gb-sxm", 16, ["--profiled-batch-size", "64", "-b", "512"]),
]
VOLATILE = {"time_s"}  # wall-clock seconds: the only fields that differ between identical runs


def _cli(args: list[str]) -> int:
    from click.testing import CliRunner

    from pipeplan.cli.main import cli

    res = CliRunner().invoke(cli, args)
    if res.exit_code not in (0, 2):
        sys.stderr.write(res.output)
        if res.exc_info:
            import traceback

            traceback.print_exception(*res.exc_info)
    return res.exit_code


def trace(graphs: Path) -> None:
    graphs.mkdir(parents=True, exist_ok=True)
    for name, (entry, batch) in EXAMPLES.items():
        out = graphs / f"{Path(name).stem}.graph.json"
        rc = _cli(["trace", str(REPO / "examples" / name), "--entry", entry, "-b", str(batch), "-o", str(out)])
        print(f"trace {name}: exit {rc}")
    for path in sorted(PROFILES_DIR.glob("*.graph.txt")):
        shutil.copy(path, graphs / path.name)


def plan(graphs: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for graph in sorted(graphs.iterdir()):
        runs = PIPEDREAM_RUNS if graph.name.endswith(".txt") else EXAMPLE_RUNS
        for i, (profile, gpus, extra) in enumerate(runs):
            dest = out / f"{graph.name.split('.')[0]}.{i}.{profile}.json"
            rc = _cli(["plan", str(graph), "--profile", profile, "--gpus", str(gpus), *extra, "-o", str(dest)])
            if rc:  # an infeasible request is a result too: record the exit code
                dest.with_suffix(".exit").write_text(f"{rc}\n")
            print(f"{dest.name}: exit {rc}")


def _scrub(x):
    if isinstance(x, dict):
        return {k: (None if k in VOLATILE else _scrub(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def diff(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    bad = 0
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            print(f"{name}: only in {'after' if not a.exists() else 'before'}")
            bad += 1
            continue
        if name.endswith(".json"):
            same = _scrub(json.loads(a.read_text())) == _scrub(json.loads(b.read_text()))
        else:
            same = a.read_text() == b.read_text()
        if not same:
            print(f"{name}: differs")
            bad += 1
    print(f"{len(names)} files compared, {bad} differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("trace").add_argument("graphs", type=Path)
    p = sub.add_parser("plan")
    p.add_argument("graphs", type=Path)
    p.add_argument("out", type=Path)
    d = sub.add_parser("diff")
    d.add_argument("before", type=Path)
    d.add_argument("after", type=Path)
    a = ap.parse_args()
    if a.cmd == "trace":
        trace(a.graphs)
    elif a.cmd == "plan":
        plan(a.graphs, a.out)
    else:
        return diff(a.before, a.after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
