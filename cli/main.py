"""The `pipeplan` command: a click group whose subcommands load lazily.

Lazy loading keeps `pipeplan --help` and `pipeplan profiles list` fast (no torch
import). Error policy lives here, once: a `UserError` prints one line and exits 2,
anything else exits 1; `--debug` shows the traceback for both.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys

import click

from pipeplan import __version__
from pipeplan.errors import UserError

# command name -> "module:attribute"; each module owns one command (or group).
COMMANDS = {
    "trace": "pipeplan.cli.trace_cmd:trace",
    "profiles": "pipeplan.cli.profiles_cmd:profiles",
    "import": "pipeplan.cli.import_cmd:import_",
    "plan": "pipeplan.cli.plan_cmd:plan",
    "analyze": "pipeplan.cli.analyze_cmd:analyze",
    "compare": "pipeplan.cli.compare_cmd:compare",
    "show": "pipeplan.cli.show_cmd:show",
    "run": "pipeplan.cli.run_cmd:run",
    "export": "pipeplan.cli.export_cmd:export",
}


class LazyGroup(click.Group):
    def main(self, args=None, prog_name=None, **extra):
        """Run the command line and apply the exit-code policy (also under CliRunner)."""
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args
        extra.pop("standalone_mode", None)
        try:
            rv = super().main(args=args, prog_name=prog_name or "pipeplan", standalone_mode=False, **extra)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        except click.exceptions.ClickException as e:  # bad flags and arguments are user errors too: one line
            ctx = getattr(e, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {e.format_message()}{where}".replace("\n", " "), err=True)
            sys.exit(2)
        except UserError as e:
            if debug:
                raise
            click.echo(f"error: {_relative(str(e))}", err=True)
            sys.exit(2)
        except Exception as e:  # internal error
            if debug:
                raise
            click.echo(f"internal error: {type(e).__name__}: {e} (re-run with --debug for the traceback)", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def list_commands(self, ctx):
        return sorted(set(self.commands) | {name for name in COMMANDS if self._available(name)})

    def get_command(self, ctx, name):
        if name in self.commands or name not in COMMANDS:
            return self.commands.get(name)
        module, _, attr = COMMANDS[name].partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name == module:  # command not built yet
                return None
            raise

    @staticmethod
    def _available(name: str) -> bool:
        return importlib.util.find_spec(COMMANDS[name].partition(":")[0]) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipeplan")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Plan, predict and run pipeline-parallel training of PyTorch models."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _relative(message: str) -> str:
    """Paths under the working folder as the user typed them (loaders record absolute paths)."""
    try:
        return message.replace(os.getcwd() + os.sep, "")
    except OSError:  # the working folder was removed
        return message


def _terminated(signum, frame) -> None:
    """SIGTERM (a scheduler's cancel) unwinds like Ctrl-C: `finally` blocks stop the children a command
    started (calibrate's link processes; `run` forwards the signal to torchrun itself), atomic writes
    remove their temp files, and the exit code is 128 + 15."""
    click.echo("error: stopped by SIGTERM", err=True)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Console entry point (`pipeplan`, `python -m pipeplan`)."""
    signal.signal(signal.SIGTERM, _terminated)
    cli.main(args=argv, prog_name="pipeplan")
