"""Peak memory: what pipeplan predicts a device holds against what a real step holds.

One command (prints two tables; --write-results also rewrites its section of benchmarks/RESULTS.md):

    python benchmarks/memory_bench.py --write-results

The first table holds each example's whole model on one device against torch's own memory estimator
(torch.distributed._tools.mem_tracker.MemTracker) over one real training step, after one Adam step so that
gradients and optimizer state exist: its peak against pipeplan's prediction from a trace at the same batch
(model state, saved activations, the tensors in flight beyond them, one weight gradient being added in),
and against model state and saved activations alone (what the memory model held before tensors in flight).
The second plans each case with `pipeplan analyze` (the a100-80gb-sxm profile, fp32, Adam, no recomputation or
sharding; its memory model does not depend on the device's speed) and trains it with `pipeplan run` on this
machine's CPU cores (gloo): each stage's measured device peak (model state plus the most bytes its step held
at once, logged op by op on the step the runtime meters, runtime/measure.py; PipeDream's own loop logs its
first step's forwards and backwards the same way, its updates between them left out) against the plan's
prediction. GPipe and 1F1B run the runtime's own loops (pipeplan/lean_gpipe.py: buffers made per microbatch;
GPipe's sent outputs freed); their 3-stage plans (3 processes on the 2 cores; memory, not time, is measured) show
a middle stage.
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

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Peak memory (`benchmarks/memory_bench.py`)"
MIB = 2**20
# (model file, batch): one device, one step
WHOLE = [("examples/mlp.py", 64), ("examples/resnet.py", 32), ("examples/unet.py", 16), ("examples/gpt.py", 8),
         ("tests/runtime_model_unet.py", 8)]
GPT = {"PIPEPLAN_GPT_SIZE": "medium"}  # vocabulary 8192, 256 tokens: the loss's tensors show
# (label, model file, environment, analyze flags)
PLANS = [
    ("gpt, 1f1b 2 stages, M=4", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "1f1b", "-m", "4"]),
    ("gpt, gpipe 2 stages, M=4", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "gpipe", "-m", "4"]),
    ("gpt, data parallel 1 x 2, M=2", "examples/gpt.py", GPT, ["-b", "32", "-k", "1", "-m", "2"]),
    ("gpt, interleaved 2 devices, M=4", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "interleaved", "-m", "4"]),
    # M == devices: torch's interleaved order keeps its warm-up formula there (Megatron runs every forward first)
    ("gpt, interleaved 2 devices, M=2", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "interleaved", "-m", "2"]),
    ("gpt, zb-h1 2 stages, M=4", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "zb-h1", "-m", "4"]),
    # M = 16: torch's multi-stage runtime keeps every send to the step's end, so these grow with M past the in-flight
    # counts (ZB-H1 read -12% to -15% here while its counts left the sends out)
    ("gpt, zb-h1 2 stages, M=16", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "zb-h1", "-m", "16"]),
    ("gpt, zb-h1 2 stages, M=16, recompute", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "zb-h1", "-m", "16", "--recompute", "on"]),
    ("gpt, interleaved 2 devices, M=16", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "interleaved", "-m", "16"]),
    ("gpt, zb-v 2 devices, M=4", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "zb-v", "-m", "4"]),
    ("gpt, dualpipev 2 devices, M=4", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "dualpipev", "-m", "4"]),
    ("gpt, pipedream 2 stages", "examples/gpt.py", GPT, ["-b", "32", "-k", "2", "--schedule", "pipedream", "-m", "4"]),
    ("gpt, pipedream-2bw 2 stages, M=4", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "pipedream-2bw", "-m", "4"]),
    ("gpt, 1f1b 2 stages, M=4, recompute", "examples/gpt.py", GPT,
     ["-b", "32", "-k", "2", "--schedule", "1f1b", "-m", "4", "--recompute", "on"]),
    *[(f"gpt, {label}, M=4, recompute", "examples/gpt.py", GPT,
       ["-b", "32", "-k", "2", "--schedule", schedule, "-m", "4", "--recompute", "on"])
      for label, schedule in (("gpipe 2 stages", "gpipe"), ("interleaved 2 devices", "interleaved"),
                              ("zb-h1 2 stages", "zb-h1"), ("zb-v 2 devices", "zb-v"),
                              ("pipedream 2 stages", "pipedream"))],
    ("resnet, 1f1b 2 stages, M=4", "examples/resnet.py", {}, ["-b", "64", "-k", "2", "--schedule", "1f1b", "-m", "4"]),
    ("unet, 1f1b 2 stages, M=4", "examples/unet.py", {}, ["-b", "32", "-k", "2", "--schedule", "1f1b", "-m", "4"]),
    ("mlp, 1f1b 2 stages, M=4", "examples/mlp.py", {}, ["-b", "256", "-k", "2", "--schedule", "1f1b", "-m", "4"]),
    # bf16 plans with the default recipe, autocast, as `pipeplan run` trains them; planned on the a100 profile, so
    # counted with CUDA's autocast lists, and run under the CPU's (they differ on norms and softmax: fp32 on CUDA)
    *[(f"{name} bf16, {label}", f"examples/{name}.py", env, ["--dtype", "bf16", "-b", batch, *flags])
      for name, env, batch in (("gpt", GPT, "32"), ("resnet", {}, "64"), ("unet", {}, "32"), ("mlp", {}, "256"))
      for label, flags in (("1f1b 2 stages, M=4", ["-k", "2", "--schedule", "1f1b", "-m", "4"]),
                           ("gpipe 2 stages, M=4", ["-k", "2", "--schedule", "gpipe", "-m", "4"]),
                           ("data parallel 1 x 2, M=2", ["-k", "1", "-m", "2"]))],
    # the GPT's other schedules in bf16: interleaved chunks, zero bubble's deferred weight gradients, recomputation
    *[(f"gpt bf16, {label}", "examples/gpt.py", GPT, ["--dtype", "bf16", "-b", "32", "-k", "2", *flags])
      for label, flags in (("interleaved 2 devices, M=4", ["--schedule", "interleaved", "-m", "4"]),
                           ("zb-h1 2 stages, M=4", ["--schedule", "zb-h1", "-m", "4"]),
                           ("zb-v 2 devices, M=4", ["--schedule", "zb-v", "-m", "4"]),
                           ("dualpipev 2 devices, M=4", ["--schedule", "dualpipev", "-m", "4"]),
                           ("1f1b 2 stages, M=4, recompute", ["--schedule", "1f1b", "-m", "4", "--recompute", "on"]))],
    # recomputed a block at a time (--recompute-granularity block, as the frameworks checkpoint each decoder layer):
    # every block's input kept per microbatch in flight, one block re-run at a time; the GPT's blocks are its
    # `h.N` modules, the CNNs' and the MLP's each layer (no numbered block list); the U-Net's skips cross its blocks
    *[(f"{name}{dtype and ' ' + dtype}, {label}, recompute per block", f"examples/{name}.py", env,
       [*(["--dtype", dtype] if dtype else []), "-b", batch, "-k", "2", "--schedule", schedule, "-m", "4",
        "--recompute", "on", "--recompute-granularity", "block"])
      for name, env, batch, dtype, label, schedule in (
          ("gpt", GPT, "32", "", "1f1b 2 stages, M=4", "1f1b"), ("gpt", GPT, "32", "", "gpipe 2 stages, M=4", "gpipe"),
          ("gpt", GPT, "32", "", "interleaved 2 devices, M=4", "interleaved"),
          ("gpt", GPT, "32", "bf16", "1f1b 2 stages, M=4", "1f1b"),
          ("unet", {}, "32", "", "1f1b 2 stages, M=4", "1f1b"), ("resnet", {}, "64", "", "gpipe 2 stages, M=4", "gpipe"),
          ("mlp", {}, "256", "", "1f1b 2 stages, M=4", "1f1b"))],
    # a middle stage under pipeplan's GPipe and 1F1B loops (pipeplan/lean_gpipe.py): its inputs in flight kept, one
    # gradient buffer; GPipe's outputs freed once sent
    *[(f"{name}, {schedule} 3 stages, M=4{label}", f"examples/{name}.py", env,
       ["--gpus", "3", "-b", batch, "-k", "3", "--schedule", schedule, "-m", "4", *flags])
      for schedule in ("gpipe", "1f1b")
      for name, env, batch in (("gpt", GPT, "32"), ("resnet", {}, "64"), ("unet", {}, "32"))
      for label, flags in (("", []), (", recompute", ["--recompute", "on"]))],
]


def measured_peak_bytes(path: str, batch: int, *, autocast: bool = False) -> int:
    """MemTracker's peak over one forward + loss + backward of the model file, after one Adam step (so that
    gradients and optimizer state exist and the backward adds into them, as a step's later microbatches do);
    with `autocast`, forward and loss under the CPU's bf16 autocast, as `pipeplan run` trains a bf16 plan."""
    import contextlib

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from pipeplan.costmodels.model_file import load_model_file

    spec = load_model_file(path)
    torch.manual_seed(0)
    model = spec.build()
    x, target = spec.example_inputs(batch), spec.example_target(batch)
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = spec.loss(model(*x), target)
        loss.backward()

    step()
    opt.step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def predicted_peak_bytes(graph, *, in_flight: bool = True, recipe: str | None = None) -> int:
    """The whole model on one device, one microbatch in flight, as `stage_memory` prices it: with `in_flight`, the
    tensors in flight and a weight gradient being added in (microbatches=2), the model's output not kept (the
    reference step lets it go after the loss, as a plain loop does; torch's stages keep it, the plans below);
    without, model state and saved activations only. `recipe`: a bf16 step under that mixed-precision recipe
    (`autocast`: the trace's counts under the CPU's autocast lists; the others: half the fp32 bytes), else fp32."""
    from pipeplan.costmodels.memory import stage_memory, transient_over_saved

    if recipe == "autocast":
        counts = [x.autocast["cpu"] for x in graph.layers]
        saved, transient = [c["saved_bytes"] for c in counts], [c["transient_bytes"] for c in counts]
    else:
        half = 2 if recipe is not None else 1
        saved = [x.saved_bytes // half for x in graph.layers]
        transient = [x.transient_bytes // half for x in graph.layers]
    return stage_memory(param_bytes=sum(x.param_bytes for x in graph.layers), saved_bytes_per_mb=sum(saved),
                        input_bytes_per_mb=0, output_bytes_per_mb=0, schedule="1f1b", stages=1, stage=0,
                        microbatches=2 if in_flight else 1, optimizer="adam",
                        dtype="fp32" if recipe is None else "bf16", mixed_precision=recipe or "deepspeed",
                        recompute=False, largest_layer_param_bytes=max(x.param_bytes for x in graph.layers),
                        transient_bytes=transient_over_saved(saved, transient) if in_flight else 0).total_bytes


def whole_model(path: str, batch: int) -> dict:
    """Measured and predicted peaks of one model, in a child process (`--whole`), so that one model's
    allocations do not touch another's."""
    r = subprocess.run([sys.executable, __file__, "--whole", path, str(batch)], capture_output=True, text=True,
                       env=dict(os.environ, **GPT), cwd=REPO, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _whole(path: str, batch: int) -> None:
    from pipeplan.costmodels.trace import trace

    full = str(REPO / path)
    graph = trace(full, batch, time_layers=False)
    print(json.dumps({"measured": measured_peak_bytes(full, batch), "predicted": predicted_peak_bytes(graph),
                      "before": predicted_peak_bytes(graph, in_flight=False)}))


def planned_run(flags: list[str], path: str, env_extra: dict) -> dict:
    """`pipeplan analyze` then `pipeplan run --steps 3 --json`: the run's JSON document. fp32 unless `flags` say."""
    env = dict(os.environ, **env_extra)
    dtype = [] if "--dtype" in flags else ["--dtype", "fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        plan = str(Path(tmp) / "plan.json")
        subprocess.run(["pipeplan", "analyze", path, "--profile", "a100-80gb-sxm", "--gpus", "2", *dtype,  # flags may say 3
                        "--recompute", "off", "--sharding", "none", "--optimizer", "adam", *flags, "-o", plan],
                       env=env, cwd=REPO, check=True, capture_output=True)
        r = subprocess.run(["pipeplan", "run", plan, "--steps", "3", "--json"], env=env, cwd=REPO, check=True,
                           capture_output=True, text=True)
    return json.loads(r.stdout)


def whole_rows() -> list[list[str]]:
    rows = []
    for path, batch in WHOLE:
        r = whole_model(path, batch)
        m = r["measured"]
        rows.append([f"{path} (batch {batch})", f"{m / MIB:.2f}", f"{r['predicted'] / MIB:.2f}",
                     f"{r['predicted'] / m - 1:+.1%}", f"{r['before'] / MIB:.2f}", f"{r['before'] / m - 1:+.1%}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def plan_rows(only: str | None = None) -> tuple[list[list[str]], list[float]]:
    rows, errors = [], []
    for label, path, env_extra, flags in PLANS:
        if only is not None and only not in label:
            continue
        doc = planned_run(flags, path, env_extra)
        for pred in doc["predicted"]["stages"]:  # a data-parallel stage: its fullest replica
            meas = max((x for x in doc["measured"]["stages"] if x["index"] == pred["index"]),
                       key=lambda x: x["device_peak_bytes"])
            p, m = pred["memory_bytes"], meas["device_peak_bytes"]
            errors.append(p / m - 1)
            rows.append([label, str(pred["index"]), f"{m / MIB:.1f}", f"{p / MIB:.1f}", f"{p / m - 1:+.1%}",
                         f"{meas['activation_bytes'] / MIB:.1f}", f"{pred['activation_bytes'] / MIB:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows, errors


WHOLE_HEADER = ["model", "MemTracker peak MiB", "predicted MiB", "error", "state + saved only MiB", "error"]
PLAN_HEADER = ["plan", "stage", "measured device peak MiB", "predicted MiB", "error",
               "measured beyond state MiB", "predicted beyond state MiB"]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--only", metavar="TEXT", help="only the plans whose label contains TEXT (no whole models; "
                    "not with --write-results)")
    ap.add_argument("--whole", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)  # one child's row
    args = ap.parse_args(argv)
    if args.whole:
        _whole(args.whole[0], int(args.whole[1]))
        return 0
    if args.only is not None and args.write_results:
        ap.error("--write-results needs every row: drop --only")
    whole = whole_rows() if args.only is None else []
    plans, errors = plan_rows(args.only)
    worst = max(errors, key=abs)
    summary = (f"{len(errors)} stages of {len(PLANS)} plans: median |error| "
               f"{statistics.median(abs(e) for e in errors):.1%}, worst {worst:+.1%}")
    bf16 = [e for row, e in zip(plans, errors, strict=True) if " bf16, " in row[0]]
    if bf16:
        summary += (f"; the {len(bf16)} bf16 stages: median |error| {statistics.median(abs(e) for e in bf16):.1%}, "
                    f"worst {max(bf16, key=abs):+.1%}")
    blocked = [e for row, e in zip(plans, errors, strict=True) if row[0].endswith("recompute per block")]
    if blocked:
        summary += (f"; the {len(blocked)} stages recomputed per block: median |error| "
                    f"{statistics.median(abs(e) for e in blocked):.1%}, worst {max(blocked, key=abs):+.1%}")
    print(summary)
    if args.write_results:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from results import write_section
        from runtime_bench import machine

        lines = [f"Command: `python benchmarks/memory_bench.py --write-results`. Machine: {machine()}.", "",
                 __doc__.split("\n\n", 3)[3].strip(), "", *table(WHOLE_HEADER, whole), "",
                 *table(PLAN_HEADER, plans), "", summary + "."]
        write_section(SECTION, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
