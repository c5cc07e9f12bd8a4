"""Recomputation benchmark: what a stage's re-run really costs against what the planner charges for it.

One command (prints a table; --write-results also rewrites its section of benchmarks/RESULTS.md):

    python benchmarks/recompute_bench.py --write-results

For each example: trace on one thread (a local device) at the microbatch size, take pipeplan's own 2- and 4-stage
1F1B splits (planned with recomputation on the traced times), cut the model into those stage modules as
`pipeplan run` does (runtime/split.py), and time each stage's forward + backward with and without the runtime's
recomputation (runtime/recompute.py) in one process, alternating the two. The re-run is the per-pair difference
(median over pairs): no pipeline, no second process, so the host's drift between a trace and a run does not enter.
Predicted as the planner prices it on a local profile: `costmodels.recompute.rerun_forward_s` on the traced layer
times (the re-run up to the stage's last saved tensor) plus `checkpoint_overhead_s` (torch's checkpoint's host time
per region and per saved tensor, measured at the start as `profiles calibrate` measures it; the planner also
prices reading the stage's input back from DRAM, `cold_read_s`, one tensor a stage, left out here); beside it, the
re-run alone and the whole forward the planner charged before. Errors are of the recomputed stage's step (its
measured forward + backward + re-run against the same with the re-run priced each way).

The second table splits every stage's backward but the first as zero bubble does, through torch's own
`stage_backward_input` (B) and `stage_backward_weight` (W), and times B + W with and without recomputation the same
way. W calls autograd once per parameter group and the checkpoint re-runs the forward for each call, so the planner
charges (1 + groups) re-runs (`costmodels.recompute.weight_grad_passes`); beside it, the two re-runs it charged
before. The first stage is left out: torch runs its whole backward as W, one re-run, as in the first table.

The third table times the same stages without recomputation, a whole backward against torch's B + W, alternating
the two, both seeded with the same contiguous gradients (runtime/split_cost.py, what `analyze` measures on a local
profile): the split's extra is the per-pair difference. Predicted by `costmodels.split_backward.split_backward_extra_s`:
per split + per parameter group (measured at the start as `profiles calibrate` measures them) + the output gradients
W reads back from memory at the copy bandwidth (measured at the start as calibrate does). Errors are of the split
stage's step (measured forward + whole backward + extra against the same with the extra predicted, or with none,
as before: B + W = the whole backward).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Recomputation's re-run (`benchmarks/recompute_bench.py`)"
# (example, microbatch size, trace repeats, timed pairs per stage): microbatches as the runtime bench runs them
CASES = [("mlp", 256, 20, 25), ("gpt", 32, 20, 25), ("unet", 16, 10, 15), ("resnet", 16, 10, 15)]
STAGES = (2, 4)


def stage_splits(graph, stages: int, microbatch: int, out: Path):
    """pipeplan's own split into `stages` stages (1F1B, recomputation on, the traced times), saved as a plan."""
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.request import PlanRequest
    from pipeplan.planner.search import search

    request = PlanRequest(devices=stages, batch_size=microbatch * 2 * stages, schedule="1f1b", stages=stages,
                          microbatches=2 * stages, recompute="on", optimizer="sgd", times="measured", sharding="none")
    plan = search(graph, load_profile("a100-80gb"), request).best
    plan.save(out)
    return plan


def _step(module, inputs) -> float:
    import torch

    t0 = time.perf_counter()
    out = module(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.stack([o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]).sum().backward()
    return time.perf_counter() - t0


def _split_step(module, inputs) -> float:
    """Forward, then the backward as zero bubble runs it: torch's B (input gradients) and W (weights, by group)."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    t0 = time.perf_counter()
    out = module(*inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
    _, groups = stage_backward_input(outs, [torch.ones_like(o) for o in outs], list(inputs), module.parameters())
    stage_backward_weight(module.parameters(), groups)
    return time.perf_counter() - t0


def time_stage(split, spec, stage: int, microbatch: int, pairs: int, split_backward: bool = False) -> tuple[float, float]:
    """(forward + backward, re-runs) of one stage, seconds: medians over alternating plain / recomputed pairs;
    `split_backward`: as zero bubble runs it (stage modules that own their outputs, as the runtime builds them)."""
    from pipeplan.runtime.recompute import recompute
    from pipeplan.runtime.split_cost import stage_inputs

    step = _split_step if split_backward else _step
    plain = split.module(stage, copy=True, own_outputs=split_backward)
    rec = recompute(split.module(stage, copy=True, own_outputs=split_backward))
    inputs = stage_inputs(split, spec, stage, microbatch)
    for _ in range(3):
        step(plain, inputs), step(rec, inputs)
    base, extra = [], []
    for _ in range(pairs):
        a = step(plain, inputs)
        b = step(rec, inputs)
        base.append(a)
        extra.append(b - a)
    return statistics.median(base), statistics.median(extra)


def time_split_extra(split, spec, stage: int, microbatch: int, pairs: int) -> tuple[float, float]:
    """(forward + whole backward, what torch's split B + W takes beyond it) of one stage, seconds: the first a median
    of steps, the second as `analyze` measures it (runtime/split_cost.py: alternating pairs on one stage module that
    owns its outputs, both backwards seeded with the same contiguous gradients, as the runtime seeds them)."""
    from pipeplan.runtime.split_cost import stage_inputs, stage_split_extra_s

    module = split.module(stage, copy=True, own_outputs=True)
    inputs = stage_inputs(split, spec, stage, microbatch)
    whole = [_step(module, inputs) for _ in range(pairs)]
    return statistics.median(whole), stage_split_extra_s(split, spec, stage, microbatch, 2 * pairs)


def run_case(name: str, microbatch: int, repeats: int, pairs: int, console, tmp: Path,
             overhead: tuple[float, float], split_cost: tuple[float, float, float]) -> list[dict]:
    import torch

    from pipeplan.costmodels.recompute import checkpoint_overhead_s, rerun_forward_s, weight_grad_passes
    from pipeplan.costmodels.split_backward import cold_gradient_bytes, split_backward_extra_s
    from pipeplan.costmodels.trace import trace
    from pipeplan.planner.plan import load_plan
    from pipeplan.runtime.worker import load_split_model

    torch.set_num_threads(1)
    console.print(f"{name}: tracing at {microbatch} rows (one thread, {repeats} repeats) ...")
    graph = trace(str(REPO / "examples" / f"{name}.py"), microbatch, repeats=repeats)
    rows = []
    for k in STAGES:
        plan = stage_splits(graph, k, microbatch, tmp / f"{name}-{k}.json")
        spec, _, split = load_split_model(load_plan(tmp / f"{name}-{k}.json"))
        for st in plan.stages:
            layers = [graph.layer(n) for n in st.layers]
            fwd = [x.fwd_s for x in layers]
            console.print(f"  {name} {k} stages, stage {st.index}: timing {pairs} pairs ...")
            fb, rerun = time_stage(split, spec, st.index, microbatch, pairs)
            one = rerun_forward_s(layers, fwd) + checkpoint_overhead_s(layers, *overhead)
            row = {"example": name, "stages": k, "stage": st.index, "layers": f"{st.layers[0]} .. {st.layers[-1]}",
                   "last": layers[-1].kind, "fwd_s": sum(fwd), "fb_s": fb, "measured_s": rerun,
                   "rerun_s": rerun_forward_s(layers, fwd), "predicted_s": one,
                   "saves": sum(x.saved_tensors or 0 for x in layers)}
            if st.index > 0:
                fb, rerun = time_stage(split, spec, st.index, microbatch, pairs, split_backward=True)
                groups = weight_grad_passes(layers)
                row["split"] = {"fb_s": fb, "measured_s": rerun, "groups": groups,
                                "predicted_s": (1 + groups) * one, "before_s": 2 * one}
                fb, extra = time_split_extra(split, spec, st.index, microbatch, pairs)
                per_split, per_group, bw = split_cost
                row["extra"] = {"fb_s": fb, "measured_s": extra, "groups": groups, "before_s": 0.0,
                                "cold_bytes": cold_gradient_bytes(layers),
                                "predicted_s": split_backward_extra_s(layers, per_split_s=per_split,
                                                                      per_group_s=per_group, mem_bw_bytes_per_s=bw)}
            rows.append(row)
    return rows


def table_rows(rows: list[dict]) -> list[list[str]]:
    return [[r["example"], str(r["stages"]), str(r["stage"]), r["layers"], r["last"], f"{r['fwd_s'] * 1e3:.2f}",
             f"{r['fb_s'] * 1e3:.2f}", f"{r['measured_s'] * 1e3:.2f}", f"{r['predicted_s'] * 1e3:.2f}",
             f"{r['saves']}", f"{_step_error(r, r['predicted_s']) * 100:+.1f}%",
             f"{_step_error(r, r['rerun_s']) * 100:+.1f}%", f"{_step_error(r, r['fwd_s']) * 100:+.1f}%"]
            for r in rows]


def _step_error(r: dict, rerun_s: float) -> float:
    """The recomputed stage step (measured forward + backward + re-run) against it with the re-run priced so."""
    return (r["fb_s"] + r["measured_s"]) / (r["fb_s"] + rerun_s) - 1


HEADER = ["example", "K", "stage", "layers", "last layer's kind", "traced forward ms", "measured fwd+bwd ms",
          "measured re-run ms", "predicted re-run ms", "saved tensors", "step error", "step error, re-run alone",
          "step error, whole forward (before)"]
SPLIT_HEADER = ["example", "K", "stage", "parameter groups", "measured fwd+B+W ms", "measured re-runs ms",
                "predicted re-runs ms (1 + groups)", "step error", "step error, two re-runs (before)"]


def split_rows(rows: list[dict]) -> list[list[str]]:
    return [[r["example"], str(r["stages"]), str(r["stage"]), str(x["groups"]), f"{x['fb_s'] * 1e3:.2f}",
             f"{x['measured_s'] * 1e3:.2f}", f"{x['predicted_s'] * 1e3:.2f}",
             f"{_step_error(x, x['predicted_s']) * 100:+.1f}%", f"{_step_error(x, x['before_s']) * 100:+.1f}%"]
            for r in rows if (x := r.get("split"))]


EXTRA_HEADER = ["example", "K", "stage", "parameter groups", "cold gradient MiB", "measured fwd+bwd ms",
                "measured split extra ms", "predicted split extra ms", "step error", "step error, no extra (before)"]


def extra_rows(rows: list[dict]) -> list[list[str]]:
    return [[r["example"], str(r["stages"]), str(r["stage"]), str(x["groups"]), f"{x['cold_bytes'] / 2**20:.2f}",
             f"{x['fb_s'] * 1e3:.2f}", f"{x['measured_s'] * 1e3:.2f}", f"{x['predicted_s'] * 1e3:.2f}",
             f"{_step_error(x, x['predicted_s']) * 100:+.1f}%", f"{_step_error(x, x['before_s']) * 100:+.1f}%"]
            for r in rows if (x := r.get("extra"))]


def summary(rows: list[dict]) -> str:
    def stats(key: str) -> str:
        errs = [abs(_step_error(r, r[key])) for r in rows]
        return f"median |error| {statistics.median(errs) * 100:.1f}% (worst {max(errs) * 100:.1f}%)"

    split = [r["split"] for r in rows if "split" in r]
    extra = [r["extra"] for r in rows if "extra" in r]

    def split_stats(key: str, of: list[dict] = split) -> str:
        errs = [abs(_step_error(x, x[key])) for x in of]
        return f"median |error| {statistics.median(errs) * 100:.1f}% (worst {max(errs) * 100:.1f}%)" if errs else "-"

    return (f"{len(rows)} stages, the recomputed stage step (forward + backward + re-run): {stats('predicted_s')} as "
            f"priced (re-run to the last save + checkpoint host time), {stats('rerun_s')} with the re-run alone, "
            f"{stats('fwd_s')} with the whole forward. {len(split)} stages with zero bubble's split backward: "
            f"{split_stats('predicted_s')} with 1 + groups re-runs, {split_stats('before_s')} with two. The same "
            f"{len(extra)} stages without recomputation, split against whole: {split_stats('predicted_s', extra)} "
            f"with the split's extra priced, {split_stats('before_s', extra)} without")


def write_results(rows: list[dict], overhead: tuple[float, float], split_cost: tuple[float, float, float]) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results import write_section
    from runtime_bench import machine

    lines = [f"Command: `python benchmarks/recompute_bench.py --write-results`. Machine: {machine()}, one thread.",
             "", __doc__.split("\n\n", 3)[3].strip(), "",
             f"torch's checkpoint host time measured at the start: {overhead[0] * 1e6:.0f} µs a region + "
             f"{overhead[1] * 1e6:.1f} µs a saved tensor.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    lines += ["", "Zero bubble's split backward, recomputed (all stages but the first):", "",
              "| " + " | ".join(SPLIT_HEADER) + " |", "|" + "---|" * len(SPLIT_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in split_rows(rows)]
    lines += ["", f"Zero bubble's split backward against a whole backward (no recomputation; all stages but the first; "
              f"measured at the start: {split_cost[0] * 1e6:.0f} µs a split + {split_cost[1] * 1e6:.1f} µs a "
              f"parameter group, copy bandwidth {split_cost[2] / 1e9:.1f} GB/s):", "",
              "| " + " | ".join(EXTRA_HEADER) + " |", "|" + "---|" * len(EXTRA_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in extra_rows(rows)]
    lines += ["", summary(rows) + "."]
    write_section(SECTION, "\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default=",".join(c[0] for c in CASES))
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from pipeplan.hardware_profiles.calibrate import measure_memory
    from pipeplan.hardware_profiles.recompute_overhead import checkpoint_overhead_s
    from pipeplan.hardware_profiles.split_backward_overhead import split_backward_overhead_s

    console = Console()
    import torch

    torch.set_num_threads(1)
    overhead = checkpoint_overhead_s()
    console.print(f"torch's checkpoint host time: {overhead[0] * 1e6:.0f} µs a region + {overhead[1] * 1e6:.1f} µs "
                  "a saved tensor")
    split_cost = (*split_backward_overhead_s(), measure_memory(1.5)[0])
    console.print(f"torch's split backward: {split_cost[0] * 1e6:.0f} µs a split + {split_cost[1] * 1e6:.1f} µs a "
                  f"group; copy bandwidth {split_cost[2] / 1e9:.1f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, mb, repeats, pairs in CASES:
            if name in args.examples.split(","):
                rows += run_case(name, mb, repeats, pairs, console, Path(tmp), overhead, split_cost)
    for title, header, cells in (("recomputation: measured re-run vs predicted (one process, one thread)", HEADER,
                                  table_rows(rows)),
                                 ("zero bubble's split backward, recomputed: measured re-runs vs predicted",
                                  SPLIT_HEADER, split_rows(rows)),
                                 ("zero bubble's split backward against a whole one: measured extra vs predicted",
                                  EXTRA_HEADER, extra_rows(rows))):
        table = Table(title=title)
        for col in header:
            table.add_column(col, justify="right")
        for r in cells:
            table.add_row(*r)
        console.print(table)
    console.print(summary(rows))
    if args.write_results:
        write_results(rows, overhead, split_cost)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
