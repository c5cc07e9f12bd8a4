"""A rich progress display on stderr fed by the library's `progress(phase, done, total)` callbacks.

Tracing and searching report phases ("timing layers", "stages=4") with counts;
each new phase becomes its own line so the user sees what already finished and
how long it took, and the spinner and clock keep moving even when a phase
reports nothing for a while. Stdout stays clean for `--json`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

ProgressFn = Callable[..., None]

stderr_console = Console(stderr=True)


class PhaseProgress:
    """Adapter from (phase, done, total) calls to rich tasks, one task per phase."""

    def __init__(self, progress: Progress | None, prefix: str):
        self._progress = progress
        self._prefix = prefix
        self._task = None
        self._phase = None
        self._last_done = None

    def _continues(self, done, total) -> bool:
        if self._task is None or done is None or not total or self._last_done is None:
            return False
        task = self._progress.tasks[-1] if self._progress.tasks else None
        return task is not None and task.id == self._task and task.total == total and done >= self._last_done

    def __call__(self, phase: str = "", done: float | None = None, total: float | None = None, *_, **__) -> None:
        if self._progress is None:
            return
        phase = str(phase)
        if phase != self._phase:
            if self._continues(done, total):
                # Same counter, new label (e.g. the search's "4 stages x 2 replicas", 3 of 10): one line, updated.
                self._progress.update(self._task, description=f"{self._prefix}{phase}")
                self._phase = phase
            else:
                self.finish()
                self._phase = phase
                self._task = self._progress.add_task(f"{self._prefix}{phase}", total=total if total else None)
                self._last_done = None
        if done is not None:
            self._last_done = done
        update = {}
        if total:
            update["total"] = total
        if done is not None:
            update["completed"] = done
        if update:
            self._progress.update(self._task, **update)

    def finish(self) -> None:
        if self._progress is not None and self._task is not None:
            task = next((t for t in self._progress.tasks if t.id == self._task), None)
            total = task.total if task is not None and task.total else 1
            self._progress.update(self._task, total=total, completed=total)
        self._task = None
        self._phase = None


@contextmanager
def progress_display(enabled: bool = True, console: Console | None = None) -> Iterator[Callable[[str], PhaseProgress]]:
    """Yield a factory: `phases("trace: ")` returns a callback that shows phases with that prefix."""
    console = console or stderr_console
    if not enabled or not console.is_terminal:  # piped or logged: bars would print as rows of box characters
        yield lambda prefix="": PhaseProgress(None, prefix)
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    callbacks: list[PhaseProgress] = []

    def factory(prefix: str = "") -> PhaseProgress:
        cb = PhaseProgress(progress, prefix)
        callbacks.append(cb)
        return cb

    with progress:
        try:
            yield factory
        finally:
            for cb in callbacks:
                cb.finish()
