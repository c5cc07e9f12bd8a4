"""Shared by the runtime tests: hand-made plans (no planner needed) and single-process reference steps."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure
from pipeplan.planner.plan import Plan, Prediction, Stage
from pipeplan.schedules import stage_device

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SEED = 1234  # pipeplan.runtime.worker.SEED (kept literal so a change there is noticed here)


def hand_plan(model_file: str, *, stages: int, devices: int, schedule: str, microbatches: int, batch_size: int,
              optimizer: str = "sgd", cuts: list[int] | None = None, entry: str = "build_model",
              data_parallel: int = 1, sharding: str = "none", dtype: str = "fp32") -> Plan:
    """A plan with layers split evenly (or at `cuts`) and stage i on pipeline device i mod devices (the V
    schedules: device i, then 2 * devices - 1 - i; pipeplan.schedules.stage_device).

    With data_parallel d the whole pipeline is replicated d times, stage-major
    (pipeline device p's replicas are ranks p*d .. p*d+d-1, as planner.predict.place).
    """
    spec = load_model_file(model_file, entry)
    torch.manual_seed(0)
    _, graph = export_structure(spec, batch_size // (microbatches * data_parallel))
    names = [l.name for l in graph.layers]
    n = len(names)
    if cuts is None:
        cuts = [round(n * k / stages) for k in range(1, stages)]
    bounds = [0, *cuts, n]
    d = data_parallel
    plan_stages = [Stage(index=s, layers=names[bounds[s]:bounds[s + 1]], devices=[stage_device(schedule, s, devices) * d + r for r in range(d)],
                         replicas=d) for s in range(stages)]
    return Plan(
        graph={"fingerprint": graph.fingerprint(), "name": graph.name, "model_file": spec.path, "entry": entry,
               "depth": None, "trace_batch_size": batch_size // (microbatches * d), "layers": n},
        profile="local", schedule=schedule, microbatches=microbatches, batch_size=batch_size,
        stages=plan_stages, predicted=Prediction(), devices=devices * d, chunks=stages // devices, optimizer=optimizer,
        data_parallel=d, sharding=sharding, dtype=dtype,
    )


def reference_steps(model_file: str, batch_size: int, steps: int, *, microbatches: int = 1, optimizer: str = "sgd",
                    lr: float = 0.01, entry: str = "build_model", autocast: torch.dtype | None = None,
                    scaler: torch.amp.GradScaler | None = None, device: str = "cpu"):
    """Single-process training: (losses, final state dict, alias groups of parameter names).

    With microbatches > 1 the batch is cut the way the pipeline cuts it and the
    gradients are accumulated (mean loss: each microbatch weighted 1/M, like the
    schedules' scale_grads; no loss_fn: summed). That is what a pipeline computes,
    also for BatchNorm, whose statistics are per microbatch. `autocast`: forwards and backwards under
    torch.autocast on `device` in that dtype (the model's weights stay fp32), written out here, not taken from
    pipeplan/precision.py, which the runtime uses; `scaler`: each backward of the loss it scales, each update
    its step (torch.amp.GradScaler, the independent reference for runtime/loss_scale.py).
    """
    from pipeplan.runtime.worker import make_optimizer

    spec = load_model_file(model_file, entry)
    mean_loss = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))
    torch.manual_seed(SEED)
    model = spec.build().to(device)
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr)
    x = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in spec.example_inputs(batch_size))
    y = spec.example_target(batch_size)
    y = y.to(device) if y is not None else None
    # an input whose first dimension is not the batch (a table every sample shares) goes whole into every microbatch
    xs = [tuple(t.tensor_split(microbatches)[i] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch_size
                else t for t in x) for i in range(microbatches)]
    ys = [y.tensor_split(microbatches)[i] if y is not None else None for i in range(microbatches)]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(xs, ys, strict=True):
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                loss = spec.loss(model(*xi), yi if mean_loss else None)
                weighted = loss / microbatches if mean_loss else loss
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
            total += float(loss.detach())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(total / microbatches if mean_loss else total)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, list(groups.values())


def load_dumped(folder: Path) -> dict[str, torch.Tensor]:
    """Per-stage parameter dumps merged by FQN (a tied weight appears in several: all copies returned)."""
    merged: dict[str, list[torch.Tensor]] = {}
    for f in sorted(Path(folder).glob("stage-*.pt")):
        for k, v in torch.load(f, weights_only=True).items():
            merged.setdefault(k, []).append(v)
    return merged


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=str(REPO))


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """`run_cli` in this process (click's CliRunner), for commands that start no process and time nothing (what
    the CLI refuses before it starts any, `plan`, `analyze` on a catalogue profile): the same command line and
    exit-code policy (cli/main.LazyGroup.main applies it under CliRunner too), without the ~3 s of a fresh Python
    importing torch that a subprocess pays."""
    from click.testing import CliRunner

    from pipeplan.cli.main import cli

    r = CliRunner().invoke(cli, list(args))
    return subprocess.CompletedProcess(["pipeplan", *args], r.exit_code, r.stdout, r.stderr)


def run_worker(plans: list, nproc: int, *args: str, timeout: float = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """The plans in turn under one torchrun of `nproc` ranks, `args` the worker's options (runtime/worker.py): with
    two or more plans it writes plan i's results under <run dir>/<i>. One launch's start-up (torchrun, each rank's
    imports, the rendezvous: ~6 s here) serves every plan, where `pipeplan run` would pay it per plan. `check`:
    fail unless it exited 0 (off for a caller that keeps the log or expects a failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "0", "-m", "pipeplan.runtime.worker", *map(str, plans), *args]
    with tempfile.TemporaryDirectory(prefix="pipeplan-test-torchrun-") as tmp:  # torchrun's torchelastic_* log folder
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp})
    assert not check or r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def train_alike(pairs, x: torch.Tensor, steps: int) -> None:
    """Each (model, optimizer) of `pairs` trains `steps` steps on sum(model(x)^2): optimizers held against each
    other from the same starting weights."""
    for model, opt in pairs:
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
