"""Tiny models for the runtime tests: a chain, U-Net-style skips over several stages,
a GPT with tied embedding / LM head. Small on purpose: each export takes well under a second."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class TinyUNet(nn.Module):
    """Encoder outputs are read by the decoder several stages later (skip connections)."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.enc1 = nn.Conv2d(1, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.enc2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.dec2 = nn.Conv2d(4 * c, c, 3, padding=1)
        self.dec1 = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(self, x):
        e1 = torch.relu(self.bn1(self.enc1(x)))
        e2 = torch.relu(self.enc2(F.max_pool2d(e1, 2)))
        m = torch.relu(self.mid(e2))
        d2 = torch.relu(self.dec2(torch.cat([m, e2], 1)))
        d2 = F.interpolate(d2, scale_factor=2.0, mode="nearest")
        return self.dec1(torch.cat([d2, e1], 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2, heads: int = 2, ctx: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse_loss(out, target):
    return F.mse_loss(out, target)


# name -> (builder, inputs(batch), target(batch), loss)
MODELS = {
    "mlp": (MLP, lambda b: (torch.randn(b, 16),), lambda b: torch.randn(b, 4), mse_loss),
    "unet": (TinyUNet, lambda b: (torch.randn(b, 1, 8, 8),), lambda b: torch.randn(b, 1, 8, 8), mse_loss),
    "gpt": (TinyGPT, lambda b: (torch.randint(0, 32, (b, 8)),), lambda b: torch.randint(0, 32, (b, 8)), gpt_loss),
}
