"""README's two set-up commands are the contract with newcomers and with CI."""

import re
from pathlib import Path

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


def test_ci_runs_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_ci_fails_when_no_test_ran():
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"$rc" -eq 5' in ci and "exit 1" in ci


def test_readme_example_files_exist():
    for command in readme_commands():
        for path in re.findall(r"(examples/\S+\.py)", command):
            assert (ROOT / path).is_file(), path
