"""A small LSTM language model: torch's CPU autocast has no fp16 LSTM where oneDNN has no fp16 kernel for it
(tests/test_dtype_support.py)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 256, 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return LM()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
