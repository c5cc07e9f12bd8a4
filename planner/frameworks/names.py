"""pipeplan layer names as the units training frameworks cut a model into.

torchtitan, Megatron-LM and DeepSpeed do not split a model at arbitrary modules:
they place whole decoder blocks and the few modules around them (torchtitan:
`tok_embeddings`, `layers.N`, `norm`, `lm_head`; Megatron: embedding `E`,
decoder layer `t`, loss `L` = final norm + output layer; DeepSpeed: one entry of
the `PipelineModule` layer list each). A pipeplan graph may be finer (one layer
per leaf module), so a plan is first read as a split of *units*:

- the pre-block layers with parameters form one `embed` unit (a token embedding,
  plus a learned position embedding where the model has one: Megatron's
  `LanguageModelEmbedding` holds both);
- `block.N` is every layer named `<prefix>.N` or `<prefix>.N.*`, where `<prefix>`
  is the module list with the most numbered children (`model.layers` for
  Hugging Face Llama, `transformer.h` for GPT-2);
- each post-block layer with parameters is its own unit (`norm`, `head`, other).

Layers without parameters outside the blocks (Llama's `rotary_emb`, GPT-2's
`drop`) are *neutral*: every framework recomputes them wherever it needs them,
so where a plan puts them constrains nothing. They are attached to the next unit
before the blocks and to the previous one after them. Whether a layer has
parameters is known from the graph; from a plan file alone (export) it is read
from the name (`NEUTRAL_NAMES`), which is what the frameworks name them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Unit", "ModelUnits", "Inexpressible", "model_units", "unit_split", "nearest_unit_split",
           "assignment_from_units", "NEUTRAL_NAMES", "neutral_by_name"]

UnitKind = Literal["embed", "block", "norm", "head", "other"]

# Last name components of weightless modules outside the blocks (HF Llama/Mistral/Qwen `rotary_emb`, GPT-2 `drop`).
NEUTRAL_NAMES = frozenset({"rotary_emb", "rotary", "rope", "drop", "dropout", "emb_dropout", "pos_drop",
                           "embedding_dropout"})
_NORM = re.compile(r"(^|\.)(norm|ln_f|final_layernorm|final_layer_norm|final_norm|layernorm|norm_f)$")
_HEAD = re.compile(r"(^|\.)(lm_head|output|output_layer|head|embed_out)$")
_NUMBERED = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)(?:\.|$)")


class Inexpressible(Exception):
    """A split a framework cannot express; `str()` says exactly why (the CLI makes it a user error)."""


@dataclass(frozen=True)
class Unit:
    key: str  # "embed", "block.N", or the post-block layer's name
    kind: UnitKind
    layers: tuple[int, ...]  # indices of the pipeplan layers it stands for, neutral ones attached included
    block: int | None = None  # N for block.N


@dataclass(frozen=True)
class ModelUnits:
    layer_names: tuple[str, ...]
    block_prefix: str  # "" when the names show no numbered module list
    units: tuple[Unit, ...]
    neutral: frozenset[int]  # layer indices whose stage no framework fixes

    @property
    def blocks(self) -> int:
        return sum(1 for u in self.units if u.kind == "block")

    def unit_of_layer(self) -> list[int]:
        out = [0] * len(self.layer_names)
        for u, unit in enumerate(self.units):
            for i in unit.layers:
                out[i] = u
        return out

    def index_of(self, key: str) -> int:
        for u, unit in enumerate(self.units):
            if unit.key == key:
                return u
        raise KeyError(key)


def neutral_by_name(name: str) -> bool:
    """A weightless helper module, judged from its name alone (plan files carry no parameter counts)."""
    return name.rsplit(".", 1)[-1] in NEUTRAL_NAMES


def _block_prefix(names: Sequence[str]) -> str:
    """The dotted module list with the most distinct numbered children ("" when none has two)."""
    seen: dict[str, set[int]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            seen.setdefault(m["prefix"], set()).add(int(m["index"]))
    if not seen:
        return ""
    counts = Counter({p: len(ix) for p, ix in seen.items()})
    prefix, n = counts.most_common(1)[0]
    return prefix if n >= 2 else ""


def _block_index(name: str, prefix: str) -> int | None:
    if not prefix or not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _post_kind(name: str) -> UnitKind:
    if _NORM.search(name):
        return "norm"
    return "head" if _HEAD.search(name) else "other"


def model_units(names: Sequence[str], has_params: Callable[[int], bool] | None = None) -> ModelUnits:
    """The units of a model whose layers (in execution order) are `names`.

    `has_params(i)`: whether layer i owns parameters (from the graph); None judges by name.
    Raises Inexpressible when the blocks are not one contiguous, 0-numbered run.
    """
    prefix = _block_prefix(names)
    index = [_block_index(n, prefix) for n in names]
    in_block = [i for i, b in enumerate(index) if b is not None]
    if not in_block:
        return _flat_units(names)
    first, last = in_block[0], in_block[-1]
    gap = [names[i] for i in range(first, last + 1) if index[i] is None]
    if gap:
        raise Inexpressible(f"layer {gap[0]!r} lies between the blocks of {prefix!r}: no framework's block list has it")
    order = [b for b in index if b is not None]
    blocks = sorted(set(order))
    if blocks != list(range(len(blocks))) or order != sorted(order):
        raise Inexpressible(f"the blocks of {prefix!r} are not numbered 0..{len(blocks) - 1} in execution order")
    weighted = has_params or (lambda i: not neutral_by_name(names[i]))
    neutral = frozenset(i for i in [*range(first), *range(last + 1, len(names))] if not weighted(i))
    units: list[Unit] = []
    pre = [i for i in range(first) if i not in neutral]
    block_layers = {b: tuple(i for i in in_block if index[i] == b) for b in blocks}
    block_units = [Unit(f"block.{b}", "block", block_layers[b], b) for b in blocks]
    if pre:
        units.append(Unit("embed", "embed", tuple(range(first))))
    else:  # nothing weighted before the blocks: the neutral ones ride with the first block
        block_units[0] = Unit("block.0", "block", tuple(range(first)) + block_layers[0], 0)
    units += block_units
    post = [i for i in range(last + 1, len(names)) if i not in neutral]
    trailing = [i for i in range(last + 1, len(names)) if i in neutral and (not post or i < post[0])]
    units[-1] = Unit(units[-1].key, units[-1].kind, units[-1].layers + tuple(trailing), units[-1].block)
    for k, i in enumerate(post):
        stop = post[k + 1] if k + 1 < len(post) else len(names)
        units.append(Unit(names[i], _post_kind(names[i]), tuple(range(i, stop))))
    return ModelUnits(tuple(names), prefix, tuple(units), neutral)


def _flat_units(names: Sequence[str]) -> ModelUnits:
    """No numbered module list: every layer is its own unit (DeepSpeed can still place them)."""
    units = tuple(Unit(n, "other", (i,)) for i, n in enumerate(names))
    return ModelUnits(tuple(names), "", units, frozenset())


def unit_split(mu: ModelUnits, stage_of_layer: Sequence[int]) -> list[list[int]]:
    """Units per stage (unit indices, in order) of a plan; Inexpressible when a unit spans stages."""
    split: dict[int, list[int]] = {}
    for u, unit in enumerate(mu.units):
        weighted = [i for i in unit.layers if i not in mu.neutral]
        stages = sorted({stage_of_layer[i] for i in weighted})
        if len(stages) > 1:
            at = next(i for i in weighted if stage_of_layer[i] == stages[1])
            what = f"decoder block {mu.block_prefix}.{unit.block}" if unit.kind == "block" else f"unit {unit.key!r}"
            raise Inexpressible(f"stage {stages[1]} starts inside {what} (at layer {mu.layer_names[at]!r}); "
                                "the framework places whole blocks")
        split.setdefault(stages[0], []).append(u)
    count = max(stage_of_layer) + 1
    missing = [s for s in range(count) if s not in split]
    if missing:
        raise Inexpressible(f"stage {missing[0]} holds only weightless layers, which the framework does not place")
    return [split[s] for s in range(count)]


def nearest_unit_split(mu: ModelUnits, stage_of_layer: Sequence[int]) -> list[list[int]]:
    """The plan with every cut moved to the nearest unit boundary (a tie goes to the earlier one)."""
    unit_of = mu.unit_of_layer()
    n = len(stage_of_layer)
    starts = [i for i in range(1, n) if stage_of_layer[i] != stage_of_layer[i - 1]]
    cuts: list[int] = []  # unit index that starts each later stage
    for b in starts:
        unit = mu.units[unit_of[b]]
        lo, hi = min(unit.layers), max(unit.layers) + 1
        u = unit_of[b] if b - lo <= hi - b else unit_of[b] + 1
        if cuts and u <= cuts[-1] or u <= 0 or u >= len(mu.units):
            raise Inexpressible(f"moving the cut at layer {mu.layer_names[b]!r} to a block boundary empties a stage")
        cuts.append(u)
    bounds = [0, *cuts, len(mu.units)]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def assignment_from_units(mu: ModelUnits, split: Sequence[Sequence[int]]) -> list[int]:
    """Stage of every pipeplan layer for a split of units (the layers of a unit go with it)."""
    stage = [-1] * len(mu.layer_names)
    for s, units in enumerate(split):
        for u in units:
            for i in mu.units[u].layers:
                stage[i] = s
    if -1 in stage or stage != sorted(stage):
        raise Inexpressible("the split does not place every unit once, in model order")
    return stage
