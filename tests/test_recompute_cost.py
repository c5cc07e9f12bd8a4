"""Recomputation's re-run is priced up to the last tensor a region saves (costmodels/recompute.py), as torch's
non-reentrant checkpoint with early stop runs it (runtime/recompute.py)."""

from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pipeplan.costmodels.graph import Layer
from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.recompute import cold_read_s, rerun_forward_s, rerun_shares
from pipeplan.costmodels.trace import trace
from pipeplan.planner.predict import evaluate

HERE = Path(__file__).resolve().parent
MODEL = HERE / "recompute_model_tail.py"


@pytest.fixture(scope="module")
def graph():
    """The tail model traced once for the module (timed: the save points come from the timing pass)."""
    return trace(str(MODEL), 8, repeats=2, fvcore_check=False)


def layer(name, fwd_s, last_save_s, saves):
    return Layer(name=name, fwd_s=fwd_s, last_save_s=last_save_s, saved_tensors=saves)


def test_the_walk_back_from_the_region_end():
    a = layer("a", 2.0, 1.9, 1)  # saves its output: runs (almost) whole
    b = layer("b", 4.0, 0.1, 2)  # saves its inputs before computing: a Linear
    c = layer("c", 1.0, 0.0, 0)  # saves nothing
    device = [20.0, 40.0, 10.0]  # the device's times (the share of the traced time applies to them)
    assert rerun_forward_s([a, b, c], device) == pytest.approx(20.0 + 40.0 * 0.1 / 4.0)
    assert rerun_forward_s([a, c], device[::2]) == pytest.approx(20.0 * 1.9 / 2.0)
    assert rerun_forward_s([c, c], [10.0, 10.0]) == 0.0
    untimed = Layer(name="u", fwd_s=3.0)  # no save points: the whole forward up to it, as before
    assert rerun_forward_s([a, untimed, c], [20.0, 30.0, 10.0]) == pytest.approx(50.0)


def test_the_walk_gives_each_layer_the_share_of_it_a_rerun_runs():
    a, b, c = layer("a", 2.0, 1.9, 1), layer("b", 4.0, 0.1, 2), layer("c", 1.0, 0.0, 0)
    assert rerun_shares([a, b, c]) == pytest.approx([1.0, 0.1 / 4.0, 0.0])
    assert rerun_shares([c, c]) == [0.0, 0.0]
    assert rerun_shares([a, Layer(name="u", fwd_s=3.0), c]) == [1.0, 1.0, 0.0]


def _local(profile_name="a100-80gb", **fields):
    import dataclasses

    from pipeplan.hardware_profiles import load_profile

    base = load_profile(profile_name)
    return dataclasses.replace(base, local=True, calibration={"device_type": "cpu"}, mem_bw_bytes_per_s=40e9,
                               **fields)


def test_a_cold_read_is_priced_as_a_copy_of_the_bytes_on_a_cpu_and_free_on_a_gpu():
    """2n bytes at the copy rate (read + write bytes a second): 4 MiB at 40 GB/s is 210 µs, the ~200 µs a 4 MiB
    ReLU took with its input evicted beyond the same ReLU with it in cache (costmodels/recompute.cold_read_s)."""
    import dataclasses

    from pipeplan.hardware_profiles import load_profile

    assert cold_read_s(4 << 20, _local()) == pytest.approx(2 * (4 << 20) / 40e9)
    assert cold_read_s(4 << 20, load_profile("a100-80gb")) == 0.0
    cuda = dataclasses.replace(_local(), calibration={"device_type": "cuda"})
    assert cold_read_s(4 << 20, cuda) == 0.0


def test_each_region_rerun_pays_for_reading_the_inputs_it_runs_on():
    """rerun_times by hand on three layers (a saves its output, b a Linear's inputs, c nothing; a skip from a to c):
    per layer as its own block, a re-reads the model input and b its input from a, each by the share of it that
    runs, c nothing (it does not run); one checkpoint around all three reads only the model input."""
    from pipeplan.planner.predict_inputs import rerun_times
    from pipeplan.planner.problem import Problem

    mib = 1 << 20
    a, b, c = layer("a", 2.0, 1.9, 1), layer("b", 4.0, 0.1, 2), layer("c", 1.0, 0.0, 0)
    problem = Problem(names=("a", "b", "c"), fwd_s=(2e-3, 4e-3, 1e-3), bwd_s=(4e-3, 8e-3, 2e-3),
                      param_bytes=(0, 0, 0), saved_bytes=(0, 0, 0), output_bytes=(4 * mib, 4 * mib, 4 * mib),
                      cut_bytes=(8 * mib, 8 * mib), input_bytes=4 * mib,
                      edges=((0, 1, 4 * mib), (1, 2, 4 * mib), (0, 2, 4 * mib)), block_of=(0, 1, 2),
                      passed_bytes=(4 * mib, 4 * mib, 0))
    profile = _local(recompute_overhead_s=0.0, recompute_tensor_s=0.0)
    copy = 2 / 40e9  # seconds a byte read cold
    slow, slow_memory = 1.1, 1.3
    per_block = rerun_times(problem, profile, [0, 0, 0], [[a, b, c]], slow, blocks=True, slow_memory=slow_memory)
    shares = [1.9 / 2.0, 0.1 / 4.0, 0.0]  # each its own region: a stops at its own save, b at its inputs'
    expect = (slow * sum(sh * f for sh, f in zip(shares, problem.fwd_s, strict=True))
              + slow_memory * copy * (shares[0] * 4 * mib + shares[1] * 4 * mib))
    assert per_block == pytest.approx([expect])
    whole = rerun_times(problem, profile, [0, 0, 0], [[a, b, c]], slow, slow_memory=slow_memory)
    # one region: a runs whole (b saves after it), only the model input comes from outside
    assert whole == pytest.approx([slow * (2e-3 + shares[1] * 4e-3) + slow_memory * copy * 4 * mib])


def _rerun_progress(stage: torch.nn.Sequential) -> tuple[set[int], set[int]]:
    """Which of the stage's modules the checkpoint's re-run started and finished (torch itself, no pricing)."""
    started, finished, in_backward = set(), set(), [False]
    for i, m in enumerate(stage):
        m.register_forward_pre_hook(lambda mod, args, i=i: started.add(i) if in_backward[0] else None)
        m.register_forward_hook(lambda mod, args, out, i=i: finished.add(i) if in_backward[0] else None)
    spec = load_model_file(str(MODEL))
    x = spec.example_inputs(8)[0]
    out = checkpoint(stage, x, use_reentrant=False)
    in_backward[0] = True
    out.sum().backward()
    return started, finished


def test_traced_save_points_say_where_torchs_rerun_stops(graph):
    """For every prefix of the model as one checkpointed region, the re-run starts the layers up to the last one
    that saves (by the trace's counts) and finishes every layer before it, as the pricing assumes."""
    saves = [x.saved_tensors for x in graph.layers]
    assert saves == [1, 1, 2, 0, 1, 0, 2, 0]  # Linear(16,32)'s input needs no gradient: one save
    model = load_model_file(str(MODEL)).build()
    for k in range(1, len(model) + 1):
        last = max(i for i in range(k) if saves[i] > 0)
        started, finished = _rerun_progress(torch.nn.Sequential(*list(model)[:k]))
        assert started == set(range(last + 1)), k
        assert finished == set(range(last)), k
    shares = {x.name: x.last_save_s / x.fwd_s for x in graph.layers if x.fwd_s > 0 and x.saved_tensors}
    assert shares["4"] > 0.5  # a ReLU saves its output: the re-run computes it


def test_a_recompute_plan_charges_the_rerun_up_to_the_last_save(graph):
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.problem import build_problem

    profile = load_profile("a100-80gb")
    plan = evaluate(graph, profile, [0, 0, 0, 0, 1, 1, 1, 1], schedule="1f1b", microbatches=2, batch_size=16,
                    recompute=True, times="measured")
    fwd = build_problem(graph, profile, microbatch_size=8, times="measured").fwd_s
    rerun = [p.compute_s - p.fwd_s - p.bwd_s for p in (st.predicted for st in plan.stages)]
    # stage 0 ends in a scale (saves nothing) after a Linear: the re-run stops inside that Linear; stage 1 ends
    # likewise after the last Linear
    lin0, lin1 = graph.layers[2], graph.layers[6]
    assert rerun[0] == pytest.approx(sum(fwd[:2]) + fwd[2] * lin0.last_save_s / lin0.fwd_s)
    assert rerun[1] == pytest.approx(sum(fwd[4:6]) + fwd[6] * lin1.last_save_s / lin1.fwd_s)
    assert rerun[0] < sum(fwd[:4]) and rerun[1] < sum(fwd[4:])


@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("pipedream", 1)])
def test_show_resimulates_a_recompute_plan_to_its_prediction(graph, schedule, chunks):
    """`show` rebuilds the timeline from the stored stage predictions (`recompute_s` and, under zero bubble,
    `wgrad_recompute_s`): it must give the plan's own iteration time."""
    from pipeplan.hardware_profiles import load_profile
    from pipeplan.planner.replay import simulate_from_plan

    per = 8 // (2 * chunks)
    plan = evaluate(graph, load_profile("a100-80gb"), [s for s in range(2 * chunks) for _ in range(per)],
                    schedule=schedule, microbatches=4, batch_size=32, chunks=chunks, recompute=True,
                    times="measured")
    assert simulate_from_plan(plan).iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)


def test_checkpoint_overhead_fit_and_pricing(monkeypatch):
    """calibrate's line through (saved tensors, extra time) gives back the line its points came from, and the
    planner adds per region + per saved tensor to a stage's re-run (counted from the trace)."""
    from pipeplan.costmodels.recompute import checkpoint_overhead_s as price
    from pipeplan.hardware_profiles import recompute_overhead

    region_s, tensor_s = 3e-4, 2.5e-5
    monkeypatch.setattr(recompute_overhead, "_extra_s", lambda pairs: (region_s + tensor_s * 3 * pairs, 3 * pairs))
    assert recompute_overhead.checkpoint_overhead_s() == pytest.approx((region_s, tensor_s))
    layers = [layer("a", 1.0, 0.5, 3), layer("b", 1.0, 0.1, 2), Layer(name="untimed", fwd_s=1.0)]
    assert price(layers, region_s, tensor_s) == pytest.approx(region_s + 5 * tensor_s)
    assert price([], region_s, tensor_s) == 0.0


def test_a_local_profiles_checkpoint_time_is_in_the_plan(graph):
    import dataclasses

    from pipeplan.hardware_profiles import load_profile

    base = load_profile("a100-80gb")
    costly = dataclasses.replace(base, recompute_overhead_s=1e-3, recompute_tensor_s=1e-4)
    kw = dict(schedule="1f1b", microbatches=2, batch_size=16, recompute=True, times="measured")
    split = [0, 0, 0, 0, 1, 1, 1, 1]
    a, b = evaluate(graph, base, split, **kw), evaluate(graph, costly, split, **kw)
    saves = [sum(x.saved_tensors for x in graph.layers[:4]), sum(x.saved_tensors for x in graph.layers[4:])]
    for s in range(2):
        assert b.stages[s].predicted.compute_s - a.stages[s].predicted.compute_s == pytest.approx(
            1e-3 + 1e-4 * saves[s])


def _torch_reruns_of_a_split_backward(stage: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(forward re-runs in B, in W) of `stage` recomputed as the runtime does, through torch's own split backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipeplan.runtime.recompute import recompute

    calls = [0]  # the first child's calls: the checkpoint re-runs the stage's forward, not its hooks
    next(stage.children()).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out = recompute(stage)(x)
    calls[0] = 0
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
    in_b = calls[0]
    stage_backward_weight(stage.parameters(), groups)
    return in_b, calls[0] - in_b


def test_zero_bubbles_w_reruns_the_forward_once_per_module_with_parameters():
    """torch's W calls autograd.grad once per parameter group, and each call re-runs the checkpointed forward; the
    count from the trace (weight_grad_passes) must be what torch does on the real modules: two GPT blocks of
    examples/gpt.py (LayerNorm, attention's two Linears, LayerNorm, the MLP's two Linears, each)."""
    from pipeplan.costmodels.recompute import weight_grad_passes
    from pipeplan.costmodels.trace import export_structure

    spec = load_model_file(str(HERE.parent / "examples" / "gpt.py"))
    _, traced = export_structure(spec, 2)
    blocks = [x for x in traced.layers if x.module.startswith(("h.0.", "h.1."))]
    model = spec.build()
    stage = torch.nn.Sequential(model.h[0], model.h[1])
    x = torch.randn(2, 16, model.h[0].ln_1.normalized_shape[0], requires_grad=True)
    in_b, in_w = _torch_reruns_of_a_split_backward(stage, x)
    assert (in_b, in_w) == (1, weight_grad_passes(blocks)) and in_w == 12


@pytest.mark.parametrize("schedule, chunks", [("zb-h1", 1), ("zb-v", 2)])
def test_a_zero_bubble_recompute_plan_charges_a_rerun_per_parameter_group(graph, schedule, chunks):
    """Each stage's W re-runs the forward once per module with parameters (Linears here), the first stage's once
    (its W is one whole backward) and its B never; compute_s holds every re-run."""
    from pipeplan.hardware_profiles import load_profile

    split = [0, 0, 1, 1, 1, 1, 1, 1] if chunks == 1 else [0, 0, 1, 1, 2, 2, 3, 3]
    plan = evaluate(graph, load_profile("a100-80gb"), split, schedule=schedule, microbatches=4, batch_size=32,
                    chunks=chunks, recompute=True, times="measured")
    linears = [sum(1 for i, s in enumerate(split) if s == k and graph.layers[i].params) for k in range(2 * chunks)]
    assert linears == ([1, 2] if chunks == 1 else [1, 1, 0, 1])  # zb-v's stage 2: a ReLU and a scale
    for k, st in enumerate(plan.stages):
        p = st.predicted
        assert p.recompute_s > 0
        assert p.wgrad_recompute_s == pytest.approx(p.recompute_s if k == 0 else linears[k] * p.recompute_s)
        rerun_b = 0.0 if k == 0 else p.recompute_s
        assert p.compute_s == pytest.approx(p.fwd_s + p.bwd_s + rerun_b + p.wgrad_recompute_s)
