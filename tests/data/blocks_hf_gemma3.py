"""A small Hugging Face Gemma3ForCausalLM from a config (random weights, no download), for tests/test_blocks.py.

Its layers alternate sliding-window and full attention (`sliding_window_pattern` 2), and 9 of them are 4 groups
of 2 and one more: a group repeated, with a partial group after it.
"""

import torch

# the same inputs, target and loss as the Llama test model (this folder is on the path when it loads)
from blocks_llama import VOCAB, example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                              sliding_window=4, sliding_window_pattern=2, use_cache=False,
                              attn_implementation="sdpa")
    return Gemma3ForCausalLM(config)
