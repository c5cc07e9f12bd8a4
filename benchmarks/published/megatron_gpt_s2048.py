"""Megatron-LM's GPT of Narayanan et al. 2021 (Table 1), sequence 2048, vocabulary 51,200: attention unfused.

See megatron_gpt.py for why these rows are traced from this file rather than from their config.json.
"""

from __future__ import annotations

from megatron_gpt import build_gpt, model_file_functions

example_inputs, example_target, loss_fn = model_file_functions("megatron-gpt-1.7b.json", seq_len=2048)


def build_megatron_1_7b():
    return build_gpt("megatron-gpt-1.7b.json")
