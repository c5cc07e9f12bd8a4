"""Hand-built graphs and profiles for the planner tests (no tracing, no catalogue), and a check they share."""

from __future__ import annotations

import random

from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.costmodels.memory import RangeMemory, stage_memory
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.planner.problem import Problem

GIB = 2**30


def gpt_like(blocks: int = 12, hidden: int = 768, seq: int = 1024, vocab: int = 50257, batch: int = 8,
             name: str = "gpt-like") -> Graph:
    """A GPT-2-shaped chain: embedding, `blocks` transformer blocks, head. FLOPs per Narayanan et al. App. A."""
    b, s, h = batch, seq, hidden
    act = b * s * h * 4  # one fp32 hidden state
    layers = [Layer("embed", kind="embedding", fwd_flops=0, bwd_flops=0, param_bytes=(vocab + s) * h * 4,
                    output_bytes=act, saved_bytes=b * s * 8, bytes_moved=2 * act, fwd_s=1e-3, bwd_s=2e-3)]
    for i in range(blocks):
        f = 24 * b * s * h * h + 4 * b * s * s * h
        layers.append(Layer(f"block{i}", kind="matmul", fwd_flops=f, bwd_flops=2 * f, param_bytes=12 * h * h * 4,
                            output_bytes=act, saved_bytes=(34 * s * b * h + 5 * 12 * s * s * b) * 2,
                            bytes_moved=12 * h * h * 4 + 4 * act, fwd_s=5e-3, bwd_s=1e-2))
    f = 2 * b * s * h * vocab
    layers.append(Layer("head", kind="matmul", fwd_flops=f, bwd_flops=2 * f, param_bytes=h * vocab * 4,
                        output_bytes=4, saved_bytes=b * s * vocab * 4, bytes_moved=h * vocab * 4 + b * s * vocab * 4,
                        fwd_s=4e-3, bwd_s=8e-3))
    edges = [Edge(layers[i].name, layers[i + 1].name, layers[i].output_bytes) for i in range(len(layers) - 1)]
    return Graph(name=name, layers=layers, edges=edges, batch_size=batch, input_bytes=b * s * 8,
                 source={"model_file": "/x/model.py", "entry": "build_model", "depth": 1, "batch_size": batch,
                         "device": "cpu"})


def profile(memory_gib: float = 40.0, *, per_node: int = 8, name: str = "test-gpu") -> HardwareProfile:
    return HardwareProfile(
        name=name, device="Test GPU", memory_bytes=int(memory_gib * GIB), usable_memory_bytes=int(memory_gib * GIB),
        mem_bw_bytes_per_s=1.5e12, peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        devices_per_node=per_node, intra_node=Link("nvlink", 300e9, 5e-6), inter_node=Link("infiniband", 25e9, 1e-5),
    )


def assert_range_memory_is_stage_memory(prob: Problem, mem: RangeMemory, *, stages: int, chunks: int,
                                        microbatches: int, ranges: int, **request: object) -> None:
    """RangeMemory (the partitioner's prefix sums) gives `stage_memory`'s number on `ranges` random layer ranges and
    stages; `request`: what both take alike (schedule, optimizer, dtype, recompute, sharding, shards, ...)."""
    rng = random.Random(0)
    n = prob.n
    for _ in range(ranges):
        a = rng.randrange(n)
        b = rng.randrange(a + 1, n + 1)
        s = rng.randrange(stages * chunks)
        want = stage_memory(param_bytes=sum(prob.param_bytes[a:b]) * chunks,
                            frozen_param_bytes=sum(prob.frozen[a:b]) * chunks,
                            saved_bytes_per_mb=sum(prob.saved_bytes[a:b]) * chunks,
                            input_bytes_per_mb=prob.input_bytes if a == 0 else prob.cut_bytes[a - 1],
                            output_bytes_per_mb=prob.cut_bytes[b - 1] if b < n else 0, stages=stages,
                            stage=s % stages, microbatches=max(microbatches, stages), chunks=chunks,
                            largest_layer_param_bytes=max(prob.param_bytes[i] - prob.frozen[i] for i in range(a, b)),
                            **request).total_bytes
        assert mem(s, a, b) == want
