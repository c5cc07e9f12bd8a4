"""`pipeplan run`'s worker with a recorder: what each rank's schedule step spends its time on.

benchmarks/step_breakdown.py starts `pipeplan run PLAN --worker-script <this file>`, so torchrun runs this script
(with the worker's usual arguments) instead of `python -m pipeplan.runtime.worker`. It wraps, on the stages of
torch's multi-stage schedule runtime (`_PipelineScheduleRuntime`: interleaved 1F1B, zero bubble, ZB-V, DualPipeV),
each forward and backward (compute), `_wait_batch_p2p` (waiting on a receive before an op) and `_batch_p2p`
(posting sends and receives), and writes every step's intervals, warm-up steps too (step_breakdown.py drops
them), to $PIPEPLAN_BREAKDOWN_DIR/rank<r>.json. Nothing in pipeplan reads this; the recorder costs ~0.3 µs a call
(a wrapped no-op against a bare one, timed by hand).

PIPEPLAN_BREAKDOWN_VARIANT (default, idle, first, first+idle) switches on before the first step the experiments of
benchmarks/gloo_experiments.py: gloo's I/O threads at SCHED_IDLE, every receive posted at the step's start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed.pipelining.schedules as schedules
from gloo_experiments import idle_gloo_threads, receives_first  # benchmarks/ (torchrun runs this as a script)

from pipeplan.runtime import worker

STEPS: list[dict[str, Any]] = []
CURRENT: list[tuple[str, float, float]] = []  # (what, start, end) of the step in progress, perf_counter seconds


def timed(what: str, fn):
    """fn, with each call's interval appended to CURRENT as `what`."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CURRENT.append((what, t0, time.perf_counter()))

    return wrapper


def instrument(schedule) -> None:
    """Wrap the schedule's stages and step, once; refuse what is not torch's multi-stage runtime."""
    if not isinstance(schedule, schedules._PipelineScheduleRuntime):
        raise SystemExit(f"step_breakdown: {type(schedule).__name__} is pipeplan's own loop, not torch's multi-stage "
                         "runtime; plan interleaved, zb-h1, zb-v or dualpipev")
    for stage in schedule._stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed("compute", getattr(stage, name)))
    step = schedule.step

    def recorded_step(*args, **kwargs):
        CURRENT.clear()
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        STEPS.append({"start": t0, "end": time.perf_counter(), "intervals": list(CURRENT)})
        return out

    schedule.step = recorded_step
    variant = os.environ.get("PIPEPLAN_BREAKDOWN_VARIANT", "default")
    if "first" in variant:
        receives_first(schedule)
    if "idle" in variant:
        idle_gloo_threads()


schedules._wait_batch_p2p = timed("receive wait", schedules._wait_batch_p2p)
schedules._batch_p2p = timed("post", schedules._batch_p2p)
_train_step = worker.train_step


def train_step(st, *args, **kwargs):
    if not getattr(st.schedule, "_breakdown", False):
        instrument(st.schedule)
        st.schedule._breakdown = True
    return _train_step(st, *args, **kwargs)


worker.train_step = train_step


def after_step(rank: int, steps_done: int) -> None:
    """Rewrite this rank's record after every step (the worker's last step ends its process)."""
    path = Path(os.environ["PIPEPLAN_BREAKDOWN_DIR"], f"rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(STEPS))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(worker.main(after_step=after_step))
