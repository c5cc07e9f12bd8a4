"""Makes the helper modules beside the tests (cli_fixtures, search_fixtures, runtime_helpers, runtime_models,
pipeline_timeline, ...) importable by name from every test file.

pytest runs with --import-mode=importlib (pyproject.toml), which imports each test file by path and puts no
folder on sys.path, so `from cli_fixtures import chain_graph` would fail. pytest imports this conftest before
any test module of this folder, whichever test files are named on the command line; the one line below is
the only place tests/ goes on sys.path.

Subprocesses (torchrun workers, `python -m pipeplan ...`) do not see this file, and need not: the model files
under tests/ (runtime_model_*.py, which import runtime_models) are loaded with
pipeplan.costmodels.model_file.load_model_file, which puts the model file's own folder on sys.path, and a
script started by path (tests/runtime_fault_worker.py) has its folder on sys.path as Python starts it.
"""

import os
import sys
import time
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# The CLI's piped output is PIPED_WIDTH wide unless COLUMNS says otherwise (cli/console.py), and the tests read its
# tables at that width: a shell's COLUMNS=80 (pytest-xdist's workers set it too) wraps them and fails tests that
# find a row. A test of COLUMNS itself sets it with monkeypatch.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def real_calibration(tmp_path_factory):
    """One real `pipeplan profiles calibrate` (budget 8 s): (CliRunner result, YAML path, seconds it took).

    The slowest fixture of the suite (~50 s on 2 cores, link processes and one round of their pipelines included),
    so every test that needs a measured local profile shares this one (test_calibrate.py,
    test_calibrated_prediction.py).
    """
    from click.testing import CliRunner

    from pipeplan.cli.main import cli

    out = tmp_path_factory.mktemp("cal") / "local.yaml"
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["profiles", "calibrate", "-o", str(out), "--budget-s", "8", "--json", "--quiet"])
    return r, out, time.perf_counter() - t0


@pytest.fixture
def no_side_by_side(monkeypatch):
    """`analyze` on a local profile without its last step, the plan's stages timed side by side in processes of their
    own (cli/device_like.measure_slowdown_like_device; tested in test_side_by_side.py): ~4-8 s a call, for tests that
    read what comes before it (the trace, the re-timing in the plan's dtype)."""
    from pipeplan.cli import device_like

    monkeypatch.setattr(device_like, "measure_slowdown_like_device", lambda graph, profile, request, result: result)
