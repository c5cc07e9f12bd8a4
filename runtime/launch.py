"""Start one worker per device with torchrun and collect what they report.

torchrun (`python -m torch.distributed.run`) is the launcher PyTorch users know;
its elastic agent also gives us the failure behaviour the issue asks for: when
one rank dies, the agent stops every other rank of the node (max restarts 0),
and the gloo/NCCL timeout bounds how long a rank on another node can wait.
This file turns the agent's outcome into one line naming the failed stage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeplan.errors import UserError


class RankFailed(Exception):
    """A worker process died (not a user error: the run itself failed)."""


@dataclass
class LaunchOptions:
    steps: int
    warmup: int = 0
    lr: float | None = None
    optimizer: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    dump_params: str | None = None
    log: str | None = None
    """A file to keep torchrun's and every rank's output in, whatever the outcome (the run folder is removed)."""
    keep_run_dir: bool = False
    """Keep the temp run folder (torchrun.log, per-rank status and results) for debugging (`--debug`)."""
    env: dict[str, str] = field(default_factory=dict)
    vertical_sync: bool = False
    """Asynchronous PipeDream plans: every stage uses the input stage's weight version (runtime/pipedream.py)."""
    initial_loss_scale: float | None = None
    """fp16 plans: the first step's loss scale (None: runtime/loss_scale.DEFAULT_INITIAL_SCALE)."""
    worker_script: str | None = None
    """A script torchrun starts instead of `-m pipeplan.runtime.worker`, with the same arguments. Tests only:
    tests/runtime_fault_worker.py wraps the real worker's main with a step hook that kills a rank."""


def devices_used(plan) -> int:
    return len({d for s in plan.stages for d in s.devices})


def check_plan(plan, opts: LaunchOptions) -> int:
    """Everything checkable before starting processes; returns processes per node."""
    from pipeplan.precision import scales_loss, trained_dtype
    from pipeplan.runtime.placement import stage_ranks, torch_schedule_class
    from pipeplan.schedules import facts

    types = sorted({s.device_type for s in plan.stages if s.device_type is not None})
    if len(types) > 1:  # the plan's stages on different device types (--cluster)
        raise UserError(f"this plan runs on a mixed cluster ({', '.join(types)}); `pipeplan run` runs every stage "
                        "as a CPU process on this machine and cannot emulate different device types",
                        "run a plan made with --profile and --gpus, or run this one on the cluster itself")
    if facts(plan.schedule).flushes:  # asynchronous PipeDream runs runtime/pipedream.py's loop, no torch class
        torch_schedule_class(plan.schedule)
        if opts.vertical_sync:
            raise UserError(f"--vertical-sync applies to asynchronous PipeDream plans; this plan's {plan.schedule} "
                            "flushes, so every microbatch already sees one weight version", "drop --vertical-sync")
    if opts.initial_loss_scale is not None and not scales_loss(plan.dtype, plan.schedule):
        raise UserError(f"--initial-loss-scale applies to fp16 plans that flush; this one trains in "
                        f"{trained_dtype(plan.dtype, plan.schedule)} without loss scaling", "drop --initial-loss-scale")
    stage_ranks(plan)  # replicas / placement checks (asynchronous plans: runtime/pipedream.check_async_plan)
    if plan.schedule == "pipedream-2bw":
        from pipeplan.runtime.pipedream import check_async_plan
        from pipeplan.runtime.pipedream_2bw import check_2bw_plan

        check_2bw_plan(check_async_plan(plan), opts)
    if not facts(plan.schedule).flushes:
        from pipeplan.runtime.pipedream import check_async_steps

        check_async_steps(plan, opts.steps, opts.warmup)
        if (opts.checkpoint_dir and opts.checkpoint_every) or opts.resume:
            raise UserError("checkpoints of an asynchronous PipeDream run are not written yet (each stage holds "
                            "stashed weight versions)", "run without --checkpoint-dir / --resume")
    if plan.graph.get("model_file") is None:
        raise UserError("this plan was made from an imported graph (no model file), so there is nothing to run",
                        "plan from `pipeplan trace model.py` to run it")
    if not Path(plan.graph["model_file"]).exists():
        raise UserError(f"the plan's model file {plan.graph['model_file']} does not exist", "re-plan from the model file's new location")
    if opts.steps < 1 or opts.warmup < 0 or opts.warmup >= opts.steps:
        raise UserError(f"--steps {opts.steps} --warmup {opts.warmup}: need steps >= 1 and 0 <= warmup < steps",
                        "measure at least one step after the warm-up")
    if opts.checkpoint_every and not opts.checkpoint_dir:
        raise UserError("--checkpoint-every needs --checkpoint-dir", "pass --checkpoint-dir DIR")
    if opts.checkpoint_dir and plan.sharding != "none" and plan.data_parallel > 1:
        raise UserError(f"checkpoints of a sharded plan ({plan.sharding}) are not written yet: each replica holds "
                        "a different optimizer shard", "re-plan with --sharding none to checkpoint this run")
    if opts.resume and not opts.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir", "pass the --checkpoint-dir of the interrupted run")
    if opts.node_rank >= opts.nnodes:  # torchrun would wait for a rendezvous that cannot complete
        raise UserError(f"--node-rank {opts.node_rank} with --nnodes {opts.nnodes}: node ranks are 0..{opts.nnodes - 1}",
                        "number the machines from 0")
    n = devices_used(plan)
    per_node = opts.nproc_per_node or -(-n // opts.nnodes)
    if per_node * opts.nnodes < n:
        raise UserError(f"the plan uses {n} devices but {opts.nnodes} node(s) x {per_node} processes were asked for",
                        f"launch at least {n} processes in total")
    if per_node * opts.nnodes > n:
        if opts.nproc_per_node is None:
            raise UserError(f"the plan uses {n} devices, which do not divide evenly over {opts.nnodes} nodes",
                            "pass --nproc-per-node, or re-plan for a device count that divides")
    cuda = _cuda_devices()
    if cuda and per_node > cuda:
        raise UserError(f"the plan needs {per_node} GPUs on this node but {cuda} are visible",
                        "re-plan for fewer devices or run on more nodes")
    return per_node


def check_resume(plan, opts: LaunchOptions) -> dict[str, Any] | None:
    """With --resume: the checkpoint the run will start from ({"step", "dir", "skipped"}), checked before
    any process starts. No intact checkpoint, or one at or past --steps, is a user error: starting from
    scratch, or measuring nothing, without a word would hide it."""
    if not opts.resume or not opts.checkpoint_dir:
        return None
    from pipeplan.runtime import checkpoint as ckpt

    root = Path(opts.checkpoint_dir)
    if not root.is_dir():
        raise UserError(f"--resume: checkpoint folder {root} does not exist", "check --checkpoint-dir, or drop --resume")
    manifest, skipped = ckpt.latest(root, stages=len(plan.stages), fingerprint=plan.graph["fingerprint"])
    if manifest is None:
        why = f" ({skipped[-1]})" if skipped else ""
        raise UserError(f"--resume: no intact checkpoint in {root}{why}", "check --checkpoint-dir, or drop --resume")
    if manifest["step"] >= opts.steps:
        raise UserError(f"--resume: the checkpoint in {root} is at step {manifest['step']}, not before --steps {opts.steps}",
                        f"pass --steps greater than {manifest['step']}")
    return {"step": manifest["step"], "dir": str(root), "skipped": skipped}


def check_outputs(opts: LaunchOptions) -> None:
    """Every place the run will write, checked (folders made) before any process starts, so a read-only or
    misspelt destination is a one-line error at once rather than after the training."""
    from pipeplan._io import check_destination

    if opts.checkpoint_dir and opts.checkpoint_every:
        check_folder(opts.checkpoint_dir, "--checkpoint-dir")
    if opts.dump_params:
        check_folder(opts.dump_params, "--dump-params")
    if opts.log:
        check_destination(opts.log, "--log")


def check_folder(path: str, option: str) -> None:
    """`path` is, or is now made, a folder this process can write into; else a UserError naming `option`."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {path}: is a file, not a folder", f"pick another {option}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{option} {path}: cannot create the folder ({e.strerror})", f"pick another {option}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: folder is not writable", f"pick another {option}")


def make_run_dir() -> Path:
    """The temp run folder (torchrun's log, per-rank status and results), in $TMPDIR."""
    try:
        return Path(tempfile.mkdtemp(prefix="pipeplan-run-"))
    except OSError as e:
        where = tempfile.tempdir or os.environ.get("TMPDIR") or "the temp folder"  # tempdir: the one mkdtemp used
        raise UserError(f"cannot create the run's temp folder in {where} ({e.strerror})",
                        "set TMPDIR to a writable folder") from None


def torchrun_command(plan_path: str, per_node: int, opts: LaunchOptions, run_dir: str,
                     resume_step: int | None = None) -> list[str]:
    """torchrun starting the worker (opts.worker_script in tests) on this node, with the run's options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_node), "--max-restarts", "0"]
    if opts.nnodes == 1 and opts.master_addr is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(opts.nnodes), "--node-rank", str(opts.node_rank),
                "--master-addr", opts.master_addr or "127.0.0.1", "--master-port", str(opts.master_port or 29500)]
    cmd += [os.path.abspath(opts.worker_script)] if opts.worker_script else ["-m", "pipeplan.runtime.worker"]
    cmd += [os.path.abspath(plan_path), "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--run-dir", run_dir]
    if opts.lr is not None:
        cmd += ["--lr", repr(opts.lr)]
    if opts.optimizer:
        cmd += ["--optimizer", opts.optimizer]
    if opts.checkpoint_dir:
        cmd += ["--checkpoint-dir", os.path.abspath(opts.checkpoint_dir), "--checkpoint-every", str(opts.checkpoint_every)]
    if opts.resume:
        cmd += ["--resume"] + (["--resume-step", str(resume_step)] if resume_step is not None else [])
    if opts.dump_params:
        cmd += ["--dump-params", os.path.abspath(opts.dump_params)]
    if opts.vertical_sync:
        cmd += ["--vertical-sync"]
    if opts.initial_loss_scale is not None:
        cmd += ["--initial-loss-scale", repr(opts.initial_loss_scale)]
    return cmd


_ROOT_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def failed_rank(log: str, run_dir: Path, world: int) -> tuple[int | None, str]:
    """The rank that failed first, from torchrun's report (else the first rank that never finished)."""
    m = _ROOT_RANK.search(log)
    if m:
        return int(m.group(1)), f"exit code {m.group(2)}"
    for r in range(world):
        if not (run_dir / f"status-rank{r}").exists():
            return r, "no exit status"
    return None, "unknown cause"


def check_builds_fit(plan, per_node: int) -> None:
    """Refuse, before torchrun starts, a plan whose processes on this node cannot all build the model.

    Every process builds the whole model with real weights and then keeps its own stages (worker.load_split_model),
    so a node's processes hold per_node copies of the weights at once while they start; past the RAM still free
    the kernel's OOM killer ends them one by one (costmodels/model_file.ram_shortfall).
    """
    from pipeplan.costmodels.model_file import load_model_file, ram_shortfall

    model_file = plan.graph.get("model_file")
    if not model_file:
        return
    short = ram_shortfall(load_model_file(model_file, plan.graph.get("entry") or "build_model",
                                          seq_len=plan.graph.get("seq_len")), per_node, grads=False)
    if short is not None:
        need, free = short
        raise UserError(
            f"{model_file}: each of this node's {per_node} processes builds the whole model with real weights "
            f"({need / per_node / 2**30:,.2f} GiB) before it keeps its stages: {need / 2**30:,.2f} GiB, more "
            f"than the {free / 2**30:,.2f} GiB of RAM free",
            "run it over more nodes (--nnodes) or on a machine with more RAM (pipeplan run does not yet build only "
            "each process's own stages)")


def launch(plan_path: str, opts: LaunchOptions, *, notify: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the plan; returns rank 0's result document (see worker.teardown).

    Everything checkable is checked before torchrun starts; `notify` gets the
    lines to show then (the checkpoint resumed from, damaged ones skipped). The
    run folder (torchrun's log, per-rank status and results) is a temp folder
    removed on every way out (kept with opts.keep_run_dir); the failure message
    carries the failing rank's own error line instead of pointing into it, and
    opts.log keeps the output.
    """
    from pipeplan.hardware_profiles.calibrate import core_count
    from pipeplan.planner.plan import load_plan
    from pipeplan.precision import precision_note, recipe_note  # imports torch: not at the CLI's start

    plan = load_plan(plan_path)
    per_node = check_plan(plan, opts)
    check_builds_fit(plan, per_node)
    resumed = check_resume(plan, opts)
    check_outputs(opts)
    shared = shared_cores_warning(per_node, _cuda_devices(), core_count())
    for warning in (shared, precision_note(plan.dtype, plan.schedule),
                    recipe_note(plan.dtype, plan.mixed_precision, plan.schedule)):
        if warning and notify is not None:
            notify(warning)
    if resumed is not None and notify is not None:
        for line in resumed["skipped"]:
            notify(f"warning: {line}")
        notify(f"resumed from the checkpoint of step {resumed['step']} in {resumed['dir']}")
    run_dir = make_run_dir()
    if opts.keep_run_dir and notify is not None:
        notify(f"run folder (kept): {run_dir}")
    try:
        # TMPDIR: torchrun's own log folder (torchelastic_*) and torch's temp files go in the run folder too
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(run_dir), **opts.env}
        cmd = torchrun_command(plan_path, per_node, opts, str(run_dir), resumed["step"] if resumed else None)
        returncode = run_torchrun(cmd, env, run_dir / "torchrun.log")
        result = _outcome(plan, opts, per_node, run_dir, returncode)
        if resumed is not None and result:
            result["resumed"] = resumed
        return result
    finally:
        _keep_log(run_dir, opts)
        if not opts.keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def shared_cores_warning(per_node: int, cuda_devices: int, cores: int) -> str | None:
    """A warning where this node's CPU ranks outnumber its cores, else None. Each rank is one process of one thread
    (OMP_NUM_THREADS=1) that a local profile prices as a core of its own; more of them than cores take turns, so
    the run measures the machine's sharing, not the plan (planner/predict_report.local_machines_note). A warning,
    not a refusal: a run to check training, not timing, is still worth doing. On GPUs `check_plan` counts them."""
    if cuda_devices or per_node <= cores:
        return None
    return (f"warning: {per_node} processes of one thread on this machine's {cores} cores take turns on them, so "
            f"steps take longer than predicted (the plan prices a core a device); run on "
            f"{-(-per_node // cores)} machines (--nnodes), or re-plan for {cores} devices or fewer")


def _cuda_devices() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # pragma: no cover - torch always imports here
        return 0


def _keep_log(run_dir: Path, opts: LaunchOptions) -> None:
    """Copy torchrun's log to --log (atomically, keeping the umask), on every way out."""
    log = run_dir / "torchrun.log"
    if opts.log and log.exists():
        from pipeplan._io import atomic_write_bytes

        atomic_write_bytes(opts.log, log.read_bytes())


def _where_output_is(opts: LaunchOptions, run_dir: Path) -> str:
    """Where the failed run's full output can be read, or how to keep it next time."""
    if opts.log:
        return f"every rank's output: {opts.log}"
    if opts.keep_run_dir:
        return f"every rank's output: {run_dir / 'torchrun.log'}"
    return "pass --log FILE to keep every rank's output"


def _outcome(plan, opts: LaunchOptions, per_node: int, run_dir: Path, returncode: int) -> dict[str, Any]:
    """Rank 0's result, or the error the run ended with (a rank's user error, else the failed rank)."""
    errors = sorted(run_dir.glob("error-rank*.json"))
    if errors:
        raise UserError(json.loads(errors[0].read_text())["message"])
    log_text = (run_dir / "torchrun.log").read_text(errors="replace")
    if returncode != 0:
        rank, cause = failed_rank(log_text, run_dir, per_node * opts.nnodes)
        tail = _last_error_line(log_text, rank)
        where = _where_output_is(opts, run_dir)
        if rank is None:
            raise RankFailed(f"the run failed (torchrun exit {returncode}){': ' + tail if tail else ''} ({where})")
        from pipeplan.runtime.placement import stage_ranks

        stages = sorted(s for s, rs in stage_ranks(plan).items() if rank in rs)
        names = ", ".join(f"stage {s}" for s in stages) or "no stage"
        raise RankFailed(f"rank {rank} ({names}) failed ({cause}){': ' + tail if tail else ''}; all ranks were "
                         f"stopped ({where})")
    result_path = run_dir / "result.json"
    if not result_path.exists():  # another node's launcher: rank 0 reports
        return {}
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


class Stopped(Exception):
    """The launcher got SIGTERM or SIGINT; every child was stopped. `signum` is the signal."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}: torchrun and every worker were stopped")
        self.signum = signum


STOP_GRACE_S = 8.0
"""How long torchrun gets to stop its workers after the forwarded signal before the group is killed."""


def run_torchrun(cmd: list[str], env: dict[str, str], log_path: Path) -> int:
    """Run torchrun in its own process group and never leave it behind.

    A batch scheduler cancels a job with SIGTERM to the launcher (Ctrl-C sends
    SIGINT): the signal is forwarded to torchrun's group, torchrun passes it to
    its workers, and all of them get STOP_GRACE_S to exit before SIGKILL; then
    `Stopped` is raised. Any other way out (an exception) stops them too.
    (Handlers can only be set from the main thread; elsewhere the caller's own
    signal handling applies, and the `finally` still stops the children.)
    """
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while proc.poll() is None and not received:
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            if received:
                _stop_group(proc, received[0])
                raise Stopped(received[0])
            return proc.returncode
        finally:
            if proc.poll() is None or _alive(_descendants(proc.pid)):
                _stop_group(proc, signal.SIGTERM)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the launcher dies
if os.getppid() != int(sys.argv[1]):  # it died before the line above
    sys.exit(143)
os.execv(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` behind a few lines of Python that make Linux send it SIGTERM if the launcher dies without
    unwinding (SIGKILL, the OOM killer), then exec it: torchrun then stops its workers as on a forwarded
    SIGTERM, and each worker also asks for SIGKILL when torchrun dies (worker.die_with_parent).
    No preexec_fn: it is unsafe with threads (the progress spinner)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc; torchrun starts each worker in a session of its own,
    so signalling torchrun's group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pids: list[int]) -> list[int]:
    live = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            live.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            live.append(pid)
    return live


def _stop_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal torchrun's group (torchrun passes it on to its workers), wait up to STOP_GRACE_S for torchrun
    and every process below it to exit, then SIGKILL whatever is left."""
    family = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or _alive(family)):
        family = sorted(set(family) | set(_descendants(proc.pid)))
        time.sleep(0.1)
    for pid in [proc.pid, *_alive(family)] if proc.poll() is None else _alive(family):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _last_error_line(log: str, rank: int | None = None) -> str:
    """The failed rank's own last exception line (torchrun prefixes worker output with [rankR]:)."""
    pattern = re.compile(r"^\[rank(\d+)\]:\s*(\w*(Error|Exception)\b.*)")
    for line in reversed(log.splitlines()):
        m = pattern.match(line.strip())
        if m and (rank is None or int(m.group(1)) == rank):
            return m.group(2)[:200]
    return ""
