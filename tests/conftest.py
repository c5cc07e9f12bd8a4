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

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
