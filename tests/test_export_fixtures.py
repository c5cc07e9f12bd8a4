"""Helpers shared by tests/test_export_*.py and tests/test_split_*.py (no tests here).

A Llama-shaped graph built in code: `model.embed_tokens`, a weightless `model.rotary_emb`,
decoder blocks `model.layers.N` (whole, or `.self_attn`/`.mlp` halves when `halves`), `model.norm`,
`lm_head`; costs from the GPT-shaped fixture (tests/search_fixtures.py), so prediction runs on it.
Plans are made by pipeplan's own prediction (`evaluate`) of a chosen partition, as the search makes them.
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.planner.plan import Plan
from pipeplan.planner.predict import evaluate
from search_fixtures import gpt_like, profile

PROFILE = profile(80.0)


def llama_graph(blocks: int = 6, halves: bool = False, hidden: int = 256, vocab: int = 4096) -> Graph:
    base = gpt_like(blocks=blocks, hidden=hidden, seq=128, vocab=vocab, batch=2)
    emb, body, head = base.layers[0], base.layers[1:-1], base.layers[-1]
    layers = [replace(emb, name="model.embed_tokens", module="model.embed_tokens"),
              Layer("model.rotary_emb", kind="elementwise", module="model.rotary_emb", output_bytes=emb.output_bytes)]
    for i, blk in enumerate(body):
        if halves:
            half = dict(fwd_flops=blk.fwd_flops // 2, bwd_flops=blk.bwd_flops // 2, param_bytes=blk.param_bytes // 2,
                        saved_bytes=blk.saved_bytes // 2, fwd_s=blk.fwd_s / 2, bwd_s=blk.bwd_s / 2,
                        bytes_moved=blk.bytes_moved // 2)
            layers += [replace(blk, name=f"model.layers.{i}.self_attn", module=f"model.layers.{i}.self_attn", **half),
                       replace(blk, name=f"model.layers.{i}.mlp", module=f"model.layers.{i}.mlp", **half)]
        else:
            layers.append(replace(blk, name=f"model.layers.{i}", module=f"model.layers.{i}"))
    norm = Layer("model.norm", kind="norm", module="model.norm", param_bytes=hidden * 4, output_bytes=emb.output_bytes,
                 fwd_s=1e-4, bwd_s=2e-4, bytes_moved=2 * emb.output_bytes)
    layers += [norm, replace(head, name="lm_head", module="lm_head")]
    edges = [Edge(a.name, b.name, a.output_bytes) for a, b in zip(layers[:-1], layers[1:], strict=True)]
    return Graph(name="llama-like", layers=layers, edges=edges, batch_size=base.batch_size, input_bytes=base.input_bytes,
                 source={**base.source, "model_file": None})


def counts_assignment(counts: list[int]) -> list[int]:
    return [s for s, c in enumerate(counts) for _ in range(c)]


def make_plan(graph: Graph, assignment: list[int], *, schedule: str = "1f1b", microbatches: int = 8,
              batch_size: int = 16, data_parallel: int = 1, chunks: int = 1, recompute: bool = False,
              sharding: str = "none", dtype: str = "bf16", mixed_precision: str = "deepspeed",
              recompute_granularity: str = "stage") -> Plan:
    return evaluate(graph, PROFILE, assignment, schedule=schedule, microbatches=microbatches, batch_size=batch_size,
                    data_parallel=data_parallel, chunks=chunks, recompute=recompute, sharding=sharding,  # type: ignore[arg-type]
                    dtype=dtype, mixed_precision=mixed_precision,  # type: ignore[arg-type]
                    recompute_granularity=recompute_granularity)  # type: ignore[arg-type]
