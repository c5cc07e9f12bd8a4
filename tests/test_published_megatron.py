"""The published table's Megatron-LM and Zero Bubble rows: GPT traced with attention as Megatron-LM's legacy model
ran it, unfused (benchmarks/published/megatron_gpt.py), held against transformers' own attention and the FLOP formula.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

PUBLISHED = Path(__file__).resolve().parent.parent / "benchmarks" / "published"
sys.path[:0] = [str(PUBLISHED), str(PUBLISHED.parent)]

import megatron_gpt  # noqa: E402
import published_bench  # noqa: E402

TINY = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32,
        "activation_function": "gelu", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
SEQ = 16


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_megatron_attention_is_causal_scaled_dot_product_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, SEQ, 8, generator=g) for _ in range(3))
    module = torch.nn.Module().eval()
    out, _ = megatron_gpt.megatron_attention(module, q, k, v, None)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_the_model_computes_what_transformers_sdpa_gpt2_computes(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    ours = megatron_gpt.build_gpt(_tiny(tmp_path)).eval()
    fields = {k: v for k, v in TINY.items() if k != "model_type"}
    theirs = GPT2LMHeadModel(GPT2Config(**fields, use_cache=False, attn_implementation="sdpa")).eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits)


def test_the_trace_writes_the_score_matrix_as_two_batched_matmuls(tmp_path):
    """Unfused: Q K^T and P V are matmul parts of 2 s^2 h FLOPs each a layer (the FLOP formula, batch 1), where the
    SDPA trace has them as one attention part; everything else is equal."""
    import pipeplan

    module_file = tmp_path / "tiny_megatron.py"
    module_file.write_text(
        "from megatron_gpt import build_gpt, model_file_functions\n"
        f"example_inputs, example_target, loss_fn = model_file_functions({str(_tiny(tmp_path))!r}, seq_len={SEQ})\n"
        f"def build_model():\n    return build_gpt({str(_tiny(tmp_path))!r})\n")
    ours = pipeplan.trace(str(module_file), 1, time_layers=False, fvcore_check=False)
    sdpa = pipeplan.trace(str(_tiny(tmp_path)), 1, time_layers=False, fvcore_check=False, seq_len=SEQ)

    def flops(graph, kind):
        return sum(p.fwd_flops for layer in graph.layers for p in layer.parts if p.kind == kind)

    per_layer = 2 * (2 * SEQ * SEQ * TINY["n_embd"])
    assert flops(ours, "attention") == 0
    assert flops(sdpa, "attention") == TINY["n_layer"] * per_layer
    assert flops(ours, "matmul") == flops(sdpa, "matmul") + TINY["n_layer"] * per_layer
    assert sum(layer.param_bytes for layer in ours.layers) == sum(layer.param_bytes for layer in sdpa.layers)


@pytest.mark.parametrize("config, named_billions", [
    ("zb-gpt-1.5b.json", 1.5), ("zb-gpt-6.2b.json", 6.2), ("zb-gpt-14.6b.json", 14.6), ("zb-gpt-28.3b.json", 28.3),
])
def test_the_zero_bubble_models_have_their_named_sizes(config, named_billions):
    """Qi et al. 2024 Table 3 names its models by size; the configs (vocabulary 32000 assumed) reproduce them."""
    with torch.device("meta"):
        model = megatron_gpt.build_gpt(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == named_billions


def test_the_cases_trace_these_rows_from_the_model_files_at_their_sequence_length():
    doc = published_bench.load_cases()
    traced = {key: m for key, m in doc["models"].items() if str(m.get("model_file", "")).startswith("megatron_gpt")}
    assert {c["source"] for c in doc["cases"] if c["model"] in traced} == {"megatron-ptdp", "zero-bubble"}
    for key, m in traced.items():
        module = __import__(Path(m["model_file"]).stem)
        assert callable(getattr(module, m["entry"])), key
        (ids,) = module.example_inputs(2)
        cfg = json.loads((PUBLISHED / m["config"]).read_text())
        assert ids.shape == (2, m["seq_len"]) and int(ids.max()) < cfg["vocab_size"], key
