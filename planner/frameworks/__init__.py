"""Hand a plan to the frameworks people train with, and read their splits back (issue 18).

`export_plan(plan, "torchtitan" | "megatron" | "deepspeed")` returns the
framework's settings (`common.Export`) or raises `Inexpressible` saying why;
`nearest.nearest_plan` re-predicts the closest plan the framework can run;
`split.parse_split` / `split.split_from_source` read a user's or a framework's
split, and `judge.judge_split` predicts it beside the best plan.
Pure functions: the CLI (`cli/export_cmd.py`, `--split`) renders them.
"""

from __future__ import annotations

from pipeplan.planner.frameworks import deepspeed, megatron, torchtitan
from pipeplan.planner.frameworks.common import Export
from pipeplan.planner.frameworks.names import Inexpressible
from pipeplan.planner.plan import Plan

__all__ = ["FRAMEWORKS", "Export", "Inexpressible", "export_plan"]

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")


def export_plan(plan: Plan, framework: str) -> Export:
    """The plan in `framework`'s terms; Inexpressible when the framework cannot run it as planned."""
    exporters = {"torchtitan": torchtitan.export, "megatron": megatron.export, "deepspeed": deepspeed.export}
    if framework not in exporters:
        raise ValueError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")
    return exporters[framework](plan)
