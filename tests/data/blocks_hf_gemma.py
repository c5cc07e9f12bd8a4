"""A small Hugging Face GemmaForCausalLM from a config (random weights, no download), for tests/test_blocks.py.

Each decoder layer's MLP activation (transformers' GELUTanh) holds a `functools.partial` of its own, made alike
in every layer.
"""

import torch
import torch.nn.functional as F

VOCAB, SEQ = 512, 32


def build_model():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa")
    return GemmaForCausalLM(config)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output, target):
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
