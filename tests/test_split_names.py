"""Layer names read as framework units, cuts moved to block boundaries, and the shipped framework defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.planner.frameworks.names import Inexpressible, model_units, nearest_unit_split, unit_split
from pipeplan.planner.frameworks.split import split_from_source

DATA = Path(__file__).parent / "data" / "frameworks"
LLAMA8B = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(32)), "model.norm", "lm_head"]
PARAMS = [525.3e6, 0.0, *([218.1e6] * 32), 4096.0, 525.3e6]  # Llama-3 8B: 128256 x 4096 embedding and head


def test_gpt2_names():
    names = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
             "transformer.ln_f", "lm_head"]
    mu = model_units(names)
    assert mu.block_prefix == "transformer.h"
    assert [(u.key, u.kind, u.layers) for u in mu.units] == [
        ("embed", "embed", (0, 1, 2)), ("block.0", "block", (3,)), ("block.1", "block", (4,)),
        ("transformer.ln_f", "norm", (5,)), ("lm_head", "head", (6,))]
    assert mu.neutral == {2}


def test_a_weightless_layer_is_placed_freely_but_a_weighted_one_is_not():
    mu = model_units(LLAMA8B)
    embed_alone = [0] + [1] * 35  # the rotary layer on stage 1 with the blocks: fine, frameworks recompute it
    assert unit_split(mu, embed_alone)[0] == [0]
    with pytest.raises(Inexpressible, match="inside decoder block"):
        halves = model_units(["e", "b.0.a", "b.0.m", "b.1.a", "b.1.m", "norm", "lm_head"])
        unit_split(halves, [0, 0, 0, 0, 1, 1, 1])


def test_nearest_moves_each_cut_to_the_closer_block_boundary():
    names = ["e", *(f"b.{i}.{p}" for i in range(3) for p in ("a", "m", "x")), "norm", "lm_head"]
    mu = model_units(names)
    # stage 1 starts at b.0.x (2 layers into block 0, 1 from its end): to block 1; stage 2 at b.2.m (1 in): to block 2
    stage = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert nearest_unit_split(mu, stage) == [[0, 1], [2], [3, 4, 5]]


def test_blocks_must_be_one_numbered_run():
    with pytest.raises(Inexpressible, match="lies between the blocks"):
        model_units(["e", "layers.0", "glue", "layers.1", "head"])
    with pytest.raises(Inexpressible, match="not numbered 0..1"):
        model_units(["e", "layers.1", "layers.0", "head"])


@pytest.mark.parametrize("source, blocks", [
    ("torchtitan-default.toml", [8, 9, 8, 7]),  # 34 effective layers: 9, 9, 8, 8; tok_embeddings and norm+output count 1
    ("megatron-default.args", [8, 8, 8, 8]),
    ("deepspeed-parameters.json", None),
])
def test_shipped_framework_defaults(source, blocks):
    got = split_from_source(str(DATA / source), LLAMA8B, PARAMS)
    counts = [sum(1 for i, s in enumerate(got.assignment) if s == k and LLAMA8B[i].startswith("model.layers."))
              for k in range(4)]
    if blocks is not None:
        assert counts == blocks
    else:  # DeepSpeed 'parameters' on 35 entries: brute force of its objective (heaviest - lightest part)
        units = [PARAMS[0], *PARAMS[2:]]
        best = min(((a, b, c) for a in range(1, 33) for b in range(a + 1, 34) for c in range(b + 1, 35)),
                   key=lambda cut: _spread(units, cut))
        parts = [0, *best, 35]
        assert counts == [sum(1 for u in range(parts[k], parts[k + 1]) if 1 <= u <= 32) for k in range(4)]


def _spread(units, cut):
    bounds = [0, *cut, len(units)]
    sums = [sum(units[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return max(sums) - min(sums)
