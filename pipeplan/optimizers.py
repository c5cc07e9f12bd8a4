"""The optimizers plans name, built one way for every layer that steps or times one.

The runtime steps with them, the single-process references in the tests use them, and
`profiles calibrate` times their step on this machine (hardware_profiles/optimizer_overhead.py),
so all three run the same torch.optim configuration. Like pipeplan/schedules.py this module sits
below every layer (it imports nothing of pipeplan but the error type).
"""

from __future__ import annotations

from typing import Any, Final

from pipeplan.errors import UserError

__all__ = ["make_optimizer", "DEFAULT_LR"]

DEFAULT_LR: Final[dict[str, float]] = {"sgd": 0.01, "momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


def make_optimizer(name: str, params: Any, lr: float) -> Any:
    """The torch.optim optimizer a plan's name stands for (torch's defaults otherwise: on a CPU they loop over
    the parameter tensors one by one, on a GPU they run foreach kernels)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise UserError(f"unknown optimizer {name!r}", "use sgd, momentum, adam or adamw")
