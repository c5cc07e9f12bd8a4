"""torchtitan export and import, checked against torchtitan 0.3.0 itself where a Python with it is at hand.

torchtitan installs CPU-only but not into pipeplan's environment: it pins huggingface_hub 1.x and an older
fsspec, which the transformers pipeplan uses refuses (pip's dry run would downgrade both), and it needs
triton. So it lives in its own venv (docs/frameworks-torchtitan.md says how to make one); set
PIPEPLAN_TORCHTITAN_PYTHON to its python (default /tmp/fw-venv/bin/python), or these checks are skipped.
There, `tests/data/frameworks/torchtitan_check.py` loads the exported config_registry function and command
line through torchtitan's ConfigManager, cuts the model with torchtitan's `_split_module` per part and
runs torchtitan's `_generate_llm_fqn_per_model_part`, which `default_parts` must reproduce.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib

from pipeplan.planner.frameworks import export_plan
from pipeplan.planner.frameworks.names import Inexpressible
from pipeplan.planner.frameworks.split import split_from_source
from pipeplan.planner.frameworks.torchtitan import LOOPED, default_parts
from test_export_fixtures import counts_assignment, llama_graph, make_plan

CHECK = Path(__file__).parent / "data" / "frameworks" / "torchtitan_check.py"
DEBUG_LAYERS = 6  # torchtitan's llama3 "debugmodel" has 6 decoder layers


def titan_python() -> str:
    py = os.environ.get("PIPEPLAN_TORCHTITAN_PYTHON", "/tmp/fw-venv/bin/python")
    if not Path(py).is_file():
        pytest.skip(f"no Python with torchtitan at {py} (set PIPEPLAN_TORCHTITAN_PYTHON)")
    return py


def _plan(**kw):
    return make_plan(llama_graph(DEBUG_LAYERS), counts_assignment([4, 2, 4]), **kw)  # E+rot+2 | 2 | 2+norm+head


def test_export_names_stages_in_torchtitan_terms():
    exp = export_plan(_plan(), "torchtitan")
    assert exp.stage_modules == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"],
                                 ["layers.4", "layers.5", "norm", "lm_head"]]
    toml = tomllib.loads(exp.snippets["toml (torchtitan <= 0.2, TOML job config)"])
    assert toml["parallelism"]["module_fqns_per_model_part"][-1] == ["layers.4", "layers.5", "norm", "output"]
    assert toml["parallelism"]["pipeline_parallel_degree"] == 3
    assert toml["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert toml["training"]["local_batch_size"] // toml["parallelism"]["pipeline_parallel_microbatch_size"] == 8


@pytest.mark.parametrize("dtype, param", [("bf16", "bfloat16"), ("fp32", "float32"), ("tf32", "float32"),
                                          ("fp16", "bfloat16")])
def test_the_export_trains_in_the_plans_dtype(dtype, param):
    """torchtitan's mixed precision casts parameters to training.mixed_precision_param (default bfloat16, installed
    by its FSDP wrapping even at shard degree 1): the plan's dtype in every snippet, or an fp32 plan would train
    in bf16; fp16, which torchtitan does not train, goes out as bf16 with a note, and tf32 with the note that the
    script turns tf32 matmuls on (torchtitan leaves them off)."""
    exp = export_plan(_plan(dtype=dtype), "torchtitan")
    toml = tomllib.loads(exp.snippets["toml (torchtitan <= 0.2, TOML job config)"])
    assert toml["training"]["mixed_precision_param"] == param == exp.settings["mixed_precision_param"]
    assert f"config.training.mixed_precision_param = {param!r}" in exp.snippets["python config_registry (torchtitan 0.3)"]
    cli = shlex.split(exp.snippets["command line (torchtitan 0.3, with the function above)"])
    assert cli[cli.index("--training.mixed_precision_param") + 1] == param
    assert any("torchtitan does not train" in n for n in exp.notes) is (dtype == "fp16")
    assert any("allow_tf32" in n for n in exp.notes) is (dtype == "tf32")


def test_toml_export_imports_back_to_the_same_split(tmp_path):
    g = llama_graph(DEBUG_LAYERS)
    plan = make_plan(g, counts_assignment([3, 1, 1, 1, 1, 3]), schedule="interleaved", chunks=2, microbatches=6,
                     batch_size=12)
    exp = export_plan(plan, "torchtitan")
    f = tmp_path / "job.toml"
    f.write_text(exp.snippets["toml (torchtitan <= 0.2, TOML job config)"])
    got = split_from_source(str(f), [layer.name for layer in g.layers], [float(x.param_bytes) for x in g.layers])
    assert got.chunks == 2 and exp.settings["pipeline_parallel_degree"] == 3
    assert got.assignment == [s.index for s in plan.stages for _ in s.layers] == counts_assignment([3, 1, 1, 1, 1, 3])


def test_toml_without_parts_splits_as_torchtitan_defaults(tmp_path):
    g = llama_graph(DEBUG_LAYERS)
    f = tmp_path / "job.toml"
    f.write_text("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"\n")
    got = split_from_source(str(f), [layer.name for layer in g.layers], [float(x.param_bytes) for x in g.layers])
    # 4 virtual stages, 6 layers + 1 + 1 effective: 2 each, the embedding and norm+output counting one layer each
    assert got.chunks == 2 and got.assignment == counts_assignment([3, 2, 2, 3])


@pytest.mark.parametrize("name, schedule", [("1F1B", "1f1b"), ("GPipe", "gpipe"), ("Interleaved1F1B", "interleaved"),
                                            ("ZBVZeroBubble", "zb-v"), ("DualPipeV", "dualpipev"),
                                            ("InterleavedZeroBubble", None), ("LoopedBFS", None)])
def test_toml_names_the_schedule_pipeplan_plans_for_its_parts(tmp_path, name, schedule):
    """The looped classes get two parts a rank by default: ZBVZeroBubble is pipeplan's zb-v, while
    InterleavedZeroBubble with two parts a rank (interleaved zero bubble) and LoopedBFS are no pipeplan schedule."""
    g = llama_graph(DEBUG_LAYERS)
    f = tmp_path / "job.toml"
    f.write_text(f"[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"{name}\"\n")
    got = split_from_source(str(f), [layer.name for layer in g.layers], [float(x.param_bytes) for x in g.layers])
    assert got.schedule == schedule and got.chunks == (2 if name in LOOPED else 1)


@pytest.mark.parametrize("kw, why", [(dict(sharding="zero1", data_parallel=2), "no ZeRO-1"),
                                     (dict(schedule="pipedream"), "asynchronous"),
                                     (dict(schedule="pipedream-2bw"), "asynchronous")])
def test_refusals(kw, why):
    with pytest.raises(Inexpressible, match=why):
        export_plan(_plan(**kw), "torchtitan")


def test_a_gpt2_named_model_does_not_map():
    from pipeplan.planner.frameworks.names import model_units, unit_split
    from pipeplan.planner.frameworks.torchtitan import parts_of

    names = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
             "transformer.ln_f", "lm_head"]
    mu = model_units(names)
    with pytest.raises(Inexpressible, match=r"not one token embedding"):
        parts_of(mu, unit_split(mu, [0, 0, 0, 0, 1, 1, 1]), "lm_head")


def test_torchtitan_loads_the_export_and_splits_as_planned(tmp_path):
    py = titan_python()
    plan = _plan(recompute=True, sharding="zero3", data_parallel=2, batch_size=32)
    exp = export_plan(plan, "torchtitan")
    src = exp.snippets["python config_registry (torchtitan 0.3)"].replace("llama3_8b", "llama3_debugmodel")
    (tmp_path / "my_configs.py").write_text(src)
    flags = shlex.split(exp.snippets["command line (torchtitan 0.3, with the function above)"])
    assert flags[:4] == ["--module", "my_configs", "--config", "pipeplan_plan"]
    run = subprocess.run([py, str(CHECK), str(tmp_path), *flags[1:2], *flags[3:4], *flags[4:]],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["n_layers"] == DEBUG_LAYERS
    assert got["kept"] == exp.stage_modules  # torchtitan's own split keeps exactly the planned modules
    assert got["pipeline_parallel_degree"] == 3 and got["pipeline_parallel_schedule"] == "1F1B"
    assert got["local_batch_size"] // got["pipeline_parallel_microbatch_size"] == plan.microbatches
    assert got["activation_checkpoint"] == "FullAC.Config"
    assert got["mixed_precision_param"] == "bfloat16"  # the plan's bf16
    assert (got["data_parallel_replicate_degree"], got["data_parallel_shard_degree"]) == (1, 2)
    for key, parts in got["default_parts"].items():  # torchtitan's default split, reproduced
        k, i, o = map(int, key.split(","))
        assert default_parts(k, DEBUG_LAYERS, i, o) == parts, key
