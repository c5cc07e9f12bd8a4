"""The Zero Bubble paper's GPT models (Qi et al. 2024, Table 3), sequence 1024, vocabulary 32000: attention unfused.

See megatron_gpt.py for why these rows are traced from this file rather than from their config.json.
"""

from __future__ import annotations

from megatron_gpt import build_gpt, model_file_functions

example_inputs, example_target, loss_fn = model_file_functions("zb-gpt-1.5b.json", seq_len=1024)  # all four: vocabulary 32000


def build_zb_1_5b():
    return build_gpt("zb-gpt-1.5b.json")


def build_zb_6_2b():
    return build_gpt("zb-gpt-6.2b.json")


def build_zb_14_6b():
    return build_gpt("zb-gpt-14.6b.json")


def build_zb_28_3b():
    return build_gpt("zb-gpt-28.3b.json")
