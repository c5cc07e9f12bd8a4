"""Bytes a step holds beyond what autograd saves: per layer, the peak of its tensors in flight.

Why: the memory model's activations are the tensors autograd saves for backward (measure.count_pass), but a
step also holds tensors nobody saves: a layer's output until the next layer has read it, the gradients the
backward is passing on, and at the loss the gradient of the log-probabilities and of the logits, two tensors
of batch x sequence x vocabulary for a language model, while the saved log-probabilities are still held. On
the H100 (benchmarks/RESULTS.md, "GPU: predicted against measured") GPT-2's step peaked at 13.0 GB against
8.5 GB predicted from saved tensors and model state; the loss's tensors were most of the difference.

How: one more forward + loss + backward on fake tensors (no arithmetic), under a dispatch mode that logs every
op's new output storages and, through a weak reference, when each is freed. Storages autograd saves (a pack
hook) are attributed to the layer that first saved them; parameters and buffers are not logged, and the
parameters' gradients and any tensor the backward makes in a layer's own parameter's shape (a weight gradient)
are left out when the log is replayed: they are model state, or do not grow with the batch as everything
counted here must (the memory model scales it to the microbatch; memory.accumulating_grad_bytes prices them).
Per layer, the most bytes live at the end of any of its ops (its forward nodes, the backward of the autograd
nodes they created; the loss and its backward count as the last layer's, as the runtime computes the loss on
the last stage), less everything it and the layers before it saved: what is in flight beyond the saved
activations the memory model already holds. At an op's end its inputs and outputs are both alive, which is
when an op's memory peaks. Held against torch's own estimator (torch.distributed._tools.mem_tracker.MemTracker)
on real steps: tests/test_transient_memory.py.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipeplan.costmodels.autocast_policy import Casts
from pipeplan.costmodels.measure import Marks, _BackwardAttribution, _LayerInterpreter, step_args, user_output
from pipeplan.costmodels.model_file import ModelSpec


class StorageLog(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves its __init_subclass__ unannotated
    """Allocations, frees and op ends, in order, under a dispatch mode; each storage gets an id per lifetime
    (addresses are reused). Storages in `state` (parameters, buffers, existing gradients) are not logged: a
    view of a weight is no new memory. The runtime meters a CPU step's peak with it too (runtime/measure.py)."""

    def __init__(self, layer_now: Any, state: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layer_now = layer_now  # () -> the layer the current op belongs to
        self.state = state  # storage addresses (`untyped_storage()._cdata`) left out
        self.events: list[tuple[str, int, int]] = []  # ("a", id, bytes), ("f", id, 0), ("m", layer, 0)
        self.ids: dict[int, int] = {}  # storage address -> id of its live lifetime
        self.saved_at: dict[int, int] = {}  # id of a storage autograd saved -> the layer that first saved it
        self.made_in: dict[int, int] = {}  # id of a storage -> the layer whose op allocated it
        self.weight_grad: Callable[[torch.Tensor], bool] = lambda t: False  # is this new tensor a weight gradient?
        self.weight_grads: set[int] = set()  # ids of the storages it said so of

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                uid = self._track(t.untyped_storage())
                if uid is not None and self.weight_grad(t):
                    self.weight_grads.add(uid)
        self.events.append(("m", self.layer_now(), 0))
        return out

    def _track(self, st: Any) -> int | None:
        key = st._cdata
        if key in self.ids or key in self.state:
            return None
        uid = len(self.events)
        self.ids[key] = uid
        self.made_in[uid] = self.layer_now()
        self.events.append(("a", uid, st.nbytes()))
        weakref.finalize(st, self._free, key, uid)
        return uid

    def _free(self, key: int, uid: int) -> None:
        if self.ids.get(key) == uid:
            del self.ids[key]
        self.events.append(("f", uid, 0))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        uid = self.ids.get(t.untyped_storage()._cdata)
        if uid is not None and uid not in self.saved_at:
            self.saved_at[uid] = self.layer_now()
        return t

    def live_ids(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The ids of these tensors' storages, where the log is tracking them now (e.g. gradients it saw made)."""
        return {self.ids[k] for k in (t.untyped_storage()._cdata for t in tensors) if k in self.ids}

    def peak_bytes(self, left_out: set[int]) -> int:
        """The most bytes live at once over the log, storages with ids in `left_out` aside."""
        return max((now for _, _, now in _replay(self.events, left_out)), default=0)


def _replay(events: list[tuple[str, int, int]], left_out: set[int]) -> Iterator[tuple[str, int, int]]:
    """Every logged event with the bytes live after it, storages with ids in `left_out` aside."""
    live: dict[int, int] = {}
    now = 0
    for kind, a, b in events:
        if kind == "a" and a not in left_out:
            live[a] = b
            now += b
        elif kind == "f":
            now -= live.pop(a, 0)
        yield kind, a, now


def _beyond_saved(events: list[tuple[str, int, int]], saved_at: dict[int, int], left_out: set[int],
                  nlayers: int) -> list[int]:
    """Per layer, the most bytes live at one of its op ends beyond everything saved by it and the layers
    before it (never below 0); storages with ids in `left_out` (gradients) are not counted."""
    sizes = {a: b for kind, a, b in events if kind == "a"}
    saved = [0] * nlayers
    for uid, layer in saved_at.items():
        if uid not in left_out:  # autocast's weight copies are saved too, and left out as model state
            saved[layer] += sizes.get(uid, 0)
    upto = list(itertools.accumulate(saved))  # upto[L]: saved by layers 0..L
    beyond = [0] * nlayers
    for kind, layer, now in _replay(events, left_out):
        if kind == "m":
            beyond[layer] = max(beyond[layer], now - upto[layer])
    return beyond


class _DeferredGrads:
    """Per layer, the bytes of the output gradients of its weight ops: what a split backward's input pass B keeps
    for its weight pass W.

    torch.distributed.pipelining's zero-bubble schedules run B as `stage_backward_input` (torch 2.13
    _backward.py): a prehook on every autograd node where the input's path meets a parameter's (a Linear's
    AddmmBackward, a norm's, a `weight * x`) keeps the gradient flowing into it, the gradient of that op's output,
    until W computes the weight gradients from it. A weight op here: an op with an input computed from parameters
    alone (a parameter, or a view of one) beside an input that needs a gradient and is not one (an activation);
    a lookup into an embedding with integer indices has none. Held against what torch's B keeps:
    tests/test_deferred_grads.py.
    """

    def __init__(self, ep: torch.export.ExportedProgram, nlayers: int) -> None:
        self.param_like = set(ep.graph_signature.inputs_to_parameters)  # placeholder names
        for node in ep.graph.nodes:
            ins = node.all_input_nodes
            if node.op == "call_function" and ins and all(a.name in self.param_like for a in ins):
                self.param_like.add(node.name)
        self.bytes = [0] * nlayers

    def weight_op(self, node: torch.fx.Node, value_of: Callable[[torch.fx.Node], Any]) -> bool:
        """Whether `node` (its inputs computed, `value_of`) is a weight op."""
        ins = node.all_input_nodes
        if node.op != "call_function" or not any(a.name in self.param_like for a in ins):
            return False
        return any(a.name not in self.param_like and getattr(value_of(a), "requires_grad", False) for a in ins)

    def see(self, layer: int, out: Any) -> None:
        """A weight op of `layer` made `out`: its first tensor's bytes are its output gradient's."""
        first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        if first is not None:
            self.bytes[layer] += first.numel() * first.element_size()


class _NodeInterpreter(_LayerInterpreter):
    """`_LayerInterpreter` that tells `on_node` each node before it runs, its inputs computed."""

    def __init__(self, gm: torch.fx.GraphModule, layer_of: dict[str, int], before: Callable[[int], None],
                 after: Callable[[int, torch.fx.Node, Any], None], on_node: Callable[[torch.fx.Node], None],
                 casts: Casts | None = None):
        super().__init__(gm, layer_of, before, after, casts)
        self.on_node = on_node

    def run_node(self, n: torch.fx.Node) -> Any:
        self.on_node(n)
        return super().run_node(n)


class InFlight(NamedTuple):
    """What `transient_bytes` measures, per layer."""

    transient: list[int]  # the peak bytes live while its ops run beyond what it and the layers before it saved
    deferred: list[int]  # the output gradients a split backward keeps for its weight pass (`_DeferredGrads`)
    loss_saved: list[int]  # what the loss saves (the last layer's; 0 elsewhere): a split backward's B frees it
    nonweight_saved: list[int]  # what its ops other than weight ops save (`_DeferredGrads`), the loss's aside
    input_saved: list[int]  # what it saves (first) of tensors earlier layers made (`saved_inputs`)
    input_nonweight_saved: list[int]  # of input_saved, what its ops other than weight ops save

    @classmethod
    def none_counted(cls, nlayers: int) -> InFlight:
        """Zeros for every count and layer: tensors in flight not counted."""
        return cls(*([0] * nlayers for _ in cls._fields))


def transient_bytes(ep: torch.export.ExportedProgram, model: torch.nn.Module, spec: ModelSpec,
                    inputs: tuple[Any, ...], target: Any, layer_of: dict[str, int], nlayers: int,
                    param_shapes: Sequence[set[tuple[int, ...]]], casts: Casts | None = None) -> InFlight:
    """Per layer (`InFlight`), the tensors in flight beyond saved activations, model state and weight gradients
    aside, and what zero bubble's B keeps and frees, from one microbatch on fake tensors at the traced batch size.
    `param_shapes`: per layer, the shapes of the parameters it uses.

    The loss's saved tensors (cross-entropy's log-probabilities, as large as the logits): torch's B on the last
    stage runs from the loss, then detaches the stage's output and keeps only the weight ops' nodes for W, so
    nothing holds the loss's own nodes and what they saved is freed at B, not at W.

    What ops other than weight ops save (a GELU's input, attention's queries, keys and values): W never reads it,
    and under recomputation each of W's autograd calls (one per parameter group) re-runs the stage and keeps
    what it recomputed for those ops until the W ends (memory.held_with_deferred)."""
    fake_mode, args, fake_target, state = step_args(ep, model, inputs, target)
    last = nlayers - 1
    attribution = _BackwardAttribution(nlayers, Marks(lambda: 0.0), last, keep_activations=False)
    phase = {"layer": last, "backward": False}
    log = StorageLog(lambda: attribution.current if phase["backward"] else phase["layer"], state)
    # A tensor the backward makes in a layer's own parameter's shape is a weight gradient (or a part of one: a
    # tied weight's gradients from two layers, summed): its size does not grow with the batch, so it is not
    # counted here, where everything is scaled to the microbatch; memory.accumulating_grad_bytes prices it.
    log.weight_grad = lambda t: bool(phase["backward"]) and tuple(t.shape) in param_shapes[attribution.current]

    def before(layer: int) -> None:
        phase["layer"] = layer

    deferred = _DeferredGrads(ep, nlayers)
    phase["weight_op"] = False
    nonweight: dict[int, int] = {}  # id of a storage an op other than a weight op saved -> its layer

    def on_node(node: torch.fx.Node) -> None:
        phase["weight_op"] = deferred.weight_op(node, lambda a: interpreter.env.get(a))

    def after(layer: int, node: torch.fx.Node, out: Any) -> None:
        attribution.claim(out, layer)
        if phase["weight_op"]:
            deferred.see(layer, out)

    def pack(t: torch.Tensor) -> torch.Tensor:
        log.pack(t)
        uid = log.ids.get(t.untyped_storage()._cdata)
        if uid is not None and not phase["weight_op"] and not phase["backward"]:
            nonweight.setdefault(uid, int(phase["layer"]))
        return t

    interpreter = _NodeInterpreter(ep.graph_module, layer_of, before, after, on_node, casts)
    with fake_mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), log:
        out = interpreter.run(*args)
        interpreter.env.clear()  # it would keep the model's output alive through the backward
        phase["layer"], phase["weight_op"] = last, False
        before_loss = set(log.saved_at)
        with casts.loss_context() if casts is not None else contextlib.nullcontext():
            loss = spec.loss(user_output(ep, out), fake_target)
        loss_ids = set(log.saved_at) - before_loss
        del out
        phase["backward"] = True
        attribution.backward(loss, spec)
        del loss
    for h in attribution.handles:
        h.remove()
    # A parameter's gradient is model state (memory.model_state_bytes): autograd keeps the first incoming one as
    # `.grad`, so the storage the backward made is still live at the end, under its address.
    grads = log.live_ids(a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None)
    if casts is not None:  # the weights' 16-bit copies: model state of the step (autocast_policy.Casts)
        grads |= log.live_ids(casts.cached.values())
    sizes = {a: b for kind, a, b in log.events if kind == "a"}
    loss_saved = [0] * nlayers
    loss_saved[last] = sum(sizes.get(uid, 0) for uid in loss_ids)
    nonweight_saved = [0] * nlayers
    for uid, layer in nonweight.items():
        if uid not in loss_ids:
            nonweight_saved[layer] += sizes.get(uid, 0)
    from_before, from_before_nonweight = saved_inputs(log, sizes, nonweight, nlayers)
    return InFlight(_beyond_saved(log.events, log.saved_at, grads | log.weight_grads, nlayers), deferred.bytes,
                    loss_saved, nonweight_saved, from_before, from_before_nonweight)


def saved_inputs(log: StorageLog, sizes: dict[int, int], nonweight: dict[int, int],
                 nlayers: int) -> tuple[list[int], list[int]]:
    """Per layer, the bytes it saves (the first to save them) of tensors that earlier layers made, and of those what
    its ops other than weight ops save. Where a pipeline stage starts at the layer, that is its received input: the
    same storage as the stage's receive buffer (or, recomputed, as the input its checkpoint keeps), which the memory
    model counts already (costmodels/memory.py, `stage_memory`: a stage starting at a LayerNorm, a Linear, a GELU
    or a convolution saves its input). The model's own inputs are no layer's and count nowhere here."""
    inputs, inputs_nonweight = [0] * nlayers, [0] * nlayers
    for uid, layer in log.saved_at.items():
        if log.made_in.get(uid, layer) < layer:
            inputs[layer] += sizes.get(uid, 0)
            if nonweight.get(uid) == layer:
                inputs_nonweight[layer] += sizes.get(uid, 0)
    return inputs, inputs_nonweight
