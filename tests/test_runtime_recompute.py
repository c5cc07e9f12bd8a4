"""A plan with recomputation runs with recomputation (runtime/recompute.py), and trains exactly as without it.

Every stage module's forward runs under non-reentrant checkpointing, so its backward re-runs the forward; the
cases cover a one-stage-a-rank schedule, a V schedule with split backwards and skip connections, dropout (the
re-run must draw the same masks) and asynchronous PipeDream (the re-run must use the stashed weight version).
Plans recomputed per block (`recompute_granularity: block`, runtime/recompute.recompute_blocks) run a checkpoint per
block: the same training again, with skip connections passed between a stage's blocks (what they hold: the "Peak
memory" rows of benchmarks/memory_bench.py). One torchrun for all plans, like tests/test_runtime_equivalence.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime_helpers import EXAMPLES, REPO, hand_plan, load_dumped, reference_steps, run_worker

TESTS = REPO / "tests"
STEPS = 2
# name -> (model file, batch, microbatches, stages, pipeline devices, schedule, recompute: off, per stage, per block)
PLANS = {
    "mlp-1f1b": (EXAMPLES / "mlp.py", 8, 4, 2, 2, "1f1b", True),
    "unet-zbv": (TESTS / "runtime_model_unet.py", 8, 4, 4, 2, "zb-v", True),
    "dropout-off": (TESTS / "runtime_model_dropout.py", 8, 4, 2, 2, "1f1b", False),
    "dropout-on": (TESTS / "runtime_model_dropout.py", 8, 4, 2, 2, "1f1b", True),
    "dropout-block": (TESTS / "runtime_model_dropout.py", 8, 4, 2, 2, "1f1b", "block"),
    "unet-gpipe-block": (TESTS / "runtime_model_unet.py", 8, 4, 2, 2, "gpipe", "block"),
    "gpt-1f1b-block": (TESTS / "runtime_model_gpt.py", 8, 4, 2, 2, "1f1b", "block"),
    "gpt-interleaved-block": (TESTS / "runtime_model_gpt.py", 8, 4, 4, 2, "interleaved", "block"),
    "gpt-zero3-block": (TESTS / "runtime_model_gpt.py", 8, 2, 1, 1, "1f1b", "block"),
    "gpt-pipedream-off": (TESTS / "runtime_model_gpt.py", 8, 4, 2, 2, "pipedream", False),
    "gpt-pipedream-on": (TESTS / "runtime_model_gpt.py", 8, 4, 2, 2, "pipedream", True),
}
NAMES = list(PLANS)
CUTS = {"gpt-1f1b-block": [6]}  # the stage boundary inside blocks.0: its two parts are two checkpoints
REPLICAS = {"gpt-zero3-block": {"data_parallel": 2, "sharding": "zero3"}}  # gathers around every block's re-run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recompute")
    paths = []
    for name in NAMES:
        model_file, batch, m, stages, devices, schedule, rc = PLANS[name]
        plan = hand_plan(str(model_file), stages=stages, devices=devices, schedule=schedule, microbatches=m,
                         batch_size=batch, cuts=CUTS.get(name), **REPLICAS.get(name, {}))
        plan.recompute = bool(rc)
        plan.recompute_granularity = "block" if rc == "block" else "stage"
        paths.append(tmp / f"{name}.json")
        plan.save(paths[-1])
    run_dir, dump = tmp / "run", tmp / "params"
    run_dir.mkdir()
    run_worker(paths, 2, "--steps", str(STEPS), "--warmup", "0", "--optimizer", "sgd", "--lr", "0.001",
               "--run-dir", str(run_dir), "--dump-params", str(dump))
    out = {}
    for i, name in enumerate(NAMES):
        result = json.loads((run_dir / str(i) / "result.json").read_text())
        # each replica's last stage logs its own slice's losses: a step's loss is their mean (or sum), as in
        # tests/test_runtime_sharding.py
        per_replica = [x["losses"] for x in result["ranks"] if x["losses"] is not None]
        mean = result["ranks"][0]["loss_reduction"] == "mean"
        losses = [sum(v) / len(v) if mean else sum(v) for v in zip(*per_replica, strict=True)]
        stages = [st for x in result["ranks"] for st in x["stages"]]
        out[name] = (losses, load_dumped(dump / str(i)), stages)
    return out


def _assert_same(a, b, what: str) -> None:
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=1e-5, atol=1e-7, msg=lambda s: f"{what}: {s}")
    for fqn, copies in a[1].items():
        for x, y in zip(copies, b[1][fqn], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=lambda s, fqn=fqn: f"{what} {fqn}: {s}")


@pytest.mark.parametrize("name", ["mlp-1f1b", "unet-zbv", "unet-gpipe-block", "gpt-1f1b-block",
                                  "gpt-interleaved-block", "gpt-zero3-block"])
def test_recomputed_steps_equal_single_process(name, runs):
    """The steps of one process without recomputation. Per block: the U-Net's skip connections passing between a
    stage's blocks (each of its layers a block: no numbered block list), the GPT's blocks (`blocks.N`) one checkpoint
    each and the one the stage boundary cuts two, the GPT interleaved (two chunks a rank, each cut in blocks), and
    one stage sharded ZeRO-3 over two replicas (its parameters gathered for every block's re-run)."""
    model_file, batch, m, *_ = PLANS[name]
    losses, dumped, _ = runs[name]
    slices = m * REPLICAS.get(name, {}).get("data_parallel", 1)
    ref_losses, ref_state, _ = reference_steps(str(model_file), batch, STEPS, microbatches=slices, lr=0.001)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    for fqn, copies in dumped.items():
        for t in copies:
            torch.testing.assert_close(t, ref_state[fqn], rtol=1e-4, atol=1e-6, msg=lambda s, fqn=fqn: f"{fqn}: {s}")


@pytest.mark.parametrize("model", ["dropout", "gpt-pipedream"])
def test_recomputation_changes_memory_not_training(model, runs):
    """Dropout draws its masks again in the re-run; PipeDream's re-run uses the stashed version. Either way
    the step is the one without recomputation, while the saved activations shrink to the stage inputs."""
    off, on = runs[f"{model}-off"], runs[f"{model}-on"]
    _assert_same(off, on, model)
    saved = {k: sum(st["saved_activation_bytes"] for st in runs[f"{model}-{k}"][2]) for k in ("off", "on")}
    assert saved["on"] < saved["off"] / 2, saved  # the saved-tensor hooks do not see inside a checkpoint
    if model == "dropout":  # torch's schedules: the step's log also holds the re-run's activations, and less
        peak = {k: sum(st["activation_bytes"] for st in runs[f"{model}-{k}"][2]) for k in ("off", "on")}
        assert saved["on"] < peak["on"] < peak["off"], (saved, peak)


def test_per_block_redraws_dropout(runs):
    """Dropout's masks drawn again block by block in the re-runs: the steps without recomputation."""
    _assert_same(runs["dropout-off"], runs["dropout-block"], "dropout per block")
