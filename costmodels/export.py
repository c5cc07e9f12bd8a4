"""torch.export the user's model and group its ATen nodes into layers: the structure, no timing.

Why torch.export: the exported program is the exact op list the runtime will later
split into pipeline stages, so a layer is defined as a list of that program's node
names and a plan's cuts map one-to-one onto the program. Grouping follows
`nn_module_stack` (which module call produced each op). Glue code that lives in a
container's own forward (residual adds, reshapes, concats, getitem) is folded into
the neighbouring layer, so layers are the modules a user recognises.
Everything here is derived from the graph alone, so the same model file and depth
give the same structure (and `Graph.fingerprint()`) at any batch size, unless the
model's own Python branches on the batch size (Hugging Face's mask code skips an
`expand` at batch 1): export is static, so such a model is a different program there.
"""

from __future__ import annotations

import io
import logging
import operator
import os
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from pipeplan.costmodels.graph import PART_KINDS, CostPart, Edge, Graph, Layer, SharedParam
from pipeplan.costmodels.model_file import ModelSpec, _cause, _user_frame_line, is_out_of_memory, out_of_memory_error
from pipeplan.errors import UserError

# Ops that do real work: a run of these is a layer of its own even when it sits in a
# container's forward (e.g. the attention core between two projections).
_HEAVY = ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "grouped_mm", "conv", "scaled_dot_product",
          "embedding", "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm", "softmax",
          "log_softmax", "flash_attention", "efficient_attention")
# Ops that only reinterpret memory: they move no bytes (excluded from bytes_moved) and run no kernel.
VIEW_OPS = ("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "slice", "select",
          "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach",
          "as_strided", "getitem", "unflatten", "flatten", "narrow", "lift_fresh_copy", "_assert_tensor_metadata",
          "sym_size", "sym_numel", "sym_stride")
_OTHER = ("max_pool", "avg_pool", "adaptive", "cat", "index", "gather", "scatter", "sort", "topk", "cumsum",
          "upsample", "pad", "constant_pad", "reflection_pad", "mean", "sum", "amax", "var")
_KIND_RULES = (  # (kind, op-name fragments), first match wins, in order of typical cost
    ("conv", ("conv",)),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    # grouped_mm: a mixture of experts' expert GEMMs (torch's _grouped_mm, transformers' grouped_mm_fallback)
    ("matmul", ("linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "einsum", "grouped_mm")),
    ("embedding", ("embedding",)),
    ("norm", ("layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm")),
)


def op_name(node: torch.fx.Node) -> str:
    """'addmm' for aten.addmm.default, 'getitem' for operator.getitem."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        name = packet.__name__
    return name.split(".")[0]


def _base(name: str) -> str:
    """'native_layer_norm' -> 'layer_norm', '_convolution' -> 'convolution': one spelling per op family."""
    name = name.lstrip("_")
    return name[len("native_"):] if name.startswith("native_") else name


def _matches(name: str, fragments: tuple[str, ...]) -> bool:
    base = _base(name)
    return any(base == f or base.startswith(f) for f in fragments)


def _is_heavy(node: torch.fx.Node) -> bool:
    return _matches(op_name(node), _HEAVY)


def tensor_bytes(val: Any) -> int:
    """Bytes of a tensor (or the tensors in a tuple/list) from node.meta['val']; symbols count 0."""
    if isinstance(val, torch.Tensor):
        try:
            return int(val.numel()) * val.element_size()
        except Exception:  # unbacked symbolic sizes
            return 0
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0


@contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and prints partial graphs to stderr on failure; the CLI reports one line."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch")]
    loggers.append(logging.getLogger("torch"))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextmanager
def plain_checkpoints() -> Iterator[list[int]]:
    """While export traces, the model's own torch.utils.checkpoint regions run as plain code; [calls] counted.

    pipeplan plans recomputation itself (`--recompute`) from what each layer computes once. Export already records
    a non-reentrant checkpoint's ops once; a reentrant one (CheckpointFunction) runs its function under no_grad, so
    the program would hold a region that trains nothing (torch 2.13: `wrap_with_set_grad_enabled(False)`). Here it
    calls the function directly instead; both kinds are counted, for the trace's note.
    """
    import torch.utils.checkpoint as ckpt

    calls = [0]
    generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return generator(*args, **kwargs)  # type: ignore[misc]  # not None where installed

    def direct(function: Any, _preserve_rng_state: bool, *args: Any) -> Any:
        calls[0] += 1
        return function(*args)

    if generator is not None:
        ckpt._checkpoint_without_reentrant_generator = counted
    ckpt.CheckpointFunction.apply = direct  # type: ignore[method-assign]  # shadows autograd.Function.apply here only
    try:
        yield calls
    finally:
        if generator is not None:
            ckpt._checkpoint_without_reentrant_generator = generator
        del ckpt.CheckpointFunction.apply


def export_program(spec: ModelSpec, model: torch.nn.Module, inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """torch.export (non-strict) in training mode; every failure is the user's model, so a UserError."""
    model.train()
    try:
        with quiet_torch_logs():
            return _without_dtype_asserts(torch.export.export(model, inputs, strict=False))
    except UserError:
        raise
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory_error(spec.path, "exporting the model (torch.export)", e) from e
        where = os.path.basename(spec.path) + _user_frame_line(e, spec.path)
        text = _cause(e)
        for cut in (" (unhinted", "  (Size-like", "\n"):
            text = text.split(cut)[0]
        hint = "torch.export must be able to trace forward() with example_inputs"
        low = str(e).lower()
        if "data-dependent" in low or "data dependent" in low or "guard" in low:
            hint = ("forward() branches on tensor values (data-dependent control flow); use torch.cond or "
                    "torch.where, or move the decision out of the model")
        raise UserError(f"{spec.path}: torch.export could not trace {spec.entry}() in {where}: {text}", hint) from e


def _without_dtype_asserts(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program less its `_assert_tensor_metadata` nodes, which hold a tensor to the dtype it had when traced.

    Why: export writes `x.to(torch.float32)` as such an assertion on x, then the `to`. A 16-bit plan runs the
    program under torch.autocast (the runtime's stages, the tracer's timing and its replay of autocast's casts),
    where x may be a matmul's bf16 output: Qwen3's and Cohere's query/key norms start with that `to`, so the
    assertion failed where eager PyTorch, which has none, converts. The `to` stays and converts as eager does.
    """
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default \
                and not node.users:
            graph.erase_node(node)
    ep.graph_module.recompile()
    return ep


def weight_free_model(spec: ModelSpec) -> tuple[torch.nn.Module, FakeTensorMode]:
    """The model with no weights in memory: built on the meta device, then every tensor made a fake CPU tensor.

    Why not stay on meta: meta kernels are not the CPU's. F.scaled_dot_product_attention
    on meta returns another memory layout, so the program exported there has an extra
    `contiguous` (another fingerprint, other bytes) than the real model's. Fake tensors
    on the CPU dispatch as the CPU does and still hold no memory. The tensors the user's
    code holds (parameters, buffers, tensor attributes) are swapped in place; a tensor
    under two names (tied weights) stays one tensor.
    """
    model = spec.build_on_meta()
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    swapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original kept alive, fake)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in swapped:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                f = torch.nn.Parameter(f, requires_grad=t.requires_grad)
            swapped[id(t)] = (t, f)
        return swapped[id(t)][1]

    for m in model.modules():
        for key, p in m._parameters.items():
            if p is not None:
                fake_p = fake(p)
                assert isinstance(fake_p, torch.nn.Parameter)  # a parameter is swapped for a parameter
                m._parameters[key] = fake_p
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = fake(b)
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):
                setattr(m, key, fake(value))
    return model, mode


def fake_leaves(mode: FakeTensorMode, value: Any) -> Any:
    """`value` (inputs, a target) with every tensor a fake tensor of `mode`: same shapes, devices and dtypes."""
    return pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)


@dataclass
class _Run:
    key: str
    nodes: list[torch.fx.Node] = field(default_factory=list)
    glue: bool = True


def _stack(node: torch.fx.Node) -> list[str]:
    """Module paths the op was called under, outermost first, root ('') left out."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if path:
            paths.append(path)
    return paths


def module_paths(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """The innermost module each op was called under, by node name ('' for the root module's own forward):
    what tells code after a block loop from the last block's own ops (costmodels/blocks.py)."""
    return {n.name: (_stack(n) or [""])[-1] for n in ep.graph.nodes if n.op == "call_function"}


def group_nodes(ep: torch.export.ExportedProgram, depth: int | None) -> list[tuple[str, str, list[torch.fx.Node]]]:
    """Split the call_function nodes into contiguous layers: [(name, module path, nodes)] in execution order."""
    if depth is not None and depth < 1:
        raise UserError(f"--depth {depth}: must be 1 or more", "omit --depth for leaf modules")
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    stacks = {n: _stack(n) for n in nodes}
    containers = {p for s in stacks.values() for p in s[:-1]}  # modules with child modules that ran ops

    key_of: dict[torch.fx.Node, str] = {}
    glue_of: dict[torch.fx.Node, bool] = {}
    for n in nodes:
        src = n.args[0] if n.target is operator.getitem and n.args else None
        if isinstance(src, torch.fx.Node) and src in key_of:  # a tuple element belongs with its producer
            key_of[n], glue_of[n] = key_of[src], True
            continue
        s = stacks[n]
        if not s:
            key, own = "", True
        elif depth is None:
            key, own = s[-1], True
        else:
            key, own = s[min(depth, len(s)) - 1], len(s) <= depth
        key_of[n] = key
        glue_of[n] = (key == "" or (own and key in containers)) and not _is_heavy(n)

    runs: list[_Run] = []
    for n in nodes:
        if not runs or runs[-1].key != key_of[n]:
            runs.append(_Run(key_of[n]))
        runs[-1].nodes.append(n)
        runs[-1].glue = runs[-1].glue and glue_of[n]

    # Fold glue runs into the previous real layer (leading glue into the next one).
    merged: list[_Run] = []
    pending: list[torch.fx.Node] = []
    for r in runs:
        if r.glue and (merged or r is not runs[-1]):
            if merged:
                merged[-1].nodes.extend(r.nodes)
            else:
                pending.extend(r.nodes)
            continue
        r.nodes = pending + r.nodes
        pending = []
        if merged and merged[-1].key == r.key:
            merged[-1].nodes.extend(r.nodes)
        else:
            merged.append(r)
    if pending:  # only glue in the whole model
        merged.append(_Run("", pending, False))

    seen: dict[str, int] = {}
    out = []
    for r in merged:
        base = r.key or "root"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}:{seen[base]}"
        out.append((name, r.key, r.nodes))
    return out


def _layer_kind(nodes: list[torch.fx.Node]) -> str:
    """The layer's dominant op family (the most expensive family present wins)."""
    names = [op_name(n) for n in nodes]
    for kind, fragments in _KIND_RULES:
        if any(_matches(n, fragments) for n in names):
            return kind
    if any(_matches(n, _OTHER) for n in names):
        return "other"
    return "elementwise"


def node_kind(node: torch.fx.Node) -> str | None:
    """The op family of one node (conv/attention/matmul/embedding/norm), None for anything else."""
    name = op_name(node)
    for kind, fragments in _KIND_RULES:
        if _matches(name, fragments):
            return kind
    return None


# The smallest output side at which cuDNN's Winograd convolutions beat the direct FLOP rate. DeepBench's 3x3 stride-1
# convolutions (benchmarks/published/deepbench/conv.csv; cuDNN 5, 6 and 7.6 on a Titan X Pascal, a GTX 1080 Ti and
# a V100, fp32): on 7x7 outputs (ResNet's last stage, 256-512 channels, batch 8 and 16; 15 kernels) their forward
# and input gradient ran at 0.38-0.88 of the FP32 peak in direct FLOPs, whatever algorithm cudnnFind picked
# (WINOGRAD or IMPLICIT_PRECOMP_GEMM), the implicit GEMM's rate; with 256-512 channels on 14x14 and 28x28 outputs
# (18 kernels) at 1.04-2.35. (Weight gradients: 0.20-1.32 against 0.55-2.46.) An output that small has few
# of Winograd's output tiles per image to spread its input and output transforms over (Lavin & Gray 2016, §4), and
# too few output positions to fill the GPU either way. Judgement: the side between the two measured sizes.
WINOGRAD_MIN_OUTPUT_SIDE = 8


def _winograd_eligible(node: torch.fx.Node) -> bool:
    """A dense 3x3 convolution with stride 1 and no dilation: the shapes Winograd's F(2x2, 3x3) applies to, on an
    output image of at least `WINOGRAD_MIN_OUTPUT_SIDE` per side (smaller ones run at the direct rate).

    Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks" (CVPR 2016), §4:
    F(m x m, 3 x 3) for unit stride; cuDNN's WINOGRAD algorithms take 3x3 filters, stride 1.
    aten.convolution / conv2d args: (input, weight, bias, stride, padding, dilation, [transposed,
    output_padding,] groups).
    """
    args = list(node.args)
    weight = getattr(args[1], "meta", {}).get("val") if len(args) > 1 else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        return False
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor) and out.dim() == 4 and min(out.shape[2:]) < WINOGRAD_MIN_OUTPUT_SIDE:
        return False
    stride: Any = args[3] if len(args) > 3 else [1, 1]
    dilation: Any = args[5] if len(args) > 5 else [1, 1]
    groups: Any = args[-1] if len(args) > 6 else 1
    if len(args) > 6 and args[6] is True:  # aten.convolution's transposed flag
        return False
    return set(stride) == {1} and set(dilation) == {1} and groups == 1


_DROPOUT = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")


def part_kind(node: torch.fx.Node) -> str | None:
    """The cost-part kind of one node (graph.PART_KINDS), None for views, which run no kernel."""
    name = op_name(node)
    if name in VIEW_OPS:
        return None
    kind = node_kind(node)
    if kind == "conv" and _winograd_eligible(node):
        return "conv3x3"
    if kind is not None:
        return kind
    if _matches(name, _DROPOUT):
        return "dropout"
    return "other" if _matches(name, _OTHER) else "elementwise"


def _node_bytes(node: torch.fx.Node) -> int:
    """One op's unfused traffic: its inputs read and its outputs written (see `_bytes_moved`)."""
    return tensor_bytes(node.meta.get("val")) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)


def _channels_first_bytes(node: torch.fx.Node) -> int:
    """A 2-D convolution's input + output bytes when its input is laid out channels-first (NCHW), else 0.

    PyTorch's default layout is NCHW; a model moved to `torch.channels_last` (NHWC) has strides with the channels
    innermost, which the export's fake tensors keep. A tensor that is both (1x1 spatial) needs no transpose.
    """
    val, inp = node.meta.get("val"), node.args[0] if node.args else None
    x = getattr(inp, "meta", {}).get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(val, torch.Tensor) or x.dim() != 4:
        return 0
    try:
        if x.is_contiguous(memory_format=torch.channels_last):
            return 0
    except Exception:  # symbolic strides that cannot be decided: assume the native layout, no transpose
        return 0
    return tensor_bytes(x) + tensor_bytes(val)


def _conv_channels(node: torch.fx.Node) -> int:
    """A convolution's narrower channel count, min(output channels, input channels per group), from its weight
    (C_out, C_in / groups, kh, kw; transposed: C_in, C_out / groups, ...): the implicit GEMM's output columns or
    the reduction's channels, whichever is fewer. 0 where the weight's shape is not known."""
    w = node.args[1] if len(node.args) > 1 else None
    val = getattr(w, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 3:
        return 0
    try:
        return int(min(val.shape[0], val.shape[1]))
    except Exception:  # symbolic sizes
        return 0


def _batch_norm_channels(node: torch.fx.Node) -> int:
    """A batch norm's channel count where its input is laid out channels-first (N, C, ...), else 0 (a channels-last
    input, a layer or group norm, a shape not known).

    Why: NCHW batch norm kernels reduce each channel in one thread block (torch's cunn BatchNormalization.cu and its
    ports launch `blocks(input.getSize(1))`), so a layer with few channels leaves the GPU's bandwidth idle
    (part_costs.channel_factor). A channels-last batch norm reduces across channels, block by block of positions.
    """
    first = node.args[0] if node.args else None
    x = getattr(first, "meta", {}).get("val")
    if "batch_norm" not in op_name(node) or not isinstance(x, torch.Tensor) or x.dim() < 3:
        return 0
    try:
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            return 0
        return int(x.shape[1])
    except Exception:  # symbolic sizes
        return 0


def _dropout_mask_bytes(node: torch.fx.Node) -> int:
    """The mask dropout writes in training, one byte per element (aten native_dropout's bool mask)."""
    val = node.meta.get("val")  # aten.dropout: the output alone (native_dropout's mask output is counted already)
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def cost_parts(nodes: list[torch.fx.Node], node_flops: dict[str, int], param_inputs: set[str],
               bwd_flops: int) -> list[CostPart]:
    """A layer's ops summed per part kind (graph.CostPart), in PART_KINDS order.

    Backward FLOPs are attributed per layer by the counter, not per op; they are
    shared among the parts in proportion to forward FLOPs (a GEMM's backward is two
    GEMMs of its forward's size, Narayanan et al. 2021 App., and FLOP-free parts
    have FLOP-free backwards up to elementwise arithmetic).
    """
    acc: dict[str, list[int]] = {}
    for n in nodes:
        kind = part_kind(n) if n.op == "call_function" else None
        if kind is None:
            continue
        a = acc.setdefault(kind, [0, 0, 0, 0, 0, 0, 0])
        a[0] += node_flops.get(n.name, 0)
        a[1] += _node_bytes(n) + (_dropout_mask_bytes(n) if kind == "dropout" else 0)
        a[2] += sum(tensor_bytes(x.meta.get("val")) for x in n.all_input_nodes if x.name in param_inputs)
        a[3] += 1
        a[4] += _channels_first_bytes(n) if kind in ("conv", "conv3x3") else 0
        a[5] += node_flops.get(n.name, 0) * _conv_channels(n) if kind in ("conv", "conv3x3") else 0
        bn_channels = _batch_norm_channels(n) if kind == "norm" else 0
        a[5] += _node_bytes(n) * bn_channels
        a[6] += _node_bytes(n) if bn_channels else 0
    fwd_total = sum(a[0] for a in acc.values())
    ops_total = sum(a[3] for a in acc.values())
    parts = []
    for kind in PART_KINDS:
        if kind in acc:
            f, b, w, ops, layout, channel_weight, weight = acc[kind]
            weight = weight if kind == "norm" else f  # norms: their batch norms' bytes; convolutions: FLOPs
            share = f / fwd_total if fwd_total else ops / ops_total
            parts.append(CostPart(kind=kind, fwd_flops=f, bwd_flops=round(bwd_flops * share), bytes_moved=b,
                                  param_bytes=min(w, b), ops=ops, layout_bytes=min(layout, b),
                                  channels=round(channel_weight / weight) if weight else 0))
    return parts


# Passes over the model's output that the loss makes, outside the exported forward: cross-entropy reads the
# logits and writes their log-softmax (aten log_softmax; nll_loss then reads one entry per row), and in
# backward log_softmax_backward reads the gradient and the output and writes the logits' gradient (4 more,
# BACKWARD_BYTES_FACTOR x these 2); a regression loss (mse) reads output and target the same way.
LOSS_OUTPUT_PASSES = 2


def with_loss(parts: list[CostPart], output_bytes: int) -> list[CostPart]:
    """A layer's parts plus the loss over `output_bytes` of model output it produces (an "other" part).

    The trace exports the model's forward only; for a language model the loss over a
    50k-word vocabulary moves more bytes per token than a small decoder block.
    """
    if output_bytes <= 0:
        return parts
    add = CostPart(kind="other", bytes_moved=LOSS_OUTPUT_PASSES * output_bytes, ops=2)
    out = [p for p in parts if p.kind != "other"]
    old = next((p for p in parts if p.kind == "other"), None)
    if old is not None:
        add = CostPart(kind="other", fwd_flops=old.fwd_flops, bwd_flops=old.bwd_flops,
                       bytes_moved=old.bytes_moved + add.bytes_moved, param_bytes=old.param_bytes, ops=old.ops + 2)
    out.append(add)
    return sorted(out, key=lambda p: PART_KINDS.index(p.kind))


def user_output_bytes(ep: torch.export.ExportedProgram) -> dict[str, int]:
    """Node name -> bytes of each tensor the program returns to the caller (what the loss reads)."""
    names = {s.arg.name for s in ep.graph_signature.output_specs
             if s.kind == OutputKind.USER_OUTPUT and getattr(s.arg, "name", None)}
    return {n.name: tensor_bytes(n.meta.get("val")) for n in ep.graph.nodes if n.name in names}


def param_input_names(ep: torch.export.ExportedProgram) -> set[str]:
    """Placeholder names of the program's parameters and buffers (reads of them do not grow with the batch)."""
    return {s.arg.name for s in ep.graph_signature.input_specs
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and getattr(s.arg, "name", None)}


def _bytes_moved(nodes: list[torch.fx.Node]) -> int:
    """Unfused memory traffic of one forward: each non-view op reads its inputs and writes its outputs.

    A rough upper bound on traffic (eager PyTorch does not fuse), used only by the
    roofline's memory term.
    """
    total = 0
    for n in nodes:
        if op_name(n) in VIEW_OPS:
            continue
        total += tensor_bytes(n.meta.get("val"))
        total += sum(tensor_bytes(a.meta.get("val")) for a in n.all_input_nodes)
    return total


def _own(layer: Layer, p: torch.nn.Parameter) -> None:
    """Charge a parameter's bytes to the layer owning it, and to its frozen bytes where it needs no gradient."""
    nbytes = p.numel() * p.element_size()
    layer.param_bytes += nbytes
    layer.frozen_param_bytes += 0 if p.requires_grad else nbytes


def build_structure(ep: torch.export.ExportedProgram, model: torch.nn.Module, *, name: str, batch_size: int,
                    depth: int | None, input_bytes: int) -> Graph:
    """The layer graph of an exported program: layers, edges, parameters, sharing; no measurements."""
    sig = ep.graph_signature
    placeholder_param = {s.arg.name: s.target for s in sig.input_specs if s.kind == InputKind.PARAMETER}
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    user_outputs = {s.arg.name for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT
                    and getattr(s.arg, "name", None)}

    groups = group_nodes(ep, depth)
    layer_of: dict[str, int] = {}
    for i, (_, _, nodes) in enumerate(groups):
        for n in nodes:
            layer_of[n.name] = i

    # Parameters: identity decides sharing (tied weights are one tensor under two names).
    named = dict(model.named_parameters(remove_duplicate=False))
    owner_of_tensor: dict[int, int] = {}
    users_of_tensor: dict[int, list[int]] = {}
    layers: list[Layer] = []
    edges: dict[tuple[int, int], dict[str, int]] = {}
    inputs: dict[str, list[str]] = {}
    for i, (lname, key, nodes) in enumerate(groups):
        params: list[str] = []
        outputs: dict[str, int] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    if a.name in placeholder_param:
                        fqn = placeholder_param[a.name]
                        if fqn not in params:
                            params.append(fqn)
                    elif a.name in user_inputs:
                        readers = inputs.setdefault(a.name, [])
                        if lname not in readers:
                            readers.append(lname)
                elif a.op == "call_function" and layer_of[a.name] != i:
                    src = layer_of[a.name]
                    edges.setdefault((src, i), {})[a.name] = tensor_bytes(a.meta.get("val"))
        layers.append(Layer(name=lname, kind=_layer_kind(nodes), module=key, params=params,
                            frozen_params=[f for f in params if f in named and not named[f].requires_grad],
                            nodes=[n.name for n in nodes], bytes_moved=_bytes_moved(nodes), outputs=outputs))
        for fqn in params:
            p = named.get(fqn)
            if p is None:
                continue
            users_of_tensor.setdefault(id(p), [])
            if i not in users_of_tensor[id(p)]:
                users_of_tensor[id(p)].append(i)
            if id(p) not in owner_of_tensor:
                owner_of_tensor[id(p)] = i
                _own(layers[i], p)

    for (src, _dst), tensors in edges.items():
        layers[src].outputs.update(tensors)
    for n in ep.graph.nodes:
        if n.name in user_outputs and n.name in layer_of:
            layers[layer_of[n.name]].outputs[n.name] = tensor_bytes(n.meta.get("val"))
    for layer in layers:
        layer.output_bytes = sum(layer.outputs.values())

    notes: list[str] = []
    # Parameters no op reads still take memory: give them to the layer of their module.
    by_id: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for fqn, p in named.items():
        by_id.setdefault(id(p), (fqn, p))
    unused = [(fqn, p) for pid, (fqn, p) in by_id.items() if pid not in owner_of_tensor]
    for fqn, p in unused:  # the innermost layer whose module contains it, else the first layer
        holders = [j for j, l in enumerate(layers) if l.module and fqn.startswith(l.module + ".")]
        best = max(holders, key=lambda j: len(layers[j].module)) if holders else 0
        _own(layers[best], p)
        owner_of_tensor[id(p)] = best
    if unused:
        notes.append(f"{len(unused)} parameter(s) are not used by forward() (e.g. {unused[0][0]}); "
                     "their bytes are charged to the layer of their module, or to the first layer")

    shared: list[SharedParam] = []
    for pid, (fqn, p) in by_id.items():
        users = users_of_tensor.get(pid, [])
        aliases = [n for n, q in named.items() if q is p]
        if len(users) > 1 or len(aliases) > 1:
            shared.append(SharedParam(name=fqn, bytes=p.numel() * p.element_size(),
                                      layers=[layers[j].name for j in sorted(users)]))

    edge_list = [Edge(src=layers[s].name, dst=layers[d].name, bytes=sum(t.values()), tensors=sorted(t))
                 for (s, d), t in sorted(edges.items())]
    return Graph(name=name, layers=layers, edges=edge_list, batch_size=batch_size, input_bytes=input_bytes,
                 inputs=inputs, shared_params=shared, notes=notes)

