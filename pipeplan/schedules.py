"""Pipeline schedules: each name defined once, with the facts that belong to it.

Every layer needs some fact about a schedule: the memory model how many
microbatches a stage holds and how many weight versions it keeps, the profile
loader which schedules have a calibrated runtime overhead, the planner which
ones flush and replicate the whole pipeline, the runtime which class of
`torch.distributed.pipelining` runs it. They all read it here, so a new schedule
(zero-bubble, PipeDream-2BW) is added in one place. This module sits below every
layer (it imports nothing of pipeplan but the error type and the V schedules' orders).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, get_args

from pipeplan.errors import UserError
from pipeplan.v_orders import Point, dualpipev_order, held_points, peak_pairs, zbv_order

__all__ = [
    "ScheduleName",
    "ScheduleRequest",
    "ScheduleFacts",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "AUTO_SCHEDULES",
    "SEARCH_SCHEDULE_CHOICES",
    "facts",
    "runs_block_checkpoints",
    "schedules_where",
    "inflight_microbatches",
    "interleaved_warmup_forwards",
    "replicated_inflight",
    "local_order",
    "microbatch_problem",
    "stashed_weight_versions",
    "stage_device",
    "device_stages",
]

ScheduleName = Literal["gpipe", "1f1b", "pipedream", "pipedream-2bw", "interleaved", "zb-h1", "zb-v", "dualpipev"]
ScheduleRequest = Literal["auto", "all", "gpipe", "1f1b", "pipedream", "pipedream-2bw", "interleaved", "zb-h1", "zb-v",
                          "dualpipev"]
"""What a user may ask the search for: one schedule, the synchronous ones ("auto") or every one ("all")."""


def _gpipe_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """All M: GPipe (Huang et al. 2019) §2.3 runs every forward before any backward
    (Megatron-LM, Narayanan et al. 2021, §2.2.1: "m microbatches for GPipe")."""
    return microbatches


def _one_f_one_b_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """min(K - s, M): stage s runs K - s - 1 warm-up forwards and one more before its first
    backward (Megatron-LM §2.2.1, "p or fewer microbatches"; schedules.py: num_warmup =
    min(p - rank - 1, M)). Stage 0 holds K, the last stage 1."""
    return min(stages - stage, microbatches)


def _pipedream_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """K - s whatever M is: async PipeDream (SOSP'19 §3.2) has the 1F1B steady state
    ("NOAM" = K minibatches admitted for K stages) but no flush, so M does not cap it. The runtime
    (runtime/pipedream.admitted) admits ceil((r_s + ... + r_{K-1}) / r_s) per replica of a stage with r_s
    replicas: K - s without replication, NOAM for the input stage."""
    return stages - stage


def _two_bw_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """K - s: PipeDream-2BW (Narayanan et al., ICML 2021, §3.1) runs 1F1B without flushes, so stage s
    holds 1F1B's K - s (warm-up of K - s - 1 forwards, one more before each backward); the window M >= K
    (`_two_bw_microbatches`) never caps it. runtime/pipedream_2bw.py admits exactly this many."""
    return stages - stage


def _interleaved_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """(chunk, microbatch) pairs held by device `stage` of p = `stages`, v = `chunks` chunks each.

    From torch's ScheduleInterleaved1F1B (`_get_warmup_ops`), which the runtime runs, and Megatron-LM's
    forward_backward_pipelining_with_interleaving: warm-up = 2(p - d - 1) + (v - 1)p forwards, then one
    more before the first backward, capped at M*v. Divided by v this is p + (p - 1)/v chunk-sets on
    device 0, i.e. p microbatches times Korthikanti et al. (2022) §4.2.3's factor (1 + (p - 1)/(p*v)).
    With v = 1 it is 1F1B (the warm-up formula assumes v >= 2). When M == p Megatron runs all M*v
    forwards first; torch does not, and neither does this count: a plan exported to Megatron with
    M == p holds M*v on every device (planner/frameworks/megatron.py says so in its export).
    """
    if chunks == 1:
        return min(stages - stage, microbatches)
    return min(interleaved_warmup_forwards(stages, stage, microbatches, chunks) + 1, microbatches * chunks)


def interleaved_warmup_forwards(devices: int, device: int, microbatches: int, chunks: int) -> int:
    """Chunk forwards device `device` runs before its first backward under interleaved 1F1B with v = `chunks` >= 2:
    2(K - d - 1) + (v - 1)K, capped at M*v (torch's ScheduleInterleaved1F1B `_get_warmup_ops`). One formula for the
    simulator's order (planner/simulate.py) and the in-flight count above, which both follow it."""
    return min(2 * (devices - device - 1) + (chunks - 1) * devices, microbatches * chunks)


def _zb_h1_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """min(K, M) on every stage: ZB-H1 (Qi et al., ICLR 2024, §3.1) keeps 1F1B's warm-up of K - s - 1
    forwards but defers stage s's weight-gradient passes W by s microbatches (torch's
    ScheduleInterleavedZeroBubble: `num_1f1b_microbatches = rank`), and a microbatch's activations stay
    until its W has run. Stage s then holds (K - s - 1) + (s + 1) = K in the steady state, the paper's
    "peak memory p*M_B, the same as 1F1B" (1F1B's stage 0), now on every stage. M caps it."""
    return min(stages, microbatches)


@lru_cache(maxsize=65536)  # the search asks again for every configuration it prices (a walk of the whole order)
def _zb_v_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """(chunk, microbatch) pairs rank `stage` holds at its peak under ZB-V, counted on torch's own order
    (pipeplan/v_orders.py): 2K once M >= K, each half a stage's layers, so K stages' worth, the paper's
    "same peak memory as 1F1B" (Qi et al. 2024 §6) on every rank."""
    return peak_pairs(zbv_order(stage, stages, microbatches))


@lru_cache(maxsize=65536)
def _dualpipev_inflight(stages: int, stage: int, microbatches: int, chunks: int) -> int:
    """(chunk, microbatch) pairs rank `stage` holds at its peak under DualPipeV, counted on torch's order
    (pipeplan/v_orders.py): 2K + 1, one more than ZB-V (its warm-up runs K + 1 forwards of chunk 0's
    microbatches before the first backward; DeepSeek-V3 §3.2.1 counts PP + 1 for DualPipe)."""
    return peak_pairs(dualpipev_order(stage, stages, microbatches))


def _zb_h1_points(stages: int, stage: int, microbatches: int, chunks: int) -> tuple[Point, ...]:
    """ZB-H1's peaks (`v_orders.held_points`): min(K, M) microbatches held (`_zb_h1_inflight`) while stage s's W
    runs s microbatches behind its B, so up to min(s, M - 1) B's wait on theirs while a B runs and min(s + 1, M)
    while a W does; none on the first stage, whose B torch skips. tests/test_deferred_grads.py holds it to torch's
    ScheduleInterleavedZeroBubble order."""
    held = min(stages, microbatches)
    if stage == 0:
        return ((held, 0, False), (held, 0, True))
    return ((held, min(stage + 1, microbatches), False), (held, min(stage, microbatches - 1), True))


def _v_points(order: Callable[[int, int, int], list[tuple[str, int, int]]]) -> Callable[
        [int, int, int, int], tuple[Point, ...]]:
    """A V schedule's peaks, read off torch's order (pipeplan/v_orders.py), once per order."""
    return lru_cache(maxsize=65536)(lambda stages, stage, microbatches, chunks: held_points(order(stage, stages,
                                                                                                  microbatches)))


@dataclass(frozen=True, kw_only=True)
class ScheduleFacts:
    """What is true of a schedule whatever the model: the single source for every layer."""

    name: ScheduleName
    flushes: bool
    """Synchronous: every iteration drains the pipeline, so all microbatches see the same weights."""
    replicates_whole_pipeline: bool
    """Data parallelism copies the whole pipeline (else stages are replicated one by one, PipeDream §3.1)."""
    stashes_weights: bool
    """Keeps one weight version per in-flight microbatch (PipeDream §3.3 weight stashing)."""
    interleaves: bool
    """A device holds several model chunks (Megatron-LM §2.2.2): the search tries chunks > 1."""
    torch_class: str | None
    """The `torch.distributed.pipelining` class that runs it, or None for a schedule without a flush, which
    runtime/pipedream.py's own loop runs (torch has no asynchronous schedule)."""
    inflight: Callable[[int, int, int, int], int]
    """(stages, stage, microbatches, chunks) -> microbatches whose activations the stage holds at its peak."""
    microbatch_rule: Callable[[int, int], str | None] = lambda stages, microbatches: None
    """(devices in the pipeline, microbatches) -> why the runtime refuses that count, or None when it runs."""
    splits_backward: bool = False
    """Runs each backward as an input-gradient pass B and a later weight-gradient pass W (zero bubble, Qi et
    al. 2024): the simulator plays W ops, and activations are held until W ends, not B."""
    pending_weight_passes: Callable[[int, int, int, int], tuple[Point, ...]] | None = None
    """Where backwards split: (stages, stage, microbatches, chunks) -> the (microbatches held, input-gradient passes
    whose W has not run, busy) a rank can peak at (`v_orders.held_points`); each such B keeps its weight ops'
    output gradients (memory.py)."""
    weight_versions: Callable[[int], int] = lambda inflight: 1
    """(microbatches the stage holds) -> weight versions it keeps (see `stashed_weight_versions`)."""
    placement: Literal["loop", "v"] = "loop"
    """Which device runs virtual stage s of K devices: "loop", s mod K (torch's and Megatron's interleaving), or
    "v", s for s < K and 2K - 1 - s after (torch's `generate_stage_to_rank_mapping(style="v")`)."""
    fixed_chunks: int | None = None
    """The only chunk count the schedule runs (the V schedules: exactly two stages per rank), else None."""
    receives_per_microbatch: bool = False
    """pipeplan's runtime makes each receive buffer when its microbatch's receive is posted and drops it after that
    microbatch's backward (pipeplan/lean_gpipe.py `receive_lazily`), where torch's stage makes M each way at set-up
    and keeps them (costmodels/memory.py `receive_buffers`)."""
    frees_sent_outputs: bool = False
    """pipeplan's runtime runs its own loop (pipeplan/lean_gpipe.py `LeanGPipe`): each sent output's data freed once
    sent, and one send in flight per direction, so no sent gradient outlives the next send (memory.py
    `kept_outputs`, `receive_buffers`); torch's loops keep outputs in `fwd_cache` until their backward."""
    updates_each_microbatch: bool = False
    """Steps the optimizer after every microbatch's backward (async PipeDream), so the simulator folds the
    update into the stage times; every other schedule updates once per iteration (its plan's M microbatches),
    after the data-parallel all-reduce, and the simulator plays both."""

    def b_reruns(self, stage: int) -> int:
        """Recomputation's re-runs of the forward before stage `stage`'s backward op (its B where backwards split):
        none before the first stage's split B, whose input-gradient pass torch skips (its input needs no gradient:
        stage.py `backward_one_chunk`; that stage's W, its whole backward, re-runs it), one otherwise."""
        return 0 if self.splits_backward and stage == 0 else 1

    def fresh_backwards(self, microbatches: int) -> int:
        """A stage's backwards per step of `microbatches` that write fresh weight gradients instead of adding into
        them (costmodels/accumulate.py): the first, as the runtime clears gradients every step, or every one where
        the stage updates after each microbatch (asynchronous PipeDream clears them after each update)."""
        return microbatches if self.updates_each_microbatch else 1


def _one_f_one_b_microbatches(stages: int, microbatches: int) -> str | None:
    """torch's Schedule1F1B refuses fewer microbatches than stages (schedules.py: "Number of microbatches
    ... must be greater than or equal to the number of stages")."""
    return None if microbatches >= stages else f"needs at least as many microbatches as stages ({stages})"


def _two_bw_microbatches(stages: int, microbatches: int) -> str | None:
    """PipeDream-2BW's window: a new weight version every m microbatches with m >= d, the pipeline depth
    (Narayanan et al., ICML 2021, §3.1), so that a window's microbatches all see the version made two
    windows back; a plan's M is the window (one update per M microbatches)."""
    return None if microbatches >= stages else (
        f"needs a window of at least as many microbatches as stages ({stages})")


def _stashed_per_inflight(inflight: int) -> int:
    """PipeDream (SOSP'19 §3.3) weight stashing as pipeplan's runtime does it: one stashed copy per in-flight
    microbatch's version, beside the module's own weights. The forward reads a copy even of the newest version
    (runtime/pipedream.py `stash`): autograd saves the tensors the forward read, and the update after each
    backward changes the module's weights in place, so a microbatch still in flight then needs its own. Measured
    on the CPU runtime: GPT's 2-stage plan holds 3 and 2 copies of its stages' weights (benchmarks/RESULTS.md,
    "Peak memory")."""
    return max(1, inflight) + 1


def _two_versions(inflight: int) -> int:
    """PipeDream-2BW (ICML 2021 §3.1, "double-buffered weight updates"): the shadow version a window's
    microbatches use and the newest one, whatever the stage holds."""
    return 2


def _interleaved_microbatches(stages: int, microbatches: int) -> str | None:
    """Megatron-LM interleaves only when microbatches are a multiple of the pipeline devices
    (its `get_forward_backward_func` asserts it); torch's ScheduleInterleaved1F1B accepts a superset
    (microbatches a multiple of max(1, M // devices)), so this rule runs there too."""
    return None if microbatches % stages == 0 else f"needs a microbatch count that is a multiple of the stages ({stages})"


def _zero_bubble_microbatches(stages: int, microbatches: int) -> str | None:
    """torch's ScheduleInterleavedZeroBubble refuses a count that is not a multiple of its rounds,
    max(1, M // devices) (schedules.py: "Zero bubble requires the number of microbatches to be a multiple
    of the number of rounds")."""
    rounds = max(1, microbatches // stages)
    return None if microbatches % rounds == 0 else (
        f"needs a microbatch count that is a multiple of max(1, microbatches // {stages}) = {rounds}")


def _dualpipev_microbatches(stages: int, microbatches: int) -> str | None:
    """torch's ScheduleDualPipeV refuses fewer microbatches than (virtual) stages, 2K on K ranks
    (schedules.py: "DualPipeV requires at least as many microbatches as stages")."""
    return None if microbatches >= 2 * stages else (
        f"needs at least as many microbatches as its {2 * stages} stages (two per device)")


SCHEDULES: Final[dict[ScheduleName, ScheduleFacts]] = {
    "gpipe": ScheduleFacts(name="gpipe", flushes=True, replicates_whole_pipeline=True, stashes_weights=False,
                           interleaves=False, torch_class="ScheduleGPipe", inflight=_gpipe_inflight,
                           receives_per_microbatch=True, frees_sent_outputs=True),
    "1f1b": ScheduleFacts(name="1f1b", flushes=True, replicates_whole_pipeline=True, stashes_weights=False,
                          interleaves=False, torch_class="Schedule1F1B", inflight=_one_f_one_b_inflight,
                          microbatch_rule=_one_f_one_b_microbatches, receives_per_microbatch=True),
    "pipedream": ScheduleFacts(name="pipedream", flushes=False, replicates_whole_pipeline=False,
                               stashes_weights=True, interleaves=False, torch_class=None,
                               inflight=_pipedream_inflight, weight_versions=_stashed_per_inflight,
                               updates_each_microbatch=True),
    "pipedream-2bw": ScheduleFacts(name="pipedream-2bw", flushes=False, replicates_whole_pipeline=True,
                                   stashes_weights=False, interleaves=False, torch_class=None,
                                   inflight=_two_bw_inflight, microbatch_rule=_two_bw_microbatches,
                                   weight_versions=_two_versions),
    "interleaved": ScheduleFacts(name="interleaved", flushes=True, replicates_whole_pipeline=True,
                                 stashes_weights=False, interleaves=True, torch_class="ScheduleInterleaved1F1B",
                                 inflight=_interleaved_inflight, microbatch_rule=_interleaved_microbatches),
    "zb-h1": ScheduleFacts(name="zb-h1", flushes=True, replicates_whole_pipeline=True, stashes_weights=False,
                           interleaves=False, torch_class="ScheduleInterleavedZeroBubble", inflight=_zb_h1_inflight,
                           microbatch_rule=_zero_bubble_microbatches, splits_backward=True,
                           pending_weight_passes=_zb_h1_points),
    "zb-v": ScheduleFacts(name="zb-v", flushes=True, replicates_whole_pipeline=True, stashes_weights=False,
                          interleaves=True, torch_class="ScheduleZBVZeroBubble", inflight=_zb_v_inflight,
                          splits_backward=True, placement="v", fixed_chunks=2,
                          pending_weight_passes=_v_points(zbv_order)),
    "dualpipev": ScheduleFacts(name="dualpipev", flushes=True, replicates_whole_pipeline=True, stashes_weights=False,
                               interleaves=True, torch_class="ScheduleDualPipeV", inflight=_dualpipev_inflight,
                               microbatch_rule=_dualpipev_microbatches, splits_backward=True, placement="v",
                               fixed_chunks=2, pending_weight_passes=_v_points(dualpipev_order)),
}
SCHEDULE_NAMES: Final[tuple[ScheduleName, ...]] = get_args(ScheduleName)
# "auto" plans the synchronous schedules only: async PipeDream and PipeDream-2BW change the training semantics
# (stale weights).
# ZB-H1 is synchronous and runs, but stays out of "auto" for now: its predicted gain rests on the split of each
# backward into B and W, which the search takes from a rule (planner/simulate.py) unless the trace measured it;
# ask for it with --schedule zb-h1 or "all". The V schedules (zb-v, dualpipev) likewise.
AUTO_SCHEDULES: Final[tuple[ScheduleName, ...]] = ("1f1b", "gpipe", "interleaved")
SEARCH_SCHEDULE_CHOICES: Final[tuple[ScheduleRequest, ...]] = get_args(ScheduleRequest)
assert set(SCHEDULES) == set(SCHEDULE_NAMES)


def facts(schedule: str) -> ScheduleFacts:
    """The facts of a schedule named by a user, a plan file or a caller; one message for an unknown name."""
    try:
        return SCHEDULES[schedule]  # type: ignore[index]
    except KeyError:
        raise UserError(f"unknown schedule {schedule!r}", f"use one of: {', '.join(SCHEDULE_NAMES)}") from None


def runs_block_checkpoints(schedule: str) -> bool:
    """Whether `pipeplan run` checkpoints each block of a recomputed stage under `schedule` (runtime/recompute.py,
    `recompute_blocks`): schedules that flush and run each backward as one pass. A split backward (zero bubble, the
    V schedules) would re-run every block once per parameter-group pass of its W, and asynchronous PipeDream's
    loops re-run a stage through its stashed weight version as one function; both checkpoint whole stages."""
    rule = facts(schedule)
    return rule.flushes and not rule.splits_backward


def schedules_where(holds: Callable[[str], bool]) -> str:
    """"gpipe, 1f1b or interleaved": the schedules `holds` is true of, for a refusal's hint, read off the facts so
    that a schedule added later is offered wherever it qualifies (a hand-written list missed three)."""
    names = [name for name in SCHEDULE_NAMES if holds(name)]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def microbatch_problem(schedule: str, stages: int, microbatches: int) -> str | None:
    """Why `schedule` cannot run `microbatches` on `stages` pipeline devices, or None: the one rule the
    search, plan files and the runtime share, so the planner never emits a plan the runtime refuses."""
    return facts(schedule).microbatch_rule(stages, microbatches)


def inflight_microbatches(schedule: str, stages: int, stage: int, microbatches: int, chunks: int = 1,
                          replicas: Sequence[int] | None = None) -> int:
    """How many microbatches' activations stage `stage` holds at its peak (see each schedule's rule).

    For the interleaved schedule `stages` counts devices, `stage` is a device and
    the count is of (chunk, microbatch) pairs, each holding one chunk's activations.
    `replicas` (each stage's count, where a schedule replicates stages one by one) gives async
    PipeDream's count per replica, `replicated_inflight`, instead of K - s.
    """
    rule = facts(schedule)
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError("stages, microbatches and chunks must be >= 1")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    if replicas is not None and not rule.replicates_whole_pipeline:
        if len(replicas) != stages or min(replicas) < 1:
            raise ValueError(f"replicas {list(replicas)} for {stages} stages")
        return replicated_inflight(replicas, stage)
    return rule.inflight(stages, stage, microbatches, chunks)


def weight_pass_points(schedule: str, stages: int, stage: int, microbatches: int, chunks: int,
                       inflight: int) -> tuple[Point, ...]:
    """The (microbatches held, weight passes pending, busy) points pipeline device `stage` can peak at
    (`v_orders.held_points`): `inflight`, none, busy where backwards do not split."""
    rule = facts(schedule).pending_weight_passes
    return ((inflight, 0, True),) if rule is None else rule(stages, stage, microbatches, chunks)


def replicated_inflight(replicas: Sequence[int], stage: int) -> int:
    """ceil((r_s + ... + r_{K-1}) / r_s): microbatches a replica of stage s admits before its first backward,
    and holds from then on, when stage t has r_t replicas taking every r_t-th microbatch (PipeDream, SOSP'19
    §3.2: NOAM = ceil(workers / workers of the input stage) for the input stage; runtime/pipedream.admitted
    runs this count). K - s without replication; more than K - s where later stages are more replicated,
    since that many microbatches are in flight below stage s, which each replica of s sees 1/r_s of."""
    return -(-sum(replicas[stage:]) // replicas[stage])


def local_order(n: int, a: int) -> list[tuple[str, int]]:
    """Asynchronous 1F1B (PipeDream, SOSP'19 §3.2) on one replica's n local microbatches with a admitted at
    startup: ("F"|"B", local index). runtime/pipedream.py runs it; `profiles calibrate` times it
    (hardware_profiles/pipeline_ops.py)."""
    ops = [("F", i) for i in range(min(a, n))]
    for i in range(n):
        ops.append(("B", i))
        if i + a < n:
            ops.append(("F", i + a))
    return ops


def stashed_weight_versions(schedule: str, inflight: int) -> int:
    """Weight versions a stage keeps: one per in-flight microbatch where the schedule stashes weights.

    Source: PipeDream (Narayanan et al., SOSP'19) §3.3 "weight stashing": each
    in-flight minibatch's backward must use the weights its forward used, so a
    stage keeps one version per in-flight microbatch (stage 0 of a K-stage
    pipeline: K, the last stage: 1), and pipeplan's runtime the module's own
    weights beside them (`_stashed_per_inflight`: K + 1 and 2). Flushing schedules
    (gpipe, 1f1b, interleaved) keep one.
    PipeDream-2BW (ICML 2021 §3.1) keeps two on every stage. Each schedule's
    `weight_versions` rule says which.
    """
    return facts(schedule).weight_versions(inflight)


def stage_device(schedule: str, stage: int, devices: int) -> int:
    """The pipeline device (0..devices-1) that runs virtual stage `stage` under the schedule's placement."""
    if facts(schedule).placement == "v" and stage >= devices:
        return 2 * devices - 1 - stage
    return stage % devices


def device_stages(schedule: str, device: int, devices: int, chunks: int) -> list[int]:
    """The virtual stages device `device` runs, in model order (the inverse of `stage_device`)."""
    return [s for s in range(devices * chunks) if stage_device(schedule, s, devices) == device]
