"""Model file for the runtime tests: an MLP with dropout, whose masks a recomputed forward must draw again
exactly (the recomputation tests, tests/test_runtime_recompute.py)."""

import torch
import torch.nn.functional as F
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(32, 4))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randint(0, 4, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
