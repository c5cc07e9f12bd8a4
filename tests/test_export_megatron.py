"""Megatron-LM export and import, checked against megatron-core's own classes where megatron-core installs.

megatron-core 0.16.1 installs CPU-only (`pip install megatron-core`; pyproject extra `frameworks`): its
`PipelineParallelLayerLayout` parses and validates the exported layouts, `TransformerConfig` accepts the
exported uneven first/last form, and `transformer_block.get_num_layers_to_build` counts the layers Megatron
builds per stage, which is what the import must reproduce.
"""

from __future__ import annotations

import shlex
import warnings

import pytest

from pipeplan.planner.frameworks import export_plan
from pipeplan.planner.frameworks.megatron import StageLayers, layout_string, parse_layout, split_from_args
from pipeplan.planner.frameworks.names import Inexpressible, assignment_from_units, model_units
from test_export_fixtures import counts_assignment, llama_graph, make_plan

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
LAYOUTS = ["Ettt|tt|tt|ttL", "E|t*8|(t*8|)*2,t*8L", "Et|(t|)*29t*2|L", "E|tt|tt|L", "Etttt|tttL", "EtL"]


def megatron_layout():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout


def _codes(layout_cls, text: str, P: int) -> list[str]:
    """Megatron's parse, as stage codes in model order (virtual stage k = vpp rank k // P, pp rank k % P)."""
    parsed = layout_cls(text, P)
    char = {"embedding": "E", "decoder": "t", "loss": "L"}
    v = parsed.virtual_pipeline_model_parallel_size
    return ["".join(char[t.name] for t in parsed.layout[k % P][k // P]) for k in range(P * v)]


@pytest.mark.parametrize("text", LAYOUTS)
def test_parse_layout_matches_megatron(text):
    cls = megatron_layout()
    ours = [st.code() for st in parse_layout(text)]
    assert ours == _codes(cls, text, 1)


@pytest.mark.parametrize("codes", [["Ett", "tt", "ttL"], ["E", "t", "t", "t", "tL"], ["Et"] + ["t"] * 29 + ["tt", "L"],
                                   ["Etttt", "tttt", "tttt", "tttL"], ["E", "tt", "tt", "tt", "tt", "L"]])
def test_layout_string_round_trips_through_megatron(codes):
    cls = megatron_layout()
    stages = [StageLayers(c.startswith("E"), c.count("t"), c.endswith("L")) for c in codes]
    text = layout_string(stages)
    for P in (p for p in (1, 2) if len(codes) % p == 0):
        assert _codes(cls, text, P) == codes
        cls(text, P).validate_layer_layout(num_layers=sum(c.count("t") for c in codes), mtp_num_layers=None)


def _args(exp) -> dict[str, str]:
    toks = shlex.split(exp.snippets["arguments"])
    out, i = {}, 0
    while i < len(toks):
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            out[toks[i]], i = toks[i + 1], i + 2
        else:
            out[toks[i]], i = "true", i + 1
    return out


def test_even_split_uses_the_plain_form():
    g = llama_graph(8)
    plan = make_plan(g, counts_assignment([4, 2, 2, 4]), microbatches=8)  # embed+rotary+2 | 2 | 2 | 2+norm+head
    args = _args(export_plan(plan, "megatron"))
    assert args["--pipeline-model-parallel-size"] == "4" and args["--num-layers"] == "8"
    assert not any("layout" in k or "first" in k or "last" in k for k in args)
    assert args["--micro-batch-size"] == "2" and args["--global-batch-size"] == "16"


def test_uneven_first_last_form_is_accepted_by_megatron_core():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = llama_graph(8)
    plan = make_plan(g, counts_assignment([3, 3, 3, 3]), recompute=True)  # decoders 1, 3, 3, 1
    args = _args(export_plan(plan, "megatron"))
    assert args["--decoder-first-pipeline-num-layers"] == "1" and args["--decoder-last-pipeline-num-layers"] == "1"
    assert args["--recompute-granularity"] == "full" and args["--recompute-num-layers"] == "1"
    cfg = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.bfloat16,
                            pipeline_model_parallel_size=int(args["--pipeline-model-parallel-size"]),
                            num_layers_in_first_pipeline_stage=int(args["--decoder-first-pipeline-num-layers"]),
                            num_layers_in_last_pipeline_stage=int(args["--decoder-last-pipeline-num-layers"]))
    assert [get_num_layers_to_build(cfg, pp_rank=r) for r in range(4)] == [1, 3, 3, 1]


def test_irregular_split_uses_a_layout_that_megatron_core_validates():
    cls = megatron_layout()
    g = llama_graph(8)
    plan = make_plan(g, counts_assignment([2, 4, 2, 4]))  # E | tttt | tt | ttL, after the rotary rides with E
    exp = export_plan(plan, "megatron")
    text = _args(exp)["--pipeline-model-parallel-layout"]
    assert _codes(cls, text, 4) == ["E", "tttt", "tt", "ttL"]
    cls(text, 4).validate_layer_layout(num_layers=8, mtp_num_layers=None)


def test_interleaved_plan_exports_virtual_stages():
    cls = megatron_layout()
    g = llama_graph(6)
    plan = make_plan(g, counts_assignment([3, 2, 2, 3]), schedule="interleaved", chunks=2, microbatches=8)
    args = _args(export_plan(plan, "megatron"))
    assert args["--pipeline-model-parallel-size"] == "2"
    text = _args(export_plan(plan, "megatron"))["--pipeline-model-parallel-layout"]
    parsed = cls(text, 2)
    assert parsed.virtual_pipeline_model_parallel_size == 2
    assert _codes(cls, text, 2) == ["Et", "tt", "tt", "tL"]


def test_interleaved_with_microbatches_equal_to_the_pipeline_says_megatron_holds_more():
    """Megatron runs all M*v forwards first when M equals the pipeline size (all_warmup_microbatches); the
    prediction follows torch's order, where the last of 2 ranks holds 3 of the 4 chunk-microbatches."""
    g = llama_graph(6)
    notes = export_plan(make_plan(g, counts_assignment([3, 2, 2, 3]), schedule="interleaved", chunks=2,
                                  microbatches=2), "megatron").notes
    assert any("holds 4 microbatch-chunks" in n and "predicts 3" in n for n in notes)
    notes = export_plan(make_plan(g, counts_assignment([3, 2, 2, 3]), schedule="interleaved", chunks=2,
                                  microbatches=4), "megatron").notes
    assert not any("microbatch-chunks" in n for n in notes)


@pytest.mark.parametrize("kw, why", [
    (dict(schedule="gpipe"), "no GPipe"),
    (dict(sharding="zero3", data_parallel=2), "ZeRO-1"),
])
def test_refusals_say_why(kw, why):
    g = llama_graph(6)
    plan = make_plan(g, counts_assignment([3, 2, 2, 3]), **kw)
    with pytest.raises(Inexpressible, match=why):
        export_plan(plan, "megatron")


def test_norm_apart_from_the_head_is_refused():
    g = llama_graph(4)
    plan = make_plan(g, counts_assignment([4, 3, 1]))  # stage 1 ends with model.norm, lm_head alone on stage 2
    with pytest.raises(Inexpressible, match="final norm and the output layer together"):
        export_plan(plan, "megatron")


def test_a_cut_inside_a_block_is_refused():
    g = llama_graph(4, halves=True)
    plan = make_plan(g, counts_assignment([5, 7]))  # stage 1 starts at model.layers.1.mlp
    with pytest.raises(Inexpressible, match=r"inside decoder block model\.layers\.1 \(at layer 'model\.layers\.1\.mlp'\)"):
        export_plan(plan, "megatron")


def _built(cfg_kwargs: dict, P: int) -> list[int]:
    """Decoder layers Megatron builds per (virtual) stage in model order, from its own config and function."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.bfloat16,
                            pipeline_model_parallel_size=P, **cfg_kwargs)
    v = cfg.virtual_pipeline_model_parallel_size or 1
    return [get_num_layers_to_build(cfg, pp_rank=k % P, vp_stage=(k // P) if v > 1 else None) for k in range(P * v)]


@pytest.mark.parametrize("argv, cfg_kwargs, P", [
    ("--pipeline-model-parallel-size 4", dict(num_layers=8), 4),
    ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3",
     dict(num_layers=8, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3), 4),
    ("--pipeline-model-parallel-size 3 --decoder-last-pipeline-num-layers 2",
     dict(num_layers=8, num_layers_in_last_pipeline_stage=2), 3),
    ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
     dict(num_layers=8, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), 2),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
     dict(num_layers=8, virtual_pipeline_model_parallel_size=2), 2),
])
def test_import_counts_layers_as_megatron_builds_them(argv, cfg_kwargs, P):
    pytest.importorskip("megatron.core")
    mu = model_units([layer.name for layer in llama_graph(8).layers])
    split, v = split_from_args(argv, mu)
    ours = [sum(1 for u in units if mu.units[u].kind == "block") for units in split]
    assert ours == _built(cfg_kwargs, P)
    assignment_from_units(mu, split)  # every unit placed once, in order


@pytest.mark.parametrize("argv, why", [
    ("--pipeline-model-parallel-size 3", "not divisible"),
    ("--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Ett|tt|tt|ttL' --decoder-first-pipeline-num-layers 2",
     "other pipeline layout arguments"),
    ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 0", "larger than 0"),
    ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 3", "cannot be split evenly"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ettt|tttt|tL'", "not a multiple"),
    ("--num-layers 8", "no --pipeline-model-parallel-size"),
    ("--pipeline-model-parallel-size 2 --num-layers 12", "model has 8"),
])
def test_import_refuses_what_megatron_refuses(argv, why):
    mu = model_units([layer.name for layer in llama_graph(8).layers])
    with pytest.raises(ValueError, match=why):
        split_from_args(argv, mu)


@pytest.mark.parametrize("dtype, mixed_precision", [("bf16", "deepspeed"), ("bf16", "megatron"), ("fp16", "megatron"),
                                                    ("bf16", "autocast"), ("fp32", "deepspeed")])
def test_the_arguments_train_in_the_plans_dtype(dtype, mixed_precision):
    """--bf16 or --fp16 as the plan's dtype (Megatron-LM trains fp32 without them), set on megatron-core's own
    configs, which refuse both at once; a 16-bit plan counted with another recipe says Megatron keeps fp32 gradients."""
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = make_plan(llama_graph(8), counts_assignment([4, 2, 2, 4]), dtype=dtype, mixed_precision=mixed_precision)
    exp = export_plan(plan, "megatron")
    args = _args(exp)
    flags = {"bf16": "--bf16" in args, "fp16": "--fp16" in args}
    assert flags == {"bf16": dtype == "bf16", "fp16": dtype == "fp16"}
    TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, **flags)
    assert OptimizerConfig(**flags).loss_scale is None  # dynamic loss scaling for --fp16
    with pytest.raises(ValueError, match="Only one of"):
        TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, bf16=True, fp16=True)
    warned = any("--accumulate-allreduce-grads-in-fp32" in n for n in exp.notes)
    assert warned is (dtype != "fp32" and mixed_precision != "megatron")
