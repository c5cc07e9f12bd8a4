"""A model that checkpoints its own blocks with torch.utils.checkpoint (tests/test_user_checkpoint.py): reentrant
under `build_model`, non-reentrant under `build_non_reentrant`, and not at all under `build_plain`."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WIDTH, CLASSES = 64, 10


class Block(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.reentrant is None:
            return x + self.mlp(h)
        return x + checkpoint(self.mlp, h, use_reentrant=self.reentrant)


class Net(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block(reentrant) for _ in range(4))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build_model() -> nn.Module:
    return Net(reentrant=True)


def build_non_reentrant() -> nn.Module:
    return Net(reentrant=False)


def build_plain() -> nn.Module:
    return Net(reentrant=None)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
