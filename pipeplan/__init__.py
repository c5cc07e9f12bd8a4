"""pipeplan: plan, predict and run pipeline-parallel training of PyTorch models.

Kept import-light on purpose: `pipeplan.errors` and friends are imported by the
lowest layers (hardware_profiles), so this module must not import them back.
The public API lives in `pipeplan.api` and is re-exported lazily.
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages (planner/, cli/, ...) sit beside this folder, not in it; setuptools'
# package-dir mapping only applies to installed copies. When Python imports this folder straight from a
# checkout (the checkout is the working directory of `python -m ...` or of a torchrun worker), let the
# subpackages resolve there too, so the source tree never shadows the install with a half package.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isdir(_os.path.join(_checkout, "planner")):
    __path__.append(_checkout)

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
