"""Calibrate this machine and check the profile against operations it did not measure.

    python benchmarks/calibrate_bench.py [--budget-s 45] [--write-results]

Prints two tables: what `pipeplan profiles calibrate` measured (and how long it
took, against the 60 s target), and roofline predictions from the resulting
profile (time = FLOPs / (peak x efficiency of the op kind), or bytes / (bandwidth
x memory efficiency)) next to the best of 9 measured runs of other GEMM, conv and copy
sizes, one thread. `--write-results` replaces the "Cost models and calibration"
section of benchmarks/RESULTS.md with the same tables.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SECTION = "## Cost models and calibration (`pipeplan profiles calibrate`)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
COMMAND = "python benchmarks/calibrate_bench.py --write-results"


def best_s(fn, reps: int = 9) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def checks(prof) -> list[tuple[str, float, float]]:
    """(operation, predicted s, measured s) for shapes the calibration did not run."""
    import torch
    import torch.nn.functional as F

    peak = prof.peak_flops["fp32"]
    eff = prof.efficiency
    rows = []
    for m, k, n in [(256, 2048, 2048), (384, 1024, 4096), (128, 4096, 1024), (2048, 512, 512)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        measured = best_s(lambda a=a, b=b: torch.mm(a, b))
        rows.append((f"GEMM {m}x{k}x{n}", 2 * m * k * n / (peak * eff["matmul"]), measured))
    for nb, c, h in [(4, 64, 56), (4, 128, 28), (8, 256, 14)]:
        x, w = torch.randn(nb, c, h, h), torch.randn(c, c, 3, 3)
        flops = 2 * nb * h * h * c * c * 9
        measured = best_s(lambda x=x, w=w: F.conv2d(x, w, padding=1))
        rows.append((f"conv3x3 N{nb} C{c} {h}x{h}", flops / (peak * eff["conv"]), measured))
    for mib in (64, 512):
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.empty_like(src)
        measured = best_s(lambda dst=dst, src=src: dst.copy_(src), reps=5)
        rows.append((f"copy {mib} MiB", 2 * mib * 2**20 / prof.mem_bw_bytes_per_s, measured))
    for mib in (4, 64):
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.empty_like(src)
        rows.append((f"relu {mib} MiB (out=)", 2 * mib * 2**20 / (prof.mem_bw_bytes_per_s * eff["memory"]),
                     best_s(lambda src=src, dst=dst: torch.clamp_min(src, 0.0, out=dst))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=45.0)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()

    import torch

    from pipeplan.hardware_profiles.calibrate import calibrate, cpu_share

    t0 = time.perf_counter()
    prof = calibrate(budget_s=args.budget_s)
    elapsed = time.perf_counter() - t0
    cal = prof.calibration
    lines = [
        f"Command: `{COMMAND}` (calibration budget {args.budget_s:g} s; torch {cal['torch']}, one thread per device).",
        "",
        "| measured | value |",
        "|---|---|",
        f"| device | {prof.device}, {prof.devices_per_node} per node |",
        f"| calibration wall time | {elapsed:.1f} s (target < 60 s) |",
        f"| CPU share during calibration | {cal['cpu_share']:.0%} "
        f"({'below 85%: machine busy, numbers pessimistic' if cal['cpu_share'] < 0.85 else 'a whole core: numbers trustworthy'}) |",
        f"| fp32 GEMM peak (best of {len(cal['matmul_fp32_gflops'])} shapes) | {prof.peak_flops['fp32'] / 1e9:.1f} GFLOP/s |",
        f"| fp32 GEMM per shape {cal['matmul_shapes_mkn']} | {cal['matmul_fp32_gflops']} GFLOP/s |",
        f"| bf16 GEMM per shape | {cal['matmul_bf16_gflops']} GFLOP/s (fast path: {cal['bf16_fast_path']}) |",
        f"| conv3x3 per shape {cal['conv3x3_shapes_nch']} | {cal['conv_fp32_gflops']} GFLOP/s |",
        "| efficiency (achieved / peak) | " + ", ".join(f"{k} {v:.2f}" for k, v in prof.efficiency.items()) + " |",
        f"| copy bandwidth (read + write) | {prof.mem_bw_bytes_per_s / 1e9:.1f} GB/s |",
        f"| p2p one way, gloo loopback, 4 B .. 16 MiB | {cal['p2p_one_way_us']} µs |",
        f"| link fit | {prof.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency {prof.intra_node.latency_s * 1e6:.0f} µs |",
        "",
        "Roofline on the calibrated profile vs measured (best of 9 runs; shapes the calibration did not run; 1 thread):",
        "",
        "| operation | predicted ms | measured ms | error |",
        "|---|---:|---:|---:|",
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        rows = checks(prof)
    finally:
        torch.set_num_threads(before)
    share = cpu_share(wall0, cpu0)
    for name, pred, meas in rows:
        lines.append(f"| {name} | {pred * 1e3:.2f} | {meas * 1e3:.2f} | {(pred - meas) / meas:+.0%} |")
    lines += ["", f"CPU share while measuring these: {share:.0%}. Cache-resident elementwise ops (the 4 MiB relu) "
              "run faster than the DRAM bandwidth predicts; see docs/profile-format.md."]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        from results import write_section

        write_section(SECTION, text)


if __name__ == "__main__":
    main()
