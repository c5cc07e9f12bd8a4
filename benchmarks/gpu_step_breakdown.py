"""On a CUDA GPU: where an example's eager training step spends its time (host issue, GPU kernels, per op).

    python benchmarks/gpu_step_breakdown.py --out DIR

Why: gpu_bench.py's per-step table says the small CNNs run 5-7x longer than the roofline; this says whether the
GPU is busy (kernels slower than priced) or waits for the host (eager PyTorch's per-op cost), and which ops.
Per example (gpu_bench.EXAMPLES), fp32 as the tracer runs them:
- eager_step_s: forward + loss + backward, host clock around it with a synchronize (median of STEPS);
- eager_fwd_s, eager_bwd_s: the same step's forward + loss and backward apart, CUDA events around each, no
  hooks: what the trace's per-layer sums (which carry its hooks) are to be held against;
- host_issue_s: the same step's host time up to `backward()` returning, before the synchronize: when it is
  about eager_step_s, the GPU waited for the host;
- graph_step_s: the same step captured in a CUDA graph and replayed (no host in the loop): the GPU's own time;
- adam_step_s: torch.optim.Adam's step over the model's parameters (the runtime's optimizer), synchronized;
- per aten op: calls, host (self CPU) and GPU (self device) time per step from torch.profiler, in DIR/*.ops.txt.
Writes DIR/breakdown.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeplan.hardware_profiles.calibrate_cuda import warm_on_side_stream

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_bench import EXAMPLES  # noqa: E402

STEPS = 15


def load(model: str, env: dict[str, str]):
    os.environ.update(env)
    spec = importlib.util.spec_from_file_location(Path(model).stem + "_bd", ROOT / model)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def step_fn(mod, batch: int):
    model = mod.build_model().cuda().train()
    x = tuple(t.cuda() for t in mod.example_inputs(batch))
    y = mod.example_target(batch).cuda()
    loss_fn = mod.loss_fn

    def step() -> None:
        loss_fn(model(*x), y).backward()

    def passes() -> tuple[float, float]:
        """(forward + loss, backward) seconds of one step, CUDA events around each, no hooks anywhere."""
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        loss = loss_fn(model(*x), y)
        b.record()
        loss.backward()
        c.record()
        c.synchronize()
        return a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3

    step.passes = passes  # type: ignore[attr-defined]
    return model, step


def timed(step, sync: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def graph_time_s(step) -> float | None:
    warm_on_side_stream(step)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None
    times = []
    for _ in range(STEPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def adam_step_s(net) -> float:
    from pipeplan.hardware_profiles.optimizer_overhead import timed_steps_s
    from pipeplan.optimizers import DEFAULT_LR, make_optimizer

    opt = make_optimizer("adam", [p for p in net.parameters() if p.grad is not None], DEFAULT_LR["adam"])
    return timed_steps_s(opt, STEPS - 3, 3, "cuda")


def op_table(step, path: Path, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    path.write_text(ka.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=60))
    rows = {}
    for e in ka:
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        rows[e.key] = {"calls": e.count / steps, "host_self_us": e.self_cpu_time_total / steps,
                       "gpu_self_us": dev / steps}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    result = {}
    for label, model, batch, env, _ in EXAMPLES:
        mod = load(model, env)
        net, step = step_fn(mod, batch)
        for _ in range(5):
            timed(step, True)
        eager = statistics.median(timed(step, True) for _ in range(STEPS))
        issue = statistics.median(timed(step, False) for _ in range(STEPS))
        split = [step.passes() for _ in range(STEPS)]
        fwd, bwd = statistics.median(f for f, _ in split), statistics.median(b for _, b in split)
        adam = adam_step_s(net)
        net.zero_grad(set_to_none=False)
        ops = op_table(step, a.out / f"{Path(model).stem}.ops.txt")
        torch.cuda.synchronize()
        graph = graph_time_s(step)  # last: a failed capture may leave the stream unusable for this model
        result[label] = {"batch": batch, "adam_step_s": adam, "eager_step_s": eager, "host_issue_s": issue,
                         "eager_fwd_s": fwd, "eager_bwd_s": bwd,
                         "graph_step_s": graph, "ops": ops}
        print(f"{label}: eager {eager * 1e3:.2f} ms (forward {fwd * 1e3:.2f}, backward {bwd * 1e3:.2f}), host issue {issue * 1e3:.2f} ms, graph "
              f"{'-' if graph is None else f'{graph * 1e3:.2f}'} ms, adam {adam * 1e3:.2f} ms",
              flush=True)
        (a.out / "breakdown.json").write_text(json.dumps(result, indent=1))
        del net, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
