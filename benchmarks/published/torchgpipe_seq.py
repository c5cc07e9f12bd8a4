"""torchgpipe's benchmark models as one flat sequence of layers, so its published `balance` applies as written.

torchgpipe (Kim et al. 2020, github.com/kakaobrain/torchgpipe, benchmarks/models/) builds U-Net and ResNet-101 as
one flattened `nn.Sequential` and splits it with `balance`: the number of consecutive items per partition. Its skip
connections are `@skippable` modules that stash a tensor and pop it later. Here the same items sit in one
`ModuleList` in the same order; `Stash` keeps its input on a stack and a `Pop` takes it back (last in, first out,
which is how both models nest their skips), so `layers.<i>` is item i of torchgpipe's sequence and
`benchmarks/published_bench.py` maps a balance onto the traced layers by that index.
"""

from __future__ import annotations

import torch
from torch import nn


class Stash(nn.Module):
    """torchgpipe's `stash`: the input goes on, and a copy of the reference waits for the matching `Pop`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Pop(nn.Module):
    """torchgpipe's `pop`: combines the current tensor with the most recently stashed one."""

    def combine(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.combine(x, skip)


class SkipSequential(nn.Module):
    """Runs `layers` in order, feeding each `Pop` the tensor of the last unmatched `Stash`."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stashed: list[torch.Tensor] = []
        for layer in self.layers:
            if isinstance(layer, Stash):
                stashed.append(x)
            elif isinstance(layer, Pop):
                x = layer(x, stashed.pop())
            else:
                x = layer(x)
        return x
