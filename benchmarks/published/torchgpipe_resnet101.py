"""torchgpipe's ResNet-101 (benchmarks/models/resnet/ at v0.0.7), as its ResNet-101 speed benchmark runs it.

torchvision's ResNet-101 (v1.5: stride 2 in the 3x3 convolution) as 370 items in torchgpipe's flattened order (see
torchgpipe_seq.py): each bottleneck is identity-stash, conv1, bn1, relu1, conv2, bn2, relu2, conv3, bn3, residual
(which holds the downsample branch), relu3. Inputs are 3x224x224 over 1000 classes with cross-entropy, as in
benchmarks/resnet101-speed/main.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torchgpipe_seq import Pop, SkipSequential, Stash


class Residual(Pop):
    """Adds the stashed block input, through the downsample branch where the block changes shape."""

    def __init__(self, downsample: nn.Module | None = None):
        super().__init__()
        self.downsample = downsample

    def combine(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + (skip if self.downsample is None else self.downsample(skip))


def bottleneck(cin: int, width: int, stride: int) -> list[nn.Module]:
    cout = width * 4
    down = None
    if stride != 1 or cin != cout:
        down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
    return [Stash(), nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout), Residual(down), nn.ReLU()]


def resnet_layers(blocks: tuple[int, ...] = (3, 4, 23, 3), classes: int = 1000, *,
                  block: Callable[[int, int, int], list[nn.Module]] = bottleneck, expansion: int = 4) -> list[nn.Module]:
    """The stem, `blocks` blocks per stage (widths 64-512, stride 2 entering stages 2-4) and the head; `block`
    (cin, width, stride) makes a block's items, whose output has width x `expansion` channels."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
        for j in range(n):
            layers += block(cin, width, 2 if (j == 0 and i > 0) else 1)
            cin = width * expansion
    return layers + [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(cin, classes)]


def build_resnet101() -> nn.Module:
    return SkipSequential(resnet_layers())


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.rand(batch_size, 3, 224, 224),)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 1000, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
