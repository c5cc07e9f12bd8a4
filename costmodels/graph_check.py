"""Validate a graph.json document field by field before `Graph.from_dict` builds anything from it.

A graph is the planner's whole input: a negative FLOP count, a NaN time or a
string where bytes go would otherwise surface as an internal error inside a cost
model, or worse, as a plan. Every failure names the file, the layer (by index
and name) and the field (pipeplan/fields.py).
"""

from __future__ import annotations

import os
from typing import Any

from pipeplan.costmodels.graph import AUTOCAST_DEVICES, AUTOCAST_FIELDS, AUTOCAST_OPTIONAL
from pipeplan.fields import Fields

COUNTS = ("fwd_flops", "bwd_flops", "param_bytes", "frozen_param_bytes", "output_bytes", "saved_bytes", "bytes_moved",
          "transient_bytes", "deferred_grad_bytes", "loss_saved_bytes", "nonweight_saved_bytes", "input_saved_bytes",
          "input_nonweight_saved_bytes")
TIMES = ("fwd_s", "bwd_s")
HINT = "re-run `pipeplan trace` (docs/graph-format.md)"


PART_COUNTS = ("fwd_flops", "bwd_flops", "bytes_moved", "param_bytes", "ops", "layout_bytes", "channels")


def check_graph_doc(doc: dict[str, Any], path: str | os.PathLike[str], layer_kinds: tuple[str, ...],
                    part_kinds: tuple[str, ...] = ()) -> None:
    f = Fields(path, HINT)
    f.string(f.require(doc, "name", "name"), "name")
    f.integer(f.require(doc, "batch_size", "batch_size"), "batch_size", low=1)
    f.string(doc.get("dtype", "float32"), "dtype")
    f.integer(doc.get("input_bytes", 0), "input_bytes")
    for name, readers in f.mapping(doc.get("inputs", {}), "inputs").items():
        f.strings(readers, f"inputs.{name}")
    totals = f.mapping(doc.get("totals", {}), "totals")
    f.integer(totals.get("peak_activation_bytes", 0), "totals.peak_activation_bytes")
    f.mapping(doc.get("source", {}), "source")
    f.strings(doc.get("notes", []), "notes")
    seen: set[str] = set()
    for i, layer in enumerate(f.items(f.require(doc, "layers", "layers"), "layers", empty=False)):
        name = _check_layer(f, layer, i, layer_kinds)
        _check_parts(f, layer, f"layers[{i}] ({name[:40]!r})", part_kinds or layer_kinds)
        if name in seen:
            raise f.fail(f"layers[{i}].name", name, "unique (another layer has this name)")
        seen.add(name)
    for i, edge in enumerate(f.items(f.require(doc, "edges", "edges"), "edges")):
        field = f"edges[{i}]"
        f.string(f.require(edge, "src", f"{field}.src"), f"{field}.src")
        f.string(f.require(edge, "dst", f"{field}.dst"), f"{field}.dst")
        f.integer(f.require(edge, "bytes", f"{field}.bytes"), f"{field}.bytes")
        f.strings(edge.get("tensors", []), f"{field}.tensors")
    for i, shared in enumerate(f.items(doc.get("shared_params", []), "shared_params")):
        field = f"shared_params[{i}]"
        f.string(f.require(shared, "name", f"{field}.name"), f"{field}.name")
        f.integer(f.require(shared, "bytes", f"{field}.bytes"), f"{field}.bytes")
        f.strings(f.require(shared, "layers", f"{field}.layers"), f"{field}.layers", empty=False)


def _check_layer(f: Fields, layer: Any, i: int, layer_kinds: tuple[str, ...]) -> str:
    name = f.string(f.require(layer, "name", f"layers[{i}].name"), f"layers[{i}].name")
    field = f"layers[{i}] ({name[:40]!r})"
    kind = f.string(layer.get("kind", "other"), f"{field}.kind")
    if kind not in layer_kinds:
        raise f.fail(f"{field}.kind", kind, f"one of {', '.join(layer_kinds)}")
    f.string(layer.get("module", ""), f"{field}.module", empty=True)
    for key in COUNTS:
        f.integer(layer.get(key, 0), f"{field}.{key}")
    for key in TIMES:
        f.number(layer.get(key, 0.0), f"{field}.{key}")
    for tensor, size in f.mapping(layer.get("outputs", {}), f"{field}.outputs").items():
        f.integer(size, f"{field}.outputs[{tensor[:40]!r}]")
    f.strings(layer.get("params", []), f"{field}.params")
    f.strings(layer.get("frozen_params", []), f"{field}.frozen_params")
    if not set(layer.get("frozen_params", [])) <= set(layer.get("params", [])):
        raise f.fail(f"{field}.frozen_params", layer["frozen_params"], "names among the layer's params")
    f.strings(layer.get("nodes", []), f"{field}.nodes")
    for device, counts in f.mapping(layer.get("autocast", {}), f"{field}.autocast").items():
        if device not in AUTOCAST_DEVICES:
            raise f.fail(f"{field}.autocast", device, f"one of {', '.join(AUTOCAST_DEVICES)}")
        where = f"{field}.autocast.{device}"
        f.mapping(counts, where)
        for key in AUTOCAST_FIELDS:
            value = counts.get(key, 0) if key in AUTOCAST_OPTIONAL else f.require(counts, key, f"{where}.{key}")
            f.integer(value, f"{where}.{key}")
    if layer.get("frozen_param_bytes", 0) > layer.get("param_bytes", 0):
        raise f.fail(f"{field}.frozen_param_bytes", layer["frozen_param_bytes"],
                     "at most the layer's param_bytes (frozen parameters are some of its parameters)")
    _check_weight_grad(f, layer, field)
    _check_save_point(f, layer, field)
    return name


def _check_weight_grad(f: Fields, layer: Any, field: str) -> None:
    """Optional `bwd_weight_flops` and `bwd_weight_s` (null or absent: not split), each within the backward."""
    w = layer.get("bwd_weight_flops")
    if w is not None:
        f.integer(w, f"{field}.bwd_weight_flops")
    if w is not None and w > layer.get("bwd_flops", 0):
        raise f.fail(f"{field}.bwd_weight_flops", w, "at most the layer's bwd_flops (W is part of the backward)")
    _check_part_of(f, layer, field, "bwd_weight_s", "bwd_s", "W is part of the backward")


def _check_save_point(f: Fields, layer: Any, field: str) -> None:
    """Optional `last_save_s` (within the forward) and `saved_tensors` (a count), null or absent: not timed;
    optional `grad_accumulate_s` (within the backward)."""
    n = layer.get("saved_tensors")
    if n is not None:
        f.integer(n, f"{field}.saved_tensors")
    _check_part_of(f, layer, field, "last_save_s", "fwd_s", "the save is part of the forward")
    _check_part_of(f, layer, field, "grad_accumulate_s", "bwd_s", "the adds are part of the backward")


def _check_part_of(f: Fields, layer: Any, field: str, key: str, whole: str, why: str) -> None:
    """An optional time (null or absent: not measured) that is a part of the layer's time `whole`."""
    t = layer.get(key)
    if t is None:
        return
    f.number(t, f"{field}.{key}")
    if t > layer.get(whole, 0.0):
        raise f.fail(f"{field}.{key}", t, f"at most the layer's {whole} ({why})")


def _check_parts(f: Fields, layer: Any, field: str, part_kinds: tuple[str, ...]) -> None:
    """A layer's cost parts: known kinds, each once, counts that are integers >= 0, weights within bytes."""
    seen: set[str] = set()
    for j, part in enumerate(f.items(layer.get("parts", []), f"{field}.parts")):
        at = f"{field}.parts[{j}]"
        part = f.mapping(part, at)
        kind = f.string(f.require(part, "kind", f"{at}.kind"), f"{at}.kind")
        if kind not in part_kinds or kind in seen:
            raise f.fail(f"{at}.kind", kind, f"one of {', '.join(part_kinds)}, each once per layer")
        seen.add(kind)
        unknown = set(part) - {"kind", *PART_COUNTS}
        if unknown:
            raise f.fail(f"{at}", sorted(unknown)[0], f"only the keys kind, {', '.join(PART_COUNTS)}")
        for key in PART_COUNTS:
            f.integer(part.get(key, 0), f"{at}.{key}")
        if part.get("param_bytes", 0) > part.get("bytes_moved", 0):
            raise f.fail(f"{at}.param_bytes", part["param_bytes"], "at most the part's bytes_moved")
        if part.get("layout_bytes", 0) > part.get("bytes_moved", 0):
            raise f.fail(f"{at}.layout_bytes", part["layout_bytes"], "at most the part's bytes_moved")
