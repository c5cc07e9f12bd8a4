"""BERT-large as DeepLearningExamples pre-trains it (dle_bert.py), phase 2's sequence length 512."""

from __future__ import annotations

from dle_bert import build_dle_bert, model_file_functions

example_inputs, example_target, loss_fn = model_file_functions(seq_len=512)


def build_bert_large():
    return build_dle_bert("bert-large.json")
