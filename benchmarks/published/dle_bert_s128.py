"""BERT-large as DeepLearningExamples pre-trains it (dle_bert.py), phase 1's sequence length 128."""

from __future__ import annotations

from dle_bert import build_dle_bert, model_file_functions

example_inputs, example_target, loss_fn = model_file_functions(seq_len=128)


def build_bert_large():
    return build_dle_bert("bert-large.json")
