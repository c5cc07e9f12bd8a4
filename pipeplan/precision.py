"""The precision a plan's steps run in, one way for `pipeplan run` and for the tracer that times them.

Why: a plan's dtype is what its prediction priced (on a GPU profile `--dtype auto` is bf16), and a run that
trained a bf16 plan in fp32 measured another step than the one predicted. bf16 runs as torchtitan's and
Megatron's mixed precision does: fp32 weights, gradients and optimizer state, the forward's ops in bf16 where
torch.autocast casts them (matmuls, convolutions; the backward follows the forward's dtypes). tf32 is fp32 with
its matmuls on tensor cores (`torch.set_float32_matmul_precision("high")`), fp32 torch's default ("highest").
fp16 needs loss scaling, which the runtime does not do yet: an fp16 plan trains in fp32 and `pipeplan run` says
so (`precision_note`). The tracer times layers in these same contexts (`pipeplan trace --dtype`), so a trace's
times are those of the step the runtime takes. Like pipeplan/optimizers.py this module sits below every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import torch

from pipeplan.choices import TIMED_DTYPES

__all__ = ["AUTOCAST_DTYPES", "TIMED_DTYPES", "precision_note", "trained_dtype", "training_precision"]

AUTOCAST_DTYPES: Final[dict[str, torch.dtype]] = {"bf16": torch.bfloat16}
MATMUL_PRECISION: Final[dict[str, str]] = {"fp32": "highest", "tf32": "high"}


def trained_dtype(dtype: str) -> str:
    """The dtype `pipeplan run` trains a plan of `dtype` in."""
    return dtype if dtype in TIMED_DTYPES else "fp32"


@contextlib.contextmanager
def training_precision(dtype: str, device: torch.device) -> Iterator[None]:
    """Forwards (and the loss) inside run as a plan of `dtype` trains: under torch.autocast for bf16, with fp32
    matmuls on tensor cores for tf32; the process's matmul precision is restored on the way out."""
    trained = trained_dtype(dtype)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(MATMUL_PRECISION.get(trained, "highest"))
    try:
        if trained in AUTOCAST_DTYPES:
            with torch.autocast(device.type, dtype=AUTOCAST_DTYPES[trained]):
                yield
        else:
            yield
    finally:
        torch.set_float32_matmul_precision(before)


def precision_note(dtype: str) -> str | None:
    """A warning line where `pipeplan run` will not train in the plan's dtype, else None."""
    if trained_dtype(dtype) == dtype:
        return None
    return (f"warning: this plan is {dtype}; pipeplan run trains it in fp32 ({dtype} needs loss scaling, which the "
            f"runtime does not do yet), so its steps are fp32's: plan with --dtype bf16 or --dtype fp32 to compare "
            f"them with a prediction")
