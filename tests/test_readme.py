"""README's two set-up commands are the contract with newcomers and with CI."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each set-up command is one line to copy"
    assert "pip install ." in commands[0] and "pipeplan " in commands[0]
    assert "pip install '.[dev]'" in commands[1] and commands[1].endswith("pytest")


def readme_test_steps() -> tuple[list[str], str]:
    """README's test command, an `&&` chain: (its install steps, its test step)."""
    *install, test = readme_commands()[1].split(" && ")
    return install, test


def test_ci_installs_lints_type_checks_and_tests_as_readme_says():
    # .ci/run runs README's install steps one a line (so `set -e` stops at the first failure), then ruff and
    # the type check, then README's test step.
    install, test = readme_test_steps()
    assert test == "pytest"
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install[0] in lines, (install, lines)
    i = lines.index(install[0])
    assert lines[i : i + len(install) + 2] == [*install, "ruff check .", ".ci/typecheck"]
    assert test in lines[i + len(install) + 2 :]


STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CI_LOG"
exit "${{STUB_RC_{name}:-0}}"
"""


def run_ci_with_stubs(tmp_path: Path, **rcs: int) -> tuple[int, list[str]]:
    """Run a copy of .ci/run with every tool replaced by a stand-in that logs its call and exits with
    rcs.get(tool, 0) (tools: python3, pip, ruff, typecheck, pytest): (exit status, calls in order)."""
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    bin_.mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / ".venv" / "bin" / "activate").write_text('echo activate >> "$CI_LOG"\n')
    stubs = {bin_ / "python3": "python3", bin_ / "pip": "pip", bin_ / "ruff": "ruff", bin_ / "pytest": "pytest",
             repo / ".ci" / "typecheck": "typecheck"}
    for path, name in stubs.items():
        path.write_text(STUB.format(name=name))
        path.chmod(0o755)
    log = tmp_path / "calls"
    log.touch()
    env = {"PATH": f"{bin_}{os.pathsep}/usr/bin{os.pathsep}/bin", "CI_LOG": str(log),
           **{f"STUB_RC_{tool}": str(rc) for tool, rc in rcs.items()}}
    r = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, log.read_text().splitlines()


CALLS = ["python3 -m venv .venv", "activate", "pip install .[dev]", "ruff check .", "typecheck ", "pytest "]


def test_ci_runs_every_step_in_order(tmp_path):
    assert run_ci_with_stubs(tmp_path) == (0, CALLS)


@pytest.mark.parametrize("tool", ["python3", "pip", "ruff", "typecheck"])
def test_a_failing_step_fails_ci_before_the_tests(tmp_path, tool):
    rc, calls = run_ci_with_stubs(tmp_path, **{tool: 3})
    assert rc != 0
    assert calls == CALLS[: [c.split()[0] for c in CALLS].index(tool) + 1]


@pytest.mark.parametrize("pytest_rc,ci_rc", [(1, 1), (2, 2), (5, 1)])
def test_ci_fails_when_tests_fail_or_none_ran(tmp_path, pytest_rc, ci_rc):
    # pytest's exit 5 (no tests collected) must not pass as a success
    assert run_ci_with_stubs(tmp_path, pytest=pytest_rc) == (ci_rc, CALLS)


def test_readme_example_files_exist():
    for command in readme_commands():
        for path in re.findall(r"(examples/\S+\.py)", command):
            assert (ROOT / path).is_file(), path
