"""What the user asks the planner: one typed object, built once and passed whole.

The CLI builds a `PlanRequest` from its flags (cli/options.py), library users
build one by hand; `search` and the prediction take it as it is. A capability
that adds an option (sharding, tensor parallelism, mixed clusters) adds a field
here, with its check, and every consumer sees it without new parameters.
Modelled on torchtitan's `ParallelismConfig`: a keyword-only dataclass whose
fields say what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipeplan.choices import (
    DEFAULT_MIXED_PRECISION,
    DTYPE_CHOICES,
    MIXED_PRECISION_DTYPES,
    MIXED_PRECISIONS,
    OPTIMIZER_KERNELS,
    OPTIMIZERS,
    RECOMPUTE_CHOICES,
    RECOMPUTE_GRANULARITY_CHOICES,
    SHARDING_CHOICES,
    SOLVERS,
    TIMES,
    Dtype,
    DtypeRequest,
    MixedPrecision,
    Optimizer,
    OptimizerKernels,
    Recompute,
    RecomputeGranularity,
    RecomputeGranularityRequest,
    ShardingRequest,
    Solver,
    Times,
)
from pipeplan.errors import UserError
from pipeplan.schedules import (
    AUTO_SCHEDULES,
    SCHEDULE_NAMES,
    SEARCH_SCHEDULE_CHOICES,
    ScheduleName,
    ScheduleRequest,
    facts,
    microbatch_problem,
    runs_block_checkpoints,
    schedules_where,
)

if TYPE_CHECKING:
    from pipeplan.hardware_profiles.profile import HardwareProfile

__all__ = ["PlanRequest", "TOP"]

TOP = 5


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A planning request. Fields left None are searched; the others restrict the search."""

    devices: int
    """Accelerators available (the plan may use fewer)."""
    batch_size: int
    """Global batch: samples per training iteration, over all data-parallel replicas."""
    schedule: ScheduleRequest = "auto"
    """One schedule, "auto" (the synchronous ones) or "all" (async PipeDream too)."""
    stages: int | None = None
    """Pipeline devices K (an interleaved plan has K x chunks virtual stages)."""
    data_parallel: int | None = None
    """Replicas of the whole pipeline (synchronous schedules) or per stage (PipeDream)."""
    microbatches: int | None = None
    """Microbatches per iteration and replica; must divide the per-replica batch."""
    chunks: int | None = None
    """Model chunks per device for the interleaved schedule (default: 2, 4 and 8 are tried)."""
    recompute: Recompute = "auto"
    """Activation recomputation: tried both ways ("auto"), always ("on") or never ("off")."""
    recompute_granularity: RecomputeGranularityRequest = "stage"
    """What one checkpoint covers: a whole stage, or each block as the frameworks recompute (pipeplan.choices); "auto"
    tries both."""
    dtype: DtypeRequest = "fp32"
    """Training precision; "auto" is resolved per profile by `for_profile`."""
    optimizer: Optimizer = "adam"
    """Sets the optimizer-state bytes per parameter."""
    optimizer_kernels: OptimizerKernels = "auto"
    """How the framework steps the optimizer, which sets the bytes its step moves (pipeplan.choices)."""
    mixed_precision: MixedPrecision = DEFAULT_MIXED_PRECISION
    """How bf16/fp16 training keeps its state and activations (pipeplan.choices.MixedPrecision): torch.autocast as
    `pipeplan run` trains (the default, 18 B/parameter with Adam), DeepSpeed's (16) or Megatron-LM's (18, fp16 20)."""
    sharding: ShardingRequest = "auto"
    """ZeRO level over each stage's replicas: "auto" (ZeRO-1 wherever there are replicas, more only to fit) or fixed."""
    times: Times = "model"
    """Layer times from the cost model ("model") or as measured while tracing ("measured")."""
    solver: Solver = "auto"
    """"dp" partitions with the DP only; "ilp" re-partitions the best with the ILP; "auto" does so for DAGs."""
    top: int = TOP
    """Plans kept: the best and its runners-up."""
    ilp_time_limit_s: float = 10.0
    """Time the ILP refinement may take."""
    heuristics: bool = True
    """Also simulate the equal-layers and torchgpipe splits of each configuration (never predicted worse)."""

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_counts()
        self._check_combinations()

    def _check_choices(self) -> None:
        for value, allowed, what in ((self.schedule, SEARCH_SCHEDULE_CHOICES, "schedule"),
                                     (self.solver, SOLVERS, "solver"), (self.optimizer, OPTIMIZERS, "optimizer"),
                                     (self.optimizer_kernels, OPTIMIZER_KERNELS, "optimizer kernels"),
                                     (self.dtype, DTYPE_CHOICES, "dtype"), (self.times, TIMES, "times"),
                                     (self.sharding, SHARDING_CHOICES, "sharding"),
                                     (self.mixed_precision, MIXED_PRECISIONS, "mixed-precision recipe")):
            if value not in allowed:
                raise UserError(f"unknown {what} {value!r}", f"use one of {', '.join(allowed)}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise UserError(f"unknown recompute setting {self.recompute!r}", "use auto, on or off")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITY_CHOICES:
            raise UserError(f"unknown recompute granularity {self.recompute_granularity!r}", "use stage, block or auto")

    def _check_counts(self) -> None:
        for what, value in (("--devices", self.devices), ("--batch-size", self.batch_size), ("--stages", self.stages),
                            ("--microbatches", self.microbatches), ("--data-parallel", self.data_parallel),
                            ("--chunks", self.chunks), ("top", self.top)):
            if value is not None and value < 1:
                raise UserError(f"{what} must be at least 1, got {value}")

    def _check_combinations(self) -> None:
        """Flag combinations no search could satisfy, named by their flags (the CLI shows these as they are)."""
        N, B, K, M = self.devices, self.batch_size, self.stages, self.microbatches
        if K is not None and K > N:
            raise UserError(f"--stages {K} needs at least {K} devices but --gpus is {N}", "lower --stages or raise --gpus")
        if M is not None and M > B:
            raise UserError(f"--microbatches {M} is more than the batch size {B}",
                            "lower --microbatches or raise --batch-size")
        if M is not None and B % M:
            raise UserError(f"--microbatches {M} does not divide --batch-size {B}",
                            "pick a microbatch count that divides the batch size")
        if self.schedule == "interleaved" and K == 1:
            raise UserError("--schedule interleaved needs at least 2 stages", "drop --stages 1 or pick another schedule")
        problem = microbatch_problem(self.schedule, K, M) if K and M and self.schedule in SCHEDULE_NAMES else None
        if problem:
            raise UserError(f"--schedule {self.schedule} {problem}, got --microbatches {M}",
                            "raise --microbatches or pick --schedule gpipe")
        d = self.data_parallel
        if d is not None and d * (K or 1) > N:
            raise UserError(f"--data-parallel {d} does not fit on {N} devices")
        if self.recompute_granularity == "block" and self.recomputes_whole_stages:
            raise UserError(f"--recompute-granularity block does not run under --schedule {self.schedule}: it "
                            "checkpoints whole stages", "use --recompute-granularity stage or pick "
                            + schedules_where(runs_block_checkpoints))
        asynchronous = self.schedule in SCHEDULE_NAMES and not facts(self.schedule).flushes
        if asynchronous and self.sharding not in ("auto", "none"):
            raise UserError(f"--sharding {self.sharding} needs a schedule that flushes; {self.schedule} never does",
                            "drop --sharding or pick " + schedules_where(lambda name: facts(name).flushes))

    def check_graph(self, n_layers: int, *, grouped: bool = False) -> None:
        """The checks that need the graph: a stage needs a layer. A finer trace can only help when the graph
        was grouped (traced at a --depth); a leaf-module or imported graph has no finer form."""
        if self.stages is not None and self.stages > n_layers:
            raise UserError(f"--stages {self.stages} exceeds the graph's {n_layers} layers",
                            "trace with a larger --depth or use fewer stages" if grouped else
                            f"use --stages {n_layers} or fewer: each stage needs at least one layer")

    @property
    def schedules(self) -> tuple[ScheduleName, ...]:
        """The schedules the search tries."""
        if self.schedule == "auto":
            return AUTO_SCHEDULES
        if self.schedule == "all":
            return SCHEDULE_NAMES
        return (self.schedule,)

    @property
    def recompute_options(self) -> tuple[bool, ...]:
        """Recomputation settings the search tries (without first: cheaper plans found early)."""
        return {"auto": (False, True), "on": (True,), "off": (False,)}[self.recompute]

    @property
    def recomputes_whole_stages(self) -> bool:
        """Whether recomputation is fixed on under a schedule whose runtime checkpoints whole stages (split
        backwards, PipeDream: pipeplan.schedules.runs_block_checkpoints), where no plan could recompute per block."""
        return (self.recompute == "on" and self.schedule in SCHEDULE_NAMES
                and not runs_block_checkpoints(self.schedule))

    @property
    def recompute_granularities(self) -> tuple[RecomputeGranularity, ...]:
        """Granularities the search tries for a configuration it recomputes (per stage first)."""
        return ("stage", "block") if self.recompute_granularity == "auto" else (self.recompute_granularity,)

    @property
    def training_dtype(self) -> Dtype:
        """The concrete dtype; "auto" must have been resolved with `for_profile` first."""
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved per profile: call PlanRequest.for_profile(profile)")
        return self.dtype

    def for_profile(self, profile: HardwareProfile) -> PlanRequest:
        """This request with dtype "auto" resolved for `profile` (unchanged when a dtype was given)."""
        if self.dtype != "auto":
            return self
        return replace(self, dtype=default_dtype(profile))


def default_dtype(profile: HardwareProfile) -> Dtype:
    """fp32 on a calibrated local profile; elsewhere bf16 mixed precision, or fp16 where the device has no bf16, or
    fp32 where it has no 16-bit rate above its fp32 one.

    Accelerators are trained in mixed precision in practice (bf16 where the
    tensor cores have it; fp16 with loss scaling on V100/T4, which would run
    bf16 at their fp32 rate), and a CPU calibration measures fp32, so each
    default matches how the target would really run. Pascal cards (P40, GTX
    1080 Ti, Titan X Pascal) have neither: no bf16, fp16 arithmetic at 1/64 of
    fp32 on GP102 (their catalogue profiles list no 16-bit peak; torch only
    emulates bf16 before compute capability 8.0:
    `torch.cuda.is_bf16_supported(including_emulation=False)`), so they train in
    fp32, as torchgpipe's and cnn-benchmarks' published runs on them did. A bf16
    default priced a P40 as if it had tensor cores (16-bit activations, no
    Winograd): torchgpipe's one-GPU U-Net and ResNet-101 at 0.71x and 1.08x of
    their published fp32 throughput, where fp32 reads 0.99 and 0.97.
    """
    if profile.local:
        return "fp32"
    peaks = profile.peak_flops or {}
    fp32 = peaks.get("fp32") or 0.0
    for dtype in MIXED_PRECISION_DTYPES:  # bf16 first: no loss scaling
        if (peaks.get(dtype) or 0.0) > fp32:
            return dtype
    return "fp32" if fp32 else "bf16"
