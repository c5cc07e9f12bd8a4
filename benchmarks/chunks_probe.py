"""How the runtime's time between ops grows with the stages a rank holds: torch's interleaved 1F1B on 2 ranks.

One command (prints two tables; record them in benchmarks/RESULTS.md by hand with the machine):

    python benchmarks/chunks_probe.py [--shape small|large|wide] [--rounds 3] [--variants 2x8,4x8,8x8,2x2,4x2,8x2]

Why: `profiles calibrate` measures interleaved's per-op charge with 2 stages a rank (hardware_profiles/op_overhead.py),
and examples/wide_mlp.py's plans with 4 stages a device ran 12-29% slower than predicted in every defaults-only run.
This runs calibrate's own pipelines (hardware_profiles/pipeline_ops._torch_steps: identical MLP stages, each rank
pinned to a core as the runtime's are) at several (stages a rank) x (microbatches) and prints, per variant, the
median over steps of each step's summed gaps (an op's start less the time it could have started,
op_overhead.op_gaps) and that per op; then the mean gap by how many messages the op's stage and the rank's previous
op's stage send or receive (m, p), which tells a cost per message from a cost per stage held.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
from typing import Any

STEPS, WARMUP = 8, 2


def worker(rank: int, port: int, shape: str, rounds: int, variants: list[tuple[int, int]], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from pipeplan.hardware_profiles import op_overhead, pipeline_ops
    from pipeplan.hardware_profiles.local_device import become_local_device

    become_local_device(rank, 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    pipeline_ops.STEPS, pipeline_ops.WARMUP = STEPS, WARMUP
    rows, layers = op_overhead.SHAPES[shape]
    hidden = op_overhead.HIDDEN.get(shape, op_overhead.WIDTH)
    out: dict[tuple[int, int], list] = {}
    for _ in range(rounds):
        for chunks, m in variants:
            torch.manual_seed(rank)
            dist.barrier()
            out.setdefault((chunks, m), []).extend(pipeline_ops._torch_steps(
                rank, "interleaved", rows, layers, 1, hidden, chunks=chunks, microbatches=m))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def by_messages(gaps: list, msgs: dict[int, int]) -> dict[tuple[int, int], list[float]]:
    """Each op's gap (op_overhead.op_gaps' rows), keyed by (messages of its stage, of the rank's previous op's; 0
    where there is none), `msgs` per stage (op_overhead.stage_messages)."""
    out: dict[tuple[int, int], list[float]] = {}
    for op, prev, gap in gaps:
        out.setdefault((msgs[op[1]], msgs[prev[1]] if prev else 0), []).append(gap)
    return out


def main() -> None:
    import torch.multiprocessing as mp

    from pipeplan.hardware_profiles import op_overhead

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(op_overhead.SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="2x8,4x8,8x8,2x2,4x2,8x2", help="stages a rank x microbatches, ...")
    args = ap.parse_args()
    variants = [(int(c), int(m)) for c, m in (v.split("x") for v in args.variants.split(","))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.shape, args.rounds, variants, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        g = queue.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    nbytes = op_overhead.message_bytes(args.shape)
    transfer_s = 60e-6 + nbytes / 2e9  # a fixed stand-in for the loopback link, as the runs in RESULTS used it
    stage = op_overhead.stage_text(args.shape).rsplit(", M=", 1)[0]  # M is each variant's
    print(f"shape {args.shape} ({stage}; {nbytes} B messages), {args.rounds} rounds of {STEPS - WARMUP} timed steps\n")
    print("| stages a rank | M | ops a rank | step ms | gaps ms a step | gap µs an op |\n|---:|---:|---:|---:|---:|---:|")
    classes = {}
    for (chunks, m), steps0 in g[0].items():
        rows = []
        for a, b in zip(steps0, g[1][(chunks, m)], strict=True):
            gaps = op_overhead.op_gaps(a, b, transfer_s)
            span = max(e[4] for e in a + b) - min(e[3] for e in a + b)
            rows.append((span, sum(gap for _, _, gap in gaps), len(a)))
            for k, v in by_messages(gaps, op_overhead.stage_messages(a, b)).items():
                classes.setdefault((chunks, m), {}).setdefault(k, []).extend(v)
        span, gap = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {chunks} | {m} | {rows[0][2]} | {span * 1e3:.1f} | {gap * 1e3:.2f} | {gap / (2 * rows[0][2]) * 1e6:.0f} |")
    print("\nMean gap µs (ops) by messages of the op's stage (m) and of the rank's previous op's stage (p):\n")
    keys = sorted({k for c in classes.values() for k in c})
    print("| stages a rank | M | " + " | ".join(f"m{m} p{p}" for m, p in keys) + " |")
    print("|---:|---:|" + "---:|" * len(keys))
    for (chunks, m), c in classes.items():
        cells = [f"{statistics.mean(c[k]) * 1e6:.0f} ({len(c[k])})" if k in c else "—" for k in keys]
        print(f"| {chunks} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
