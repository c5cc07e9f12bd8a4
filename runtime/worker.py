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
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan._io import atomic_write_bytes, atomic_write_json
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.local_device import become_local_device
from pipeplan.lean_gpipe import single_stage_schedule
from pipeplan.optimizers import DEFAULT_LR, make_optimizer
from pipeplan.precision import scales_loss, training_precision
from pipeplan.runtime import checkpoint as ckpt
from pipeplan.runtime.batch_split import batch_leaves, chunk_spec, cut
from pipeplan.runtime.complete_split import complete_split_backward
from pipeplan.runtime.loss_scale import DEFAULT_INITIAL_SCALE, LossScaler, overflow_anywhere, unscale_grads
from pipeplan.runtime.measure import (
    SavedTensorMeter,
    StageStats,
    StepClock,
    instrument,
    median,
    optimizer_state_bytes,
    state_keys,
    tensor_bytes,
    timed_loss,
    weight_storages,
)
from pipeplan.runtime.placement import combine_losses, rank_stages, stage_ranks, torch_schedule_class
from pipeplan.runtime.recompute import recompute, recompute_blocks
from pipeplan.runtime.sharding import ShardedParams, wrap_stage
from pipeplan.runtime.split import Split, flat_inputs, split_program, unflatten_output
from pipeplan.schedules import facts

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
    resume_step: int | None = None
    """The checkpoint the launcher checked and announced (launch.check_resume); None: the newest intact one."""
    vertical_sync: bool = False
    """Asynchronous PipeDream: every stage uses the input stage's weight version (runtime/pipedream.py)."""
    initial_loss_scale: float = DEFAULT_INITIAL_SCALE
    """fp16 plans: the loss scale of the first step (runtime/loss_scale.py)."""


def parse(argv: list[str]) -> Options:
    """The worker's command line, as launch.torchrun_command writes it."""
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
    p.add_argument("--resume-step", type=int, default=None)
    p.add_argument("--vertical-sync", action="store_true")
    p.add_argument("--initial-loss-scale", type=float, default=DEFAULT_INITIAL_SCALE)
    a = p.parse_args(argv)
    return Options(a.plan, a.steps, a.warmup, a.lr, a.optimizer, a.run_dir, a.checkpoint_dir, a.checkpoint_every,
                   a.resume, a.dump_params, a.resume_step, a.vertical_sync, a.initial_loss_scale)




def build_schedule(plan, stages: list, loss_fn, *, scale_grads: bool = True, args_chunk_spec: Any = None):
    """The torch schedule object for the plan's schedule, with user errors for what it cannot run.

    An interleaving schedule takes all of a device's stages (model chunks); the others exactly one.
    `args_chunk_spec`: how the first stage's inputs are cut into microbatches (runtime/batch_split.py).
    """
    from torch.distributed import pipelining

    cls = getattr(pipelining, torch_schedule_class(plan.schedule))
    m = plan.microbatches
    common = {"scale_grads": scale_grads, "args_chunk_spec": args_chunk_spec}  # what every schedule class takes
    if facts(plan.schedule).splits_backward and len(stages) == 1:
        # zero bubble (ZB-H1): torch's ScheduleInterleavedZeroBubble is a multi-stage class; with one stage
        # per rank its order is ZB-H1 (Qi et al. 2024 §3.1: warm-up K - r - 1, W deferred by r microbatches)
        try:
            return cls(stages, m, loss_fn=loss_fn, **common)
        except ValueError as e:
            raise UserError(f"zero-bubble schedule: {e}", "pick a microbatch count the schedule accepts") from None
    if facts(plan.schedule).interleaves:
        try:
            return cls(stages, m, loss_fn=loss_fn, **common)
        except ValueError as e:
            raise UserError(f"interleaved schedule: {e}", "pick a microbatch count the schedule accepts") from None
    if len(stages) != 1:
        raise UserError(f"schedule {plan.schedule} runs one stage per device, but the plan puts {len(stages)} on one device",
                        "use the interleaved schedule or re-plan")
    # GPipe and 1F1B: pipeplan's loops, each receive buffer living as long as its microbatch (pipeplan/lean_gpipe.py)
    return single_stage_schedule(cls, stages[0], m, loss_fn=loss_fn, **common)


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
StepHook = Callable[[int, int], None]
"""Called as hook(rank, steps done) after every training step."""


def no_step_hook(rank: int, steps_done: int) -> None:
    """Production's step hook: nothing.

    The seam lets a test act between steps (tests/runtime_fault_worker.py kills a rank)
    without the training loop branching on test settings.
    """


def run_all(opts: Options, after_step: StepHook = no_step_hook) -> None:
    """Every plan on the command line, one after the other in the same processes (the tests save start-up time)."""
    if len(opts.plan) == 1:
        run(opts, opts.plan[0], Path(opts.run_dir), opts.dump_params and Path(opts.dump_params), after_step)
        return
    for i, plan in enumerate(opts.plan):
        out = Path(opts.run_dir) / str(i)
        out.mkdir(exist_ok=True)
        dump = None
        if opts.dump_params:
            dump = Path(opts.dump_params) / str(i)
            dump.mkdir(parents=True, exist_ok=True)
        run(opts, plan, out, dump, after_step)


@dataclass
class RunState:
    """What setup builds for one plan on this rank; the step loop and teardown work from it.

    stats, meter and clock are filled in by the instrumented stages while the steps run.
    """

    plan: Any
    spec: Any  # the model file (costmodels.model_file)
    gm: Any  # the exported program's module: flattens inputs and unflattens outputs
    device: torch.device
    rank: int
    world: int
    replica: int  # which data-parallel copy of the pipeline this rank belongs to
    dp: int
    mine: list[int]  # this rank's stages
    modules: dict[int, torch.nn.Module]
    optimizers: dict[int, torch.optim.Optimizer]  # the stage's unsharded parameters (all of them without ZeRO)
    sharded: dict[int, ShardedParams]  # ZeRO: the stage's other parameters, sharded over its replicas
    shared: dict[str, list[int]]  # tied parameter -> the stages holding a copy
    my_ranks: dict[int, int]  # stage -> rank in this replica's pipeline
    tied_groups: dict[tuple[int, ...], Any]
    dp_groups: dict[int, Any]
    stats: dict[int, StageStats]
    meter: SavedTensorMeter | None
    clock: StepClock
    schedule: Any
    mean_loss: bool
    first_step: int
    scaler: LossScaler | None = None  # an fp16 plan's dynamic loss scale (runtime/loss_scale.py)
    batch: tuple[bool, ...] | None = None  # per input leaf, whether it carries the batch (runtime/batch_split.py)

    @property
    def divides_grads(self) -> bool:
        """Whether gradients are divided after the backward (by M, by the replicas): a batch-mean loss, unless
        fp16's loss scaling weighted every loss before it (build_pipeline, `loss_weight`)."""
        return self.mean_loss and self.scaler is None

    @property
    def has_first(self) -> bool:
        """This rank feeds the pipeline its inputs."""
        return 0 in self.mine

    @property
    def has_last(self) -> bool:
        """This rank computes the loss."""
        return (len(self.plan.stages) - 1) in self.mine


@dataclass
class StepLog:
    """What the steps produce for the results: the last stage's losses and the measured step times."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def run(opts: Options, plan_path: str, out_dir: Path, dump_dir: Path | None,
        after_step: StepHook = no_step_hook) -> None:
    """One plan on this rank: setup, the training steps, then the results gathered on rank 0.

    Three parts so that each reads on its own; RunState carries what setup built. A schedule without
    a flush (asynchronous PipeDream) runs runtime/pipedream.py's own loop instead of a torch schedule.
    """
    from pipeplan.planner.plan import load_plan

    if not facts(load_plan(plan_path).schedule).flushes:
        from pipeplan.runtime.pipedream import run_async

        run_async(opts, plan_path, out_dir, dump_dir, after_step)
        return
    st = setup(opts, plan_path)
    log = train(opts, st, after_step)
    teardown(st, log, out_dir, dump_dir)


def setup(opts: Options, plan_path: str) -> RunState:
    """Check the launch, build this rank's stages, optimizers and process groups, and resume.

    Every check that can fail with a UserError runs here, before the first step, and
    the process groups are created in the same order on every rank (a collective requirement).
    """
    from pipeplan.planner.plan import load_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    plan = load_plan(plan_path)
    ranks = stage_ranks(plan)
    dp = len(ranks[0])
    check_launch(plan, ranks, world)
    spec, gm, split = load_split_model(plan)
    replica, mine = rank_stages(ranks, rank)
    pp_groups, dp_groups = data_parallel_groups(ranks, dp)
    shared = split.shared_attrs()
    # zero bubble detaches stage outputs in place after the input-gradient pass (runtime/split.py); a tied
    # parameter held by two of this rank's stages (a V schedule's first and last) gets a copy per stage, as
    # on two ranks, or its one tensor would gather both gradients and be stepped twice
    own = facts(plan.schedule).splits_backward
    copy = any(len([s for s in holders if s in mine]) > 1 for holders in shared.values())
    modules = {s: on_device(split.module(s, own_outputs=own, copy=copy), device) for s in mine}
    if plan.recompute and plan.recompute_granularity == "block":
        modules = {s: recompute_blocks(m, split.block_modules(s, m)) for s, m in modules.items()}
    elif plan.recompute:
        modules = {s: recompute(m) for s, m in modules.items()}
    sharded = shard_stages(opts, plan, modules, shared, dp_groups, dp)
    optimizers = make_optimizers(opts, plan, modules, sharded)
    tied = tied_groups(ranks, dp, shared)
    my_ranks = {s: ranks[s][replica] for s in ranks}  # this replica's pipeline
    first_step, scaled = resume_step(opts, plan, modules, optimizers)
    scaler = None
    if scales_loss(plan.dtype, plan.schedule):
        scaler = LossScaler.from_state(scaled) if scaled else LossScaler(scale=opts.initial_loss_scale)
    meter = SavedTensorMeter(weight_storages(modules.values()), state_keys(modules.values())) \
        if device.type == "cpu" else None
    clock = StepClock()
    stats = {s: StageStats(index=s) for s in mine}
    batch = batch_leaves(spec)
    schedule, mean_loss = build_pipeline(plan, spec, gm, modules, pp_groups[replica], device, stats, clock, meter,
                                         sharded, scaler, chunk_spec(batch, gm))
    return RunState(plan=plan, spec=spec, gm=gm, device=device, rank=rank, world=world, replica=replica, dp=dp,
                    mine=mine, modules=modules, optimizers=optimizers, sharded=sharded, shared=shared,
                    my_ranks=my_ranks,
                    tied_groups=tied, dp_groups=dp_groups, stats=stats, meter=meter, clock=clock,
                    schedule=schedule, mean_loss=mean_loss, first_step=first_step, scaler=scaler, batch=batch)


def check_launch(plan, ranks: dict[int, list[int]], world: int) -> None:
    """One process per device of the plan, and a model file to run: else nothing could train."""
    used = len({r for rs in ranks.values() for r in rs})
    if used > world:
        raise UserError(f"the plan uses {used} devices but only {world} processes were launched",
                        f"launch {used} processes (e.g. more --nnodes or a larger --nproc-per-node)")
    if used < world:
        raise UserError(f"{world} processes were launched but the plan uses {used} devices", f"launch exactly {used}")
    if plan.graph.get("model_file") is None:
        raise UserError("this plan was made from an imported graph (no model file), so there is nothing to run",
                        "plan from `pipeplan trace model.py` to run it")


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module` moved to `device`, with the ops that create tensors creating them there too.

    The program is exported on the CPU, so an op that makes a tensor (torch.arange(..., device=x.device)
    in examples/gpt.py) is recorded with device=cpu; on a GPU rank it must make it on the GPU.
    """
    module = module.to(device)
    if device.type == "cpu":
        return module
    for sub in module.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        nodes = [n for n in sub.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)
                 and n.kwargs["device"].type == "cpu"]
        for n in nodes:
            n.kwargs = {**n.kwargs, "device": device}
        if nodes:
            sub.recompile()
    return module


def load_split_model(plan) -> tuple[Any, Any, Split]:
    """(model file, exported module, split program): the model rebuilt with the shared seed, cut into the plan's stages.

    The graph fingerprint must match the plan's, else the plan's layer names and cuts
    describe another model.
    """
    from pipeplan.costmodels.model_file import load_model_file
    from pipeplan.costmodels.trace import export_structure
    from pipeplan.planner.plan import planned_from
    from pipeplan.planner.problem import checkpoint_units

    spec = load_model_file(plan.graph["model_file"], plan.graph.get("entry") or "build_model",
                           seq_len=plan.graph.get("seq_len"))
    torch.manual_seed(SEED)
    model = spec.build()
    ep, graph = export_structure(spec, plan.microbatch_size, depth=plan.graph.get("depth"), model=model)
    if not planned_from(graph, plan.graph) and not _same_layers_at_another_batch(plan, graph):
        raise UserError(
            f"the model in {plan.graph['model_file']} no longer matches the plan (graph fingerprint "
            f"{graph.fingerprint()} != {plan.graph['fingerprint']})",
            "re-trace and re-plan after changing the model",
        )
    gm = ep.module()
    layer_nodes = {layer.name: layer.nodes for layer in graph.layers}
    layer_stage = {name: s.index for s in plan.stages for name in s.layers}
    unknown = [n for n in layer_stage if n not in layer_nodes]
    if unknown:
        raise UserError(f"stage {layer_stage[unknown[0]]} of the plan names layer {unknown[0][:60]!r}, which the model "
                        f"in {plan.graph['model_file']} does not have", "re-plan from the model file")
    missing = [n for n in layer_nodes if n not in layer_stage]
    if missing:
        raise UserError(f"the plan assigns no stage to layer {missing[0]!r}", "re-plan")
    split = split_program(gm, layer_nodes, layer_stage, len(plan.stages))
    # each layer's block where the plan recomputes per block: the planner's own call on the same layers
    blocks = checkpoint_units([layer.name for layer in graph.layers], [layer.param_bytes for layer in graph.layers])
    split.layer_block = {layer.name: b for layer, b in zip(graph.layers, blocks, strict=True)}
    return spec, gm, split


def data_parallel_groups(ranks: dict[int, list[int]], dp: int) -> tuple[list[Any], dict[int, Any]]:
    """(each replica's pipeline group, each stage's replica group); ([None], {}) without replicas.

    Stages on the same pipeline device share its replica group (one per device, whatever the placement).
    new_group is a collective: every rank creates the same groups in the same order.
    """
    if dp == 1:
        return [None], {}
    pp_groups = [dist.new_group(sorted({ranks[s][r] for s in ranks})) for r in range(dp)]
    by_ranks: dict[tuple[int, ...], Any] = {}
    for s in sorted(ranks):
        if tuple(ranks[s]) not in by_ranks:
            by_ranks[tuple(ranks[s])] = dist.new_group(ranks[s])
    return pp_groups, {s: by_ranks[tuple(ranks[s])] for s in ranks}


def tied_groups(ranks: dict[int, list[int]], dp: int, shared: dict[str, list[int]]) -> dict[tuple[int, ...], Any]:
    """Tied parameters: one process group per set of holder ranks (several ranks sum their gradients).

    Created in the same order on every rank, as new_group requires.
    """
    groups: dict[tuple[int, ...], Any] = {}
    for r in range(dp):
        for fqn in sorted(shared):
            holder_ranks = tuple(sorted({ranks[s][r] for s in shared[fqn]}))
            if len(holder_ranks) > 1 and holder_ranks not in groups:
                groups[holder_ranks] = dist.new_group(list(holder_ranks))
    return groups


def optimizer_factory(opts: Options, plan) -> Callable[[list], torch.optim.Optimizer]:
    """--optimizer, else the plan's (what its memory prediction assumed), else adam; at --lr or its default; stepping
    as the plan says its framework does (`plan.optimizer_kernels`, what its prediction priced)."""
    opt_name = opts.optimizer or plan.optimizer or "adam"
    lr = opts.lr if opts.lr is not None else DEFAULT_LR.get(opt_name, 1e-3)
    return lambda params: make_optimizer(opt_name, params, lr, plan.optimizer_kernels)


def unsharded_params(s: int, module: torch.nn.Module, sharded: dict[int, ShardedParams]) -> list:
    """The stage's trainable parameters that its ZeRO shards (if any) do not hold."""
    held = {id(p) for p in sharded[s].params} if s in sharded else set()
    return [p for p in module.parameters() if p.requires_grad and id(p) not in held]


def make_optimizers(opts: Options, plan, modules: dict[int, torch.nn.Module],
                    sharded: dict[int, ShardedParams]) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage over its unsharded parameters (none when ZeRO holds them all)."""
    factory = optimizer_factory(opts, plan)
    params = {s: unsharded_params(s, m, sharded) for s, m in modules.items()}
    return {s: factory(ps) for s, ps in params.items() if ps}


def shard_stages(opts: Options, plan, modules: dict[int, torch.nn.Module], shared: dict[str, list[int]],
                 dp_groups: dict[int, Any], dp: int) -> dict[int, ShardedParams]:
    """ZeRO (runtime/sharding.py) over each stage's replicas, for the plan's level; tied parameters stay whole."""
    level = plan.sharding
    if level == "none" or dp < 2:
        return {}
    factory = optimizer_factory(opts, plan)
    out = {}
    for s, m in modules.items():
        tied = {id(m.get_parameter(fqn)) for fqn, holders in shared.items() if s in holders}
        params = [p for p in m.parameters() if p.requires_grad and id(p) not in tied]
        if params:
            out[s] = ShardedParams(params, level=level, group=dp_groups[s], make_optimizer=factory)
    return out


def resume_step(opts: Options, plan, modules: dict[int, torch.nn.Module],
                optimizers: dict[int, torch.optim.Optimizer]) -> tuple[int, dict[str, Any] | None]:
    """(the step to start from, the loss scaler's state there): with --resume, the last complete checkpoint's (its
    shards loaded), else (0, None)."""
    if not (opts.resume and opts.checkpoint_dir):
        return 0, None
    if opts.resume_step is not None:  # the one the launcher announced, so every rank loads the same step
        manifest: dict[str, Any] | None = ckpt.read_manifest(ckpt.step_dir(opts.checkpoint_dir, opts.resume_step)
                                                             / "manifest.json")
    else:
        manifest, _ = ckpt.latest(opts.checkpoint_dir, stages=len(plan.stages), fingerprint=plan.graph["fingerprint"])
    if manifest is None:  # the launcher checked; the folder changed since
        raise UserError(f"--resume: no intact checkpoint in {opts.checkpoint_dir}", "run without --resume")
    scaled = [ckpt.load_shard(manifest, s, modules[s], optimizers.get(s)) for s in modules]
    return int(manifest["step"]), next((state for state in scaled if state), None)


def build_pipeline(plan, spec, gm, modules: dict[int, torch.nn.Module], group, device: torch.device,
                   stats: dict[int, StageStats], clock: StepClock, meter: SavedTensorMeter | None,
                   sharded: dict[int, ShardedParams], scaler: LossScaler | None = None,
                   args_chunk_spec: Any = None) -> tuple[Any, bool]:
    """(schedule, mean_loss): this rank's instrumented PipelineStages under the plan's torch schedule.

    mean_loss says whether the model file's loss is a batch mean (its loss_fn) or a sum
    (no loss_fn: the sum of the outputs); the microbatch gradients are averaged or summed
    to match, so the pipelined step equals the whole-batch step. With a scaler (fp16: runtime/loss_scale.py)
    every loss is multiplied by its scale of the moment times its weight in the step (`loss_weight`), before the
    backward, as Megatron-LM divides by the microbatch count there: fp16's backward then sees the magnitudes a
    single process under GradScaler sees, and no pass after it divides (the unscaling does).
    """
    from torch.distributed.pipelining import PipelineStage

    complete_split_backward()  # zero bubble's W misses weights that meet no input's graph (runtime/complete_split.py)
    pipe_stages = []
    for s in modules:
        stage = PipelineStage(modules[s], s, len(plan.stages), device, group=group)
        keep_buffers_through_shape_inference(stage)
        zeroed_inference_inputs(stage)
        if s in sharded:
            wrap_stage(stage, sharded[s])
        instrument(stage, stats[s], clock, meter)
        pipe_stages.append(stage)
    mean_loss = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))

    def loss_fn(output, target):
        loss = spec.loss(unflatten_output(output, gm), target if mean_loss else None)
        if scaler is not None:
            loss = loss * (scaler.scale * loss_weight(plan, mean_loss))
        # zero bubble's stage_backward_input detaches the loss in place (torch _backward.py), which a view refuses
        return loss.clone() if isinstance(loss, torch.Tensor) and loss._is_view() else loss

    last = len(plan.stages) - 1
    timed = timed_loss(loss_fn, stats[last], clock, device) if last in stats else loss_fn
    return build_schedule(plan, pipe_stages, timed, scale_grads=mean_loss and scaler is None,
                          args_chunk_spec=args_chunk_spec), mean_loss


def loss_weight(plan, mean_loss: bool) -> float:
    """A microbatch loss's weight in the step's: 1/(M x replicas) for a batch mean (each replica's M microbatches
    are an equal share of the batch), 1 for a sum."""
    return 1.0 / (plan.microbatches * plan.data_parallel) if mean_loss else 1.0


def train(opts: Options, st: RunState, after_step: StepHook) -> StepLog:
    """The steps from st.first_step to opts.steps, with checkpoints every opts.checkpoint_every.

    A resumed run skips the batches already trained on, so it sees the data an
    uninterrupted run would. after_step runs after every step (see no_step_hook).
    """
    data = batches(st.spec, st.plan.batch_size)
    for _ in range(st.first_step):  # resume: skip the batches already trained on
        next(data)
    log = StepLog()
    if st.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(st.device)
    for step in range(st.first_step, opts.steps):
        inputs, target = replica_share(*next(data), st.dp, st.replica, st.batch)
        train_step(st, inputs, target, measured=step - st.first_step >= opts.warmup,
                   first=step == st.first_step, log=log)
        if opts.checkpoint_dir and opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            save_checkpoint(opts.checkpoint_dir, st, step + 1, log.losses)
        st.clock.recording = False
        after_step(st.rank, step + 1)
    return log


def replica_share(inputs: tuple, target: Any, dp: int, replica: int,
                  batch: tuple[bool, ...] | None) -> tuple[tuple, Any]:
    """This replica's rows of a global batch: data parallelism splits every batch dp ways, along the inputs that
    carry it (`batch`: runtime/batch_split.py; the others, and a dict's, whole or cut as any)."""
    if dp > 1:
        inputs = cut(inputs, dp, batch)[replica]
        target = target.tensor_split(dp)[replica] if isinstance(target, torch.Tensor) else target
    return inputs, target


def train_step(st: RunState, inputs: tuple, target: Any, *, measured: bool, first: bool, log: StepLog) -> None:
    """One optimizer step: the schedule's forwards/backwards, gradient sums, update; time and loss into log.

    Every rank starts its clock after a barrier, so the slowest rank's step is the iteration time.
    """
    for module in st.modules.values():  # every stage, also one whose parameters ZeRO holds (no optimizer here)
        module.zero_grad(set_to_none=True)
    if st.meter is not None:  # saved-tensor hooks slow the forward: meter untimed steps (and the first) only
        st.meter.enabled = not measured or first
    dist.barrier()
    st.clock.start(measured)
    args = tuple(t.to(st.device) if isinstance(t, torch.Tensor) else t  # a Python number as forward() takes it
                 for t in flat_inputs(inputs, st.gm)) if st.has_first else ()
    kwargs: dict[str, Any] = {}
    mb_losses: list[torch.Tensor] = []
    if st.has_last:
        if not st.mean_loss or target is None:  # the schedule splits a target per microbatch even when unused
            target = torch.zeros(st.plan.batch_size // st.dp)  # this replica's share of the global batch
        kwargs["target"] = target.to(st.device) if isinstance(target, torch.Tensor) else target
        kwargs["losses"] = mb_losses
    # return_outputs=False: the losses come through `losses`; merging the last stage's outputs
    # would only concatenate (and keep alive) every microbatch's logits
    # in the plan's precision (pipeplan/precision.py: bf16 under autocast), forwards, loss and backwards alike
    with (st.meter.step(st.modules.values()) if st.meter is not None else contextlib.nullcontext(),
          training_precision(st.plan.dtype, st.device, st.plan.schedule)):
        st.schedule.step(*args, return_outputs=False, **kwargs)
    # what this step's losses were multiplied by: under fp16 they were already weighted, so the sync only sums
    factor = st.scaler.scale * loss_weight(st.plan, st.mean_loss) if st.scaler is not None else 1.0
    sum_shared_grads(st.shared, st.modules, st.my_ranks, st.tied_groups)
    if st.dp > 1:
        average_replica_grads(st.modules, st.dp_groups, st.dp, st.divides_grads, st.sharded)
    update(st)
    if st.device.type == "cuda":
        torch.cuda.synchronize(st.device)
    elapsed = time.perf_counter() - st.clock.origin
    if measured:
        log.step_s.append(elapsed)
    if st.has_last:
        per_mb = torch.stack([l.detach().float() for l in mb_losses]) / factor
        log.losses.append(float(per_mb.mean() if st.mean_loss else per_mb.sum()))


def update(st: RunState) -> None:
    """The optimizer steps of this rank's stages. Under fp16 the gradients are divided by the loss scale first,
    and every rank skips the step where any found an inf or a NaN (runtime/loss_scale.py)."""
    for sp in st.sharded.values():
        sp.reduce_pending()
    shard_scale = {s: sharded_grad_scale(sp.level, st.dp, st.plan.microbatches, st.divides_grads)
                   for s, sp in st.sharded.items()}
    if st.scaler is not None:
        grads = [p.grad for opt in st.optimizers.values() for g in opt.param_groups for p in g["params"]
                 if p.grad is not None] + [sp.grad_shard for sp in st.sharded.values()]
        overflow = overflow_anywhere(unscale_grads(grads, st.scaler.scale, st.device))
        st.scaler.update(overflow)
        if overflow:
            for sp in st.sharded.values():
                sp.skip()
            return
    for opt in st.optimizers.values():
        opt.step()
    for s, sp in st.sharded.items():
        sp.step(shard_scale[s])


def save_checkpoint(checkpoint_dir: str, st: RunState, steps_done: int, losses: list[float]) -> None:
    """Shards of replica 0 (replicas are identical), then rank 0's manifest once every shard is written.

    The manifest is what makes a checkpoint complete: a rank dying before it leaves the previous one latest.
    """
    for s in st.mine if st.replica == 0 else ():
        ckpt.save_shard(checkpoint_dir, steps_done, s, st.modules[s], st.optimizers.get(s),
                        st.scaler.state() if st.scaler is not None else None)
    all_losses = gather_losses(losses, st.has_last, st.mean_loss)
    dist.barrier()
    if st.rank == 0:
        ckpt.save_manifest(checkpoint_dir, steps_done, stages=len(st.plan.stages),
                           fingerprint=st.plan.graph["fingerprint"], losses=all_losses)
    dist.barrier()


def teardown(st: RunState, log: StepLog, out_dir: Path, dump_dir: Path | None) -> None:
    """Each rank's measurements gathered on rank 0 into out_dir/result.json (the launcher reads it).

    With dump_dir, each stage's final parameters too: the tests compare them with single-process training.
    """
    for sp in st.sharded.values():
        if sp.level == "zero3":
            sp.gather()  # the final parameters, whole, for the records and the dump
    record = {
        "rank": st.rank,
        "replica": st.replica,
        "loss_reduction": "mean" if st.mean_loss else "sum",
        "loss_scale": st.scaler.state() if st.scaler is not None else None,
        "step_s": log.step_s,
        "losses": log.losses if st.has_last else None,
        "stages": [stage_record(s, st.stats[s], st.modules[s], st.optimizers.get(s), st.meter, st.device,
                                len(st.mine), st.sharded.get(s)) for s in st.mine],
        "events": {s: st.stats[s].events[-(3 if facts(st.plan.schedule).splits_backward else 2) * st.plan.microbatches:]
                   for s in st.mine},
    }
    record["device_peak_bytes"] = device_peak_bytes(record["stages"], st.device)
    if dump_dir:
        dump_parameters(st, dump_dir)
    records: list[Any] | None = [None] * st.world if st.rank == 0 else None
    dist.gather_object(record, records, dst=0)
    if st.rank == 0:
        atomic_write_json(Path(out_dir) / "result.json", {"first_step": st.first_step, "ranks": records})


def _same_layers_at_another_batch(plan, graph) -> bool:
    """A plan traced at another batch size than the microbatch it runs may export differently in
    batch-dependent details only (Hugging Face's mask code skips an expand at batch 1): the stages are
    cut by layer names, so what matters is that the same layers come in the same order."""
    traced_at = plan.graph.get("trace_batch_size")
    if traced_at is None or traced_at == plan.microbatch_size:
        return False
    return [layer.name for layer in graph.layers] == [name for s in plan.stages for name in s.layers]


def device_peak_bytes(stages: list[dict[str, Any]], device: torch.device) -> int:
    """The whole device's peak, what the plan predicts per device (a device holds several stages under
    interleaving): CUDA measures it directly (every stage record carries it); on the CPU it is the state of
    every stage the rank holds plus the rank's activation peak (one meter per rank)."""
    if device.type == "cuda":
        return max(s["peak_memory_bytes"] for s in stages)
    state = sum(s["weights_bytes"] + s["grad_bytes"] + s["optimizer_bytes"] for s in stages)
    return state + max(s["activation_bytes"] for s in stages)


def dump_parameters(st: RunState, dump_dir: Path) -> None:
    """This rank's stages' state dicts, one file per stage (and replica), for the equivalence tests."""
    for s in st.mine:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in st.modules[s].state_dict().items()}, buf)
        name = f"stage-{s}.pt" if st.replica == 0 else f"stage-{s}-replica{st.replica}.pt"
        atomic_write_bytes(Path(dump_dir) / name, buf.getvalue())


def zeroed_inference_inputs(stage) -> None:
    """Received inputs of the stage's shape-inference pass start as zeros, not torch.empty's leftover bytes.

    torch.distributed.pipelining (2.13, stage.py `_to_tensor`) runs a later stage's real forward on inputs made
    from their metadata with `torch.empty`. An integer input consumed past the first stage (ids an embedding bag
    reads on stage 1) then holds whatever the memory held, and the forward fails ("Index 0 of input takes value
    68719476760 which is not in the valid range"); zeros index every table. The real steps receive real values.
    """
    to_tensor = getattr(stage, "_to_tensor", None)
    if to_tensor is None:
        return

    def zeroed(arg):
        out = to_tensor(arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata, not a real input of the first stage
            with torch.no_grad():
                out.zero_()
        return out

    stage._to_tensor = zeroed


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


def sharded_grad_scale(level: str, dp: int, microbatches: int, mean: bool) -> float:
    """What a ZeRO shard's summed gradient is multiplied by: 1/dp for a batch-mean loss (as
    `average_replica_grads`), and 1/M too where the reduce-scatter ran before the schedule's
    own 1/M scaling (ZeRO-2/3 reduce every backward; the schedule then finds no gradients)."""
    if not mean:
        return 1.0
    return 1.0 / (dp * (microbatches if level in ("zero2", "zero3") else 1))


def average_replica_grads(modules: dict, dp_groups: dict, dp: int, mean: bool,
                          sharded: dict[int, ShardedParams] | None = None) -> None:
    """Data parallelism: each stage's replicas all-reduce their gradients (one flat buffer per stage).

    Each replica saw 1/dp of the batch; a batch-mean loss wants the mean of their
    gradients, a summed loss the sum. Parameters a ZeRO shard holds are reduced there.
    Each gradient becomes a view of the reduced buffer rather than a copy of its slice: a copy
    is a third pass over every gradient into new memory, measured here at 3.3-4.1 ms of the sync's
    7-8 for 8.4M parameters (costmodels/grad_passes.py). The views live until the step's
    `zero_grad(set_to_none=True)` drops them with the buffer.
    """
    for s, module in modules.items():
        params = unsharded_params(s, module, sharded or {})
        if not params:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_groups[s])
        if mean:
            flat /= dp
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
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


def stage_record(s: int, st: StageStats, module, optimizer, meter, device, stages_on_rank: int,
                 sharded: ShardedParams | None = None) -> dict[str, Any]:
    """One stage's measured times and memory, in the terms of the plan's prediction (runtime/report.py compares)."""
    params = [p for p in module.parameters()]
    weights = tensor_bytes(params) + tensor_bytes(module.buffers())
    grads = tensor_bytes(p for p in params if p.requires_grad)  # gradients are kept between steps (same size)
    opt = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    if sharded is not None:  # what ZeRO keeps: the state of its shard, the shard of the gradients (ZeRO-2/3)...
        opt += sharded.state_bytes()
        shard_bytes = tensor_bytes([sharded.master])
        if sharded.level in ("zero2", "zero3"):
            grads += shard_bytes - tensor_bytes(sharded.params)
        if sharded.level == "zero3":  # ...and of the weights (ZeRO-3)
            weights += shard_bytes - tensor_bytes(sharded.params)
    saved = meter.peak if meter is not None else None  # the saved tensors' high-water mark alone (CPU)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        activation = max(0, peak - weights - grads - opt)
    else:
        # the step's whole peak beyond state where it was logged (torch's schedules), else the saved tensors'
        activation = max(meter.peak, meter.step_peak) if meter is not None else 0
        peak = weights + grads + opt + activation
    return {
        "index": s,
        "fwd_s": median(st.fwd_s),
        "bwd_s": median(st.bwd_s),
        "fwd_total_s": sum(st.fwd_s),
        "bwd_total_s": sum(st.bwd_s) + sum(st.wgrad_s),  # a zero-bubble backward is its B and its W
        "wgrad_s": median(st.wgrad_s) if st.wgrad_s else 0.0,
        "microbatches_timed": len(st.fwd_s),
        "weights_bytes": weights,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "activation_bytes": activation,
        "saved_activation_bytes": saved,
        "peak_memory_bytes": peak,
    }


def die_with_parent() -> None:
    """Ask Linux for SIGKILL when torchrun dies: torchrun stops its workers when it is signalled, but a torchrun
    killed outright (SIGKILL, the OOM killer) would leave them training to their last step."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # torchrun died before the line above
        os._exit(1)


def leave_without_finalizing() -> None:
    """End the rank's process now, skipping Python's finalization.

    Everything the rank owes is done by then: its status and results written, the process group destroyed. What
    finalization would add is a race: torch's C++ objects are destroyed while some of their threads still run,
    and now and then a rank died there with SIGABRT ("terminate called without an active exception") after
    `destroy_process_group()` had returned, which failed a finished run (here 1 run in 3-50 of a 2-rank gloo
    GPipe of examples/mlp.py; the defaults benchmark stopped on it twice). os._exit skips that teardown; the
    streams are flushed first, since it skips their flush too.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None, *, after_step: StepHook = no_step_hook) -> int:
    """torchrun's entry: one rank's run(s), UserErrors written for the launcher; after_step: see no_step_hook."""
    die_with_parent()
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
        run_all(opts, after_step)
    except UserError as e:
        atomic_write_json(run_dir / f"error-rank{rank}.json", {"rank": rank, "message": str(e)})
        (run_dir / f"status-rank{rank}").write_text("error\n")
        os._exit(2)  # no teardown: the other ranks may be blocked on us; torchrun stops them
    (run_dir / f"status-rank{rank}").write_text("done\n")
    dist.destroy_process_group()
    leave_without_finalizing()
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
