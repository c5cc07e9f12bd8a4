"""The CLI run in this process for tests: click's CliRunner on a command line, and the one line a user error prints.

In-process, a command costs no fresh Python importing torch (~3 s a subprocess); the exit-code policy is the same
(cli/main.LazyGroup.main applies it under CliRunner too). runtime_helpers.run_cli_here is the same call shaped as a
CompletedProcess, for tests written against subprocesses.
"""

from __future__ import annotations

from collections.abc import Iterable

from click.testing import CliRunner

from pipeplan.cli.main import cli


def invoke(args: Iterable[object]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `pipeplan ARGS` (paths and numbers in `args` are str()-ed)."""
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    """The one `error:` line a user error prints (progress lines aside), with no traceback."""
    lines = [l for l in stderr.splitlines() if l.startswith("error:") or l.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]
