"""Zero bubble's split backward cannot run a stage that uses one module twice around another (planner/runnable.py):
torch's own functions fail on it, and the search never emits such a plan."""

import pytest
import torch
from torch import nn

from cli_fixtures import chain_graph
from pipeplan.costmodels.graph import SharedParam
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import load_profile
from pipeplan.planner.request import PlanRequest
from pipeplan.planner.runnable import split_backward_conflict
from pipeplan.planner.search import search


class Twice(nn.Module):
    """a(relu(b(a(x)))): the shared module's two uses with another module's parameters between them."""

    def __init__(self, around: bool = True):
        super().__init__()
        self.a, self.b, self.around = nn.Linear(8, 8), nn.Linear(8, 8), around

    def forward(self, x):
        return self.a(torch.relu(self.b(self.a(x)))) if self.around else self.b(self.a(self.a(x)))


@pytest.mark.parametrize("around", [True, False])
def test_torchs_split_backward_fails_on_a_module_used_around_another(around):
    """If torch ever runs the first case, planner/runnable.py's refusal can go."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    m = Twice(around)
    x = torch.randn(4, 8, requires_grad=True)
    out = m(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], m.parameters())
    if around:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            stage_backward_weight(m.parameters(), groups)
    else:  # nothing between the uses: torch runs it, and pipeplan's check refuses it too (a safe superset)
        stage_backward_weight(m.parameters(), groups)
        assert all(p.grad is not None for p in m.parameters())


def test_a_conflict_is_two_users_in_one_stage_past_the_first():
    users = [[1, 3]]
    assert split_backward_conflict(users, [0, 1, 1, 1]) == 1
    assert split_backward_conflict(users, [0, 0, 1, 1]) is None  # one use a stage
    assert split_backward_conflict(users, [0, 0, 0, 0, 1]) is None  # the first stage runs one whole backward
    assert split_backward_conflict([[0, 2], [1, 3]], [0, 1, 0, 1]) == 1


def _shared_graph(widths):
    """tiny-chain layers with layers 3 and 5 sharing one parameter (a module applied twice)."""
    graph = chain_graph(widths=widths)
    graph.layers[5].params = list(graph.layers[3].params)
    graph.shared_params = [SharedParam(name="layers.3.weight", bytes=graph.layers[3].param_bytes,
                                       layers=["layers.3", "layers.5"])]
    return graph


def _request(schedule):
    return PlanRequest(devices=2, batch_size=8, stages=2, microbatches=4, schedule=schedule, sharding="none")


def test_the_search_refuses_zero_bubble_splits_torch_cannot_run():
    """Heavy layers first: every balanced 2-stage split puts both uses in stage 1. 1F1B runs it; ZB-H1 is refused
    with a one-line reason instead of a plan that fails in `pipeplan run`."""
    graph = _shared_graph((256, 4096, 256, 256, 256, 256))
    profile = load_profile("a100-80gb")
    split = search(graph, profile, _request("1f1b")).best
    assert {"layers.3", "layers.5"} <= set(split.stages[1].layers)
    with pytest.raises(UserError, match="shared parameter"):
        search(graph, profile, _request("zb-h1"))


def test_zero_bubble_may_hold_both_uses_on_its_first_stage():
    """Heavy layers last: the balanced split keeps both uses in stage 0, whose backward runs whole."""
    graph = _shared_graph((256, 256, 256, 256, 256, 256, 4096, 4096, 256))
    plan = search(graph, load_profile("a100-80gb"), _request("zb-h1")).best
    assert {"layers.3", "layers.5"} <= set(plan.stages[0].layers)
