"""A Llama-2-7B-shaped LlamaForCausalLM (random weights, no download): too big to trace with real weights here.

hidden 4096, 32 layers, 32 heads, intermediate 11008, vocabulary 32000, sequence 2048:
6.7B parameters, 27 GB in fp32. Planning it against a catalogue profile traces it
without weights (meta device); `pipeplan trace` with times builds it for real.
PIPEPLAN_LLAMA_LAYERS overrides the layer count (the tests use 2).
"""

import os

import torch
import torch.nn.functional as F

SEQ = int(os.environ.get("PIPEPLAN_LLAMA_SEQ", "2048"))
VOCAB = 32000


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=int(os.environ.get("PIPEPLAN_LLAMA_LAYERS", "32")),
                         num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                         vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False,
                         attn_implementation="sdpa")
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
