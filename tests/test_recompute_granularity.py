"""Recomputation a block at a time (`recompute_granularity: block`, as Megatron-LM, DeepSpeed and torchtitan
checkpoint): what a stage keeps and re-runs, priced by the planner, emitted only where the runtime runs it, kept in
plan files, and asked for on the command line. The runtime's side (training unchanged, skips passed between a
stage's blocks): tests/test_runtime_recompute.py; measured memory: benchmarks/memory_bench.py."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from pipeplan.costmodels.memory import RangeMemory, checkpointed_bytes, stage_memory
from pipeplan.errors import InfeasibleError, UserError
from pipeplan.planner.plan import Plan, load_plan
from pipeplan.planner.predict import evaluate
from pipeplan.planner.problem import build_problem, checkpoint_units, dag_problem
from pipeplan.planner.replay import assignment_of, config_of, request_of
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.search import search
from pipeplan.schedules import SCHEDULE_NAMES, facts, runs_block_checkpoints
from search_fixtures import gpt_like, profile
from test_export_fixtures import counts_assignment, llama_graph


def test_checkpointed_bytes_by_hand():
    """Kept: the stage's input and what every block but the last passes on; one re-run: the largest block's saves;
    beyond it: the block whose saves so far and tensors in flight peak highest."""
    # blocks [0, 0, 1, 1, 2]: saves 55, 16, 4; peaks 55 + 10, 7 + 60, 4 + 1
    got = checkpointed_bytes(3, [0, 10, 0, 20, 30], [5, 50, 7, 9, 4], [0, 10, 60, 0, 1], [0, 0, 1, 1, 2])
    assert got == (3 + 10 + 20, 55, 67 - 55)
    assert checkpointed_bytes(8, [99], [4], [0], [7]) == (8, 4, 0)  # one layer: a checkpoint per stage
    # a stage that starts inside block 1: its part of block 1 is a checkpoint of its own
    assert checkpointed_bytes(3, [0, 20, 30], [7, 9, 4], [0, 0, 0], [1, 1, 2]) == (3 + 20, 16, 0)
    # what a later stage reads too is the stage's output, which it keeps anyway (one storage): not kept twice
    assert checkpointed_bytes(3, [0, 20, 30], [7, 9, 4], [0, 0, 0], [1, 1, 2], [False, True, True]) == (3, 16, 0)


def test_checkpoint_units_are_the_frameworks_blocks():
    """Each decoder block one unit (both halves of it), the embedding with the weightless rotary layer beside it, the
    final norm and the head apart; without a numbered module list, each layer its own."""
    g = llama_graph(3, halves=True)
    names = [layer.name for layer in g.layers]
    assert names[:4] == ["model.embed_tokens", "model.rotary_emb", "model.layers.0.self_attn", "model.layers.0.mlp"]
    assert checkpoint_units(names, [layer.param_bytes for layer in g.layers]) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5]
    assert checkpoint_units(["conv1", "bn1", "fc"], [1, 1, 1]) == [0, 1, 2]


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_range_memory_per_block_equals_stage_memory(schedule, chunks):
    """The partitioner's prefix sums and range maxima give stage_memory's number, with `checkpointed_bytes` of the
    range's layers, for every range, including those that cut blocks."""
    g = llama_graph(6, halves=True)
    rng = random.Random(1)
    prob = build_problem(g, profile(), microbatch_size=2)
    prob = dataclasses.replace(prob, transient_bytes=tuple(rng.randrange(4 * s + 1) for s in prob.saved_bytes))
    block_of, passed, last_reader = prob.blocks
    assert len(set(block_of)) < prob.n  # blocks of two layers
    P, M, n = 3, 6, prob.n
    model = RangeMemory(param_bytes=prob.param_bytes, saved_bytes=prob.saved_bytes, cut_bytes=prob.cut_bytes,
                        input_bytes=prob.input_bytes, schedule=schedule, stages=P, microbatches=M, chunks=chunks,
                        recompute=True, optimizer="adam", dtype="fp32", blocks=prob.blocks,
                        transient_bytes=prob.transient_bytes)
    for _ in range(60):
        a = rng.randrange(n)
        b = rng.randrange(a + 1, n + 1)
        s = rng.randrange(P * chunks)
        inb = prob.input_bytes if a == 0 else prob.cut_bytes[a - 1]
        kept, rerun, beyond = checkpointed_bytes(inb, passed[a:b], prob.saved_bytes[a:b], prob.transient_bytes[a:b],
                                                 block_of[a:b], [r >= b for r in last_reader[a:b]])
        want = stage_memory(param_bytes=sum(prob.param_bytes[a:b]) * chunks,
                            saved_bytes_per_mb=sum(prob.saved_bytes[a:b]) * chunks, input_bytes_per_mb=inb,
                            output_bytes_per_mb=prob.cut_bytes[b - 1] if b < n else 0, schedule=schedule, stages=P,
                            stage=s % P, microbatches=M, optimizer="adam", dtype="fp32", recompute=True,
                            chunks=chunks, largest_layer_param_bytes=max(prob.param_bytes[a:b]),
                            checkpointed=(kept * chunks, rerun), transient_bytes=beyond).total_bytes
        assert model(s, a, b) == want


def test_range_memory_per_block_on_random_dags():
    """Random skips (a layer read several layers on, by a later stage too), random blocks: the partitioner's
    numbers are `checkpointed_bytes` of the range written out."""
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(2, 14)
        edges = sorted({(i, rng.randint(i + 1, min(n - 1, i + 4)), 0) for i in range(n - 1) for _ in range(2)})
        prob = dag_problem([1.0] * n, edges)
        block_of = sorted(rng.randrange(n) for _ in range(n))
        block_of = [sorted(set(block_of)).index(x) for x in block_of]  # numbered 0.. in order
        prob = dataclasses.replace(prob, saved_bytes=tuple(rng.randrange(100) for _ in range(n)),
                                   transient_bytes=tuple(rng.randrange(100) for _ in range(n)),
                                   block_of=tuple(block_of), passed_bytes=tuple(rng.randrange(50) for _ in range(n)))
        blocks, passed, last_reader = prob.blocks
        model = RangeMemory(param_bytes=prob.param_bytes, saved_bytes=prob.saved_bytes, cut_bytes=prob.cut_bytes,
                            input_bytes=prob.input_bytes, schedule="gpipe", stages=2, microbatches=3, chunks=1,
                            recompute=True, optimizer="sgd", dtype="fp32", blocks=prob.blocks,
                            transient_bytes=prob.transient_bytes)
        for a in range(n):
            for b in range(a + 1, n + 1):
                inb = prob.input_bytes if a == 0 else prob.cut_bytes[a - 1]
                kept, rerun, beyond = checkpointed_bytes(inb, passed[a:b], prob.saved_bytes[a:b],
                                                         prob.transient_bytes[a:b], blocks[a:b],
                                                         [r >= b for r in last_reader[a:b]])
                want = stage_memory(param_bytes=0, saved_bytes_per_mb=sum(prob.saved_bytes[a:b]),
                                    input_bytes_per_mb=inb, output_bytes_per_mb=prob.cut_bytes[b - 1] if b < n else 0,
                                    schedule="gpipe", stages=2, stage=0, microbatches=3, optimizer="sgd",
                                    dtype="fp32", recompute=True, checkpointed=(kept, rerun),
                                    transient_bytes=beyond).total_bytes
                assert model(0, a, b) == want, (a, b)


def _two_stage(granularity: str, prof=None, microbatches: int = 4):
    g = llama_graph(4, halves=True, hidden=256)
    assignment = counts_assignment([6, len(g.layers) - 6])  # embedding, rotary, blocks 0 and 1 | the rest
    plan = evaluate(g, prof or profile(80.0), assignment, schedule="1f1b", microbatches=microbatches, batch_size=8,
                    recompute=True, recompute_granularity=granularity)
    return g, assignment, plan


def test_a_stage_keeps_every_block_input_for_each_microbatch_in_flight():
    """1F1B's first of two stages holds 2 microbatches: each keeps its blocks' inputs (fp32, at the microbatch's 2
    samples: the traced bytes), and one block's saves come back at a time, where one checkpoint per stage keeps the
    stage's input and re-runs all it saves; counted here from the graph's layers. (A stage's reported activations
    add its buffers and tensors in flight, the same under both: compared by difference.)"""
    g, assignment, per_block = _two_stage("block")
    per_stage = _two_stage("stage")[2]
    mine = g.layers[:6]
    # the embedding block (embed_tokens, rotary) passes the embedding on; block 0 its mlp's output; block 1 leaves
    kept = g.input_bytes + mine[0].output_bytes + mine[3].output_bytes
    rerun = max(mine[2].saved_bytes + mine[3].saved_bytes, mine[0].saved_bytes + mine[1].saved_bytes)
    saved = sum(layer.saved_bytes for layer in mine)
    assert per_block.recompute_granularity == "block" and per_stage.recompute_granularity == "stage"
    assert 2 * kept + rerun < 2 * g.input_bytes + saved < 2 * saved  # blocks save more than they pass on
    got = per_block.stages[0].predicted.activation_bytes - per_stage.stages[0].predicted.activation_bytes
    assert got == (2 * kept + rerun) - (2 * g.input_bytes + saved)


def test_each_block_pays_a_checkpoint():
    """The re-run is the same forward (these layers' saves were not timed: each re-runs whole); what differs is
    torch's checkpoint host time, once per region: per block, once per block of the stage (3 and 4 here)."""
    prof = dataclasses.replace(profile(80.0), recompute_overhead_s=1e-3, recompute_tensor_s=0.0)
    g, assignment, per_block = _two_stage("block", prof)
    per_stage = _two_stage("stage", prof)[2]
    blocks = [3, 4]  # embedding, blocks 0-1 | blocks 2-3, norm, head
    for a, b, k in zip(per_block.stages, per_stage.stages, blocks, strict=True):
        assert a.predicted.recompute_s - b.predicted.recompute_s == pytest.approx((k - 1) * 1e-3, rel=1e-9)


def test_search_emits_per_block_recomputation_only_where_it_runs():
    """Asked for per block, the search never pairs recomputation with a schedule whose runtime checkpoints whole
    stages (split backwards, asynchronous PipeDream), and every plan it recomputes says per block."""
    g = gpt_like(blocks=4, hidden=512, seq=1024, vocab=1000, batch=8)
    res = search(g, profile(0.5), PlanRequest(devices=4, batch_size=16, schedule="all", recompute="auto",
                                               recompute_granularity="block", top=20))
    plans = [res.best, *res.alternatives]
    assert any(p.recompute for p in plans), "the case should need recomputation somewhere"
    for p in plans:
        if p.recompute:
            assert runs_block_checkpoints(p.schedule) and p.recompute_granularity == "block", p.schedule
    unrunnable = [name for name in SCHEDULE_NAMES if not runs_block_checkpoints(name)]
    assert {facts(name).splits_backward or not facts(name).flushes for name in unrunnable} == {True}


def test_auto_tries_both_and_keeps_the_better():
    """`auto` searches stage and block granularity per configuration: its best is at least as fast as the best of
    either alone, and is one of them."""
    g = llama_graph(6, halves=True, hidden=512, vocab=8000)
    best = {}
    for granularity in ("stage", "block", "auto"):
        best[granularity] = search(g, profile(0.4), PlanRequest(devices=4, batch_size=32, recompute="on",
                                                                 recompute_granularity=granularity)).best
    rates = {k: p.predicted.samples_per_s for k, p in best.items()}
    assert rates["auto"] == max(rates["stage"], rates["block"]), rates
    assert rates["stage"] != rates["block"]  # the case tells them apart
    assert best["auto"].recompute_granularity == max(("stage", "block"), key=rates.__getitem__)


def test_nothing_fits_names_per_block_recomputation_where_it_fits():
    """One device, one microbatch of 64: a checkpoint per stage re-runs the whole model at once and needs ~2.9 GiB,
    one per block ~0.9. At 1 GiB the one line leads with per-block recomputation and the plan a per-block search
    finds, which fits; at 0.5 GiB, where that does not fit either, it does not offer it."""
    g = llama_graph(6, halves=True, hidden=512, vocab=8000)
    req = PlanRequest(devices=1, batch_size=64, microbatches=1, recompute="on")
    with pytest.raises(InfeasibleError) as err:
        search(g, profile(1.0), req)
    assert err.value.hint.startswith("would fit with: --recompute-granularity block (1 stage x 1 replica"), err.value
    best = search(g, profile(1.0), dataclasses.replace(req, recompute_granularity="block")).best
    assert best.recompute_granularity == "block"
    assert max(s.predicted.memory_bytes for s in best.stages) <= profile(1.0).usable_memory_bytes
    assert f"{best.predicted.samples_per_s:.4g} samples/s" in err.value.hint
    with pytest.raises(InfeasibleError) as err:
        search(g, profile(0.5), req)
    assert "--recompute-granularity" not in err.value.hint and "more devices" in err.value.hint
    with pytest.raises(InfeasibleError) as err:  # not offered where the user asked for no recomputation
        search(g, profile(1.0), dataclasses.replace(req, recompute="off"))
    assert "--recompute-granularity" not in err.value.hint


def test_a_searched_plan_replays_to_its_own_prediction():
    g = gpt_like(blocks=4, hidden=512, seq=1024, vocab=1000, batch=8)
    best = search(g, profile(1.0), PlanRequest(devices=4, batch_size=16, recompute="on",
                                               recompute_granularity="block")).best
    assert best.recompute and best.recompute_granularity == "block"
    config = config_of(best)
    again = evaluate(g, profile(1.0), assignment_of(best, g), schedule=config.schedule,
                     microbatches=config.microbatches, batch_size=16, data_parallel=config.data_parallel,
                     chunks=config.chunks, recompute=True, recompute_granularity="block", layout=config.layout,
                     dtype=best.dtype, sharding=best.sharding, mixed_precision=request_of(best).mixed_precision)
    assert again.predicted == best.predicted


def test_requests_and_plans_refuse_it_where_it_does_not_run(tmp_path):
    with pytest.raises(UserError, match="--recompute-granularity block does not run under --schedule zb-h1"):
        PlanRequest(devices=2, batch_size=8, schedule="zb-h1", recompute="on", recompute_granularity="block")
    with pytest.raises(UserError, match="unknown recompute granularity 'layer'"):
        PlanRequest(devices=2, batch_size=8, recompute_granularity="layer")  # type: ignore[arg-type]
    plan = _two_stage("block")[2]
    plan.save(tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").recompute_granularity == "block"
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["recompute_granularity"]  # a plan file from before: one checkpoint per stage, as it was priced
    assert Plan.from_dict(doc).recompute_granularity == "stage"
    doc.update(recompute_granularity="block", schedule="zb-h1")
    with pytest.raises(UserError, match="'block' does not run under the zb-h1 schedule"):
        Plan.from_dict(doc)


def _cli(args, tmp_path):
    from click.testing import CliRunner

    from pipeplan.cli.main import cli
    from test_export_fixtures import llama_graph

    graph = tmp_path / "graph.json"
    llama_graph(8, hidden=1024, vocab=32000).save(graph)
    result = CliRunner().invoke(cli, ["plan", str(graph), "--profile", "h100-sxm", "--gpus", "4", "-b", "16",
                                      "--dtype", "bf16", *args])
    return result.exit_code, result.stdout, result.stderr


def test_cli_per_block_and_its_refusal(tmp_path):
    code, out, err = _cli(["--recompute", "on", "--recompute-granularity", "block", "--json"], tmp_path)
    assert code == 0, err
    assert json.loads(out)["plan"]["recompute_granularity"] == "block"
    code, out, err = _cli(["--schedule", "zb-h1", "--recompute", "on", "--recompute-granularity", "block"], tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--recompute-granularity block does not run under --schedule zb-h1" in err


def test_a_framework_split_is_counted_per_block_unless_told(tmp_path):
    """Planned for a framework (`--split-from`), recomputation is counted as the frameworks run it, per block."""
    split = ["--split-from", "deepspeed:2:uniform", "--recompute", "on", "--json"]
    code, out, err = _cli(split, tmp_path)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["recompute_granularity"] == doc["your_split"]["plan"]["recompute_granularity"] == "block"
    code, out, err = _cli([*split, "--recompute-granularity", "stage"], tmp_path)
    assert code == 0, err
    assert json.loads(out)["your_split"]["plan"]["recompute_granularity"] == "stage"
