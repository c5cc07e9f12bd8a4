"""Stage construction: running the stage modules in sequence must equal the whole model
(outputs, loss, gradients), including skips over several stages and tied weights."""

from __future__ import annotations

import pytest
import torch

from pipeplan.runtime.split import flat_inputs, run_sequential, split_program, unflatten_output
from runtime_models import MODELS


def even_layers(gm, stages: int):
    """One layer per call_function node, cut into `stages` contiguous runs."""
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    layer_nodes = {f"l{i}": [n] for i, n in enumerate(nodes)}
    layer_stage = {f"l{i}": min(stages - 1, i * stages // len(nodes)) for i in range(len(nodes))}
    return layer_nodes, layer_stage


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_in_sequence_equal_whole_model(name, stages):
    build, inputs, target, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x, y = inputs(4), target(4)
    ep = torch.export.export(model, x, strict=False)
    gm = ep.module()
    split = split_program(gm, *even_layers(gm, stages), stages)
    mods = [split.module(s, copy=True) for s in range(stages)]

    out = unflatten_output(run_sequential(mods, flat_inputs(x, gm)), gm)
    loss = loss_fn(out, y)
    loss.backward()

    ref_out = model(*x)
    ref_loss = loss_fn(ref_out, y)
    ref_loss.backward()

    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads: dict[str, torch.Tensor] = {}
    for m in mods:
        for fqn, p in m.named_parameters():
            grads[fqn] = grads.get(fqn, 0) + p.grad  # a tied parameter's gradient is the sum over holders
    assert grads, "no parameters in the stages"
    for fqn, g in grads.items():
        torch.testing.assert_close(g, model.get_parameter(fqn).grad, rtol=1e-5, atol=1e-6)
    held = {fqn for m in mods for fqn, _ in m.named_parameters()}
    assert {id(model.get_parameter(f)) for f in held} == {id(p) for p in model.parameters()}


def test_skips_are_forwarded_through_middle_stages():
    build, inputs, _, _ = MODELS["unet"]
    torch.manual_seed(0)
    model = build()
    gm = torch.export.export(model, inputs(2), strict=False).module()
    split = split_program(gm, *even_layers(gm, 4), 4)
    # e1 (first relu) is read by the last stage: every middle stage must receive and send it
    e1 = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "relu" in n.name)
    assert split.stage_of[e1] == 0
    for s in (1, 2, 3):
        assert e1 in split.infos[s].inputs
    for s in (0, 1, 2):
        assert e1 in split.infos[s].outputs


def test_tied_weight_is_held_by_both_end_stages():
    build, inputs, _, _ = MODELS["gpt"]
    torch.manual_seed(0)
    gm = torch.export.export(build(), inputs(2), strict=False).module()
    split = split_program(gm, *even_layers(gm, 3), 3)
    shared = split.shared_attrs()
    assert len(shared) == 1
    (holders,) = shared.values()
    assert holders == [0, 2]


def test_a_dict_input_seeds_the_stages_timed_apart():
    """`analyze` times a local plan's stages on their own inputs (runtime/split_cost.stage_inputs): a model taking a
    dict gets its leaves in stage 0's placeholder order, as `pipeplan run` feeds it (it failed with "forward()
    missing 1 required positional argument"), and the next stage gets what stage 0 sends."""
    from pipeplan.runtime.split_cost import stage_inputs
    from pipeplan.runtime.worker import load_split_model
    from runtime_helpers import REPO, hand_plan

    plan = hand_plan(str(REPO / "tests" / "data" / "dict_input.py"), stages=2, devices=2, schedule="1f1b",
                     microbatches=2, batch_size=8)
    spec, gm, split = load_split_model(plan)
    first = stage_inputs(split, spec, 0, 4)
    batch = spec.example_inputs(4)[0]
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, batch.values(), strict=True))
    second = stage_inputs(split, spec, 1, 4)
    with torch.no_grad():
        sent = split.module(0, copy=True)(*first)
    sent = sent if isinstance(sent, tuple) else (sent,)
    assert len(second) == len(sent) and all(torch.equal(a, b) for a, b in zip(second, sent, strict=True))
    assert all(t.requires_grad == t.is_floating_point() for t in second)
    out = split.module(1, copy=True)(*second)
    assert unflatten_output(out if isinstance(out, tuple) else (out,), gm)["logits"].shape == (4, 2)


def test_inputs_that_do_not_carry_the_batch_go_whole_into_every_part():
    """runtime/batch_split.py: shared_input.py's positional table (T, D) does not grow with example_inputs' batch,
    so every part gets it whole and torch's schedule is told to replicate it; a dict's values are told apart alike;
    where example_inputs cannot make a batch of 1, every tensor with a first dimension is cut, as before."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    from pipeplan.runtime.batch_split import batch_leaves, chunk_spec, cut
    from pipeplan.runtime.worker import load_split_model
    from runtime_helpers import REPO, hand_plan

    plan = hand_plan(str(REPO / "tests" / "data" / "shared_input.py"), stages=2, devices=2, schedule="1f1b",
                     microbatches=2, batch_size=8)
    spec, gm, _ = load_split_model(plan)
    batch = batch_leaves(spec)
    assert batch == (True, False, False)
    x, pos, scale = spec.example_inputs(8)
    parts = cut((x, pos, scale), 4, batch)
    assert [p[0].shape[0] for p in parts] == [2, 2, 2, 2] and all(p[1] is pos and p[2] == scale for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    # the number is baked into the program by export: stage 0 neither takes it nor is fed it (torch's stages take
    # tensors only: "Stage arg[1] has type float")
    assert [type(t) for t in flat_inputs((x, pos, scale), gm)] == [torch.Tensor, torch.Tensor]
    spec_ = chunk_spec(batch, gm)
    assert len(spec_) == 2 and isinstance(spec_[0], TensorChunkSpec) and spec_[0].split_dim == 0
    assert isinstance(spec_[1], _Replicate)
    assert chunk_spec((True, True), gm) is None and chunk_spec(None, gm) is None

    plan = hand_plan(str(REPO / "tests" / "data" / "dict_input.py"), stages=2, devices=2, schedule="1f1b",
                     microbatches=2, batch_size=8)
    spec, gm, _ = load_split_model(plan)
    assert batch_leaves(spec) == (True, True)
    halves = cut(spec.example_inputs(8), 2, None)  # not known: every tensor with a first dimension is cut
    assert [h[0]["ids"].shape[0] for h in halves] == [4, 4]
