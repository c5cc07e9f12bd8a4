"""PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, §3.1):
1F1B without flushes, two weight versions per stage, one update per window of gradients.

runtime/pipedream.py's stage (messages, stashed forwards, tied weights, the shared setup and teardown)
with 2BW's rule instead of PipeDream's; tests/pipedream_2bw_reference.py applies the same in one process:

- Every stage of a pipeline is one rank; data parallelism replicates the whole pipeline (all stages have
  r replicas; replica j of stage s is ranks[s][j] and talks to replica j of its neighbours). Replica j
  trains on its rows of every step's batch (worker.replica_share), cut into the plan's M microbatches.
- Window w is step w: the replica's local microbatches w*M .. w*M + M - 1. Stage s runs them in 1F1B
  order with K - s admitted (pipedream.local_order), never flushing between windows.
- Versions: W(0) is the seeded model; W(w+1) is one optimizer step from W(w) after the window-w
  backwards. The forward of every microbatch of window w, on every stage, uses the shadow version
  W(max(0, w - 1)), and its backward differentiates that same copy: W(w+1) = W(w) - lr * grad f(W(w-1))
  (the paper's update, delay one window on every stage). A stage keeps the newest version (its module)
  and the shadow; `window_version` shows no older one is ever asked for (M >= K, schedules.py).
- Gradients of a window are summed over its M microbatches and, for a batch-mean loss, divided by M
  (torch's schedules' scale_grads, so a window's gradient is that of its batch as in synchronous 1F1B);
  tied parameters get the sum of their holders' (worker.sum_shared_grads); the replicas all-reduce once
  per window (worker.average_replica_grads: the mean for a batch-mean loss, else the sum); one step.

A step of `pipeplan run --steps N` is one window; it closes on a rank when the rank has applied that
window's update, and its reported loss is the mean (summed loss: the sum) of the window's microbatch
losses over all replicas, each computed with the shadow version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeplan.errors import UserError
from pipeplan.runtime.pipedream import AsyncStage, Groups, admitted, local_order, timed_op, update


def window_version(m: int, window: int) -> int:
    """The version local microbatch m's forward and backward use: the shadow W(w - 1) of its window w."""
    return max(0, m // window - 1)


def check_2bw_plan(ranks: dict[int, list[int]], opts) -> None:
    """What the 2BW loop cannot run: stages replicated unequally (2BW replicates whole pipelines)."""
    counts = {len(rs) for rs in ranks.values()}
    if len(counts) > 1:
        raise UserError(f"PipeDream-2BW replicates the whole pipeline, but the plan's stages have {sorted(counts)} "
                        "replicas", "re-plan with --schedule pipedream-2bw (every stage gets data_parallel replicas)")
    if getattr(opts, "vertical_sync", False):
        raise UserError("--vertical-sync applies to asynchronous PipeDream plans; PipeDream-2BW already runs every "
                        "stage of a microbatch on one weight version", "drop --vertical-sync")


@dataclass
class TwoBWStage(AsyncStage):
    """A stage replica of one whole-pipeline replica, with 2BW's versions (see the module docstring)."""

    window: int = 0  # M; 0 means the plan's, set by train_2bw

    def peer(self, stage: int, m: int) -> int:
        """Replica j's neighbours are replica j of the adjacent stages, whatever the microbatch."""
        return self.ranks[stage][self.j]

    def next_microbatch(self, m: int) -> int:
        """Every replica of a whole pipeline runs every local microbatch."""
        return m + 1

    def stash(self, m: int) -> dict[str, torch.Tensor]:
        """The shadow version of m's window. The newest version (the module, which the optimizer steps in
        place) is copied when a window first asks for it or, at the latest, just before it is stepped
        (`before_update`); versions older than the shadow are dropped."""
        v = window_version(m, self.window)
        if v not in self.versions:
            if v != self.updates:
                raise RuntimeError(f"stage {self.s}: version {v} was not kept (2BW keeps two)")
            self.keep_version()
        for old in [k for k in self.versions if k < v]:
            del self.versions[old]
        return self.versions[v]

    def before_update(self, mean: bool) -> None:
        """Keep W(w) (the next window's shadow) before the step makes W(w+1); a window's summed gradient
        divided by M for a batch-mean loss."""
        if self.updates not in self.versions:
            self.keep_version()
        if mean:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad /= self.window


def train_2bw(opts, st: TwoBWStage, rs, groups: Groups, mean: bool, after_step):
    """1F1B over steps x M local microbatches, one update (and step close) per window of M."""
    from pipeplan.runtime.worker import StepLog

    m_per_step = st.window = rs.plan.microbatches
    a = admitted([len(st.ranks[t]) for t in sorted(st.ranks)], st.s)  # K - s: the stages have equal replicas
    stats, clock, meter, log = rs.stats[st.s], rs.clock, rs.meter, StepLog()
    st.end = opts.steps * m_per_step
    dist.barrier()
    clock.start(opts.warmup == 0)
    for kind, m in local_order(opts.steps * m_per_step, a):
        measured = m // m_per_step >= opts.warmup
        meter.enabled = not measured or m < m_per_step
        with meter.op([st.module]):
            timed_op(st, kind, m, meter, stats, clock.origin if measured else None)
        if kind == "B" and (m + 1) % m_per_step == 0:
            st.before_update(mean)
            update(st, groups, mean)
            close_window(st, rs, log, m // m_per_step, opts, mean, after_step)
    meter.close_ops()
    st.box.drain()
    return log


def close_window(st: TwoBWStage, rs, log, k: int, opts, mean: bool, after_step) -> None:
    """Step k is done on this rank: its time since the previous close, the last stage's window loss
    (the mean or sum of its microbatches'; placement.combine_losses then takes the replicas' mean or sum)."""
    if k >= opts.warmup:
        log.step_s.append(time.perf_counter() - rs.clock.origin)
    if st.last:
        mine = [st.losses.pop(m) for m in sorted(st.losses) if m // st.window == k]
        log.losses.append(sum(mine) / len(mine) if mean else sum(mine))
    rs.clock.start(k + 1 >= opts.warmup)
    after_step(rs.rank, k + 1)
