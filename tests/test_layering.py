"""The layers import only downwards: hardware_profiles <- costmodels <- planner <- runtime <- cli.

A module of a layer may import its own layer and any layer to its left, never one to its right. The core
modules in pipeplan/ (errors, _io, schedules, choices, units, and any added beside them) sit below every
layer and import no layer at all. pipeplan/__init__.py (the public API, which names layers lazily by
string) and pipeplan/__main__.py (`python -m pipeplan`, which starts the CLI) sit above every layer and
are not checked.

Every import counts: at module level, inside functions, under `if TYPE_CHECKING:`, relative ones, and
importlib.import_module / __import__ with a literal module name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("hardware_profiles", "costmodels", "planner", "runtime", "cli")  # bottom to top
CORE = -1  # the rank of pipeplan's core modules: below every layer
ENTRY_POINTS = {"__init__.py", "__main__.py"}  # pipeplan/ modules above every layer


def rank(module: str) -> int | None:
    """The layer's index in LAYERS of a pipeplan.<layer>... module name, CORE for another pipeplan module,
    None outside pipeplan."""
    parts = module.split(".")
    if parts[0] != "pipeplan":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return CORE


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the text of module `module`.

    `from X import a, b` yields X.a and X.b (a may be a submodule: `from pipeplan import cli`).
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            found += [(node.lineno, target if alias.name == "*" else f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(
                    first.value, str) and not first.value.startswith("."):
                found.append((node.lineno, first.value))
    return sorted(found)


def violations(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) of the imports in `source` (module `module`, a pipeplan.<layer>... or a core
    pipeplan.<name> module) that go against the layering."""
    own = rank(module)
    assert own is not None, f"{module} is not a pipeplan module"
    return [(line, name) for line, name in imports(source, module, is_package)
            if (r := rank(name)) is not None and r > own]


def modules() -> list[tuple[Path, str]]:
    """(file, module name) of every checked module: each layer folder's modules and pipeplan's core ones."""
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT / layer).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((path, ".".join(("pipeplan", layer, *parts))))
    for path in sorted((ROOT / "pipeplan").glob("*.py")):
        if path.name not in ENTRY_POINTS:
            found.append((path, f"pipeplan.{path.stem}"))
    return found


def _describe(module: str) -> str:
    r = rank(module)
    return "core" if r == CORE else LAYERS[r] if r is not None else "outside"


def test_every_module_imports_only_its_own_layer_and_those_below():
    broken = []
    for path, module in modules():
        for line, name in violations(path.read_text(), module, path.name == "__init__.py"):
            broken.append(f"{path.relative_to(ROOT)}:{line}: {_describe(module)} imports {name} "
                          f"({_describe(name)} is above it)")
    assert not broken, "imports against the layering " + " <- ".join(LAYERS) + ":\n" + "\n".join(broken)


def test_the_walk_sees_every_layer_and_the_core():
    names = {module for _, module in modules()}
    for layer in LAYERS:
        assert f"pipeplan.{layer}" in names, layer  # its __init__.py
        assert sum(n.startswith(f"pipeplan.{layer}.") for n in names) >= 2, layer
    assert {"pipeplan.errors", "pipeplan._io", "pipeplan.schedules", "pipeplan.choices", "pipeplan.units"} <= names
    assert "pipeplan" not in names and "pipeplan.__main__" not in names


SYNTHETIC = '''
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

import pipeplan.hardware_profiles.profile
from pipeplan.costmodels.graph import Graph
from pipeplan.errors import UserError
from pipeplan import schedules, __version__
from . import memory
from .comm import allreduce_time_s
from ..hardware_profiles import load_profile

if TYPE_CHECKING:
    from pipeplan.planner.plan import Plan


def later():
    import pipeplan.cli.main
    from ..runtime import launch
    from pipeplan import cli
    return importlib.import_module("pipeplan.runtime.worker")
'''


def test_violations_are_caught_wherever_the_import_is():
    # a costmodels module: hardware_profiles, costmodels itself and the core are fine; planner, runtime, cli not
    found = violations(SYNTHETIC, "pipeplan.costmodels.example")
    assert found == [(17, "pipeplan.planner.plan.Plan"), (21, "pipeplan.cli.main"), (22, "pipeplan.runtime.launch"),
                     (23, "pipeplan.cli"), (24, "pipeplan.runtime.worker")]
    # the same text as the costmodels package's __init__: `from . import` is the package itself
    assert violations(SYNTHETIC, "pipeplan.costmodels", is_package=True) == found
    # as a cli module every import is allowed
    assert violations(SYNTHETIC, "pipeplan.cli.example") == []
    # as hardware_profiles, costmodels is above it too (its relative imports land in hardware_profiles itself)
    assert [name for _, name in violations(SYNTHETIC, "pipeplan.hardware_profiles.example")][:1] == [
        "pipeplan.costmodels.graph.Graph"]


@pytest.mark.parametrize("source", ["import pipeplan.hardware_profiles",
                                    "from pipeplan import planner",
                                    "from .planner import search",
                                    "def f():\n    from pipeplan.costmodels.graph import Graph"])
def test_a_core_module_may_import_no_layer(source):
    assert len(violations(source, "pipeplan.units")) == 1
    assert violations("from pipeplan.errors import UserError\nfrom . import choices", "pipeplan.units") == []
