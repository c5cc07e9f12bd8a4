"""Fit the one catalogue number a published source calibrates: the memory efficiency of Pascal (GP102) profiles.

The catalogue's default memory efficiency (0.80, costmodels/compute.py: STREAM-like copies on HBM) prices the
memory-bound layers of a training step: norms, activations, pooling, residual adds. cnn-benchmarks (published/
cases.yaml) times seven CNNs on two GP102 cards, from VGG (3x3 convolutions and ReLU; few bytes per FLOP) to
ResNets (a batch norm and an activation after every convolution), so the efficiency its rows imply is measurable
apart from the convolutions'. This script predicts those rows at every efficiency of a grid and prints the median
|log(predicted / published)|; the minimum is the value the GP102 profiles carry (catalog/titan-x-pascal.yaml,
gtx-1080-ti.yaml, p40.yaml). torchgpipe's P40 rows are printed beside it, not fitted: they are the held-out check.

Command: python benchmarks/published_fit.py
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import published_bench as pb  # noqa: E402

FIT_SOURCE = "cnn-benchmarks"
HELD_OUT = ("torchgpipe", "torchgpipe-timeline")  # the speed benchmarks and the timeline benchmark
PROFILES = ("titan-x-pascal", "gtx-1080-ti", "p40")
GRID = [round(0.40 + 0.02 * i, 2) for i in range(26)]  # 0.40 .. 0.90


def with_memory_efficiency(profile, value: float):
    """The profile with its memory efficiency set to `value` (the 'memory' key of its efficiency table)."""
    return dataclasses.replace(profile, efficiency={**(profile.efficiency or {}), "memory": value})


def ratios(cases, graphs, value: float) -> dict[str, float]:
    import pipeplan

    profiles = {gpu: with_memory_efficiency(pipeplan.load_profile(gpu), value) for gpu in {c["gpu"] for c in cases}}
    return {c["id"]: pb.predict_case(c, graphs[c["model"]], profiles[c["gpu"]])["samples_per_s"] / float(c["published"])
            for c in cases}


def median_log_error(values) -> float:
    return statistics.median(abs(math.log(v)) for v in values)


def main() -> int:
    import torch

    torch.set_num_threads(1)
    doc = pb.load_cases()
    cases = [c for c in doc["cases"] if c["source"] in (FIT_SOURCE, *HELD_OUT) and c["gpu"] in PROFILES]
    graphs = {c["model"]: pb.trace_model(doc["models"][c["model"]], use_cache=True)[0] for c in cases}
    print(f"| memory efficiency | {FIT_SOURCE}: median, worst error (fitted) | {', '.join(HELD_OUT)}: median, worst error "
          "(held out) |\n|---:|---|---|")
    best = None
    source = {c["id"]: c["source"] for c in cases}
    for value in GRID:
        r = ratios(cases, graphs, value)
        fit = [v for k, v in r.items() if source[k] == FIT_SOURCE]
        held = [v for k, v in r.items() if source[k] in HELD_OUT]
        score = median_log_error(fit)
        if best is None or score < best[0]:
            best = (score, value)
        print(f"| {value:.2f} | {statistics.median(abs(v - 1) for v in fit):.1%}, {max(abs(v - 1) for v in fit):.0%} "
              f"| {statistics.median(abs(v - 1) for v in held):.1%}, {max(abs(v - 1) for v in held):.0%} |", flush=True)
    print(f"\nfitted memory efficiency ({FIT_SOURCE}, median |log ratio| {best[0]:.3f}): {best[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
