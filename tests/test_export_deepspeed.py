"""DeepSpeed export and `partition_method` import, checked against deepspeed's own code (0.19.8 installs CPU-only).

The partitioners are compared with `deepspeed.runtime.utils.partition_uniform` / `partition_balanced` on
random and adversarial weights; the exported boundaries are applied by the exported Python class to a real
`PipelineModule` on 4 gloo ranks, each of which must build exactly its planned layers.
"""

from __future__ import annotations

import json
import random
import textwrap

import pytest

from pipeplan.planner.frameworks import export_plan
from pipeplan.planner.frameworks.deepspeed import partition_balanced, partition_uniform, parts_for_method
from pipeplan.planner.frameworks.names import Inexpressible, model_units
from pipeplan.planner.frameworks.split import split_from_source
from test_export_fixtures import counts_assignment, llama_graph, make_plan


def ds_utils():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import utils

    return utils


@pytest.mark.parametrize("n, k", [(1, 1), (3, 4), (4, 4), (10, 3), (36, 8), (35, 4), (7, 7)])
def test_partition_uniform_matches_deepspeed(n, k):
    assert partition_uniform(n, k) == list(ds_utils().partition_uniform(n, k))


def test_partition_balanced_matches_deepspeed():
    utils = ds_utils()
    rng = random.Random(18)
    cases = [([0, 1, 1, 1, 1, 0], 2), ([5] * 10, 3), ([1, 0, 0, 0, 1], 2), ([0] * 6, 3), ([3, 1], 4)]
    for _ in range(60):
        n = rng.randint(1, 24)
        cases.append(([rng.choice([0, 1, rng.randint(1, 10**6)]) for _ in range(n)], rng.randint(1, 9)))
    for weights, k in cases:
        assert partition_balanced(weights, k) == [int(x) for x in utils.partition_balanced(weights, k)], (weights, k)


def test_type_regex_weights_the_matching_classes():
    mu = model_units([layer.name for layer in llama_graph(8).layers])
    names = ["EmbeddingPipe"] + ["ParallelTransformerLayerPipe"] * 8 + ["NormPipe", "LMHeadPipe"]
    ours = parts_for_method("type:Transformer", [0.0] * len(names), names, 4)
    expect = [int(x) for x in ds_utils().partition_balanced([0] + [1] * 8 + [0, 0], 4)]
    assert ours == expect
    with pytest.raises(ValueError, match="found no valid layers"):
        parts_for_method("type:conv", [0.0] * len(names), names, 4)
    assert len(mu.units) == len(names)


def test_parameters_import_uses_the_units_parameter_counts(tmp_path):
    g = llama_graph(8)
    names = [layer.name for layer in g.layers]
    params = [float(layer.param_bytes) for layer in g.layers]
    spec = tmp_path / "ds.json"
    spec.write_text(json.dumps({"num_stages": 4, "partition_method": "parameters"}))
    got = split_from_source(str(spec), names, params)
    unit_params = [params[0] + params[1]] + params[2:10] + params[10:]  # embed (+ weightless rotary), blocks, norm, head
    parts = [int(x) for x in ds_utils().partition_balanced(unit_params, 4)]
    layer_parts = [0] + [p + 1 for p in parts[1:]]  # the rotary layer rides with the embedding unit
    expect = [s for s in range(4) for _ in range(layer_parts[s], layer_parts[s + 1])]
    assert got.assignment == expect and got.chunks == 1
    assert split_from_source("deepspeed:4:parameters", names, params).assignment == expect


def test_export_settings_and_refusals():
    g = llama_graph(6)
    plan = make_plan(g, counts_assignment([3, 2, 2, 3]), recompute=True, sharding="zero1", data_parallel=2)
    exp = export_plan(plan, "deepspeed")
    assert exp.settings["parts"] == [0, 2, 4, 6, 9]  # units: embed, 6 blocks, norm, head
    assert exp.settings["activation_checkpoint_interval"] == 1
    assert exp.settings["ds_config"] == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                                         "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1},
                                         "bf16": {"enabled": True}}  # the plan's dtype
    assert any("no option for explicit stage boundaries" in n for n in exp.notes)
    for kw, why in ((dict(schedule="interleaved", chunks=2), "no interleaved schedule"),
                    (dict(sharding="zero2", data_parallel=2), "refuses ZeRO-2 and ZeRO-3")):
        with pytest.raises(Inexpressible, match=why):
            export_plan(make_plan(g, counts_assignment([3, 2, 2, 3]), **kw), "deepspeed")


WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.multiprocessing as mp

    def worker(rank, world, out):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0", LOCAL_SIZE="1")
        import deepspeed
        from deepspeed.pipe import LayerSpec
        # Off: the CPU accelerator's shared-memory all-reduce op, which deepspeed compiles with ninja on first
        # use (~45 s on 2 cores, again for each new venv). Partitioning never reduces; gloo serves the rest.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        scope = {}
        exec(open(sys.argv[1]).read(), scope)
        cls = scope["PlannedPipelineModule"]
        specs = [LayerSpec(torch.nn.Linear, 4, 4) for _ in range(cls.PARTS[-1])]
        m = cls(layers=specs, num_stages=world)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump([m.stage_id, m._local_start, m._local_stop, len(m.forward_funcs)], f)
        torch.distributed.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(4, os.path.dirname(sys.argv[1])), nprocs=4)
""")


@pytest.mark.slow
def test_pipeline_module_builds_the_exported_parts(tmp_path):
    """DeepSpeed's own PipelineModule, with the exported class, on 4 gloo ranks."""
    pytest.importorskip("deepspeed")
    import socket
    import subprocess
    import sys

    g = llama_graph(6)
    exp = export_plan(make_plan(g, counts_assignment([3, 2, 2, 3])), "deepspeed")
    (tmp_path / "planned.py").write_text(exp.snippets["python"])
    (tmp_path / "worker.py").write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "planned.py"), str(port)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = exp.settings["parts"]
    built = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert built == [[r, parts[r], parts[r + 1], parts[r + 1] - parts[r]] for r in range(4)]


@pytest.mark.parametrize("dtype, bf16, fp16", [("bf16", True, False), ("fp16", False, True), ("fp32", False, False),
                                               ("tf32", False, False)])
def test_ds_config_trains_in_the_plans_dtype(dtype, bf16, fp16):
    """DeepSpeed trains fp32 unless ds_config says otherwise: read by DeepSpeed's own precision parser, the exported
    config enables the plan's 16-bit dtype, fp16 with dynamic loss scaling from 2^16; tf32 has no key (a note)."""
    ds_utils()
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    plan = make_plan(llama_graph(8), counts_assignment([4, 2, 2, 4]), dtype=dtype)
    exp = export_plan(plan, "deepspeed")
    config = json.loads(exp.snippets["ds_config.json"])
    assert get_bfloat16_config(config).enabled is bf16
    fp16_config = get_float16_config(config)
    assert fp16_config.enabled is fp16
    if fp16:
        assert fp16_config.loss_scale == 0 and fp16_config.initial_scale_power == 16  # 0: dynamic
    assert any("allow_tf32" in n for n in exp.notes) is (dtype == "tf32")
