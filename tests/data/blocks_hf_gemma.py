"""A small Hugging Face GemmaForCausalLM from a config (random weights, no download), for tests/test_blocks.py.

Each decoder layer's MLP activation (transformers' GELUTanh) holds a `functools.partial` of its own, made alike
in every layer.
"""

import torch

# the same inputs, target and loss as the Llama test model (this folder is on the path when it loads)
from blocks_llama import VOCAB, example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa")
    return GemmaForCausalLM(config)
