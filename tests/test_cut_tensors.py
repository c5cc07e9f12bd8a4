"""The tensors a pipeline cut carries: counted from the graph's edges as the runtime sends them (runtime/split.py's
live-in sets, one message each), and charged per tensor beyond one in every op's messages."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.predict import evaluate
from pipeplan.planner.predict_inputs import boundary_tensors
from pipeplan.runtime.split import split_program
from test_op_overhead import BASE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _exported(name: str):
    spec = load_model_file(str(EXAMPLES / f"{name}.py"), "build_model", seq_len=None)
    torch.manual_seed(0)
    ep, graph = export_structure(spec, 2, depth=None, model=spec.build())
    return ep.module(), graph


def _assignment(n: int, cuts: list[int]) -> list[int]:
    """Stage of each of n layers, a new stage starting at each index in `cuts`."""
    return [sum(1 for c in cuts if i >= c) for i in range(n)]


@pytest.mark.parametrize("name", ["unet", "resnet", "gpt"])
def test_each_cut_carries_the_tensors_the_runtime_sends_across_it(name):
    """At random contiguous splits into 2-4 stages, the count per boundary is the number of values the runtime's
    stage sends on (StageInfo.outputs): the skip tensors a cut's stages forward included."""
    gm, graph = _exported(name)
    names = [layer.name for layer in graph.layers]
    layer_nodes = {layer.name: layer.nodes for layer in graph.layers}
    rng = random.Random(7)
    seen = set()
    for _ in range(12):
        stages = rng.choice([2, 3, 4])
        assignment = _assignment(len(names), sorted(rng.sample(range(1, len(names)), stages - 1)))
        split = split_program(gm, layer_nodes, dict(zip(names, assignment, strict=True)), stages)
        want = [len(info.outputs) for info in split.infos[:-1]]
        assert boundary_tensors(graph, names, assignment, stages) == [*want, 0]
        seen.update(want)
    assert max(seen) > 1  # the examples' skips: some cut carries several tensors


BOX = BASE + "op_overhead_us: {1f1b: 200}\n"  # a local-like profile: the runtime's 200 µs an op


def test_a_stage_is_charged_for_each_extra_tensor_its_messages_carry(tmp_path):
    """examples/unet.py cut after its second pooling (the two skip tensors of the levels above and the pooled map:
    3 tensors) and after its second up-sampling (the top level's skip and the concatenation: 2). Stage 0 sends 2
    tensors beyond one, stage 1 receives 2 and sends 1 more, stage 2 receives 1 more: at 100 µs a tensor, those
    are the differences in each stage's runtime overhead per op, and nothing else moves but the iteration."""
    _, graph = _exported("unet")
    names = [layer.name for layer in graph.layers]
    cuts = [names.index("down.2.conv1"), names.index("dec.1.conv1")]
    assert names[cuts[0] - 1] == "pool:2" and names[cuts[1] - 1] == "up.1"
    assignment = _assignment(len(names), cuts)
    assert boundary_tensors(graph, names, assignment, 3) == [3, 2, 0]
    plans = []
    for extra in ("", "op_overhead_us_per_tensor: {1f1b: 100}\n"):
        (tmp_path / "box.yaml").write_text(BOX + extra)
        plans.append(evaluate(graph, load_profile(str(tmp_path / "box.yaml")), assignment, schedule="1f1b",
                              microbatches=4, batch_size=8))
    base, with_tensors = plans
    assert [s.predicted.op_overhead_s for s in base.stages] == pytest.approx([2e-4] * 3)
    moved = [b.predicted.op_overhead_s - a.predicted.op_overhead_s
             for a, b in zip(base.stages, with_tensors.stages, strict=True)]
    assert moved == pytest.approx([2e-4, 3e-4, 1e-4])
    assert [s.predicted.compute_s for s in with_tensors.stages] == [s.predicted.compute_s for s in base.stages]
    assert with_tensors.predicted.iteration_s > base.predicted.iteration_s
