"""The per-rank training loop, started by torchrun (`python -m pipeplan.runtime.worker`).

Every rank rebuilds the same model from the plan's model file with the same
seed, re-exports it at the microbatch size, checks the graph fingerprint, cuts
the exported graph into the plan's stages (runtime/split.py) and keeps the
stages the plan places on it. The schedule objects of
torch.distributed.pipelining do the pipelining; this file adds what the plan
needs around them: tied-weight gradient sums, optimizer steps, measurement,
checkpoints, and results gathered on rank 0.

Failures: a `UserError` on any rank is written to `<run dir>/error-rank<R>.json`
and the rank exits 2, so the launcher can print that one line. Ranks write
`<run dir>/status-rank<R>` when they finish, so the launcher can tell a rank that
died from ranks that were stopped because of it.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan._io import atomic_write_bytes, atomic_write_json
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.local_device import become_local_device
from pipeplan.runtime import checkpoint as ckpt
from pipeplan.runtime.measure import (SavedTensorMeter, StageStats, StepClock, instrument, median, optimizer_state_bytes, tensor_bytes,
                                      weight_storages)
from pipeplan.runtime.split import flat_inputs, split_program, unflatten_output

SEED = 1234  # every rank builds the model with this seed, so replicas of a tensor start identical
# gloo/NCCL timeout of every collective and send/receive: a rank whose neighbour vanished (on another
# machine; on the same machine torchrun stops it at once) gives up well within 60 s. Raise it with
# PIPEPLAN_TIMEOUT_S when one step of a stage can take longer than that.
TIMEOUT_S = float(os.environ.get("PIPEPLAN_TIMEOUT_S", 45))


@dataclass
class Options:
    plan: list[str]
    steps: int
    warmup: int
    lr: float | None
    optimizer: str | None
    run_dir: str
    checkpoint_dir: str | None
    checkpoint_every: int
    resume: bool
    dump_params: str | None


def parse(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(prog="pipeplan-worker")
    p.add_argument("plan", nargs="+", help="several plans run one after the other in the same processes "
                   "(results in RUN_DIR/<i>/, parameter dumps in DUMP_PARAMS/<i>/): the tests' way to save start-up time")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--optimizer", default=None)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dump-params", default=None)
    a = p.parse_args(argv)
    return Options(a.plan, a.steps, a.warmup, a.lr, a.optimizer, a.run_dir, a.checkpoint_dir, a.checkpoint_every, a.resume, a.dump_params)


# ---------------------------------------------------------------- placement
def stage_ranks(plan) -> dict[int, list[int]]:
    """stage index -> its ranks, one per data-parallel replica of the whole pipeline.

    torch's schedules run stage i on rank i mod P of a pipeline's process group,
    whose ranks are in increasing order, so each replica's pipeline devices must
    increase with the stage index (both of planner.evaluate.place's layouts do).
    """
    if plan.schedule == "pipedream" or any(len(s.devices) != s.replicas for s in plan.stages):
        raise UserError(
            "this plan replicates stages individually (PipeDream); the runtime runs only whole-pipeline replicas",
            "plan with --schedule 1f1b or gpipe",
        )
    reps = {s.replicas for s in plan.stages}
    d = getattr(plan, "data_parallel", 1) or 1
    if reps != {d}:
        raise UserError(f"stages have {sorted(reps)} replicas but the plan's data_parallel is {d}",
                        "re-plan: every stage must have data_parallel replicas")
    ranks = {s.index: list(s.devices) for s in plan.stages}
    n = len(plan.stages)
    p = len({ranks[s][0] for s in ranks})
    for r in range(d):
        pipe = [ranks[s][r] for s in range(min(p, n))]
        for s in range(n):
            if ranks[s][r] != pipe[s % p] or (s < p and s and pipe[s] <= pipe[s - 1]):
                raise UserError(
                    f"stage {s} is placed on device {ranks[s][r]}, but torch.distributed.pipelining runs stage {s} "
                    f"on pipeline rank {s % p} (stages go round-robin over increasing device ranks)",
                    "re-plan with the default placement",
                )
    return ranks


def rank_stages(ranks: dict[int, list[int]], rank: int) -> tuple[int, list[int]]:
    """(replica index, stages) of a rank."""
    for s in sorted(ranks):
        if rank in ranks[s]:
            r = ranks[s].index(rank)
            return r, sorted(t for t in ranks if ranks[t][r] == rank)
    return -1, []


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise UserError(f"unknown optimizer {name!r}", "use sgd, momentum, adam or adamw")


DEFAULT_LR = {"sgd": 0.01, "momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


def build_schedule(plan, stages: list, loss_fn, *, scale_grads: bool = True):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    m = plan.microbatches
    if plan.schedule == "pipedream":
        raise UserError(
            "asynchronous PipeDream (weight stashing, no flush) is not supported by the runtime yet",
            "plan with --schedule 1f1b (PipeDream-Flush), which runs with the same partition",
        )
    if plan.schedule == "interleaved":
        try:
            return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=scale_grads)
        except ValueError as e:
            raise UserError(f"interleaved schedule: {e}", "pick a microbatch count the schedule accepts") from None
    if len(stages) != 1:
        raise UserError(f"schedule {plan.schedule} runs one stage per device, but the plan puts {len(stages)} on one device",
                        "use the interleaved schedule or re-plan")
    cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], m, loss_fn=loss_fn, scale_grads=scale_grads)


# ---------------------------------------------------------------- data
def batches(spec, batch_size: int):
    """(inputs, target) for each step: train_batches() when the model file has it, else one fixed batch."""
    custom = spec.train_batches()
    if custom is not None:
        for item in custom:
            if isinstance(item, dict):
                yield tuple(item["inputs"]), item.get("target")
            else:
                inputs, target = item
                yield (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target
        return
    inputs, target = spec.example_inputs(batch_size), spec.example_target(batch_size)
    while True:
        yield inputs, target


# ---------------------------------------------------------------- the run
def run_all(opts: Options) -> None:
    if len(opts.plan) == 1:
        run(opts, opts.plan[0], Path(opts.run_dir), opts.dump_params and Path(opts.dump_params))
        return
    for i, plan in enumerate(opts.plan):
        out = Path(opts.run_dir) / str(i)
        out.mkdir(exist_ok=True)
        dump = None
        if opts.dump_params:
            dump = Path(opts.dump_params) / str(i)
            dump.mkdir(parents=True, exist_ok=True)
        run(opts, plan, out, dump)


def run(opts: Options, plan_path: str, out_dir: Path, dump_dir: Path | None) -> None:
    from torch.distributed.pipelining import PipelineStage

    from pipeplan.costmodels.model_file import load_model_file
    from pipeplan.costmodels.trace import export_structure
    from pipeplan.planner.plan import load_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    plan = load_plan(plan_path)
    ranks = stage_ranks(plan)
    used = len({r for rs in ranks.values() for r in rs})
    dp = len(ranks[0])
    if used > world:
        raise UserError(f"the plan uses {used} devices but only {world} processes were launched",
                        f"launch {used} processes (e.g. more --nnodes or a larger --nproc-per-node)")
    if used < world:
        raise UserError(f"{world} processes were launched but the plan uses {used} devices", f"launch exactly {used}")
    if plan.graph.get("model_file") is None:
        raise UserError("this plan was made from an imported graph (no model file), so there is nothing to run",
                        "plan from `pipeplan trace model.py` to run it")

    spec = load_model_file(plan.graph["model_file"], plan.graph.get("entry") or "build_model")
    torch.manual_seed(SEED)
    model = spec.build()
    ep, graph = export_structure(spec, plan.microbatch_size, depth=plan.graph.get("depth"), model=model)
    if graph.fingerprint() != plan.graph["fingerprint"]:
        raise UserError(
            f"the model in {plan.graph['model_file']} no longer matches the plan (graph fingerprint "
            f"{graph.fingerprint()} != {plan.graph['fingerprint']})",
            "re-trace and re-plan after changing the model",
        )
    gm = ep.module()
    layer_nodes = {layer.name: layer.nodes for layer in graph.layers}
    layer_stage = {name: s.index for s in plan.stages for name in s.layers}
    missing = [n for n in layer_nodes if n not in layer_stage]
    if missing:
        raise UserError(f"the plan assigns no stage to layer {missing[0]!r}", "re-plan")
    split = split_program(gm, layer_nodes, layer_stage, len(plan.stages))
    replica, mine = rank_stages(ranks, rank)
    # process groups, created in the same order on every rank (a collective requirement)
    pp_groups = [dist.new_group(sorted({ranks[s][r] for s in ranks})) for r in range(dp)] if dp > 1 else [None]
    dp_groups = {s: dist.new_group(ranks[s]) for s in sorted(ranks) if s < len({ranks[t][0] for t in ranks})} if dp > 1 else {}

    modules = {s: split.module(s).to(device) for s in mine}
    opt_name = opts.optimizer or plan.optimizer or "adam"
    lr = opts.lr if opts.lr is not None else DEFAULT_LR.get(opt_name, 1e-3)
    optimizers = {s: make_optimizer(opt_name, [p for p in modules[s].parameters() if p.requires_grad], lr) for s in mine}
    # tied parameters: one process group per set of holder ranks, created in the same order on every rank
    shared = split.shared_attrs()
    groups: dict[tuple[int, ...], Any] = {}
    for r in range(dp):
        for fqn in sorted(shared):
            holder_ranks = tuple(sorted({ranks[s][r] for s in shared[fqn]}))
            if len(holder_ranks) > 1 and holder_ranks not in groups:
                groups[holder_ranks] = dist.new_group(list(holder_ranks))
    my_ranks = {s: ranks[s][replica] for s in ranks}  # this replica's pipeline

    first_step = 0
    if opts.resume and opts.checkpoint_dir:
        manifest = ckpt.latest(opts.checkpoint_dir, stages=len(plan.stages), fingerprint=plan.graph["fingerprint"])
        if manifest is not None:
            for s in mine:
                ckpt.load_shard(manifest, s, modules[s], optimizers[s])
            first_step = int(manifest["step"])

    meter = SavedTensorMeter(weight_storages(modules.values())) if device.type == "cpu" else None
    clock = StepClock()
    stats = {s: StageStats(index=s) for s in mine}
    pipe_stages = []
    for s in mine:
        st = PipelineStage(modules[s], s, len(plan.stages), device, group=pp_groups[replica])
        keep_buffers_through_shape_inference(st)
        instrument(st, stats[s], clock, meter)
        pipe_stages.append(st)

    # Without loss_fn the model file's loss is the sum of the outputs: a sum over the batch, so the
    # microbatch gradients must be summed, not averaged, to equal the whole-batch step.
    mean_loss = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))

    def loss_fn(output, target):
        return spec.loss(unflatten_output(output, gm), target if mean_loss else None)

    schedule = build_schedule(plan, pipe_stages, loss_fn, scale_grads=mean_loss)
    has_first = 0 in mine
    has_last = (len(plan.stages) - 1) in mine

    kill_rank = os.environ.get("PIPEPLAN_TEST_KILL_RANK")
    kill_step = int(os.environ.get("PIPEPLAN_TEST_KILL_STEP", "-1"))
    data = batches(spec, plan.batch_size)
    rows = plan.batch_size // dp  # this replica's share of every global batch
    for _ in range(first_step):  # resume: skip the batches already trained on
        next(data)
    losses: list[float] = []
    step_s: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(first_step, opts.steps):
        if kill_rank is not None and int(kill_rank) == rank and step == kill_step:
            os._exit(9)  # test hook: die like a crashed process (no cleanup, no message)
        inputs, target = next(data)
        if dp > 1:
            inputs = tuple(t.tensor_split(dp)[replica] if isinstance(t, torch.Tensor) else t for t in inputs)
            target = target.tensor_split(dp)[replica] if isinstance(target, torch.Tensor) else target
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        measured = step - first_step >= opts.warmup
        if meter is not None:  # saved-tensor hooks slow the forward: meter untimed steps (and the first) only
            meter.enabled = not measured or step == first_step
        dist.barrier()
        clock.start(measured)
        args = tuple(t.to(device) for t in flat_inputs(inputs, gm)) if has_first else ()
        kwargs: dict[str, Any] = {}
        mb_losses: list[torch.Tensor] = []
        if has_last:
            if not mean_loss or target is None:  # the schedule splits a target per microbatch even when unused
                target = torch.zeros(rows)
            kwargs["target"] = target.to(device) if isinstance(target, torch.Tensor) else target
            kwargs["losses"] = mb_losses
        # return_outputs=False: the losses come through `losses`; merging the last stage's outputs
        # would only concatenate (and keep alive) every microbatch's logits
        schedule.step(*args, return_outputs=False, **kwargs)
        sum_shared_grads(shared, modules, my_ranks, groups)
        if dp > 1:
            average_replica_grads(modules, dp_groups, dp, mean_loss)
        for opt in optimizers.values():
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - clock.origin
        if measured:
            step_s.append(elapsed)
        if has_last:
            per_mb = torch.stack([l.detach().float() for l in mb_losses])
            losses.append(float(per_mb.mean() if mean_loss else per_mb.sum()))
        if opts.checkpoint_dir and opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            for s in mine if replica == 0 else ():  # replicas are identical: replica 0 writes
                ckpt.save_shard(opts.checkpoint_dir, step + 1, s, modules[s], optimizers[s])
            all_losses = gather_losses(losses, has_last, mean_loss)
            dist.barrier()
            if rank == 0:
                ckpt.save_manifest(opts.checkpoint_dir, step + 1, stages=len(plan.stages),
                                   fingerprint=plan.graph["fingerprint"], losses=all_losses)
            dist.barrier()
        clock.recording = False

    # ---- results, gathered on rank 0
    record = {
        "rank": rank,
        "replica": replica,
        "loss_reduction": "mean" if mean_loss else "sum",
        "step_s": step_s,
        "losses": losses if has_last else None,
        "stages": [stage_record(s, stats[s], modules[s], optimizers[s], meter, device, len(mine)) for s in mine],
        "events": {s: stats[s].events[-2 * plan.microbatches:] for s in mine},
    }
    if dump_dir:
        for s in mine:
            buf = io.BytesIO()
            torch.save({k: v.detach().cpu() for k, v in modules[s].state_dict().items()}, buf)
            name = f"stage-{s}.pt" if replica == 0 else f"stage-{s}-replica{replica}.pt"
            atomic_write_bytes(Path(dump_dir) / name, buf.getvalue())
    records: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(record, records, dst=0)
    if rank == 0:
        atomic_write_json(Path(out_dir) / "result.json", {"first_step": first_step, "ranks": records})


def keep_buffers_through_shape_inference(stage) -> None:
    """Undo buffer updates (BatchNorm statistics) made by the stage's shape-inference pass.

    torch.distributed.pipelining runs each stage once on the first microbatch (forward,
    then backward) to learn its shapes; for BatchNorm that is one more statistics
    update than the training steps make, so the run would drift from single-process
    training. The buffers are restored after the inference backward (restoring them
    earlier would bump their version under autograd's feet).
    """
    fwd_infer = getattr(stage, "_forward_metadata_inference", None)
    bwd_infer = getattr(stage, "_backward_metadata_inference", None)
    if fwd_infer is None or bwd_infer is None:
        return
    saved: dict[str, torch.Tensor] = {}

    def restore():
        with torch.no_grad():
            for k, v in stage.submod.named_buffers():
                if k in saved:
                    v.copy_(saved[k])
        saved.clear()

    def forward_inference(*args, **kwargs):
        saved.update({k: v.detach().clone() for k, v in stage.submod.named_buffers()})
        out = fwd_infer(*args, **kwargs)
        if not kwargs.get("has_backward", args[2] if len(args) > 2 else False):
            restore()
        return out

    def backward_inference(*args, **kwargs):
        try:
            return bwd_infer(*args, **kwargs)
        finally:
            restore()

    stage._forward_metadata_inference = forward_inference
    stage._backward_metadata_inference = backward_inference


def gather_losses(losses: list[float], has_last: bool, mean: bool = True) -> list[float]:
    """Every rank learns the global losses (combined over replicas) so rank 0 can put them in the manifest."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, losses if has_last else None)
    return combine_losses([x for x in out if x is not None], mean)


def combine_losses(per_replica: list[list[float]], mean: bool) -> list[float]:
    """Global loss per step from each replica's: the mean for batch-mean losses, else the sum."""
    if not per_replica:
        return []
    steps = zip(*per_replica)
    return [sum(xs) / len(xs) if mean else sum(xs) for xs in steps]


def average_replica_grads(modules: dict, dp_groups: dict, dp: int, mean: bool) -> None:
    """Data parallelism: each stage's replicas all-reduce their gradients (one flat buffer per stage).

    Each replica saw 1/dp of the batch; a batch-mean loss wants the mean of their
    gradients, a summed loss the sum.
    """
    for s, module in modules.items():
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_groups[s % len(dp_groups)])
        if mean:
            flat /= dp
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


def sum_shared_grads(shared: dict[str, list[int]], modules: dict, ranks: dict[int, int], groups: dict) -> None:
    """Tied parameters: every holder ends up with the sum of all holders' gradients.

    This is the gradient the un-split model computes for the one shared tensor,
    so the holders' copies, updated by identical optimizers, stay identical.
    """
    for fqn in sorted(shared):
        holders = shared[fqn]
        local = [modules[s].get_parameter(fqn) for s in holders if s in modules]
        holder_ranks = tuple(sorted({ranks[s] for s in holders}))
        if not local and dist.get_rank() not in holder_ranks:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in local]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if len(holder_ranks) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=groups[holder_ranks])
        for p in local:
            p.grad = total.clone()


def stage_record(s: int, st: StageStats, module, optimizer, meter, device, stages_on_rank: int) -> dict[str, Any]:
    params = [p for p in module.parameters()]
    weights = tensor_bytes(params) + tensor_bytes(module.buffers())
    grads = tensor_bytes(p for p in params if p.requires_grad)  # gradients are kept between steps (same size)
    opt = optimizer_state_bytes(optimizer)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        activation = max(0, peak - weights - grads - opt)
    else:
        activation = meter.peak if meter is not None else 0
        peak = weights + grads + opt + activation
    return {
        "index": s,
        "fwd_s": median(st.fwd_s),
        "bwd_s": median(st.bwd_s),
        "fwd_total_s": sum(st.fwd_s),
        "bwd_total_s": sum(st.bwd_s),
        "microbatches_timed": len(st.fwd_s),
        "weights_bytes": weights,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "activation_bytes": activation,
        "peak_memory_bytes": peak,
    }


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", 0))
    run_dir = Path(opts.run_dir)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # NCCL needs each rank on its own GPU
    else:
        become_local_device(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
        run_all(opts)
    except UserError as e:
        atomic_write_json(run_dir / f"error-rank{rank}.json", {"rank": rank, "message": str(e)})
        (run_dir / f"status-rank{rank}").write_text("error\n")
        os._exit(2)  # no teardown: the other ranks may be blocked on us; torchrun stops them
    (run_dir / f"status-rank{rank}").write_text("done\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
