"""On a CUDA GPU: each convolution shape of ResNet-18 and VGG-16 (batch 16, 224x224), timed forward, input
gradient and weight gradient apart, in fp32 on CUDA cores (TF32 off) and with PyTorch's defaults (TF32 on).

Why: the published table's ResNet-18/34 rows (cnn-benchmarks, GP102, cuDNN 5.1) are over-predicted by 25-40%
while VGG-16/19 and ResNet-101/152 are within 6%, and the backward carries the miss. This prints which shapes
run far under the FLOP roofline, on the GPU at hand (not a Pascal: a pointer to where the time goes, not a
calibration). Prints a markdown table; `--out FILE` also writes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# (label, batch, C_in, C_out, H=W of the input, kernel, stride): the distinct convolutions of each model.
SHAPES = [
    ("resnet18 stem 7x7/2", 16, 3, 64, 224, 7, 2),
    ("resnet18 3x3 64@56", 16, 64, 64, 56, 3, 1),
    ("resnet18 3x3/2 64->128@56", 16, 64, 128, 56, 3, 2),
    ("resnet18 3x3 128@28", 16, 128, 128, 28, 3, 1),
    ("resnet18 3x3 256@14", 16, 256, 256, 14, 3, 1),
    ("resnet18 3x3 512@7", 16, 512, 512, 7, 3, 1),
    ("resnet18 1x1/2 256->512@14", 16, 256, 512, 14, 1, 2),
    ("vgg16 3x3 3->64@224", 16, 3, 64, 224, 3, 1),
    ("vgg16 3x3 64@224", 16, 64, 64, 224, 3, 1),
    ("vgg16 3x3 256@56", 16, 256, 256, 56, 3, 1),
    ("vgg16 3x3 512@14", 16, 512, 512, 14, 3, 1),
]


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def row(label: str, n: int, cin: int, cout: int, hw: int, k: int, s: int) -> str:
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(cin, cout, k, stride=s, padding=k // 2, bias=False).cuda()
    x = torch.randn(n, cin, hw, hw, device="cuda", requires_grad=True)
    y = conv(x)
    dy = torch.randn_like(y)
    flops = 2 * y.numel() * cin * k * k  # forward multiply-adds x 2; each gradient the same
    out = [label]
    for tf32 in (False, True):
        torch.backends.cudnn.allow_tf32 = tf32
        f = time_ms(lambda: conv(x))
        dx = time_ms(lambda: torch.autograd.grad(conv(x), x, dy)[0]) - f
        dw = time_ms(lambda: torch.autograd.grad(conv(x), conv.weight, dy)[0]) - f
        out += [f"{f:.3f}", f"{dx:.3f}", f"{dw:.3f}",
                f"{flops / f / 1e9:.1f} / {flops / max(dx, 1e-6) / 1e9:.1f} / {flops / max(dw, 1e-6) / 1e9:.1f}"]
    return "| " + " | ".join(out) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    head = ["| shape | fp32 fwd ms | dgrad ms | wgrad ms | fp32 TFLOP/s fwd / dgrad / wgrad | tf32 fwd ms | dgrad ms "
            "| wgrad ms | tf32 TFLOP/s fwd / dgrad / wgrad |", "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    lines = [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
             "", *head] + [row(*s) for s in SHAPES]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
