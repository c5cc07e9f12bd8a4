"""Linear -> an RMS norm that upcasts its input to fp32 (as Qwen3's and Cohere's query/key norms do) -> Linear.

torch.export records `x.to(torch.float32)` on the fp32 trace as an assertion that x is fp32, then the `to`; under
torch.autocast x is the first Linear's bf16 output (tests/test_autocast_bytes.py, tests/test_precision.py).
"""

import torch

FEATURES = 64


class UpcastNorm(torch.nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), UpcastNorm(FEATURES),
                               torch.nn.Linear(FEATURES, FEATURES))


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, FEATURES, generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, FEATURES, generator=g)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)
