"""A model whose export numbers its ops differently from one process to the next (the order of two alike computations
follows a set's iteration order; Gemma 3) still runs its plan: the runtime's second check, Graph.op_fingerprint, is
the structure without torch.fx's name counters. A model that really changed is still refused."""

from pathlib import Path

import pytest

from pipeplan.costmodels.model_file import load_model_file
from pipeplan.costmodels.trace import export_structure
from pipeplan.errors import UserError
from pipeplan.planner.predict import graph_summary
from pipeplan.runtime.worker import load_split_model
from runtime_helpers import hand_plan

MODEL = str(Path(__file__).resolve().parent / "data" / "set_order.py")


def _graph(monkeypatch, order: str, act: str = "relu"):
    monkeypatch.setenv("PIPEPLAN_TEST_ORDER", order)
    monkeypatch.setenv("PIPEPLAN_TEST_ACT", act)
    return export_structure(load_model_file(MODEL), 2)[1]


def test_a_plan_runs_where_the_model_numbers_its_ops_in_another_order(monkeypatch):
    traced = _graph(monkeypatch, "ab")
    plan = hand_plan(MODEL, stages=2, devices=2, schedule="gpipe", microbatches=2, batch_size=4)
    summary = graph_summary(traced)
    assert summary["fingerprint"] == plan.graph["fingerprint"]
    plan.graph["op_fingerprint"] = summary["op_fingerprint"]  # what analyze writes into a plan

    other = _graph(monkeypatch, "ba")  # the same model as another process may export it
    assert other.fingerprint() != traced.fingerprint()
    assert other.op_fingerprint() == traced.op_fingerprint()
    assert [x.name for x in other.layers] == [x.name for x in traced.layers]
    _, _, split = load_split_model(plan)  # the order is "ba" now
    assert split is not None

    monkeypatch.setenv("PIPEPLAN_TEST_ACT", "gelu")  # an op changed: another model
    with pytest.raises(UserError, match="no longer matches the plan"):
        load_split_model(plan)
    monkeypatch.setenv("PIPEPLAN_TEST_ACT", "relu")
    del plan.graph["op_fingerprint"]  # a plan without it (written before it existed): the exact check alone
    with pytest.raises(UserError, match="no longer matches the plan"):
        load_split_model(plan)
