"""A MobileNet-style net: a stem, a depthwise 3x3 convolution (groups = channels), a pointwise 1x1 and a head
(tests/test_costmodels_flops.py: a grouped convolution's backward FLOPs)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

CHANNELS, SIZE, CLASSES = 32, 16, 10


class DepthwiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.depthwise = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, groups=CHANNELS)
        self.pointwise = nn.Conv2d(CHANNELS, 2 * CHANNELS, 1)
        self.head = nn.Linear(2 * CHANNELS, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.pointwise(F.relu(self.depthwise(F.relu(self.stem(x))))))
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return DepthwiseNet()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
