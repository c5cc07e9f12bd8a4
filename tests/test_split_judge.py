"""`--split` / `--split-from` on `plan` (and `analyze`): a user's split parsed, predicted and reported beside the best.

The split's prediction is checked against pipeplan's one prediction path called directly (`evaluate`) with
the configuration the report says it used; the forms are checked against assignments written out by hand.
"""

from __future__ import annotations

import json

import pytest

from cli_invoke import invoke as run
from pipeplan.planner.frameworks.split import parse_split, split_from_source
from pipeplan.planner.predict import evaluate
from test_export_fixtures import counts_assignment, llama_graph

NAMES = [layer.name for layer in llama_graph(8).layers]  # embed, rotary, layers.0-7, norm, lm_head


def test_names_form_starts_stages_at_the_named_layers():
    got = parse_split("model.layers.2,model.layers.4,model.layers.6", NAMES)
    assert got.assignment == counts_assignment([4, 2, 2, 4]) and got.chunks == 1


def test_a_module_name_stands_for_its_first_layer():
    names = [layer.name for layer in llama_graph(4, halves=True).layers]
    assert parse_split("model.layers.2", names).assignment == counts_assignment([6, 6])
    assert parse_split("model.layers.1.mlp", names).assignment == counts_assignment([5, 7])  # inside a block: allowed


def test_counts_form_counts_blocks_and_keeps_embedding_and_head_at_the_ends():
    assert parse_split("2,2,2,2", NAMES).assignment == counts_assignment([4, 2, 2, 4])
    assert parse_split("1,3,3,1", NAMES).assignment == counts_assignment([3, 3, 3, 3])


@pytest.mark.parametrize("text, why", [("3,3,3", "add up to 9 blocks, the model has 8"), ("0,8", "at least one block"),
                                       ("model.layers.4,model.layers.2", "model order"),
                                       ("model.layers.9", "no layer is named"), ("model.embed_tokens", "after the first")])
def test_bad_splits_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        parse_split(text, NAMES)


def test_megatron_argument_file(tmp_path):
    f = tmp_path / "megatron.args"
    f.write_text("# the job's pipeline flags\n--num-layers 8 \\\n  --pipeline-model-parallel-size 4 \\\n"
                 "  --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1\n")
    params = [1.0] * len(NAMES)
    params[1] = 0.0
    assert split_from_source(str(f), NAMES, params).assignment == counts_assignment([3, 3, 3, 3])


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("split") / "graph.json"
    llama_graph(8, hidden=1024, vocab=32000).save(path)
    return path


def test_plan_reports_the_split_beside_the_best(graph_file):
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "--stages", "4", "-b", "16",
                          "--dtype", "bf16", "--split", "2,2,2,2", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    mine, best = doc["your_split"], doc["plan"]
    assert mine["source"] == "--split 2,2,2,2" and mine["layer_counts"] == [4, 2, 2, 4]
    plan = mine["plan"]
    again = evaluate(llama_graph(8, hidden=1024, vocab=32000), _profile("h100-sxm"), counts_assignment([4, 2, 2, 4]),
                     schedule=plan["schedule"], microbatches=plan["microbatches"], batch_size=16,
                     data_parallel=plan["data_parallel"], chunks=plan["chunks"], recompute=plan["recompute"],
                     sharding=plan["sharding"], dtype="bf16")
    assert mine["samples_per_s"] == pytest.approx(again.predicted.samples_per_s, rel=1e-9)
    assert mine["slowdown_vs_best"] == pytest.approx(best["predicted"]["samples_per_s"] / mine["samples_per_s"])
    assert len(mine["stage_memory_fractions"]) == 4 and mine["why"]


def _profile(name):
    from pipeplan.hardware_profiles import load_profile

    return load_profile(name)


def test_text_report_says_how_much_slower_and_why(graph_file):
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "--stages", "4", "-b", "16",
                          "--dtype", "bf16", "--split", "model.layers.1,model.layers.2,model.layers.3"])
    assert code == 0, err
    assert "your split (--split model.layers.1,model.layers.2,model.layers.3):" in out
    assert "slower than the best" in out and "why: stage 3" in out


def test_deepspeed_inline_and_a_different_stage_count(graph_file):
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "-b", "16", "--dtype", "bf16",
                          "--split-from", "deepspeed:2:uniform", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    mine = doc["your_split"]
    assert mine["layer_counts"] == [7, 5]  # 11 DeepSpeed layers, 6 + 5; the weightless rotary rides with the embedding
    assert mine["plan"]["stages"][0]["layers"][-1] == "model.layers.4"
    # planned for DeepSpeed: both plans counted with its recipe, unless --mixed-precision says otherwise
    assert mine["plan"]["mixed_precision"] == doc["plan"]["mixed_precision"] == "deepspeed"
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "-b", "16", "--dtype", "bf16",
                          "--split-from", "deepspeed:2:uniform", "--mixed-precision", "autocast", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["your_split"]["plan"]["mixed_precision"] == doc["plan"]["mixed_precision"] == "autocast"


def test_a_torchtitan_zbv_split_is_judged_in_its_v(graph_file, tmp_path):
    """ZBVZeroBubble's parts go in a V (torchtitan places them so): the split is judged under zb-v, the last
    virtual stage on device 0, not under interleaved's loop, and the prediction is evaluate's for that."""
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "ZBVZeroBubble"\n')
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "2", "-b", "16", "--dtype", "bf16",
                          "--split-from", job, "--json"])
    assert code == 0, err
    mine = json.loads(out)["your_split"]
    plan = mine["plan"]
    assert plan["schedule"] == "zb-v" and plan["chunks"] == 2
    assert [s["devices"] for s in plan["stages"]] == [[0], [1], [1], [0]]
    assert plan["mixed_precision"] == "megatron"  # torchtitan's FSDP mixed precision: fp32 gradients
    again = evaluate(llama_graph(8, hidden=1024, vocab=32000), _profile("h100-sxm"), counts_assignment(
        [len(s["layers"]) for s in plan["stages"]]), schedule="zb-v", microbatches=plan["microbatches"],
        batch_size=16, chunks=2, recompute=plan["recompute"], dtype="bf16", mixed_precision="megatron")
    assert mine["samples_per_s"] == pytest.approx(again.predicted.samples_per_s, rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["--split", "3,3"], "--split 3,3: the counts add up to 6 blocks, the model has 8"),
    (["--split", "2,2", "--split-from", "deepspeed:2:uniform"], "--split and --split-from both name a split"),
    (["--split-from", "nope.toml"], "--split-from nope.toml: no such file"),
    (["--split-from", "deepspeed:2:type:conv"], "found no valid layers"),
    (["--split", "1,1,1,1,1,1,1,1"], "the split has 8 pipeline stages but --gpus is 4"),
    # the graph has 8 blocks between embedding and head: 11 DeepSpeed layer-list entries at most
    (["--split-from", "deepspeed:99999999999:uniform"], "num_stages must be an integer from 1 to 11"),
    (["--split-from", "deepspeed:x:uniform"], "num_stages must be an integer from 1 to 11 (the model's layer-list"),
    (["--split", "0,4,4"], "--split 0,4,4: every stage needs at least one block"),
])
def test_bad_split_flags_exit_2_with_one_line(graph_file, args, message):
    code, out, err = run(["plan", graph_file, "--profile", "h100-sxm", "--gpus", "4", "-b", "16", *args])
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err


def test_deepspeed_inline_without_a_method_is_deepspeeds_default_parameters():
    names = [layer.name for layer in llama_graph(8).layers]
    params = [float(layer.param_bytes) for layer in llama_graph(8).layers]
    assert (split_from_source("deepspeed:3", names, params).assignment
            == split_from_source("deepspeed:3:parameters", names, params).assignment)
