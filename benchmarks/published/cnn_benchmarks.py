"""The models of Justin Johnson's cnn-benchmarks (github.com/jcjohnson/cnn-benchmarks), as its Torch7 script runs them.

VGG-16 and VGG-19 are the Caffe models of Simonyan & Zisserman (configurations D and E: 3x3 convolutions with bias,
ReLU, 2x2 max pooling, three fully connected layers with dropout); ResNet-18 to -152 are fb.resnet.torch's
ImageNet models (He et al. 2016): basic blocks for 18 and 34, bottlenecks with the stride in the 3x3 convolution
for 50 and up, projection shortcuts (1x1 convolution + batch norm) where a block changes shape, convolutions
without bias. The parameter counts equal torchvision's for the same names (tests/test_published_cnn_benchmarks.py).

Every model is one flat sequence of items (published/torchgpipe_seq.py), so `trace` with depth 1 gives one layer
per item, as for the torchgpipe rows. Inputs are 3x224x224 over 1000 classes. cnn_benchmark.lua times
`model:forward(x)` and `model:backward(x, dout)` with a random `dout` and no loss; the loss here (cross-entropy
over 16 x 1000 logits) is negligible beside a step.
"""

from __future__ import annotations

import torch
from torch import nn

# the model-file protocol's target and loss: ImageNet's, as for torchgpipe's ResNet-101 (its inputs: below)
from torchgpipe_resnet101 import Residual, example_target, loss_fn, resnet_layers  # noqa: F401
from torchgpipe_seq import SkipSequential, Stash


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    """A batch of 3x224x224 images that needs its gradient: Torch7's `model:backward(x, dout)` computes the first
    layer's gradInput where the module has one, where PyTorch skips it for an input that does not require grad;
    the trace then counts that convolution's input-gradient FLOPs, as cnn_benchmark.lua's backward ran them for
    the VGGs (Caffe models through loadcaffe). The ResNets' first convolution has none (`StemWithoutGradInput`)."""
    return (torch.rand(batch_size, 3, 224, 224).requires_grad_(),)


class StemWithoutGradInput(nn.Conv2d):
    """fb.resnet.torch's first convolution: its createModel ends with `model:get(1).gradInput = nil`
    (models/resnet.lua) and cudnn.torch's SpatialConvolution:updateGradInput returns at once without one
    (`if not self.gradInput then return end`); cnn-benchmarks loads those models and restores only their
    gradWeight and gradBias (utils.lua), so its ResNets' backward computes the stem's weight gradient only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.detach())


def fb_resnet_layers(blocks: tuple[int, ...], **kwargs: object) -> list[nn.Module]:
    """resnet_layers with fb.resnet.torch's first convolution (`StemWithoutGradInput`, the same weights)."""
    layers = resnet_layers(blocks, **kwargs)  # type: ignore[arg-type]
    layers[0] = StemWithoutGradInput(3, 64, 7, stride=2, padding=3, bias=False)
    return layers

VGG_CONFIGS = {
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


def vgg_layers(depth: int, classes: int = 1000) -> list[nn.Module]:
    layers: list[nn.Module] = []
    cin = 3
    for v in VGG_CONFIGS[depth]:
        if v == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            cin = int(v)
    return layers + [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                     nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(4096, classes)]


def basic_block(cin: int, cout: int, stride: int) -> list[nn.Module]:
    """fb.resnet.torch's basicblock: conv3x3 (stride), BN, ReLU, conv3x3, BN, add the shortcut, ReLU."""
    down = None
    if stride != 1 or cin != cout:
        down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
    return [Stash(), nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), Residual(down), nn.ReLU()]


def build_vgg16() -> nn.Module:
    return SkipSequential(vgg_layers(16))


def build_vgg19() -> nn.Module:
    return SkipSequential(vgg_layers(19))


def build_resnet18() -> nn.Module:
    return SkipSequential(fb_resnet_layers((2, 2, 2, 2), block=basic_block, expansion=1))


def build_resnet34() -> nn.Module:
    return SkipSequential(fb_resnet_layers((3, 4, 6, 3), block=basic_block, expansion=1))


def build_resnet50() -> nn.Module:
    return SkipSequential(fb_resnet_layers((3, 4, 6, 3)))


def build_resnet101() -> nn.Module:
    return SkipSequential(fb_resnet_layers((3, 4, 23, 3)))


def build_resnet152() -> nn.Module:
    return SkipSequential(fb_resnet_layers((3, 8, 36, 3)))
