"""Dynamic loss scaling: how `pipeplan run` trains an fp16 plan in fp16.

Why: fp16 holds magnitudes down to 2^-24 (6e-8); smaller activation gradients flush to zero and training stalls.
Multiplying the loss by S before the backward multiplies every gradient by S, and the update divides it back out
(Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2); with S a power of 2 both are exact. Too large
an S overflows: a step whose gradients hold an inf or a NaN anywhere is skipped and S shrinks; after
`growth_interval` clean steps in a row S grows. The defaults and the update rule are torch.amp.GradScaler's
(init_scale 2^16, growth 2, backoff 0.5, interval 2000; aten's `_amp_update_scale_`), so a pipelined run steps as
one process under GradScaler does. A pipeline adds one rule: every stage and replica must skip the same steps, so
the ranks agree on "an inf somewhere" with one all-reduce (MAX) over all of them before any steps, as Megatron-LM's
mixed-precision optimizer does over its model-parallel group (megatron/core/optimizer/optimizer.py,
`_unscale_main_grads_and_check_for_nan`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_INITIAL_SCALE", "LossScaler", "overflow_anywhere", "unscale_grads"]

DEFAULT_INITIAL_SCALE = 2.0 ** 16  # torch.amp.GradScaler's init_scale


@dataclass
class LossScaler:
    """The scale every rank multiplies its losses by, and the count of clean steps since it last changed."""

    scale: float = DEFAULT_INITIAL_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """After a step: back off and count a skipped step on an overflow, else grow after `growth_interval`
        clean steps (aten/src/ATen/native/cuda/AmpKernels.cu, `amp_update_scale_cuda_kernel`)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.good_steps = 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain numbers), so a resumed run scales as the uninterrupted one."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LossScaler:
        return cls(**{k: type(getattr(cls(), k))(v) for k, v in state.items() if k in cls.__dataclass_fields__})


def unscale_grads(grads: Iterable[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
    """Divide gradients by `scale` in place; returns a 1-element float tensor on `device`, 1 where any gradient
    held an inf or a NaN (torch's fused `_amp_foreach_non_finite_check_and_unscale_`, one pass, per dtype)."""
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 1.0 / scale, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
    return found


def overflow_anywhere(found: torch.Tensor) -> bool:
    """Whether any rank found an inf or a NaN: one all-reduce (MAX) over every rank of the run."""
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)
