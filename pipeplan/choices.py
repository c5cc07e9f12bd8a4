"""The closed sets of names a user picks from (besides schedules: `pipeplan.schedules`), each defined once.

The CLI's `--dtype`/`--optimizer`/... choices, the planner's request, the
memory model and the profile loader all check against these, so a name added
here is accepted everywhere at once. Plain `Literal` strings rather than enums:
they are what plan.json and profile YAML store, unchanged.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "Dtype", "DTYPES", "DtypeRequest", "DTYPE_CHOICES",
    "Optimizer", "OPTIMIZERS", "OptimizerKernels", "OPTIMIZER_KERNELS",
    "Recompute", "RECOMPUTE_CHOICES", "RecomputeGranularity", "RECOMPUTE_GRANULARITIES",
    "RecomputeGranularityRequest", "RECOMPUTE_GRANULARITY_CHOICES",
    "Solver", "SOLVERS",
    "Times", "TIMES",
    "Layout", "LAYOUTS",
    "MIXED_PRECISION_DTYPES",
    "Sharding", "SHARDINGS", "ShardingRequest", "SHARDING_CHOICES",
    "MixedPrecision", "MIXED_PRECISIONS", "DEFAULT_MIXED_PRECISION",
]

Dtype = Literal["fp32", "tf32", "fp16", "bf16"]
"""Training precision; bf16 and fp16 mean mixed precision (16-bit weights and activations, fp32 master copy)."""
DTYPES: Final[tuple[Dtype, ...]] = get_args(Dtype)
MIXED_PRECISION_DTYPES: Final[tuple[Dtype, ...]] = ("bf16", "fp16")
DtypeRequest = Literal["auto", "fp32", "tf32", "fp16", "bf16"]
"""A dtype, or "auto": fp32 on a calibrated local profile, else bf16 (fp16 where the device has no bf16; fp32 where
it has no 16-bit rate above fp32's, as Pascal)."""
DTYPE_CHOICES: Final[tuple[DtypeRequest, ...]] = get_args(DtypeRequest)

Optimizer = Literal["sgd", "momentum", "adam", "adamw"]
"""Sets the optimizer-state memory (ZeRO §3.1): none, one fp32 buffer, two fp32 buffers (Adam, AdamW)."""
OPTIMIZERS: Final[tuple[Optimizer, ...]] = get_args(Optimizer)

OptimizerKernels = Literal["auto", "fused", "foreach"]
"""How the framework steps its optimizer (costmodels/optimizer_step.py): fused kernels, one pass over the state
(torchtitan's default, Megatron, DeepSpeed, `pipeplan run` on CUDA); torch.optim's default passes, one op at a time
or foreach (torch on CUDA without fused=True, Composer's DecoupledAdamW); "auto": the runtime's on the profile's
device (a local CPU profile: torch's defaults; any other: fused)."""
OPTIMIZER_KERNELS: Final[tuple[OptimizerKernels, ...]] = get_args(OptimizerKernels)

Recompute = Literal["auto", "on", "off"]
"""Activation recomputation: searched ("auto"), always, or never."""
RECOMPUTE_CHOICES: Final[tuple[Recompute, ...]] = get_args(Recompute)

RecomputeGranularity = Literal["stage", "block"]
"""What one checkpoint covers when recomputing: a whole stage (GPipe §2.3, torchgpipe; it keeps each microbatch's
stage input and re-runs the stage at once) or each block, the unit a framework checkpoints: a decoder layer
(Megatron-LM's `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`, DeepSpeed's
`activation_checkpoint_interval=1`, torchtitan's `full`), and outside the blocks each unit the frameworks place
(embedding, final norm, head; planner/frameworks/names.py), or each traced layer of a model without a numbered
block list. It keeps every block's input and re-runs one block at a time. Only schedules whose backward is one pass
and that flush run per-block checkpoints (`pipeplan.schedules.runs_block_checkpoints`)."""
RECOMPUTE_GRANULARITIES: Final[tuple[RecomputeGranularity, ...]] = get_args(RecomputeGranularity)
RecomputeGranularityRequest = Literal["auto", "stage", "block"]
"""A granularity, or "auto": the search tries both for each configuration it recomputes (block only where it runs)."""
RECOMPUTE_GRANULARITY_CHOICES: Final[tuple[RecomputeGranularityRequest, ...]] = get_args(RecomputeGranularityRequest)

Solver = Literal["auto", "dp", "ilp"]
"""Partitioner: the DP for every configuration; "ilp"/"auto" re-partition the best with the ILP (DAGs)."""
SOLVERS: Final[tuple[Solver, ...]] = get_args(Solver)

Times = Literal["model", "measured", "roofline"]
"""Layer times: the trace's measurements where it timed the profile's device (this CPU, or that GPU), else the
roofline cost model ("model"); always as measured while tracing; always the roofline."""
TIMES: Final[tuple[Times, ...]] = get_args(Times)

Layout = Literal["stage-major", "pipeline-major"]
"""Rank placement: a stage's replicas on consecutive ranks, or each pipeline replica on consecutive ranks."""
LAYOUTS: Final[tuple[Layout, ...]] = get_args(Layout)

Sharding = Literal["none", "zero1", "zero2", "zero3"]
"""Sharded data parallelism across a stage's replicas (ZeRO, Rajbhandari et al. 2019 §5): nothing sharded;
the optimizer state and fp32 master weights (ZeRO-1, Megatron-LM's distributed optimizer); plus the
gradients (ZeRO-2); plus the parameters (ZeRO-3, FSDP)."""
SHARDINGS: Final[tuple[Sharding, ...]] = get_args(Sharding)
ShardingRequest = Literal["auto", "none", "zero1", "zero2", "zero3"]
"""A sharding level, or "auto": ZeRO-1 wherever there are replicas, further only to fit (planner/configs.py)."""
SHARDING_CHOICES: Final[tuple[ShardingRequest, ...]] = get_args(ShardingRequest)

MixedPrecision = Literal["deepspeed", "megatron", "autocast"]
"""How bf16/fp16 training keeps its state: 16-bit weights and gradients (DeepSpeed, the ZeRO paper: 16 bytes per
parameter with Adam), fp32 gradients (Megatron-LM: bf16 18 bytes, fp16 20 with an fp32 main-gradient copy), or
fp32 weights and gradients with a 16-bit copy for the step and activations as torch.autocast leaves them (autocast,
what `pipeplan run` trains: 18 bytes)."""
MIXED_PRECISIONS: Final[tuple[MixedPrecision, ...]] = get_args(MixedPrecision)
DEFAULT_MIXED_PRECISION: Final[MixedPrecision] = "autocast"
"""The recipe a 16-bit plan is priced with unless the user names one: the one `pipeplan run` trains, so a plan saved
with `analyze -o` holds when run there (as `--optimizer-kernels auto` prices the runtime's step). Priced with
DeepSpeed's recipe instead, the stages of the GPT plans of benchmarks/RESULTS.md ("Peak memory") were predicted
11-32% under what they held under `pipeplan run`. A plan for a framework names that framework's recipe
(`--mixed-precision deepspeed|megatron`; `pipeplan export` says when a plan's recipe is not its target's)."""
