"""torchgpipe's simplified U-Net (benchmarks/models/unet/__init__.py at v0.0.7), as its U-Net speed benchmark runs it.

`build_unet` is `unet(depth=5, num_convs=5, base_channels=64, input_channels=3, output_channels=1)`: 241 items in
torchgpipe's flattened order (see torchgpipe_seq.py). Every convolution is 3x3 without bias, followed by
Dropout2d(0.1), InstanceNorm2d and LeakyReLU(0.01); five encoder cells stash their output for the decoder cells,
which upsample (nearest, x2) and concatenate it. Inputs are 3x192x192, the loss binary cross-entropy on logits
against a 1x192x192 target, as in benchmarks/unet-speed/main.py.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torchgpipe_seq import Pop, SkipSequential, Stash

IMAGE = 192


class PopCat(Pop):
    """Concatenates the decoder's input with the encoder's stashed output (channels: input first)."""

    def combine(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, skip), dim=1)


def conv_dropout_norm_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.Dropout2d(p=0.1), nn.InstanceNorm2d(cout),
            nn.LeakyReLU(negative_slope=1e-2)]


def cell(cin: int, mid: int, cout: int, num_convs: int) -> list[nn.Module]:
    """torchgpipe's stacked_convs for num_convs >= 2: cin -> mid, (num_convs - 2) x mid -> mid, mid -> cout."""
    chans = [cin] + [mid] * (num_convs - 1) + [cout]
    return [m for a, b in itertools.pairwise(chans) for m in conv_dropout_norm_relu(a, b)]


def unet_layers(depth: int = 5, num_convs: int = 5, base: int = 64, cin: int = 3, cout: int = 1) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for i in range(depth):  # encoder: encode, stash, downsample
        c_in = cin if i == 0 else base * 2 ** (i - 1)
        layers += cell(c_in, base * 2 ** i, base * 2 ** i, num_convs) + [Stash(), nn.MaxPool2d(2, stride=2)]
    layers += cell(base * 2 ** (depth - 1), base * 2 ** depth, base * 2 ** (depth - 1), num_convs)  # bottleneck
    for i in reversed(range(depth)):  # decoder: upsample, concatenate the skip, decode
        layers += [nn.Upsample(scale_factor=2), PopCat()]
        layers += cell(base * 2 ** (i + 1), int(base * 2 ** (i - 1)), int(base * 2 ** (i - 1)), num_convs)
    layers.append(nn.Conv2d(int(base * 2 ** -1), cout, 1, bias=False))  # segment
    return layers


def build_unet() -> nn.Module:
    return SkipSequential(unet_layers())


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.rand(batch_size, 3, IMAGE, IMAGE),)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.ones(batch_size, 1, IMAGE, IMAGE)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, target)
