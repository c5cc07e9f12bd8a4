"""A small Hugging Face LlamaForCausalLM from a config (random weights, no download), for tests/test_blocks.py.

PIPEPLAN_TEST_LLAMA_LAYERS sets the number of decoder layers (default 6), so the
same file measures how trace time grows with depth.
"""

import os

import torch
import torch.nn.functional as F

VOCAB, SEQ = 512, 32


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    layers = int(os.environ.get("PIPEPLAN_TEST_LLAMA_LAYERS", "6"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output, target):
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
