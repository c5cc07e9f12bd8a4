"""DeepSpeed: a plan as pipeline settings plus explicit stage boundaries, and `partition_method` as a split.

DeepSpeed's `PipelineModule(layers, num_stages, partition_method=...)`
(deepspeed/runtime/pipe/module.py, 0.19.8) cuts its layer list with one of
'uniform' (`runtime/utils.partition_uniform`), 'parameters' (trainable parameter
counts per layer, balanced by `partition_balanced`, a linear-partition DP that
minimises the heaviest minus the lightest part) or 'type:REGEX' (weight 1 for
layers whose class name matches REGEX case-insensitively, 0 for the others,
balanced the same way). It has no option for explicit boundaries: `parts`
(the first layer index of each stage, then the layer count) is set inside
`_partition_layers`, so applying a plan means overriding that one method.

pipeplan reads a model as the layer list a DeepSpeed port of it has
(Megatron-DeepSpeed's GPT pipe: `EmbeddingPipe`, one `ParallelTransformerLayerPipe`
per block, then the final norm and the output head): the units of `names.py`.
The class names `TYPE_NAMES` are what 'type:REGEX' matches against, so
'type:transformer' selects the blocks, as in Megatron-DeepSpeed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pipeplan.planner.baselines import deepspeed_parameters
from pipeplan.planner.frameworks.common import Export, framework_notes, plan_units, require_synchronous
from pipeplan.planner.frameworks.names import ModelUnits, unit_split
from pipeplan.planner.plan import Plan

__all__ = ["TYPE_NAMES", "partition_uniform", "partition_balanced", "parts_for_method", "parts_of_split",
           "precision_config", "split_of_parts", "export", "type_name"]

TYPE_NAMES = {"embed": "EmbeddingPipe", "block": "ParallelTransformerLayerPipe", "norm": "NormPipe",
              "head": "LMHeadPipe", "other": "LayerPipe"}


def type_name(mu: ModelUnits, unit: int) -> str:
    return TYPE_NAMES[mu.units[unit].kind]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_uniform`: the first `num_items % num_parts` parts take one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_balanced`: uniform when there are no more items than parts, else
    the linear-partition DP, computed by `planner/baselines.deepspeed_parameters` (same recurrence and ties)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    stage = deepspeed_parameters([float(w) for w in weights], num_parts)
    return [0] + [int(i) + 1 for i in np.flatnonzero(np.diff(stage))] + [n]


def parts_for_method(method: str, weights: Sequence[float], type_names: Sequence[str], num_stages: int) -> list[int]:
    """`PipelineModule._partition_layers`: the parts list for 'uniform', 'parameters' or 'type:REGEX'."""
    m = method.lower()
    if m == "uniform":
        return partition_uniform(len(type_names), num_stages)
    if m == "parameters":
        return partition_balanced(weights, num_stages)
    if m.startswith("type:"):
        rx = re.compile(m.split(":")[1], re.IGNORECASE)  # DeepSpeed keeps what follows the first ":" up to the next
        binary = [1 if rx.search(name) else 0 for name in type_names]
        if not any(binary):
            raise ValueError(f"Partitioning '{m.split(':')[1]}' found no valid layers to partition "
                             f"(DeepSpeed's error; the layer classes are {sorted(set(type_names))})")
        return partition_balanced(binary, num_stages)
    raise ValueError(f"partition_method {method!r} is not one DeepSpeed implements (uniform, parameters, type:REGEX)")


def parts_of_split(split: Sequence[Sequence[int]]) -> list[int]:
    parts = [0]
    for units in split:
        parts.append(parts[-1] + len(units))
    return parts


def split_of_parts(parts: Sequence[int]) -> list[list[int]]:
    """Units per stage; a DeepSpeed stage may be empty (more stages than layers), pipeplan's may not."""
    split = [list(range(a, b)) for a, b in zip(parts[:-1], parts[1:], strict=True)]
    empty = [s for s, units in enumerate(split) if not units]
    if empty:
        raise ValueError(f"DeepSpeed leaves stage {empty[0]} without layers (parts {list(parts)})")
    return split


def export(plan: Plan) -> Export:
    """The plan as DeepSpeed settings; Inexpressible says why when DeepSpeed cannot run it."""
    from pipeplan.planner.frameworks.names import Inexpressible

    require_synchronous(plan, "DeepSpeed")
    if plan.chunks > 1:
        raise Inexpressible("DeepSpeed's pipeline engine runs one stage per rank (TrainSchedule, 1F1B); it has no "
                            "interleaved schedule: re-plan with --schedule 1f1b")
    if plan.sharding in ("zero2", "zero3"):
        raise Inexpressible(f"DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 (PipelineModule docstring); "
                            f"the plan uses {plan.sharding}: re-plan with --sharding zero1 or none")
    pu = plan_units(plan)
    split = unit_split(pu.units, pu.stage_of_layer)
    parts = parts_of_split(split)
    stage_modules = [[f"{type_name(pu.units, u)}({pu.units.units[u].key})" for u in units] for units in split]
    config: dict[str, object] = {"train_batch_size": plan.batch_size, "train_micro_batch_size_per_gpu": plan.microbatch_size,
              "gradient_accumulation_steps": plan.microbatches}
    if plan.sharding == "zero1":
        config["zero_optimization"] = {"stage": 1}
    config.update(precision_config(plan.dtype))
    settings = {"num_stages": len(split), "parts": parts, "activation_checkpoint_interval": 1 if plan.recompute else 0,
                "ds_config": config}
    notes = ["DeepSpeed has no option for explicit stage boundaries: the class below overrides "
             "PipelineModule._partition_layers to set them (deepspeed/runtime/pipe/module.py)",
             f"layer list order assumed: {', '.join(type_name(pu.units, u) for u in range(min(3, len(pu.units.units))))}"
             f"... ({len(pu.units.units)} layers)",
             f"gradient_accumulation_steps is the microbatch count ({plan.microbatches}); DeepSpeed runs 1F1B "
             "(TrainSchedule) whatever the plan's synchronous schedule"]
    notes += framework_notes(plan, "deepspeed")
    return Export("deepspeed", settings, {"python": _python(settings), "ds_config.json": _json(config)},
                  stage_modules, notes)


def precision_config(dtype: str) -> dict[str, object]:
    """The ds_config keys that train in the plan's dtype (DeepSpeed trains fp32 without them, another step than the
    one predicted): bf16, or fp16 with dynamic loss scaling (`"loss_scale": 0`) from 2^16, where `pipeplan run`
    and torch.amp.GradScaler start (DeepSpeed's own window and hysteresis then move it;
    deepspeed/runtime/precision_config.py)."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}
    return {}


def _json(config: dict[str, object]) -> str:
    import json

    return json.dumps(config, indent=2) + "\n"


def _python(s: dict[str, object]) -> str:
    return (
        "from deepspeed.pipe import PipelineModule\n\n\n"
        "class PlannedPipelineModule(PipelineModule):\n"
        "    \"\"\"PipelineModule with pipeplan's stage boundaries (DeepSpeed has no option for them).\"\"\"\n\n"
        f"    PARTS = {s['parts']}  # first layer of each stage, then the number of layers\n\n"
        "    def _partition_layers(self, method=\"uniform\"):\n"
        "        assert len(self._layer_specs) == self.PARTS[-1] and self.num_stages == len(self.PARTS) - 1\n"
        "        self.parts = list(self.PARTS)\n"
        "        stage_id = self._topo.get_coord(self.global_rank).pipe\n"
        "        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])\n\n\n"
        f"# model = PlannedPipelineModule(layers=specs, num_stages={s['num_stages']}, loss_fn=loss_fn,\n"
        f"#                               activation_checkpoint_interval={s['activation_checkpoint_interval']})\n"
    )
