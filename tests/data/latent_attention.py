"""Attention whose value heads are narrower than its query and key heads (DeepSeek's multi-head latent attention:
192 against 128), for tests/test_gpu_attention.py. `Core` runs F.scaled_dot_product_attention alone, so its layer
holds exactly what attention saves; V_DIM = Q_DIM gives the same model with one head size, and DROPOUT attention
dropout in training (Hugging Face's GPT-2 and BERT: 0.1)."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

HEADS, Q_DIM, SEQ, WIDTH = 4, 24, 64, 32
V_DIM = int(os.environ.get("PIPEPLAN_TEST_V_DIM", "16"))
DROPOUT = float(os.environ.get("PIPEPLAN_TEST_DROPOUT", "0"))


class Core(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT if self.training else 0.0)


class LatentAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, HEADS * Q_DIM)
        self.k = nn.Linear(WIDTH, HEADS * Q_DIM)
        self.v = nn.Linear(WIDTH, HEADS * V_DIM)
        self.core = Core()
        self.out = nn.Linear(HEADS * V_DIM, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, SEQ, HEADS, -1).transpose(1, 2)

        o = self.core(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.out(o.transpose(1, 2).reshape(b, SEQ, HEADS * V_DIM))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LatentAttention()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, WIDTH, generator=torch.Generator().manual_seed(0)),)
