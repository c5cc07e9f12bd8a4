"""Per-op-kind pricing (costmodels/part_costs.py): what the trace records per kind, and the sums the roofline takes.

Expected values are written from the formulas (a Linear's 2*B*in*out FLOPs, a tensor's numel*4 bytes, the
traffic factors and per-kernel times named in part_costs), not read back from the code under test.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace

import pytest
import yaml

from pipeplan.costmodels import part_costs
from pipeplan.costmodels.compute import DEFAULT_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY, efficiency_for, layer_roofline_s
from pipeplan.costmodels.graph import CostPart, Graph, Layer, load_graph
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile
from pipeplan.hardware_profiles.loader import parse_profile, profile_to_dict

B, IN, OUT = 4, 16, 128

BLOCK = textwrap.dedent(f"""
    import torch, torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear({IN}, {OUT})
            self.norm = nn.LayerNorm({OUT})
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(torch.nn.functional.gelu(self.norm(self.fc(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
            self.point = nn.Conv2d(2, 2, 1)
            self.grouped = nn.Conv2d(2, 2, 3, padding=1, groups=2)
            self.small = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            y = self.block(x)
            img = y.reshape(x.shape[0], 2, 8, 8)
            return self.small(self.grouped(self.point(self.down(self.conv(img))))).flatten(1)

    def build_model():
        return Net()

    def example_inputs(batch_size):
        return (torch.randn(batch_size, {IN}),)

    def example_target(batch_size):
        return torch.randn(batch_size, 32)

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)
""")


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> Graph:
    import pipeplan

    path = tmp_path_factory.mktemp("parts") / "net.py"
    path.write_text(BLOCK)
    return pipeplan.trace(str(path), B, depth=1, repeats=1, time_layers=False, fvcore_check=False)


def parts_of(graph: Graph, name: str) -> dict[str, CostPart]:
    return {p.kind: p for p in graph.layer(name).parts}


def test_a_grouped_block_keeps_each_kind_of_op(graph):
    parts = parts_of(graph, "block")
    assert set(parts) == {"matmul", "norm", "elementwise", "dropout"}
    act = B * OUT * 4  # one fp32 activation of the block
    assert parts["matmul"].fwd_flops == 2 * B * IN * OUT
    assert parts["matmul"].param_bytes == (IN * OUT + OUT) * 4
    assert parts["matmul"].bytes_moved == B * IN * 4 + (IN * OUT + OUT) * 4 + act
    assert parts["norm"].bytes_moved == act + 2 * OUT * 4 + act  # input, weight and bias, output
    assert parts["elementwise"].bytes_moved == 2 * act  # gelu reads and writes
    assert parts["dropout"].bytes_moved == 2 * act + B * OUT  # ... plus a one-byte mask per element
    assert sum(p.ops for p in parts.values()) == 4
    assert parts["matmul"].bwd_flops == graph.layer("block").bwd_flops  # the only part with FLOPs


def test_only_dense_unit_stride_3x3_convolutions_count_as_winograd(graph):
    """... on outputs of at least WINOGRAD_MIN_OUTPUT_SIDE (8) per side: `conv` makes 8x8, `small` 4x4."""
    assert set(parts_of(graph, "conv")) == {"conv3x3"}
    for name in ("down", "point", "grouped", "small"):
        assert set(parts_of(graph, name)) - {"other"} == {"conv"}, name  # "other": the loss, on the last layer


def test_the_loss_over_the_model_output_is_charged_to_the_layer_that_returns_it(graph):
    last = graph.layers[-1]
    other = parts_of(graph, last.name)["other"]
    assert other.bytes_moved >= 2 * B * 8 * 4  # two passes over the (B, 8) fp32 output
    assert all("other" not in parts_of(graph, l.name) for l in graph.layers if l.name in ("block", "conv"))


def test_parts_survive_graph_json(graph, tmp_path):
    graph.save(tmp_path / "g.json")
    again = load_graph(tmp_path / "g.json")
    assert [l.parts for l in again.layers] == [l.parts for l in graph.layers]


@pytest.mark.parametrize("bad, says", [
    ({"kind": "bogus", "bytes_moved": 1}, "kind"),
    ({"kind": "norm", "ops": -1}, "ops"),
    ({"kind": "norm", "bytes_moved": 4, "param_bytes": 8}, "param_bytes"),
    ({"kind": "norm", "bytes": 4}, "only the keys"),
    ({"kind": "conv", "bytes_moved": 4, "layout_bytes": 8}, "layout_bytes"),
])
def test_bad_parts_are_refused_naming_the_field(graph, tmp_path, bad, says):
    doc = graph.to_dict()
    doc["layers"][0]["parts"] = [bad]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=says):
        load_graph(path)


def test_a_kind_given_twice_in_one_layer_is_refused(graph, tmp_path):
    doc = graph.to_dict()
    doc["layers"][0]["parts"] = [{"kind": "norm"}, {"kind": "norm"}]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="each once"):
        load_graph(path)


A100 = load_profile("a100-80gb-sxm")


def test_memory_bound_parts_add_to_compute_bound_ones_instead_of_hiding_under_them():
    gemm = CostPart(kind="matmul", fwd_flops=10**12, bwd_flops=2 * 10**12, bytes_moved=10**6, ops=1)
    norm = CostPart(kind="norm", bytes_moved=10**9, ops=1)
    layer = Layer(name="block", kind="matmul", fwd_flops=10**12, bwd_flops=2 * 10**12, bytes_moved=10**9 + 10**6,
                  parts=[gemm, norm])
    bw = A100.mem_bw_bytes_per_s * DEFAULT_MEMORY_EFFICIENCY
    peak = A100.flops_for("bf16") * DEFAULT_EFFICIENCY["matmul"]
    k = part_costs.DEFAULT_KERNEL_OVERHEAD_S
    half = 0.5  # bf16 activations: half the traced fp32 bytes
    fwd, bwd = layer_roofline_s(layer, A100, dtype="bf16")
    assert fwd == pytest.approx(10**12 / peak + 1.5 * 10**9 * half / bw + 2 * k)
    assert bwd == pytest.approx(2 * 10**12 / peak + 2.5 * 10**9 * half / bw + 4 * k)
    single, _ = layer_roofline_s(replace(layer, parts=[]), A100, dtype="bf16")
    assert single == pytest.approx(max(10**12 / peak, 10**9 * half / bw))  # the old max() hid the norm
    assert fwd > single


def test_tiny_ops_cost_their_host_dispatch_time():
    tiny = Layer(name="t", kind="elementwise", bytes_moved=8, parts=[CostPart(kind="elementwise", bytes_moved=8, ops=5)])
    fwd, bwd = layer_roofline_s(tiny, A100, dtype="fp32")
    assert fwd == pytest.approx(5 * part_costs.DEFAULT_DISPATCH_S)
    assert bwd == pytest.approx(10 * part_costs.DEFAULT_DISPATCH_S)


def test_winograd_applies_to_fp32_3x3_convolutions_only():
    conv = CostPart(kind="conv3x3", fwd_flops=10**12, bwd_flops=2 * 10**12, bytes_moved=1000, ops=1)
    layer = Layer(name="c", kind="conv", fwd_flops=10**12, bwd_flops=2 * 10**12, bytes_moved=1000, parts=[conv])
    k = part_costs.DEFAULT_KERNEL_OVERHEAD_S
    fp32, _ = layer_roofline_s(layer, A100, dtype="fp32")
    assert fp32 == pytest.approx(10**12 / 2.25 / (A100.flops_for("fp32") * DEFAULT_EFFICIENCY["conv"]) + k)
    bf16, _ = layer_roofline_s(layer, A100, dtype="bf16")
    assert bf16 == pytest.approx(10**12 / (A100.flops_for("bf16") * DEFAULT_EFFICIENCY["conv"]) + k)


CONV = textwrap.dedent("""
    import torch, torch.nn as nn

    class Net(nn.Module):
        def __init__(self, channels_last):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)
            self.point = nn.Conv2d(8, 8, 1)
            self.channels_last = channels_last
            if channels_last:
                self.to(memory_format=torch.channels_last)

        def forward(self, x):
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            return self.point(torch.relu(self.conv(x))).flatten(1)

    def build_nchw():
        return Net(False)

    def build_nhwc():
        return Net(True)

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 4, 6, 6),)
""")


@pytest.mark.parametrize("entry, transposed", [("build_nchw", True), ("build_nhwc", False)])
def test_the_trace_records_the_bytes_of_channels_first_convolutions(tmp_path, entry, transposed):
    import pipeplan

    path = tmp_path / "conv.py"
    path.write_text(CONV)
    g = pipeplan.trace(str(path), B, depth=1, repeats=1, time_layers=False, fvcore_check=False, entry=entry)
    # input + output of each convolution, fp32: (B,4,6,6) -> (B,8,6,6) and (B,8,6,6) -> (B,8,6,6)
    want = {"conv": B * (4 + 8) * 36 * 4, "point": B * (8 + 8) * 36 * 4}
    for name, layout in want.items():
        layer = next(l for l in g.layers if l.name.endswith(name))
        convs = [p for p in layer.parts if p.kind in ("conv", "conv3x3")]
        assert [p.layout_bytes for p in convs] == [layout if transposed else 0], name
        assert all(p.layout_bytes == 0 for p in layer.parts if p not in convs)


def test_channels_first_convolutions_pay_transposes_on_nvidia_tensor_cores_only():
    conv = CostPart(kind="conv", fwd_flops=10**6, bwd_flops=2 * 10**6, bytes_moved=10**9, layout_bytes=6 * 10**8,
                    ops=1)
    layer = Layer(name="c", kind="conv", fwd_flops=10**6, bwd_flops=2 * 10**6, bytes_moved=10**9, parts=[conv])
    plain = replace(layer, parts=[replace(conv, layout_bytes=0)])
    k = part_costs.DEFAULT_KERNEL_OVERHEAD_S
    for dtype, scale in (("fp16", 0.5), ("bf16", 0.5), ("tf32", 1.0)):
        bw = A100.mem_bw_bytes_per_s * DEFAULT_MEMORY_EFFICIENCY
        fwd, bwd = layer_roofline_s(layer, A100, dtype=dtype)
        # memory-bound: traffic / bandwidth; the transposes read and write input and output (2x forward, 3x backward)
        assert fwd == pytest.approx((10**9 + 2 * 6 * 10**8) * scale / bw + k), dtype
        assert bwd == pytest.approx((2 * 10**9 + 3 * 6 * 10**8) * scale / bw + 2 * k), dtype
    assert layer_roofline_s(layer, A100, dtype="fp32") == layer_roofline_s(plain, A100, dtype="fp32")  # CUDA cores
    for other in ("mi300x", "tpu-v5p"):  # not cuDNN
        prof = load_profile(other)
        assert layer_roofline_s(layer, prof, dtype="bf16") == layer_roofline_s(plain, prof, dtype="bf16"), other


def _profile(extra: str):
    text = textwrap.dedent("""
        format: pipeplan.profile/v1
        name: test-gpu
        device: Test GPU
        memory_gib: 80
        usable_memory_gib: 78
        memory_bandwidth_gbps: 2000
        peak_tflops: {fp32: 19.5, bf16: 312}
        devices_per_node: 8
        intra_node: {kind: nvlink, bandwidth_gbps: 300, latency_us: 3}
        inter_node: {kind: infiniband, bandwidth_gbps: 25, latency_us: 5}
    """) + extra
    return parse_profile(yaml.safe_load(text), "test.yaml")


def test_efficiency_by_dtype_then_kind_then_the_kind_a_part_refines():
    p = _profile("efficiency: {matmul@bf16: 0.5, matmul: 0.6, conv: 0.4, memory@bf16: 0.9}\n")
    assert efficiency_for(p, "matmul", "bf16") == (0.5, 0.9)
    assert efficiency_for(p, "matmul", "fp32") == (0.6, DEFAULT_MEMORY_EFFICIENCY)
    assert efficiency_for(p, "conv3x3", "bf16")[0] == 0.4
    assert efficiency_for(p, "dropout", "bf16")[0] == DEFAULT_EFFICIENCY["elementwise"]


@pytest.mark.parametrize("bad, says", [
    ("efficiency: {matmul@int8: 0.5}\n", "names no dtype"),
    ("efficiency: {gemm@bf16: 0.5}\n", "unknown field 'efficiency.gemm'"),
    ("kernel_overhead_us: -1\n", "kernel_overhead_us"),
])
def test_bad_efficiency_keys_and_overheads_are_refused(bad, says):
    with pytest.raises(UserError, match=says):
        _profile(bad)


def test_kernel_overheads_come_from_the_profile_and_round_trip():
    p = _profile("kernel_overhead_us: 2\ndispatch_us: 0\n")
    assert part_costs.kernel_overheads_s(p) == (pytest.approx(2e-6), 0.0)
    doc = profile_to_dict(p)
    assert doc["kernel_overhead_us"] == 2 and doc["dispatch_us"] == 0
    assert part_costs.kernel_overheads_s(_profile("")) == (part_costs.DEFAULT_KERNEL_OVERHEAD_S,
                                                           part_costs.DEFAULT_DISPATCH_S)
