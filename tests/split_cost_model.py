"""Model file for tests/test_split_cost_measured.py: 16 Linear(64, 64) + ReLU pairs, so that each half, a stage of a
2-stage plan, has 8 parameter groups for zero bubble's W (one `autograd.grad` call each)."""

import torch
import torch.nn.functional as F
from torch import nn

PAIRS, WIDTH = 16, 64


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(PAIRS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def example_inputs(batch_size):
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.mse_loss(output, target)
