"""Sharded data parallelism in the runtime: ZeRO-1, -2 and -3 over a stage's replicas, as the planner prices them.

Why our own and not FSDP2: under `torch.distributed.pipelining` an FSDP module
keeps its parameters gathered and its gradients unsharded until the stage's last
backward (stage.py `backward_maybe_with_nosync`), so ZeRO-2/3 would move and hold
what ZeRO-1 does and the run would not be the plan. Here the collectives happen
where planner/predict_inputs.py puts them:

- ZeRO-1: after the stage's last backward, reduce-scatter the gradients; each
  replica updates its shard of the parameters (its optimizer state covers that
  shard only); all-gather the updated parameters.
- ZeRO-2: the reduce-scatter follows every backward (the full gradients are
  freed at once); the update and all-gather as ZeRO-1.
- ZeRO-3: the parameters live as shards; every forward and every backward
  gathers them and frees them after (the storage is resized to 0 in place, so
  autograd's saved views see the gathered values again: FSDP's original trick).

The stage's trainable parameters (tied parameters aside: `sum_shared_grads`
keeps them whole) become views into one flat buffer; replica r owns elements
[r*n, (r+1)*n) of it, padded to a multiple of the replicas. The optimizer is the
plan's, on one flat fp32 shard: its update is elementwise, so training equals
the unsharded run (tests/test_runtime_sharding.py checks losses and parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.hardware_profiles.collectives import all_gather_op, reduce_scatter_op

__all__ = ["ShardedParams", "wrap_stage"]

# torch 2.13's names where it has them (the old ones warn on every call), looked up once, not per gather
_all_gather, _reduce_scatter = all_gather_op(dist), reduce_scatter_op(dist)


class ShardedParams:
    """One stage's trainable parameters (at least one), sharded over its replicas' process group."""

    def __init__(self, params: list[torch.nn.Parameter], *, level: str, group: Any, make_optimizer: Callable) -> None:
        self.level, self.group = level, group
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = params
        total = sum(p.numel() for p in params)
        self.shard_numel = -(-total // self.dp)
        self.full = torch.zeros(self.shard_numel * self.dp, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.full[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.full[offset:offset + n].view_as(p)
                offset += n
        mine = self.full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        self.master = torch.nn.Parameter(mine.detach().clone())
        self.grad_shard = torch.zeros_like(self.master)
        self.optimizer = make_optimizer([self.master])
        self.gathered = True  # ZeRO-3 frees them after the first forward: the pipeline's shape inference runs first

    # -- parameters ----------------------------------------------------------
    def free(self) -> None:
        """ZeRO-3: drop the full parameters (views keep their shapes; their storage holds nothing)."""
        if self.level == "zero3" and self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def gather(self) -> None:
        """Make the full parameters current: all-gather every replica's shard into the flat buffer."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            self.gathered = True
        _all_gather(self.full, self.master.detach().to(self.full.dtype), group=self.group)

    # -- gradients -----------------------------------------------------------
    def reduce_scatter_grads(self) -> None:
        """Sum every replica's gradients; keep (accumulate) this replica's shard; free the full gradients."""
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=self.full.device)
                 for p in self.params]
        flat = torch.cat(grads + [torch.zeros(self.full.numel() - sum(g.numel() for g in grads), dtype=self.full.dtype,
                                             device=self.full.device)])
        out = torch.empty(self.shard_numel, dtype=flat.dtype, device=flat.device)
        _reduce_scatter(out, flat, group=self.group)
        self.grad_shard += out.to(self.grad_shard.dtype)
        for p in self.params:
            p.grad = None

    def reduce_pending(self) -> None:
        """ZeRO-1 reduces the step's gradients once, before its update (ZeRO-2/3 did after every backward)."""
        if self.level == "zero1":
            self.reduce_scatter_grads()

    def skip(self) -> None:
        """A step fp16's loss scaling skips (runtime/loss_scale.py): drop the gradients; the parameters stand."""
        self.grad_shard.zero_()

    def step(self, scale: float) -> None:
        """The optimizer update of this replica's shard (`reduce_pending` first), then the updated parameters
        gathered (ZeRO-1/2)."""
        self.master.grad = self.grad_shard * scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_shard.zero_()
        if self.level == "zero3":
            return  # gathered at the next forward
        self.gather()

    def state_bytes(self) -> int:
        """Optimizer state this replica keeps (its shard's)."""
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))


def wrap_stage(stage: Any, sharded: ShardedParams) -> None:
    """Put the collectives of ZeRO-2/3 around a PipelineStage's forward and backward (patches the instance).

    Wrapped before `instrument`, so a measured op includes its collectives, as
    the plan's op time does.
    """
    if sharded.level not in ("zero2", "zero3"):
        return
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        if sharded.level == "zero3":
            sharded.gather()
        try:
            return fwd(*args, **kwargs)
        finally:
            sharded.free()

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        if sharded.level == "zero3":
            sharded.gather()
        try:
            return bwd(*args, **kwargs)
        finally:
            sharded.reduce_scatter_grads()
            sharded.free()

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
