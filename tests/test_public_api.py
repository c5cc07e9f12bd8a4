"""The library's front door: `pipeplan.__all__` names what a user calls, and its usage example runs."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import pipeplan

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves():
    assert {"trace", "load_profile", "HardwareProfile", "PlanRequest", "search", "predict", "simulate", "Plan",
            "Graph"} <= set(pipeplan.__all__)
    for name in pipeplan.__all__:
        assert getattr(pipeplan, name) is not None, name
    with pytest.raises(AttributeError):
        pipeplan.no_such_name  # noqa: B018


def test_star_import_gives_the_public_names():
    namespace: dict[str, object] = {}
    exec("from pipeplan import *", namespace)  # noqa: S102
    assert set(pipeplan.__all__) <= set(namespace)


def test_usage_example_in_the_docstring_runs(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example traces examples/mlp.py, as a user in a checkout would
    result = doctest.testmod(importlib.import_module("pipeplan"), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0, result
