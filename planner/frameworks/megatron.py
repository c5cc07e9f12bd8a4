"""Megatron-LM: a plan as command-line arguments, and Megatron arguments as a split.

Megatron places the embedding (`E`) on the first pipeline stage and the loss
stage (`L`: final layernorm, output layer and loss; `TransformerBlock.
has_final_layernorm_in_this_stage` puts the final norm where post_process is,
i.e. the last stage) on the last; only the decoder layers (`t`) move. Four
argument forms say where (megatron/training/arguments.py, megatron/core/
transformer/transformer_config.py and transformer_block.get_num_layers_to_build,
megatron-core 0.16.1 and Megatron-LM main 2026-08):

- `--pipeline-model-parallel-size P` alone: N/P decoder layers per stage (N % P == 0);
- `--decoder-first-pipeline-num-layers a` / `--decoder-last-pipeline-num-layers b`:
  the rest split evenly over the middle stages (each > 0, the middle must divide);
- `--num-layers-per-virtual-pipeline-stage n` or `--num-virtual-stages-per-pipeline-rank v`:
  interleaving, equal chunks, virtual stage k on rank k % P;
- `--pipeline-model-parallel-layout`: any placement, e.g. "Ettt|(tt|)*2,ttL"
  (`PipelineParallelLayerLayout.parse_str_to_list`): stages split by "|",
  "(x)*n" and "x*n" repeat, commas are cosmetic; "E" exactly once and first,
  "L" exactly once and last, N "t"s. It cannot be combined with the other forms.

`export` picks the simplest form that expresses the plan; `split_from_args`
reads any of them (as Megatron computes them) into a split of the model's units.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from pipeplan.planner.frameworks.common import Export, framework_notes, plan_units, require_synchronous
from pipeplan.planner.frameworks.names import Inexpressible, ModelUnits, unit_split
from pipeplan.planner.plan import Plan
from pipeplan.schedules import facts, inflight_microbatches

__all__ = ["StageLayers", "layout_string", "parse_layout", "export", "split_from_args", "stage_layers"]


@dataclass(frozen=True)
class StageLayers:
    """One (virtual) stage as Megatron sees it."""

    embedding: bool
    decoders: int
    loss: bool

    def code(self) -> str:
        return ("E" if self.embedding else "") + "t" * self.decoders + ("L" if self.loss else "")


def stage_layers(mu: ModelUnits, split: list[list[int]]) -> list[StageLayers]:
    """The split as Megatron stages; Inexpressible when the norm/head are not together on the last stage."""
    if not mu.blocks:
        raise Inexpressible("the layer names show no numbered decoder blocks; Megatron's GPT model has them")
    post = {u for u, unit in enumerate(mu.units) if unit.kind not in ("embed", "block")}
    last = len(split) - 1
    for s, units in enumerate(split):
        stray = [mu.units[u].key for u in units if u in post]
        if stray and s != last:
            raise Inexpressible(f"stage {s} holds {', '.join(stray)}: Megatron keeps the final norm and the output "
                                f"layer together in the loss stage L, on the last stage ({last})")
    return [StageLayers(embedding=s == 0, decoders=sum(1 for u in units if mu.units[u].kind == "block"),
                        loss=s == last) for s, units in enumerate(split)]


def layout_string(stages: list[StageLayers]) -> str:
    """The `--pipeline-model-parallel-layout` value; runs of three or more equal stages fold to "(..|)*n"."""
    codes = [re.sub(r"t{2,}", lambda m: f"t*{len(m.group())}", st.code()) for st in stages]
    out: list[str] = []
    i = 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[i]:
            j += 1
        n = j - i + 1 - (1 if j == len(codes) - 1 else 0)  # the last stage takes no "|" after it
        out.append(f"({codes[i]}|)*{n}" if n > 2 else f"{codes[i]}|" * n)
        if j == len(codes) - 1:
            out.append(codes[i])
        i = j + 1
    return "".join(out)


def parse_layout(text: str) -> list[StageLayers]:
    """Megatron's layout grammar (`PipelineParallelLayerLayout.parse_str_to_list`), reproduced; "m" (MTP) refused."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    stages = []
    for part in s.split("|"):
        bad = sorted(set(part) - set("EtL"))
        if bad:
            raise ValueError(f"layout {text!r}: layer character {bad[0]!r} is not one of E, t, L "
                             "(m, multi-token prediction, has no pipeplan counterpart)")
        if not re.fullmatch(r"E?t*L?", part):
            raise ValueError(f"layout {text!r}: in stage {part!r} E must come first and L last")
        stages.append(StageLayers("E" in part, part.count("t"), "L" in part))
    flat = "".join(st.code() for st in stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError(f"layout {text!r}: Megatron needs E exactly once, first, and L exactly once, last")
    return stages


def _even(counts: list[int]) -> bool:
    return len(set(counts)) == 1 and counts[0] > 0


def _form(stages: list[StageLayers], P: int, v: int) -> tuple[dict[str, Any], str]:
    """The simplest Megatron arguments for these stages, and which form they are."""
    counts = [st.decoders for st in stages]
    layout = layout_string(stages)
    if v == 1 and _even(counts):
        return {}, "even split"
    if v > 1 and _even(counts):
        return {"--num-virtual-stages-per-pipeline-rank": v}, "interleaved, equal chunks"
    middle = counts[1:-1]
    if v == 1 and P >= 2 and min(counts) > 0 and (not middle or len(set(middle)) == 1):
        args: dict[str, Any] = {}
        ref = middle[0] if middle else None
        if counts[0] != ref:
            args["--decoder-first-pipeline-num-layers"] = counts[0]
        if counts[-1] != ref:
            args["--decoder-last-pipeline-num-layers"] = counts[-1]
        return args, "uneven first/last stage"
    return {"--pipeline-model-parallel-layout": layout}, "explicit layout"


def export(plan: Plan) -> Export:
    """The plan as Megatron-LM arguments; Inexpressible says why when Megatron cannot run it."""
    require_synchronous(plan, "Megatron-LM")
    if plan.schedule == "gpipe":
        raise Inexpressible("Megatron-LM has no GPipe schedule (it runs 1F1B, or interleaved 1F1B with virtual "
                            "stages); the nearest plan is the same split under 1f1b")
    if facts(plan.schedule).splits_backward:
        raise Inexpressible(f"Megatron-LM's pipeline schedules are 1F1B and interleaved 1F1B; it has no {plan.schedule} "
                            "zero-bubble schedule: re-plan with --schedule 1f1b or interleaved")
    if plan.sharding in ("zero2", "zero3"):
        raise Inexpressible(f"pipeplan exports Megatron's ZeRO-1 (--use-distributed-optimizer) only; {plan.sharding} "
                            "would need Megatron-FSDP, whose pipeline support pipeplan does not model")
    pu = plan_units(plan)
    split = unit_split(pu.units, pu.stage_of_layer)
    stages = stage_layers(pu.units, split)
    P, v, M = len(split) // plan.chunks, plan.chunks, plan.microbatches
    if v > 1 and (M < P or M % P):
        raise Inexpressible(f"Megatron's interleaved schedule needs the microbatch count ({M}) to be a multiple of "
                            f"the pipeline size ({P}) (pipeline_parallel/schedules.py, "
                            "microbatch_group_size_per_vp_stage = P)")
    form_args, form = _form(stages, P, v)
    args: dict[str, Any] = {"--num-layers": pu.units.blocks, "--pipeline-model-parallel-size": P, **form_args,
                            "--micro-batch-size": plan.microbatch_size, "--global-batch-size": plan.batch_size}
    if plan.recompute:
        args.update({"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": 1})
    if plan.sharding == "zero1":
        args["--use-distributed-optimizer"] = True
    args.update(PRECISION_ARGS.get(plan.dtype, {}))
    line = " ".join(k if v is True else f"{k} {shlex.quote(str(v))}" for k, v in args.items())
    notes = [f"form: {form}; the same placement as a layout: --pipeline-model-parallel-layout "
             f"{shlex.quote(layout_string(stages))}",
             f"launch on {P * plan.data_parallel} GPUs (data-parallel size = GPUs / pipeline size = "
             f"{plan.data_parallel}); microbatches = global / (micro x data-parallel) = {M}"]
    if v > 1 and M == P:
        notes.append(_all_warmup_note(P, v))
    notes += framework_notes(plan, "megatron")
    settings = {k.lstrip("-"): val for k, val in args.items()}
    settings["layout"] = layout_string(stages)
    return Export("megatron", settings, {"arguments": line + "\n"}, [[st.code()] for st in stages], notes)


def _all_warmup_note(P: int, v: int) -> str:
    """Megatron's interleaved schedule runs all M*v forwards first when M equals the pipeline size
    (schedules.py: `if num_microbatches == pipeline_parallel_size: all_warmup_microbatches = True`); pipeplan
    predicts torch's order (`_get_warmup_ops`), which keeps fewer in flight on every rank but the first."""
    held = inflight_microbatches("interleaved", P, P - 1, P, chunks=v)
    return (f"microbatches = pipeline size ({P}): Megatron then runs all {P * v} chunk forwards before any backward, "
            f"so the last rank holds {P * v} microbatch-chunks of activations where the plan predicts {held} "
            "(torch's order); give it more microbatches, a multiple of the pipeline size, to keep the prediction")


# Megatron-LM trains fp32 without these (megatron/training/arguments.py): the plan's 16-bit dtype; --fp16 scales its
# loss dynamically unless --loss-scale fixes one.
PRECISION_ARGS: dict[str, dict[str, Any]] = {"bf16": {"--bf16": True}, "fp16": {"--fp16": True}}


def _flags(text: str) -> dict[str, str]:
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key, eq, val = tok.partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                val, i = tokens[i + 1], i + 1
            out[key.replace("_", "-")] = val if (eq or val) else "true"
        i += 1
    return out


def _int(flags: dict[str, str], key: str) -> int | None:
    if key not in flags:
        return None
    try:
        return int(flags[key])
    except ValueError:
        raise ValueError(f"{key} {flags[key]!r} is not an integer") from None


def _counts(flags: dict[str, str], N: int, P: int) -> tuple[list[int], int]:
    """Decoder layers per virtual stage (model order) and v, as Megatron computes them from the arguments."""
    first, last = _int(flags, "--decoder-first-pipeline-num-layers"), _int(flags, "--decoder-last-pipeline-num-layers")
    per_vstage, v_arg = _int(flags, "--num-layers-per-virtual-pipeline-stage"), _int(flags, "--num-virtual-stages-per-pipeline-rank")
    e, lo = int("--account-for-embedding-in-pipeline-split" in flags), int("--account-for-loss-in-pipeline-split" in flags)
    if per_vstage is not None and (first is not None or last is not None):
        raise ValueError("Megatron refuses --num-layers-per-virtual-pipeline-stage with uneven first/last stages "
                         "(use --num-virtual-stages-per-pipeline-rank)")
    if (first is not None or last is not None) and (e or lo):
        raise ValueError("Megatron refuses --decoder-first/last-pipeline-num-layers with --account-for-*-in-pipeline-split")
    total = N + e + lo
    if first is not None or last is not None:
        ranks = _uneven(N, P, first, last)
        v = v_arg or 1
        if v > 1 and any(r % v for r in ranks):
            raise ValueError(f"Megatron refuses: a stage's layer count is not divisible by {v} virtual stages")
        return [ranks[k % P] // v for k in range(P * v)], v
    if total % P:
        raise ValueError(f"Megatron refuses {N} layers{' (+ embedding/loss)' if e or lo else ''} on "
                         f"{P} pipeline stages: not divisible")
    per_rank = total // P
    if per_vstage is not None and (per_vstage < 1 or per_rank % per_vstage):
        raise ValueError("Megatron refuses: layers per pipeline stage not divisible by layers per virtual stage")
    v = v_arg or (per_rank // per_vstage if per_vstage else 1)
    if per_rank % v:
        raise ValueError(f"Megatron refuses: {per_rank} layers per pipeline stage do not divide into {v} virtual stages")
    # transformer_block.get_num_layers_to_build: the embedding (loss) takes a layer's place on the first (last)
    # virtual stage only.
    counts = [per_rank // v] * (P * v)
    counts[0] -= e
    counts[-1] -= lo
    if min(counts) < 0:
        raise ValueError("Megatron refuses: not enough layers in the first or last virtual stage")
    return counts, v


def _uneven(N: int, P: int, first: int | None, last: int | None) -> list[int]:
    rest, middle = N, P
    for value, name in ((first, "first"), (last, "last")):
        if value is not None:
            if value <= 0:
                raise ValueError(f"num_layers_in_{name}_pipeline_stage must be larger than 0")
            rest, middle = rest - value, middle - 1
    if bool(rest) != bool(middle) or (middle and rest % middle):
        raise ValueError(f"Megatron refuses: {rest} middle layers cannot be split evenly over {middle} middle stages")
    each = rest // middle if middle else 0
    ranks = [each] * P
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def split_from_args(text: str, mu: ModelUnits) -> tuple[list[list[int]], int]:
    """Megatron arguments -> (units per virtual stage, chunks per rank); ValueError names what Megatron refuses."""
    flags = _flags(text)
    P = _int(flags, "--pipeline-model-parallel-size")
    if P is None or P < 1:
        raise ValueError("no --pipeline-model-parallel-size among the Megatron arguments")
    N = mu.blocks
    given = _int(flags, "--num-layers")
    if given is not None and given != N:
        raise ValueError(f"--num-layers {given} but the model has {N} decoder blocks")
    layout = flags.get("--pipeline-model-parallel-layout")
    if layout is not None:
        if any(k in flags for k in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                                    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")):
            raise ValueError("Megatron refuses --pipeline-model-parallel-layout with other pipeline layout arguments")
        stages = parse_layout(layout)
        if len(stages) % P:
            raise ValueError(f"layout has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {P}")
        if sum(st.decoders for st in stages) != N:
            raise ValueError(f"layout has {sum(st.decoders for st in stages)} decoder layers, the model {N}")
        counts, v = [st.decoders for st in stages], len(stages) // P
    else:
        counts, v = _counts(flags, N, P)
    return _units_split(mu, counts), v


def _units_split(mu: ModelUnits, counts: list[int]) -> list[list[int]]:
    """Embedding-side units to stage 0, `counts[k]` blocks to stage k, the rest to the last stage."""
    blocks = [u for u, unit in enumerate(mu.units) if unit.kind == "block"]
    pre = [u for u in range(blocks[0])]
    post = [u for u in range(blocks[-1] + 1, len(mu.units))]
    split, at = [], 0
    for k, c in enumerate(counts):
        split.append((pre if k == 0 else []) + blocks[at:at + c] + (post if k == len(counts) - 1 else []))
        at += c
    return split
