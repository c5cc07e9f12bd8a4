"""Per layer, the bytes a 16-bit step under torch.autocast holds, for each device's autocast lists.

Why a second count: the tracer counts bytes in fp32, and half of them is what DeepSpeed's and Megatron's recipes
hold (16-bit weights, so 16-bit activations throughout) but not what torch.autocast holds, which is how
`pipeplan run` trains a bf16 or fp16 plan (costmodels/autocast_policy.py says what differs). The same fake step
is counted again with autocast's casts replayed, once per device's lists (graph.AUTOCAST_DEVICES), so a plan for a GPU
and one for this CPU each get their own. bf16 and fp16 take the same bytes, so one count serves both. Saved bytes
need the forward and the loss only (measure.count_saved); what is in flight needs the backward too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeplan.costmodels.autocast_policy import Casts, cast_kind, op_name
from pipeplan.costmodels.graph import AUTOCAST_DEVICES, Graph
from pipeplan.costmodels.measure import count_saved
from pipeplan.costmodels.model_file import ModelSpec
from pipeplan.costmodels.transient import transient_bytes


def count_autocast(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: Any,
                   target: Any, layer_of: dict[str, int], graph: Graph,
                   param_shapes: Sequence[set[tuple[int, ...]]]) -> None:
    """Fill each layer's `autocast` with its byte counts under each device's autocast lists.

    Left empty (with a note) where the replayed step fails: a 16-bit plan is then priced at half the fp32 bytes.
    """
    n = len(graph.layers)
    counted: dict[str, list[dict[str, int]]] = {}
    try:
        for device in AUTOCAST_DEVICES:
            same = next((d for d in counted if same_casts(ep, d, device)), None)
            if same is not None:  # the two lists treat every op of this program alike: the same step, counted once
                counted[device] = [dict(c) for c in counted[same]]
                continue
            counts = count_saved(ep, model, spec, inputs, target, layer_of, n, Casts(device, torch.bfloat16))
            flight = transient_bytes(ep, model, spec, inputs, target, layer_of, n, param_shapes,
                                     casts=Casts(device, torch.bfloat16))
            counted[device] = [
                {"saved_bytes": int(counts.saved_bytes[i]),
                 "output_bytes": sum(counts.node_out_bytes.get(t, size) for t, size in layer.outputs.items()),
                 "transient_bytes": int(flight.transient[i]), "deferred_grad_bytes": int(flight.deferred[i]),
                 "loss_saved_bytes": int(flight.loss_saved[i]), "nonweight_saved_bytes": int(flight.nonweight_saved[i]),
                 "input_saved_bytes": int(flight.input_saved[i]),
                 "input_nonweight_saved_bytes": int(flight.input_nonweight_saved[i])}
                for i, layer in enumerate(graph.layers)]
    except Exception as e:  # an op autocast's replay cannot run on fake tensors: keep the fp32 count only
        graph.notes.append(f"bytes under torch.autocast were not counted ({type(e).__name__}); a 16-bit plan's "
                           "activations are priced at half the fp32 bytes")
        return
    for i, layer in enumerate(graph.layers):
        layer.autocast = {device: counted[device][i] for device in AUTOCAST_DEVICES}


def same_casts(ep: torch.export.ExportedProgram, a: str, b: str) -> bool:
    """Whether autocast on devices `a` and `b` casts the inputs of every op of the program alike, so that replaying
    one device's lists counts the other's bytes too. Only the forward's ops are cast (their backward follows the
    dtypes autocast chose), and the loss runs under the same context for both (`Casts.loss_context`). A
    convolutional net often qualifies (convolutions and matmuls 16-bit on both, its norms and pools on neither);
    a transformer does not (CUDA's lists run layer_norm and softmax in fp32, the CPU's leave them)."""
    names = {op_name(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    return all(cast_kind(a, name) == cast_kind(b, name) for name in names)
