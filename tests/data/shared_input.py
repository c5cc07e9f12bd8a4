"""A model with inputs every sample shares: a positional table of shape (T, D) beside the batch, and a Python
number (which torch.export bakes into the program) (tests/test_runtime_equivalence.py, tests/test_runtime_sharding.py,
runtime/batch_split.py, runtime/split.py `_baked`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

T, D = 6, 32


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(4))
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:  # x: (B, T, 8); pos: (T, D)
        h = self.inp(x) + scale * pos
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h.mean(1))


def build_model() -> nn.Module:
    return WithTable()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, T, 8, generator=g), torch.randn(T, D, generator=torch.Generator().manual_seed(2)), 0.5


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 3, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
