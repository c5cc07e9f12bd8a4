"""The published FLOP formulas used as oracles agree with PyTorch's own FLOP counter.

If Narayanan et al.'s 24Bsh^2 + 4Bs^2h (and the conv formula) match
FlopCounterMode on real modules, they can be trusted as independent checks of
traced graphs and of the roofline inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.costmodels import analytic
from pipeplan.costmodels.measure import flop_counter


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


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("groups", [1, 4, 32])
def test_a_grouped_convolutions_backward_is_twice_its_forward(groups, transposed):
    """Its input gradient and its weight gradient each take the forward's multiply-adds, whatever the groups
    (the formula above: 2 N H_out W_out C_out (C_in / groups) K_h K_w); torch 2.13's own counter prices the weight
    gradient as an ungrouped convolution, `groups` times too many."""
    conv = (nn.ConvTranspose2d if transposed else nn.Conv2d)(32, 32, 3, padding=1, groups=groups)
    x = torch.randn(2, 32, 10, 10, requires_grad=True)
    with flop_counter() as fwd:
        y = conv(x)
    expected = analytic.conv2d_fwd_flops(2, 32, 32, 10, 10, 3, 3, groups=groups)
    assert fwd.get_total_flops() == expected
    with flop_counter() as bwd:
        y.sum().backward()
    assert bwd.get_total_flops() == 2 * expected
    if groups > 1:
        with FlopCounterMode(display=False) as torchs:
            conv(x).sum().backward()
        assert torchs.get_total_flops() > 2 * expected  # what the fix is for


def test_a_traced_depthwise_layers_backward_is_its_input_and_weight_gradients():
    """Traced (tests/data/depthwise_convnet.py, 16x16 images, batch 2): the depthwise layer's backward counts its
    input and weight gradients, each its forward (C_in / groups = 1); the stem's input needs no gradient, so its
    backward is the weight gradient alone."""
    import pipeplan

    graph = pipeplan.trace(str(Path(__file__).parent / "data" / "depthwise_convnet.py"), 2, time_layers=False)
    depthwise, stem = graph.layer("depthwise"), graph.layer("stem")
    assert depthwise.fwd_flops == analytic.conv2d_fwd_flops(2, 32, 32, 16, 16, 3, 3, groups=32)
    assert depthwise.bwd_flops == 2 * depthwise.fwd_flops and depthwise.bwd_weight_flops == depthwise.fwd_flops
    assert stem.fwd_flops == analytic.conv2d_fwd_flops(2, 3, 32, 16, 16, 3, 3)
    assert stem.bwd_flops == stem.fwd_flops
