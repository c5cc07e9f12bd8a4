"""How well the roofline on a calibrated local profile predicts real layer times, per kind of op.

Usage (one command, prints a table; --write-results rewrites this benchmark's
section of benchmarks/RESULTS.md):

    python benchmarks/costmodel_bench.py [--budget 20] [--profile local.yaml] [--write-results]

Each layer is run on one thread (as calibrate measures and the runtime runs),
timed with the thread's CPU clock (other processes cannot inflate it), median of
--repeats after warm-up. FLOPs come from FlopCounterMode, bytes moved are the
layer's inputs + outputs + parameters (what the tracer's estimate reduces to for
a single op), and the prediction is `layer_times_s(..., times="roofline")`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SECTION = "## Cost-model accuracy (`benchmarks/costmodel_bench.py`)"

KNOWN_MISSES = (
    "Where the model is known to miss on this CPU: memory-bound kinds (norm, elementwise) are predicted only "
    "roughly (tens of percent, mostly too fast, worst in backward; on a shared machine their timings also swing "
    "several-fold with other processes' memory traffic, which even the CPU clock counts); training-mode BatchNorm reads its input more than once, which a single bytes-moved figure misses; "
    "GELU's erf is vector math FlopCounterMode does not count; embedding backward allocates a fresh dense "
    "gradient of the whole table and on the CPU first-touch page faults dominate (a GPU's caching allocator "
    "has no such cost); small GEMMs and 1x1 convolutions run below the calibrated efficiency. The layers that "
    "dominate training time (matmul, conv, attention) are the ones benchmarks/calibrate_bench.py checks "
    "against the roofline (section above)."
)


def _cases():
    import torch
    from torch import nn

    class Attention(nn.Module):
        def forward(self, q):
            return nn.functional.scaled_dot_product_attention(q, q, q)

    return [
        # name, kind, module, input factory
        ("Linear 256x2048->2048", "matmul", nn.Linear(2048, 2048), lambda: torch.randn(256, 2048)),
        ("Linear 1024x768->3072", "matmul", nn.Linear(768, 3072), lambda: torch.randn(1024, 768)),
        ("Linear 64x1024->1024", "matmul", nn.Linear(1024, 1024), lambda: torch.randn(64, 1024)),
        ("Conv3x3 64ch 4x56x56", "conv", nn.Conv2d(64, 64, 3, padding=1), lambda: torch.randn(4, 64, 56, 56)),
        ("Conv3x3 256ch 4x14x14", "conv", nn.Conv2d(256, 256, 3, padding=1), lambda: torch.randn(4, 256, 14, 14)),
        ("Conv1x1 256->64 4x56x56", "conv", nn.Conv2d(256, 64, 1), lambda: torch.randn(4, 256, 56, 56)),
        ("SDPA 4x8x256x64", "attention", Attention(), lambda: torch.randn(4, 8, 256, 64)),
        ("LayerNorm 4096x1024", "norm", nn.LayerNorm(1024), lambda: torch.randn(4096, 1024)),
        ("BatchNorm2d 64ch 8x56x56", "norm", nn.BatchNorm2d(64), lambda: torch.randn(8, 64, 56, 56)),
        ("GELU 4M", "elementwise", nn.GELU(), lambda: torch.randn(4096, 1024)),
        ("ReLU 4M", "elementwise", nn.ReLU(), lambda: torch.randn(4096, 1024)),
        ("Embedding 50257x768, 4096 ids", "embedding", nn.Embedding(50257, 768),
         lambda: torch.randint(0, 50257, (4, 1024))),
    ]


def _median_cpu_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _flop_counter():
    """The tracer's counter (it adds the CPU SDPA formula FlopCounterMode lacks), else plain FlopCounterMode."""
    try:
        from pipeplan.costmodels.measure import flop_counter

        return flop_counter()
    except ImportError:
        from torch.utils.flop_counter import FlopCounterMode

        return FlopCounterMode(display=False)


def measure(repeats: int):
    import torch

    from pipeplan.costmodels.graph import Layer

    rows = []
    for name, kind, module, make in _cases():
        x = make()
        if x.is_floating_point():
            x.requires_grad_(True)
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        with _flop_counter() as fc:
            out = module(x)
        grad = torch.ones_like(out)
        with _flop_counter() as bc:
            out.backward(grad)
        out_bytes = out.numel() * out.element_size()
        layer = Layer(name, kind=kind, fwd_flops=fc.get_total_flops(), bwd_flops=bc.get_total_flops(),
                      param_bytes=params, output_bytes=out_bytes,
                      bytes_moved=x.numel() * x.element_size() + out_bytes + params)
        with torch.no_grad():
            fwd_s = _median_cpu_s(lambda module=module, x=x: module(x), repeats)

        def fwd_bwd(module=module, x=x, grad=grad):
            # fresh gradients each time, as for a layer inside a network (an input's
            # gradient flows on rather than accumulating into a leaf's .grad)
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x).backward(grad)

        both_s = _median_cpu_s(fwd_bwd, repeats)
        rows.append((layer, fwd_s, max(both_s - fwd_s, 1e-9)))
    return rows


def predict(rows, profile):
    from pipeplan.costmodels import compute
    from pipeplan.costmodels.graph import Graph

    graph = Graph(name="bench", layers=[r[0] for r in rows], edges=[], batch_size=1, source={"device": "cpu"})
    return compute.layer_times_s(graph, profile, times="roofline")


def render(rows, fwd, bwd, profile, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Profile: fp32 peak {profile.flops_for('fp32') / 1e9:.1f} GFLOP/s, copy bandwidth "
        f"{profile.mem_bw_bytes_per_s / 1e9:.1f} GB/s, efficiency "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(profile.efficiency.items()))
        + ". Times: one thread, CPU clock, median. Error = predicted / measured - 1.",
        "",
        "| layer | kind | fwd GFLOP | MB moved | fwd pred ms | fwd meas ms | fwd err | bwd pred ms | bwd meas ms | bwd err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_kind: dict[str, list[float]] = {}
    for (layer, f_s, b_s), fp, bp in zip(rows, fwd, bwd, strict=True):
        fe, be = fp / f_s - 1, bp / b_s - 1
        by_kind.setdefault(layer.kind, []).extend([abs(fe), abs(be)])
        lines.append(f"| {layer.name} | {layer.kind} | {layer.fwd_flops / 1e9:.3f} | {layer.bytes_moved / 1e6:.1f} | "
                     f"{fp * 1e3:.2f} | {f_s * 1e3:.2f} | {fe:+.0%} | {bp * 1e3:.2f} | {b_s * 1e3:.2f} | {be:+.0%} |")
    import os

    lines += ["", "Median absolute error by kind (fwd and bwd together): "
              + ", ".join(f"{k} {statistics.median(v):.0%}" for k, v in by_kind.items()) + ".",
              "", f"1-minute load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
              "", KNOWN_MISSES]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=20.0, help="calibrate() budget in seconds")
    ap.add_argument("--profile", help="use a saved local profile instead of calibrating now")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write-results", action="store_true", help="rewrite this section of benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    import torch

    from pipeplan.hardware_profiles import load_profile
    from pipeplan.hardware_profiles.calibrate import calibrate

    torch.manual_seed(0)
    profile = load_profile(args.profile) if args.profile else calibrate(budget_s=args.budget)
    torch.set_num_threads(1)
    rows = measure(args.repeats)
    fwd, bwd = predict(rows, profile)
    command = "python benchmarks/costmodel_bench.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-results")
    body = render(rows, fwd, bwd, profile, command)
    print(body)
    if args.write_results:
        from results import write_section

        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
