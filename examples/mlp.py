"""An uneven MLP: layer widths differ a lot, so an equal-layer split is a bad pipeline split."""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTHS = [256, 2048, 512, 4096, 256, 1024, 128, 10]


def build_model():
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTHS[0], generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, WIDTHS[-1], (batch_size,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
