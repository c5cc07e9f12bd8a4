"""GPipe that holds, per microbatch in flight, what torchgpipe holds: the stage's input and what autograd saves;
1F1B with the same receive buffers.

Why not torch's `ScheduleGPipe` as it is (torch 2.13, schedules.py and stage.py): a stage allocates a receive
buffer per microbatch for its input and another for its output's gradient when the step is first set up, and
keeps all of them for the life of the schedule (pytorch/pytorch#136380); it keeps every microbatch's output in
`fwd_cache` until that microbatch's backward although the backward needs only the output's autograd node; each
input's gradient stays as `.grad` of its receive buffer until the next step; and the loop waits for its sends
only once every forward (and every backward) has run, so each sent tensor lives until the phase ends. On
ResNet-101's second stage of four (22 samples a microbatch, 256 microbatches) that is 185 MiB a microbatch where
torchgpipe keeps its 76 MiB input, and the search had to give up a balanced split for it (benchmarks/RESULTS.md,
"published GPU training throughput").

This loop runs torch's stage methods in GPipe's order (all forwards, then all backwards) and changes only what is
kept: receive buffers are made when a microbatch's receive is posted and dropped after its backward; a sent
output's data is replaced by a one-element stand-in once the send is done, as Megatron-LM's
`deallocate_output_tensor` does (its autograd node stays for the backward); one send per direction is in flight at
a time (the previous microbatch's is waited before the next is posted, as torch's 1F1B does); the input's gradient
is freed once sent. costmodels/memory.py prices this (`receive_buffers`, `kept_outputs` for "gpipe").
1F1B (`Lean1F1B`) runs torch's own loop over stages whose buffers live the same way (`receive_lazily`); both let
go of each loss's graph after its backward (`_LossesLetGo`).

It lives here, not in runtime/, because `profiles calibrate` times the runtime's schedules on this machine
(hardware_profiles/pipeline_ops.py, below runtime/ in the import order) and must time this loop.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining.schedules import _sorted_batch_p2p, _wait_batch_p2p


def _placeholder(meta: Any, device: torch.device) -> torch.Tensor:
    """What a receive buffer holds between its microbatch's backward and its next receive: nothing."""
    return torch.empty(0, dtype=getattr(meta, "dtype", None), device=device)


def defer_receive_buffers(stage: Any) -> None:
    """Make the stage's per-microbatch receive buffers placeholders at set-up (`allocate` makes each when used).

    Patches the instance's two set-up methods (stage.py `_setup_forward_recv_info`, `_setup_backward_recv_info`),
    which allocate M buffers each way through `_make_tensor_from_meta` and do nothing else with them.
    """
    for name in ("_setup_forward_recv_info", "_setup_backward_recv_info"):
        original = getattr(stage, name)

        def deferred(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            make = getattr(stage_module, "_make_tensor_from_meta")  # noqa: B009  # private to torch
            setattr(stage_module, "_make_tensor_from_meta", _placeholder)  # noqa: B010
            try:
                return _original(*args, **kwargs)
            finally:
                setattr(stage_module, "_make_tensor_from_meta", make)  # noqa: B010

        setattr(stage, name, deferred)


def _receiving(infos: Sequence[Any]) -> list[Any]:
    """The receive infos that hold a buffer (not the first stage's root inputs, not a None gradient)."""
    return [i for i in infos if not i.is_root_arg and i.tensor_meta is not None]


def allocate(infos: Sequence[Any], device: torch.device) -> None:
    make = getattr(stage_module, "_make_tensor_from_meta")  # noqa: B009  # private to torch
    for info in _receiving(infos):
        info.buffer = make(info.tensor_meta, device)


def release(infos: Sequence[Any], device: torch.device) -> None:
    for info in _receiving(infos):
        info.buffer.grad = None
        info.buffer = _placeholder(info.tensor_meta, device)


def receive_lazily(stage: Any) -> None:
    """Give the stage's receive buffers the life of their microbatch (`LeanGPipe`, `Lean1F1B`): each is made when its
    receive is asked for (`get_fwd_recv_ops`, `get_bwd_recv_ops`), an output gradient's dropped after its
    backward, an input's (with its gradient, which the send ops then hold until sent) once its gradient's sends
    are made (`get_bwd_send_ops`). Patches the instance's methods, as runtime/measure.py's timing does.

    Under torch's 1F1B too (`Lean1F1B`), whose loop calls the same methods in its own order."""
    defer_receive_buffers(stage)
    fwd_recv, bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops
    backward, bwd_send = stage.backward_one_chunk, stage.get_bwd_send_ops

    def get_fwd_recv_ops(chunk: int) -> Any:
        allocate(stage.args_recv_info[chunk], stage.device)
        return fwd_recv(chunk)

    def get_bwd_recv_ops(chunk: int) -> Any:
        if stage.has_backward and not stage.is_last:
            allocate(stage.grad_recv_info[chunk], stage.device)
        return bwd_recv(chunk)

    def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
        out = backward(chunk, *args, **kwargs)
        if stage.has_backward and not stage.is_last:
            release(stage.grad_recv_info[chunk], stage.device)
        return out

    def get_bwd_send_ops(chunk: int) -> Any:
        ops = bwd_send(chunk)
        release(stage.args_recv_info[chunk], stage.device)
        return ops

    stage.get_fwd_recv_ops, stage.get_bwd_recv_ops = get_fwd_recv_ops, get_bwd_recv_ops
    stage.backward_one_chunk, stage.get_bwd_send_ops = backward_one_chunk, get_bwd_send_ops


def deallocate_outputs(stage: Any, chunk: int) -> None:
    """Free the data of the outputs a middle stage sent for `chunk`; their autograd nodes stay for the backward.

    Megatron-LM's `deallocate_output_tensor` (megatron/core/pipeline_parallel/schedules.py) sets `.data` to a
    one-element tensor; here the element is expanded to the output's shape, so torch's `stage_backward`, whose
    `torch.autograd.backward` checks each gradient's shape against its output's, runs unchanged. A view's base
    (a linear layer's 2-D product reshaped) is freed with it where the view alone holds it.
    """
    if stage.is_last or chunk not in stage.fwd_cache:
        return
    outputs, _ = stage.fwd_cache[chunk]
    for out in outputs:
        if isinstance(out, torch.Tensor) and _only_holder(out, python_refs=2):  # the tuple's and `out`
            base = out._base
            if base is None:
                _free(out)
            elif base._base is None and _only_holder(base, python_refs=2, impl_refs=2):  # `base`, and its tensor's hold on it
                _free(out)
                _free(base)
            del base


def _only_holder(t: torch.Tensor, *, python_refs: int, impl_refs: int = 1) -> bool:
    """Whether freeing `t`'s data can change nothing but memory: a non-leaf (a leaf is an input passed through,
    which the stage still needs) that nothing holds beyond the references the caller counts. Not an output another
    op of the stage saved as it is: autograd keeps such a tensor itself (`_use_count` above 1), and its backward
    would read the stand-in (a U-Net's skip output, read again by the stage's next convolution). One saved as an
    output (a ReLU's) autograd keeps under a tensor of its own, so its memory stays and only the stage's goes.
    `python_refs`: the caller's references to the Python object (this call adds `t` and getrefcount's own)."""
    return (t.grad_fn is not None and t.numel() > 1 and t._use_count() == impl_refs  # type: ignore[attr-defined]
            and sys.getrefcount(t) == python_refs + 2)


def _free(t: torch.Tensor) -> None:
    t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


class _LossesLetGo:
    """A last stage's microbatch lets go of its inputs once its backward is done.

    torch keeps each microbatch's loss for the step's end (`_internal_losses`, for `_update_losses`); a loss holds
    its autograd graph's nodes, and the node that accumulates into a received input (a leaf) holds that input, so
    the last stage kept every microbatch's input until the step ended however its buffers were released (1F1B's
    2-stage MLP: 32.1 MiB measured, 29.1 with this and as predicted). The backward gets the loss with its graph;
    the list keeps a detached copy, whose value is all `_update_losses` reads.
    """

    _internal_losses: list[Any]

    def _maybe_get_loss(self, stage: Any, mb_index: int) -> Any:
        loss = super()._maybe_get_loss(stage, mb_index)  # type: ignore[misc]
        if isinstance(loss, torch.Tensor):
            self._internal_losses[mb_index] = loss.detach()
        return loss


class Lean1F1B(_LossesLetGo, Schedule1F1B):
    """torch's 1F1B loop over stages that receive lazily (`receive_lazily`) and let go of their losses' graphs."""


class LeanGPipe(_LossesLetGo, ScheduleGPipe):
    """torch's GPipe order with per-microbatch buffers, sent outputs freed and sends waited one behind."""

    def _step_microbatches(self, arg_mbs: list[Any] | None = None, kwarg_mbs: list[Any] | None = None,
                           target_mbs: list[Any] | None = None, losses: list[Any] | None = None,
                           return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0],  # type: ignore[no-untyped-call]
                               target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        stage, M = self._stage, self._n_microbatches
        with _one_behind() as send:
            for i in range(M):
                with torch.profiler.record_function(f"Forward {i}"):
                    _wait_all(_sorted_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv"))
                    output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                    send(stage.get_fwd_send_ops(i), functools.partial(deallocate_outputs, stage, i))
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)  # type: ignore[no-untyped-call]
                del output
        with _one_behind() as send:
            for i in range(M):
                with torch.profiler.record_function(f"Backward {i}"):
                    _wait_all(_sorted_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv"))
                    loss = self._maybe_get_loss(stage, i)
                    stage.backward_one_chunk(i, loss=loss, last_backward=i == M - 1)
                    del loss
                    send(stage.get_bwd_send_ops(i), None)
        self._update_losses(stage, losses)  # type: ignore[no-untyped-call]
        stage.perform_reduce_grad(M if self.scale_grads else 1)


def _wait_all(works: dict[int, list[Any]]) -> None:
    for w in works.values():
        _wait_batch_p2p(w)


@contextlib.contextmanager
def _one_behind() -> Iterator[Callable[[list[Any], Callable[[], None] | None], None]]:
    """`send(ops, after)`: post these sends once the previous ones are done (then run the previous `after`); on
    leaving, wait for the last. Holding the works no longer than that frees what they send."""
    pending: list[Any] = [None, None]

    def finish() -> None:
        if pending[0] is not None:
            _wait_all(pending[0])
            if pending[1] is not None:
                pending[1]()
        pending[0] = pending[1] = None

    def send(ops: list[Any], after: Callable[[], None] | None) -> None:
        finish()
        pending[0], pending[1] = _sorted_batch_p2p(ops, desc="send"), after

    yield send
    finish()


# torch's class -> what the runtime runs instead, over stages that `receive_lazily`: the schedules whose facts say
# `receives_per_microbatch` (pipeplan/schedules.py; tests/test_lean_gpipe.py holds the two to each other)
LEAN_CLASSES: dict[type, type] = {ScheduleGPipe: LeanGPipe, Schedule1F1B: Lean1F1B}


def single_stage_schedule(cls: type, stage: Any, microbatches: int, **kwargs: Any) -> Any:
    """The schedule object the runtime runs for a one-stage-a-rank torch schedule class: GPipe and 1F1B as
    `LEAN_CLASSES` say, their stages receiving lazily; the others as torch has them."""
    if cls in LEAN_CLASSES:
        receive_lazily(stage)
        cls = LEAN_CLASSES[cls]
    return cls(stage, microbatches, **kwargs)
