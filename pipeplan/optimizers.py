"""The optimizers plans name, built one way for every layer that steps or times one.

The runtime steps with them, the single-process references in the tests use them, and
`profiles calibrate` times their step on this machine (hardware_profiles/optimizer_overhead.py),
so all three run the same torch.optim configuration. Like pipeplan/schedules.py this module sits
below every layer (it imports nothing of pipeplan but the error type).

On CUDA they take torch's fused kernels (`fused=True`): what the GPU frameworks our users train with step
with (torchtitan's `Optimizer.implementation` defaults to "fused", torchtitan/config/job_config.py; Megatron
and DeepSpeed step with fused Adam), and what the catalogue's GPU profiles price (costmodels/optimizer_step.py:
one pass, 28 bytes a parameter for Adam). torch's own CUDA default, the foreach kernels, spent 1.1-1.5 ms of
host-bound launches a step on the examples on an H200 where fused kernels price 0.004 ms (benchmarks/RESULTS.md,
GPU section (f)). Elsewhere torch's defaults (on a CPU a loop over the parameter tensors, what a local
profile's calibration timed and prices).
"""

from __future__ import annotations

from typing import Any, Final

from pipeplan.errors import UserError

__all__ = ["make_optimizer", "fused_for", "DEFAULT_LR"]

DEFAULT_LR: Final[dict[str, float]] = {"sgd": 0.01, "momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


def fused_for(params: list[Any]) -> bool:
    """Whether `make_optimizer` steps these parameters with fused kernels: every one a floating-point tensor on
    CUDA (torch's fused Adam, AdamW and SGD take float16, bfloat16, float32 and float64 on CUDA)."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def make_optimizer(name: str, params: Any, lr: float, kernels: str = "auto") -> Any:
    """The torch.optim optimizer a plan's name stands for, over a list or iterable of parameter tensors, stepping
    with the plan's `kernels` (pipeplan.choices.OptimizerKernels): "auto" fused on CUDA (`fused_for`) and torch's
    defaults elsewhere; "fused" fused kernels (torch has them for a CPU too); "foreach" torch's foreach kernels on
    CUDA and its defaults on a CPU (the same passes, one tensor at a time)."""
    import torch

    params = list(params)
    kw: dict[str, Any] = {}
    if kernels == "fused" or (kernels == "auto" and fused_for(params)):
        kw = {"fused": True}
    elif kernels == "foreach" and fused_for(params):
        kw = {"foreach": True}
    elif kernels not in ("auto", "foreach"):
        raise UserError(f"unknown optimizer kernels {kernels!r}", "use auto, fused or foreach")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kw)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **kw)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kw)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kw)
    raise UserError(f"unknown optimizer {name!r}", "use sgd, momentum, adam or adamw")
