"""Two ranks swap one activation-sized message each way over gloo: how often the swap, ~0.1 ms, takes milliseconds.

One command (prints a table; record it in benchmarks/RESULTS.md by hand with the machine):

    python benchmarks/exchange_probe.py [--rounds 200] [--bytes 65536] [--before-ms 3] [--loop-idle]
                                        [--loop-core own|other|any] [--unpinned]

Why: in `pipeplan run` on this machine a post of a send or a receive, ~0.1 ms, now and then takes 3-8 ms
(benchmarks/step_breakdown.py counts them per step). This probe takes the pipeline away: each round both ranks meet
at a barrier, spend `--before-ms` computing (a 256 x 256 matmul loop) or sleeping, then post a send to the other
rank and a receive from it and wait for both; only the swap is timed. Each rank runs as the runtime's ranks do
(`become_local_device`: pinned to its own core with the threads it starts, gloo's among them).

The suspected mechanism (gloo at pytorch/gloo 70dc360, gloo/transport/tcp/pair.cc): the thread that posts a send
holds the pair's mutex while it writes; gloo's I/O thread, woken by the peer's message on the same core, may preempt
it, finds the mutex taken (`handleEvents` only try-locks) and returns to a level-triggered epoll that reports the
same event at once, so it spins on the core the mutex holder needs until the scheduler's next tick. The switches
test that: --loop-idle puts gloo's I/O threads at SCHED_IDLE (they never preempt the rank's thread), --loop-core
moves them to the other rank's core or lets them run on either, --unpinned leaves the ranks unpinned.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gloo_experiments import gloo_io_threads, idle_gloo_threads  # benchmarks/, this script's folder

MODES = ("compute", "sleep")
STALL_S = 1e-3  # a swap of 64 KiB takes ~0.1-0.3 ms here: one over 1 ms waited on something else


def before(mode: str, seconds: float) -> None:
    """Spend `seconds` as the rank would before a swap: computing (as after a stage's op) or asleep."""
    import torch

    if mode == "sleep":
        time.sleep(seconds)
        return
    x = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x @ x


def move_gloo_loop(cores: set[int]) -> None:
    """Put this process's gloo I/O threads on `cores`."""
    for tid in gloo_io_threads():
        os.sched_setaffinity(tid, cores)


def rank_main(rank: int, store_path: str, args: argparse.Namespace, out_dir: str) -> None:
    """One rank: every mode's rounds, its swap times written to out_dir/rank<r>.txt (mode, seconds per line)."""
    import torch
    import torch.distributed as dist

    from pipeplan.hardware_profiles.local_device import become_local_device

    if args.unpinned:  # the same threads, the scheduler free to put gloo's on either core
        torch.set_num_threads(1)
    else:
        become_local_device(rank, 2)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    peer = 1 - rank
    if args.loop_core != "own":
        move_gloo_loop({1 - rank} if args.loop_core == "other" else {0, 1})
    if args.loop_idle:
        idle_gloo_threads()
    send, recv = torch.ones(args.bytes // 4), torch.empty(args.bytes // 4)
    lines = []
    for mode in MODES:
        for i in range(args.rounds + 5):  # the first 5 warm gloo's connection up
            dist.barrier()
            before(mode, args.before_ms / 1e3)
            t0 = time.perf_counter()
            works = [dist.isend(send, peer), dist.irecv(recv, peer)]
            for w in works:
                w.wait()
            if i >= 5:
                lines.append(f"{mode} {time.perf_counter() - t0:.9f}")
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def table(out_dir: str) -> list[str]:
    """Per mode: median and 90th percentile of the swap, the share of swaps over STALL_S, the mean of those."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for path in sorted(Path(out_dir).glob("rank*.txt")):
        for line in path.read_text().splitlines():
            mode, seconds = line.split()
            times[mode].append(float(seconds))
    rows = ["| before the swap | swaps (both ranks) | median ms | 90th percentile ms | over 1 ms | mean of those, ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for mode, ts in times.items():
        ts.sort()
        slow = [t for t in ts if t > STALL_S]
        rows.append(f"| {mode} | {len(ts)} | {statistics.median(ts) * 1e3:.2f} | {ts[int(0.9 * len(ts))] * 1e3:.2f} | "
                    f"{100 * len(slow) / len(ts):.0f}% | {statistics.mean(slow) * 1e3 if slow else 0:.2f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200, help="swaps per mode and rank")
    ap.add_argument("--bytes", type=int, default=64 << 10, help="message size each way (wide_mlp's: 16 x 1024 fp32)")
    ap.add_argument("--before-ms", type=float, default=3.0, help="computing or sleeping before each swap")
    ap.add_argument("--unpinned", action="store_true", help="leave the ranks unpinned (the runtime pins them)")
    ap.add_argument("--loop-core", choices=("own", "other", "any"), default="own",
                    help="where gloo's I/O thread runs: the rank's core (as pinned ranks start it), the other, either")
    ap.add_argument("--loop-idle", action="store_true", help="gloo's I/O thread at SCHED_IDLE")
    args = ap.parse_args()
    if os.cpu_count() is None or os.cpu_count() < 2:
        print("needs 2 cores", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(str(Path(tmp, "store")), args, tmp), nprocs=2, start_method="spawn")
        rows = table(tmp)
    switches = f"{' --unpinned' if args.unpinned else ''} --loop-core {args.loop_core}{' --loop-idle' * args.loop_idle}"
    print(f"Command: `python benchmarks/exchange_probe.py --rounds {args.rounds} --bytes {args.bytes} "
          f"--before-ms {args.before_ms:g}{switches}`\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
