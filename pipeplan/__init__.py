"""pipeplan: plan, predict and run pipeline-parallel training of PyTorch models.

Kept import-light on purpose: `pipeplan.errors` and friends are imported by the
lowest layers (hardware_profiles), so this module must not import them back.
The public API lives in `pipeplan.api` and is re-exported lazily.
"""

__version__ = "0.1.0"

_API = {
    "trace": "pipeplan.costmodels.trace",
    "Graph": "pipeplan.costmodels.graph",
    "load_graph": "pipeplan.costmodels.graph",
    "load_profile": "pipeplan.hardware_profiles",
    "Plan": "pipeplan.planner.plan",
    "load_plan": "pipeplan.planner.plan",
}


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'pipeplan' has no attribute {name!r}")
