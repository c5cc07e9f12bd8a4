"""A worker entry for the exit test: the real worker, with an exit handler that leaves a mark if it runs.

tests/test_runtime_reliability.py runs `pipeplan run ... --worker-script <this file>`. A rank that ends through
Python's finalization runs its atexit handlers; runtime/worker.leave_without_finalizing skips them (and the
teardown race it exists for), so a finished run must leave no mark. PIPEPLAN_TEST_MARK_DIR is read here only.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from pipeplan.runtime import worker


def mark() -> None:
    Path(os.environ["PIPEPLAN_TEST_MARK_DIR"], f"finalized-rank{os.environ.get('RANK', '?')}").write_text("1\n")


if __name__ == "__main__":
    atexit.register(mark)
    sys.exit(worker.main())
