"""Model file for the runtime tests: a tiny GPT with tied embedding / LM head and no loss_fn
(the loss is the sum of the logits, so microbatch gradients must be summed, not averaged)."""

import torch

from runtime_models import TinyGPT


def build_model():
    return TinyGPT()


def example_inputs(batch_size):
    return (torch.randint(0, 32, (batch_size, 8), generator=torch.Generator().manual_seed(0)),)
