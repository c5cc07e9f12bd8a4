"""Asynchronous PipeDream (Narayanan et al., SOSP 2019, §3.2-3.4): 1F1B without flush, weight stashing,
stages replicated individually. torch.distributed.pipelining has no schedule without a flush, so this
file is the worker loop for such plans (PipeDream-2BW's too: runtime/pipedream_2bw.py swaps in its rule), over the stage modules runtime/split.py builds (skip tensors
and tied weights as in the synchronous runtime) and runtime/pipedream_comm.py's messages.

The update rule, exactly (tests/pipedream_reference.py applies the same in one process):

- Microbatches m = 0, 1, ..., N-1 with N = steps x plan.microbatches; step k's batch (worker.batches)
  is cut into plan.microbatches equal microbatches (tensor_split on dim 0), m = k*M + i. A microbatch
  is PipeDream's "minibatch": each one is a separate update.
- Stage s (0-based, of K) has r_s replicas (len of its `devices`). Microbatch m runs on replica
  j = m mod r_s of stage s, as that replica's local microbatch i = m // r_s (round-robin, §3.1).
- Startup: a replica of stage s admits a_s = ceil((r_s + ... + r_{K-1}) / r_s) local microbatches
  before its first backward (`admitted`). For the input stage this is the paper's NOAM = ceil(devices /
  devices of the input stage) (§3.2); without replication a_s = K - s, 1F1B's warm-up. Then it
  alternates one backward and one forward (`local_order`): F0..F(a-1), B0, Fa, B1, F(a+1), ...
- Versions: each replica of stage s starts from version 0 (the seeded model) and makes version v+1
  from version v after its v-th backward (round v). The forward of local microbatch i uses the latest
  version, which is v = max(0, i - a_s + 1); weight stashing: its backward computes the gradients with
  that same version (the stashed copy), whatever updates happened in between (§3.3).
- Round v of stage s is the r_s microbatches v*r_s .. v*r_s + r_s - 1, one per replica. After its
  backward of round v every replica all-reduces the gradients with the stage's other replicas (the mean
  for a batch-mean loss, the sum for a summed loss, as worker.average_replica_grads) and applies one
  optimizer step to version v: replicas stay identical (data parallelism within the stage, §3.1).
- A tied parameter (held by several stages) gets, in each round, the sum of its holders' round
  gradients (as worker.sum_shared_grads), so every holder's copy makes the same updates; the holders
  must then have the same replica count (else their rounds differ: refused). A holder's forward uses
  its own stage's version of the copy.
- The gradient of a microbatch is that of its own loss (spec.loss on the microbatch: a batch mean, or
  the sum of the outputs without loss_fn), not divided by the microbatch count.

- Vertical sync (option, §3.3): the forward of m on every stage uses the version number the input
  stage used for m, v_0(m) = max(0, m // r_0 - a_0 + 1), or the stage's newest if it has made fewer
  updates (possible only with replicated stages, whose versions count rounds of different sizes); the
  backward uses the same stashed version. Each stage keeps the versions between them.

A "step" of `pipeplan run --steps N` is plan.microbatches microbatches (the planner's iteration: the plan's
batch); there is no flush between steps (only at the end of the run). N x microbatches must be a multiple of
every replica count, so every round completes (`check_async_steps`). A rank's step time runs from the end of
its previous step's last backward to the end of this step's last backward (`close_steps`); the reported
loss of step k is the mean (summed loss: the sum) of its microbatches' losses, each computed with the
weights its forward used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.errors import UserError
from pipeplan.precision import training_precision
from pipeplan.runtime.batch_split import batch_leaves, cut
from pipeplan.runtime.measure import SavedTensorMeter, StageStats, StepClock, state_keys, weight_storages
from pipeplan.runtime.pipedream_comm import (
    GradRecv,
    Inbox,
    Outbox,
    post_grad_recvs,
    send_activations,
    send_grads,
    wait_grads,
)
from pipeplan.runtime.placement import steps_per_round, whole_rounds
from pipeplan.runtime.recompute import functional_forward
from pipeplan.runtime.split import flat_inputs, unflatten_output
from pipeplan.schedules import local_order, replicated_inflight


def admitted(replicas: list[int], s: int) -> int:
    """a_s: local microbatches a replica of stage s runs forward before its first backward (see the docstring);
    the memory model charges the same count (pipeplan.schedules.replicated_inflight)."""
    return replicated_inflight(replicas, s)


def check_async_plan(plan) -> dict[int, list[int]]:
    """stage -> its ranks (one per replica), with user errors for what the asynchronous loop cannot run."""
    if plan.sharding != "none":
        raise UserError(f"ZeRO sharding ({plan.sharding}) is not run with asynchronous PipeDream: each update "
                        "is one stage's round, not a flushed step", "re-plan with --sharding none")
    ranks = {s.index: list(s.devices) for s in plan.stages}
    for s in plan.stages:
        if len(s.devices) != s.replicas:
            raise UserError(f"stage {s.index} has {s.replicas} replicas but {len(s.devices)} devices", "re-plan")
    used = [r for rs in ranks.values() for r in rs]
    if len(used) != len(set(used)):
        raise UserError("asynchronous PipeDream runs one stage per device, but the plan puts several stages on "
                        "one device", "re-plan with as many devices as stage replicas")
    return ranks


def check_async_steps(plan, steps: int, warmup: int = 0) -> None:
    """Every replica must finish its last round: steps x microbatches a multiple of every replica count
    (a replica short of a microbatch would wait in the round's all-reduce for ever). Where the replicas take
    turns by step (placement.steps_per_round > 1) the measured steps must hold a whole round too: the report
    reads the iteration per round (runtime/report.py), and fewer measured steps read none (an iteration of 0)."""
    if plan.schedule == "pipedream-2bw":  # whole pipelines replicated: every replica runs every window
        return
    need = math.lcm(*(len(s.devices) for s in plan.stages))
    total = steps * plan.microbatches
    round_steps = steps_per_round(plan)
    if total % need:
        raise UserError(f"--steps {steps} x {plan.microbatches} microbatches = {total} microbatches, not a multiple "
                        f"of {need} (the least common multiple of the stages' replica counts): the last round of "
                        "a replicated stage would not complete", f"pass --steps a multiple of {round_steps}")
    if steps - warmup < round_steps:
        raise UserError(f"--steps {steps} --warmup {warmup} measures {steps - warmup} step(s), less than one round "
                        f"of {round_steps}: this plan's stage replicas take turns by step ({plan.microbatches} "
                        "microbatch(es) a step), so a replica's time is read over a round",
                        f"pass --steps {whole_rounds(plan, steps, warmup)} or more, a multiple of {round_steps}")


def tied_replicas(ranks: dict[int, list[int]], shared: dict[str, list[int]]) -> None:
    """Tied parameters need holders with equal replica counts (their rounds must coincide)."""
    for fqn, holders in sorted(shared.items()):
        counts = {len(ranks[s]) for s in holders}
        if len(counts) > 1:
            raise UserError(f"parameter {fqn} is tied across stages {holders} with different replica counts "
                            f"{sorted(counts)}; their updates would not coincide", "re-plan so those stages have "
                            "the same replica count, or untie the weights")


def process_groups(ranks: dict[int, list[int]], shared: dict[str, list[int]]) -> tuple[dict[int, Any], dict]:
    """(stage -> its replicas' group, holder ranks -> group for tied sums), created in the same order on every rank."""
    stage_groups = {s: dist.new_group(ranks[s]) for s in sorted(ranks) if len(ranks[s]) > 1}
    tied: dict[tuple[int, ...], Any] = {}
    for fqn in sorted(shared):
        for j in range(len(ranks[shared[fqn][0]])):
            key = tuple(sorted({ranks[s][j] for s in shared[fqn]}))
            if len(key) > 1 and key not in tied:
                tied[key] = dist.new_group(list(key))
    return stage_groups, tied


@dataclass
class Microbatches:
    """Microbatch m of the run from worker.batches (steps' batches cut in M): read in increasing m."""

    data: Iterator
    m_per_step: int
    batch: tuple[bool, ...] | None  # per input leaf, whether it carries the batch (runtime/batch_split.py)
    step: int = -1
    parts: list[tuple[tuple, Any]] = field(default_factory=list)

    def get(self, m: int) -> tuple[tuple, Any]:
        while self.step < m // self.m_per_step:
            inputs, target = next(self.data)
            self.step += 1
            xs = cut(inputs, self.m_per_step, self.batch)
            ys = target.tensor_split(self.m_per_step) if isinstance(target, torch.Tensor) else [target] * self.m_per_step
            self.parts = [(xs[i], ys[i]) for i in range(self.m_per_step)]
        return self.parts[m % self.m_per_step]


@dataclass
class AsyncStage:
    """One rank's replica of one stage and what its loop keeps between operations."""

    s: int
    j: int
    ranks: dict[int, list[int]]
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    loss: Any  # (flat outputs, target) -> loss tensor, on the last stage
    microbatches: Microbatches | None
    gm: Any
    n_inputs: int  # tensors received per microbatch (split.infos[s].inputs)
    vertical_sync: bool = False
    recompute: bool = False  # the plan's recomputation: each forward re-runs inside its backward
    updates: int = 0
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stashed copies by version
    inflight: dict[int, tuple[dict[str, torch.Tensor], list[torch.Tensor], tuple]] = field(default_factory=dict)
    grad_recvs: dict[int, list[GradRecv]] = field(default_factory=dict)  # microbatch -> its output gradients' receives
    losses: dict[int, float] = field(default_factory=dict)  # microbatch -> its loss (last stage)
    box: Outbox = field(default_factory=Outbox)
    inbox: Inbox = field(default_factory=Inbox)
    end: int = 0  # microbatches of the run (the loop sets it): none is received from `end` on
    received_s: float = 0.0  # time spent so far waiting in receives: a wait, not the op's compute (`timed_op`)

    @property
    def last(self) -> bool:
        return self.s == len(self.ranks) - 1

    def peer(self, stage: int, m: int) -> int:
        """The rank of `stage`'s replica that runs microbatch m."""
        return self.ranks[stage][m % len(self.ranks[stage])]

    def next_microbatch(self, m: int) -> int:
        """The microbatch this replica runs after m (every r_s-th: round-robin over the stage's replicas)."""
        return m + len(self.ranks[self.s])

    def input_version(self, m: int) -> int:
        """The version the input stage's forward of m used: its replica m mod r_0 had then made
        max(0, m // r_0 - a_0 + 1) updates (its fixed order makes this exact, so it is not sent along)."""
        replicas = [len(self.ranks[t]) for t in sorted(self.ranks)]
        return max(0, m // replicas[0] - admitted(replicas, 0) + 1)

    def keep_version(self) -> None:
        """Stash the current version as leaf copies the forwards use and the backwards differentiate (§3.3). A frozen
        parameter never changes, so every version reads the module's own (costmodels/memory.py charges it once)."""
        self.versions[self.updates] = {n: p.detach().clone().requires_grad_(True) if p.requires_grad else p.detach()
                                       for n, p in self.module.named_parameters()}

    def stash(self, m: int) -> dict[str, torch.Tensor]:
        """The version microbatch m's forward uses: the newest, or with vertical sync the input stage's
        (never newer than this stage's). Microbatches that see the same version share one copy; versions
        older than it are dropped here (the microbatches in flight keep theirs alive)."""
        v = min(self.updates, self.input_version(m)) if self.vertical_sync else self.updates
        if v not in self.versions:
            if v != self.updates:
                raise RuntimeError(f"stage {self.s}: version {v} was not kept for vertical sync")
            self.keep_version()
        for old in [k for k in self.versions if k < v]:
            del self.versions[old]
        return self.versions[v]

    def forward(self, m: int) -> None:
        if self.s == 0:
            assert self.microbatches is not None
            inputs = list(flat_inputs(self.microbatches.get(m)[0], self.gm))
        else:
            t0 = time.perf_counter()
            received = self.inbox.receive(m, self.n_inputs, self.peer(self.s - 1, m))
            after = self.next_microbatch(m)
            if after < self.end:
                self.inbox.post(after, self.peer(self.s - 1, after))
            self.received_s += time.perf_counter() - t0
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in received]
        params = self.stash(m)
        out = functional_forward(self.module, params, tuple(inputs), self.recompute)
        if self.last:
            assert self.microbatches is not None
            loss = self.loss(out, self.microbatches.get(m)[1])
            self.losses[m] = float(loss.detach())
            out = (loss,)
        else:
            send_activations(tuple(out), self.peer(self.s + 1, m), self.box)
            self.grad_recvs[m] = post_grad_recvs(tuple(out), self.peer(self.s + 1, m))
        self.inflight[m] = (params, inputs, tuple(out))

    def backward(self, m: int) -> None:
        params, inputs, out = self.inflight.pop(m)
        t0 = time.perf_counter()
        grads_out: list[torch.Tensor | None] = [None] if self.last else wait_grads(self.grad_recvs.pop(m))
        self.received_s += time.perf_counter() - t0
        pairs = [(o, g) for o, g in zip(out, grads_out, strict=True) if o.requires_grad]
        names = [n for n, p in params.items() if p.requires_grad]
        leaves = [params[n] for n in names] + [x for x in inputs if x.requires_grad]
        # nothing of a frozen stage reading the model's inputs needs a gradient: autograd.grad refuses empty lists
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True) \
            if pairs and leaves else (None,) * len(leaves)
        if self.s > 0:
            it = iter(grads[len(names):])
            send_grads(inputs, [next(it) if x.requires_grad else None for x in inputs], self.peer(self.s - 1, m),
                       self.box)
        own = dict(self.module.named_parameters())
        for n, g in zip(names, grads[:len(names)], strict=True):  # summed until the update (2BW: a window)
            g = g if g is not None else torch.zeros_like(own[n])
            own[n].grad = g if own[n].grad is None else own[n].grad + g


def meter_forward(st: AsyncStage, m: int, meter: SavedTensorMeter | None) -> None:
    """The forward under the saved-tensor meter when it is on (unmeasured steps and the first: its hooks cost
    time). Stashed weight copies the forward saves are counted with the activations (they are not the module's)."""
    if meter is not None and meter.enabled:
        with meter.hooks():
            st.forward(m)
    else:
        st.forward(m)


@dataclass
class Groups:
    """The process groups an update uses, and the tied parameters (FQN -> holder stages)."""

    stage: dict[int, Any]
    tied: dict[tuple[int, ...], Any]
    shared: dict[str, list[int]]


def update(st: AsyncStage, groups: Groups, mean: bool) -> None:
    """End of a round on this replica: tied sums, the stage's replica all-reduce, one optimizer step."""
    from pipeplan.runtime.worker import average_replica_grads, sum_shared_grads

    my_ranks = {t: rs[st.j % len(rs)] for t, rs in st.ranks.items()}  # tied holders have equal replica counts
    sum_shared_grads(groups.shared, {st.s: st.module}, my_ranks, groups.tied)
    r = len(st.ranks[st.s])
    if r > 1:  # average_replica_grads takes each stage's group by its key: one stage, key 0
        average_replica_grads({0: st.module}, {0: groups.stage[st.s]}, r, mean)
    if st.optimizer is not None:
        st.optimizer.step()
    st.module.zero_grad(set_to_none=True)
    st.updates += 1
    if st.vertical_sync:  # a later microbatch may still ask for this version when it is no longer the newest
        st.keep_version()


def run_async(opts, plan_path: str, out_dir: Path, dump_dir: Path | None, after_step) -> None:
    """One asynchronous plan on this rank: setup, the 1F1B loop, the records (worker.teardown)."""
    st, rs, groups, mean = setup_async(opts, plan_path)
    if rs.plan.schedule == "pipedream-2bw":
        from pipeplan.runtime.pipedream_2bw import train_2bw

        log = train_2bw(opts, st, rs, groups, mean, after_step)
    else:
        log = train_async(opts, st, rs, groups, mean, after_step)
    from pipeplan.runtime.worker import teardown

    teardown(rs, log, out_dir, dump_dir)


def setup_async(opts, plan_path: str):
    """This rank's stage replica, optimizer and groups; a worker.RunState for the shared teardown."""
    from pipeplan.planner.plan import load_plan
    from pipeplan.runtime import worker as w

    plan = load_plan(plan_path)
    if (opts.checkpoint_dir and opts.checkpoint_every) or opts.resume:
        raise UserError("checkpoints of an asynchronous PipeDream run are not written yet (each stage holds "
                        "stashed weight versions)", "run without --checkpoint-dir / --resume")
    ranks = check_async_plan(plan)
    check_async_steps(plan, opts.steps, opts.warmup)
    rank, world = dist.get_rank(), dist.get_world_size()
    w.check_launch(plan, ranks, world)
    spec, gm, split = w.load_split_model(plan)
    shared = split.shared_attrs()
    tied_replicas(ranks, shared)
    stage_groups, tied = process_groups(ranks, shared)
    s = next(t for t, rs in ranks.items() if rank in rs)
    j = ranks[s].index(rank)
    module = split.module(s)
    optimizers = w.make_optimizers(opts, plan, {s: module}, {})
    mean = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))

    def loss_fn(output, target):
        return spec.loss(unflatten_output(output, gm), target if mean else None)

    needs_data = s == 0 or s == len(ranks) - 1
    data = w.batches(spec, plan.batch_size)
    batch = batch_leaves(spec)
    kind: type[AsyncStage] = AsyncStage
    if plan.schedule == "pipedream-2bw":  # replica j of the whole pipeline trains on its share of every batch
        from pipeplan.runtime.pipedream_2bw import TwoBWStage, check_2bw_plan

        check_2bw_plan(ranks, opts)
        data = (w.replica_share(x, y, len(ranks[s]), j, batch) for x, y in data)
        kind = TwoBWStage
    mbs = Microbatches(data, plan.microbatches, batch) if needs_data else None
    st = kind(s=s, j=j, ranks=ranks, module=module, optimizer=optimizers.get(s), loss=loss_fn,
              microbatches=mbs, gm=gm, n_inputs=len(split.infos[s].inputs),
              vertical_sync=opts.vertical_sync, recompute=plan.recompute)
    device = torch.device("cpu")
    meter = SavedTensorMeter(weight_storages([module]), state_keys([module]))
    rs = w.RunState(plan=plan, spec=spec, gm=gm, device=device, rank=rank, world=world, replica=j, dp=len(ranks[s]),
                    mine=[s], modules={s: module}, optimizers=optimizers, sharded={}, shared=shared,
                    my_ranks={t: r[j % len(r)] for t, r in ranks.items()}, tied_groups=tied, dp_groups=stage_groups,
                    stats={s: StageStats(index=s)}, meter=meter, clock=StepClock(), schedule=None,
                    mean_loss=mean, first_step=0)
    return st, rs, Groups(stage_groups, tied, shared), mean


def timed_op(st: AsyncStage, kind: str, m: int, meter: SavedTensorMeter | None, stats, origin: float | None) -> None:
    """Run forward ("F") or backward ("B") of microbatch m; with an `origin` (a measured step), record its compute:
    the op's time less what it waited in its receive (the planner prices that wait as bubble, not compute), its
    span starting when the data arrived."""
    t0, w0 = time.perf_counter(), st.received_s
    if kind == "F":
        meter_forward(st, m, meter)
    else:
        st.backward(m)
    t1 = time.perf_counter()
    if origin is not None:
        start = t0 + (st.received_s - w0)
        (stats.fwd_s if kind == "F" else stats.bwd_s).append(t1 - start)
        stats.events.append(("fwd" if kind == "F" else "bwd", m, start - origin, t1 - origin))


def train_async(opts, st: AsyncStage, rs, groups: Groups, mean: bool, after_step):
    """The loop of `local_order`, timing each operation; steps close as `close_steps` says."""
    from pipeplan.runtime.worker import StepLog

    r, m_per_step = len(st.ranks[st.s]), rs.plan.microbatches
    a = admitted([len(st.ranks[t]) for t in sorted(st.ranks)], st.s)
    stats, clock, meter, log = rs.stats[st.s], rs.clock, rs.meter, StepLog()
    st.end = opts.steps * m_per_step
    metered = steps_per_round(rs.plan) * m_per_step  # the first round's microbatches: one on every replica
    dist.barrier()
    clock.start(opts.warmup == 0)
    closed = 0
    for kind, i in local_order(opts.steps * m_per_step // r, a):
        m = i * r + st.j
        measured = m // m_per_step >= opts.warmup
        meter.enabled = not measured or m < metered
        with meter.op([st.module]), training_precision(rs.plan.dtype, rs.device, rs.plan.schedule):  # the plan's
            timed_op(st, kind, m, meter, stats, clock.origin if measured else None)
        if kind == "B":
            update(st, groups, mean)
            closed = close_steps(st, rs, log, closed, ((i + 1) * r + st.j) // m_per_step, opts, mean, after_step)
    meter.close_ops()
    close_steps(st, rs, log, closed, opts.steps, opts, mean, after_step)
    st.box.drain()
    return log


def close_steps(st: AsyncStage, rs, log, closed: int, upto: int, opts, mean: bool, after_step) -> int:
    """Close steps closed .. upto-1 (returns the new count): a rank is done with step k when it has finished
    its last backward of a microbatch of step k or earlier; a step with no microbatch of this replica
    closes with the one before it (0 s). A step's time on this rank is from the previous close.

    Each last-stage replica logs the share of the step's loss its microbatches make (r/M times their
    sum for a batch-mean loss, their sum otherwise; 0 without one), so placement.combine_losses (the mean,
    or the sum, over replicas) gives the step's mean or summed loss.
    """
    m_per_step, r = rs.plan.microbatches, len(st.ranks[st.s])
    for k in range(closed, min(upto, opts.steps)):
        if k >= opts.warmup:
            log.step_s.append(time.perf_counter() - rs.clock.origin)
        if st.last:
            mine = [st.losses.pop(m) for m in sorted(st.losses) if m // m_per_step == k]
            log.losses.append(sum(mine) * (r / m_per_step if mean else 1.0))
        rs.clock.start(k + 1 >= opts.warmup)
        after_step(rs.rank, k + 1)
    return max(closed, min(upto, opts.steps))
