"""Zero bubble's split backward, timed on the chosen plan's own stages (local profiles, before `analyze` reports).

Why: torch's split (torch.distributed.pipelining `_backward.py`: `stage_backward_input` then one
`torch.autograd.grad` per parameter group in `stage_backward_weight`) costs more than one whole backward, and how
much depends on the stage far more than the calibrated line (per split + per group, measured on tiny Linear + ReLU
stages: hardware_profiles/split_backward_overhead.py) and the cold gradient bytes say. Timed here on one core, paired
against a whole backward on the same stage module: examples/resnet.py's second of two stages took 4.8 ms more
(1.4 ms modelled), examples/gpt.py's 1.3 ms (0.6 modelled). Three causes, none of which the line sees:
- each group's `autograd.grad` walks the part of the stage's graph it can reach, so the per-group cost grows with
  the stage (tiny Linear + ReLU stages: 38 µs a group at 8 groups, 61 µs at 64; with three more parameter-free ops
  per group, 46 and 85 µs);
- a convolution's or a norm's backward runs twice, once per output mask (input gradient in B, weight gradient in
  W), and each call redoes the work they share (ResNet stage: convolution_backward +10%, batch-norm backward
  +80%, by torch's profiler);
- W reads its inputs back after B has moved on.
So where the plan's stages can be built (a model file on this machine, as `pipeplan run` builds them), the extra is
measured and the plan re-predicted with it (planner/replay.with_split_extra); elsewhere the model prices it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PAIRS, WARMUP = 12, 3  # whole / split pairs per stage (median of the differences), after warm-up pairs


def stage_inputs(split: Any, spec: Any, stage: int, microbatch: int) -> tuple[Any, ...]:
    """Stage `stage`'s inputs: the stages before it run once without gradients; detached leaves, which need a
    gradient past the first stage (floating-point ones), as a pipeline's received activations do."""
    import torch

    from pipeplan.runtime.split import flat_inputs

    values = flat_inputs(tuple(spec.example_inputs(microbatch)), split.gm)  # a dict input: its leaves, as run feeds
    with torch.no_grad():
        for s in range(stage):
            values = split.module(s, copy=True)(*values)
            values = values if isinstance(values, tuple) else (values,)
    return tuple(v.detach().requires_grad_(stage > 0 and v.is_floating_point()) if isinstance(v, torch.Tensor)
                 else v for v in values)


def _outputs(module: Any, inputs: tuple[Any, ...]) -> list[Any]:
    import torch

    out = module(*inputs)
    return [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]


def _whole_s(module: Any, inputs: tuple[Any, ...]) -> float:
    """One whole backward of the stage, seeded as the runtime seeds it: a contiguous gradient per output."""
    import torch

    outs = _outputs(module, inputs)
    grads = [torch.ones_like(o) for o in outs]
    t0 = time.perf_counter()
    torch.autograd.backward(outs, grads)
    return time.perf_counter() - t0


def _split_s(module: Any, inputs: tuple[Any, ...]) -> float:
    """The same backward as zero bubble runs it: torch's B (input gradients), then its W (one call per group)."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    outs = _outputs(module, inputs)
    grads = [torch.ones_like(o) for o in outs]
    t0 = time.perf_counter()
    _, groups = stage_backward_input(outs, grads, [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad],
                                     module.parameters())
    stage_backward_weight(module.parameters(), groups)
    return time.perf_counter() - t0


def stage_split_extra_s(split: Any, spec: Any, stage: int, microbatch: int, pairs: int = PAIRS) -> float:
    """Median over alternating pairs of (split backward - whole backward) on one stage module, seconds (>= 0).

    The module owns its outputs, as the runtime builds zero bubble's stages; forwards stay outside the clocks.
    """
    module = split.module(stage, copy=True, own_outputs=True)
    inputs = stage_inputs(split, spec, stage, microbatch)
    for _ in range(WARMUP):
        _whole_s(module, inputs), _split_s(module, inputs)
    extra = []
    for _ in range(pairs):
        whole = _whole_s(module, inputs)
        extra.append(_split_s(module, inputs) - whole)
    return max(0.0, statistics.median(extra))


def measure_split_extra_s(plan: Any, pairs: int = PAIRS) -> list[float]:
    """Per stage of `plan` (in model order), what torch's split backward takes beyond a whole one, seconds.

    The first stage's is 0: torch runs its backward whole, as W (its input needs no gradient).
    """
    from pipeplan.runtime.worker import load_split_model

    spec, _, split = load_split_model(plan)
    return [0.0, *(stage_split_extra_s(split, spec, s, plan.microbatch_size, pairs)
                   for s in range(1, len(plan.stages)))]
