"""The robustness suite's one check: a bad input ends in exit 2 with one line naming the culprit, nothing else.

Every case of tests/test_bad_inputs_*.py goes through `expect_user_error`, which
runs the CLI in-process (click's runner, with the same exit-code policy as the
console script) and asserts, for that one case:
- exit code 2 (a user error, not an internal error 1 and not a silent 0);
- exactly one non-empty line on stderr, starting "error:" (or click's "Error:"),
  containing every string of `names` (the file and the field or option);
- no "Traceback" anywhere, nothing on stdout;
- none of `outputs` exists afterwards, and no temp file (".*.tmp") is left in their folders.

Each call is counted (`CASES`) and, when PIPEPLAN_BAD_INPUTS_LOG names a file, appended
there as a JSON line, so benchmarks/bad_inputs_bench.py can report how many ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from click.testing import CliRunner

from pipeplan.cli.main import cli

CASES: list[str] = []


def expect_user_error(args: Iterable[object], names: Iterable[str] = (), outputs: Iterable[Path] = (),
                      *, label: str | None = None, input: str | None = None) -> str:
    """Run `pipeplan ARGS`; assert the policy above; return the error line."""
    argv = [str(a) for a in args]
    result = CliRunner().invoke(cli, argv, input=input)
    where = f"pipeplan {' '.join(argv)}\nexit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.exit_code == 2, where
    assert "Traceback" not in result.stdout + result.stderr, where
    assert result.stdout.strip() == "", where
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, where
    line = lines[0]
    assert line.startswith(("error:", "Error:")), where
    for name in names:
        assert str(name) in line, f"{name!r} not named\n{where}"
    assert len(line) < 600, f"error line of {len(line)} characters\n{where}"
    for out in outputs:
        out = Path(out)
        assert not out.exists(), f"{out} was written\n{where}"
        if out.parent.is_dir():
            assert not list(out.parent.glob(".*.tmp")), f"temp file left in {out.parent}\n{where}"
    CASES.append(label or " ".join(argv))
    log = os.environ.get("PIPEPLAN_BAD_INPUTS_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, "case": CASES[-1][:200], "line": line[:300]}) + "\n")
    return line
