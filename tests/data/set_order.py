"""A model whose forward computes two alike tables in an order it does not fix, as Gemma 3's forward computes its
rotary embedding once per attention kind by iterating `set(config.layer_types)`, whose order Python's string hashing
picks anew in each process. Here PIPEPLAN_TEST_ORDER ("ab" or "ba") picks it, so a test can export both orders;
PIPEPLAN_TEST_ACT ("relu" or "gelu") changes an op, a model that really changed (tests/test_runtime_op_order.py)."""

import os

import torch
import torch.nn as nn

WIDTH = 16
ORDER = os.environ.get("PIPEPLAN_TEST_ORDER", "ab")
ACT = {"relu": torch.relu, "gelu": nn.functional.gelu}[os.environ.get("PIPEPLAN_TEST_ACT", "relu")]


class Tables(nn.Module):
    """One table per kind, like a rotary embedding's cos of positions times a kind's frequency."""

    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return torch.cos(x * (1.0 if kind == "a" else 0.5))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return ACT(self.lin(x) + table)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.tables = Tables()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        tables = {kind: self.tables(h, kind) for kind in ORDER}
        for i, block in enumerate(self.blocks):
            h = block(h, tables["ab"[i % 2]])
        return self.head(h)


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)
