"""What zero bubble's split backward costs beyond one whole backward of the same stage.

torch.distributed.pipelining runs the backward of every stage but the first as an input-gradient pass B and a
weight-gradient pass W (torch 2.13 `_backward.py`: `stage_backward_input`, `stage_backward_weight`). The trace
times W as a layer's whole backward less its B, so B + W = the whole backward (costmodels/measure.py). torch's
split costs more, for two reasons:
- host work: B walks the stage's autograd graph to group its parameters and hooks each group's intermediates,
  and W calls `torch.autograd.grad` once per group (the groups: `recompute.weight_grad_passes`). Measured by
  `profiles calibrate` as a line, per split backward + per group (hardware_profiles/split_backward_overhead.py;
  ~50 µs a group on one core here; 0 in the catalogue, host work a GPU's kernels hide);
- memory: a whole backward reduces each parameter's gradient over the layer's output gradient right after the
  input-gradient product read it, while it is still in cache (Linear: grad_W = g^T x, grad_b = sum(g);
  BatchNorm: sums of g and g * x_hat). W does so after B has moved on through the stage, so each of a layer's
  parameter tensors reads the output gradient back from memory: output bytes x parameter tensors (up to two:
  weight and bias) at the memory bandwidth.
Paired on one core on pipeplan's own 2- and 4-stage splits of the four examples (16 stages past the first,
benchmarks/RESULTS.md, "Recomputation's re-run", third table): the split cost 0.04-2.2 ms more, and the stage's
forward + split backward is predicted within 2.6-2.7% median (worst 5.1-9.3%) with this extra, 7.6-10.6% (worst
~40%) without, in two runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.costmodels.graph import Layer, trainable_params
from pipeplan.costmodels.recompute import weight_grad_passes

# Of a layer's parameter tensors, how many reduce over its output gradient apart: a weight and a bias.
MAX_REDUCTIONS = 2


def cold_gradient_bytes(layers: Sequence[Layer]) -> int:
    """Bytes W reads back from memory: each parameter-owning layer's output bytes, once per parameter tensor it
    uses (at most `MAX_REDUCTIONS`; one for a layer with parameter bytes but no names: analytic graphs)."""
    total = 0
    for layer in layers:
        tensors = len(trainable_params(layer)) or (1 if layer.param_bytes > layer.frozen_param_bytes else 0)
        total += layer.output_bytes * min(MAX_REDUCTIONS, tensors)
    return total


def split_backward_extra_s(layers: Sequence[Layer], *, per_split_s: float, per_group_s: float,
                           mem_bw_bytes_per_s: float) -> float:
    """Seconds one split backward (B then W) of a stage made of `layers` takes beyond its whole backward."""
    return (per_split_s + per_group_s * weight_grad_passes(layers)
            + cold_gradient_bytes(layers) / mem_bw_bytes_per_s)
