"""`pipeplan run plan.json --steps N`: train the planned pipeline for real and compare with the prediction."""

from __future__ import annotations

import json
import math
import sys

import click

from pipeplan.choices import OPTIMIZERS


@click.command("run")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Training steps to run.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Leading steps left out of the measurement.")
@click.option("--lr", type=float, default=None, help="Learning rate (default: 0.01 for sgd/momentum, 1e-3 for adam/adamw).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None, help="Optimizer (default: the plan's).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Machines taking part.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This machine's index.")
@click.option("--master-addr", default=None, help="Address of node 0 (several machines).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None, help="Port on node 0 (several machines; default 29500).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None, help="Processes per machine (default: devices / nnodes).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (measured, predicted, losses) to stdout.")
@click.option("--chrome-trace", type=click.Path(dir_okay=False), default=None, help="Write measured + simulated timelines (Perfetto).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None, help="Folder for per-stage checkpoints.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True, help="Checkpoint every S steps (0: never).")
@click.option("--resume", is_flag=True, help="Continue from the last complete checkpoint in --checkpoint-dir.")
@click.option("--vertical-sync", is_flag=True,
              help="Asynchronous PipeDream plans: every stage uses the weight version the input stage used.")
@click.option("--initial-loss-scale", type=float, default=None,
              help="fp16 plans: the loss scale of the first step, adjusted as training goes (default 65536, "
                   "torch.amp.GradScaler's); a power of 2 keeps the scaling exact.")
@click.option("--log", "log_file", type=click.Path(dir_okay=False), default=None,
              help="Keep torchrun's and every rank's output in this file (also when the run fails).")
@click.option("--dump-params", type=click.Path(file_okay=False), default=None, hidden=True,
              help="Write each stage's final parameters to DIR/stage-<i>.pt (tests).")
@click.option("--worker-script", type=click.Path(dir_okay=False, exists=True), default=None, hidden=True,
              help="Python script torchrun starts instead of pipeplan.runtime.worker (tests: fault injection).")
def run(plan_file, steps, warmup, lr, optimizer, nnodes, node_rank, master_addr, master_port, nproc_per_node,
        as_json, chrome_trace, checkpoint_dir, checkpoint_every, resume, vertical_sync, initial_loss_scale, log_file,
        dump_params, worker_script):
    """Train PLAN_FILE's pipeline on torch.distributed (one process per device) and report measured vs predicted."""
    from rich.console import Console

    from pipeplan._io import check_destination
    from pipeplan.cli.console import stdout_console
    from pipeplan.cli.run_report import render_table
    from pipeplan.costmodels.compute import LOCAL_TIMES_NOTE_PREFIX
    from pipeplan.planner.plan import load_plan
    from pipeplan.runtime.launch import LaunchOptions, RankFailed, Stopped, launch
    from pipeplan.runtime.report import summarize

    warmup = _warmup(steps, warmup)
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise click.BadParameter(f"{lr} is not a positive finite learning rate", param_hint="'--lr'")
    if initial_loss_scale is not None and not (math.isfinite(initial_loss_scale) and initial_loss_scale > 0):
        raise click.BadParameter(f"{initial_loss_scale} is not a positive finite loss scale",
                                 param_hint="'--initial-loss-scale'")
    plan = load_plan(plan_file)
    steps = _whole_rounds(plan, steps, warmup)
    if chrome_trace:
        check_destination(chrome_trace, "--chrome-trace")
    ctx = click.get_current_context()
    debug = bool((ctx.find_root().obj or {}).get("debug"))
    opts = LaunchOptions(steps=steps, warmup=warmup, lr=lr, optimizer=optimizer, nnodes=nnodes, node_rank=node_rank,
                         master_addr=master_addr, master_port=master_port, nproc_per_node=nproc_per_node,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
                         dump_params=dump_params, worker_script=worker_script, log=log_file, keep_run_dir=debug,
                         vertical_sync=vertical_sync, initial_loss_scale=initial_loss_scale)
    err = Console(stderr=True)

    def notify(line: str) -> None:  # shown before training starts (the checkpoint resumed from)
        err.print(line, markup=False, highlight=False, soft_wrap=True)

    try:
        if as_json:
            result = launch(plan_file, opts, notify=notify)
        else:
            with err.status(f"training {steps} step(s) of {plan.schedule} on {len({d for s in plan.stages for d in s.devices})} process(es)"):
                result = launch(plan_file, opts, notify=notify)
    except RankFailed as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except Stopped as e:  # SIGTERM (a scheduler's cancel) or Ctrl-C: the convention is 128 + the signal
        click.echo(f"error: {e}", err=True)
        sys.exit(128 + e.signum)
    if not result:  # not node 0: rank 0's node reports
        err.print("done (results are reported on node 0)")
        return
    doc = summarize(result, plan)
    elsewhere = _planned_for_another_machine(plan, plan_file)
    doc["notes"] = [elsewhere] if elsewhere else []
    if chrome_trace:
        write_trace(chrome_trace, result, plan)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        out = stdout_console()
        render_table(doc, out)
        for note in plan.notes or []:  # why a local plan's prediction may miss (costmodels.compute.local_times_note)
            if note.startswith(LOCAL_TIMES_NOTE_PREFIX):
                out.print(f"[yellow]note (from the plan): {note}[/yellow]")
        for note in doc["notes"]:
            out.print(f"[yellow]note: {note}[/yellow]", highlight=False)
        if chrome_trace:
            out.print(f"chrome trace: {chrome_trace}")


def _planned_for_another_machine(plan, plan_file: str) -> str | None:
    """Why measured and predicted differ by orders of magnitude when a plan priced on a GPU's catalogue profile
    runs here on CPU processes (the runtime falls back to gloo on the CPU): the table compares two machines."""
    import torch

    from pipeplan.cli.workflow import plan_profile
    from pipeplan.errors import UserError

    if torch.cuda.is_available():
        return None  # on a GPU: the catalogue profile may well be this one's
    try:
        profile = plan_profile(plan.device_profile, plan_file)
    except UserError:
        return None  # a mixed plan's cluster, or a profile file that moved: nothing to say which
    if profile.local:
        return None
    return (f"the plan was predicted for {profile.name} ({profile.device}); this run trained on this machine's CPU "
            "cores, so the prediction is not for them. To predict this machine, plan against its own profile: "
            "`pipeplan profiles calibrate -o local.yaml`, then `--profile local.yaml`")


def _whole_rounds(plan, steps: int, warmup: int) -> int:
    """The default --steps grown to whole rounds of a PipeDream plan's replicas (runtime/placement.whole_rounds),
    said on stderr; steps the user asked for are checked as asked (runtime/pipedream.check_async_steps)."""
    from pipeplan.runtime.placement import steps_per_round, whole_rounds

    source = click.get_current_context().get_parameter_source("steps")
    grown = whole_rounds(plan, steps, warmup)
    if grown == steps or source is None or source.name != "DEFAULT":
        return steps
    click.echo(f"note: running {grown} steps, not the default {steps}: whole rounds of {steps_per_round(plan)} steps "
               f"(this plan's stage replicas take turns), one of them measured after the warm-up", err=True)
    return grown


def _warmup(steps: int, warmup: int) -> int:
    """The warm-up steps to leave out: the default (1) shrinks to fit `--steps 1`; a warm-up the user
    asked for that leaves no measured step is an error, not silently fewer steps."""
    source = click.get_current_context().get_parameter_source("warmup")
    if warmup < steps:
        return warmup
    if source is not None and source.name == "DEFAULT":
        return 0
    raise click.BadParameter(f"--warmup {warmup} leaves no measured step of --steps {steps}",
                             param_hint="'--warmup'")


def write_trace(path: str, result: dict, plan) -> None:
    """Measured timeline (devices 0..P-1) above the simulated one (devices 100..).

    The simulation replays the plan's own per-stage predictions (forward,
    backward, send, all-reduce) through planner.simulate, so it needs neither
    the graph nor the hardware profile at run time.
    """
    from pipeplan.planner.replay import simulate_from_plan
    from pipeplan.planner.timeline import write_chrome_trace
    from pipeplan.runtime.report import measured_events

    events = measured_events(result, plan)
    sim = simulate_from_plan(plan)
    for e in sim.events:
        events.append({"device": e.device + 100, "stage": e.stage, "chunk": e.chunk, "microbatch": e.microbatch,
                       "kind": e.kind, "start_s": e.start_s, "end_s": e.end_s, "peer": (e.peer + 100) if e.peer >= 0 else -1})
    write_chrome_trace(path, events, title=f"pipeplan run ({plan.schedule}): measured = devices 0.., simulated = devices 100..")
