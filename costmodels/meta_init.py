"""Building a model on the meta device without running its weight initialisers.

On a meta tensor an initialiser computes nothing (there are no values), yet torch still routes it through
its Python reference (`torch._refs.normal_` is wrapped by `torch._compile._disable_dynamo`), whose first call
imports torch._dynamo: 1.2-2.2 s here, paid by every `pipeplan run` before torchrun starts, only to size the
model (`model_file.model_bytes`). Skipping the initialisers on meta tensors leaves every shape, dtype and
tie exactly as built, and the values were never there to keep.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_IN_PLACE_RANDOM = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.erfinv_})
"""What `torch.nn.init` and models' own `_init_weights` (Hugging Face's `weight.data.normal_`) call."""


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor an initialiser fills: `torch.nn.init` passes it by keyword (`tensor=`) to the mode."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


class SkipInitOnMeta(TorchFunctionMode):
    """Inside it, `torch.nn.init.*` and in-place random fills of a meta tensor return the tensor untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _IN_PLACE_RANDOM or getattr(func, "__module__", None) == "torch.nn.init":
            target = _first_tensor(args, kwargs)
            if target is not None and target.is_meta:
                return target
        return func(*args, **kwargs)
