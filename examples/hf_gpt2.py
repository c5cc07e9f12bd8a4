"""A Hugging Face transformers GPT-2, built from a config (random weights, no download).

use_cache=False keeps the KV cache out of the output so the model is a plain
training graph; the output is a ModelOutput (a dict), and the loss is computed
from its logits. Needs `pip install 'pipeplan[hf]'`.
"""

import torch
import torch.nn.functional as F

CONFIG = dict(vocab_size=1024, n_positions=128, n_embd=64, n_layer=2, n_head=2)
SEQ = 32


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQ), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQ), generator=g)


def loss_fn(output, target):
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
