"""What each rank measures while the schedule runs.

Compute time is what the stage's own forward/backward take; everything else in
a step (waiting for a neighbour's activation or gradient, the send itself, the
shared-weight all-reduce) is "wait". That split is exactly the one the planner
predicts (compute vs. bubble + communication), so the two can be compared.

Timing wraps the `PipelineStage` instance's `forward_one_chunk` /
`backward_one_chunk` (and zero bubble's `backward_weight_one_chunk`), which every torch.distributed.pipelining schedule calls
around the pure computation (receives are waited for before, sends issued after). The loss, which the
schedule computes after the last stage's forward, is added to that forward (`timed_loss`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StageStats:
    index: int
    fwd_s: list[float] = field(default_factory=list)  # one entry per microbatch of a measured step
    bwd_s: list[float] = field(default_factory=list)
    wgrad_s: list[float] = field(default_factory=list)  # zero bubble's weight-gradient passes W, apart from B
    events: list[tuple[str, int, float, float]] = field(default_factory=list)  # (kind, microbatch, start, end)


class StepClock:
    """Wall-clock origin of the current step, shared by the stage timers of one rank."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.recording = False

    def start(self, recording: bool) -> None:
        self.origin = time.perf_counter()
        self.recording = recording


def _synchronize(device) -> None:
    """On a GPU the calls return before their kernels finish: wait for them, so the host clock reads the
    compute, not its launch time (timed calls of recorded steps only). Nothing to wait for elsewhere."""
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def instrument(stage, stats: StageStats, clock: StepClock, meter: "SavedTensorMeter | None" = None) -> None:
    """Time forward/backward of one PipelineStage (patches the instance, not the class).

    With an enabled meter, the forward runs under its saved-tensor hooks (CPU memory
    measurement). The hooks cost Python work per saved tensor (~10% of a small
    model's step), so the worker enables the meter only on steps it does not time.
    """
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    device = getattr(stage, "device", None)

    def sync() -> None:
        if clock.recording:
            _synchronize(device)

    def record(kind: str, durations: list, chunk_id, t0: float, t1: float) -> None:
        if clock.recording:
            durations.append(t1 - t0)
            stats.events.append((kind, int(chunk_id), t0 - clock.origin, t1 - clock.origin))

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        if meter is not None and meter.enabled:
            with meter.hooks():
                out = fwd(fwd_chunk_id, *args, **kwargs)
        else:
            out = fwd(fwd_chunk_id, *args, **kwargs)
        sync()
        record("fwd", stats.fwd_s, fwd_chunk_id, t0, time.perf_counter())
        return out

    def timed(fn, kind: str, durations: list):
        def run(chunk_id, *args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(chunk_id, *args, **kwargs)
            sync()
            record(kind, durations, chunk_id, t0, time.perf_counter())
            return out
        return run

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = timed(bwd, "bwd", stats.bwd_s)
    # Zero bubble's W: torch calls it apart from B (which then computes input gradients only); compute too.
    if getattr(stage, "backward_weight_one_chunk", None) is not None:
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "wgrad", stats.wgrad_s)


def timed_loss(loss_fn, stats: StageStats, clock: StepClock, device: torch.device | None = None):
    """`loss_fn` with its time added to the last stage's forward of the same microbatch.

    torch.distributed.pipelining computes the loss after `forward_one_chunk` returns
    (its schedules' `_maybe_compute_loss`), outside the timer `instrument` puts
    around the stage's forward. The trace charges the loss to the last layer's
    forward (costmodels/measure.py), and PipeDream's own loop times it inside its
    forward, so without this the last stage's measured forward looked faster than
    predicted by the loss (0.9 ms of 2.2 in examples/gpt.py's interleaved plan).
    """

    def run(output, target):
        if not clock.recording or not stats.fwd_s:
            return loss_fn(output, target)
        t0 = time.perf_counter()
        loss = loss_fn(output, target)
        _synchronize(device)
        dt = time.perf_counter() - t0
        stats.fwd_s[-1] += dt  # the schedule calls the loss right after the microbatch's forward
        # its event, searched from the end (events accumulate over the run; it is the latest forward)
        last = next(i for i in range(len(stats.events) - 1, -1, -1) if stats.events[i][0] == "fwd")
        kind, mb, start, end = stats.events[last]
        stats.events[last] = (kind, mb, start, end + dt)
        return loss

    return run


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """High-water mark of the bytes autograd keeps for backward (CPU peak-memory estimate).

    Parameters and buffers are excluded (they are counted as weights), by
    storage: autograd saves views of them too (a Linear saves `weight.t()`, a new
    tensor on the weight's memory), and counting those added every weight a
    second time (+32 MiB per stage of 8 x Linear(1024)). A tensor saved by
    several ops counts once (by storage pointer), and is released when the last
    autograd node holding it is freed. Every step saves the same tensors (static
    shapes), so metering the untimed steps (warm-up, or the first step) gives the
    peak without slowing the timed ones.
    """

    def __init__(self, weight_storages: set[int], state_keys: set[int] | None = None):
        self.weight_storages = weight_storages  # untyped_storage().data_ptr() of parameters and buffers
        self.enabled = True  # off: instrument() runs the forward without the hooks
        self.live: dict[int, list[int]] = {}  # data_ptr -> [refs, bytes]
        self.current = 0
        self.peak = 0
        self.state_keys = state_keys  # untyped_storage()._cdata of parameters and buffers, for `step`
        self.step_peak = 0  # the most bytes a metered step held beyond model state (`step`, `op`)
        self._ops: tuple[Any, set[int]] | None = None  # `op`'s log across calls, and the gradients it saw

    @contextlib.contextmanager
    def step(self, modules):
        """A step (the schedule's forwards and backwards) whose every tensor is logged while the meter is on: the
        most bytes it held at once beyond the `modules`' parameters, buffers and the gradients it leaves
        (`step_peak`). The saved tensors are part of it, and so are what they leave out: outputs not yet read,
        gradients in flight, the loss's (costmodels/transient.py, whose log this is). It costs a dispatch per
        op, so only the steps the meter is on for (untimed ones) are logged; the parameters are listed only then.
        One `op` whose log is read at once."""
        with self.op(modules):
            yield
        self.close_ops()

    @contextlib.contextmanager
    def op(self, modules):
        """One op of a loop that updates between its ops (PipeDream's and 2BW's), logged while the meter is on
        into one log across calls, as `step` logs a whole step; the updates between them stay out of it (the
        optimizer's state, which its first step makes, is model state). Every storage that was a parameter's
        `.grad` after an op is left out (model state; the loop sets them and the update frees them).
        `close_ops` reads the peak."""
        if not self.enabled or self.state_keys is None:
            yield
            return
        if self._ops is None:
            from pipeplan.costmodels.transient import StorageLog

            self._ops = (StorageLog(lambda: 0, set(self.state_keys)), set())
        log, grads = self._ops
        with log:
            yield
        grads |= log.live_ids(p.grad for m in modules for p in m.parameters() if p.grad is not None)

    def close_ops(self) -> None:
        """The peak of what `op` logged into `step_peak`."""
        if self._ops is not None:
            log, grads = self._ops
            self.step_peak = max(self.step_peak, log.peak_bytes(grads))
            self._ops = None

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def pack(self, t: torch.Tensor):
        if t.device.type != "cpu":
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.weight_storages:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # a detached view in the box, not the tensor: a saved output would otherwise make a cycle (box -> tensor ->
        # its grad_fn -> the box), which a split backward never breaks (B retains the graph, W runs only the
        # weight nodes), so the metered step held what B alone needed until Python's cycle collector ran
        box = _Saved(t.detach())
        weakref.finalize(box, self._release, ptr)
        return box

    @staticmethod
    def unpack(box):
        return box.tensor if isinstance(box, _Saved) else box

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def weight_storages(modules) -> set[int]:
    """The storages of these modules' parameters and buffers (what SavedTensorMeter leaves out)."""
    return {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}


def state_keys(modules) -> set[int]:
    """The same storages by their storage object's address, as the step log (`SavedTensorMeter.step`) keys them."""
    return {t.untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(state.values()) for state in optimizer.state.values())


def median(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
