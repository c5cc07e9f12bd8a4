"""A DLRM-like model (tests/test_zero_bubble_runtime.py): dense features through an MLP, integer ids through four
embedding bags, their pairwise dot products and a top MLP. Under a V of four stages the second holds two bags whose
tables meet no float input's graph there: torch's split backward never computed their gradients
(runtime/complete_split.py); and its shape inference ran them on uninitialised ids (runtime/worker.py
`zeroed_inference_inputs`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TABLES, ROWS, BAG = 4, 500, 6


class Dlrm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, 16, mode="sum") for _ in range(TABLES))
        self.bot = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(16 + (TABLES + 1) * TABLES // 2, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bot(dense)
        ys = [bag(sparse[:, i]) for i, bag in enumerate(self.bags)]
        z = torch.stack([x, *ys], dim=1)
        pairs = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.tril_indices(TABLES + 1, TABLES + 1, offset=-1)
        return self.top(torch.cat([x, pairs[:, i, j]], dim=1)).squeeze(1)


def build_model() -> nn.Module:
    return Dlrm()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 13, generator=g), torch.randint(0, ROWS, (batch_size, TABLES, BAG), generator=g)


def example_target(batch_size: int) -> torch.Tensor:
    return torch.rand(batch_size, generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, target)
