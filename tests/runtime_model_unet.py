"""Model file (model.py format) for the runtime tests: U-Net skips that span several stages, with BatchNorm."""

import torch

from runtime_models import TinyUNet, mse_loss


def build_model():
    return TinyUNet()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 1, 8, 8, generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size):
    return torch.randn(batch_size, 1, 8, 8, generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return mse_loss(output, target)
