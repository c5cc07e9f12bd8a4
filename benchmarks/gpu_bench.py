"""On a CUDA GPU: calibrate, trace and run, and print predicted against measured (issue 16, point 1).

    python benchmarks/gpu_bench.py --out DIR [--quick]

Steps, each through the `pipeplan` command as a user would run it:
1. `pipeplan profiles calibrate --device cuda` writes DIR/calibrated.yaml (efficiency curves, bandwidth,
   per-kernel and per-op overheads; NCCL only with 2+ GPUs).
2. `pipeplan trace EXAMPLE --device cuda` per example: per-layer forward/backward timed with CUDA events.
   Each layer is predicted by the roofline (`compute.layer_times_s(times="roofline")`, fp32: the tracer
   runs the model in its own dtype, fp32) on the catalogue profile of this GPU and on the calibrated one.
3. `pipeplan plan --gpus 1 --stages 1` and `pipeplan run` per example: the measured iteration against
   each profile's roofline and against the default plan, which takes this GPU's traced times (one GPU: one
   stage, NCCL with one rank).
4. `pipeplan analyze MODEL --profile <this GPU's catalogue profile> --dtype fp32` (defaults: it re-times its plan
   on the GPU) and `pipeplan run` of that plan.
5. The calibrated curve points.
`--replan` (no GPU) prints step 3's table again from DIR's saved calibration, graphs and runs, planned by the
current code.
Writes DIR/gpu_section.md (the markdown for benchmarks/RESULTS.md) and prints it. Needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (label, model file, trace/run batch, environment, microbatches for run)
EXAMPLES = [
    ("gpt2 (124M, seq 1024)", "examples/gpt.py", 8, {"PIPEPLAN_GPT_SIZE": "gpt2"}, 1),
    ("resnet (32x32)", "examples/resnet.py", 256, {}, 1),
    ("unet (32x32)", "examples/unet.py", 64, {}, 1),
]
# --published: the published table's worst CNN rows (benchmarks/RESULTS.md, "Still missing") need their models'
# per-layer GPU times: torchgpipe's U-Net and ResNet-101, traced one layer per module as published_bench traces
# them, at a microbatch of their published runs. (label, model file, batch, entry, depth)
PUBLISHED = [
    ("torchgpipe U-Net (5, 64), 192x192", "benchmarks/published/torchgpipe_unet.py", 16, "build_unet", 1),
    ("torchgpipe ResNet-101, 224x224", "benchmarks/published/torchgpipe_resnet101.py", 32, "build_resnet101", 1),
]
QUICK = [
    ("gpt small", "examples/gpt.py", 8, {"PIPEPLAN_GPT_SIZE": "small"}, 1),
    ("resnet (32x32)", "examples/resnet.py", 32, {}, 1),
]


def sh(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> str:
    """Run a pipeplan command; its stdout (stderr goes to the log), raising with the tail on failure."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}  ({time.perf_counter() - t0:.1f} s, rc {p.returncode})\n{p.stderr[-4000:]}\n")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout


def machine() -> str:
    import torch

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return (f"{smi}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs, {os.cpu_count()} CPU cores")


def pct(pred: float, meas: float) -> str:
    return "—" if meas <= 0 else f"{(pred - meas) / meas * 100:+.0f}%"


def layer_table(label: str, graph_path: Path, profiles: dict[str, object], top: int) -> tuple[list[str], dict]:
    """Markdown rows: the `top` slowest layers and the whole step, measured vs each profile's roofline."""
    from pipeplan.costmodels.compute import layer_times_s
    from pipeplan.costmodels.graph import load_graph

    g = load_graph(graph_path)
    preds = {n: layer_times_s(g, p, dtype="fp32", times="roofline") for n, p in profiles.items()}
    names = list(profiles)
    head = ("| layer | kind | meas fwd ms | meas bwd ms | " + " | ".join(f"{n} fwd ms | {n} bwd ms" for n in names) + " |")
    rows = [f"**{label}**, batch {g.batch_size}, {len(g.layers)} layers, traced on {g.source.get('device_name')}"
            f" (median of {g.source.get('repeats')} steps):", "", head, "|" + "---|" * (4 + 2 * len(names))]
    order = sorted(range(len(g.layers)), key=lambda i: -(g.layers[i].fwd_s + g.layers[i].bwd_s))[:top]
    for i in order:
        layer = g.layers[i]
        cells = [f"{preds[n][0][i] * 1e3:.3f} ({pct(preds[n][0][i], layer.fwd_s)}) | "
                 f"{preds[n][1][i] * 1e3:.3f} ({pct(preds[n][1][i], layer.bwd_s)})" for n in names]
        rows.append(f"| {layer.name[:40]} | {layer.kind} | {layer.fwd_s * 1e3:.3f} | {layer.bwd_s * 1e3:.3f} | "
                    + " | ".join(cells) + " |")
    mf, mb = sum(l.fwd_s for l in g.layers), sum(l.bwd_s for l in g.layers)
    summary = {"measured_fwd_s": mf, "measured_bwd_s": mb}
    cells = []
    for n in names:
        pf, pb = sum(preds[n][0]), sum(preds[n][1])
        summary[n] = {"fwd_s": pf, "bwd_s": pb, "median_abs_log_err": _median_log_err(g, preds[n])}
        cells.append(f"{pf * 1e3:.3f} ({pct(pf, mf)}) | {pb * 1e3:.3f} ({pct(pb, mb)})")
    rows.append(f"| **all {len(g.layers)} layers** | | **{mf * 1e3:.3f}** | **{mb * 1e3:.3f}** | " + " | ".join(cells) + " |")
    errs = ", ".join(f"{n} {summary[n]['median_abs_log_err']:.2f}" for n in names)
    rows += ["", f"Median over layers (measured > 20 µs) of |ln(predicted / measured)|, fwd and bwd: {errs}.", ""]
    return rows, summary


def _median_log_err(g, pred) -> float:
    errs = []
    for i, layer in enumerate(g.layers):
        for p, m in ((pred[0][i], layer.fwd_s), (pred[1][i], layer.bwd_s)):
            if m > 20e-6 and p > 0:
                errs.append(abs(math.log(p / m)))
    errs.sort()
    return errs[len(errs) // 2] if errs else float("nan")


def step_section(examples, out: Path, sheet_name: str | None, cal_path: Path, log: Path, replan: bool) -> list[str]:
    """Section (b): each example planned with the roofline on the catalogue and calibrated profiles and with the
    defaults on the calibrated profile (this GPU's traced times), against `pipeplan run` of the default plan."""
    variants = {f"{sheet_name} roofline": (sheet_name, "roofline")} if sheet_name else {}
    variants["calibrated roofline"] = (str(cal_path), "roofline")
    variants["default"] = (str(cal_path), "model")
    return (["### (b) Per step: `pipeplan run` (NCCL, one process on the one GPU) against the plans' predictions", "",
             "Roofline columns: `--times roofline` on each profile; default: `--times model` (the default) on the "
             "calibrated profile, which takes this GPU's traced layer times; `pipeplan run` runs the default plan.",
             ""] + step_rows(examples, out, variants, log, replan))


def step_rows(examples, out: Path, variants: dict[str, tuple[str, str]], log: Path, replan: bool = False) -> list[str]:
    """Plan each example on one GPU per variant (label -> (profile, --times)); run the last variant's plan (or,
    `replan`, read the run saved beside the graph); measured against predicted iteration and peak memory."""
    rows = ["| model | batch | schedule, microbatches | measured iteration ms (`pipeplan run`) | "
            + " | ".join(f"predicted {n} ms" for n in variants) + " | trace step ms (sum of layers) | measured peak GB | "
            + " | ".join(f"predicted peak {n} GB" for n in variants) + " |",
            "|" + "---|" * (6 + 2 * len(variants))]
    for label, model, batch, env, m in examples:
        try:
            rows.append(_step_row(label, model, batch, env, m, out, variants, log, replan))
        except RuntimeError as e:
            rows.append(f"| {label} | {batch} | — | failed: {str(e)[:200]} |")
    return rows


def _step_row(label: str, model: str, batch: int, env: dict[str, str], m: int, out: Path,
              variants: dict[str, tuple[str, str]], log: Path, replan: bool) -> str:
    """One model's row of `step_rows`."""
    stem = Path(model).stem
    preds, plan_paths, peaks = {}, {}, {}
    for i, (n, (prof, times)) in enumerate(variants.items()):
        plan_paths[n] = out / f"{stem}.v{i}.plan.json"
        sh(["pipeplan", "plan", str(out / f"{stem}.graph.json"), "--profile", prof, "--gpus", "1", "-b", str(batch),
            "-m", str(m), "--stages", "1", "--dtype", "fp32", "--recompute", "off", "--times", times,
            "-o", str(plan_paths[n])], env, log)
        doc = json.loads(plan_paths[n].read_text())
        preds[n] = doc["predicted"]["iteration_s"]
        peaks[n] = doc["predicted"]["peak_memory_bytes"]
    last = list(variants)[-1]
    if replan:
        res = json.loads((out / f"{stem}.run.json").read_text())
    else:
        res = json.loads(sh(["pipeplan", "run", str(plan_paths[last]), "--steps", "12", "--warmup", "2", "--json"],
                            env, log))
        (out / f"{stem}.run.json").write_text(json.dumps(res, indent=1))
    meas = res["measured"]["iteration_s"]
    meas_peak = max(s["device_peak_bytes"] for s in res["measured"]["stages"])
    plan = json.loads(plan_paths[last].read_text())
    from pipeplan.costmodels.graph import load_graph

    g = load_graph(out / f"{stem}.graph.json")
    trace_step = sum(l.fwd_s + l.bwd_s for l in g.layers) * batch / g.batch_size
    return (f"| {label} | {batch} | {plan['schedule']}, {plan['microbatches']} | {meas * 1e3:.2f} | "
            + " | ".join(f"{preds[n] * 1e3:.2f} ({pct(preds[n], meas)})" for n in variants)
            + f" | {trace_step * 1e3:.2f} | {meas_peak / 1e9:.2f} | "
            + " | ".join(f"{peaks[n] / 1e9:.2f} ({pct(peaks[n], meas_peak)})" for n in variants) + " |")


def traced_layers(label: str, model: str, batch: int, env: dict[str, str] | None, flags: list[str], out: Path,
                  profiles: dict[str, object], top: int, log: Path, summaries: dict) -> tuple[list[str], bool]:
    """(section (a)'s rows for one model traced on CUDA with `flags`, whether it traced): a failure is a row, not
    the end of the benchmark."""
    graph_path = out / f"{Path(model).stem}.graph.json"
    try:
        sh(["pipeplan", "trace", model, "-b", str(batch), "--device", "cuda", *flags, "--no-fvcore-check",
            "-o", str(graph_path)], env, log)
    except RuntimeError as e:
        return [f"**{label}**: trace failed: {str(e)[:300]}", ""], False
    rows, summaries[label] = layer_table(label, graph_path, profiles, top)
    return rows, True


def published_layers(out: Path, profiles: dict[str, object], top: int, log: Path, summaries: dict) -> list[str]:
    """Section (a) for the published table's CNNs (PUBLISHED): CUDA-event layer times against each profile."""
    md: list[str] = ["#### The published table's CNNs (`--published`)", ""]
    for label, model, batch, entry, depth in PUBLISHED:
        md += traced_layers(label, model, batch, None, ["--entry", entry, "--depth", str(depth), "--repeats", "3"],
                            out, profiles, top, log, summaries)[0]
    return md


def analyze_rows(examples, out: Path, profile: str, log: Path, dtype: str | None = "fp32") -> list[str]:
    """Defaults only on this GPU's catalogue profile: `pipeplan analyze MODEL --gpus 1 --dtype fp32` (which re-times
    its chosen plan on the GPU, cli/device_like.py) then `pipeplan run` of that plan. `dtype` None: no --dtype at
    all, the profile's default (bf16 on a GPU: the plan is timed and run under autocast, pipeplan/precision.py)."""
    rows = ["| model | batch | plan (dtype, schedule, microbatches, microbatch size) | measured iteration ms | "
            "predicted ms | measured peak GB | predicted peak GB |", "|---|---|---|---|---|---|---|"]
    for label, model, batch, env, _ in examples:
        stem = Path(model).stem + ("" if dtype == "fp32" else f"-{dtype or 'default'}")
        try:
            plan_path = out / f"{stem}.analyze.plan.json"
            sh(["pipeplan", "analyze", model, "--profile", profile, "--gpus", "1", "-b", str(batch),
                *(["--dtype", dtype] if dtype else []), "-o", str(plan_path), "--json"], env, log)
            res = json.loads(sh(["pipeplan", "run", str(plan_path), "--steps", "12", "--warmup", "2", "--json"], env, log))
        except RuntimeError as e:
            rows.append(f"| {label} | {batch} | failed: {str(e)[:200]} | | | | |")
            continue
        (out / f"{stem}.analyze.run.json").write_text(json.dumps(res, indent=1))
        plan = json.loads(plan_path.read_text())
        meas, pred = res["measured"]["iteration_s"], plan["predicted"]["iteration_s"]
        meas_peak = max(st["device_peak_bytes"] for st in res["measured"]["stages"])
        pred_peak = plan["predicted"]["peak_memory_bytes"]
        rows.append(f"| {label} | {batch} | {plan['dtype']}, {plan['schedule']}, {plan['microbatches']}, "
                    f"{plan['microbatch_size']} | "
                    f"{meas * 1e3:.2f} | {pred * 1e3:.2f} ({pct(pred, meas)}) | {meas_peak / 1e9:.2f} | "
                    f"{pred_peak / 1e9:.2f} ({pct(pred_peak, meas_peak)}) |")
    return rows


def curve_rows(path: Path) -> list[str]:
    from pipeplan.hardware_profiles.loader import read_profile_file

    p = read_profile_file(path)
    rows = ["| curve | points (FLOPs per kernel: efficiency) |", "|---|---|"]
    for key, pts in p.efficiency_curve.items():
        rows.append(f"| {key} | " + ", ".join(f"{f:.2g}: {e:.3f}" for f, e in pts) + " |")
    cal = p.calibration
    rows += ["", f"Best measured GEMM TFLOP/s {cal.get('best_gemm_tflops')} (datasheet peaks "
             f"{ {d: (v or 0) / 1e12 for d, v in p.peak_flops.items()} }); device-to-device copy "
             f"{cal.get('copy_gbps')} GB/s; kernel overhead {(p.kernel_overhead_s or 0) * 1e6:.2f} µs; eager dispatch "
             f"{(p.dispatch_s or 0) * 1e6:.2f} µs per autograd op ({cal.get('dispatch_plain_us')} µs plain).",
             f"Links: {p.notes}"]
    return rows


def _write(out: Path, md: list[str]) -> None:
    """The section so far (a run stopped at its time limit still leaves what it measured)."""
    (out / "gpu_section.md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="small models (a smoke run)")
    ap.add_argument("--top", type=int, default=8, help="slowest layers shown per model")
    ap.add_argument("--published", action="store_true",
                    help="also trace the published table's CNNs (torchgpipe's U-Net and ResNet-101) per layer on the GPU")
    ap.add_argument("--defaults", action="store_true",
                    help="only `analyze` with no --dtype (bf16 on a GPU profile) and `pipeplan run` of its plan")
    ap.add_argument("--replan", action="store_true",
                    help="no GPU: section (b) again from DIR's calibrated profile, graphs and runs, planned by this code")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "gpu_bench.log"
    examples = QUICK if a.quick else EXAMPLES
    if a.replan:
        from pipeplan.hardware_profiles.gpu_catalog import catalog_match
        from pipeplan.hardware_profiles.loader import read_profile_file

        cal_path = a.out / "calibrated.yaml"
        sheet = catalog_match(read_profile_file(cal_path).device)
        print("\n".join(step_section(examples, a.out, sheet.name if sheet else None, cal_path, log, True)))
        return
    import torch

    from pipeplan.hardware_profiles.gpu_catalog import catalog_match
    from pipeplan.hardware_profiles.loader import read_profile_file

    if a.defaults:
        sheet = catalog_match(torch.cuda.get_device_name(0))
        assert sheet is not None, f"no catalogue profile for {torch.cuda.get_device_name(0)}"
        md = [f"`python benchmarks/gpu_bench.py --out DIR --defaults` on {datetime.date.today().isoformat()}: "
              f"{machine()}.", "", f"`pipeplan analyze MODEL --profile {sheet.name} --gpus 1 -b B`, then `pipeplan run`:",
              ""] + analyze_rows(examples, a.out, sheet.name, log, dtype=None)
        _write(a.out, md)
        print("\n".join(md))
        return
    t0 = time.perf_counter()
    cal_path = a.out / "calibrated.yaml"
    slug = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
    sh(["pipeplan", "profiles", "calibrate", "--device", "cuda", "--name", f"{slug}-calibrated",
        "-o", str(cal_path), "--quiet"], log=log)
    t_cal = time.perf_counter() - t0
    sheet = catalog_match(torch.cuda.get_device_name(0))
    profiles = {sheet.name if sheet else "catalogue": read_profile_file(sheet.path) if sheet else None,
                "calibrated": read_profile_file(cal_path)}
    profiles = {k: v for k, v in profiles.items() if v is not None}
    md = ["## GPU: predicted against measured (benchmarks/gpu_bench.py)", "",
          f"`python benchmarks/gpu_bench.py --out DIR{' --quick' if a.quick else ''}` on "
          f"{datetime.date.today().isoformat()}: {machine()}. Calibration took {t_cal:.0f} s.", "",
          "### (a) Per layer: CUDA-event times from `pipeplan trace --device cuda` against the fp32 roofline", ""]
    summaries = {}
    traced = []
    for example in examples:
        label, model, batch, env, _ = example
        rows, ok = traced_layers(label, model, batch, env, ["--repeats", "5"], a.out, profiles, a.top, log, summaries)
        md += rows
        if ok:
            traced.append(example)
        _write(a.out, md)
    if a.published:
        md += published_layers(a.out, profiles, a.top, log, summaries)
    (a.out / "layer_summary.json").write_text(json.dumps(summaries, indent=1))
    md += step_section(traced, a.out, sheet.name if sheet else None, cal_path, log, False)
    _write(a.out, md)
    if sheet is not None:
        md += ["", f"### (c) Defaults only: `pipeplan analyze MODEL --profile {sheet.name} --gpus 1 -b B --dtype fp32`, "
               "then `pipeplan run`", ""]
        md += analyze_rows(examples, a.out, sheet.name, log)
    md += ["", "### (d) The calibrated profile's curves", ""] + curve_rows(cal_path)
    text = "\n".join(md) + "\n"
    (a.out / "gpu_section.md").write_text(text)
    print(text)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
