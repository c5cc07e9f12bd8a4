"""What every framework export needs from a plan: its stages as units, and the checks they share.

A plan file names pipeplan layers; `plan_units` reads them as framework units
(`names.py`) and the stage of each. Stage s of a synchronous plan runs on
pipeline rank s % P (docs/plan-format.md), which is also how torchtitan's
"loop" style, Megatron's layout and DeepSpeed (one stage per rank) number them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeplan.choices import MIXED_PRECISION_DTYPES
from pipeplan.planner.frameworks.names import Inexpressible, ModelUnits, model_units
from pipeplan.planner.plan import Plan

__all__ = ["PlanUnits", "plan_units", "Export", "stage_of_layer", "require_synchronous", "tf32_notes", "recipe_notes",
           "framework_notes", "recompute_notes", "FRAMEWORK_RECIPE"]


@dataclass(frozen=True)
class PlanUnits:
    units: ModelUnits
    stage_of_layer: tuple[int, ...]


def stage_of_layer(plan: Plan) -> list[int]:
    """The stage of every layer of the plan, in model order (stages are listed in model order)."""
    return [st.index for st in sorted(plan.stages, key=lambda s: s.index) for _ in st.layers]


def plan_units(plan: Plan) -> PlanUnits:
    names = [name for st in sorted(plan.stages, key=lambda s: s.index) for name in st.layers]
    return PlanUnits(model_units(names), tuple(stage_of_layer(plan)))


def require_synchronous(plan: Plan, framework: str) -> None:
    """PipeDream's asynchronous schedule and per-stage replicas exist in no framework's pipeline engine."""
    if plan.schedule in ("pipedream", "pipedream-2bw"):
        raise Inexpressible(f"{framework} has no asynchronous ({plan.schedule}) schedule; re-plan with --schedule 1f1b")


def tf32_notes(plan: Plan, framework: str) -> list[str]:
    """A tf32 plan's note: no framework has a setting for tf32 matmuls, so the training script turns them on."""
    if plan.dtype != "tf32":
        return []
    return [f"the plan is tf32: {framework} has no setting for it; set torch.backends.cuda.matmul.allow_tf32 = True "
            "in the training script (else its matmuls run in full fp32, slower than predicted)"]


@dataclass(frozen=True)
class _Training:
    """How a framework trains what a plan describes, where its settings cannot say it."""

    name: str  # the framework, in notes
    recipe: str  # the mixed-precision recipe (pipeplan.choices.MixedPrecision) it keeps a 16-bit model's state by
    state: str  # that recipe in words (a recipe note says it)
    recompute: str  # its setting that recomputes per layer, which the export writes for a plan with recomputation


# DeepSpeed's own recipe (16-bit weights and gradients), Megatron-LM's (fp32 gradients: its README's bytes-per-parameter
# table; arguments.py turns on --accumulate-allreduce-grads-in-fp32 with --bf16); torchtitan's FSDP2
# MixedPrecisionPolicy (bf16 compute, gradients reduced in fp32, 16-bit activations) is closest to Megatron-LM's.
_TRAINING: dict[str, _Training] = {
    "deepspeed": _Training("DeepSpeed", "deepspeed",
                           "keeps 16-bit weights and gradients beside fp32 master weights (the ZeRO paper's "
                           "mixed-precision Adam), so its activations are 16-bit", "activation_checkpoint_interval=1"),
    "megatron": _Training("Megatron-LM", "megatron",
                          "keeps 16-bit weights, so its activations are 16-bit, and accumulates and all-reduces "
                          "gradients in fp32 (--accumulate-allreduce-grads-in-fp32, on with --bf16; fp16 keeps fp32 "
                          "main gradients)",
                          "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    "torchtitan": _Training("torchtitan", "megatron",
                            "computes with bf16 parameters and reduces gradients in fp32 (FSDP2's "
                            "MixedPrecisionPolicy), so its activations are 16-bit", 'activation_checkpoint mode "full"'),
}
FRAMEWORK_RECIPE: dict[str, str] = {framework: t.recipe for framework, t in _TRAINING.items()}


def framework_notes(plan: Plan, framework: str) -> list[str]:
    """What a framework's settings cannot say about the plan: the precision recipe its memory was counted with
    where that is not the framework's (`recipe_notes`), tf32 (`tf32_notes`), and recomputation's granularity."""
    t = _TRAINING[framework]
    return (recipe_notes(plan, t.name, t.recipe, t.state) + tf32_notes(plan, t.name)
            + recompute_notes(plan, t.name, t.recompute))


def recompute_notes(plan: Plan, framework: str, setting: str) -> list[str]:
    """A plan recomputed with one checkpoint per stage (`recompute_granularity: stage`, pipeplan's default), where
    the frameworks checkpoint every decoder layer: the framework's activation memory is not the plan's (every block's
    input kept per microbatch in flight, one block re-run at a time, against the stage's input kept and the whole
    stage re-run at once; docs/cost-models.md §3.3), so the note says to re-plan per block. None for a plan counted
    per block, as the export writes it."""
    if not plan.recompute or plan.recompute_granularity == "block":
        return []
    return [f"recomputation: {framework} checkpoints every layer ({setting}), where this plan's memory was counted "
            "with one checkpoint per stage: each microbatch in flight keeps every layer's input there, and one "
            "layer is re-run at a time, so its activation memory differs from the plan's; re-plan with "
            "--recompute-granularity block to count it as the framework runs it (a checkpoint per decoder layer)"]


def recipe_notes(plan: Plan, framework: str, recipe: str, how: str) -> list[str]:
    """A 16-bit plan whose memory was counted with another recipe than the framework trains with (`pipeplan.choices.
    MixedPrecision`; the default is `pipeplan run`'s torch.autocast): its per-device memory is not the framework's,
    so the note says how the framework keeps its state (`how`) and which recipe to re-plan with."""
    if plan.dtype not in MIXED_PRECISION_DTYPES or plan.mixed_precision == recipe:
        return []
    counted = " (pipeplan run's torch.autocast)" if plan.mixed_precision == "autocast" else ""
    return [f"{framework} {how}; this plan's memory was counted with the {plan.mixed_precision} recipe{counted}: "
            f"re-plan with --mixed-precision {recipe} for {framework}'s memory"]


@dataclass
class Export:
    """One framework's settings for a plan: structured values, rendered snippets and notes."""

    framework: str
    settings: dict[str, Any]  # the framework's own option names and values
    snippets: dict[str, str]  # label -> text to paste (TOML, command line, Python)
    stage_modules: list[list[str]]  # the framework's names of what each stage holds
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "settings": self.settings, "snippets": self.snippets,
                "stage_modules": self.stage_modules, "notes": self.notes}
