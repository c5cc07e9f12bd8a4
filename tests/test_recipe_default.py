"""The default mixed-precision recipe is `pipeplan run`'s (torch.autocast), and every place a plan leaves for
another trainer says when the plan's recipe is not that trainer's: the framework exports, `pipeplan run` itself,
and the infeasibility hint. Old plan files without a recipe keep the one they were planned with."""

from __future__ import annotations

import json

import pytest

from pipeplan.costmodels.memory import model_state_bytes
from pipeplan.errors import InfeasibleError
from pipeplan.planner.frameworks import export_plan
from pipeplan.planner.plan import load_plan
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.search import search
from pipeplan.precision import recipe_note
from search_fixtures import gpt_like, profile
from test_export_fixtures import counts_assignment, llama_graph, make_plan

# The recipe each framework trains with, written out here (not imported) so that a change there is noticed: DeepSpeed
# and Megatron-LM their own; torchtitan's FSDP mixed precision (bf16 compute, fp32 gradient reduction) is closest to
# Megatron-LM's.
FRAMEWORK_RECIPE = {"deepspeed": "deepspeed", "megatron": "megatron", "torchtitan": "megatron"}


def test_a_plan_with_default_flags_is_counted_as_pipeplan_run_trains():
    """The request's default recipe prices autocast's state (fp32 weights and gradients, a 16-bit copy: 18 B/param
    with Adam), not DeepSpeed's 16, and its activations from the trace's autocast counts, not half the fp32 ones."""
    g = llama_graph(4)
    plan = search(g, profile(80.0), PlanRequest(devices=2, batch_size=8, stages=2, microbatches=4, dtype="bf16",
                                                 schedule="1f1b")).best
    assert plan.mixed_precision == "autocast"
    params = sum(layer.param_bytes for layer in g.layers if layer.name in plan.stages[0].layers)
    want = model_state_bytes(params, optimizer="adam", dtype="bf16", mixed_precision="autocast")
    assert want.total_bytes == 18 * params // 4
    got = plan.stages[0].predicted
    assert got.weights_bytes + got.optimizer_bytes == want.total_bytes


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_RECIPE))
@pytest.mark.parametrize("dtype,recipe", [("bf16", "autocast"), ("bf16", "deepspeed"), ("bf16", "megatron"),
                                          ("fp32", "autocast")])
def test_an_export_says_when_the_plans_recipe_is_not_the_frameworks(framework, dtype, recipe):
    plan = make_plan(llama_graph(6), counts_assignment([4, 2, 4]), dtype=dtype, mixed_precision=recipe)
    notes = [n for n in export_plan(plan, framework).notes if "re-plan with --mixed-precision" in n]
    differs = dtype == "bf16" and recipe != FRAMEWORK_RECIPE[framework]
    assert len(notes) == int(differs)
    if differs:
        assert f"--mixed-precision {FRAMEWORK_RECIPE[framework]} " in notes[0]
        assert f"counted with the {recipe} recipe" in notes[0]


@pytest.mark.parametrize("dtype,recipe,schedule,warns", [
    ("bf16", "deepspeed", "1f1b", True), ("fp16", "megatron", "gpipe", True), ("bf16", "autocast", "1f1b", False),
    ("fp32", "deepspeed", "1f1b", False),
    ("fp16", "deepspeed", "pipedream", False),  # asynchronous fp16 trains in fp32 (precision_note says so)
])
def test_run_warns_where_it_trains_another_recipe_than_the_plan_counted(dtype, recipe, schedule, warns):
    note = recipe_note(dtype, recipe, schedule)
    assert (note is not None) is warns
    if warns:
        assert note.startswith("warning: ") and f"counted with the {recipe} recipe" in note


def test_nothing_fits_under_autocast_names_the_frameworks_recipes():
    """A 16-bit plan that does not fit under autocast: the hint says a framework's recipe counts less."""
    g = gpt_like(blocks=8, hidden=1024, seq=1024, vocab=32000, batch=1)
    with pytest.raises(InfeasibleError) as e:
        search(g, profile(1.0), PlanRequest(devices=2, batch_size=8, dtype="bf16", schedule="1f1b"))
    assert "--mixed-precision megatron or deepspeed" in e.value.hint
    with pytest.raises(InfeasibleError) as e:
        search(g, profile(1.0), PlanRequest(devices=2, batch_size=8, dtype="bf16", schedule="1f1b",
                                            mixed_precision="deepspeed"))
    assert "--mixed-precision" not in e.value.hint


def test_a_plan_file_without_a_recipe_reads_as_the_one_it_was_planned_with(tmp_path):
    """Plans saved before the recipes existed were counted as DeepSpeed's (16 B/param): they keep it."""
    plan = make_plan(llama_graph(6), counts_assignment([4, 2, 4]), mixed_precision="deepspeed")
    doc = plan.to_dict()
    del doc["mixed_precision"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "old.json").mixed_precision == "deepspeed"
    plan.mixed_precision = "autocast"
    plan.save(tmp_path / "new.json")
    assert load_plan(tmp_path / "new.json").mixed_precision == "autocast"


@pytest.mark.parametrize("framework,setting", [("deepspeed", "activation_checkpoint_interval=1"),
                                               ("megatron", "--recompute-num-layers 1"), ("torchtitan", '"full"')])
def test_an_export_with_recomputation_says_the_framework_checkpoints_every_layer(framework, setting):
    """The exports turn recomputation on per decoder layer (each framework's only full-recompute form): a plan priced with
    one checkpoint per stage (pipeplan's default) gets a note that its memory differs and how to re-plan; a plan
    priced per block, as the framework runs it, none."""
    for recompute, granularity in ((False, "stage"), (True, "stage"), (True, "block")):
        plan = make_plan(llama_graph(6), counts_assignment([4, 2, 4]), recompute=recompute,
                         mixed_precision=FRAMEWORK_RECIPE[framework], recompute_granularity=granularity)
        exp = export_plan(plan, framework)
        notes = [n for n in exp.notes if n.startswith("recomputation:")]
        assert len(notes) == int(recompute and granularity == "stage")
        if notes:
            assert setting in notes[0] and "one checkpoint per stage" in notes[0]
            assert "--recompute-granularity block" in notes[0]
        if recompute:
            assert setting.strip('"') in json.dumps(exp.settings) or setting in " ".join(exp.snippets.values())
