"""The plan: what the planner decided and what it predicts, as versioned JSON.

A plan is read by the CLI (`show`), by the runtime (`run`) and by people's own
scripts, so its JSON form (`pipeplan.plan/v1`, docs/plan-format.md) is written
and read here only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pipeplan._io import atomic_write_json, check_format, read_json
from pipeplan.choices import (
    DEFAULT_MIXED_PRECISION,
    DTYPES,
    MIXED_PRECISIONS,
    OPTIMIZER_KERNELS,
    OPTIMIZERS,
    RECOMPUTE_GRANULARITIES,
    SHARDINGS,
    TIMES,
    Dtype,
    MixedPrecision,
    Optimizer,
    OptimizerKernels,
    RecomputeGranularity,
    Sharding,
    Times,
)
from pipeplan.errors import UserError
from pipeplan.schedules import ScheduleName, facts, runs_block_checkpoints

if TYPE_CHECKING:
    from pipeplan.costmodels.graph import Graph

__all__ = ["PLAN_FORMAT", "Plan", "Stage", "StagePrediction", "Prediction", "load_plan"]

PLAN_FORMAT = "pipeplan.plan/v1"


@dataclass
class StagePrediction:
    fwd_s: float = 0.0  # one microbatch's forward on this stage (per replica)
    bwd_s: float = 0.0
    compute_s: float = 0.0  # fwd_s + bwd_s (+ recompute: every re-run of one microbatch) for one microbatch
    send_s: float = 0.0  # sending this stage's output (and receiving its gradient) for one microbatch
    send_bytes: int = 0  # bytes sent downstream per microbatch
    allreduce_s: float = 0.0  # data-parallel sync after the last backward (all-reduce; ZeRO: reduce-scatter/all-gather)
    optimizer_s: float = 0.0  # the optimizer step after it, once per iteration (PipeDream: per microbatch, in bwd),
    # with the division of the gradients by M before it (costmodels/grad_passes.grad_scale_s)
    memory_bytes: int = 0  # predicted peak per device
    weights_bytes: int = 0
    optimizer_bytes: int = 0  # gradients + optimizer state (this device's share when sharded)
    activation_bytes: int = 0  # peak in-flight activations incl. receive buffers and tensors in flight
    op_overhead_s: float = 0.0  # the runtime's time around each forward/backward op (simulated, not in fwd_s/bwd_s)
    grad_bytes: int = 0  # the gradients' part of optimizer_bytes
    gathered_bytes: int = 0  # ZeRO-2/3: full-size layer weights/gradients held while computing (in memory_bytes)
    fwd_comm_s: float = 0.0  # ZeRO-3: all-gather of every forward (overlapped: the op takes the longer)
    bwd_comm_s: float = 0.0  # ZeRO-2/3: collectives of every backward (likewise)
    wgrad_s: float = 0.0  # zero bubble: of bwd_s, the weight-gradient pass W (0 elsewhere)
    # what a backward into fresh gradients saves (the stage's first of an update; every one for PipeDream): bwd_s
    # and compute_s price accumulating backwards (costmodels/accumulate.py)
    fresh_grad_s: float = 0.0
    recompute_s: float = 0.0  # recomputation: one re-run of the forward, before a backward (0 without)
    wgrad_recompute_s: float = 0.0  # zero bubble + recomputation: the re-runs one W makes (once per parameter group)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StagePrediction:
        """A stage's saved `predicted`: the fields this version knows (newer keys are skipped, missing ones 0)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def reruns_s(self, splits_backward: bool) -> tuple[float, float]:
        """(the re-run before a backward, the re-runs of a zero-bubble W) of one microbatch.

        Plans from before the two fields held only their sum in compute_s, one re-run per backward pass
        (two where B and W run apart); that reading is kept for them.
        """
        if self.recompute_s or self.wgrad_recompute_s:
            return self.recompute_s, self.wgrad_recompute_s
        one = max(0.0, self.compute_s - self.fwd_s - self.bwd_s) / (2 if splits_backward else 1)
        return one, one if splits_backward else 0.0


@dataclass
class Stage:
    index: int
    layers: list[str]  # layer names of the graph, in execution order
    devices: list[int]  # global device ranks, one per replica (per chunk for interleaved: see docs)
    replicas: int = 1
    predicted: StagePrediction = field(default_factory=StagePrediction)
    device_type: str | None = None  # profile name of the stage's devices in a mixed cluster (None: plan.profile)


@dataclass
class Prediction:
    iteration_s: float = 0.0
    samples_per_s: float = 0.0
    bubble_fraction: float = 0.0
    peak_memory_bytes: int = 0  # largest per-device peak
    achieved_flops_fraction: float = 0.0  # model FLOP/s over the devices' peak
    memory_capacity_bytes: int = 0  # the profile's usable memory per device (the planner's cap)
    fits: bool = True  # every device's predicted peak is within memory_capacity_bytes


@dataclass
class Plan:
    graph: dict[str, Any]  # fingerprint, name, model_file, entry, layers (count)
    profile: str  # profile name (or path for a user profile)
    schedule: ScheduleName
    microbatches: int
    batch_size: int
    stages: list[Stage]
    predicted: Prediction
    devices: int = 0  # devices the plan uses
    chunks: int = 1  # model chunks per device (interleaved schedule)
    recompute: bool = False
    recompute_granularity: RecomputeGranularity = "stage"  # what one checkpoint covers (pipeplan.choices)
    optimizer: Optimizer = "adam"
    optimizer_kernels: OptimizerKernels = "auto"  # how its step runs (pipeplan.choices; `run` steps that way)
    dtype: Dtype = "fp32"
    solver: dict[str, Any] = field(default_factory=dict)  # name, status, objective, bound, gap, time_s
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # runners-up (summaries)
    notes: list[str] = field(default_factory=list)
    data_parallel: int = 1  # replicas of the whole pipeline (synchronous schedules); batch splits across them
    times: Times = "model"  # where layer times came from (costmodels.compute.layer_times_s)
    sharding: Sharding = "none"  # ZeRO level over each stage's replicas (costmodels/memory.py)
    mixed_precision: MixedPrecision = DEFAULT_MIXED_PRECISION  # bf16/fp16 memory recipe (costmodels/memory.py)
    collectives_overlap: bool = True  # ZeRO collectives beside compute (GPU frameworks) or in series (local runtime)
    overlap_slowdown: float = 0.0  # compute beside those collectives runs this much slower (predict_inputs.op_times)
    # an op waits for its input's transfer once its device reaches it (predict_inputs.receives_wait; False in plans
    # saved before the rule, which were predicted with transfers from the producer's end)
    receives_wait: bool = False
    tied_stages: list[list[int]] = field(default_factory=list)  # stages holding one tied parameter (simulate)

    def __post_init__(self) -> None:
        facts(self.schedule)  # an unknown schedule is a user error
        for value, allowed, what in ((self.dtype, DTYPES, "dtype"), (self.optimizer, OPTIMIZERS, "optimizer"),
                                     (self.optimizer_kernels, OPTIMIZER_KERNELS, "optimizer_kernels"),
                                     (self.times, TIMES, "times"), (self.sharding, SHARDINGS, "sharding"),
                                     (self.mixed_precision, MIXED_PRECISIONS, "mixed_precision"),
                                     (self.recompute_granularity, RECOMPUTE_GRANULARITIES, "recompute_granularity")):
            if value not in allowed:
                raise UserError(f"unknown {what} {value!r}", f"use one of {', '.join(allowed)}")
        if self.data_parallel < 1:
            raise UserError(f"data_parallel must be >= 1, got {self.data_parallel}")
        if self.recompute and self.recompute_granularity == "block" and not runs_block_checkpoints(self.schedule):
            raise UserError(f"recompute_granularity 'block' does not run under the {self.schedule} schedule",
                            "set it to 'stage' or re-plan")
        per_step = self.microbatches * self.data_parallel
        if self.microbatches < 1 or self.batch_size % per_step:
            raise UserError(
                f"batch size {self.batch_size} is not divisible into {self.microbatches} microbatches"
                + (f" on each of {self.data_parallel} data-parallel replicas" if self.data_parallel > 1 else ""),
                "pick a microbatch count that divides the batch",
            )

    @property
    def mixed(self) -> bool:
        """Whether the stages run on more than one device type (a mixed cluster)."""
        return len({s.device_type for s in self.stages}) > 1

    @property
    def device_profile(self) -> str:
        """The profile the plan's devices are of, where they are of one: the stages' device type when a --cluster
        plan uses one of its types (its `profile` is then the cluster's spec, which names no profile), else
        `profile`. A mixed plan has one per stage (`Stage.device_type`)."""
        types = {s.device_type for s in self.stages}
        return str(types.pop()) if len(types) == 1 and None not in types else self.profile

    @property
    def microbatch_size(self) -> int:
        """Samples in one microbatch on one pipeline replica: batch / (data_parallel * microbatches)."""
        return self.batch_size // (self.microbatches * self.data_parallel)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for stage in d["stages"]:  # optional: written only for mixed-cluster plans, so other plans read as before
            if stage["device_type"] is None:
                del stage["device_type"]
        if not d["tied_stages"]:  # likewise: only plans with tied parameters across stages
            del d["tied_stages"]
        return {"format": PLAN_FORMAT, "microbatch_size": self.microbatch_size, **d}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], path: str | os.PathLike[str] = "<plan>") -> Plan:
        check_format(doc, path, PLAN_FORMAT)
        from pipeplan.planner.plan_check import check_plan_doc

        check_plan_doc(doc, path)
        try:
            pred = {f.name for f in fields(Prediction)}
            stages = [
                Stage(
                    index=int(s["index"]),
                    layers=list(s["layers"]),
                    devices=list(s["devices"]),
                    replicas=int(s.get("replicas", 1)),
                    predicted=StagePrediction.from_dict(s.get("predicted", {})),
                    device_type=s.get("device_type"),
                )
                for s in doc["stages"]
            ]
            plan_keys = {f.name for f in fields(cls)} - {"stages", "predicted"}
            rest = {k: v for k, v in doc.items() if k in plan_keys}
            rest.setdefault("mixed_precision", "deepspeed")  # plan files from before the recipes were planned so
            return cls(
                stages=stages,
                predicted=Prediction(**{k: v for k, v in doc["predicted"].items() if k in pred}),
                **rest,
            )
        except UserError as e:  # a value the dataclass refuses (an unknown dtype, ...): say which file has it
            raise UserError(f"{path}: {e.message}", e.hint) from None
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: malformed plan file ({type(e).__name__}: {e})", "re-create it with `pipeplan analyze -o`") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_dict())


def planned_from(graph: Graph, plan_graph: dict[str, Any]) -> bool:
    """Whether `graph` is the model a plan (its `graph` summary) was made from: the same fingerprint, or the same
    structure with its ops numbered in another order (`Graph.op_fingerprint`: a model whose export numbers its ops
    anew in each process, as Gemma 3's does; plans written before it existed have the exact check alone)."""
    return (graph.fingerprint() == plan_graph.get("fingerprint")
            or graph.op_fingerprint() == plan_graph.get("op_fingerprint"))


def load_plan(path: str | os.PathLike[str]) -> Plan:
    return Plan.from_dict(read_json(path, "plan file (pipeplan.plan/v1)"), path)
