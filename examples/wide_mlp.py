"""A balanced MLP of equal wide Linear layers: the runtime benchmark's pipeline-friendly model.

Every layer costs the same and there are many of them (16), so a 2-stage cut can
balance what only the last stage does (the head, the loss, and the input gradient
the first stage never computes); each microbatch carries enough matmul work
(2 x 1024 x 1024 x 1024 FLOPs per layer forward at the runtime benchmark's batch of
8192 in 8 microbatches) to keep GEMMs efficient and dwarf gloo's per-message overhead.
PIPEPLAN_WIDE_MLP_WIDTH / _DEPTH resize it.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = int(os.environ.get("PIPEPLAN_WIDE_MLP_WIDTH", 1024))
DEPTH = int(os.environ.get("PIPEPLAN_WIDE_MLP_DEPTH", 16))
CLASSES = 16


def build_model():
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def example_inputs(batch_size):
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
