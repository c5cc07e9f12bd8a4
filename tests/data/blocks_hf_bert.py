"""A small Hugging Face BertLMHeadModel from a config (random weights, no download), for tests/test_blocks.py.

Its head reads the last encoder layer through a view (`slice_logits_to_keep`), which torch.export files under
that layer's LayerNorm: the last traced copy has a node the middle one does not.
"""

import torch

# the same inputs, target and loss as the Llama test model (this folder is on the path when it loads)
from blocks_llama import VOCAB, example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, max_position_embeddings=64, is_decoder=True, use_cache=False,
                        attn_implementation="sdpa")
    return BertLMHeadModel(config)
