"""ZeRO-1/2/3 in the runtime (runtime/sharding.py): sharded training equals single-process training.

2 stages x 2 replicas (4 processes) per plan, every level, SGD with momentum (an
update that is elementwise, with state, so a flat shard updates exactly as the whole
tensors would; Adam is elementwise too, but it turns the summation-order noise of
gradients that are exactly zero, such as a conv bias before BatchNorm or an
attention key bias, into whole steps of +-lr, so it cannot be compared exactly): the
losses and every parameter equal a single-process run of the whole batch cut
into replicas x microbatches slices. Cases: a tied GPT with a summed loss (the
tied weights stay whole), a U-Net with BatchNorm under GPipe, an MLP interleaved
(two stages per process, each sharded over its own replica group).
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.planner.plan import load_plan
from runtime_helpers import EXAMPLES, REPO, hand_plan, load_dumped, reference_steps, run_worker

CASES = {  # name -> (model file, batch, microbatches, schedule, stages, devices)
    "t-gpt-tied": (REPO / "tests" / "runtime_model_gpt.py", 8, 2, "1f1b", 2, 2),
    "t-unet": (REPO / "tests" / "runtime_model_unet.py", 8, 2, "gpipe", 2, 2),
    "mlp": (EXAMPLES / "mlp.py", 8, 2, "interleaved", 4, 2),
    "frozen": (REPO / "tests" / "data" / "frozen_backbone.py", 8, 2, "1f1b", 2, 2),  # stage 0: frozen weights only
    "shared-input": (REPO / "tests" / "data" / "shared_input.py", 8, 2, "gpipe", 2, 2),  # each replica: the table whole
}
LEVELS = ("zero1", "zero2", "zero3")
IDS = [(c, lv) for c in sorted(CASES) for lv in LEVELS]
STEPS = 2
LR = 0.01


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Every case and level in one torchrun of 4 processes (start-up paid once)."""
    tmp = tmp_path_factory.mktemp("sharding")
    plans = []
    for case, level in IDS:
        model_file, batch, m, schedule, stages, devices = CASES[case]
        path = tmp / f"{case}-{level}.json"
        hand_plan(str(model_file), stages=stages, devices=devices, schedule=schedule, microbatches=m, batch_size=batch,
                  data_parallel=2, optimizer="momentum", sharding=level).save(path)
        plans.append(str(path))
    run_dir, dump = tmp / "run", tmp / "params"
    run_dir.mkdir()
    run_worker(plans, 4, "--steps", str(STEPS), "--warmup", "0", "--optimizer", "momentum", "--lr", str(LR),
               "--run-dir", str(run_dir), "--dump-params", str(dump), timeout=900)
    return run_dir, dump


@pytest.mark.slow
@pytest.mark.parametrize("case,level", IDS, ids=[f"{c}-{lv}" for c, lv in IDS])
def test_sharded_steps_equal_single_process(case, level, sharded_runs):
    run_dir, dump = sharded_runs
    i = IDS.index((case, level))
    model_file, batch, m, *_ = CASES[case]
    result = json.loads((run_dir / str(i) / "result.json").read_text())
    losses = [r["losses"] for r in result["ranks"] if r["losses"] is not None]
    ref_losses, ref_state, _ = reference_steps(str(model_file), batch, STEPS, microbatches=2 * m, optimizer="momentum",
                                               lr=LR)
    mean = result["ranks"][0]["loss_reduction"] == "mean"
    per_step = [sum(x) / len(x) if mean else sum(x) for x in zip(*losses, strict=True)]
    torch.testing.assert_close(torch.tensor(per_step), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    dumped = load_dumped(dump / str(i))
    moved = 0.0
    for fqn, copies in dumped.items():
        if "running_" in fqn or "num_batches" in fqn:
            continue  # BatchNorm statistics are per replica (not synchronized, like DDP without broadcast_buffers)
        for t in copies:  # every replica's copy, and every copy of a tied weight
            torch.testing.assert_close(t, ref_state[fqn], rtol=1e-4, atol=1e-6, msg=lambda s, fqn=fqn: f"{fqn}: {s}")
        moved = max(moved, float((copies[0] - reference_steps(str(model_file), batch, 0)[1][fqn]).abs().max()))
    assert moved > 1e-5  # the run really trained


def _records(run_dir, case, level):
    result = json.loads((run_dir / str(IDS.index((case, level))) / "result.json").read_text())
    return {(rank["rank"], st["index"]): st for rank in result["ranks"] for st in rank["stages"]}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES) - {"frozen"}))
def test_each_level_holds_its_shards(case, sharded_runs):
    """Measured on every rank and stage: ZeRO-1 keeps half the momentum buffers (2 replicas); ZeRO-2 also
    about half the gradients, ZeRO-3 also about half the weights (tied weights and buffers stay whole)."""
    run_dir, _ = sharded_runs
    z1, z2, z3 = (_records(run_dir, case, level) for level in LEVELS)
    for key, st in z1.items():
        assert 0.4 * st["grad_bytes"] < st["optimizer_bytes"] < 0.6 * st["grad_bytes"]  # 4 B/param unsharded
        assert z2[key]["grad_bytes"] < 0.75 * st["grad_bytes"]
        assert z2[key]["weights_bytes"] == st["weights_bytes"]
        assert z3[key]["weights_bytes"] < 0.75 * st["weights_bytes"]


@pytest.mark.slow
def test_frozen_weights_stay_whole_and_hold_no_state(sharded_runs):
    """The frozen backbone's stage (stage 0 of 2: frozen parameters only) keeps its whole weights and no gradient
    or optimizer state at every level, as costmodels/memory.py `model_state_bytes` charges it; the trainable
    stage's state is sharded as any other's."""
    run_dir, _ = sharded_runs
    plan = load_plan(run_dir.parent / "frozen-zero1.json")
    model = load_model_file(str(CASES["frozen"][0])).build()

    def held(stage: int, trains: bool) -> int:
        return sum(p.numel() * p.element_size() for name in plan.stages[stage].layers
                   for p in model.get_submodule(name).parameters(recurse=False) if p.requires_grad == trains)

    assert held(0, True) == 0 < held(0, False) and held(1, True) > 0 < held(1, False)
    z1, z2, z3 = (_records(run_dir, "frozen", level) for level in LEVELS)
    assert sorted(z1) == sorted(z2) == sorted(z3) and len(z1) == 4  # 2 replicas x 2 stages
    for key, st in z1.items():
        frozen, trainable = held(key[1], False), held(key[1], True)
        assert st["weights_bytes"] == z2[key]["weights_bytes"] == frozen + trainable
        assert z3[key]["weights_bytes"] == frozen + trainable // 2  # frozen weights whole, the rest halved
        assert st["grad_bytes"] == trainable and st["optimizer_bytes"] == trainable // 2  # momentum: 4 B, halved
        assert z2[key]["grad_bytes"] == z3[key]["grad_bytes"] == trainable // 2
