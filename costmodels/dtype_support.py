"""Telling a model that torch cannot train in a 16-bit dtype on this device from a failure of pipeplan's own.

Why: a 16-bit plan is timed (and run) under torch.autocast, and some models have no kernel there: on this CPU an
nn.LSTM under fp16 autocast fails in oneDNN ("could not create a primitive descriptor for the LSTM forward
propagation primitive"). That is the model and the flag, and the user's answer is another `--dtype`: exit 2 with
one line. But the same kind of RuntimeError came from pipeplan itself once (the exported program's dtype
assertions, costmodels/export.py `_without_dtype_asserts`), and that must stay an internal error. The model's own
eager forward and backward under the same autocast tells them apart: if it fails too, torch cannot run the model
in that dtype; if it runs, the failure is in what pipeplan ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipeplan.costmodels.model_file import ModelSpec, _cause, is_out_of_memory
from pipeplan.errors import UserError
from pipeplan.precision import training_precision


def eager_step_error(spec: ModelSpec, model: torch.nn.Module, inputs: tuple[Any, ...], target: Any, dtype: str,
                     device: torch.device) -> BaseException | None:
    """What one eager training step of `model` in `dtype` raises (None: it runs); its gradients are cleared after."""
    try:
        with training_precision(dtype, device):
            loss = spec.loss(model(*inputs), target)
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward has no annotations
    except Exception as e:  # whatever torch raises for this model in this dtype
        return e
    finally:
        model.zero_grad(set_to_none=True)
    return None


@contextmanager
def unsupported_dtype_as_user_error(spec: ModelSpec, model: torch.nn.Module, inputs: tuple[Any, ...], target: Any,
                                    dtype: str, device: torch.device) -> Iterator[None]:
    """Around a 16-bit timing of the exported program: a RuntimeError the eager model also raises is a UserError."""
    try:
        yield
    except RuntimeError as e:
        if dtype == "fp32" or is_out_of_memory(e):
            raise
        eager = eager_step_error(spec, model, inputs, target, dtype, device)
        if eager is None:
            raise  # the eager model trains in this dtype: the failure is pipeplan's
        raise UserError(f"{spec.path}: {spec.entry}() does not train in {dtype} on this {device.type.upper()}: torch "
                        f"fails on it under autocast ({_cause(eager)})", "plan it with another --dtype; fp32 runs "
                        "everywhere") from e
