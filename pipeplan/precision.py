"""The precision a plan's steps run in, one way for `pipeplan run` and for the tracer that times them.

Why: a plan's dtype is what its prediction priced (on a GPU profile `--dtype auto` is bf16), and a run that
trained a bf16 plan in fp32 measured another step than the one predicted. bf16 runs as torchtitan's and
Megatron's mixed precision does: fp32 weights, gradients and optimizer state, the forward's ops in bf16 where
torch.autocast casts them (matmuls, convolutions; the backward follows the forward's dtypes). tf32 is fp32 with
its matmuls on tensor cores (`torch.set_float32_matmul_precision("high")`), fp32 torch's default ("highest").
fp16 runs under torch.autocast too, with dynamic loss scaling (runtime/loss_scale.py), on the schedules that
flush: asynchronous PipeDream's stages update at different times and could not agree on which steps to skip, so
their fp16 plans train in fp32 and `pipeplan run` says so (`precision_note`). The tracer times layers in these
same contexts (`pipeplan trace --dtype`), so a trace's times are those of the step the runtime takes. Like
pipeplan/optimizers.py this module sits below every layer (torch is imported where a context needs it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from pipeplan.schedules import facts

if TYPE_CHECKING:
    import torch

__all__ = ["AUTOCAST_DTYPES", "precision_note", "recipe_note", "scales_loss", "trained_dtype", "training_precision"]

AUTOCAST_DTYPES: Final[dict[str, str]] = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtypes by name: the
# planner asks `scales_loss` without importing torch
MATMUL_PRECISION: Final[dict[str, str]] = {"fp32": "highest", "tf32": "high"}


def trained_dtype(dtype: str, schedule: str | None = None) -> str:
    """The dtype `pipeplan run` trains a plan of `dtype` under `schedule` in (None: a schedule that flushes)."""
    if dtype == "fp16" and schedule is not None and not facts(schedule).flushes:
        return "fp32"
    return dtype


def scales_loss(dtype: str, schedule: str | None = None) -> bool:
    """Whether the run multiplies its losses by a dynamic scale (an fp16 plan it trains in fp16)."""
    return trained_dtype(dtype, schedule) == "fp16"


@contextlib.contextmanager
def training_precision(dtype: str, device: torch.device, schedule: str | None = None) -> Iterator[None]:
    """Forwards (and the loss) inside run as a plan of `dtype` trains: under torch.autocast for bf16 and fp16, with
    fp32 matmuls on tensor cores for tf32; the process's matmul precision is restored on the way out."""
    import torch

    trained = trained_dtype(dtype, schedule)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(MATMUL_PRECISION.get(trained, "highest"))
    try:
        if trained in AUTOCAST_DTYPES:
            with torch.autocast(device.type, dtype=getattr(torch, AUTOCAST_DTYPES[trained])):
                yield
        else:
            yield
    finally:
        torch.set_float32_matmul_precision(before)


def recipe_note(dtype: str, mixed_precision: str, schedule: str | None = None) -> str | None:
    """A warning line where a 16-bit plan's memory was counted with a framework's recipe (`--mixed-precision deepspeed
    |megatron`: 16-bit weights, so every activation 16-bit) and `pipeplan run` trains it under torch.autocast, whose
    fp32 weights, residual stream and norm inputs weigh more (a `deepspeed` prediction of the GPT plans of
    benchmarks/RESULTS.md, "Peak memory", was 11-32% under their stages' peaks); else None."""
    if trained_dtype(dtype, schedule) not in AUTOCAST_DTYPES or mixed_precision == "autocast":
        return None
    return (f"warning: this plan's memory was counted with the {mixed_precision} recipe (16-bit weights and "
            f"activations, as that framework trains); pipeplan run trains under torch.autocast (fp32 weights, "
            f"activations in the dtypes autocast leaves them), which can need more memory than predicted: re-plan "
            f"with --mixed-precision autocast for this runtime")


def precision_note(dtype: str, schedule: str | None = None) -> str | None:
    """A warning line where `pipeplan run` will not train in the plan's dtype, else None."""
    if trained_dtype(dtype, schedule) == dtype:
        return None
    return (f"warning: this plan is {dtype} under {schedule}; pipeplan run trains it in fp32 (the stages of "
            f"asynchronous PipeDream update at different times and cannot agree on which steps fp16's loss scaling "
            f"skips), so its steps are fp32's: plan with --dtype bf16 or --dtype fp32 to compare them with a "
            f"prediction")
