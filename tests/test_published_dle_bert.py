"""The published table's DeepLearningExamples BERT rows: BERT-large as its run_pretraining.py trained it
(benchmarks/published/dle_bert.py): the MLM head on the masked positions only, attention unfused, the NSP head.
Held against transformers' own BertForPreTraining (same weights) and the head's FLOP formula."""

import json
import sys
from pathlib import Path

import pytest
import torch

PUBLISHED = Path(__file__).resolve().parent.parent / "benchmarks" / "published"
sys.path[:0] = [str(PUBLISHED), str(PUBLISHED.parent)]

import dle_bert  # noqa: E402
import published_bench  # noqa: E402

TINY = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1}
SEQ = 40  # masks round(40 x 0.15) = 6 positions a sequence


def _tiny_config():
    from transformers import BertConfig

    config = BertConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    config._attn_implementation = "eager"
    return config


def test_lddls_mask_count_is_fifteen_percent_of_the_tokens_rounded():
    assert [dle_bert.masked_per_sequence(n) for n in (128, 512, 40, 3)] == [19, 77, 6, 1]


def test_the_model_is_transformers_bert_for_pretraining_with_the_mlm_head_on_the_masked_positions():
    """Same weights in transformers' BertForPreTraining (its MLM head on every token): ours must give its
    prediction scores at the positions it picks, in order, and the same next-sentence scores."""
    from transformers import BertForPreTraining

    torch.manual_seed(0)
    ours = dle_bert.DLEBertForPreTraining(_tiny_config()).eval()
    theirs = BertForPreTraining(_tiny_config()).eval()
    theirs.load_state_dict(ours.state_dict())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    ids = torch.randint(0, TINY["vocab_size"], (3, SEQ))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        mlm, nsp = ours(ids, mask)
        ref = theirs(input_ids=ids, attention_mask=mask)
    k = dle_bert.masked_per_sequence(SEQ)
    picked = ref.prediction_logits[:, torch.arange(k) * (SEQ // k), :].reshape(3 * k, -1)
    torch.testing.assert_close(mlm, picked)
    torch.testing.assert_close(nsp, ref.seq_relationship_logits)


def test_the_head_on_masked_positions_saves_its_flops_on_the_others():
    """Forward FLOPs (torch's FlopCounterMode, not pipeplan's tracer): transformers' model minus ours is the MLM
    head's transform (h x h) and decoder (h x V) on the SEQ - k unmasked positions, 2 FLOPs a multiply-add."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertForPreTraining

    def forward_flops(model, *args, **kwargs):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(*args, **kwargs)
        return counter.get_total_flops()

    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ))
    mask = torch.ones_like(ids)
    ours = forward_flops(dle_bert.DLEBertForPreTraining(_tiny_config()).eval(), ids, mask)
    theirs = forward_flops(BertForPreTraining(_tiny_config()).eval(), input_ids=ids, attention_mask=mask)
    h, v, k = TINY["hidden_size"], TINY["vocab_size"], dle_bert.masked_per_sequence(SEQ)
    assert theirs - ours == 2 * (SEQ - k) * 2 * (h * h + h * v)


@pytest.mark.parametrize("key, seq", [("bert-large-128", 128), ("bert-large-512", 512)])
def test_the_cases_trace_bert_large_from_the_model_files_at_their_sequence_length(key, seq):
    """BERT-large as DLE's bert_config.json (vocabulary padded to 30528), on the meta device: 336,232,258
    parameters, transformers' BertForPreTraining's count for that config (computed here)."""
    from transformers import BertConfig, BertForPreTraining

    m = published_bench.load_cases()["models"][key]
    module = __import__(Path(m["model_file"]).stem)
    ids, mask = module.example_inputs(2)
    assert ids.shape == mask.shape == (2, seq) and m["seq_len"] == seq
    mlm_labels, nsp_labels = module.example_target(2)
    assert mlm_labels.shape == (2 * dle_bert.masked_per_sequence(seq),) and nsp_labels.shape == (2,)
    with torch.device("meta"):
        ours = getattr(module, m["entry"])()
        cfg = json.loads((PUBLISHED / m["config"]).read_text())
        ref = BertForPreTraining(BertConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "_comment")}))
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in ref.parameters()) == 336_232_258


def test_only_the_binned_phase_2_rows_carry_lddls_binning_speed_up():
    cases = [c for c in published_bench.load_cases()["cases"] if c["source"] == "nvidia-dle-bert"]
    assert {c["id"] for c in cases if c.get("binned_speedup")} == {c["id"] for c in cases if c["model"] == "bert-large-512"}
    assert len([c for c in cases if c["model"] == "bert-large-512"]) == 4
