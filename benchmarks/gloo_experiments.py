"""The two changes to gloo's point-to-point that benchmarks/RESULTS.md ("Defaults only") measured, as switches for
benchmarks/exchange_probe.py and benchmarks/step_breakdown.py: nothing in pipeplan runs them.

`idle_gloo_threads`: gloo's I/O threads at SCHED_IDLE, so that they never preempt the rank's thread while it holds a
pair's mutex (a post that waited for that mutex took 3-8 ms). `receives_first`: every receive of a rank's step
posted at its start, so that gloo, which sends a message only once its receive is posted, can write each send at
once from the posting thread instead of leaving it to an I/O thread that SCHED_IDLE keeps off a computing core.
Together they made the runtime's interleaved plans of four examples up to 12% faster on this machine; `profiles
calibrate`'s per-op charge, measured with them on its plain MLP stages, then fell further than the runtime's ops
did, and examples/mlp.py's and examples/wide_mlp.py's interleaved plans read +24% and +21% (RESULTS.md), so the
runtime does not use them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

GLOO_IO_THREAD = "gloo_tcp_loop"  # the name gloo's tcp transport gives its I/O thread (gloo/transport/tcp/loop.cc)


def receives_first(schedule: Any) -> bool:
    """Move every receive of each rank's step to the start of its action list, in their order; True if done.

    Safe because torch matches a peer's messages to posted receives in order: `_add_send_recv` appends a send to
    the sender's list and its receive to the receiver's at the same moment, so between any two ranks the receives
    keep the order of the sends whatever comes between them; the receive buffers exist from the first step
    (`PipelineStage` makes one per microbatch), so posting them early allocates nothing.
    """
    from torch.distributed.pipelining.schedules import RECV_B, RECV_F, _PipelineScheduleRuntime

    if not isinstance(schedule, _PipelineScheduleRuntime) or schedule.pipeline_order_with_comms is None:
        return False
    for rank, actions in schedule.pipeline_order_with_comms.items():
        receives = [a for a in actions if a.computation_type in (RECV_F, RECV_B)]
        others = [a for a in actions if a.computation_type not in (RECV_F, RECV_B)]
        schedule.pipeline_order_with_comms[rank] = receives + others
    return True


def gloo_io_threads() -> list[int]:
    """This process's gloo I/O threads (Linux; none where /proc is not there)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    out = []
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() == GLOO_IO_THREAD:
                out.append(int(task.name))
        except OSError:  # the thread ended while we looked
            continue
    return out


def idle_gloo_threads() -> int:
    """Put this process's gloo I/O threads at SCHED_IDLE (any process may lower its own threads); how many."""
    if not hasattr(os, "sched_setscheduler"):  # not Linux
        return 0
    done = 0
    for tid in gloo_io_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done += 1
        except OSError:
            continue
    return done
