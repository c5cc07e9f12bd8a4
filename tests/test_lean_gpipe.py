"""The runtime's GPipe and 1F1B loops (pipeplan/lean_gpipe.py): what they free, that the step stays exact, and that
the memory model prices what they hold.

- `deallocate_outputs` frees a sent output's data only where nothing else reads it: the gradients after freeing equal
  those of the same graph left alone (autograd computes both; a freed tensor that a backward still read would
  change them).
- `receive_buffers` / `kept_outputs` for "gpipe" and "1f1b", against the counts the loops hold (written out here).
- A 3-stage GPipe run of the U-Net whose skip tensors pass through the middle stage equals single-process training,
  and each stage's measured peak is within 20% of the plan's prediction (benchmarks/memory_bench.py measures more).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pipeplan.costmodels.memory import kept_outputs, receive_buffers
from pipeplan.lean_gpipe import deallocate_outputs
from runtime_helpers import REPO, hand_plan, reference_steps, run_cli, run_cli_here


def _graph(seed: int = 0):
    """(x, w, outputs): a stage whose outputs are a linear layer's reshaped product (a view of a base only it holds),
    a product another op of the stage saved as its input (`h`, read by `h * w2`), a tensor nothing saved, and the
    stage's input passed through (a leaf)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, generator=g, requires_grad=True)
    proj = (x.reshape(-1, 8) @ w).view(4, 6, 16)  # a view of mm's output
    h = torch.tanh(proj) * 2.0  # read by the next op, which saves it as its input
    scaled = h * w2
    summed = x + 1.0  # add saves nothing
    return (x, w, w2), (proj, h, scaled, summed, x)


def _grads(leaves, outputs, grads):
    torch.autograd.backward([o for o in outputs if o.grad_fn is not None],
                            [g for o, g in zip(outputs, grads, strict=True) if o.grad_fn is not None])
    return [t.grad.clone() for t in leaves]


def test_freed_outputs_leave_the_gradients_as_they_were():
    leaves, outputs = _graph()
    grads = [torch.randn_like(o) for o in outputs]
    reference = _grads(leaves, outputs, grads)

    leaves, outputs = _graph()
    ptrs = [o.untyped_storage().data_ptr() for o in outputs]
    stage = SimpleNamespace(is_last=False, fwd_cache={0: (outputs, [])})
    deallocate_outputs(stage, 0)
    freed = [o.untyped_storage().data_ptr() != p for o, p in zip(outputs, ptrs, strict=True)]
    # proj (a view whose base only it holds), scaled and summed are freed; h (saved by `h * w2`) and the
    # passed-through input are not
    assert freed == [True, False, True, True, False]
    assert all(o.untyped_storage().nbytes() <= o.element_size() for o, f in zip(outputs, freed, strict=True) if f)
    assert outputs[0]._base.untyped_storage().nbytes() <= 4  # the base went with its view
    for got, want in zip(_grads(leaves, outputs, grads), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_outputs_held_elsewhere_are_kept():
    """A tensor the caller (or anything else in Python) still holds is not the stage's to free."""
    _, outputs = _graph()
    held = outputs[2]
    ptr = held.untyped_storage().data_ptr()
    deallocate_outputs(SimpleNamespace(is_last=False, fwd_cache={0: (outputs, [])}), 0)
    assert held.untyped_storage().data_ptr() == ptr
    _, outputs = _graph()  # the last stage keeps its output for the loss
    ptrs = [o.untyped_storage().data_ptr() for o in outputs]
    deallocate_outputs(SimpleNamespace(is_last=True, fwd_cache={0: (outputs, [])}), 0)
    assert [o.untyped_storage().data_ptr() for o in outputs] == ptrs


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_lazy_buffers_are_the_loops(stages, schedule):
    """Per stage (input buffers, gradient buffers): the first stage its microbatch once; a later one every input
    it keeps until its backward (M under GPipe, K - s under 1F1B), which recomputation already counts as its
    checkpoints' inputs; one gradient buffer except on the last stage. GPipe keeps no output past its send; 1F1B
    (torch's loop) keeps each in fwd_cache until its backward. Torch's other loops: M buffers each way."""
    M = 8
    for s in range(stages):
        last = s == stages - 1
        inflight = M if schedule == "gpipe" else stages - s
        for recompute in (False, True):
            # 1F1B: the gradient it sent last, still in torch's send list through the next backward
            ins = 1 if s == 0 else (0 if recompute else inflight) + (schedule == "1f1b")
            assert receive_buffers(schedule, stages, s, M, 1, inflight, recompute) == (ins, 0 if last else 1)
    assert kept_outputs(schedule, 3) == (0 if schedule == "gpipe" else 3)
    assert receive_buffers("zb-h1", 4, 1, M, 1, 4) == (M, M)


def test_the_runtimes_loops_are_the_ones_the_facts_name():
    """The runtime's lean classes (LEAN_CLASSES, with `LeanGPipe` the one freeing sent outputs) are exactly the
    schedules whose facts the memory model reads as lean (`receives_per_microbatch`, `frees_sent_outputs`)."""
    from torch.distributed import pipelining

    from pipeplan.lean_gpipe import LEAN_CLASSES, LeanGPipe
    from pipeplan.schedules import SCHEDULES

    for name, f in SCHEDULES.items():
        cls = getattr(pipelining, f.torch_class) if f.torch_class else None
        assert f.receives_per_microbatch == (cls in LEAN_CLASSES), name
        assert f.frees_sent_outputs == (LEAN_CLASSES.get(cls) is LeanGPipe), name


@pytest.mark.slow
def test_three_stage_gpipe_equals_single_process(tmp_path):
    """The U-Net's skip tensors pass through the middle stage (outputs that are its inputs, and outputs its next
    convolution saves): a step frees none of those and equals single-process training."""
    model_file, batch, m = REPO / "tests" / "runtime_model_unet.py", 8, 4
    plan = hand_plan(str(model_file), stages=3, devices=3, schedule="gpipe", microbatches=m, batch_size=batch)
    plan.save(tmp_path / "plan.json")
    r = run_cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "0", "--optimizer", "sgd",
                "--lr", "0.01", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ref_losses, _, _ = reference_steps(str(model_file), batch, 2, microbatches=m)
    torch.testing.assert_close(torch.tensor(json.loads(r.stdout)["losses"]), torch.tensor(ref_losses),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stage_plans_hold_what_they_predict(tmp_path, schedule):
    """`analyze` plans ResNet on 3 stages; each rank's measured peak (runtime/measure.py) is within 20% of the
    plan's prediction (benchmarks/RESULTS.md, "Peak memory": GPipe +1.6%, +10.5%, +11.7%; 1F1B +1.3%, +9.3%,
    +4.0%). Torch's own loops held M receive buffers each way, and GPipe every output besides."""
    plan_path = tmp_path / "plan.json"
    r = run_cli_here("analyze", str(REPO / "examples" / "resnet.py"), "--profile", "a100-80gb-sxm", "--gpus", "3",
                     "--dtype", "fp32", "--recompute", "off", "--optimizer", "adam", "-b", "64", "-k", "3",
                     "--schedule", schedule, "-m", "4", "-o", str(plan_path))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("run", str(plan_path), "--steps", "3", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    predicted = {s["index"]: s["predicted"]["memory_bytes"] for s in json.loads(plan_path.read_text())["stages"]}
    for st in doc["measured"]["stages"]:
        assert 0.8 <= st["device_peak_bytes"] / predicted[st["index"]] <= 1.2, (st["index"], st["device_peak_bytes"],
                                                                              predicted[st["index"]])
