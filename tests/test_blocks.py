"""Identical blocks traced once (costmodels/blocks.py), checked against the oracle: tracing every block.

Deduplicated and full traces must agree on everything but measured times: layer
names and order, nodes, parameters, FLOPs, saved/output/parameter bytes, edges,
shared parameters, inputs, notes and the fingerprint the runtime compares.
"""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from pipeplan.costmodels import blocks
from pipeplan.costmodels.export import module_paths
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure, trace

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
# bwd_weight_s, last_save_s, grad_accumulate_s: null when not timed
TIMES = ("fwd_s", "bwd_s", "bwd_weight_s", "last_save_s", "grad_accumulate_s")


def comparable(graph, autocast_in_flight=True):
    """The graph's JSON without what is measured by the clock or says how it was traced (and, with
    `autocast_in_flight` false, without the in-flight bytes under autocast: see test_small_blocks_match_full_trace)."""
    doc = graph.to_dict()
    for layer in doc["layers"]:
        for key in TIMES:
            layer.pop(key)
        for counts in layer["autocast"].values():
            if not autocast_in_flight:
                counts.pop("transient_bytes")
    doc["source"] = {k: v for k, v in doc["source"].items() if k not in ("repeats", "repeated_blocks")}
    doc["notes"] = [n for n in doc["notes"] if "cloned from them" not in n]
    return doc


def assert_same_as_full(path, entry="build_model", count=None, batch=2, fvcore_check=True, autocast_in_flight=True,
                        time_layers=True, period=None):
    deduped = trace(str(path), batch, entry=entry, repeats=1, fvcore_check=fvcore_check, time_layers=time_layers)
    full = trace(str(path), batch, entry=entry, repeats=1, fvcore_check=fvcore_check, repeated_blocks=False,
                 time_layers=time_layers)
    record = deduped.source.get("repeated_blocks")
    assert record is not None and record["traced"] == blocks.TRACED, deduped.notes
    if count is not None:
        assert record["count"] == count
    assert record.get("period", 1) == (period or 1)
    assert "repeated_blocks" not in full.source
    assert any(("identical blocks" if period is None else f"a group of {period}") in n and "cloned" in n
               for n in deduped.notes)
    a, b = comparable(deduped, autocast_in_flight), comparable(full, autocast_in_flight)
    assert [x["name"] for x in a["layers"]] == [x["name"] for x in b["layers"]]
    assert a["edges"] == b["edges"]
    assert a == b
    assert deduped.fingerprint() == full.fingerprint()
    # The runtime re-exports the whole model and compares this fingerprint.
    spec = load_model_file(str(path), entry)
    assert export_structure(spec, batch)[1].fingerprint() == deduped.fingerprint()
    # Layers of cloned blocks carry the traced copies' times.
    assert all(x.fwd_s > 0 for x in deduped.layers if x.fwd_flops > 0) or not time_layers
    return deduped


# ---- the signature ----------------------------------------------------------------------------

class Attn(nn.Module):
    def __init__(self, width, layer_idx, window=None, approximate="tanh"):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = window
        self.proj = nn.Linear(width, width)
        # a function object made anew in every block, as transformers' GELUTanh makes its `act`
        self.act = functools.partial(torch.nn.functional.gelu, approximate=approximate)


class Layer(nn.Module):
    def __init__(self, width=8, layer_idx=0, window=None, dtype=torch.float32):
        super().__init__()
        self.attn = Attn(width, layer_idx, window)
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.register_buffer("scale", torch.ones(width))


def test_signature_ignores_the_block_index_only():
    sig = blocks.module_signature
    assert sig(Layer(layer_idx=0)) == sig(Layer(layer_idx=7))
    assert sig(Layer()) != sig(Layer(width=16))
    assert sig(Layer()) != sig(Layer(window=4096))  # e.g. sliding-window layers between full-attention ones
    assert sig(Layer()) != sig(Layer(dtype=torch.float64))
    frozen = Layer()
    frozen.norm.weight.requires_grad_(False)
    assert sig(Layer()) != sig(frozen)
    renamed = Layer()
    renamed.attn.other_count = 3  # an integer that is not named like an index
    assert sig(Layer()) != sig(renamed)
    evaluating = Layer().eval()
    assert sig(Layer()) != sig(evaluating)
    exact = Layer()
    exact.attn.act = functools.partial(torch.nn.functional.gelu, approximate="none")
    assert sig(Layer()) != sig(exact)
    other = Layer()
    other.attn.act = functools.partial(torch.nn.functional.silu)
    assert sig(Layer()) != sig(other)


class Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))  # more children, far fewer modules


def test_find_repeated_blocks():
    found = blocks.find_repeated_blocks(Model([Layer(layer_idx=i) for i in range(6)]))
    assert found is not None and (found.module, found.count) == ("layers", 6)
    # Too few blocks to be worth it: the other list wins.
    small = blocks.find_repeated_blocks(Model([Layer() for _ in range(3)]))
    assert small is not None and small.module == "small"
    # One different block: not grouped.
    odd = [Layer(window=4 if i == 4 else None) for i in range(6)]
    assert blocks.find_repeated_blocks(Model(odd)).module == "small"
    # Every second block different: a group of two, when there are at least 4 groups; the rest after them counts.
    for n, found_module, period in ((8, "layers", 2), (9, "layers", 2), (7, "small", 1)):
        alternating = blocks.find_repeated_blocks(Model([Layer(window=4 if i % 2 else None) for i in range(n)]))
        assert (alternating.module, alternating.period) == (found_module, period), n
    found = blocks.find_repeated_blocks(Model([Layer(window=4 if i % 2 else None) for i in range(9)]))
    assert (found.count, found.groups, found.rest) == (9, 4, 1)
    # A pattern that breaks off: not grouped.
    broken = [Layer(window=4 if i % 2 and i != 5 else None) for i in range(10)]
    assert blocks.find_repeated_blocks(Model(broken)).module == "small"
    # Weights tied between blocks: not grouped.
    tied = [Layer() for _ in range(6)]
    tied[1].attn.proj.weight = tied[0].attn.proj.weight
    assert blocks.find_repeated_blocks(Model(tied)).module == "small"
    assert blocks.find_repeated_blocks(nn.Sequential(nn.Linear(2, 2))) is None


def test_shortened_restores_the_list():
    model = Model([Layer(layer_idx=i) for i in range(6)])
    repeat = blocks.find_repeated_blocks(model)
    names = [n for n, _ in model.named_parameters()]
    with blocks.shortened(model, repeat):
        assert len(model.layers) == blocks.TRACED
        assert [b.attn.layer_idx for b in model.layers] == [0, 1, 2]
        assert not any(n.startswith("layers.3.") for n, _ in model.named_parameters())
    assert len(model.layers) == 6 and [n for n, _ in model.named_parameters()] == names
    # Groups of two and one block more: three groups, then the rest under its own key.
    model = Model([Layer(layer_idx=i, window=4 if i % 2 else None) for i in range(11)])
    with blocks.shortened(model, blocks.find_repeated_blocks(model)):
        assert [b.attn.layer_idx for b in model.layers] == [0, 1, 2, 3, 4, 5, 10]
        assert list(model.layers._modules) == ["0", "1", "2", "3", "4", "5", "10"]
    assert len(model.layers) == 11


# ---- the oracle: the full trace ----------------------------------------------------------------

@pytest.mark.parametrize("entry", ["build_model", "build_hidden"])
def test_small_blocks_match_full_trace(entry):
    """A known limit of cloning: where every block's output also leaves the model (build_hidden), under autocast
    the next block saves a 16-bit copy of it, not it, so the fp32 outputs of all earlier blocks are in flight and
    a later block's in-flight bytes grow with its index, which a clone of a traced block does not (1.5 KB a block
    here); in fp32 the next block saves the output itself and every block holds the same."""
    assert_same_as_full(DATA / "blocks_models.py", entry, count=6, autocast_in_flight=entry != "build_hidden")


def test_gpt_tiny_has_too_few_blocks():
    graph = trace(str(ROOT / "examples" / "gpt.py"), 2, repeats=1, fvcore_check=False)
    assert "repeated_blocks" not in graph.source  # 2 blocks: traced as they are


@pytest.mark.slow
def test_gpt2_small_matches_full_trace(monkeypatch):
    monkeypatch.setenv("PIPEPLAN_GPT_SEQ", "16")  # GPT-2 small's 12 blocks and 124M parameters, short sequences
    # without weights, as a catalogue profile traces it (the timed path is the smaller models' above)
    graph = assert_same_as_full(ROOT / "examples" / "gpt.py", "build_gpt2_small", count=12, batch=1,
                                fvcore_check=False, time_layers=False)
    assert len([x for x in graph.layers if x.name.startswith("h.11.")]) == 8
    assert graph.shared_params[0].layers == ["wte", "lm_head"]


@needs_hf
def test_hf_gpt2_matches_full_trace():
    assert_same_as_full(DATA / "blocks_hf_gpt2.py", count=6)


@needs_hf
def test_hf_llama_matches_full_trace():
    graph = assert_same_as_full(DATA / "blocks_llama.py", count=6)
    # Every decoder layer reads the rotary embedding computed once before the blocks.
    assert sum(1 for e in graph.edges if e.src == "model.rotary_emb") >= 6


@needs_hf
def test_hf_bert_matches_full_trace():
    """The last block's layer holds a view the middle ones lack (the head's slice of its output, `alias`)."""
    graph = assert_same_as_full(DATA / "blocks_hf_bert.py", count=6)
    last_norm = graph.layer("bert.encoder.layer.5.output.LayerNorm")
    assert "alias" in last_norm.nodes
    assert not any("alias" in graph.layer(f"bert.encoder.layer.{i}.output.LayerNorm").nodes for i in range(5))


@needs_hf
def test_hf_gemma_matches_full_trace():
    """Every layer's activation holds a `functools.partial` of its own (transformers' GELUTanh)."""
    assert_same_as_full(DATA / "blocks_hf_gemma.py", count=6)


@pytest.mark.parametrize(("path", "entry"), [
    (DATA / "blocks_models.py", "build_model"),
    (DATA / "blocks_models.py", "build_alternating"),  # groups of 2
    (DATA / "blocks_models.py", "build_grouped_rest"),  # groups of 3, then 2 blocks more
    pytest.param(DATA / "blocks_llama.py", "build_model", marks=needs_hf),
    pytest.param(DATA / "blocks_hf_gemma3.py", "build_model", marks=needs_hf),  # groups of 2, then 1 more
])
def test_fvcore_counts_of_the_traced_blocks_expand_to_the_whole_models(path, entry, monkeypatch):
    """fvcore run on the model cut to its traced groups, its counts cloned (blocks.expand_module_counts), gives
    every module's count that fvcore run on the whole model gives: the cross-check no longer jit-traces every
    block of a large model (costmodels/fvcheck.py)."""
    from pipeplan.costmodels import fvcheck

    spec = load_model_file(str(path), entry)
    repeat = blocks.find_repeated_blocks(spec.build_on_meta())
    assert repeat is not None
    (whole, _), _ = fvcheck._fvcore_counts(spec, None)
    expanded = []  # what fvcore counted on the cut model (it falls back to the whole one where that fails)
    monkeypatch.setattr(fvcheck, "expand_module_counts",
                        lambda counts, r: expanded.append(counts) or blocks.expand_module_counts(counts, r))
    (cut, _), _ = fvcheck._fvcore_counts(spec, None, repeat)
    assert len(expanded) == 1 and len(expanded[0]) < len(whole)
    assert len(whole) > 3 * repeat.count  # every block's modules, and the list's holders
    assert cut == whole


@pytest.mark.parametrize(("entry", "count", "period"), [("build_alternating", 8, 2), ("build_grouped_rest", 14, 3)])
def test_blocks_that_repeat_in_groups_match_full_trace(entry, count, period):
    """Blocks that differ by a rule of their position: a group repeated (every second block, every third); the
    groups of three end in two blocks more (the start of another group), traced as they are."""
    graph = assert_same_as_full(DATA / "blocks_models.py", entry, count=count, period=period)
    assert len(graph.layers) == 2 + 3 * count
    plain = len(graph.layer("blocks.0.up").nodes)
    with_window = [i for i in range(count) if len(graph.layer(f"blocks.{i}.up").nodes) > plain]  # the `h * 0.5`
    assert with_window == [i for i in range(count) if i % period == period - 1]


@needs_hf
def test_hf_gemma3_alternating_attention_matches_full_trace():
    """Sliding-window and full attention layer by layer (transformers' `layer_types`), 9 layers: 4 groups of 2 and
    one more. Traced without weights (the timed path is the small models' above)."""
    graph = assert_same_as_full(DATA / "blocks_hf_gemma3.py", count=9, period=2, time_layers=False, fvcore_check=False)
    assert graph.source["repeated_blocks"] == {"module": "model.layers", "count": 9, "traced": 3, "period": 2}


def test_code_after_the_loop_ends_the_last_block():
    """A masked mean after the block loop, in the root module's forward: export folds it into the last block's
    last layer, so the last traced copy has ops the middle one lacks; they are code after the loop (the module they
    ran under says so), and the unrolled graph is the whole model's."""
    graph = assert_same_as_full(DATA / "blocks_models.py", "build_pooled", count=6)
    last, middle = graph.layer("blocks.5.down"), graph.layer("blocks.4.down")
    assert len(last.nodes) > len(middle.nodes) and last.bytes_moved > middle.bytes_moved


# ---- when it must not deduplicate ------------------------------------------------------------

@pytest.mark.parametrize("entry", ["build_wider", "build_window"])
def test_different_blocks_are_traced_whole(entry):
    graph = trace(str(DATA / "blocks_models.py"), 2, entry=entry, repeats=1, fvcore_check=False)
    assert "repeated_blocks" not in graph.source
    assert not any("identical blocks" in n for n in graph.notes)
    assert {x.name for x in graph.layers} >= {f"blocks.{i}.up" for i in range(6)}


@pytest.mark.parametrize(("entry", "why"), [("build_counted", "IndexError"), ("build_stacked", "differ")])
def test_falls_back_with_a_note(entry, why):
    path = str(DATA / "blocks_models.py")
    graph = trace(path, 2, entry=entry, repeats=1, fvcore_check=False)
    assert "repeated_blocks" not in graph.source
    note = next(n for n in graph.notes if "identical blocks" in n)
    assert "the whole model was traced" in note and why in note
    full = trace(path, 2, entry=entry, repeats=1, fvcore_check=False, repeated_blocks=False)
    assert graph.fingerprint() == full.fingerprint() and len(graph.layers) == len(full.layers)


def test_expand_refuses_copies_that_differ():
    spec = load_model_file(str(DATA / "blocks_models.py"))
    model = spec.build()
    repeat = blocks.find_repeated_blocks(model)
    with blocks.shortened(model, repeat):
        _, graph = export_structure(spec, 2, model=model)
    assert len(blocks.expand(graph, repeat).layers) == len(graph.layers) + 3 * 3  # 3 layers a block
    graph.layers[-2].bytes_moved += 1  # the third copy's last layer no longer matches the second's
    with pytest.raises(blocks.NotRepeated, match="bytes_moved"):
        blocks.expand(graph, repeat)


def _shortened_program(entry: str):
    """The traced copies of `entry`'s blocks: (graph, repeat, module paths of its nodes)."""
    spec = load_model_file(str(DATA / "blocks_models.py"), entry)
    model = spec.build()
    repeat = blocks.find_repeated_blocks(model)
    with blocks.shortened(model, repeat):
        ep, graph = export_structure(spec, 2, model=model)
    return graph, repeat, module_paths(ep)


def test_code_after_the_loop_is_told_apart_by_the_module_its_ops_ran_under():
    """Ops that only the last copy's last layer has: code after the loop when they ran outside every block
    (build_pooled), a block that differs when the third block ran them itself (build_halved_late: blocks from
    index 2 on halve their output, the same attributes, other ops). Without the modules the first is refused too."""
    graph, repeat, module_of = _shortened_program("build_pooled")
    assert len(blocks.expand(graph, repeat, module_of).layers) == len(graph.layers) + 3 * 3
    with pytest.raises(blocks.NotRepeated, match="op count"):
        blocks.expand(graph, repeat)
    graph, repeat, module_of = _shortened_program("build_halved_late")
    with pytest.raises(blocks.NotRepeated, match="op count"):
        blocks.expand(graph, repeat, module_of)


def test_expand_refuses_a_hole_in_the_names_after_the_blocks():
    """An op kind the blocks do not show, numbered after them as if the blocks had used some of its names."""
    spec = load_model_file(str(DATA / "blocks_models.py"))
    model = spec.build()
    repeat = blocks.find_repeated_blocks(model)
    with blocks.shortened(model, repeat):
        _, graph = export_structure(spec, 2, model=model)
    graph.layers[-1].nodes.append("sigmoid_1")  # no `sigmoid` anywhere before it
    with pytest.raises(blocks.NotRepeated, match="skips names"):
        blocks.expand(graph, repeat)


# ---- one layer per block for very large models ------------------------------------------------------------------


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_large_models_are_traced_one_layer_per_block(monkeypatch):
    """Above MAX_LEAF_LAYERS leaf modules, a model with repeated blocks gets one layer per block, at a depth that
    is recorded, so re-exporting at that depth (what the runtime does) gives the same graph and fingerprint."""
    path = str(DATA / "blocks_llama.py")
    model = load_model_file(path).build()
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    assert blocks.coarse_depth(model) is None  # small: leaf layers, as every bundled example
    assert blocks.coarse_depth(model, max_leaf_layers=leaves - 1)[0] == 2  # model(1) > layers (ModuleList) > 0 (2)

    monkeypatch.setattr(blocks, "MAX_LEAF_LAYERS", leaves - 1)
    g = trace(path, 2, repeats=1, fvcore_check=False, time_layers=False)
    assert g.source["depth"] == 2 and any("one layer per block of model.layers" in n for n in g.notes)
    names = [layer.name for layer in g.layers]
    assert [n for n in names if n.startswith("model.layers.")] == [f"model.layers.{i}" for i in range(6)]
    assert len(names) < leaves
    explicit = trace(path, 2, depth=2, repeats=1, fvcore_check=False, time_layers=False)  # --depth 2 by hand
    auto = comparable(g)
    auto["notes"] = [n for n in auto["notes"] if "leaf modules" not in n]  # the one difference: it says why
    assert auto == comparable(explicit) and g.fingerprint() == explicit.fingerprint()
    _, runtime_graph = export_structure(load_model_file(path), 2, depth=g.source["depth"])  # as the runtime does
    assert runtime_graph.fingerprint() == g.fingerprint()
    # an explicit --depth wins over the automatic one
    assert trace(path, 2, depth=1, repeats=1, fvcore_check=False, time_layers=False).source["depth"] == 1
