"""The exit-code policy every command relies on: user error 2, internal error 1, --debug tracebacks."""

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from pipeplan.cli.main import LazyGroup, cli
from pipeplan.errors import UserError


@click.group(cls=LazyGroup)
@click.option("--debug", is_flag=True)
def group(debug):
    pass


@group.command("boom")
@click.argument("kind")
def boom(kind):
    if kind == "user":
        raise UserError("model.py: no function build_model", hint="define build_model() or pass --entry")
    if kind == "internal":
        raise RuntimeError("bug")
    click.echo("fine")


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["boom", "ok"], 0, "fine"),
        (["boom", "user"], 2, "error: model.py: no function build_model (define build_model() or pass --entry)"),
        (["boom", "internal"], 1, "internal error: RuntimeError: bug"),
        (["boom"], 2, "Missing argument"),
        (["nope"], 2, "No such command"),
    ],
)
def test_exit_codes_and_one_line_messages(args, code, text):
    result = CliRunner().invoke(group, args)
    assert result.exit_code == code
    assert text in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_exception():
    result = CliRunner().invoke(group, ["--debug", "boom", "user"])
    assert isinstance(result.exception, UserError)


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "pipeplan", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "pipeplan, version" in out.stdout


def test_every_registered_command_loads():
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        assert cli.get_command(ctx, name) is not None, name
