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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from pipeplan.costmodels import gpu_attention
from pipeplan.costmodels.accumulate import accumulate_times
from pipeplan.costmodels.autocast_policy import Casts
from pipeplan.costmodels.instrument import take_out_excess
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


def _conv_backward_flop(grad_out_shape: Sequence[int], x_shape: Sequence[int], w_shape: Sequence[int], _bias: Any,
                        _stride: Any, _padding: Any, _dilation: Any, transposed: bool, _output_padding: Any,
                        _groups: Any, output_mask: Sequence[bool], *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    """A convolution's backward: its input gradient and its weight gradient each take the forward's multiply-adds
    (the same products, other operands: torch's own derivation in flop_counter.conv_backward_flop).

    torch 2.13's formula counts the weight gradient as an ungrouped convolution of the input with the output
    gradient, `groups` times too many: a depthwise convolution (MobileNet, ConvNeXt, Mamba's causal conv1d over
    4096 channels) counted thousands of times its forward in backward. The forward's count, from the weight's shape
    (C_out, C_in / groups, k...), is right for any groups, so each gradient asked for is priced as one forward."""
    forward: int = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    aten.convolution_backward: _conv_backward_flop,
}


def flop_counter() -> FlopCounterMode:
    """FlopCounterMode with the CPU attention formulas added and grouped convolutions' backward counted with their
    groups; FLOP = 2 per multiply-add."""
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)


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
                 after: Callable[[int, torch.fx.Node, Any], None], casts: Casts | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.layer_of = layer_of
        self.before = before
        self.after = after
        self.casts = casts  # autocast's casts, replayed per op (costmodels/autocast_policy.py); None: none

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.casts is not None:
            args, kwargs = self.casts.cast(target, args, kwargs)
        return gpu_attention.call(target, args, kwargs)  # target(*args, **kwargs), attention as a GPU runs it there

    def run_node(self, n: torch.fx.Node) -> Any:
        layer = self.layer_of.get(n.name)
        if layer is None:
            return super().run_node(n)
        self.before(layer)
        out = super().run_node(n)
        self.after(layer, n, out)
        return out


class Marks:
    """A clock read as marks, resolved later: `perf_counter` (or a FLOP counter) as plain numbers.

    A mark is what `read()` returns and the time between two marks is b - a, so a CPU
    step's totals are the same sums of the same deltas as reading the clock inline.
    `wait()` is where a deferred clock (CUDA events) waits for the device; here nothing.
    """

    def __init__(self, read: Callable[[], float]):
        self.read = read

    def mark(self) -> Any:
        return self.read()

    def elapsed_s(self, a: Any, b: Any) -> float:
        return float(b - a)

    def wait(self) -> None:
        return None


class CudaEventMarks(Marks):
    """Marks on a CUDA stream: one `torch.cuda.Event(enable_timing=True)` recorded per boundary.

    Why events: CUDA kernels run asynchronously, so a host clock read between two
    layers measures how fast Python launches them, not how long the GPU runs them.
    Events are recorded in stream order and read after one synchronize at the end of
    the step (`wait`), so timing adds no synchronization inside the step. Resolution
    is about 0.5 µs (CUDA Runtime API, cudaEventElapsedTime).
    """

    def __init__(self, device: torch.device):
        super().__init__(time.perf_counter)
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        event.record()
        return event

    def elapsed_s(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3  # elapsed_time is in milliseconds

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)


def marks_for(device: torch.device) -> Marks:
    """CUDA events on a CUDA device, `time.perf_counter` elsewhere."""
    return CudaEventMarks(device) if device.type == "cuda" else Marks(time.perf_counter)


class Ledger:
    """Intervals charged to layers as (layer, start mark, end mark), summed only when asked (after `wait`)."""

    def __init__(self, marks: Marks, nlayers: int):
        self.marks = marks
        self.nlayers = nlayers
        self.entries: list[tuple[int, Any, Any]] = []

    def charge(self, layer: int, a: Any, b: Any) -> None:
        self.entries.append((layer, a, b))

    def totals(self) -> list[float]:
        self.marks.wait()
        acc = [0.0] * self.nlayers
        for layer, a, b in self.entries:
            acc[layer] += self.marks.elapsed_s(a, b)
        return acc


class _BackwardAttribution:
    """Maps autograd nodes to layers and charges the marks between hooks to the layer being differentiated."""

    def __init__(self, nlayers: int, marks: Marks, start_layer: int, *, keep_activations: bool = True):
        self.keep_activations = keep_activations  # False: `claim` holds no layer output (costmodels/transient.py)
        self.owner: dict[Any, int] = {}
        self.marks = marks
        self.ledger = Ledger(marks, nlayers)
        self.start_layer = start_layer
        self.current = start_layer
        self.last: Any = 0.0
        self.handles: list[RemovableHandle] = []
        self.activations: list[torch.Tensor] = []  # every layer output autograd differentiates

    def claim(self, value: Any, layer: int) -> None:
        if self.keep_activations:
            self.activations += [t for t in pytree.tree_leaves(value)
                                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
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
            now = self.marks.mark()
            self.ledger.charge(self.current, self.last, now)
            self.last = now
            self.current = layer
        return hook

    def totals(self) -> list[float]:
        """Per layer, the backward time (or FLOPs) charged so far."""
        return self.ledger.totals()

    def input_grad(self, loss: torch.Tensor) -> list[float]:
        """Per layer, what the backward w.r.t. the layers' outputs only costs: the input-gradient part B.

        Zero bubble (Qi et al. 2024 §2) splits a backward into B and the weight gradient W. Asking
        autograd for the activations' gradients alone runs every node but skips the weight-gradient
        outputs (AddmmBackward computes mat1's gradient only), so the clock charged here is B, and the
        full backward after it minus B is W. Leaves the ledger empty for that full backward.
        """
        return self.input_grad_marked(loss)[0]

    def input_grad_marked(self, loss: torch.Tensor) -> tuple[list[float], tuple[Any, Any]]:
        """`input_grad`, and the (start, end) marks of that pass (a timed step leaves it out of its wall time)."""
        start = end = self.marks.mark()
        if self.activations and loss.requires_grad:
            self.last = start
            torch.autograd.grad(loss, self.activations, retain_graph=True, allow_unused=True)
            end = self.marks.mark()
            self.ledger.charge(self.current, self.last, end)
        out = self.ledger.totals()
        self.ledger, self.current = Ledger(self.marks, len(out)), self.start_layer
        return out, (start, end)

    def backward(self, loss: torch.Tensor, spec: ModelSpec) -> None:
        if not loss.requires_grad:
            raise UserError(f"{spec.path}: the loss does not depend on any parameter that requires a gradient",
                            "pipeplan plans training: unfreeze parameters or check loss_fn")
        self.last = self.marks.mark()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward has no annotations
        self.ledger.charge(self.current, self.last, self.marks.mark())


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
    the rare model whose ops have no fake-tensor implementation. The step under torch.autocast: count_saved.
    """
    fake_mode, args, fake_target, state_storages = step_args(ep, model, inputs, target, fake_tensors=fake_tensors)

    fwd = [0] * nlayers
    saved = [0] * nlayers
    node_flops: dict[str, int] = {}
    last_layer = nlayers - 1
    cur = {"layer": last_layer, "start": 0}

    counter = flop_counter()

    def before(layer: int) -> None:
        cur["layer"] = layer
        cur["start"] = counter.get_total_flops()

    attribution = _BackwardAttribution(nlayers, Marks(counter.get_total_flops), last_layer)

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        f = counter.get_total_flops() - cur["start"]
        fwd[layer] += f
        node_flops[node.name] = f
        attribution.claim(out, layer)

    pack = _saved_counter(saved, cur, state_storages, None)
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
    return Counts(fwd_flops=fwd, bwd_flops=[int(x) for x in attribution.totals()], saved_bytes=saved,
                  peak_saved_bytes=sum(saved), node_flops=node_flops, total_fwd_flops=total_fwd,
                  bwd_input_flops=[int(x) for x in bwd_input])


def _saved_counter(saved: list[int], cur: dict[str, int], state_storages: set[int],
                   casts: Casts | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook adding each storage autograd saves, once, to the layer `cur` names: never model state (parameters,
    buffers, and under `casts` the weights' 16-bit copies)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
        except Exception:  # tensors without a plain storage (nested, sparse): count their elements
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in state_storages and key not in seen and (casts is None or key not in casts.storages):
            seen.add(key)
            saved[cur["layer"]] += nbytes
        return t

    return pack


def _out_bytes(out: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


class Saved(NamedTuple):
    saved_bytes: list[int]  # per layer, as Counts.saved_bytes
    node_out_bytes: dict[str, int]  # each node's output bytes


def count_saved(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: tuple[Any, ...],
                target: Any, layer_of: dict[str, int], nlayers: int, casts: Casts) -> Saved:
    """`count_pass`'s saved bytes and node outputs under `casts`, from the forward and the loss alone, on fake tensors.

    Why no backward: autograd saves tensors as the forward records them (the pack hook runs then), so a step's saved
    bytes are known when the loss is. count_pass's backward, input-gradient pass and FLOP counter took 60-90% of its
    time, once per device's autocast lists, for nothing the replay reports (costmodels/autocast_bytes.py).
    """
    fake_mode, args, fake_target, state_storages = step_args(ep, model, inputs, target)
    saved = [0] * nlayers
    cur = {"layer": nlayers - 1}
    out_bytes: dict[str, int] = {}
    held: list[Any] = []  # every output kept alive, as count_pass's claim keeps them: no saved storage is freed

    def before(layer: int) -> None:
        cur["layer"] = layer

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        out_bytes[node.name] = _out_bytes(out)
        held.append(out)

    with fake_mode, torch.autograd.graph.saved_tensors_hooks(_saved_counter(saved, cur, state_storages, casts),
                                                             lambda t: t):
        out = _LayerInterpreter(ep.graph_module, layer_of, before, after, casts).run(*args)
        cur["layer"] = nlayers - 1
        with casts.loss_context():
            spec.loss(user_output(ep, out), fake_target)
    return Saved(saved, out_bytes)


def step_args(ep: torch.export.ExportedProgram, model: torch.nn.Module, inputs: tuple[Any, ...], target: Any, *,
              fake_tensors: bool = True) -> tuple[Any, list[Any], Any, set[int]]:
    """(fake mode or None, the program's flat arguments, the target, the storages of parameters and buffers) for
    a counted step: fake copies of the real tensors by default (a tied parameter stays one tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake_tensors else None
    real_args = program_args(ep, model, [t for t in pytree.tree_leaves(inputs)])
    converted: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or fake_mode is None:  # None: not fake_tensors
            return t
        if id(t) not in converted:
            f = fake_mode.from_tensor(t.detach())
            if t.requires_grad:
                f.requires_grad_(True)
            converted[id(t)] = f
        return converted[id(t)]

    args = [fake(a) for a in real_args]
    state_storages = {a.untyped_storage()._cdata for a, r in zip(args, real_args, strict=True)
                      if isinstance(a, torch.Tensor) and not _is_user(r, inputs)}
    return fake_mode, args, pytree.tree_map(fake, target), state_storages


def _is_user(t: Any, inputs: tuple[Any, ...]) -> bool:
    return any(t is u for u in pytree.tree_leaves(inputs))


@dataclass
class Timing:
    fwd_s: list[float]
    bwd_s: list[float]
    bwd_weight_s: list[float]  # of bwd_s, the weight-gradient part W: median of each step's backward less its B
    step_s: list[float]  # wall time of each timed step (fwd + loss + bwd)
    warmup_s: float
    repeats: int
    node_overhead_s: float = 0.0  # the interpreter's time per node, taken out of the forward times (`_compiled_forward`)
    hook_overhead_s: float = 0.0  # a CUDA trace's time per backward hook, taken out of the backward (`_unhooked_backward`)
    last_save_share: list[float] = field(default_factory=list)  # of each layer's forward, the part up to its last save
    saved_tensors: list[int] = field(default_factory=list)  # tensors each layer's forward saves for backward
    # of each layer's backward, the adds into existing weight gradients a fresh one skips (costmodels/accumulate.py)
    grad_accumulate_s: list[float] = field(default_factory=list)


def _one_step(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, args: list[Any], target: Any,
              layer_of: dict[str, int], nlayers: int, marks: Marks | None = None,
              ) -> tuple[list[float], list[float], float, list[float], list[int]]:
    """One timed training step: per-layer forward and backward seconds, the whole step's, per-layer B, and how
    many autograd nodes of each layer carry a timing hook.

    Every boundary is a mark (`marks`, default perf_counter); the intervals are resolved
    after the step, so CUDA events need one synchronize per step, not one per layer.
    """
    marks = marks or Marks(time.perf_counter)
    last_layer = nlayers - 1
    forward = Ledger(marks, nlayers)
    cur: dict[str, Any] = {"start": 0.0}
    attribution = _BackwardAttribution(nlayers, marks, last_layer)

    def before(layer: int) -> None:
        cur["start"] = marks.mark()

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        forward.charge(layer, cur["start"], marks.mark())
        attribution.claim(out, layer)

    # Gradients are kept from the step before: a pipeline's microbatches 2..M accumulate into them,
    # which reads and writes each gradient instead of writing a fresh one (11-15% of a weight-heavy
    # backward here, docs/runtime.md), so that is the backward a stage runs most often.
    # The garbage collector is off while steps are timed (`_collector_off`).
    step, b_pass, b = _timed_step(ep, spec, args, target, layer_of, forward, attribution, before, after)
    hooks = [0] * nlayers
    for layer in attribution.owner.values():
        hooks[layer] += 1
    return forward.totals(), attribution.totals(), marks.elapsed_s(*step) - marks.elapsed_s(*b_pass), b, hooks


def _timed_step(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any,
                layer_of: dict[str, int], forward: Ledger, attribution: _BackwardAttribution,
                before: Callable[[int], None], after: Callable[[int, torch.fx.Node, Any], None],
                ) -> tuple[tuple[Any, Any], tuple[Any, Any], list[float]]:
    """Runs the step, charging the loss to the last layer: the step's (start, end) marks, the B pass's, and B.

    Before the full backward, the input-gradient pass B runs alone (`input_grad`, retaining the
    graph), so each layer's W is its full backward less its B, both timed in this step: zero-bubble
    schedules run the two apart, and their time split is not their FLOP split (graph.weight_grad_time_share).
    """
    marks = forward.marks
    t0 = marks.mark()
    out = _LayerInterpreter(ep.graph_module, layer_of, before, after).run(*args)
    t1 = marks.mark()
    loss = spec.loss(user_output(ep, out), target)
    forward.charge(forward.nlayers - 1, t1, marks.mark())  # the loss runs on the last stage
    del out
    b, b_pass = attribution.input_grad_marked(loss)
    attribution.backward(loss, spec)
    end = marks.mark()
    for h in attribution.handles:
        h.remove()
    return (t0, end), b_pass, b


def _forward_only(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any) -> Any:
    """The compiled program's forward and the loss, no marks; the loss (callers that time a forward drop it)."""
    out = ep.graph_module(*args)
    return spec.loss(user_output(ep, out), target)


def _device_of(args: list[Any]) -> torch.device:
    """The device the program's tensors are on (the first tensor's; the tracer puts them all on one)."""
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """Python's garbage collector off for the warm-up and every timed step, after one collection before them.

    A collection inside a timed step lands on whichever layer is running. Collecting before each step instead
    (as the tracer did) walks every Python object and leaves the caches cold for the step that follows: a tiny
    U-Net's interpreted forward (tests/runtime_model_unet.py, batch 64) took 1.5 ms after a collection against
    0.73 ms without, while `pipeplan run`, which never collects, runs the whole stage's forward in 0.63 ms.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_pass(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec, inputs: tuple[Any, ...],
              target: Any, layer_of: dict[str, int], nlayers: int, *, repeats: int | None, budget_s: float = 10.0,
              progress: Callable[[str, int, int], None] | None = None,
              owned_params: Sequence[Sequence[torch.nn.Parameter]] | None = None) -> Timing:
    """Warm-up, then `repeats` timed steps (default: as many as fit in budget_s, 1 to 10); medians per layer.

    On a CUDA device the layers are timed with CUDA events (`CudaEventMarks`), elsewhere with perf_counter.
    `owned_params[i]`: the parameters layer i owns, whose gradient adds are then timed too
    (costmodels/accumulate.py).
    """
    args = program_args(ep, model, [t for t in pytree.tree_leaves(inputs)])
    marks = marks_for(_device_of(args))
    if progress:
        progress("timing (warm-up step)", 0, 1)
    # Warm up the forward first; a model whose forward alone takes a second or more has
    # negligible one-time costs relative to its step, so its backward is not warmed up
    # separately (that saves a whole backward, ~2/3 of a step, on GPT-2-sized models).
    # A GPU's first step loads kernels and picks cuBLAS/cuDNN algorithms, so it always warms a whole step.
    cuda = isinstance(marks, CudaEventMarks)
    with _collector_off():
        t0 = time.perf_counter()
        _forward_only(ep, spec, args, target)
        marks.wait()
        warm = time.perf_counter() - t0
        if warm < 1.0 or cuda:
            _, _, warm, _, _ = _one_step(ep, model, spec, args, target, layer_of, nlayers, marks)
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
            runs.append(_one_step(ep, model, spec, args, target, layer_of, nlayers, marks))
    if progress:
        progress("timing layers", repeats, repeats)
    accumulate: list[float] = []
    if owned_params is not None:  # on the gradients the timed steps left
        accumulate = accumulate_times(owned_params, marks, passes=min(3, repeats), plain=cuda)
    fwd = [statistics.median(r[0][i] for r in runs) for i in range(nlayers)]
    bwd = [statistics.median(r[1][i] for r in runs) for i in range(nlayers)]
    # W paired within each step (its backward less its B pass), so a slow step shifts both alike.
    wgrad = [statistics.median(r[1][i] - r[3][i] for r in runs) for i in range(nlayers)]
    per_hook = 0.0
    if cuda:  # on the gradients the timed steps left, as they ran
        fixed, per_hook = _unhooked_backward(ep, spec, args, target, bwd, runs[-1][4], repeats, marks)
        wgrad = [w * (f / b) if b > 0 else w for w, f, b in zip(wgrad, fixed, bwd, strict=True)]
        bwd = fixed
    for p in model.parameters():
        p.grad = None
    fwd, per_node = _compiled_forward(ep, spec, args, target, fwd, layer_of, repeats, marks)
    share, saves = save_points(ep, spec, args, target, layer_of, nlayers, marks, passes=min(3, repeats))
    return Timing(fwd_s=fwd, bwd_s=bwd, bwd_weight_s=wgrad, step_s=[r[2] for r in runs], warmup_s=warm,
                  repeats=repeats, node_overhead_s=per_node, hook_overhead_s=per_hook, last_save_share=share,
                  saved_tensors=saves,
                  grad_accumulate_s=accumulate)


def save_points(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any,
                layer_of: dict[str, int], nlayers: int, marks: Marks, *, passes: int) -> tuple[list[float], list[int]]:
    """Per layer: the share of its forward that runs before its last tensor saved for backward, and how many it saves.

    Why: torch's non-reentrant checkpoint (the runtime's recomputation, runtime/recompute.py) stops its re-run
    as soon as every tensor the forward saved has been saved again ("early stop", the default of
    `torch.utils.checkpoint.set_checkpoint_early_stop`). What a stage's forward computes after its last save
    is never re-run: a Linear saves its input and weight before it multiplies, so a stage that ends in one
    re-runs everything but that matmul (measured here: 14.6 ms of a 30 ms forward). A pack hook marks each
    save; separate forward-only passes, because the hooks' Python calls would slow the timed steps (and their
    unpack twins the backward). The share, not the time, is kept: the timed forward is the cleaner clock.
    """
    runs = [_save_pass(ep, args, layer_of, nlayers, marks) for _ in range(max(1, passes))]
    fwd = [statistics.median(r[0][i] for r in runs) for i in range(nlayers)]
    up = [statistics.median(r[1][i] for r in runs) for i in range(nlayers)]
    return [min(1.0, u / f) if f > 0 else 0.0 for u, f in zip(up, fwd, strict=True)], runs[-1][2]


def _save_pass(ep: torch.export.ExportedProgram, args: list[Any], layer_of: dict[str, int], nlayers: int,
               marks: Marks) -> tuple[list[float], list[float], list[int]]:
    """One forward with a pack hook: per layer its forward time, its time up to its last save, and its saves.

    The hook only records marks (its own time lands after the mark it reads); sums are made after the pass.
    """
    forward = Ledger(marks, nlayers)
    cur: dict[str, Any] = {"layer": None, "start": None}
    count = [0] * nlayers
    last: dict[int, tuple[int, Any, Any]] = {}  # layer -> (its charged nodes so far, the node's start, the save)

    def before(layer: int) -> None:
        cur["layer"], cur["start"] = layer, marks.mark()

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        forward.charge(layer, cur["start"], marks.mark())
        cur["layer"] = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        layer = cur["layer"]
        if layer is not None:  # inside a layer's node (the loss is outside every stage)
            last[layer] = (len(forward.entries), cur["start"], marks.mark())
            count[layer] += 1
        return t

    gc.collect()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _LayerInterpreter(ep.graph_module, layer_of, before, after).run(*args)
    del out
    fwd = forward.totals()  # waits for the device
    upto = [0.0] * nlayers
    for layer, (k, start, mark) in last.items():
        upto[layer] = sum(marks.elapsed_s(a, b) for lay, a, b in forward.entries[:k] if lay == layer)
        upto[layer] += marks.elapsed_s(start, mark)
    return fwd, upto, count


def _compiled_forward(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any,
                      fwd: list[float], layer_of: dict[str, int], repeats: int, marks: Marks,
                      ) -> tuple[list[float], float]:
    """The layers' forward times less the interpreter's share: (times, seconds per node taken out).

    The forward is timed node by node through torch.fx.Interpreter, which spends Python time per node
    (argument lookup, environment bookkeeping) that the runtime's stages, compiled GraphModules, do not.
    On models of small ops that is most of the forward: a 32x32 U-Net's layers summed to 1.95 ms where its
    stage's forward took 0.87 ms in `pipeplan run`. So the compiled program is timed too (forward + loss, as
    the layer times count them), and the excess over it, per node, is taken out of each layer by its node
    count, never below the layer's proportional share of the compiled time. The backward runs in autograd's
    engine either way and is left as measured.
    """
    times = []
    for _ in range(max(3, repeats)):
        a = marks.mark()
        _forward_only(ep, spec, args, target)
        b = marks.mark()
        marks.wait()
        times.append(marks.elapsed_s(a, b))
    nodes = [0] * len(fwd)
    for layer in layer_of.values():
        nodes[layer] += 1
    return take_out_excess(fwd, nodes, statistics.median(times))


def _unhooked_backward(ep: torch.export.ExportedProgram, spec: ModelSpec, args: list[Any], target: Any,
                       bwd: list[float], hooks: list[int], repeats: int, marks: Marks) -> tuple[list[float], float]:
    """A CUDA trace's layer backward times less its hooks' share: (times, seconds per hook taken out).

    The backward is timed by a pre-hook on every autograd node that records a CUDA event (`_BackwardAttribution`):
    a Python call and a cudaEventRecord per node. A model whose GPU waits for the host (small convolutions at
    32x32 on an H200: its CUDA-graph replay took half its eager step, benchmarks/RESULTS.md, GPU (e)) spends that
    host time in the GPU's intervals too: the 32x32 U-Net's traced backward summed to 3.76 and 6.62 ms in two
    traces, against 3.18 and 2.38 ms in `pipeplan run`. So the same backward is timed without hooks (its
    forward run untimed before it; into the gradients the timed steps left, as they ran), and the excess comes
    out per hook (instrument.take_out_excess), as `_compiled_forward` takes out the interpreter's per node. On a
    CPU the mark is a perf_counter read, and the hooked and unhooked backwards agreed within 2% on the examples and
    tests/runtime_model_unet.py at batch 32 (measured here, one thread), so it is not run there.
    """
    times = []
    for _ in range(max(3, repeats)):
        loss = _forward_only(ep, spec, args, target)
        a = marks.mark()
        loss.backward()
        b = marks.mark()
        marks.wait()
        times.append(marks.elapsed_s(a, b))
    return take_out_excess(bwd, hooks, statistics.median(times))
