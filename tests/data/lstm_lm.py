"""A small LSTM language model: torch's CPU autocast has no fp16 LSTM where oneDNN has no fp16 kernel for it
(tests/test_dtype_support.py)."""

import torch
import torch.nn.functional as F

# token ids and next-token targets as the Llama test model draws them (this folder is on the path when it loads)
from blocks_llama import VOCAB, example_inputs, example_target  # noqa: F401
from torch import nn


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


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
