"""pipeplan: plan, predict and run pipeline-parallel training of PyTorch models.

Trace a model into a layer graph, describe the target with a hardware profile,
ask for a plan, and read what it predicts::

    >>> import pipeplan
    >>> graph = pipeplan.trace("examples/mlp.py", batch_size=8)   # layers, FLOPs, bytes, measured times
    >>> profile = pipeplan.load_profile("a100-80gb-sxm")          # or a calibrated local.yaml
    >>> request = pipeplan.PlanRequest(devices=8, batch_size=256, dtype="auto")
    >>> best = pipeplan.search(graph, profile, request).best      # the fastest plan that fits
    >>> best.predicted.fits and best.devices <= 8
    True
    >>> split = [s.index for s in best.stages for _ in s.layers]  # every layer's stage
    >>> again = pipeplan.evaluate(graph, profile, split, schedule=best.schedule, microbatches=best.microbatches,
    ...                           batch_size=256, data_parallel=best.data_parallel, chunks=best.chunks,
    ...                           recompute=best.recompute, layout=best.solver["layout"], dtype=best.dtype,
    ...                           sharding=best.sharding)
    >>> again.predicted.samples_per_s == best.predicted.samples_per_s   # one prediction path for every split
    True
    >>> # the event simulator alone: 2 stages, 4 microbatches, 1 s forward, 2 s backward: (M + K - 1) x 3 s
    >>> pipeplan.simulate("1f1b", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 4).iteration_s
    15.0

`best.save("plan.json")` writes the plan that `pipeplan run plan.json` trains.

Kept import-light on purpose: `pipeplan.errors` and the vocabulary modules
(`schedules`, `choices`, `units`) are imported by the lowest layers
(hardware_profiles), so this module must not import them back; the names below
load their module on first use (PEP 562).
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

__version__ = "0.1.0"

# In a source checkout the subpackages (planner/, cli/, ...) sit beside this folder, not in it; setuptools'
# package-dir mapping only applies to installed copies. When Python imports this folder straight from a
# checkout (the checkout is the working directory of `python -m ...` or of a torchrun worker), let the
# subpackages resolve there too, so the source tree never shadows the install with a half package.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isdir(_os.path.join(_checkout, "planner")):
    __path__.append(_checkout)

# public name -> the module that defines it
_API = {
    "trace": "pipeplan.costmodels.trace",
    "Graph": "pipeplan.costmodels.graph",
    "load_graph": "pipeplan.costmodels.graph",
    "HardwareProfile": "pipeplan.hardware_profiles",
    "load_profile": "pipeplan.hardware_profiles",
    "list_profiles": "pipeplan.hardware_profiles",
    "PlanRequest": "pipeplan.planner.request",
    "search": "pipeplan.planner.search",
    "SearchResult": "pipeplan.planner.search",
    "predict": "pipeplan.planner.predict",
    "evaluate": "pipeplan.planner.predict",
    "simulate": "pipeplan.planner.simulate",
    "Plan": "pipeplan.planner.plan",
    "load_plan": "pipeplan.planner.plan",
    "UserError": "pipeplan.errors",
    "InfeasibleError": "pipeplan.errors",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'pipeplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
