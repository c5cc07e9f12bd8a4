"""`trace`: a user's model file in, a measured layer graph (pipeplan.graph/v1) out.

The steps are kept apart so the runtime can reuse the structural one:
`export_structure` (torch.export + grouping, no timing; cheap and deterministic,
called on every rank) and the measurements in `measure.py` / `fvcheck.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeplan.costmodels.export import build_structure, export_program, node_kind, tensor_bytes
from pipeplan.costmodels.graph import Graph, Layer
from pipeplan.costmodels.model_file import ModelSpec, load_model_file
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.allocator import keep_freed_memory

Progress = Callable[[str, int, int], None]


def _input_bytes(inputs: Any) -> int:
    return sum(tensor_bytes(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))


def _check_batch(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch size {batch_size!r} must be a positive integer", "pass --batch-size N with N >= 1")


def export_structure(spec: ModelSpec, batch_size: int, *, depth: int | None = None,
                     model: torch.nn.Module | None = None) -> tuple[torch.export.ExportedProgram, Graph]:
    """Export `model` (default: a fresh spec.build()) at `batch_size` and group its nodes into layers.

    No timing and no FLOP counting: the Graph has structure, parameters, bytes per
    tensor and bytes_moved only. Same model file + depth -> same fingerprint at any batch size.
    """
    _check_batch(batch_size)
    if model is None:
        model = spec.build()
    inputs = spec.example_inputs(batch_size)
    ep = export_program(spec, model, inputs)
    name = os.path.splitext(os.path.basename(spec.path))[0]
    if spec.entry != "build_model":
        name = f"{name}:{spec.entry}"
    graph = build_structure(ep, model, name=name, batch_size=batch_size, depth=depth, input_bytes=_input_bytes(inputs))
    if not graph.layers:
        raise UserError(f"{spec.path}: {spec.entry}() has no operations to trace", "the model's forward() does nothing")
    graph.source = {
        "model_file": spec.path,
        "entry": spec.entry,
        "depth": depth,
        "batch_size": batch_size,
        "torch": torch.__version__,
        "device": "cpu",
        "repeats": None,
        # Measured times depend on the thread count; the cost models compare it with a local profile's device.
        "threads": torch.get_num_threads(),
    }
    return ep, graph


def trace(model_file: str, batch_size: int, *, entry: str = "build_model", depth: int | None = None,
          repeats: int | None = None, progress: Progress | None = None, fvcore_check: bool = True) -> Graph:
    """The full measured graph: structure, FLOPs, saved bytes, times; fvcore cross-check notes."""
    from pipeplan.costmodels import fvcheck, measure

    def report(phase: str, done: int, total: int) -> None:
        if progress is not None:
            progress(phase, done, total)

    _check_batch(batch_size)
    if repeats is not None and repeats < 1:
        raise UserError(f"--repeats {repeats}: must be 1 or more", "omit --repeats for an automatic count")
    report("loading model file", 0, 1)
    spec = load_model_file(model_file, entry)
    model = spec.build()
    report("loading model file", 1, 1)
    report("exporting (torch.export)", 0, 1)
    ep, graph = export_structure(spec, batch_size, depth=depth, model=model)
    report("exporting (torch.export)", 1, 1)
    inputs = spec.example_inputs(batch_size)
    target = spec.example_target(batch_size)
    layer_of = {n: i for i, layer in enumerate(graph.layers) for n in layer.nodes}
    n = len(graph.layers)
    family = {node.name: node_kind(node) for node in ep.graph.nodes if node.op == "call_function"}

    report("counting FLOPs and saved bytes", 0, 1)
    try:
        counts = measure.count_pass(ep, model, spec, inputs, target, layer_of, n)
    except UserError:
        raise
    except Exception as e:  # an op without a fake-tensor implementation: count on real tensors instead
        graph.notes.append(f"FLOPs and saved bytes were counted on a real step (fake tensors failed: "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''})")
        counts = measure.count_pass(ep, model, spec, inputs, target, layer_of, n, fake_tensors=False)
    report("counting FLOPs and saved bytes", 1, 1)

    keep_freed_memory()  # as the runtime's ranks run: see hardware_profiles/allocator.py
    timing = measure.time_pass(ep, model, spec, inputs, target, layer_of, n, repeats=repeats,
                               progress=report)
    for i, layer in enumerate(graph.layers):
        layer.fwd_s = timing.fwd_s[i]
        layer.bwd_s = timing.bwd_s[i]
        layer.fwd_flops = int(counts.fwd_flops[i])
        layer.bwd_flops = int(counts.bwd_flops[i])
        layer.saved_bytes = int(counts.saved_bytes[i])
        layer.kind = _refine_kind(layer, counts.node_flops, family)
    graph.peak_activation_bytes = int(counts.peak_saved_bytes)
    graph.source["repeats"] = timing.repeats

    if fvcore_check:
        report("cross-checking FLOPs with fvcore", 0, 1)
        graph.notes.extend(fvcheck.compare(spec, graph, batch_size, counts.node_flops, family, model))
        report("cross-checking FLOPs with fvcore", 1, 1)
    return graph


def _refine_kind(layer: Layer, node_flops: dict[str, int], family: dict[str, str | None]) -> str:
    """With FLOPs known, the kind is the op family with the most FLOPs (a whole block: matmul, not attention)."""
    by_kind: dict[str, int] = {}
    for node_name in layer.nodes:
        kind, f = family.get(node_name), node_flops.get(node_name, 0)
        if kind is not None and f > 0:
            by_kind[kind] = by_kind.get(kind, 0) + f
    return max(by_kind, key=by_kind.__getitem__) if by_kind else layer.kind
