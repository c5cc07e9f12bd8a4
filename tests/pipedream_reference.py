"""Single-process reference of asynchronous PipeDream's update rule (runtime/pipedream.py's docstring).

No processes, no messages, no 1F1B order: microbatches run one after the other through the whole
model in one autograd graph, each stage's part with the weight version the rule says that stage's
forward of that microbatch sees, and the updates are applied per stage and round as the rule says.
Written from the rule, not from the worker: the versions come from the closed form
v_s(m) = max(0, m // r_s - a_s + 1) with a_s = ceil((r_s + ... + r_{K-1}) / r_s), which the loop
in the worker only produces by running its order.
"""

from __future__ import annotations

import math

import torch

from pipeplan.runtime.split import flat_inputs, unflatten_output
from pipeplan.runtime.worker import load_split_model, make_optimizer
from runtime_helpers import SEED  # noqa: F401  (the worker builds the model with it; load_split_model seeds)


def version_seen(m: int, replicas: list[int], s: int, *, vertical_sync: bool = False) -> int:
    """The version of stage s that microbatch m's forward (and, stashed, backward) uses; with vertical sync
    the input stage's, unless this stage has made fewer updates."""
    a = math.ceil(sum(replicas[s:]) / replicas[s])
    newest = max(0, m // replicas[s] - a + 1)
    return min(newest, version_seen(m, replicas, 0)) if vertical_sync and s > 0 else newest


def pipedream_reference(plan, steps: int, *, optimizer: str = "sgd", lr: float = 0.01, vertical_sync: bool = False):
    """(losses per step, {stage: final parameters by FQN}, {(stage, replica): final buffers by FQN})."""
    spec, gm, split = load_split_model(plan)
    k, mb = len(plan.stages), plan.microbatches
    replicas = [len(s.devices) for s in plan.stages]
    mean = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))
    modules = [split.module(s, copy=True) for s in range(k)]
    # frozen parameters (requires_grad False) are the modules' own in every version, never stepped
    names = [[n for n, p in m.named_parameters() if p.requires_grad] for m in modules]
    frozen = [{n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad} for m in modules]
    masters = [{n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad} for m in modules]
    opts = [make_optimizer(optimizer, list(masters[s].values()), lr) if masters[s] else None for s in range(k)]
    versions = [[{n: t.clone() for n, t in masters[s].items()}] for s in range(k)]
    buffers = {(s, j): {n: b.detach().clone() for n, b in modules[s].named_buffers()}
               for s in range(k) for j in range(replicas[s])}
    acc = [{n: torch.zeros_like(t) for n, t in masters[s].items()} for s in range(k)]
    shared = split.shared_attrs()
    x, y = spec.example_inputs(plan.batch_size), spec.example_target(plan.batch_size)
    xs = [tuple(t.tensor_split(mb)[i] for t in x) for i in range(mb)]
    ys = [y.tensor_split(mb)[i] if y is not None else None for i in range(mb)]
    step_losses: list[list[float]] = [[] for _ in range(steps)]
    for m in range(steps * mb):
        leaves, vals = [], flat_inputs(xs[m % mb], gm)
        for s in range(k):
            v = version_seen(m, replicas, s, vertical_sync=vertical_sync)
            assert v < len(versions[s]), "the rule asks for a version not made yet"
            ps = {n: versions[s][v][n].clone().requires_grad_() for n in names[s]}
            leaves.append(ps)
            vals = torch.func.functional_call(modules[s], {**ps, **buffers[(s, m % replicas[s])]}, tuple(vals))
        loss = spec.loss(unflatten_output(vals, gm), ys[m % mb] if mean else None)
        step_losses[m // mb].append(float(loss.detach()))
        flat = [p for ps in leaves for p in ps.values()]
        grads = iter(torch.autograd.grad(loss, flat, allow_unused=True))
        for s in range(k):
            for n in names[s]:
                g = next(grads)
                if g is not None:
                    acc[s][n] += g
        round_end = [s for s in range(k) if m % replicas[s] == replicas[s] - 1]
        apply_rounds(round_end, acc, masters, opts, versions, shared, replicas, mean)
    losses = [sum(ls) / mb if mean else sum(ls) for ls in step_losses]
    return losses, {s: {**frozen[s], **versions[s][-1]} for s in range(k)}, buffers


def apply_rounds(stages, acc, masters, opts, versions, shared, replicas, mean) -> None:
    """The stages whose round ended: (tied: the holders' summed) round gradient, averaged over the replicas
    for a batch-mean loss, one optimizer step, a new version."""
    grads = {s: {n: g.clone() for n, g in acc[s].items()} for s in stages}
    for fqn, holders in shared.items():
        ending = [s for s in holders if s in grads]
        if ending:
            assert len(ending) == len(holders), "tied holders' rounds must end together"
            total = sum(acc[s][fqn] for s in holders)
            for s in holders:
                grads[s][fqn] = total.clone()
    for s in stages:
        for n, p in masters[s].items():
            p.grad = grads[s][n] / replicas[s] if mean else grads[s][n]
        if opts[s] is not None:
            opts[s].step()
        versions[s].append({n: p.detach().clone() for n, p in masters[s].items()})
        for t in acc[s].values():
            t.zero_()


def assert_dumped_equal(plan, folder, ref_params, ref_buffers, where: str) -> int:
    """Every replica's dumped parameters and buffers (`--dump-params`) equal the reference's (rtol 1e-4);
    returns how many tensors were compared."""
    checked = 0
    for s, st in enumerate(plan.stages):
        for j in range(st.replicas):
            f = folder / (f"stage-{s}.pt" if j == 0 else f"stage-{s}-replica{j}.pt")
            got = torch.load(f, weights_only=True)
            want = {**ref_params[s], **ref_buffers[(s, j)]}
            assert set(got) == set(want)
            for fqn, t in got.items():
                torch.testing.assert_close(t, want[fqn], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, w=f"{where} stage {s}.{j} {fqn}": f"{w}: {m}")
                checked += 1
    return checked
