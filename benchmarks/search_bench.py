"""Search and simulator speed: how long `planner.search.search` and `planner.simulate.simulate` take.

Target (issue 4 / search brief): a GPT-2-small graph on 8 devices is searched in a few seconds at most.

    python benchmarks/search_bench.py                  # print the tables
    python benchmarks/search_bench.py --write-results  # and rewrite our section of RESULTS.md

The GPT-shaped graphs are built by hand with Narayanan et al. (2021) App. A FLOPs and Korthikanti et al.
(2022) activation bytes (tests/search_fixtures.py), so the benchmark needs no tracing; the search's cost
depends on the layer count, which matches a depth-1 trace (embedding, blocks, head). PipeDream graphs are
the published profiles in tests/data/pipedream-profiles (planned with their measured times).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from pipeplan.hardware_profiles import load_profile  # noqa: E402
from pipeplan.planner.request import PlanRequest  # noqa: E402
from pipeplan.planner.search import search  # noqa: E402
from pipeplan.planner.simulate import simulate  # noqa: E402
from search_fixtures import gpt_like  # noqa: E402

SECTION = "## Search and schedule simulation (`benchmarks/search_bench.py`)"
COMMAND = "python benchmarks/search_bench.py --write-results"
SHARED = ROOT / "tests" / "data" / "pipedream-profiles"


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def simulator_rows(repeats: int) -> list[list[str]]:
    rows = []
    for schedule, K, M, v in [("gpipe", 8, 64, 1), ("1f1b", 8, 64, 1), ("1f1b", 16, 128, 1),
                              ("interleaved", 8, 64, 4), ("pipedream", 8, 64, 1)]:
        S = K * v
        fwd, bwd, send = [1.0 + 0.1 * (s % 3) for s in range(S)], [2.0] * S, [0.1] * S
        for keep in (False, True):
            run = functools.partial(simulate, schedule, fwd, bwd, send, M, chunks=v, keep_events=keep)
            t = _median_time(run, repeats)
            ops = 2 * S * M * (1 if schedule != "pipedream" else 3 + -(-2 * K // M))
            rows.append([schedule, str(K), str(v), str(M), "yes" if keep else "no", str(ops), f"{t * 1e3:.1f}"])
    return rows


def search_cases():
    cases = [
        ("GPT-2 small shape (12 x 768)", lambda: gpt_like(), "a100-40gb-sxm", 8, 64, "auto", "model"),
        ("GPT-2 small shape (12 x 768)", lambda: gpt_like(), "a100-40gb-sxm", 8, 512, "auto", "model"),
        ("GPT-2 small shape (12 x 768)", lambda: gpt_like(), "v100-16gb-sxm2", 16, 256, "all", "model"),
        ("GPT-2 XL shape (48 x 1600)", lambda: gpt_like(blocks=48, hidden=1600, batch=4), "v100-16gb-sxm2", 8, 64,
         "auto", "model"),
        ("GPT-2 XL shape (48 x 1600)", lambda: gpt_like(blocks=48, hidden=1600, batch=4), "v100-16gb-sxm2", 32, 512,
         "auto", "model"),
    ]
    for name in ("vgg16", "resnet50", "gnmt"):
        path = SHARED / f"{name}.graph.txt"
        if path.is_file():
            def load(path=path):
                from pipeplan.costmodels.load import load_any_graph

                return load_any_graph(path)

            cases.append((f"PipeDream {name}", load, "v100-16gb-sxm2", 8, 256, "all", "measured"))
    return cases


def search_rows() -> list[list[str]]:
    rows = []
    for label, build, prof_name, devices, batch, schedule, times in search_cases():
        graph = build()
        profile = load_profile(prof_name)
        t0 = time.perf_counter()
        res = search(graph, profile, PlanRequest(devices=devices, batch_size=batch, schedule=schedule, times=times))
        elapsed = time.perf_counter() - t0
        b = res.best
        stages = len(b.stages) // b.chunks
        config = f"{b.schedule} K={stages}" + (f" v={b.chunks}" if b.chunks > 1 else "")
        config += (f" d={b.data_parallel}" if b.schedule != "pipedream" else f" r={[s.replicas for s in b.stages]}")
        config += f" M={b.microbatches}" + (" rc" if b.recompute else "")
        base = res.baseline
        ratio = b.predicted.samples_per_s / base.predicted.samples_per_s if base and base.predicted.fits else None
        rows.append([label, str(len(graph.layers)), prof_name, str(devices), str(batch), schedule,
                     f"{elapsed:.2f}", str(res.evaluated), str(res.pruned), str(res.infeasible), config,
                     f"{b.predicted.samples_per_s:.1f}", f"{ratio:.3f}" if ratio else "baseline OOM"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true", help="rewrite our section of benchmarks/RESULTS.md")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sim = table(["schedule", "K", "v", "M", "events kept", "compute ops", "median ms"], simulator_rows(args.repeats))
    print(sim, flush=True)
    print()
    srch = table(["graph", "layers", "profile", "devices", "batch", "schedules", "search s", "evaluated", "pruned",
                  "infeasible", "best", "samples/s", "vs equal layers"], search_rows())
    print(srch)
    if args.write_results:
        text = (f"Command: `{COMMAND}`\n\n"
                "Simulator: one call, stage times uneven (1.0-1.2 fwd, 2.0 bwd), sends 0.1.\n\n" + sim + "\n\n"
                "Search: wall time of one `search()` call (target: GPT-2 small on 8 devices in a few seconds). "
                "`vs equal layers` = predicted samples/s of the best plan / the equal-layer-count split with the "
                "same configuration.\n\n" + srch + "\n")
        from results import write_section

        write_section(SECTION, text)


if __name__ == "__main__":
    main()
