"""Partitions worth simulating for one configuration, and the ILP refinement of the best one.

The DP is exact for its bottleneck objective, but the simulator also charges
pipeline fill and drain and plays each transfer where the runtime pays it (the
receiver waits for it on GPU profiles; on a calibrated local profile it starts
at the producer's end), so the DP's optimum under either communication model
(blocking sends, overlapped sends) is not always the simulator's best. Both DP
optima are candidates, and (unless the request turns heuristics off) so are the
equal-layers and torchgpipe time-balanced splits, so a plan is never predicted
slower than the naive split it is compared with. The simulator picks; the
prediction re-checks memory exactly, and where it finds the DP's partitions over,
the search asks the DP again under a capacity lowered by the excess.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from pipeplan.costmodels.memory import RangeMemory
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.baselines import equal_layers, torchgpipe_balance_by_time
from pipeplan.planner.configs import Config
from pipeplan.planner.dp import (
    COMM_MODES,
    Partition,
    assignment_bounds,
    boundary_links,
    partition_dp_modes,
    stage_costs,
)
from pipeplan.planner.ilp import partition_ilp
from pipeplan.planner.predict import place
from pipeplan.planner.problem import Problem
from pipeplan.schedules import facts, stage_device

__all__ = ["LinkFn", "link_fn", "Partitioner", "ilp_partition"]

LinkFn = Callable[[int], Link]
"""Boundary index b (stage b to b + 1) -> the link its sends cross."""


def worst_link(profile: HardwareProfile, pairs: Iterable[tuple[int, int]]) -> Link:
    """The slowest of the links between rank pairs (synchronous replicas wait for the slowest)."""
    links = {profile.link_between(a, b) for a, b in pairs}
    return min(links, key=lambda lk: (lk.bandwidth_bytes_per_s, -lk.latency_s))


def link_fn(profile: HardwareProfile, cfg: Config) -> LinkFn:
    """The links the configuration's stage boundaries cross, under its placement."""
    P, d = cfg.stages, cfg.data_parallel
    if not facts(cfg.schedule).replicates_whole_pipeline:
        return boundary_links(profile, d)
    per_device = place(P, d, cfg.layout)

    def fn(b: int) -> Link:
        a, c = stage_device(cfg.schedule, b, P), stage_device(cfg.schedule, b + 1, P)
        return worst_link(profile, zip(per_device[a], per_device[c], strict=True))

    return fn


class Partitioner:
    """DP partitions cached across configurations with the same microbatch size, memory signature and links."""

    def __init__(self, capacity_bytes: int, *, heuristics: bool) -> None:
        self.cap = capacity_bytes
        self.heuristics = heuristics
        self._cache: dict[Hashable, Partition] = {}

    def candidates(self, cfg: Config, prob: Problem, mem: RangeMemory, links: LinkFn,
                   key: tuple[Hashable, ...]) -> list[Partition]:
        """Both DP optima, then (heuristics on) the equal-layers and balance-by-time splits.

        `key` identifies everything the DP's answer depends on besides the links and
        the communication mode (microbatch size, recomputation, memory signature)."""
        S = cfg.virtual_stages
        out = self.dp_optima(cfg, prob, mem, links, key, self.cap)
        if self.heuristics and 1 < S <= prob.n and not cfg.stage_replicas:
            out.extend(_heuristic_partitions(prob, S, links))
        return out

    def dp_optima(self, cfg: Config, prob: Problem, mem: RangeMemory, links: LinkFn, key: tuple[Hashable, ...],
                  capacity: int) -> list[Partition]:
        """The DP's optimum under each communication model with memory capped at `capacity` (the search lowers it
        below the device's when the exact prediction finds the DP's partition over: search.py
        `_Search.partition_and_predict`)."""
        S = cfg.virtual_stages
        boundaries = tuple(links(b) for b in range(S - 1))
        keys = {comm: (*key, boundaries, comm, capacity) for comm in COMM_MODES}
        missing = tuple(comm for comm in COMM_MODES if keys[comm] not in self._cache)
        if missing:  # one memory walk for the models not cached yet; overflows sized only when nothing fits
            got = partition_dp_modes(prob, S, link=links, memory_bytes=mem, capacity_bytes=capacity, comms=missing,
                                     size_overflow=False)
            self._cache.update((keys[comm], part) for comm, part in zip(missing, got, strict=True))
        return [self._cache[keys[comm]] for comm in COMM_MODES]


def _heuristic_partitions(prob: Problem, S: int, links: LinkFn) -> list[Partition]:
    heuristic = [("equal-layers", equal_layers(prob.n, S))]
    try:
        heuristic.append(("balance-by-time", torchgpipe_balance_by_time(list(prob.compute_s), S)))
    except ValueError:  # torchgpipe's heuristic can cycle or empty a stage; then it is no candidate
        pass
    out = []
    for name, assignment in heuristic:
        stage_s = stage_costs(prob, assignment_bounds(assignment), links)
        out.append(Partition(assignment=assignment, bottleneck_s=max(stage_s), stage_s=stage_s,
                             replicas=[1] * S, solver={"name": name, "status": "feasible"}))
    return out


def ilp_partition(prob: Problem, cfg: Config, mem: RangeMemory, links: LinkFn, *, capacity_bytes: int,
                  time_limit_s: float, warm_start: Partition) -> Partition | None:
    """The ILP's partition of the configuration (DAG splits), warm-started from the DP; None if it has none.

    Per-layer bytes are additive for the ILP (receive buffers left out): the
    prediction of the result re-checks the whole. Errors the ILP solver raises
    (a missing CBC binary, a solver crash) propagate: they are bugs to see, not
    results to hide.
    """
    S = cfg.virtual_stages
    ch = mem.ch
    per_layer = [[mem.device_total(mem.device_of[s], prob.param_bytes[i] * ch, prob.saved_bytes[i] * ch, 0, 0,
                                   frozen=prob.frozen[i] * ch)
                  for i in range(prob.n)] for s in range(S)]
    got = partition_ilp(prob, S, link=links, capacity_bytes=capacity_bytes, memory_bytes_per_layer=per_layer,
                        time_limit_s=time_limit_s, warm_start=warm_start)
    if got.solver.get("status") not in ("optimal", "feasible") or not got.assignment:
        return None
    return got


def ilp_info(part: Partition) -> dict[str, Any]:
    """What a plan records of an ILP solve."""
    return {k: part.solver.get(k) for k in ("status", "objective", "bound", "gap", "time_s")}
