"""Done-when of issue 6: a pipelined step (real torchrun, 2 ranks) equals a single-process step.

Every example (and two test models: U-Net skips across stages with BatchNorm, a tied
GPT without loss_fn), each schedule. Two steps each, so the second step checks that
the first update (incl. tied weights) was applied identically. Cost: one torchrun
per case (~5-10 s on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime_helpers import EXAMPLES, REPO, hand_plan, load_dumped, reference_steps, run_cli, run_worker

TESTS = REPO / "tests"
CASES = {  # name -> (model file, batch size, microbatches)
    "mlp": (EXAMPLES / "mlp.py", 8, 4),
    "gpt": (EXAMPLES / "gpt.py", 4, 4),
    "unet": (EXAMPLES / "unet.py", 4, 4),
    "resnet": (EXAMPLES / "resnet.py", 4, 4),
    "hf_gpt2": (TESTS / "runtime_model_hf_gpt2.py", 4, 4),  # the example with dropout off
    "t-unet": (TESTS / "runtime_model_unet.py", 8, 4),
    "t-gpt-tied": (TESTS / "runtime_model_gpt.py", 8, 4),
    "frozen": (TESTS / "data" / "frozen_backbone.py", 8, 4),  # a frozen backbone: the first stage trains nothing
    "t-checkpointed": (TESTS / "data" / "checkpointed.py", 8, 4),  # its own reentrant torch.utils.checkpoint calls
    "t-shared-input": (TESTS / "data" / "shared_input.py", 8, 4),  # an input every microbatch gets whole
}
SCHEDULES = {"gpipe": (2, 2), "1f1b": (2, 2), "interleaved": (4, 2)}  # schedule -> (stages, devices)
STEPS = 2


CASE_IDS = [(c, s) for c in sorted(CASES) for s in sorted(SCHEDULES)]


def _available(case: str) -> bool:
    if case == "hf_gpt2":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return False
        return (EXAMPLES / "hf_gpt2.py").exists()
    return CASES[case][0].exists()


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """All cases in ONE torchrun (the worker runs several plans in turn): start-up paid once."""
    tmp = tmp_path_factory.mktemp("equivalence")
    plans, index = [], {}
    for case, schedule in CASE_IDS:
        if not _available(case):
            continue
        model_file, batch, m = CASES[case]
        stages, devices = SCHEDULES[schedule]
        path = tmp / f"{case}-{schedule}.json"
        hand_plan(str(model_file), stages=stages, devices=devices, schedule=schedule, microbatches=m, batch_size=batch).save(path)
        index[(case, schedule)] = len(plans)
        plans.append(str(path))
    run_dir, dump = tmp / "run", tmp / "params"
    run_dir.mkdir()
    run_worker(plans, 2, "--steps", str(STEPS), "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01",
               "--run-dir", str(run_dir), "--dump-params", str(dump))
    return index, run_dir, dump


@pytest.mark.slow
@pytest.mark.parametrize("case,schedule", CASE_IDS, ids=[f"{c}-{s}" for c, s in CASE_IDS])
def test_pipelined_steps_equal_single_process(case, schedule, pipelined):
    if not _available(case):
        pytest.skip(f"{case}: model file or transformers missing")
    index, run_dir, dump = pipelined
    i = index[(case, schedule)]
    model_file, batch, m = CASES[case]
    result = json.loads((run_dir / str(i) / "result.json").read_text())
    losses = next(r["losses"] for r in result["ranks"] if r["losses"] is not None)

    ref_losses, ref_state, aliases = reference_steps(str(model_file), batch, STEPS, microbatches=m)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    dumped = load_dumped(dump / str(i))
    assert len(list((dump / str(i)).glob("stage-*.pt"))) == SCHEDULES[schedule][0]  # one replica: one file per stage
    for fqn, copies in dumped.items():
        for t in copies:  # a tied weight's copies on different stages must all equal the reference
            torch.testing.assert_close(t, ref_state[fqn], rtol=1e-4, atol=1e-6, msg=lambda s, fqn=fqn: f"{fqn}: {s}")
    for names in aliases:  # every parameter of the model was trained by some stage
        assert any(n in dumped for n in names), f"no stage holds {names}"
    # the run really moved the parameters (else equal-to-reference would prove little)
    _, initial, _ = reference_steps(str(model_file), batch, 0)
    assert max(float((v[0] - initial[k]).abs().max()) for k, v in dumped.items() if v[0].is_floating_point()) > 1e-5


def test_cli_run_json_matches_reference(tmp_path):
    """The same through `pipeplan run --json` (launcher, torchrun, summary): one small case."""
    model_file, batch, m = CASES["t-gpt-tied"]
    plan = hand_plan(str(model_file), stages=2, devices=2, schedule="1f1b", microbatches=m, batch_size=batch)
    plan.profile = "h100-sxm"  # priced for a GPU, run on this machine's cores: the document says so
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01",
                "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    ref_losses, _, _ = reference_steps(str(model_file), batch, 2, microbatches=m)
    torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
    assert set(doc) >= {"measured", "predicted", "losses"}
    if not torch.cuda.is_available():
        assert len(doc["notes"]) == 1 and "predicted for h100-sxm (NVIDIA H100 SXM5 80GB)" in doc["notes"][0]


@pytest.mark.slow
def test_data_parallel_pipeline_equals_single_process(tmp_path):
    """2 stages x 2 replicas (4 processes): each replica trains on half the batch, gradients are
    averaged per stage (summed for the no-loss_fn GPT), tied weights summed within each replica."""
    plans = []
    for case, schedule in (("t-gpt-tied", "1f1b"), ("t-unet", "gpipe")):
        model_file, batch, m = CASES[case]
        path = tmp_path / f"{case}.json"
        hand_plan(str(model_file), stages=2, devices=2, schedule=schedule, microbatches=2, batch_size=batch,
                  data_parallel=2).save(path)
        plans.append((case, path))
    run_dir, dump = tmp_path / "run", tmp_path / "params"
    run_dir.mkdir()
    run_worker([p for _, p in plans], 4, "--steps", str(STEPS), "--warmup", "0", "--optimizer", "sgd", "--lr", "0.01",
               "--run-dir", str(run_dir), "--dump-params", str(dump))
    from pipeplan.planner.plan import load_plan
    from pipeplan.runtime.report import summarize

    for i, (case, path) in enumerate(plans):
        model_file, batch, _ = CASES[case]
        doc = summarize(json.loads((run_dir / str(i) / "result.json").read_text()), load_plan(path))
        # the reference: 2 replicas x 2 microbatches = 4 equal slices of the batch, accumulated
        ref_losses, ref_state, _ = reference_steps(str(model_file), batch, STEPS, microbatches=4)
        torch.testing.assert_close(torch.tensor(doc["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        assert sorted((s["index"], s["replica"]) for s in doc["measured"]["stages"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        dumped = load_dumped(dump / str(i))
        assert len(list((dump / str(i)).glob("stage-*-replica1.pt"))) == 2
        for fqn, copies in dumped.items():
            if "running_" in fqn or "num_batches" in fqn:
                continue  # BatchNorm statistics are per replica (not synchronized, like DDP without broadcast_buffers)
            assert len(copies) >= 2  # every replica's copy checked
            for t in copies:
                torch.testing.assert_close(t, ref_state[fqn], rtol=1e-4, atol=1e-6, msg=lambda s, case=case, fqn=fqn: f"{case} {fqn}: {s}")
