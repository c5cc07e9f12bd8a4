"""The published table's torchgpipe rows: its models rebuilt as torchgpipe builds them, its balances mapped onto
the traced layers, and the P40 profile they are predicted on (benchmarks/published/, benchmarks/published_bench.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from pipeplan.hardware_profiles import load_profile

PUBLISHED = Path(__file__).resolve().parent.parent / "benchmarks" / "published"
sys.path[:0] = [str(PUBLISHED), str(PUBLISHED.parent)]

import published_bench  # noqa: E402
import torchgpipe_resnet101  # noqa: E402
import torchgpipe_unet  # noqa: E402


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("convs, base, published", [
    # torchgpipe docs/benchmarks.rst, "U-Net (B, C) Memory Benchmark": Parameters, as printed
    (6, 72, "362.2M"), (11, 128, "2.21B"), (24, 128, "4.99B"), (24, 160, "7.80B"), (48, 160, "15.82B"),
])
def test_unet_has_the_parameter_counts_torchgpipe_publishes(convs, base, published):
    with torch.device("meta"):
        model = torchgpipe_unet.SkipSequential(torchgpipe_unet.unet_layers(5, convs, base))
    value, unit = float(published[:-1]), {"M": 1e6, "B": 1e9}[published[-1]]
    decimals = len(published[:-1].split(".")[1])
    assert round(_params(model) / unit, decimals) == value


def test_the_speed_benchmark_models_match_their_sources():
    with torch.device("meta"):
        unet, resnet = torchgpipe_unet.build_unet(), torchgpipe_resnet101.build_resnet101()
    assert _params(resnet) == 44_549_160  # torchvision's ResNet-101 (its model card's num_params)
    cases = yaml.safe_load((PUBLISHED / "cases.yaml").read_text())["cases"]
    for model, items in (("torchgpipe-unet", len(unet.layers)), ("torchgpipe-resnet101", len(resnet.layers))):
        balances = [c["balance"] for c in cases if c["model"] == model and c.get("balance")]
        assert balances and all(sum(b) == items for b in balances)  # every published balance covers the sequence


def test_a_balance_maps_by_item_index_past_items_without_ops():
    graph = SimpleNamespace(layers=[SimpleNamespace(name=f"layers.{i}") for i in (0, 1, 3, 4, 6)])  # 2 and 5: stashes
    assert published_bench.balance_assignment(graph, [2, 3, 2]) == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        published_bench.balance_assignment(graph, [2, 3, 3])


def test_the_skips_run_last_in_first_out():
    """A 2-level U-Net's decoder concatenates the deeper encoder output first: checked against plain code."""
    torch.manual_seed(0)
    model = torchgpipe_unet.SkipSequential(torchgpipe_unet.unet_layers(depth=2, num_convs=2, base=4)).eval()
    x = torch.rand(2, 3, 8, 8)
    L = list(model.layers)

    def run(mods, t):
        for m in mods:
            t = m(t)
        return t

    e0 = run(L[0:8], x)  # encoder 0: two conv groups; L[8] stashes, L[9] pools
    e1 = run(L[10:18], L[9](e0))
    mid = run(L[20:28], L[19](e1))  # bottleneck
    d1 = run(L[30:38], torch.cat((L[28](mid), e1), 1))
    d0 = run(L[40:48], torch.cat((L[38](d1), e0), 1))
    assert torch.equal(model(x), L[48](d0))


def test_p40_profile_is_its_datasheet():
    p = load_profile("tesla-p40")
    assert p.name == "p40" and p.flops_for("fp32") == pytest.approx(3840 * 2 * 1.531e9, rel=1e-3)
    assert p.mem_bw_bytes_per_s == pytest.approx(346e9) and p.peak_flops["fp16"] is None
