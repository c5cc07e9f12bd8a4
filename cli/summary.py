"""The plain-dict views the CLI prints with --json and renders as tables.

One place builds them so the human report and the machine document always say
the same numbers; their schemas are documented in docs/cli.md and are stable.
"""

from __future__ import annotations

from typing import Any

_ELEMENT_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}


def parameter_count(param_bytes: int, dtype: str = "float32") -> int:
    """Parameters from bytes: the trace records fp32 parameter bytes (4 per parameter)."""
    return int(param_bytes) // _ELEMENT_BYTES.get(str(dtype), 4)


def graph_summary(graph) -> dict[str, Any]:
    """Model totals of a Graph, per sample where it scales with the batch."""
    batch = max(1, int(graph.batch_size))
    return {
        "name": graph.name,
        "fingerprint": graph.fingerprint(),
        "layers": len(graph.layers),
        "edges": len(graph.edges),
        "parameters": parameter_count(graph.param_bytes, graph.dtype),
        "param_bytes": int(graph.param_bytes),
        "trainable_parameters": parameter_count(graph.param_bytes - graph.frozen_param_bytes, graph.dtype),
        "fwd_flops_per_sample": graph.fwd_flops / batch,
        "bwd_flops_per_sample": graph.bwd_flops / batch,
        "peak_activation_bytes_per_sample": graph.peak_activation_bytes / batch,
        "trace_batch_size": int(graph.batch_size),
        "source": dict(graph.source),
        "notes": list(graph.notes),
    }


def plan_graph_summary(plan) -> dict[str, Any]:
    """What a saved plan alone knows about its model (for `show` without the graph)."""
    g = plan.graph
    return {
        "name": g.get("name"),
        "fingerprint": g.get("fingerprint"),
        "layers": g.get("layers"),
        "trace_batch_size": g.get("trace_batch_size"),
        "source": {k: g.get(k) for k in ("model_file", "entry", "depth") if g.get(k) is not None},
        "notes": [],
    }


def stage_params(plan, graph) -> list[int | None]:
    """Parameters per stage, counted from the graph's layers (None without a graph)."""
    if graph is None:
        return [None] * len(plan.stages)
    out = []
    for s in plan.stages:
        total = 0
        for name in s.layers:
            try:
                total += graph.layer(name).param_bytes
            except KeyError:
                return [None] * len(plan.stages)
        out.append(parameter_count(total, graph.dtype))
    return out


def speedup(plan, baseline) -> float | None:
    if baseline is None or not baseline.predicted.samples_per_s:
        return None
    return plan.predicted.samples_per_s / baseline.predicted.samples_per_s


def baseline_summary(plan, baseline, capacity_bytes: int | None) -> dict[str, Any] | None:
    """The naive equal-layers split with the same stages/replicas/microbatches/schedule, for the one-line comparison."""
    if baseline is None:
        return None
    fits = None if capacity_bytes is None else baseline.predicted.peak_memory_bytes <= capacity_bytes
    return {
        "layers_per_stage": [len(s.layers) for s in baseline.stages],
        "iteration_s": baseline.predicted.iteration_s,
        "samples_per_s": baseline.predicted.samples_per_s,
        "bubble_fraction": baseline.predicted.bubble_fraction,
        "peak_memory_bytes": baseline.predicted.peak_memory_bytes,
        "fits_memory": fits,
        "speedup": speedup(plan, baseline),
    }


def profile_summary(profile, dtype: str) -> dict[str, Any]:
    try:
        peak = profile.flops_for(dtype)
    except Exception:  # noqa: BLE001 - an unsupported dtype was already reported by the search
        peak = None
    return {
        "name": profile.name,
        "device": profile.device,
        "usable_memory_bytes": int(profile.usable_memory_bytes),
        "peak_flops": peak,
        "dtype": dtype,
        "local": bool(profile.local),
    }


def analyze_document(result, graph, profile, dtype: str) -> dict[str, Any]:
    """`analyze --json` / `plan --json`: {"plan", "baseline", "graph", "profile", "evaluated"} (docs/cli.md)."""
    capacity = int(profile.usable_memory_bytes)
    return {
        "plan": result.best.to_dict(),
        "baseline": baseline_summary(result.best, result.baseline, capacity),
        "graph": graph_summary(graph),
        "profile": profile_summary(profile, dtype),
        "evaluated": int(getattr(result, "evaluated", 0)),
    }


def compare_row(profile, plan, dtype: str, error: str | None = None) -> dict[str, Any]:
    """One `compare` row: the best plan on a profile, or why there is none."""
    capacity = int(profile.usable_memory_bytes) if profile is not None else None
    row: dict[str, Any] = {
        "profile": profile.name if profile is not None else None,
        "device": profile.device if profile is not None else None,
        "dtype": dtype,
        "feasible": plan is not None,
        "error": error,
        "stages": None,
        "replicas": None,
        "microbatches": None,
        "microbatch_size": None,
        "schedule": None,
        "chunks": None,
        "recompute": None,
        "recompute_granularity": None,
        "sharding": None,
        "devices": None,
        "iteration_s": None,
        "samples_per_s": None,
        "bubble_fraction": None,
        "peak_memory_bytes": None,
        "usable_memory_bytes": capacity,
        "memory_headroom_bytes": None,
        "memory_headroom_fraction": None,
        "achieved_flops_fraction": None,
    }
    if plan is None:
        return row
    replicas = [s.replicas for s in plan.stages]
    chunks = max(1, plan.chunks)
    peak = int(plan.predicted.peak_memory_bytes)
    row.update(
        stages=len(plan.stages) // chunks if plan.schedule == "interleaved" else len(plan.stages),
        replicas=replicas[0] if len(set(replicas)) == 1 else replicas,
        microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size,
        schedule=plan.schedule,
        chunks=plan.chunks,
        recompute=plan.recompute,
        recompute_granularity=plan.recompute_granularity,
        sharding=plan.sharding,
        devices=plan.devices,
        iteration_s=plan.predicted.iteration_s,
        samples_per_s=plan.predicted.samples_per_s,
        bubble_fraction=plan.predicted.bubble_fraction,
        peak_memory_bytes=peak,
        memory_headroom_bytes=None if capacity is None else capacity - peak,
        memory_headroom_fraction=None if not capacity else (capacity - peak) / capacity,
        achieved_flops_fraction=plan.predicted.achieved_flops_fraction,
    )
    return row


def cluster_document(result, graph, cluster, dtype: str) -> dict[str, Any]:
    """`analyze --cluster --json` / `plan --cluster --json`: {"plan", "baseline", "graph", "cluster", "evaluated"}
    (docs/cli.md); the plan's stages name their `device_type`."""
    doc = {
        "plan": result.best.to_dict(),
        "baseline": baseline_summary(result.best, result.baseline, None),
        "graph": graph_summary(graph),
        "cluster": {
            "spec": cluster.spec,
            "groups": [{**profile_summary(g.profile, dtype), "count": g.count} for g in cluster.groups],
            "link": {"bandwidth_bytes_per_s": cluster.link.bandwidth_bytes_per_s, "latency_s": cluster.link.latency_s},
        },
        "evaluated": int(getattr(result, "evaluated", 0)),
    }
    if doc["baseline"] is not None:  # each device against its own type's capacity (planner/mixed_predict.py)
        doc["baseline"]["fits_memory"] = bool(result.baseline.predicted.fits)
    return doc


def cluster_row(cluster, plan, dtype: str, error: str | None = None) -> dict[str, Any]:
    """One `compare --cluster` row: `compare_row`'s fields for a mixed cluster, plus `device_types` (per stage) and
    `devices_available`; capacity and headroom are those of the device with the largest peak."""
    row = compare_row(None, plan, dtype, error)
    capacity = int(plan.predicted.memory_capacity_bytes) if plan is not None else None
    peak = row["peak_memory_bytes"]
    row.update(profile=cluster.spec, device=" + ".join(f"{g.count} × {g.profile.device}" for g in cluster.groups),
               usable_memory_bytes=capacity, devices_available=cluster.devices,
               device_types=[s.device_type for s in plan.stages] if plan is not None else None)
    if plan is not None and capacity:
        row.update(memory_headroom_bytes=capacity - peak, memory_headroom_fraction=(capacity - peak) / capacity)
    return row
