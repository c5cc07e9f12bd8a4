"""A model whose forward takes one dict of tensors and returns a dict (tests/test_runtime_split.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.num = nn.Linear(8, 64)
        self.mlp = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        e = self.emb(batch["ids"]).mean(1)
        return {"logits": self.mlp(torch.cat([e, self.num(batch["dense"])], dim=-1))}


def build_model() -> nn.Module:
    return Tabular()


def example_inputs(batch_size: int) -> tuple[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return ({"ids": torch.randint(0, 1000, (batch_size, 20), generator=g), "dense": torch.randn(batch_size, 8, generator=g)},)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 2, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"], target)
