"""Passes the runtime makes over a stage's gradients besides the optimizer's: memory-bound copies that no layer's
time and no collective's time includes.

* Dividing by the microbatch count (`grad_scale_s`). torch.distributed.pipelining's schedules do it after a
  stage's last backward of a step when the loss is a batch mean (`_PipelineStageBase.scale_grads`:
  `p.grad.div_(M)` for each parameter, one eager op a tensor; runtime/worker.py asks for it exactly then), and
  PipeDream-2BW once per window (runtime/pipedream_2bw.py). One pass: it reads and writes every gradient.
  Measured on examples/mlp.py's 2-stage 1F1B at M = 2: 0.46 ms for stage 0's 3.7M parameters, 1.6% of the step.
* Flattening for the data-parallel all-reduce (`dp_flatten_s`). runtime/worker.average_replica_grads concatenates
  a stage's gradients into one buffer, all-reduces it, divides it by the replica count (a batch-mean loss) and
  makes each parameter's gradient a view of its slice: two passes that read and write every gradient (the
  concatenation, the division), and an op a tensor. `profiles calibrate` times the all-reduce alone
  (hardware_profiles/collectives.py). Measured here (one core, 8 Linear(1024, 1024), 8.4M parameters in 16
  tensors, tests/test_grad_passes.py): the concatenation 2.4 ms, the division 1.4, against 3.6-4.3 predicted for
  the two. The sync used to clone each slice back out as well, a third pass into new memory that took 3.3-4.1 ms
  (5.4-8 ms for the three against 4.0-6.5 predicted: the test's 2x bound failed once in a few CI runs); a view
  costs nothing and the step drops it with the buffer (`zero_grad(set_to_none=True)`).

* Unscaling an fp16 step (`unscale_s`). runtime/loss_scale.py divides every gradient by the loss scale and checks
  it for an inf or a NaN in one fused pass (torch's `_amp_foreach_non_finite_check_and_unscale_`), then every rank
  all-reduces one flag. The loss was weighted by 1/M (and 1/replicas) before the backward, so such a step makes
  neither the division by M nor the sync's division: the unscaling replaces them.

All are priced the same way, by the bytes of the gradients in their dtype. A calibrated profile measured its
plain SGD step (`p.add_(g)`: one in-place op a tensor, reading 8 and writing 4 bytes a parameter,
hardware_profiles/optimizer_overhead.py), so a pass over fp32 gradients (8 bytes a parameter) costs 8/12 of its
time per parameter, and its time per tensor; a GPU profile the bytes at its memory
bandwidth, a kernel per tensor, and no less than the host's dispatch per tensor. The planner does not know the
loss's reduction (the graph does not record it) and prices the division for a batch mean; a summed loss skips it.
"""

from __future__ import annotations

from typing import Final

from pipeplan.costmodels.compute import streaming_bandwidth_bytes_per_s
from pipeplan.costmodels.optimizer_step import FOREACH_BYTES_PER_PARAM
from pipeplan.costmodels.part_costs import kernel_overheads_s
from pipeplan.hardware_profiles.profile import HardwareProfile

__all__ = ["DP_FLATTEN_PASSES", "dp_flatten_s", "grad_scale_s", "gradient_pass_s", "unscale_s"]

DP_FLATTEN_PASSES: Final[int] = 2  # torch.cat in, the division (the slices go back out as views)


def gradient_pass_s(grad_bytes: float, *, profile: HardwareProfile, tensors: int, passes: int = 1) -> float:
    """Seconds for `passes` eager passes that each read and write `grad_bytes` of gradients in `tensors` tensors
    (8 bytes a parameter in fp32, 4 in 16 bits)."""
    measured = profile.optimizer_param_s.get("sgd")  # seconds per parameter of a step moving 12 bytes of it
    per_byte = (measured / FOREACH_BYTES_PER_PARAM["sgd"] if measured is not None
                else 1.0 / streaming_bandwidth_bytes_per_s(profile))
    kernel_s, dispatch_s = kernel_overheads_s(profile)
    per_tensor = profile.optimizer_tensor_s.get("sgd", 0.0) + kernel_s
    return passes * max(2 * grad_bytes * per_byte + tensors * per_tensor, tensors * dispatch_s)


def grad_scale_s(grad_bytes: float, *, profile: HardwareProfile, tensors: int) -> float:
    """Seconds to divide a stage's gradients by M before its update (torch's scale_grads; 2BW per window)."""
    return gradient_pass_s(grad_bytes, profile=profile, tensors=tensors)


def dp_flatten_s(grad_bytes: float, *, profile: HardwareProfile, tensors: int, divides: bool = True) -> float:
    """Seconds the data-parallel sync spends copying a stage's gradients into one buffer and dividing it
    (runtime/worker.average_replica_grads), beside the all-reduce itself; without the division where the loss was
    weighted before the backward (fp16)."""
    return gradient_pass_s(grad_bytes, profile=profile, tensors=tensors,
                           passes=DP_FLATTEN_PASSES if divides else DP_FLATTEN_PASSES - 1)


def unscale_s(grad_bytes: float, *, profile: HardwareProfile, tensors: int) -> float:
    """Seconds to divide a stage's gradients by the loss scale and check them (fp16; the flag's all-reduce apart)."""
    return gradient_pass_s(grad_bytes, profile=profile, tensors=tensors)
