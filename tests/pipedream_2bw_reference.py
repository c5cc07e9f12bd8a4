"""Single-process reference of PipeDream-2BW's update rule (runtime/pipedream_2bw.py's docstring).

No processes, no messages, no 1F1B order: each window's microbatches (of every pipeline replica) run one
after the other through the whole model, every stage with the shadow version W(max(0, w - 1)), and the
window's gradient updates the newest version: W(w+1) = W(w) - lr * grad f(W(w-1)) (Narayanan et al., ICML
2021, §3.1). Written from the paper's rule, not from the worker: here a version is a list index, there it
is the copy a stage keeps when its order reaches the window.
"""

from __future__ import annotations

import torch

from pipeplan.runtime.split import flat_inputs, unflatten_output
from pipeplan.runtime.worker import load_split_model, make_optimizer, replica_share
from runtime_helpers import SEED  # noqa: F401  (the worker builds the model with it; load_split_model seeds)


def two_bw_reference(plan, steps: int, *, optimizer: str = "sgd", lr: float = 0.01):
    """(losses per step, {stage: final parameters by FQN}, {(stage, replica): final buffers by FQN}, versions
    used per window). Replica j trains on its rows of the batch; the window gradient is the mean over the
    window's microbatches and replicas for a batch-mean loss, else the sum; tied copies get the holders' sum."""
    spec, gm, split = load_split_model(plan)
    k, mb, r = len(plan.stages), plan.microbatches, len(plan.stages[0].devices)
    mean = callable(getattr(spec.module, "loss_fn", None)) and callable(getattr(spec.module, "example_target", None))
    modules = [split.module(s, copy=True) for s in range(k)]
    # frozen parameters (requires_grad False) are the modules' own in every version, never stepped
    frozen = [{n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad} for m in modules]
    masters = [{n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad} for m in modules]
    opts = [make_optimizer(optimizer, list(masters[s].values()), lr) if masters[s] else None for s in range(k)]
    versions = [[{n: t.clone() for n, t in masters[s].items()} for s in range(k)]]  # versions[v][s]
    buffers = {(s, j): {n: b.detach().clone() for n, b in modules[s].named_buffers()} for s in range(k) for j in range(r)}
    shared = split.shared_attrs()
    batch = spec.example_inputs(plan.batch_size), spec.example_target(plan.batch_size)
    losses, used = [], []
    for w in range(steps):
        v = max(0, w - 1)
        used.append(v)
        acc = [{n: torch.zeros_like(t) for n, t in masters[s].items()} for s in range(k)]
        window_losses = []
        for j in range(r):
            x, y = replica_share(*batch, r, j, (True,) * len(flat_inputs(batch[0], gm)))  # every input batch-sized
            for i in range(mb):
                leaves = [{n: t.clone().requires_grad_() for n, t in versions[v][s].items()} for s in range(k)]
                vals = flat_inputs(tuple(t.tensor_split(mb)[i] for t in x), gm)
                for s in range(k):
                    vals = torch.func.functional_call(modules[s], {**leaves[s], **buffers[(s, j)]}, tuple(vals))
                target = y.tensor_split(mb)[i] if (mean and y is not None) else None
                loss = spec.loss(unflatten_output(vals, gm), target)
                window_losses.append(float(loss.detach()))
                flat = [(s, n, p) for s in range(k) for n, p in leaves[s].items()]
                grads = torch.autograd.grad(loss, [p for _, _, p in flat], allow_unused=True)
                for (s, n, _), g in zip(flat, grads, strict=True):
                    if g is not None:
                        acc[s][n] += g
        for fqn, holders in shared.items():
            total = sum(acc[s][fqn] for s in holders)
            for s in holders:
                acc[s][fqn] = total.clone()
        for s in range(k):
            for n, p in masters[s].items():
                p.grad = acc[s][n] / (mb * r) if mean else acc[s][n]
            if opts[s] is not None:
                opts[s].step()
        versions.append([{n: p.detach().clone() for n, p in masters[s].items()} for s in range(k)])
        losses.append(sum(window_losses) / len(window_losses) if mean else sum(window_losses))
    return losses, {s: {**frozen[s], **versions[-1][s]} for s in range(k)}, buffers, used
