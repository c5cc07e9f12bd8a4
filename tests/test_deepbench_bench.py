"""benchmarks/deepbench_bench.py prices DeepBench's kernels as `pipeplan trace` records them, from rows read right.

Two independent checks: DeepBench's own TFLOPS column (its arithmetic, in the workbooks) against the FLOPs the
benchmark counts over the published time, which also checks the CSV's times were read into the right columns; and
a one-convolution model traced by pipeplan against the cost part the benchmark builds for the same shape.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

# Loaded from its file, not through sys.path: benchmarks/ first on the path would shadow tests' own modules
# (both folders have a pipedream_reference.py).
_SPEC = importlib.util.spec_from_file_location(
    "deepbench_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "deepbench_bench.py")
assert _SPEC is not None and _SPEC.loader is not None
db = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(db)


def test_the_counted_flops_over_the_published_time_are_deepbenchs_own_tflops():
    """Rows whose workbook output size (P, Q) is not whole are its own formula's slip, (H + 2 pad) / stride: for
    7x7 inputs, padding 3, stride 2 the 1080 Ti sheet has 6.5 where cuDNN's output is 7x7; they are left out."""
    rows = [r for r in db.conv_rows() if float(r["p"]).is_integer() and float(r["q"]).is_integer()]
    assert len(rows) > 200
    assert {r["profile"] for r in rows} == {"gtx-1080-ti", "titan-x-pascal", "v100-16gb-sxm2"}
    for r in rows:
        part = db.conv_part(r, weight_grad_only=False)
        out = (int(r["h"]) + 2 * int(r["pad_h"]) - int(r["r"])) // int(r["stride_h"]) + 1
        assert (out, out) == (int(float(r["p"])), int(float(r["q"]))), r
        tflops = part.fwd_flops / (float(r["fwd_ms"]) * 1e-3) / 1e12
        assert tflops == pytest.approx(float(r["fwd_tflops"]), rel=2e-3), r


def test_gemm_rows_are_complete():
    rows = db.gemm_rows()
    assert len(rows) > 600
    assert all(float(r["ms"]) > 0 and int(r["m"]) * int(r["n"]) * int(r["k"]) > 0 for r in rows)


CONV = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        return nn.Conv2d({c}, {k}, {r}, stride={stride}, padding={pad}, bias=False)

    def example_inputs(batch_size):
        return (torch.randn(batch_size, {c}, {hw}, {hw}),)

    def example_target(batch_size):
        return torch.randn(batch_size, {k}, {out}, {out})

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)
""")


@pytest.mark.parametrize("shape, kind", [
    (dict(c=8, k=16, r=3, stride=1, pad=1, hw=14), "conv3x3"),  # Winograd-eligible
    (dict(c=8, k=16, r=3, stride=1, pad=1, hw=7), "conv"),  # a 7x7 output: no Winograd gain (DeepBench)
    (dict(c=16, k=8, r=1, stride=2, pad=0, hw=14), "conv"),  # a strided 1x1
])
def test_a_kernel_is_the_cost_part_pipeplan_traces_for_it(tmp_path, shape, kind):
    import pipeplan

    out = (shape["hw"] + 2 * shape["pad"] - shape["r"]) // shape["stride"] + 1
    path = tmp_path / "conv.py"
    path.write_text(CONV.format(out=out, **shape))
    batch = 4
    graph = pipeplan.trace(str(path), batch, time_layers=False, fvcore_check=False)
    traced = [p for layer in graph.layers for p in layer.parts if p.kind in ("conv", "conv3x3")]
    assert len(traced) == 1
    row = {"n": str(batch), "c": str(shape["c"]), "k": str(shape["k"]), "h": str(shape["hw"]),
           "r": str(shape["r"]), "pad_h": str(shape["pad"]), "stride_h": str(shape["stride"])}
    built = db.conv_part(row, weight_grad_only=False)
    got = traced[0]
    assert got.kind == kind
    assert (built.kind, built.fwd_flops, built.bytes_moved, built.param_bytes, built.channels) == (
        got.kind, got.fwd_flops, got.bytes_moved, got.param_bytes, got.channels)
    assert built.bwd_flops == 2 * got.fwd_flops  # input and weight gradients (the traced input needs no gradient)
