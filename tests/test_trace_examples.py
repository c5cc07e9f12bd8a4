"""Tracing every bundled example, checked against independent oracles.

Oracles: parameter bytes summed over the model's unique tensors; FLOPs from one
FlopCounterMode over the whole eager model (plus the textbook attention formula
when torch has none for the CPU kernel); saved bytes from saved-tensor hooks on a
real eager step; the U-Net's skip wiring from its definition. Each example is
traced once per session (tiny configurations, one timed repeat).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.costmodels.graph import Graph, load_graph
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure, trace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BATCH = 2
NAMES = ["mlp", "resnet", "gpt", "unet", "hf_gpt2"]
HAS_HF = importlib.util.find_spec("transformers") is not None


def _param(name):
    marks = [pytest.mark.skipif(not HAS_HF, reason="transformers not installed")] if name == "hf_gpt2" else []
    return pytest.param(name, marks=marks)


EXAMPLE_PARAMS = [_param(n) for n in NAMES]
_cache: dict[str, Graph] = {}


def traced(name: str) -> Graph:
    if name not in _cache:
        _cache[name] = trace(str(EXAMPLES / f"{name}.py"), BATCH, repeats=1)
    return _cache[name]


def fresh(name: str):
    spec = load_model_file(str(EXAMPLES / f"{name}.py"))
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    return spec, model


def unique_param_bytes(model) -> int:
    seen = {}
    for p in model.parameters():  # remove_duplicate=True: a tied tensor once
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def textbook_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    """softmax(Q K^T) V: two batched matmuls, 2*b*h*s_q*s_k*d each (no causal discount)."""
    b, h, s_q, d = query_shape
    s_k = key_shape[2]
    return 2 * (2 * b * h * s_q * s_k * d)


# torch has no FLOP formula for the kernel F.scaled_dot_product_attention uses on CPU
ORACLE = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: textbook_attention_flops}
ATTENTION = {"gpt", "hf_gpt2"}


@pytest.mark.parametrize("name", EXAMPLE_PARAMS)
def test_parameter_bytes_equal_unique_tensors(name):
    g = traced(name)
    _, model = fresh(name)
    assert g.param_bytes == unique_param_bytes(model)
    assert g.totals()["param_bytes"] == g.param_bytes
    named = dict(model.named_parameters(remove_duplicate=False))
    for layer in g.layers:
        assert all(p in named for p in layer.params), layer.name
    owned = sum(named[p].numel() * 4 for l in g.layers for p in l.params)
    shared_extra = sum(s.bytes * (len(s.layers) - 1) for s in g.shared_params)
    assert owned - shared_extra == g.param_bytes  # each tensor charged once, to its first user


@pytest.mark.parametrize("name", EXAMPLE_PARAMS)
def test_forward_flops_match_flopcountermode_on_whole_model(name):
    g = traced(name)
    spec, model = fresh(name)
    with FlopCounterMode(display=False, custom_mapping=ORACLE) as fc:
        model(*spec.example_inputs(BATCH))
    expected = fc.get_total_flops()
    assert expected > 0
    assert g.fwd_flops == pytest.approx(expected, rel=0.01)
    assert g.totals()["fwd_flops"] == g.fwd_flops
    if name not in ATTENTION:  # backward: whole-step counter minus forward, exact for matmul/conv models
        spec, model = fresh(name)
        with FlopCounterMode(display=False) as fc:
            out = model(*spec.example_inputs(BATCH))
            fwd = fc.get_total_flops()
            spec.loss(out, spec.example_target(BATCH)).backward()
        assert g.bwd_flops == pytest.approx(fc.get_total_flops() - fwd, rel=0.01)
    else:
        assert 1.9 * g.fwd_flops < g.bwd_flops < 2.6 * g.fwd_flops


@pytest.mark.parametrize("name", EXAMPLE_PARAMS)
def test_saved_bytes_match_a_real_eager_step(name):
    """Unique storages autograd saves in a real eager step (parameters excluded) == the fake-tensor count."""
    g = traced(name)
    spec, model = fresh(name)
    state = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in state:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = spec.loss(model(*spec.example_inputs(BATCH)), spec.example_target(BATCH))
    assert g.peak_activation_bytes == pytest.approx(sum(seen.values()), rel=0.02)
    assert g.peak_activation_bytes == sum(l.saved_bytes for l in g.layers)
    del loss


@pytest.mark.parametrize("name", EXAMPLE_PARAMS)
def test_structure_is_a_dag_in_execution_order_covering_the_program(name):
    g = traced(name)
    spec = load_model_file(str(EXAMPLES / f"{name}.py"))
    # same structure at another batch size: the runtime re-exports at its microbatch size.
    # (Hugging Face's mask code skips an expand at batch 1, so its batch-1 program differs.)
    ep, g1 = export_structure(spec, 3 if name == "hf_gpt2" else 1)
    assert g1.fingerprint() == g.fingerprint()
    program = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    assert [n for l in g.layers for n in l.nodes] == program  # every node once, layers contiguous, in order
    assert len({l.name for l in g.layers}) == len(g.layers)
    import networkx as nx

    assert nx.is_directed_acyclic_graph(g.to_networkx())
    for e in g.edges:
        assert g.index(e.src) < g.index(e.dst)
        src = g.layer(e.src)
        assert e.bytes == sum(src.outputs[t] for t in e.tensors) > 0
    for layer in g.layers[:-1]:
        assert layer.output_bytes == sum(layer.outputs.values())
    assert g.input_bytes == sum(t.numel() * t.element_size() for t in spec.example_inputs(BATCH))
    assert set(g.inputs) and all(g.inputs.values())
    assert all(l.fwd_s >= 0 and l.bwd_s >= 0 for l in g.layers)
    assert sum(l.fwd_s + l.bwd_s for l in g.layers) > 0
    source = dict(g.source)
    blocks = source.pop("repeated_blocks", None)  # models with identical blocks: traced once (tests/test_blocks.py)
    assert blocks is None or blocks["count"] > blocks["traced"] >= 2
    assert source == {"model_file": str(EXAMPLES / f"{name}.py"), "entry": "build_model", "seq_len": None,
                      "depth": None, "batch_size": BATCH, "torch": torch.__version__, "device": "cpu", "repeats": 1,
                      "threads": torch.get_num_threads(), "timed": True, "weights": "real"}


@pytest.mark.parametrize("name", EXAMPLE_PARAMS)
def test_json_round_trip_is_exact(name, tmp_path):
    g = traced(name)
    assert Graph.from_dict(g.to_dict()) == g
    g.save(tmp_path / "g.json")
    back = load_graph(tmp_path / "g.json")
    assert back == g and back.fingerprint() == g.fingerprint()
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["format"] == "pipeplan.graph/v1"
    for key in ("name", "fwd_flops", "bwd_flops", "param_bytes", "output_bytes", "saved_bytes", "fwd_s", "bwd_s"):
        assert key in doc["layers"][0]
    assert {"param_bytes", "fwd_flops", "bwd_flops"} <= set(doc["totals"])


def test_unet_has_the_long_skip_edges():
    g = traced("unet")
    levels = load_model_file(str(EXAMPLES / "unet.py")).module.LEVELS
    bottom = g.index("bottom.conv1")
    skip_spans = []
    for level in range(levels):
        # encoder level `level` ends with act2; its output is read after the bottleneck, by the decoder
        # level that upsamples back to the same resolution (the torch.cat is folded into up.<j>)
        src = f"down.{level}.act2"
        long = [e for e in g.edges if e.src == src and g.index(e.dst) > bottom]
        assert [e.dst for e in long] == [f"up.{levels - 1 - level}"]
        assert long[0].bytes == BATCH * 8 * 2**level * (32 // 2**level) ** 2 * 4  # the whole skip tensor
        skip_spans.append(g.index(long[0].dst) - g.index(src))
    # nested skips: the outer the level, the more layers its edge spans
    assert skip_spans == sorted(skip_spans, reverse=True) and skip_spans[-1] >= 5 and skip_spans[0] >= 20
    cuts = g.cut_bytes()
    top_skip = g.layer("down.0.act2").outputs
    assert all(c >= min(top_skip.values()) for c in cuts[g.index("down.0.act2"):g.index("bottom.conv1")])


def test_gpt_tied_embedding_and_lm_head_recorded_once():
    g = traced("gpt")
    assert [(s.name, s.layers) for s in g.shared_params] == [("wte.weight", ["wte", "lm_head"])]
    s = g.shared_params[0]
    assert g.layer("wte").param_bytes == s.bytes  # owned by its first user
    assert g.layer("lm_head").param_bytes == 0
    assert "lm_head.weight" in g.layer("lm_head").params


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_hf_gpt2_tied_weights_and_layer_names():
    g = traced("hf_gpt2")
    assert [s.name for s in g.shared_params] == ["transformer.wte.weight"]
    assert g.shared_params[0].layers == ["transformer.wte", "lm_head"]
    assert g.layer("transformer.h.0.attn").kind == "attention"


def test_layer_kinds_follow_the_dominant_op():
    g = traced("gpt")
    assert g.layer("wte").kind == "embedding"
    assert g.layer("h.0.ln_1").kind == "norm"
    assert g.layer("h.0.attn.c_attn").kind == "matmul"
    assert g.layer("h.0.attn").kind == "attention"
    assert g.layer("h.0.mlp.gelu").kind == "elementwise"
    r = traced("resnet")
    assert r.layer("blocks.0.conv1").kind == "conv"
    assert r.layer("fc").kind == "matmul"


def test_residual_adds_are_folded_not_layers_of_their_own():
    g = traced("gpt")
    # GPT blocks do x + attn(...) in Block.forward: no layer is named after the block itself
    assert not any(l.name == "h.0" or l.name.startswith("h.0:") for l in g.layers)
    assert all(l.module for l in g.layers)  # no root-only glue layer either


def test_depth_groups_whole_blocks():
    spec = load_model_file(str(EXAMPLES / "gpt.py"))
    _, g = export_structure(spec, 2, depth=1)
    assert [l.name for l in g.layers] == ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    assert g.param_bytes == unique_param_bytes(spec.build())


def test_fvcore_agrees_or_the_disagreement_is_reported():
    assert traced("mlp").notes == []  # dense-only model: the two counters agree per layer
    notes = traced("gpt").notes
    assert any("fvcore does not count attention" in n for n in notes)
    assert not any("disagree" in n for n in notes)  # all matmuls agree


def test_fvcore_disagreement_names_the_layer():
    from pipeplan.costmodels import fvcheck
    from pipeplan.costmodels.export import node_kind

    g = traced("mlp")
    spec, model = fresh("mlp")
    ep, _ = export_structure(spec, BATCH, model=model)
    family = {n.name: node_kind(n) for n in ep.graph.nodes if n.op == "call_function"}
    node_flops = {n: l.fwd_flops for l in g.layers for n in l.nodes if family[n] == "matmul"}
    assert fvcheck.compare(spec, g, BATCH, node_flops, family, model) == []
    # layer "4" is the third Linear (512 -> 4096): pretend FlopCounterMode saw 1.5x its FLOPs
    node_flops[g.layer("4").nodes[0]] = int(1.5 * node_flops[g.layer("4").nodes[0]])
    g.layer("4").fwd_flops = node_flops[g.layer("4").nodes[0]]
    notes = fvcheck.compare(spec, g, BATCH, node_flops, family, model)
    assert len(notes) == 2
    assert notes[0].startswith("FLOPs disagree with fvcore on 1 layer(s)") and "4 " in notes[0]
    assert f"fvcore {2 * BATCH * 512 * 4096:.4g}" in notes[0]
    assert notes[1].startswith("total matmul/conv forward FLOPs disagree")
    _cache.pop("mlp")  # the cached graph was modified


def test_mlp_edges_carry_each_activation():
    g = traced("mlp")
    widths = load_model_file(str(EXAMPLES / "mlp.py")).module.WIDTHS
    # Linear i -> ReLU -> Linear i+1: every edge carries one batch x width fp32 activation
    expected = [BATCH * w * 4 for w in widths[1:-1] for _ in (0, 1)]
    assert [(e.src, e.dst) for e in g.edges] == [(str(i), str(i + 1)) for i in range(len(g.layers) - 1)]
    assert [e.bytes for e in g.edges] == expected
    assert g.cut_bytes() == expected
    assert g.layer("12").outputs == {g.layer("12").nodes[-1]: BATCH * widths[-1] * 4}  # the model output
