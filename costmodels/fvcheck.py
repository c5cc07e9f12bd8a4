"""Cross-check FlopCounterMode's forward FLOPs against fvcore's per-module counts.

Two independent counters (dispatch-level vs TorchScript-trace-level) agreeing is
evidence that the per-layer FLOPs the planner balances on are right. fvcore counts
multiply-adds, so its numbers are doubled; it runs on a meta-device copy of the
model at batch 1 (no arithmetic) and is scaled by the batch size, which is exact
for matmuls and convolutions. Only those op families are compared: fvcore and
FlopCounterMode disagree *by design* on norms and elementwise ops (fvcore counts
some, FlopCounterMode none), and fvcore does not count fused attention at all,
which is reported as a disagreement of its own.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, TypeAlias

import torch

from pipeplan.costmodels.blocks import Repeat, expand_module_counts, shortened
from pipeplan.costmodels.graph import Graph, Layer
from pipeplan.costmodels.model_file import ModelSpec

# fvcore operator names (TorchScript) that are matmuls or convolutions.
_FV_DENSE = {"linear", "addmm", "matmul", "mm", "bmm", "einsum", "conv", "_convolution", "baddbmm", "conv2d",
             "conv1d", "conv3d", "conv_transpose"}
_OUR_DENSE = {"matmul", "conv"}  # node families (export.node_kind) fvcore also counts
TOLERANCE = 0.01

# FlopCountAnalysis.by_module_and_operator() (module -> operator -> multiply-adds) and .unsupported_ops()
# (operator -> count); fvcore has no type information, so these say what it returns.
_Analysis: TypeAlias = tuple[dict[str, dict[str, int]], dict[str, int]]


def _fvcore_counts(spec: ModelSpec, model: torch.nn.Module | None, repeat: Repeat | None = None) -> tuple[_Analysis, str]:
    """FlopCountAnalysis at batch 1, on the meta device when the model allows it (no compute).

    Else on `model`, the real one; a weight-free trace has none (None) and the check is skipped.
    `repeat` (the blocks the tracer traced a few of and cloned, costmodels/blocks.py): fvcore runs on the
    model cut to those blocks too, and its counts are cloned to the whole model's modules the same way
    (`blocks.expand_module_counts`): its jit trace of all of Llama-3-70B's 80 blocks took 4-5 s of README's
    ~25 s `analyze`, 0.2 s cut. Where the cut model does not trace, the whole one is.
    """
    from fvcore.nn import FlopCountAnalysis

    def analyse(m: torch.nn.Module, x: tuple[Any, ...]) -> _Analysis:
        fca = FlopCountAnalysis(m, x)
        fca.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
        by_module: dict[str, dict[str, int]] = fca.by_module_and_operator()
        return by_module, dict(fca.unsupported_ops())

    def analyse_blocks(m: torch.nn.Module, x: tuple[Any, ...]) -> _Analysis:
        if repeat is not None:
            try:
                with shortened(m, repeat):
                    by_module, unsupported = analyse(m, x)
                return expand_module_counts(by_module, repeat), unsupported
            except Exception:
                pass
        return analyse(m, x)

    logging.getLogger("fvcore").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            meta_model = spec.build_on_meta()
            meta_model.train()
            x = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in spec.example_inputs(1))
            return analyse_blocks(meta_model, x), "meta"
        except Exception:
            if model is None:
                raise
        return analyse_blocks(model, spec.example_inputs(1)), "cpu"


def compare(spec: ModelSpec, graph: Graph, batch_size: int, node_flops: dict[str, int],
            family: dict[str, str | None], model: torch.nn.Module | None) -> list[str]:
    """Notes for Graph.notes: each disagreement beyond 1%, or why the check could not run."""
    record = graph.source.get("repeated_blocks")
    repeat = Repeat(**record) if record else None
    try:
        (by_module, unsupported), _where = _fvcore_counts(spec, model, repeat)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        where = " on the meta device (a weight-free trace has no real model to try)" if model is None else ""
        return [f"fvcore cross-check skipped: fvcore could not trace the model{where} ({type(e).__name__}: {first})"]

    def fv_dense(module: str) -> float:
        return 2.0 * batch_size * sum(v for op, v in by_module.get(module, {}).items() if op in _FV_DENSE)

    def ours_dense(layer: Layer) -> int:
        return sum(node_flops.get(n, 0) for n in layer.nodes if family.get(n) in _OUR_DENSE)

    notes = []
    modules = [l.module for l in graph.layers]
    repeated = {m for m in modules if modules.count(m) > 1}
    bad = []
    for layer in graph.layers:
        m = layer.module
        if not m or m in repeated or any(o.startswith(m + ".") for o in modules if o):
            continue  # only layers that are exactly one module call compare like for like
        ours, theirs = ours_dense(layer), fv_dense(m)
        if abs(ours - theirs) > TOLERANCE * max(ours, theirs, 1):
            bad.append(f"{layer.name} {ours:.4g} vs fvcore {theirs:.4g}")
    if bad:
        notes.append(f"FLOPs disagree with fvcore on {len(bad)} layer(s) (FlopCounterMode vs fvcore, matmul/conv "
                     f"only): " + "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    ours_total = sum(ours_dense(l) for l in graph.layers)
    theirs_total = fv_dense("")
    if abs(ours_total - theirs_total) > TOLERANCE * max(ours_total, theirs_total, 1):
        notes.append(f"total matmul/conv forward FLOPs disagree: FlopCounterMode {ours_total:.4g}, "
                     f"fvcore {theirs_total:.4g} ({(theirs_total - ours_total) / max(ours_total, 1):+.1%})")
    missed: dict[str, int] = {}
    for layer in graph.layers:
        for n in layer.nodes:
            if family.get(n) not in _OUR_DENSE and node_flops.get(n, 0) > 0:
                missed[family.get(n) or "other"] = missed.get(family.get(n) or "other", 0) + node_flops[n]
    if missed:
        ops = ", ".join(f"{k}" for k in sorted(unsupported) if "attention" in k or "einsum" in k) or "them"
        for kind, flops in sorted(missed.items()):
            notes.append(f"fvcore does not count {kind} ops ({ops}): FlopCounterMode counts {flops:.4g} forward "
                         f"FLOPs there that fvcore reports as 0")
    return notes
