"""A ResNet-style CNN (basic blocks, batch norm, strided downsampling), sized for CPU tracing.

Residual adds live in each block's forward, so the tracer folds them into a
neighbouring layer; downsampling shortcuts are 1x1 convolutions of their own.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTHS = (16, 32, 64, 128)  # channels per stage
BLOCKS = (2, 2, 2, 2)  # basic blocks per stage (ResNet-18 layout)
IMAGE = 32
CLASSES = 100


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    def __init__(self, widths=WIDTHS, blocks=BLOCKS, classes=CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        stages, cin = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks, strict=False)):
            for j in range(n):
                stages.append(BasicBlock(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.blocks = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model():
    return ResNet()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
