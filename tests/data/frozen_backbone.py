"""A classifier fine-tuned on a frozen backbone: six identical Linear+ReLU blocks that need no gradient, and a
trainable head (tests/test_frozen_params.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, CLASSES = 256, 10


class FineTune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(6))
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(WIDTH, 128), nn.ReLU(), nn.Linear(128, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.backbone:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return FineTune()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
