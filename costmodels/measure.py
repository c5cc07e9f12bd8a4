"""Per-layer costs of an exported program: FLOPs and saved bytes (shapes only), wall times (real runs).

Both passes run the exported program itself node by node (an fx.Interpreter), so a
cost lands on exactly the layer whose nodes produced it. Backward work is
attributed through autograd: the autograd nodes a layer's forward creates belong
to that layer, and a pre-hook on each tells which layer the engine is working on.
Whatever runs between two hooks (the loss, AccumulateGrad) is charged to the layer
that was running, so per-layer totals add up to the whole step.

FLOPs and saved bytes are counted under FakeTensorMode: no real arithmetic, which
is what keeps tracing GPT-2 small (124M, 1024 tokens) within a minute on 2 cores.
Only the timing runs are real.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from pipeplan.costmodels.model_file import ModelSpec
from pipeplan.errors import UserError

aten = torch.ops.aten

# FlopCounterMode (torch 2.13) has no formula for the CPU flash-attention kernel that
# F.scaled_dot_product_attention dispatches to on CPU, so attention would count 0 FLOPs.
# It has the same signature as the CUDA kernels, so their formulas apply (4*b*h*s_q*s_k*d forward).
# (torch's formulas take shapes and have no annotations, hence the ignores.)
def _cpu_sdpa_flop(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int], *args: Any,
                   out_shape: Sequence[int] | None = None, **kwargs: Any) -> int:
    flops: int = sdpa_flop_count(query_shape, key_shape, value_shape)  # type: ignore[no-untyped-call]
    return flops


def _cpu_sdpa_backward_flop(grad_out_shape: Sequence[int], query_shape: Sequence[int], key_shape: Sequence[int],
                            value_shape: Sequence[int], *args: Any, out_shape: Sequence[int] | None = None,
                            **kwargs: Any) -> int:
    flops: int = sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
        grad_out_shape, query_shape, key_shape, value_shape)
    return flops


CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


def flop_counter() -> FlopCounterMode:
    """FlopCounterMode with the CPU attention formulas added; FLOP = 2 per multiply-add."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)


def program_args(ep: torch.export.ExportedProgram, model: torch.nn.Module, user_args: list[Any]) -> list[Any]:
    """The flat positional arguments of ep.graph_module: parameters, buffers, constants, user inputs."""
    user = iter(user_args)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    args: list[Any] = []  # tensors, and whatever non-tensor leaves the user's inputs have
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.PARAMETER:
            args.append(params[s.target])
        elif s.kind == InputKind.BUFFER:
            args.append(buffers[s.target] if s.target in buffers else ep.state_dict[s.target])
        elif s.kind == InputKind.CONSTANT_TENSOR:
            args.append(ep.constants[s.target])
        elif s.kind == InputKind.USER_INPUT:
            args.append(next(user))
        else:
            raise NotImplementedError(f"exported input kind {s.kind} is not supported by the tracer")
    return args


def user_output(ep: torch.export.ExportedProgram, flat_out: Any) -> Any:
    """Rebuild the model's output structure (tensor, tuple, dict, ModelOutput) from the program's outputs."""
    if not isinstance(flat_out, (tuple, list)):
        flat_out = (flat_out,)
    # One output spec per program output (torch.export verifies the signature against the graph).
    outs = [o for o, s in zip(flat_out, ep.graph_signature.output_specs, strict=True)
            if s.kind == OutputKind.USER_OUTPUT]
    return pytree.tree_unflatten(outs, ep.call_spec.out_spec)


class _LayerInterpreter(torch.fx.Interpreter):
    """Runs the program node by node, telling `on_node` which layer each node belongs to."""

    def __init__(self, gm: torch.fx.GraphModule, layer_of: dict[str, int], before: Callable[[int], None],
                 after: Callable[[int, torch.fx.Node, Any], None]):
        super().__init__(gm, garbage_collect_values=True)
        self.layer_of = layer_of
        self.before = before
        self.after = after

    def run_node(self, n: torch.fx.Node) -> Any:
        layer = self.layer_of.get(n.name)
        if layer is None:
            return super().run_node(n)
        self.before(layer)
        out = super().run_node(n)
        self.after(layer, n, out)
        return out


class _BackwardAttribution:
    """Maps autograd nodes to layers and charges `clock()` deltas to the layer being differentiated."""

    def __init__(self, nlayers: int, clock: Callable[[], float], start_layer: int):
        self.owner: dict[Any, int] = {}
        self.acc = [0.0] * nlayers
        self.clock = clock
        self.start_layer = start_layer
        self.current = start_layer
        self.last = 0.0
        self.handles: list[RemovableHandle] = []
        self.activations: list[torch.Tensor] = []  # every layer output autograd differentiates

    def claim(self, value: Any, layer: int) -> None:
        self.activations += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        stack = [t.grad_fn for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.owner:
                continue
            self.owner[fn] = layer
            self.handles.append(fn.register_prehook(self._hook(layer)))
            stack.extend(f for f, _ in fn.next_functions if f is not None)

    def _hook(self, layer: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            now = self.clock()
            self.acc[self.current] += now - self.last
            self.last = now
            self.current = layer
        return hook

    def input_grad(self, loss: torch.Tensor) -> list[float]:
        """Per layer, what the backward w.r.t. the layers' outputs only costs: the input-gradient part B.

        Zero bubble (Qi et al. 2024 §2) splits a backward into B and the weight gradient W. Asking
        autograd for the activations' gradients alone runs every node but skips the weight-gradient
        outputs (AddmmBackward computes mat1's gradient only), so the clock charged here is B, and the
        full backward after it minus B is W. Leaves `acc` zeroed for that full backward.
        """
        if self.activations and loss.requires_grad:
            self.last = self.clock()
            torch.autograd.grad(loss, self.activations, retain_graph=True, allow_unused=True)
            self.acc[self.current] += self.clock() - self.last
        out, self.acc, self.current = self.acc, [0.0] * len(self.acc), self.start_layer
        return out

    def backward(self, loss: torch.Tensor, spec: ModelSpec) -> None:
        if not loss.requires_grad:
            raise UserError(f"{spec.path}: the loss does not depend on any parameter that requires a gradient",
                            "pipeplan plans training: unfreeze parameters or check loss_fn")
        self.last = self.clock()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward has no annotations
        self.acc[self.current] += self.clock() - self.last


@dataclass
class Counts:
    fwd_flops: list[int]
    bwd_flops: list[int]
    saved_bytes: list[int]
    peak_saved_bytes: int
    node_flops: dict[str, int] = field(default_factory=dict)
    total_fwd_flops: int = 0  # whole program, as one FlopCounterMode sees it
    bwd_input_flops: list[int] = field(default_factory=list)  # of bwd_flops, the input-gradient part B


def count_pass(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: tuple[Any, ...],
               target: Any, layer_of: dict[str, int], nlayers: int, *, fake_tensors: bool = True) -> Counts:
    """One forward+backward, on fake tensors by default: FLOPs per layer (fwd and bwd) and bytes saved for backward.

    fake_tensors=False runs on the real tensors instead (a real step's compute), for
    the rare model whose ops have no fake-tensor implementation.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake_tensors else None
    real_args = program_args(ep, model, [t for t in pytree.tree_leaves(inputs)])
    converted: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or fake_mode is None:  # None: not fake_tensors
            return t
        if id(t) not in converted:  # a tied parameter stays one tensor
            f = fake_mode.from_tensor(t.detach())
            if t.requires_grad:
                f.requires_grad_(True)
            converted[id(t)] = f
        return converted[id(t)]

    args = [fake(a) for a in real_args]
    fake_target = pytree.tree_map(fake, target)
    state_storages = {a.untyped_storage()._cdata for a, r in zip(args, real_args, strict=True)
                      if isinstance(a, torch.Tensor) and not _is_user(r, inputs)}

    fwd = [0] * nlayers
    saved = [0] * nlayers
    node_flops: dict[str, int] = {}
    seen_storage: set[int] = set()
    last_layer = nlayers - 1
    cur = {"layer": last_layer, "start": 0}

    counter = flop_counter()

    def before(layer: int) -> None:
        cur["layer"] = layer
        cur["start"] = counter.get_total_flops()

    attribution = _BackwardAttribution(nlayers, counter.get_total_flops, last_layer)

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        f = counter.get_total_flops() - cur["start"]
        fwd[layer] += f
        node_flops[node.name] = f
        attribution.claim(out, layer)

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
        except Exception:  # tensors without a plain storage (nested, sparse): count their elements
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in state_storages and key not in seen_storage:
            seen_storage.add(key)
            saved[cur["layer"]] += nbytes
        return t

    mode = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with mode, counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _LayerInterpreter(ep.graph_module, layer_of, before, after).run(*args)
        total_fwd = counter.get_total_flops()
        cur["layer"] = last_layer
        loss = spec.loss(user_output(ep, out), fake_target)
        bwd_input = attribution.input_grad(loss)
        attribution.backward(loss, spec)
    for h in attribution.handles:
        h.remove()
    if not fake_tensors:
        for p in model.parameters():
            p.grad = None
    return Counts(fwd_flops=fwd, bwd_flops=[int(x) for x in attribution.acc], saved_bytes=saved,
                  peak_saved_bytes=sum(saved), node_flops=node_flops, total_fwd_flops=total_fwd,
                  bwd_input_flops=[int(x) for x in bwd_input])


def _is_user(t: Any, inputs: tuple[Any, ...]) -> bool:
    return any(t is u for u in pytree.tree_leaves(inputs))


@dataclass
class Timing:
    fwd_s: list[float]
    bwd_s: list[float]
    step_s: list[float]  # wall time of each timed step (fwd + loss + bwd)
    warmup_s: float
    repeats: int


def _one_step(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, args: list[Any], target: Any,
              layer_of: dict[str, int], nlayers: int) -> tuple[list[float], list[float], float]:
    clock = time.perf_counter
    fwd = [0.0] * nlayers
    last_layer = nlayers - 1
    cur = {"start": 0.0}
    attribution = _BackwardAttribution(nlayers, clock, last_layer)

    def before(layer: int) -> None:
        cur["start"] = clock()

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        fwd[layer] += clock() - cur["start"]
        attribution.claim(out, layer)

    # Gradients are kept from the step before: a pipeline's microbatches 2..M accumulate into them,
    # which reads and writes each gradient instead of writing a fresh one (11-15% of a weight-heavy
    # backward here, docs/runtime.md), so that is the backward a stage runs most often.
    gc.collect()  # a garbage collection inside a timed step lands on whichever layer is running
    gc.disable()
    try:
        return _timed_step(ep, spec, args, target, layer_of, nlayers, fwd, attribution, before, after)
    finally:
        gc.enable()


def _timed_step(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any,
                layer_of: dict[str, int], nlayers: int, fwd: list[float], attribution: _BackwardAttribution,
                before: Callable[[int], None], after: Callable[[int, torch.fx.Node, Any], None],
                ) -> tuple[list[float], list[float], float]:
    clock = time.perf_counter
    last_layer = nlayers - 1
    t0 = clock()
    out = _LayerInterpreter(ep.graph_module, layer_of, before, after).run(*args)
    t1 = clock()
    loss = spec.loss(user_output(ep, out), target)
    fwd[last_layer] += clock() - t1  # the loss runs on the last stage
    del out
    attribution.backward(loss, spec)
    step = clock() - t0
    for h in attribution.handles:
        h.remove()
    return fwd, attribution.acc, step


def _forward_only(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any) -> None:
    out = ep.graph_module(*args)
    loss = spec.loss(user_output(ep, out), target)
    del loss, out


def time_pass(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: tuple[Any, ...],
              target: Any, layer_of: dict[str, int], nlayers: int, *, repeats: int | None, budget_s: float = 10.0,
              progress: Callable[[str, int, int], None] | None = None) -> Timing:
    """Warm-up, then `repeats` timed steps (default: as many as fit in budget_s, 1 to 10); medians per layer."""
    args = program_args(ep, model, [t for t in pytree.tree_leaves(inputs)])
    if progress:
        progress("timing (warm-up step)", 0, 1)
    # Warm up the forward first; a model whose forward alone takes a second or more has
    # negligible one-time costs relative to its step, so its backward is not warmed up
    # separately (that saves a whole backward, ~2/3 of a step, on GPT-2-sized models).
    t0 = time.perf_counter()
    _forward_only(ep, spec, args, target)
    warm = time.perf_counter() - t0
    if warm < 1.0:
        _, _, warm = _one_step(ep, model, spec, args, target, layer_of, nlayers)
    else:
        warm *= 3.0  # a step is roughly forward + 2x backward
    if progress:
        progress("timing (warm-up step)", 1, 1)
    if repeats is None:
        repeats = max(1, min(10, int(budget_s / max(warm, 1e-6))))
    runs = []
    for r in range(repeats):
        if progress:
            progress("timing layers", r, repeats)
        runs.append(_one_step(ep, model, spec, args, target, layer_of, nlayers))
    if progress:
        progress("timing layers", repeats, repeats)
    for p in model.parameters():
        p.grad = None
    fwd = [statistics.median(r[0][i] for r in runs) for i in range(nlayers)]
    bwd = [statistics.median(r[1][i] for r in runs) for i in range(nlayers)]
    return Timing(fwd_s=fwd, bwd_s=bwd, step_s=[r[2] for r in runs], warmup_s=warm, repeats=repeats)
