"""A GPT-style decoder (nanoGPT layout), from tiny to GPT-2 small (124M).

`build_model` is a tiny configuration that traces in a second or two; `build_gpt2_small`
(`--entry build_gpt2_small`) is GPT-2 small: 12 layers, 12 heads, width 768,
vocabulary 50257, context 1024, tied token embedding and LM head (124M parameters).
PIPEPLAN_GPT_SIZE=tiny|small|medium|gpt2 picks the size `build_model` returns, and
PIPEPLAN_GPT_SEQ overrides the sequence length used by `example_inputs`.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    # name: (layers, heads, width, vocab, context)
    "tiny": (2, 2, 64, 512, 64),
    "small": (4, 4, 128, 2048, 128),
    "medium": (6, 8, 256, 8192, 256),
    "gpt2": (12, 12, 768, 50257, 1024),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # residual adds: glue folded into a neighbouring layer
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, layers, heads, width, vocab, context):
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _size():
    name = os.environ.get("PIPEPLAN_GPT_SIZE", "tiny")
    if name not in SIZES:
        raise ValueError(f"PIPEPLAN_GPT_SIZE={name!r}: pick one of {', '.join(SIZES)}")
    return name


_CONFIG = {"size": _size()}


def _seq():
    return int(os.environ.get("PIPEPLAN_GPT_SEQ", SIZES[_CONFIG["size"]][4]))


def build_model():
    return GPT(*SIZES[_CONFIG["size"]])


def build_gpt2_small():
    _CONFIG["size"] = "gpt2"
    return GPT(*SIZES["gpt2"])


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    vocab = SIZES[_CONFIG["size"]][3]
    return (torch.randint(0, vocab, (batch_size, _seq()), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    vocab = SIZES[_CONFIG["size"]][3]
    return torch.randint(0, vocab, (batch_size, _seq()), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
