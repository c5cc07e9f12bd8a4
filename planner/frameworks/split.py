"""A user's split, in any of the forms people have one in, as the stage of every pipeplan layer.

`--split` takes the names of the layers that start stages 2..K
(`model.layers.8,model.layers.16`; a module name stands for its first layer) or
per-stage counts of the model's repeated blocks (`8,8,8,8`: the layers before
the blocks go with the first stage, those after them with the last).
`--split-from` takes what a framework would be given: a torchtitan TOML job file
(`[parallelism]`), a file of Megatron-LM arguments, a DeepSpeed JSON
(`{"num_stages": 4, "partition_method": "parameters"}`), or inline
`deepspeed:K:METHOD`; each is computed the way that framework computes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan._io import read_json
from pipeplan.planner.frameworks import deepspeed, megatron, torchtitan
from pipeplan.planner.frameworks.names import Inexpressible, ModelUnits, assignment_from_units, model_units
from pipeplan.schedules import ScheduleName, facts

__all__ = ["UserSplit", "parse_split", "split_from_source", "MAX_SPLIT_FILE_BYTES"]

MAX_SPLIT_FILE_BYTES = 1 << 20  # a job file or argument list is a few KiB


@dataclass(frozen=True)
class UserSplit:
    assignment: list[int]  # stage (virtual stage) of every pipeplan layer
    chunks: int  # model chunks per pipeline rank (Megatron/torchtitan virtual stages)
    source: str  # what it came from, as the report says it
    # the schedule the framework's settings name, when pipeplan plans it with these chunks (a torchtitan ZB-V
    # split is placed in a V, not looped: judged under its own schedule); None: judge under the best's
    schedule: ScheduleName | None = None


def _counts_split(counts: list[int], mu: ModelUnits, names: Sequence[str]) -> list[int]:
    if any(c < 1 for c in counts):
        raise ValueError("every stage needs at least one block")
    if not mu.blocks:  # no repeated blocks: counts of layers
        if sum(counts) != len(names):
            raise ValueError(f"the counts add up to {sum(counts)}, the model has {len(names)} layers (and no repeated blocks)")
        return [s for s, c in enumerate(counts) for _ in range(c)]
    if sum(counts) != mu.blocks:
        raise ValueError(f"the counts add up to {sum(counts)} blocks, the model has {mu.blocks} "
                         f"({mu.block_prefix}.0-{mu.blocks - 1})")
    return assignment_from_units(mu, megatron._units_split(mu, counts))


def _first_layer(token: str, names: Sequence[str]) -> int:
    for i, name in enumerate(names):
        if name == token or name.startswith(token + "."):
            return i
    raise ValueError(f"no layer is named {token!r} or lies inside it (layers run {names[0]} ... {names[-1]})")


def parse_split(text: str, names: Sequence[str], has_params: Callable[[int], bool] | None = None) -> UserSplit:
    """`--split`: boundary names or per-stage block counts; ValueError says what is wrong."""
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens:
        raise ValueError("--split is empty")
    if all(t.isdigit() for t in tokens):
        mu = model_units(names, has_params)
        return UserSplit(_counts_split([int(t) for t in tokens], mu, names), 1, f"--split {text}")
    starts = [_first_layer(t, names) for t in tokens]
    if starts[0] == 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError("the stage-start layers must be in model order, after the first layer, one per stage")
    bounds = [0, *starts, len(names)]
    assignment = [s for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) for _ in range(b - a)]
    return UserSplit(assignment, 1, f"--split {text}")


def _toml(text: str) -> dict[str, Any]:
    """TOML through the standard library (Python 3.11+; pipeplan still runs on 3.10, without this import)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ValueError("reading a torchtitan TOML needs Python 3.11 or later (tomllib)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML ({e})") from None


def _read(path: str) -> str:
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError("no such file")
    if p.stat().st_size > MAX_SPLIT_FILE_BYTES:
        raise ValueError(f"larger than {MAX_SPLIT_FILE_BYTES} bytes; a split is a few lines")
    return p.read_text(encoding="utf-8", errors="replace")


def _torchtitan(doc: dict[str, Any], mu: ModelUnits) -> tuple[list[list[int]], int, ScheduleName | None]:
    """A torchtitan `[parallelism]` table as units per model part, computed as torchtitan does, and the
    pipeplan schedule its `pipeline_parallel_schedule` is with that many parts a rank (None: none is)."""
    par = doc.get("parallelism")
    if not isinstance(par, dict):
        raise ValueError("no [parallelism] table")
    degree = int(par.get("pipeline_parallel_degree", 1))
    schedule = str(par.get("pipeline_parallel_schedule", "1F1B"))
    parts = par.get("module_fqns_per_model_part")
    if parts is None:
        parts = _default_parts(par, degree, schedule, mu.blocks)
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
        raise ValueError("module_fqns_per_model_part must be a list of lists of module names")
    if degree < 1 or len(parts) % degree:
        raise ValueError(f"{len(parts)} model parts do not divide over pipeline_parallel_degree {degree}")
    chunks = len(parts) // degree
    named = [k for k, v in torchtitan.SCHEDULES.items() if v == schedule and facts(k).interleaves == (chunks > 1)]
    return [[_unit_of_fqn(str(name), mu) for name in part] for part in parts], chunks, named[0] if named else None


def _default_parts(par: dict[str, Any], degree: int, schedule: str, layers: int) -> list[list[str]]:
    """torchtitan's `_get_pipeline_metadata` stage count, then `_generate_llm_fqn_per_model_part`."""
    first = int(par.get("pipeline_parallel_first_stage_less_layers", 1))
    last = int(par.get("pipeline_parallel_last_stage_less_layers", 1))
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    looped = schedule in torchtitan.LOOPED
    if per_stage is not None:
        stages = -(-(layers + first + last) // int(per_stage))
        if stages % degree or (stages // degree != 1) == (not looped):
            raise ValueError(f"torchtitan refuses {stages} virtual stages on {degree} ranks with schedule {schedule}")
    else:
        stages = degree * (2 if looped else 1)
    return torchtitan.default_parts(stages, layers, first, last, output=torchtitan.OUTPUT_TOML)


def _unit_of_fqn(name: str, mu: ModelUnits) -> int:
    kinds = {"tok_embeddings": "embed", "norm": "norm", "output": "head", "lm_head": "head"}
    for u, unit in enumerate(mu.units):
        if name.startswith("layers.") and unit.kind == "block" and name == f"layers.{unit.block}":
            return u
        if kinds.get(name) == unit.kind:
            return u
    raise ValueError(f"module {name!r} is not one of this model's torchtitan modules "
                     f"(tok_embeddings, layers.0-{mu.blocks - 1}, norm, output/lm_head)")


def _deepspeed(spec: dict[str, Any], mu: ModelUnits, weights: Sequence[float]) -> list[list[int]]:
    k, method = spec.get("num_stages", 0), str(spec.get("partition_method", "parameters"))
    if isinstance(k, str) and k.isdigit():
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= len(mu.units):
        raise ValueError(f"num_stages must be an integer from 1 to {len(mu.units)} (the model's layer-list entries; "
                         f"DeepSpeed gives every stage at least one), not {k!r}")
    names = [deepspeed.type_name(mu, u) for u in range(len(mu.units))]
    return deepspeed.split_of_parts(deepspeed.parts_for_method(method, weights, names, k))


def source_framework(source: str) -> str:
    """The framework a `--split-from` source is read as (`split_from_source`): `deepspeed:K[:METHOD]` and a .json are
    DeepSpeed's, a .toml torchtitan's, anything else Megatron-LM's arguments."""
    if source.startswith("deepspeed:") or source.endswith(".json"):
        return "deepspeed"
    return "torchtitan" if source.endswith(".toml") else "megatron"


def split_from_source(source: str, names: Sequence[str], param_counts: Sequence[float]) -> UserSplit:
    """`--split-from`: a framework's settings as the split that framework would build (ValueError: why not)."""
    has = (lambda i: param_counts[i] > 0)
    mu = model_units(names, has)
    unit_weights = [sum(param_counts[i] for i in unit.layers) for unit in mu.units]
    schedule = None
    try:
        framework = source_framework(source)
        if source.startswith("deepspeed:"):
            _, k, *rest = source.split(":", 2)  # deepspeed:K is DeepSpeed's default, "parameters"
            method = rest[0] if rest else "parameters"
            split, chunks = _deepspeed({"num_stages": k, "partition_method": method}, mu, unit_weights), 1
        elif framework == "torchtitan":
            split, chunks, schedule = _torchtitan(_toml(_read(source)), mu)
        elif framework == "deepspeed":
            _read(source)  # exists and is small
            doc = read_json(source, "DeepSpeed JSON")  # bounded nesting: a UserError naming the file
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object with num_stages and partition_method")
            split, chunks = _deepspeed(doc, mu, unit_weights), 1
        else:
            split, chunks = megatron.split_from_args(_read(source), mu)
        return UserSplit(assignment_from_units(mu, split), chunks, f"--split-from {source}", schedule)
    except Inexpressible as e:
        raise ValueError(str(e)) from None
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"cannot read it ({type(e).__name__}: {e})") from None
