"""A U-Net: an encoder-decoder whose long skip connections jump from each encoder level
to the decoder level of the same resolution, i.e. across many layers. A pipeline cut
in the middle must ship every skip tensor that spans it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BASE = 8  # channels at the top level; doubles per level
LEVELS = 3
IMAGE = 32


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.act2 = nn.ReLU()

    def forward(self, x):
        return self.act2(self.conv2(self.act1(self.conv1(x))))


class UNet(nn.Module):
    def __init__(self, cin=3, classes=2, base=BASE, levels=LEVELS):
        super().__init__()
        chans = [base * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList()
        c = cin
        for ch in chans[:-1]:
            self.down.append(DoubleConv(c, ch))
            c = ch
        self.pool = nn.MaxPool2d(2)
        self.bottom = DoubleConv(chans[-2], chans[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for ch in reversed(chans[:-1]):
            self.up.append(nn.ConvTranspose2d(ch * 2, ch, 2, stride=2))
            self.dec.append(DoubleConv(ch * 2, ch))
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # the long skip: read again at the end of the network
            x = self.pool(x)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips), strict=True):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def build_model():
    return UNet()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g),)


def example_target(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 2, (batch_size, IMAGE, IMAGE), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
