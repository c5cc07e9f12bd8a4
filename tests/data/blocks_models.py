"""Small models with repeated blocks for tests/test_blocks.py, one builder per case (pick with entry=...)."""

import torch
import torch.nn as nn

WIDTH, SEQ = 16, 8


class Block(nn.Module):
    def __init__(self, width=WIDTH, hidden=4 * WIDTH, layer_idx=0, window=None, halve_from=None):
        super().__init__()
        self.layer_idx = layer_idx  # a block's own index: allowed to differ
        self.window = window
        self.halve_from = halve_from  # blocks from this index on end in an op of their own
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        h = self.up(self.norm(x))
        if self.window is not None:  # an attribute that changes what the block computes
            h = h * 0.5
        out = x + self.down(torch.relu(h))
        if self.halve_from is not None and self.layer_idx >= self.halve_from:  # the same attributes, not the same ops
            out = out * 0.5
        return out


class Stack(nn.Module):
    def __init__(self, blocks, mode="loop"):
        super().__init__()
        self.mode = mode
        self.n_layer = len(blocks)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        inputs = x
        x = self.embed(x)
        if self.mode == "counted":  # indexes the blocks by a count kept elsewhere
            for i in range(self.n_layer):
                x = self.blocks[i](x)
            return self.head(x)
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        if self.mode == "hidden":  # every block's output also leaves the model (output_hidden_states)
            return (self.head(x), *hidden)
        if self.mode == "stacked":  # every block read after the loop (the stack folds into the last block)
            return self.head(torch.stack(hidden).mean(0))
        if self.mode == "pooled":  # a masked mean after the loop, no module of its own (folds into the last block)
            keep = (inputs[..., :1] > 0).float()
            return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1.0))
        return self.head(x)


def build_model():
    return Stack([Block(layer_idx=i) for i in range(6)])


def build_counted():
    return Stack([Block(layer_idx=i) for i in range(6)], mode="counted")


def build_hidden():
    return Stack([Block(layer_idx=i) for i in range(6)], mode="hidden")


def build_stacked():
    return Stack([Block(layer_idx=i) for i in range(6)], mode="stacked")


def build_pooled():
    return Stack([Block(layer_idx=i) for i in range(6)], mode="pooled")


def build_halved_late():
    return Stack([Block(layer_idx=i, halve_from=2) for i in range(6)])


def build_wider():
    return Stack([Block(hidden=8 * WIDTH if i == 3 else 4 * WIDTH) for i in range(6)])


def build_window():
    return Stack([Block(window=4 if i == 2 else None) for i in range(6)])


def build_alternating():
    """Blocks that alternate (Gemma 2's sliding-window and full attention): a group of 2, repeated 4 times."""
    return Stack([Block(layer_idx=i, window=4 if i % 2 else None) for i in range(8)])


def build_grouped_rest():
    """Every third block differs (Gemma 3's one full-attention layer in six): 4 groups of 3, then 2 more."""
    return Stack([Block(layer_idx=i, window=4 if i % 3 == 2 else None) for i in range(14)])


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, SEQ, WIDTH, generator=g),)
