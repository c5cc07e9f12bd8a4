"""Planner benchmark: solver speed, PipeDream reproduction, ILP, and plan quality vs baselines.

    python benchmarks/planner_bench.py                  # print the tables
    python benchmarks/planner_bench.py --write-results  # and replace the Planner section of RESULTS.md

Sections:
1. PipeDream mode on the 14 PipeDream profiles (flat 4/8/16 workers at 1 GB/s, and
   2 nodes x 4 workers at 10 GB/s inside / 1 GB/s between): our solve time, optimum
   and configuration, against our re-implementation of PipeDream's own optimizer
   (benchmarks/pipedream_reference.py) run in a subprocess with a time cap.
2. DP solve time on random chains (100 / 1,000 / 10,000 layers into 8 / 64 / 512 stages).
3. ILP time to a proven optimum on a 200-node branchy DAG into 8 stages.
4. Plan quality on every example model: predicted samples/s of pipeplan's plan over
   equal layer counts, DeepSpeed partition_method="parameters" and torchgpipe
   balance_by_time, same stages / microbatches / schedule (planner/baselines.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = REPO / "tests" / "data" / "pipedream-profiles"
sys.path.insert(0, str(REPO))

GBPS = 1e9
PD_CONFIGS = {
    "4": [(4, GBPS)],
    "8": [(8, GBPS)],
    "16": [(16, GBPS)],
    "2x4": [(4, 10 * GBPS), (2, GBPS)],
}
SECTION = "## Planner (`benchmarks/planner_bench.py`)"


def _levels(spec):
    from pipeplan.hardware_profiles.profile import Link

    return [(n, Link("pipedream", bw, 0.0)) for n, bw in spec]


def _config_text(part) -> str:
    sizes = []
    for s in range(len(part.replicas)):
        sizes.append(f"{part.assignment.count(s)}x{part.replicas[s]}")
    text = " ".join(sizes)
    return text if len(text) <= 60 else text[:57] + "..."


MAX_STATES = 5000


def reference_in_subprocess(path: Path, spec, timeout_s: float):
    args = [sys.executable, str(HERE / "pipedream_reference.py"), str(path), "-n", *[str(n) for n, _ in spec],
            "-b", *[repr(bw) for _, bw in spec], "--max-states", str(MAX_STATES)]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        return None, None
    except subprocess.CalledProcessError as e:
        if e.returncode == 3:
            return f"> {MAX_STATES} antichain states", time.perf_counter() - t0
        return f"error: {e.stderr.strip().splitlines()[-1] if e.stderr.strip() else e.returncode}", None
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def pipedream_section(ref_timeout_s: float, only: list[str] | None) -> list[str]:
    from pipeplan.costmodels.pipedream_import import load_pipedream_graph
    from pipeplan.planner.pipedream import partition_pipedream
    from pipeplan.planner.problem import build_problem

    lines = [
        "### PipeDream mode on PipeDream's 14 profiles",
        "",
        f"Objective: PipeDream's (time per profiled minibatch of the slowest stage, compute + all-reduce summed). "
        f"Flat clusters at 1 GB/s; `2x4` = 4 workers at 10 GB/s inside each of 2 nodes at 1 GB/s. "
        f"Config = layers x replicas per stage. Reference = our re-implementation of PipeDream's optimizer "
        f"(`--use_fewer_machines` semantics), in a subprocess capped at {ref_timeout_s:.0f} s.",
        "",
        "| profile | workers | ours (s) | solve (s) | PipeDream ref (s) | ref time (s) | same? | config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    matches = total = 0
    for path in sorted(SHARED.glob("*.graph.txt")):
        name = path.name[: -len(".graph.txt")]
        if only and name not in only:
            continue
        graph = load_pipedream_graph(path)
        problem = build_problem(graph, None, microbatch_size=1, times="measured")
        for label, spec in PD_CONFIGS.items():
            t0 = time.perf_counter()
            part = partition_pipedream(problem, _levels(spec))
            solve_s = time.perf_counter() - t0
            ref, ref_s = reference_in_subprocess(path, spec, ref_timeout_s)
            if isinstance(ref, float):
                total += 1
                same = abs(ref - part.bottleneck_s) <= 1e-9 * max(ref, 1e-12)
                matches += same
                verdict = "yes" if same else ("better" if part.bottleneck_s < ref else "NO")
                ref_text, ref_time = f"{ref:.6g}", f"{ref_s:.2f}"
            elif ref is None:
                verdict, ref_text, ref_time = "-", "timeout", f"> {ref_timeout_s:.0f}"
            else:
                verdict, ref_text, ref_time = "-", ref, "-" if ref_s is None else f"{ref_s:.1f} (gave up)"
            lines.append(f"| {name} | {label} | {part.bottleneck_s:.6g} | {solve_s:.3f} | {ref_text} | {ref_time} | "
                         f"{verdict} | {_config_text(part)} |")
            print(lines[-1], flush=True)
    lines += ["", f"Same optimum as the reference in {matches} of {total} cases where the reference finished.", ""]
    return lines


def dp_section(repeats: int) -> list[str]:
    from pipeplan.hardware_profiles.profile import Link
    from pipeplan.planner.dp import partition_dp
    from pipeplan.planner.problem import chain_problem

    intra, inter = Link("nvlink", 300e9, 5e-6), Link("ib", 25e9, 1e-5)

    def link(b):  # 8 devices per node
        return inter if b % 8 == 7 else intra

    lines = ["### DP on random chains", "",
             "Random per-layer times (0.1-1 ms) and cut sizes (0-8 MB), 8 devices per node (every 8th boundary "
             f"on the slow link). Median of {repeats} solves.", "",
             "| layers | stages | solve (s) | bisection steps |", "|---|---|---|---|"]
    rng = random.Random(0)
    for n in (100, 1000, 10000):
        comp = [rng.uniform(1e-4, 1e-3) for _ in range(n)]
        cuts = [rng.randint(0, 8_000_000) for _ in range(n - 1)]
        problem = chain_problem(comp, cut_bytes=cuts)
        for k in (8, 64, 512):
            if k > n:
                continue
            times = []
            steps = 0
            for _ in range(repeats if n * k < 1_000_000 else 1):
                t0 = time.perf_counter()
                part = partition_dp(problem, k, link=link)
                times.append(time.perf_counter() - t0)
                steps = part.solver["iterations"]
            lines.append(f"| {n} | {k} | {statistics.median(times):.3f} | {steps} |")
            print(lines[-1], flush=True)
    lines.append("")
    return lines


def block_dag(n_target: int, seed: int):
    """Inception-like DAG: blocks of 1-4 parallel branches of 1-3 nodes joined by a concat."""
    from pipeplan.planner.problem import dag_problem

    rng = random.Random(seed)
    comp, edges = [rng.uniform(1e-4, 1e-3)], []
    prev, n = 0, 1
    while n < n_target - 1:
        ends = []
        for _ in range(rng.randint(1, 4)):
            last = prev
            for _ in range(rng.randint(1, 3)):
                comp.append(rng.uniform(1e-4, 1e-3))
                edges.append((last, n, rng.randint(100_000, 4_000_000)))
                last, n = n, n + 1
            ends.append(last)
        comp.append(rng.uniform(1e-6, 5e-5))
        edges += [(e, n, rng.randint(100_000, 4_000_000)) for e in ends]
        prev, n = n, n + 1
    return dag_problem(comp, edges)


def ilp_section() -> list[str]:
    from pipeplan.hardware_profiles.profile import Link
    from pipeplan.planner.dp import partition_dp
    from pipeplan.planner.ilp import partition_ilp

    link = Link("pcie", 25e9, 1e-5)
    lines = ["### ILP (PuLP + CBC, 1 thread) to a proven optimum", "",
             "Inception-like random DAGs (parallel branches joined by concats), 8 stages, warm start from the DP.", "",
             "| nodes | seed | DP (ms) | ILP (ms) | status | gap | ILP time (s) |", "|---|---|---|---|---|---|---|"]
    for seed in (1, 2, 3):
        problem = block_dag(200, seed)
        dp = partition_dp(problem, 8, link=link)
        t0 = time.perf_counter()
        got = partition_ilp(problem, 8, link=link, warm_start=dp, time_limit_s=120)
        secs = time.perf_counter() - t0
        lines.append(f"| {problem.n} | {seed} | {dp.bottleneck_s * 1e3:.4f} | {got.bottleneck_s * 1e3:.4f} | "
                     f"{got.solver['status']} | {got.solver['gap']:.2%} | {secs:.2f} |")
        print(lines[-1], flush=True)
    lines.append("")
    return lines


def quality_section(profile_name: str, devices: int, batch: int, microbatches: int) -> list[str]:
    from pipeplan.costmodels.compute import layer_times_s
    from pipeplan.costmodels.trace import trace
    from pipeplan.errors import UserError
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.baselines import deepspeed_parameters, equal_layers, torchgpipe_balance_by_time
    from pipeplan.planner.predict import evaluate
    from pipeplan.planner.request import PlanRequest
    from pipeplan.planner.search import search

    profile = load_profile(profile_name)
    lines = ["### Plan quality against baselines (predicted samples/s ratio, same configuration)", "",
             f"Profile `{profile_name}`, 1F1B, {devices} pipeline stages (no data parallelism), batch {batch}, "
             f"{microbatches} microbatches, fp32, no recomputation; graphs traced at batch 1 on this machine, "
             "times from the roofline model. Ratio = pipeplan / baseline (>1: pipeplan faster). torchgpipe "
             "balances the same per-layer model times it would measure on the device.", "",
             "| example | layers | pipeplan samples/s | chosen candidate | vs equal layers | vs DeepSpeed parameters "
             "| vs torchgpipe time | DP candidates only, vs equal layers |",
             "|---|---|---|---|---|---|---|---|"]
    for model in sorted((REPO / "examples").glob("*.py")):
        try:
            # roofline times only (below), so the model is built without weights: Llama-2-7B does not fit here
            graph = trace(str(model), 1, time_layers=False)
        except Exception as e:  # an example that cannot trace here is reported, not fatal
            lines.append(f"| {model.stem} | - | trace failed: {type(e).__name__} | | | | | |")
            print(lines[-1], flush=True)
            continue
        n = len(graph.layers)
        k = min(devices, n)
        common = dict(schedule="1f1b", microbatches=microbatches, batch_size=batch, recompute=False, data_parallel=1)
        try:
            best = search(graph, profile, PlanRequest(devices=k, batch_size=batch, schedule="1f1b", stages=k, microbatches=microbatches, data_parallel=1, recompute="off")).best
            dp_only = search(graph, profile, PlanRequest(devices=k, batch_size=batch, schedule="1f1b", stages=k, microbatches=microbatches, data_parallel=1, recompute="off", heuristics=False)).best
        except UserError as e:
            lines.append(f"| {model.stem} | {n} | infeasible: {e.message} | | | | | |")
            continue
        fwd, bwd = layer_times_s(graph, profile, times="model", samples=batch // microbatches)
        baselines: dict[str, list[int] | None] = {
            "equal": equal_layers(n, k),
            "deepspeed": deepspeed_parameters([l.param_bytes / 4 for l in graph.layers], k),
        }
        try:
            baselines["torchgpipe"] = torchgpipe_balance_by_time([f + b for f, b in zip(fwd, bwd, strict=True)], k)
        except ValueError:  # torchgpipe's own moves can empty a stage: no split to compare with
            baselines["torchgpipe"] = None
        ratios, plans = [], {}
        for name, assignment in baselines.items():
            if assignment is None:
                ratios.append("n/a (balance_by_time emptied a stage)")
                continue
            plan = plans[name] = evaluate(graph, profile, assignment, **common)
            fits = plan.predicted.peak_memory_bytes <= profile.usable_memory_bytes
            ratios.append(f"{best.predicted.samples_per_s / plan.predicted.samples_per_s:.2f}x" + ("" if fits else " (OOM)"))
        dp_ratio = dp_only.predicted.samples_per_s / plans["equal"].predicted.samples_per_s
        lines.append(f"| {model.stem} | {n} | {best.predicted.samples_per_s:.1f} | {best.solver.get('name')} | "
                     + " | ".join(ratios) + f" | {dp_ratio:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "The search simulates several candidate partitions per configuration and keeps the fastest: the "
              "DP's optima for its bottleneck objective (compute + boundary sends, summed or overlapped) and the "
              "equal-layers and time-balanced splits. The last column restricts it to the DP candidates: the "
              "DP minimises the slowest stage, while the simulator also charges pipeline fill/drain and link "
              "latency, so on these microsecond-scale toy stages the bottleneck proxy can lose to a naive split.", ""]
    return lines


def write_results(body: list[str], command: str) -> None:
    from results import write_section

    write_section(SECTION, "\n".join([f"Command: `{command}`", "", *body]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true", help="replace the Planner section of RESULTS.md")
    ap.add_argument("--ref-timeout", type=float, default=30.0, help="cap on each PipeDream reference run (s)")
    ap.add_argument("--profiles", nargs="*", default=None, help="only these PipeDream profiles")
    ap.add_argument("--skip", nargs="*", default=[], choices=["pipedream", "dp", "ilp", "quality"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality-profile", default="a100-80gb-sxm")
    args = ap.parse_args(argv)
    body: list[str] = []
    if "pipedream" not in args.skip and SHARED.is_dir():
        body += pipedream_section(args.ref_timeout, args.profiles)
    if "dp" not in args.skip:
        body += dp_section(args.repeats)
    if "ilp" not in args.skip:
        body += ilp_section()
    if "quality" not in args.skip:
        body += quality_section(args.quality_profile, devices=4, batch=64, microbatches=8)
    print("\n".join(body))
    if args.write_results:
        command = "python benchmarks/planner_bench.py " + " ".join(a for a in (argv or sys.argv[1:]))
        write_results(body, command.strip())


if __name__ == "__main__":
    main()
