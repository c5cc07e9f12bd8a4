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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from pipeplan.choices import DTYPES
from pipeplan.costmodels import blocks, gpu_attention, hf_config
from pipeplan.costmodels.autocast_bytes import count_autocast
from pipeplan.costmodels.dtype_support import unsupported_dtype_as_user_error
from pipeplan.costmodels.export import (
    build_structure,
    cost_parts,
    export_program,
    fake_leaves,
    module_paths,
    node_kind,
    param_input_names,
    plain_checkpoints,
    tensor_bytes,
    user_output_bytes,
    weight_free_model,
    with_loss,
)
from pipeplan.costmodels.graph import Graph, Layer, trainable_params
from pipeplan.costmodels.model_file import (
    ModelSpec,
    OutOfMemory,
    _cause,
    check_fits_in_ram,
    load_model_file,
    out_of_memory_as_user_error,
)
from pipeplan.costmodels.transient import InFlight, transient_bytes
from pipeplan.errors import UserError
from pipeplan.hardware_profiles.allocator import keep_freed_memory
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.precision import training_precision

Progress = Callable[[str, int, int], None]


def _input_bytes(inputs: Any) -> int:
    return sum(tensor_bytes(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))


def _check_batch(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch size {batch_size!r} must be a positive integer", "pass --batch-size N with N >= 1")


TRACE_DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str, profile: HardwareProfile | None = None) -> str:
    """The device layers are timed on: "cpu" or "cuda".

    auto: "cuda" when a GPU is visible, unless the profile is a CPU calibration (a local
    profile not measured on CUDA), whose device is one core; "cpu" otherwise. A catalogue
    GPU profile with a GPU visible also times on CUDA: a plan on that GPU's own profile takes
    the times (compute.uses_measured_times), any other only with --times measured, where the
    GPU's own times are the ones that mean anything.
    "cuda" without a visible GPU is the user's error.
    """
    if requested not in TRACE_DEVICES:
        raise UserError(f"--device {requested!r}: unknown device", f"use one of {', '.join(TRACE_DEVICES)}")
    visible = torch.cuda.is_available()
    if requested == "cuda" and not visible:
        raise UserError("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is false)",
                        "run on a machine with a GPU and a CUDA build of torch, or pass --device cpu")
    if requested != "auto":
        return requested
    cpu_profile = profile is not None and profile.local_cpu()
    return "cuda" if visible and not cpu_profile else "cpu"


def _device_source(device: torch.device) -> dict[str, Any]:
    """What graph.json's source says about the timing device: "cpu", or "cuda" and the GPU's name."""
    if device.type != "cuda":
        return {"device": "cpu"}
    return {"device": "cuda", "device_name": torch.cuda.get_device_name(device)}


def export_structure(spec: ModelSpec, batch_size: int, *, depth: int | None = None,
                     model: torch.nn.Module | None = None,
                     inputs: tuple[Any, ...] | None = None) -> tuple[torch.export.ExportedProgram, Graph]:
    """Export `model` (default: a fresh spec.build()) at `batch_size` and group its nodes into layers.

    `inputs` (default: spec.example_inputs(batch_size)) are the ones to export with: fake
    tensors for a weight-free model (export.weight_free_model).

    No timing and no FLOP counting: the Graph has structure, parameters, bytes per
    tensor and bytes_moved only. Same model file + depth -> same fingerprint at any batch size.
    """
    _check_batch(batch_size)
    if model is None:
        model = spec.build()
    if inputs is None:
        inputs = spec.example_inputs(batch_size)
    with plain_checkpoints() as checkpoints:
        ep = export_program(spec, model, inputs)
    name = os.path.splitext(os.path.basename(spec.path))[0]
    if spec.entry != "build_model":
        name = f"{name}:{spec.entry}"
    graph = build_structure(ep, model, name=name, batch_size=batch_size, depth=depth, input_bytes=_input_bytes(inputs))
    if not graph.layers:
        raise UserError(f"{spec.path}: {spec.entry}() has no operations to trace", "the model's forward() does nothing")
    if checkpoints[0]:
        graph.notes.append("forward() calls torch.utils.checkpoint: traced and run as plain code, each op once, as "
                           "pipeplan plans recomputation itself (--recompute on; --recompute-granularity block "
                           "for a checkpoint per block, as the model's own)")
    graph.source = {
        "model_file": spec.path,
        "entry": spec.entry,
        "seq_len": spec.seq_len,  # a Hugging Face config's sequence length (None for a model.py)
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
          repeats: int | None = None, progress: Progress | None = None, fvcore_check: bool = True,
          seq_len: int | None = None, repeated_blocks: bool = True, time_layers: bool = True,
          device: str = "cpu", dtype: str = "fp32") -> Graph:
    """The full measured graph: structure, FLOPs, saved bytes, times; fvcore cross-check notes.

    `device` ("cpu", "cuda" or "auto", see `resolve_device`) is where the layers are exported,
    counted and timed (CUDA: with CUDA events, measure.CudaEventMarks); the model goes back to
    the CPU afterwards. It only matters when layers are timed.

    `time_layers=False` is for a graph whose layer times nobody will use (a catalogue profile
    prices layers by roofline): the model is built without weights (export.weight_free_model),
    nothing is timed (fwd_s = bwd_s = 0, source "timed": false, `repeats` is ignored), and the
    FLOPs and bytes are those of the real model. A model that cannot be traced that way is built
    for real, with a note saying why.

    `repeated_blocks=False` traces every block even when a ModuleList holds identical ones.

    `seq_len` is the sequence length of a Hugging Face config.json model (costmodels/hf_config.py).

    `dtype` is the precision the layers are timed in, as `pipeplan run` trains a plan of it (pipeplan/precision.py:
    bf16 and fp16 under torch.autocast, tf32 with tensor-core matmuls); a graph timed in another than fp32 says so in
    source["dtype"], and a plan takes its times only in that dtype (compute.uses_measured_times).
    """
    from pipeplan.costmodels import fvcheck

    def report(phase: str, done: int, total: int) -> None:
        if progress is not None:
            progress(phase, done, total)

    _check_batch(batch_size)
    if repeats is not None and repeats < 1:
        raise UserError(f"--repeats {repeats}: must be 1 or more", "omit --repeats for an automatic count")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: layers are timed in {', '.join(DTYPES)}",
                        "time in one of those")
    timing_device = torch.device(resolve_device(device)) if time_layers else torch.device("cpu")
    report("loading model file", 0, 1)
    spec = load_model_file(model_file, entry, seq_len=seq_len)

    def measure_model(model: torch.nn.Module, mode: FakeTensorMode | None) -> blocks.Measured:
        report("loading model file", 1, 1)
        # A very large model with repeated blocks is traced one layer per block (blocks.coarse_depth).
        coarse = blocks.coarse_depth(model) if depth is None and repeated_blocks else None
        at_depth = coarse[0] if coarse else depth
        # Identical blocks (decoder layers) are traced a few times and cloned: costmodels/blocks.py, docs/tracing.md.
        measured = blocks.measure_once_per_block(
            model, lambda m: _measure(spec, m, batch_size, at_depth, repeats, report, fake_mode=mode,
                                      time_layers=time_layers, device=timing_device, dtype=dtype),
            enabled=repeated_blocks)
        if coarse:
            measured.graph.notes.append(coarse[1])
        return measured

    measured: blocks.Measured | None = None
    mode: FakeTensorMode | None = None
    failure: str | None = None  # why the weight-free trace did not work
    if not time_layers:
        try:
            model, mode = weight_free_model(spec)
            measured = measure_model(model, mode)
        except Exception as e:  # meta or fake tensors cannot build or run it (.item(), a fixed device): build it
            mode, failure = None, (e.message if isinstance(e, UserError) else _cause(e))[:240]
    if measured is None:
        check_fits_in_ram(spec)
        try:
            model = spec.build()
            measured = measure_model(model, None)
        except OutOfMemory as e:
            raise _weight_free_failed_too(e, failure) from e
    graph = measured.graph
    if failure is not None:
        graph.notes.insert(0, f"built with real weights: tracing without them failed ({failure})")
    if getattr(spec.module, "attention", None) == "eager":
        graph.notes.append(hf_config.EAGER_NOTE)
    if fvcore_check:  # fvcore builds its own copy on the meta device; `model` is its fallback, when real
        report("cross-checking FLOPs with fvcore", 0, 1)
        graph.notes.extend(fvcheck.compare(spec, graph, batch_size, measured.node_flops, measured.family,
                                           model if mode is None else None))
        report("cross-checking FLOPs with fvcore", 1, 1)
    return graph


def _weight_free_failed_too(e: OutOfMemory, failure: str | None) -> OutOfMemory:
    """An out-of-memory of the real build that only ran because the weight-free trace failed: say both."""
    if failure is None:
        return e
    return OutOfMemory(f"{e.message}; it was built for real because tracing without weights failed: {failure}",
                       "make build_model() and forward() work on the meta device (no .item() or tensors "
                       "created on a fixed device), or trace on a machine with more RAM")


def _measure(spec: ModelSpec, model: torch.nn.Module, batch_size: int, depth: int | None, repeats: int | None,
             report: Progress, *, fake_mode: FakeTensorMode | None = None, time_layers: bool = True,
             device: torch.device | None = None, dtype: str = "fp32") -> blocks.Measured:
    """Export, count and time `model` as it is (all its blocks, or the few blocks.shortened leaves).

    `fake_mode`: the model is export.weight_free_model's, so the inputs are made fake tensors of it.
    `device` (CUDA): model and inputs are moved there before the export, so the program's ops, its
    FLOP count and its timed kernels are the GPU's; the model is moved back to the CPU afterwards.
    """
    inputs = spec.example_inputs(batch_size)
    target = spec.example_target(batch_size)
    if fake_mode is not None:
        inputs, target = fake_leaves(fake_mode, inputs), fake_leaves(fake_mode, target)
    if device is None or device.type == "cpu":
        return _measure_on(spec, model, batch_size, depth, repeats, report, inputs, target, fake_mode, time_layers,
                           dtype=dtype)

    def to_device(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    try:
        return _measure_on(spec, model.to(device), batch_size, depth, repeats, report,
                           pytree.tree_map(to_device, inputs), pytree.tree_map(to_device, target), fake_mode,
                           time_layers, device=device, dtype=dtype)
    finally:
        model.to("cpu")
        torch.cuda.empty_cache()


def _measure_on(spec: ModelSpec, model: torch.nn.Module, batch_size: int, depth: int | None, repeats: int | None,
                report: Progress, inputs: Any, target: Any, fake_mode: FakeTensorMode | None, time_layers: bool,
                device: torch.device | None = None, dtype: str = "fp32") -> blocks.Measured:
    """`_measure` once the model and inputs are where they are measured."""
    from pipeplan.costmodels import measure

    report("exporting (torch.export)", 0, 1)
    ep, graph = export_structure(spec, batch_size, depth=depth, model=model, inputs=inputs)
    report("exporting (torch.export)", 1, 1)
    if device is not None:
        graph.source.update(_device_source(device))
    layer_of = {n: i for i, layer in enumerate(graph.layers) for n in layer.nodes}
    n = len(graph.layers)
    family = {node.name: node_kind(node) for node in ep.graph.nodes if node.op == "call_function"}

    report("counting FLOPs and saved bytes", 0, 1)
    in_flight = InFlight.none_counted(n)
    try:
        # untimed: the graph is for a catalogue (GPU) profile, so attention is counted as a GPU runs it
        with gpu_attention.counting_as_gpu(enabled=not time_layers) as replaced:
            counts = measure.count_pass(ep, model, spec, inputs, target, layer_of, n)
            param_shapes = _param_shapes(model, graph)
            in_flight = _transient(ep, model, spec, inputs, target, layer_of, graph, param_shapes)
            count_autocast(ep, model, spec, inputs, target, layer_of, graph, param_shapes)
        if (said := gpu_attention.note(replaced)) is not None:
            graph.notes.append(said)
    except UserError:
        raise
    except Exception as e:  # an op without a fake-tensor implementation: count on real tensors instead
        if fake_mode is not None:  # there are none: the caller builds the model for real
            raise
        graph.notes.append(f"FLOPs and saved bytes were counted on a real step, tensors in flight not at all "
                           f"(fake tensors failed: "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''})")
        with out_of_memory_as_user_error(spec.path, "counting FLOPs on a real step"):
            counts = measure.count_pass(ep, model, spec, inputs, target, layer_of, n, fake_tensors=False)
    report("counting FLOPs and saved bytes", 1, 1)

    fwd_s, bwd_s = [0.0] * n, [0.0] * n
    bwd_weight_s: list[float] | None = None
    timing: measure.Timing | None = None
    if time_layers:
        keep_freed_memory()  # as the runtime's ranks run: see hardware_profiles/allocator.py
        where = device or torch.device("cpu")
        with (out_of_memory_as_user_error(spec.path, "timing the layers"),
              unsupported_dtype_as_user_error(spec, model, inputs, target, dtype, where),
              training_precision(dtype, where)):
            timing = measure.time_pass(ep, model, spec, inputs, target, layer_of, n, repeats=repeats,
                                       progress=report, owned_params=_owned_params(model, graph.layers))
        fwd_s, bwd_s, graph.source["repeats"] = timing.fwd_s, timing.bwd_s, timing.repeats
        bwd_weight_s = timing.bwd_weight_s
        if timing.hook_overhead_s:
            graph.source["backward_hook_us"] = round(timing.hook_overhead_s * 1e6, 3)
        if dtype != "fp32":
            graph.source["dtype"] = dtype
    nodes = {node.name: node for node in ep.graph.nodes}
    params = param_input_names(ep)
    loss_read = {i: 0 for i in range(n)}
    for node_name, size in user_output_bytes(ep).items():
        if node_name in layer_of:
            loss_read[layer_of[node_name]] += size
    graph.source["timed"] = time_layers
    graph.source["weights"] = "real" if fake_mode is None else "meta"
    for i, layer in enumerate(graph.layers):
        layer.fwd_s = fwd_s[i]
        layer.bwd_s = bwd_s[i]
        layer.fwd_flops = int(counts.fwd_flops[i])
        layer.bwd_flops = int(counts.bwd_flops[i])
        if counts.bwd_input_flops:  # W = the full backward minus its input-gradient part (measure.input_grad)
            layer.bwd_weight_flops = max(0, min(layer.bwd_flops, layer.bwd_flops - counts.bwd_input_flops[i]))
        if bwd_weight_s is not None:
            layer.bwd_weight_s = _weight_grad_s(layer, bwd_weight_s[i])
        if timing is not None and timing.saved_tensors:
            layer.last_save_s = layer.fwd_s * timing.last_save_share[i]
            layer.saved_tensors = timing.saved_tensors[i]
        if timing is not None and timing.grad_accumulate_s:
            layer.grad_accumulate_s = min(layer.bwd_s, timing.grad_accumulate_s[i])
        layer.saved_bytes = int(counts.saved_bytes[i])
        layer.transient_bytes = int(in_flight.transient[i])
        layer.deferred_grad_bytes = int(in_flight.deferred[i])
        layer.loss_saved_bytes = int(in_flight.loss_saved[i])
        layer.nonweight_saved_bytes = int(in_flight.nonweight_saved[i])
        layer.input_saved_bytes = int(in_flight.input_saved[i])
        layer.input_nonweight_saved_bytes = int(in_flight.input_nonweight_saved[i])
        layer.kind = _refine_kind(layer, counts.node_flops, family)
        layer.parts = with_loss(cost_parts([nodes[x] for x in layer.nodes if x in nodes], counts.node_flops,
                                           params, layer.bwd_flops), loss_read[i])
    graph.peak_activation_bytes = int(counts.peak_saved_bytes)
    return blocks.Measured(graph, counts.node_flops, family, module_paths(ep))


def _transient(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: Any, target: Any,
               layer_of: dict[str, int], graph: Graph, param_shapes: list[set[tuple[int, ...]]]) -> InFlight:
    """costmodels/transient.py's per-layer bytes in flight and what a split backward keeps and frees; zeros, with
    a note, where its fake step fails (the memory model then holds saved tensors and model state only, as before
    the terms existed)."""

    n = len(graph.layers)
    try:
        return transient_bytes(ep, model, spec, inputs, target, layer_of, n, param_shapes)
    except UserError:
        raise
    except Exception as e:
        graph.notes.append(f"tensors in flight were not counted ({type(e).__name__}); "
                           "peak memory holds saved activations and model state only")
        return InFlight.none_counted(n)


def _param_shapes(model: torch.nn.Module, graph: Graph) -> list[set[tuple[int, ...]]]:
    """Per layer, the shapes of the parameters it uses (transient.transient_bytes tells weight gradients by them)."""
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters(remove_duplicate=False)}
    return [{shapes[fqn] for fqn in layer.params if fqn in shapes} for layer in graph.layers]


def _owned_params(model: torch.nn.Module, layers: list[Layer]) -> list[list[torch.nn.Parameter]]:
    """Per layer, the parameters it owns: a tied tensor once, at its first user (as param_bytes)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    owned: list[list[torch.nn.Parameter]] = []
    for layer in layers:
        owned.append([])
        for fqn in layer.params:
            if fqn in named and id(named[fqn]) not in seen:
                seen.add(id(named[fqn]))
                owned[-1].append(named[fqn])
    return owned


def _weight_grad_s(layer: Layer, measured_s: float) -> float:
    """A layer's measured W (its backward less its timed input-gradient part B), within [0, bwd_s].

    A layer without parameters has no W whatever the clock says: B and the full backward are two
    timings of the same nodes there, and their noise is not W. A layer whose W the FLOP counter
    misses (a LayerNorm's affine gradients count no FLOPs) keeps its measured W.
    """
    if not trainable_params(layer):
        return 0.0
    return max(0.0, min(layer.bwd_s, measured_s))


def _refine_kind(layer: Layer, node_flops: dict[str, int], family: dict[str, str | None]) -> str:
    """With FLOPs known, the kind is the op family with the most FLOPs (a whole block: matmul, not attention)."""
    by_kind: dict[str, int] = {}
    for node_name in layer.nodes:
        kind, f = family.get(node_name), node_flops.get(node_name, 0)
        if kind is not None and f > 0:
            by_kind[kind] = by_kind.get(kind, 0) + f
    return max(by_kind, key=by_kind.__getitem__) if by_kind else layer.kind
