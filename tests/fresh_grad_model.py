"""Model file for the fresh-gradient tests (tests/test_fresh_gradients.py): wide Linear layers at a tiny batch, so
adding each weight gradient into an existing one is a large part of the backward (the part a fresh one skips)."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 1024


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def example_inputs(batch_size):
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
