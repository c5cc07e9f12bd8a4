"""torchtitan: a plan as `[parallelism]` settings, and torchtitan settings as a split.

torchtitan (github.com/pytorch/torchtitan) names a Llama-family model's modules
`tok_embeddings`, `layers.N`, `norm` and the output projection, and splits it by
`parallelism.module_fqns_per_model_part` (one list of module names per model
part, i.e. per virtual stage; `distributed/pipeline_parallel.py: _split_module`
keeps exactly those). Two generations of its configuration exist:

- releases up to February 2026 read a TOML job file (`torchtitan/config/job_config.py`):
  `[parallelism]` and `[training]` tables, the output module is `output`;
- torchtitan 0.3.0 (commit 9810191 "Config System Refactor: TOML to Python
  Dataclass Registry") reads a Python `config_registry` function chosen with
  `--module/--config`, overridable by tyro flags such as
  `--parallelism.pipeline_parallel_degree 4`; the output module is `lm_head`.
  tyro reads a `list[list[str]]` flag as one-element lists, so the parts go in the
  Python function, not on the command line.

The number of microbatches is `training.local_batch_size //
parallelism.pipeline_parallel_microbatch_size` in both. When no parts are given,
torchtitan splits by `_generate_llm_fqn_per_model_part`, reproduced here as
`default_parts` (the same in 0.3.0 and at main, 2026-08).
"""

from __future__ import annotations

import json
from typing import Any

from pipeplan.planner.frameworks.common import Export, framework_notes, plan_units, require_synchronous
from pipeplan.planner.frameworks.names import Inexpressible, ModelUnits
from pipeplan.planner.plan import Plan
from pipeplan.schedules import ScheduleName

__all__ = ["SCHEDULES", "EMBEDDING_NAMES", "fqn_of", "parts_of", "default_parts", "export", "OUTPUT_TOML",
           "OUTPUT_PY", "LOOPED"]

# pipeplan schedule -> torch.distributed.pipelining schedule name torchtitan passes to get_schedule_class.
# torchtitan places ZBVZeroBubble's and DualPipeV's stages in a V itself (its pipeline_module_split: style "v"),
# as pipeplan plans them (pipeplan.schedules.stage_device).
SCHEDULES: dict[ScheduleName, str] = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb-h1": "InterleavedZeroBubble",
             "zb-v": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
LOOPED = frozenset({"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
# Token-embedding module names of the Llama family: Hugging Face, torchtitan, GPT-2, Megatron.
EMBEDDING_NAMES = frozenset({"embed_tokens", "tok_embeddings", "wte", "word_embeddings"})
OUTPUT_TOML = "output"  # TOML-era torchtitan's output projection
OUTPUT_PY = "lm_head"  # torchtitan 0.3.0's


def fqn_of(mu: ModelUnits, unit: int, output: str) -> str:
    """torchtitan's module name for a unit; Inexpressible for a model outside the Llama family's naming."""
    u = mu.units[unit]
    if u.kind == "block":
        return f"layers.{u.block}"
    if u.kind == "norm":
        return "norm"
    if u.kind == "head":
        return output
    if u.kind == "embed":
        weighted = [mu.layer_names[i] for i in u.layers if i not in mu.neutral]
        if len(weighted) == 1 and weighted[0].rsplit(".", 1)[-1] in EMBEDDING_NAMES:
            return "tok_embeddings"
        raise Inexpressible(f"the layers before the blocks ({', '.join(weighted)}) are not one token embedding: "
                            "torchtitan's Llama-family models have only tok_embeddings there")
    raise Inexpressible(f"layer {u.key!r} has no torchtitan module name (a Llama-family model has "
                        "tok_embeddings, layers.N, norm and the output projection only)")


def _check_family(mu: ModelUnits) -> None:
    kinds = [u.kind for u in mu.units if u.kind != "block"]
    if not mu.blocks or kinds != ["embed", "norm", "head"]:
        raise Inexpressible("the model is not Llama-shaped (token embedding, numbered decoder blocks, final norm, "
                            f"output projection); its units outside the blocks are {kinds}")


def parts_of(mu: ModelUnits, split: list[list[int]], output: str) -> list[list[str]]:
    _check_family(mu)
    return [[fqn_of(mu, u, output) for u in units] for units in split]


def default_parts(num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1,
                  output: str = OUTPUT_PY) -> list[list[str]]:
    """torchtitan's `_generate_llm_fqn_per_model_part`, step for step (distributed/pipeline_parallel.py)."""
    if num_stages < 1:
        raise ValueError("Number of stages must be at least 1")
    if num_stages == 1:
        return [["tok_embeddings"] + [f"layers.{i}" for i in range(num_layers)] + ["norm", output]]
    effective = num_layers + input_weight + output_weight
    if num_stages > effective:
        raise ValueError(f"Number of stages ({num_stages}) cannot be greater than effective layers ({effective})")
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or input_weight > per_stage or output_weight > per_stage:
        raise ValueError(f"torchtitan refuses {num_stages} stages for {num_layers} layers "
                         f"(input_weight={input_weight}, output_weight={output_weight})")
    parts, current = [], 0
    for s in range(num_stages):
        budget = per_stage + (1 if s < extra else 0)
        part = ["tok_embeddings"] if s == 0 else []
        take = budget - (input_weight if s == 0 else output_weight if s == num_stages - 1 else 0)
        for _ in range(take):
            if current < num_layers:
                part.append(f"layers.{current}")
                current += 1
        if s == num_stages - 1:
            part += ["norm", output]
        parts.append(part)
    return parts


def _data_parallel(plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """pipeplan's data parallelism as torchtitan's degrees (FSDP2: ZeRO-3, or ZeRO-2 without resharding)."""
    d = plan.data_parallel
    if plan.sharding == "zero1":
        raise Inexpressible("torchtitan has no ZeRO-1 (its sharded data parallelism is FSDP2: ZeRO-2 with "
                            "fsdp_reshard_after_forward=\"never\", or ZeRO-3)")
    if plan.sharding == "none":
        return {"data_parallel_replicate_degree": d, "data_parallel_shard_degree": 1}, []
    out: dict[str, Any] = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": d}
    if plan.sharding == "zero2":
        out["fsdp_reshard_after_forward"] = "never"
    return out, []


# torchtitan's parameter dtype under its mixed precision (training.mixed_precision_param, default "bfloat16": FSDP's
# MixedPrecisionPolicy, which torchtitan's parallelize installs even at shard degree 1, torchtitan/models/llama3/
# parallelize.py at b5bcd76; torch.autocast under DDP alone in older versions): the plan's, so an fp32 plan is not
# trained in bf16 nor a bf16 plan in fp32. tf32 is fp32 parameters with tf32 matmuls.
MIXED_PRECISION_PARAM = {"bf16": "bfloat16", "fp32": "float32", "tf32": "float32"}


def export(plan: Plan) -> Export:
    """The plan as torchtitan settings; Inexpressible says why when it cannot be."""
    require_synchronous(plan, "torchtitan")
    pu = plan_units(plan)
    from pipeplan.planner.frameworks.names import unit_split

    split = unit_split(pu.units, pu.stage_of_layer)
    parts_py = parts_of(pu.units, split, OUTPUT_PY)
    parts_toml = parts_of(pu.units, split, OUTPUT_TOML)
    degree = len(split) // plan.chunks
    dp, notes = _data_parallel(plan)
    settings: dict[str, Any] = {
        "pipeline_parallel_degree": degree,
        "pipeline_parallel_schedule": SCHEDULES[plan.schedule],
        "module_fqns_per_model_part": parts_py,
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
        "local_batch_size": plan.batch_size // plan.data_parallel,
        "activation_checkpoint": "full" if plan.recompute else "none",
        "mixed_precision_param": MIXED_PRECISION_PARAM.get(plan.dtype, "bfloat16"),
        **dp,
    }
    if plan.dtype == "fp16":
        notes.append("the plan is fp16, which torchtitan does not train (training.mixed_precision_param is bfloat16 "
                     "or float32): exported as bfloat16; re-plan with --dtype bf16 for a prediction of that step")
    notes += framework_notes(plan, "torchtitan")  # torchtitan leaves allow_tf32 at torch's default, off
    notes.append(f"{len(split)} model parts on {degree} pipeline ranks; microbatches = local_batch_size / "
                 f"pipeline_parallel_microbatch_size = {plan.microbatches}")
    snippets = {"toml (torchtitan <= 0.2, TOML job config)": _toml(settings, parts_toml),
                "python config_registry (torchtitan 0.3)": _python(settings),
                "command line (torchtitan 0.3, with the function above)": _cli(settings)}
    return Export("torchtitan", settings, snippets, parts_py, notes)


def _toml(s: dict[str, Any], parts: list[list[str]]) -> str:
    par = {k: s[k] for k in ("pipeline_parallel_degree", "pipeline_parallel_schedule",
                             "pipeline_parallel_microbatch_size", "data_parallel_replicate_degree",
                             "data_parallel_shard_degree", "fsdp_reshard_after_forward") if k in s}
    lines = ["[parallelism]"] + [f"{k} = {json.dumps(v)}" for k, v in par.items()]
    lines.append("module_fqns_per_model_part = [")
    lines += [f"  {json.dumps(p)}," for p in parts] + ["]", "", "[training]",
                                                        f"local_batch_size = {s['local_batch_size']}",
                                                        f"mixed_precision_param = {json.dumps(s['mixed_precision_param'])}",
                                                        "",
                                                        "[activation_checkpoint]",
                                                        f"mode = {json.dumps(s['activation_checkpoint'])}"]
    return "\n".join(lines) + "\n"


def _python(s: dict[str, Any]) -> str:
    full = s["activation_checkpoint"] == "full"
    lines = ["from torchtitan.distributed.activation_checkpoint import FullAC"] if full else []
    lines += ["from torchtitan.models.llama3.config_registry import llama3_8b  # your model's config function",
              "", "", "def pipeplan_plan():",
             "    config = llama3_8b()",
             "    p = config.parallelism"]
    for k in ("pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
              "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward"):
        if k in s:
            lines.append(f"    p.{k} = {s[k]!r}")
    lines.append("    p.module_fqns_per_model_part = [")
    lines += [f"        {p!r}," for p in s["module_fqns_per_model_part"]] + ["    ]"]
    lines += [f"    config.training.local_batch_size = {s['local_batch_size']}",
              f"    config.training.mixed_precision_param = {s['mixed_precision_param']!r}",
              f"    config.activation_checkpoint = {'FullAC.Config()' if full else 'None'}",
              "    config.training.disable_cuda_graphs = True  # torchtitan 0.3 refuses CUDA graphs with PP",
              "    return config"]
    return "\n".join(lines) + "\n"


def _cli(s: dict[str, Any]) -> str:
    flags = ["--module", "my_configs", "--config", "pipeplan_plan"]
    for k in ("pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size"):
        flags += [f"--parallelism.{k}", str(s[k])]
    flags += ["--training.local_batch_size", str(s["local_batch_size"]),
              "--training.mixed_precision_param", s["mixed_precision_param"], "--training.disable_cuda_graphs"]
    return " ".join(flags) + "\n"
