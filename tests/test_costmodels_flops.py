"""The published FLOP formulas used as oracles agree with PyTorch's own FLOP counter.

If Narayanan et al.'s 24Bsh^2 + 4Bs^2h (and the conv formula) match
FlopCounterMode on real modules, they can be trusted as independent checks of
traced graphs and of the roofline inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.costmodels import analytic


class TinyGPTLayer(nn.Module):
    """A pre-LN GPT block written out with explicit matmuls (as in the paper's count)."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.h, self.heads = h, heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        B, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(B, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, s, h)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("B,s,h,heads", [(2, 16, 32, 4), (1, 64, 48, 3)])
def test_transformer_layer_flops_match_flopcounter(B, s, h, heads):
    torch.manual_seed(0)
    layer = TinyGPTLayer(h, heads)
    x = torch.randn(B, s, h, requires_grad=True)
    with FlopCounterMode(display=False) as fwd_counter:
        out = layer(x)
    expected = analytic.transformer_layer_fwd_flops(B, s, h)
    assert fwd_counter.get_total_flops() == expected
    with FlopCounterMode(display=False) as bwd_counter:
        out.sum().backward()
    assert bwd_counter.get_total_flops() == 2 * expected  # "backward = 2x forward" (Narayanan et al. App.)


def test_conv_formula_matches_flopcounter():
    conv = nn.Conv2d(3, 64, 7, stride=2, padding=3)
    x = torch.randn(1, 3, 224, 224)
    with FlopCounterMode(display=False) as c:
        y = conv(x)
    assert y.shape[-2:] == (112, 112)
    assert c.get_total_flops() == analytic.conv2d_fwd_flops(1, 3, 64, 112, 112, 7, 7)
    grouped = nn.Conv2d(32, 64, 3, padding=1, groups=4)
    with FlopCounterMode(display=False) as c:
        grouped(torch.randn(2, 32, 10, 10))
    assert c.get_total_flops() == analytic.conv2d_fwd_flops(2, 32, 64, 10, 10, 3, 3, groups=4)
