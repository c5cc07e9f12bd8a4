"""BERT-large pre-training as NVIDIA DeepLearningExamples' PyTorch BERT ran it for the tables the nvidia-dle-bert
rows quote (pytorch:21.11-py3 container; PyTorch/LanguageModeling/BERT at a9e2c1d5, where the tables appear, and
a07d20a1, where they were last edited; the code the README's run_pretraining.sh runs there).

What it computes differently from transformers' BertLMHeadModel, which these rows were traced from before:
- The MLM head runs on the masked positions only (`dense_sequence_output`, on by default: run_pretraining.py
  `--no_dense_sequence_output` default False; modeling.py `BertForPreTraining.forward`:
  `torch.index_select(sequence_output.view(-1, hidden), 0, torch.nonzero(masked_lm_labels.view(-1) != -1)...)`
  before `self.predictions`). LDDL, its data loader, masks `max(1, round(tokens x 0.15))` positions a sequence
  (lddl/dask/bert/pretrain.py, masked_lm_ratio 0.15): 19 of 128 tokens, 77 of 512. The head (its 1024 x 1024
  transform, GELU, layer norm and the 1024 x 30528 decoder, tied to the word embeddings) is ~12% of the
  model's FLOPs on every token; on the masked ones, under 2%.
- Attention unfused: modeling.py computes `torch.bmm(query, key)`, divides by sqrt(d), adds the -10000 mask,
  `F.softmax`, dropout and `torch.bmm` with the values (no fmha, unpad or flash path in the BERT code there).
  transformers' "eager" BERT attention is that sequence, so the score matrix is written and read as DLE did.
- The next-sentence head on the pooled [CLS] output (`seq_relationship`, Linear(1024, 2)), as BertForPreTraining.
Kept as transformers builds it: the encoder layers' ops (DLE fuses bias + GELU with TorchScript/NVFuser: a few
passes over (batch, seq, hidden) a layer, beside the GEMMs).

Not modelled here: phase 2's sequence binning (cases.yaml, the nvidia-dle-bert source's notes). Its rows are
traced at 512 tokens a sequence and scaled by LDDL's published speed-up from binning (`binned_speedup`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
MASKED_LM_RATIO = 0.15  # LDDL's masked_lm_ratio (lddl/dask/bert/pretrain.py)


def masked_per_sequence(seq_len: int) -> int:
    """Positions LDDL masks in a sequence of `seq_len` tokens: max(1, round(seq_len x 0.15)) (pretrain.py L174)."""
    return max(1, int(round(seq_len * MASKED_LM_RATIO)))


class DLEBertForPreTraining(torch.nn.Module):
    """BertModel + the pre-training heads, the MLM head on `masked_per_sequence` positions of each sequence."""

    def __init__(self, config: Any) -> None:
        from transformers.models.bert.modeling_bert import BertModel, BertPreTrainingHeads

        super().__init__()
        self.bert = BertModel(config)  # with its pooler, as DLE's
        self.cls = BertPreTrainingHeads(config)
        head = self.cls.predictions  # decoder tied to the word embeddings, its bias the head's, as in DLE
        head.decoder.weight, head.decoder.bias = self.bert.embeddings.word_embeddings.weight, head.bias

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        seq, pooled = out.last_hidden_state, out.pooler_output
        b, s, h = seq.shape
        k = masked_per_sequence(s)
        # which positions does not change the cost; spread over the sequence as a mask would be
        rows = torch.ones(b, 1, dtype=torch.long, device=seq.device).cumsum(0) - 1
        at = rows * s + torch.arange(k, device=seq.device) * (s // k)
        dense = seq.reshape(b * s, h).index_select(0, at.reshape(-1))
        return self.cls.predictions(dense), self.cls.seq_relationship(pooled)


def build_dle_bert(config: str = "bert-large.json") -> torch.nn.Module:
    """The model of a BERT config.json beside this file, read and checked as `trace` reads one, eager attention."""
    from pipeplan.costmodels.hf_config import make_config, read_config_dict

    path = str(HERE / config)
    bert = make_config(path, read_config_dict(path))
    bert._attn_implementation = "eager"
    bert.is_decoder = False
    return DLEBertForPreTraining(bert)


def model_file_functions(seq_len: int, vocab: int = 30528) -> tuple[Any, Any, Any]:
    """The model-file protocol's (example_inputs, example_target, loss_fn) at `seq_len`: token ids and an all-ones
    attention mask; masked-token labels and next-sentence labels; DLE's BertPretrainingCriterion (the two
    cross-entropies summed)."""
    def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return ids, torch.ones(batch_size, seq_len, dtype=torch.long)

    def example_target(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        k = masked_per_sequence(seq_len)
        return (torch.randint(0, vocab, (batch_size * k,), generator=g),
                torch.randint(0, 2, (batch_size,), generator=g))

    def loss_fn(output: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mlm, nsp = output
        return F.cross_entropy(mlm.float(), target[0]) + F.cross_entropy(nsp.float(), target[1])

    return example_inputs, example_target, loss_fn
