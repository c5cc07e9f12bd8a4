"""The partitioning problem: a graph reduced to per-microbatch numbers on the target device.

Solvers never look at a `Graph` or a `HardwareProfile`; they take a `Problem`, so
the DP, the ILP, the PipeDream optimizer and the brute-force reference all see the
same numbers, and tests can build problems by hand. Everything per layer is for
ONE microbatch on the target device, in the graph's execution (topological) order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from pipeplan.choices import DEFAULT_MIXED_PRECISION
from pipeplan.costmodels.compute import layer_times_s
from pipeplan.costmodels.graph import AUTOCAST_FIELDS, Graph
from pipeplan.costmodels.memory import RangeMemory, activation_bytes_scale, is_mixed_precision
from pipeplan.costmodels.recompute import weight_passes_added
from pipeplan.hardware_profiles.profile import HardwareProfile
from pipeplan.planner.walks import keeps_sends, kept_send_counts, walks
from pipeplan.schedules import facts

if TYPE_CHECKING:
    from pipeplan.planner.configs import Config
    from pipeplan.planner.request import PlanRequest


@dataclass(frozen=True)
class Problem:
    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    param_bytes: tuple[int, ...]  # fp32 parameter bytes owned by each layer
    saved_bytes: tuple[int, ...]  # activations saved for backward, per microbatch
    output_bytes: tuple[int, ...]
    cut_bytes: tuple[int, ...]  # len n-1: bytes live across the cut after layer i, per microbatch
    input_bytes: int  # model input per microbatch
    edges: tuple[tuple[int, int, int], ...] = ()  # (src index, dst index, bytes per microbatch)
    transient_bytes: tuple[int, ...] = ()  # tensors in flight while a layer runs, per microbatch; (): none counted
    deferred_grad_bytes: tuple[int, ...] = ()  # what a split backward's B leaves held until W, per microbatch; (): none
    loss_saved_bytes: int = 0  # what the loss saves, per microbatch (memory._held_activations)
    nonweight_saved_bytes: tuple[int, ...] = ()  # of saved_bytes, what ops other than weight ops save; (): none
    weight_passes: tuple[int, ...] = ()  # parameter groups each layer adds (costmodels.recompute.weight_grad_passes)
    # of saved_bytes, what each layer saves of tensors earlier layers made (a stage starting there: its received
    # input), and of that what ops other than weight ops save (Layer.input_saved_bytes); (): none
    input_saved_bytes: tuple[int, ...] = ()
    input_nonweight_saved_bytes: tuple[int, ...] = ()
    # recomputed per block (pipeplan.choices.RecomputeGranularity): each layer's block, numbered 0.. in execution
    # order (`checkpoint_units`), and what it passes to other blocks; (): each layer a block, passing its outputs
    block_of: tuple[int, ...] = ()
    passed_bytes: tuple[int, ...] = ()
    # of param_bytes, parameters that need no gradient (Layer.frozen_param_bytes); (): every parameter trains
    frozen_param_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        for field_name in ("fwd_s", "bwd_s", "param_bytes", "saved_bytes", "output_bytes"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(f"Problem.{field_name} has {len(getattr(self, field_name))} entries for {n} layers")
        for field_name in ("transient_bytes", "deferred_grad_bytes", "nonweight_saved_bytes", "weight_passes",
                           "input_saved_bytes", "input_nonweight_saved_bytes", "block_of", "passed_bytes",
                           "frozen_param_bytes"):
            if getattr(self, field_name) and len(getattr(self, field_name)) != n:
                raise ValueError(f"Problem.{field_name} has {len(getattr(self, field_name))} entries for {n} layers")
        if len(self.cut_bytes) != max(n - 1, 0):
            raise ValueError(f"Problem.cut_bytes must have {max(n - 1, 0)} entries, has {len(self.cut_bytes)}")
        for s, d, _ in self.edges:
            if not 0 <= s < d < n:
                raise ValueError(f"edge {s} -> {d} is not forward in execution order")

    @property
    def n(self) -> int:
        return len(self.names)

    @cached_property
    def blocks(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(each layer's block, what each layer passes to other blocks, the last layer reading its outputs: -1 for
        none) for recomputation per block; a problem without blocks (built by hand) has each layer a block of its
        own, passing on its outputs. Cached: the search reads it for every configuration it recomputes per block."""
        last = [-1] * self.n
        for s, d, _ in self.edges:
            last[s] = max(last[s], d)
        if self.block_of:
            return self.block_of, self.passed_bytes, tuple(last)
        return tuple(range(self.n)), self.output_bytes, tuple(last)

    @cached_property
    def frozen(self) -> tuple[int, ...]:
        """Per layer, the parameter bytes that need no gradient: zeros where every parameter trains."""
        return self.frozen_param_bytes or (0,) * self.n

    @cached_property
    def trainable(self) -> tuple[int, ...]:
        """Per layer, the parameter bytes that get a gradient: what data parallelism all-reduces and the
        optimizer keeps state for (cost-models.md §3.1)."""
        return tuple(p - f for p, f in zip(self.param_bytes, self.frozen, strict=True))

    @cached_property
    def compute_s(self) -> tuple[float, ...]:
        """fwd + bwd per layer (cached: the search reads it for every configuration)."""
        return tuple(f + b for f, b in zip(self.fwd_s, self.bwd_s, strict=True))

    def is_chain(self) -> bool:
        """Every edge goes to the next layer (no skips, no branches)."""
        return all(d == s + 1 for s, d, _ in self.edges)


def chain_problem(compute_s: Sequence[float], *, param_bytes: Sequence[float] | None = None,
                  cut_bytes: Sequence[int] | None = None, saved_bytes: Sequence[float] | None = None,
                  names: Sequence[str] | None = None) -> Problem:
    """A chain problem from plain lists (tests, benchmarks): fwd = 1/3, bwd = 2/3 of compute."""
    n = len(compute_s)
    cut = list(cut_bytes) if cut_bytes is not None else [0] * (n - 1)
    return Problem(
        names=tuple(names or (f"l{i}" for i in range(n))),
        fwd_s=tuple(c / 3.0 for c in compute_s),
        bwd_s=tuple(c - c / 3.0 for c in compute_s),
        param_bytes=tuple(int(p) for p in (param_bytes or [0] * n)),
        saved_bytes=tuple(int(s) for s in (saved_bytes or [0] * n)),
        output_bytes=tuple(cut[i] if i < n - 1 else 0 for i in range(n)),
        cut_bytes=tuple(int(c) for c in cut),
        input_bytes=0,
        edges=tuple((i, i + 1, int(cut[i])) for i in range(n - 1)),
    )


def dag_problem(compute_s: Sequence[float], edges: Sequence[tuple[int, int, int]], *,
                param_bytes: Sequence[float] | None = None) -> Problem:
    """A DAG problem from plain lists (tests, benchmarks): nodes in topological order,
    edges (src, dst, bytes); a node's output is one tensor of its largest edge's size,
    live from the node to its last consumer, which is the rule the ILP prices."""
    n = len(compute_s)
    size: dict[int, int] = {}
    last: dict[int, int] = {}
    for s, d, b in edges:
        size[s] = max(size.get(s, 0), b)
        last[s] = max(last.get(s, 0), d)
    cut = [0] * (n - 1)
    for s, d in last.items():
        for c in range(s, d):
            cut[c] += size[s]
    return Problem(names=tuple(f"n{i}" for i in range(n)), fwd_s=tuple(c / 3.0 for c in compute_s),
                   bwd_s=tuple(c - c / 3.0 for c in compute_s),
                   param_bytes=tuple(int(p) for p in (param_bytes or [0] * n)), saved_bytes=(0,) * n,
                   output_bytes=tuple(size.get(i, 0) for i in range(n)), cut_bytes=tuple(cut), input_bytes=0,
                   edges=tuple(edges))


def build_problem(graph: Graph, profile: HardwareProfile | None, *, microbatch_size: int, dtype: str = "fp32",
                  times: str = "model", mixed_precision: str = DEFAULT_MIXED_PRECISION) -> Problem:
    """Per-microbatch layer times and bytes of `graph` on `profile` (None: measured times only).

    Times come from the cost models (`costmodels.compute.layer_times_s`, which
    honours --times measured and local profiles). Activation-sized bytes
    (saved, outputs, cuts, edges, input) were traced at `graph.batch_size` in
    fp32: they scale linearly with the microbatch size (activations are
    per-sample) and by `activation_bytes_scale(dtype)` (16-bit activations under
    mixed precision), except under the `autocast` recipe, where they are the
    trace's count of that step (`_autocast_bytes`). Parameter bytes stay fp32:
    the memory model applies the dtype to weights itself.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if profile is None:  # measured times need no device model (e.g. imported PipeDream profiles)
        if times != "measured":
            raise ValueError("build_problem without a profile needs times='measured'")
        ratio = microbatch_size / graph.batch_size
        fwd = [layer.fwd_s * ratio for layer in graph.layers]
        bwd = [layer.bwd_s * ratio for layer in graph.layers]
    else:
        fwd, bwd = layer_times_s(graph, profile, dtype=dtype, times=times, samples=microbatch_size)
    counted = _autocast_bytes(graph, profile, dtype, mixed_precision)
    ratio = microbatch_size / graph.batch_size
    scale = ratio * (1.0 if counted is not None else activation_bytes_scale(dtype))
    nbytes = counted or [{k: getattr(layer, k) for k in AUTOCAST_FIELDS} for layer in graph.layers]
    # the share of a layer's fp32 output bytes its outputs take in the step (1: as traced, or scaled alike)
    out_share = [b["output_bytes"] / layer.output_bytes if layer.output_bytes else 1.0
                 for b, layer in zip(nbytes, graph.layers, strict=True)]

    def act(x: float) -> int:
        return int(round(x * scale))

    def per_layer(key: str) -> tuple[int, ...]:
        return tuple(act(b.get(key, 0)) for b in nbytes)  # counts a graph file predates read 0 (not traced)

    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    return Problem(
        names=tuple(layer.name for layer in graph.layers),
        fwd_s=tuple(float(x) for x in fwd),
        bwd_s=tuple(float(x) for x in bwd),
        param_bytes=tuple(int(layer.param_bytes) for layer in graph.layers),
        frozen_param_bytes=tuple(int(layer.frozen_param_bytes) for layer in graph.layers)
        if any(layer.frozen_param_bytes for layer in graph.layers) else (),
        saved_bytes=per_layer("saved_bytes"),
        output_bytes=per_layer("output_bytes"),
        cut_bytes=tuple(act(c) for c in graph.cut_bytes(out_share)),
        # autocast leaves the model's inputs as they are (images stay fp32)
        input_bytes=int(round(graph.input_bytes * (ratio if counted is not None else scale))),
        edges=tuple((index[e.src], index[e.dst], act(e.bytes * out_share[index[e.src]])) for e in graph.edges),
        transient_bytes=per_layer("transient_bytes"),
        # what a split backward's B leaves held until W beyond the activations: the weight ops' output gradients,
        # less the loss's saved tensors it frees (the last layer's; never below 0, so more W's pending never weigh
        # less: memory.held_with_deferred's points assume it)
        deferred_grad_bytes=tuple(act(max(0, b["deferred_grad_bytes"] - b["loss_saved_bytes"])) for b in nbytes),
        loss_saved_bytes=act(nbytes[-1]["loss_saved_bytes"]) if graph.layers else 0,
        nonweight_saved_bytes=per_layer("nonweight_saved_bytes"),
        weight_passes=tuple(weight_passes_added(graph.layers)),
        input_saved_bytes=per_layer("input_saved_bytes"),
        input_nonweight_saved_bytes=per_layer("input_nonweight_saved_bytes"),
        **_blocks(graph, per_layer("output_bytes")),
    )


def checkpoint_units(names: Sequence[str], param_bytes: Sequence[int]) -> list[int]:
    """Each layer's block for recomputation per block, numbered 0.. in execution order: the units the frameworks
    place and checkpoint (planner/frameworks/names.py: each decoder block with its layers, the embedding, final norm
    and head with the weightless layers beside them), or each layer its own where the names show no numbered
    block list (or one no framework could express). `pipeplan run` cuts its stages' checkpoints by the same call."""
    from pipeplan.planner.frameworks.names import Inexpressible, model_units

    try:
        units = model_units(names, lambda i: param_bytes[i] > 0).unit_of_layer()
    except Inexpressible:
        return list(range(len(names)))
    return units if all(a <= b for a, b in itertools.pairwise(units)) else list(range(len(names)))


def _blocks(graph: Graph, output_bytes: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """`Problem.block_of` and `passed_bytes`: a layer passes its outputs (`output_bytes`, as the step holds them) to
    other blocks when any layer of another block reads it (its edges), else nothing."""
    names = [layer.name for layer in graph.layers]
    block = checkpoint_units(names, [layer.param_bytes for layer in graph.layers])
    index = {name: i for i, name in enumerate(names)}
    leaves = {index[e.src] for e in graph.edges if block[index[e.dst]] != block[index[e.src]]}
    return {"block_of": tuple(block), "passed_bytes": tuple(b if i in leaves else 0 for i, b in enumerate(output_bytes))}


def _autocast_bytes(graph: Graph, profile: HardwareProfile | None, dtype: str,
                    mixed_precision: str) -> list[dict[str, int]] | None:
    """Per layer, the trace's byte counts of a step under torch.autocast with the lists of the device `profile` is
    (this machine's CPU or a GPU), where the plan is 16-bit under the `autocast` recipe and every layer has them;
    else None (bytes are half the fp32 ones: the recipes of DeepSpeed and Megatron, 16-bit throughout)."""
    if mixed_precision != "autocast" or not is_mixed_precision(dtype) or not graph.layers:
        return None
    device = "cpu" if profile is not None and profile.local_cpu() else "cuda"
    if any(device not in layer.autocast for layer in graph.layers):
        return None
    return [layer.autocast[device] for layer in graph.layers]


def memory_signature(config: Config) -> tuple[int, ...]:
    """How M enters `range_memory`, for the caches of its results: the in-flight counts per device; M itself where
    torch's multi-stage runtime keeps a receive buffer per microbatch and every send to the step's end, which grow
    with M where the in-flight counts stop; whether a second microbatch adds its gradient into the
    first's."""
    rule = facts(config.schedule)
    M = config.microbatches
    return (*(rule.inflight(config.stages, p, M, config.chunks) for p in range(config.stages)),
            M if keeps_sends(config.schedule) else min(M, 2))


def range_memory(problem: Problem, config: Config, request: PlanRequest,
                 shared: Sequence[tuple[int, Sequence[int]]] = ()) -> RangeMemory:
    """The partitioner's memory of a layer range under `config` (costmodels.memory.RangeMemory), from the problem's
    per-layer bytes: one place that says which of its numbers the memory model reads (and, where torch's multi-stage
    runtime keeps the sends, how many: planner/walks.py)."""
    p, req = problem, request
    return RangeMemory(
        param_bytes=p.param_bytes, frozen_param_bytes=p.frozen_param_bytes, saved_bytes=p.saved_bytes,
        cut_bytes=p.cut_bytes, input_bytes=p.input_bytes, schedule=config.schedule, stages=config.stages, microbatches=config.microbatches, chunks=config.chunks,
        recompute=config.recompute, optimizer=req.optimizer, dtype=req.training_dtype, shared=shared,
        mixed_precision=req.mixed_precision, sharding=config.sharding, shards=config.data_parallel,
        transient_bytes=p.transient_bytes, model_output_bytes=p.output_bytes[-1] if p.n else 0,
        deferred_grad_bytes=p.deferred_grad_bytes, loss_saved_bytes=p.loss_saved_bytes,
        nonweight_saved_bytes=p.nonweight_saved_bytes, weight_passes=p.weight_passes,
        input_saved_bytes=p.input_saved_bytes, input_nonweight_saved_bytes=p.input_nonweight_saved_bytes,
        blocks=p.blocks if config.recompute_granularity == "block" else None,
        kept_sends=kept_send_counts(config) if keeps_sends(config.schedule) else None, walked=walks(config.schedule))
