"""Linear -> softmax -> Linear: softmax is on CUDA's autocast fp32 list and not on the CPU's, so the bytes it saves
differ by device (tests/test_autocast_bytes.py)."""

import torch

BATCH_FEATURES = 64


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(BATCH_FEATURES, BATCH_FEATURES), torch.nn.Softmax(dim=-1),
                               torch.nn.Linear(BATCH_FEATURES, BATCH_FEATURES))


def example_inputs(batch_size):
    return (torch.randn(batch_size, BATCH_FEATURES),)


def example_target(batch_size):
    return torch.randn(batch_size, BATCH_FEATURES)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)
