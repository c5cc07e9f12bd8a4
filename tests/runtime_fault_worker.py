"""A worker entry for the kill test: the real worker, with a step hook that crashes one rank.

tests/test_runtime_reliability.py runs `pipeplan run ... --worker-script <this file>`, so
torchrun starts this script (with the worker's usual arguments) instead of
`python -m pipeplan.runtime.worker`. PIPEPLAN_TEST_KILL_RANK / PIPEPLAN_TEST_KILL_STEP
are read here only, never by the runtime: rank KILL_RANK dies when KILL_STEP steps
are done, i.e. before step index KILL_STEP runs.
"""

from __future__ import annotations

import os
import sys

from pipeplan.runtime import worker


def kill_hook(kill_rank: int, kill_step: int) -> worker.StepHook:
    """A step hook that ends rank `kill_rank` after `kill_step` steps like a crashed process."""

    def after_step(rank: int, steps_done: int) -> None:
        if rank == kill_rank and steps_done == kill_step:
            os._exit(9)  # no cleanup, no message: what a segfault or an OOM kill leaves behind

    return after_step


if __name__ == "__main__":
    hook = kill_hook(int(os.environ["PIPEPLAN_TEST_KILL_RANK"]), int(os.environ["PIPEPLAN_TEST_KILL_STEP"]))
    sys.exit(worker.main(after_step=hook))
