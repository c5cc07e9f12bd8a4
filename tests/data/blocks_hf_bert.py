"""A small Hugging Face BertLMHeadModel from a config (random weights, no download), for tests/test_blocks.py.

Its head reads the last encoder layer through a view (`slice_logits_to_keep`), which torch.export files under
that layer's LayerNorm: the last traced copy has a node the middle one does not.
"""

import torch
import torch.nn.functional as F

VOCAB, SEQ = 512, 32


def build_model():
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, max_position_embeddings=64, is_decoder=True, use_cache=False,
                        attn_implementation="sdpa")
    return BertLMHeadModel(config)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output, target):
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
