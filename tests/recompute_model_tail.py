"""Model file for the recomputation cost tests (tests/test_recompute_cost.py): layers that save their input before
computing (Linear), their output after (ReLU), or nothing (a scale by a constant), so checkpointed regions that end
in each stop their re-run at a different point."""

import torch
import torch.nn.functional as F
from torch import nn


class Scale(nn.Module):
    """x * 2: autograd saves nothing for it (the gradient is 2 * grad)."""

    def forward(self, x):
        return x * 2.0


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), Scale(), nn.ReLU(), Scale(),
                         nn.Linear(32, 4), Scale())


def example_inputs(batch_size):
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randint(0, 4, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
