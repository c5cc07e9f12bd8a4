"""Zero bubble's split backward, completed for weights that torch's input pass cannot see.

torch.distributed.pipelining (2.13, `_backward.py`) splits a stage's backward into B, the gradients of the stage's
inputs, and W, the weights' gradients, which it computes later from the gradients B left at the "intermediates":
the nodes where a weight's part of the autograd graph meets an input's. A weight whose part never meets an input's
(an embedding bag reading integer ids the stage received, whose output the stage sends on) has no intermediate,
so W never computes its gradient and the weight silently stops training on every stage but the first (which torch
runs as one whole backward). Found on a DLRM-like model under ZB-V: its second stage's embedding tables were not
updated (the losses parted from GPipe's at the second step).

Here B first computes those weights' gradients itself, from the stage's outputs, keeping the graph for torch's own
B and W. A weight with parts on both sides (meeting an input's part and not) keeps torch's behaviour for its part
that does not: not seen in the models pipelined here, and found the same way (losses against GPipe's) if it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["complete_split_backward"]


def _disconnected(outputs: list[torch.Tensor], inputs: list[Any], weights: list[torch.nn.Parameter]) -> list[int]:
    """Indices of `weights` that torch's parameter groups leave out (none of their graph meets an input's)."""
    from torch.distributed.pipelining import _backward as tb

    out_fns = [f for f in map(tb._get_grad_fn_or_grad_acc, outputs) if f is not None]
    in_fns = [f for f in (tb._get_grad_fn_or_grad_acc(t) for t in inputs if isinstance(t, torch.Tensor))
              if f is not None]
    w_fns = [tb._get_grad_fn_or_grad_acc(w) for w in weights]
    groups = tb.get_param_groups(in_fns, [f for f in w_fns if f is not None], tb.construct_reverse_graph(out_fns))
    seen = {p for g in groups for p in g["params"]}
    return [i for i, (w, f) in enumerate(zip(weights, w_fns, strict=True)) if w.requires_grad and f not in seen]


def complete_split_backward() -> None:
    """Wrap the input pass torch's stages call (idempotent): the weights it would leave out get their gradients."""
    import torch.distributed.pipelining.stage as stage_module

    original = stage_module.stage_backward_input
    if getattr(original, "_pipeplan_completed", False):
        return
    left_out: dict[tuple[int, ...], list[int]] = {}  # per stage's weights: the same graph every microbatch

    def backward_input(stage_outputs_or_loss: list[torch.Tensor], output_grads: list[torch.Tensor] | None,
                       input_values: list[Any], weights: Iterator[torch.nn.Parameter]) -> Any:
        params = list(weights)
        key = tuple(id(p) for p in params)
        outputs = [(i, o) for i, o in enumerate(stage_outputs_or_loss) if o.requires_grad or o.grad_fn is not None]
        if key not in left_out:
            left_out[key] = _disconnected([o for _, o in outputs], input_values, params) if outputs else []
        missing = [params[i] for i in left_out[key]]
        if missing:  # a stage's first microbatch found some: their gradients, from the stage's outputs
            grads = torch.autograd.grad([o for _, o in outputs], missing,
                                        [torch.ones_like(o) if output_grads is None else output_grads[i]
                                         for i, o in outputs], retain_graph=True, allow_unused=True)
            for p, g in zip(missing, grads, strict=True):
                if g is not None and p.grad is None:
                    p.grad = g
                elif g is not None:
                    p.grad += g  # in place, as torch's W adds (a ZeRO stage's .grad is a view of its flat buffer)
        return original(stage_outputs_or_loss, output_grads, input_values, iter(params))

    backward_input._pipeplan_completed = True  # type: ignore[attr-defined]
    stage_module.stage_backward_input = backward_input
