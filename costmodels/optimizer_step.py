"""The optimizer step's time: a memory-bound pass over each parameter's training state, plus host time per tensor.

The update runs once per iteration after the gradients are reduced (every
microbatch for PipeDream, which updates after each backward), so it adds to the
iteration rather than hiding behind compute. Adam does ~10 FLOPs per parameter
against 28-80 bytes moved: memory-bound on every device in the catalogue, so the
time is bytes / the bandwidth a streaming pass achieves (the profile's memory
efficiency times its bandwidth, compute.streaming_bandwidth_bytes_per_s); on a
CPU, where torch.optim loops over the parameter tensors one eager op at a time,
plus the profile's measured host time per tensor (`optimizer_us_per_tensor`, hardware_profiles/optimizer_overhead.py).

Bytes per parameter, by implementation (fp32 state):
- torch.optim's defaults, what `pipeplan run` steps with on a CPU (a local profile): the per-tensor
  loop `_single_tensor_adam` (foreach kernels only on CUDA-like devices), the same passes as
  torch/optim/adam.py `_multi_tensor_adam`: lerp_(m, g) 12, mul_(v) 8, addcmul_(v, g, g) 12,
  sqrt(v) 8, div_ 8, add_(eps) 8, addcdiv_(p, m, denom) 16 = 72; AdamW's decoupled decay adds
  mul_(p) 8 = 80; SGD add_(p, g) 12; momentum mul_(buf) 8 + add_(buf, g) 12 + add_(p, buf) 12 = 32.
  Measured here: 2.23M parameters, Adam, one thread: 4.5 ms = 160 MB at 36 GB/s, against the
  32.3 GB/s `profiles calibrate` measured for the core.
  A calibrated profile measures the step instead (`optimizer_ns_per_param`, hardware_profiles/
  optimizer_overhead.py): the passes over one tensor reuse what the previous pass left in cache, so the
  bytes overstate the traffic. Here Adam stepped at 3.2-3.4 ns a parameter on tensors of 1-4M floats against
  4.1 ns for 72 bytes at the 17.5 GB/s calibrate measured (SGD 0.41-0.46 ns against 0.69); examples/mlp.py's
  step (5.12M parameters) took 17.8 ms, 22.2 predicted by bytes, 17.9 by the measured rate.
- fused kernels, what GPU frameworks step with (apex / DeepSpeed FusedAdam, Megatron's optimizer,
  torchtitan's default, torch `fused=True`) and `pipeplan run` on CUDA (pipeplan/optimizers.py): one pass
  reading p, g, m, v and writing p, m, v: 28 (Adam, AdamW); SGD 12; momentum 20 (read p, g, buf; write p, buf).
Mixed precision adds a pass making the 16-bit copy of the weights from the fp32 master, reading 4 bytes and writing 2:
torch.autocast casts each weight once a step (cached until the step's autocast region ends: `pipeplan run`'s
bf16 and fp16 plans, pipeplan/precision.py), Megatron-LM copies main to model parameters after the update
(`_copy_main_params_to_model_params`). Measured here: casting 5.2M fp32 weights to fp16 or bf16 took 1.3 ms on one
core, 6 bytes a parameter at calibrate's 26.5 GB/s say 1.2 (the 2 bytes of the write alone, as priced before, 0.4).
"""

from __future__ import annotations

from typing import Final

from pipeplan.costmodels.compute import streaming_bandwidth_bytes_per_s
from pipeplan.hardware_profiles.profile import HardwareProfile

__all__ = ["FOREACH_BYTES_PER_PARAM", "FUSED_BYTES_PER_PARAM", "HALF_COPY_BYTES_PER_PARAM", "optimizer_step_s",
           "stash_copy_s"]

FOREACH_BYTES_PER_PARAM: Final[dict[str, int]] = {"sgd": 12, "momentum": 32, "adam": 72, "adamw": 80}
FUSED_BYTES_PER_PARAM: Final[dict[str, int]] = {"sgd": 12, "momentum": 20, "adam": 28, "adamw": 28}
HALF_COPY_BYTES_PER_PARAM: Final[int] = 6  # read the fp32 master, write the 16-bit copy
FP32_BYTES: Final[int] = 4


def optimizer_step_s(param_bytes_fp32: float, *, optimizer: str, mixed_precision: bool,
                     profile: HardwareProfile, tensors: int = 0, kernels: str = "auto") -> float:
    """Seconds for one optimizer step over `param_bytes_fp32` bytes of fp32 parameters in `tensors` parameter
    tensors on one device of `profile`, stepped with `kernels` (pipeplan.choices.OptimizerKernels).

    "auto": a local profile steps with torch.optim's defaults (the runtime's on a CPU), any other with fused
    kernels (the runtime's on CUDA); "fused" and "foreach" say how the framework steps whatever the profile,
    priced by the bytes their passes move (a profile's measurements are of the runtime's own step, so "auto" alone
    takes them). Composer's DecoupledAdamW, which LLM Foundry trains with, is a Python loop of torch ops per
    tensor (composer/optim/decoupled_weight_decay.py: mul_, add_, mul_, addcmul_, sqrt, /, add_, addcdiv_):
    "foreach". Where the profile measured the optimizer's time per parameter and per tensor, those price it
    (none in the catalogue: fused kernels take every tensor in one launch); else the bytes its kernels move at
    the streaming bandwidth. On a CPU (a local profile) the host does the passes, so the per-tensor time adds to
    them; on a GPU the host issues the next tensor's kernels while the GPU runs the last ones, so the step is
    the longer of the two. Measured on an H200 (benchmarks/RESULTS.md, GPU) with torch's default foreach
    kernels: torch.optim.Adam took 3.12 ms over GPT-2's 124M parameters in 148 tensors, where 2.85 ms is their
    passes and 2.26 ms their 15.3 µs a tensor (sum 5.1), and 1.26 ms over the 32x32 ResNet's 2.8M in 62 (passes
    0.06 ms, host 0.95). What is left, ~0.24 ms, is a step's fixed part (`optimizer_us_per_step`, measured on
    CUDA: Adam over one tensor took 252 µs).
    """
    foreach = kernels == "foreach" or (kernels == "auto" and profile.local)
    table = FOREACH_BYTES_PER_PARAM if foreach else FUSED_BYTES_PER_PARAM
    if optimizer not in table:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    own = kernels == "auto"  # what calibrate timed: the runtime's step
    params = param_bytes_fp32 / FP32_BYTES
    bandwidth = streaming_bandwidth_bytes_per_s(profile)
    half_copy_s = params * (HALF_COPY_BYTES_PER_PARAM if mixed_precision else 0) / bandwidth
    measured = profile.optimizer_param_s.get(optimizer) if own else None
    update_s = params * measured if measured is not None else params * table[optimizer] / bandwidth
    host_s = tensors * profile.optimizer_tensor_s.get(optimizer, 0.0) if own else 0.0
    fixed_s = profile.optimizer_step_s.get(optimizer, 0.0) if params > 0 and own else 0.0
    if profile.local:
        return update_s + half_copy_s + host_s + fixed_s
    return max(update_s + half_copy_s, host_s) + fixed_s


def stash_copy_s(param_bytes: float, *, profile: HardwareProfile) -> float:
    """Seconds to copy a stage's weights into a new stashed version (PipeDream's weight stashing, SOSP'19
    §3.3; PipeDream-2BW's shadow copy, ICML'21 §3.1): one clone of every parameter, which reads and writes
    each byte once (runtime/pipedream.keep_version, `p.detach().clone()`). PipeDream makes a version per
    update, so every microbatch; 2BW once per window. Memory-bound, like the optimizer step beside it."""
    return 2.0 * param_bytes / streaming_bandwidth_bytes_per_s(profile, copy=True)
