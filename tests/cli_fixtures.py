"""Saved-graph and plan fixtures for the CLI tests, built in code so they are small and obviously right.

The chain graph is deliberately uneven (a few heavy layers among light ones) so
the planner's split beats the naive equal-layers split and the comparison line
has something to say.
"""

from __future__ import annotations

from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.planner.plan import Plan, Prediction, Stage, StagePrediction

WIDTHS = (256, 256, 1024, 256, 256, 256, 2048, 256, 256, 512, 256, 256)


def chain_graph(batch: int = 4, widths=WIDTHS, name: str = "tiny-chain", param_scale: int = 1) -> Graph:
    """A chain of Linear-like layers: layer i maps widths[i-1] -> widths[i] (2 FLOPs per MAC)."""
    layers, edges = [], []
    prev = widths[0]
    for i, w in enumerate(widths):
        macs = batch * prev * w
        out = 4 * batch * w
        layers.append(
            Layer(
                name=f"layers.{i}",
                kind="matmul",
                module=f"layers.{i}",
                fwd_flops=2 * macs,
                bwd_flops=4 * macs,
                param_bytes=4 * (prev * w + w) * param_scale,
                output_bytes=out,
                saved_bytes=4 * batch * prev + out,
                fwd_s=2 * macs / 20e9,
                bwd_s=4 * macs / 20e9,
                bytes_moved=4 * (batch * prev + prev * w) + out,
                outputs={f"layers.{i}:out": out},
                params=[f"layers.{i}.weight", f"layers.{i}.bias"],
                nodes=[f"linear_{i}"],
            )
        )
        if i:
            edges.append(Edge(src=f"layers.{i - 1}", dst=f"layers.{i}", bytes=layers[i - 1].output_bytes, tensors=[f"layers.{i - 1}:out"]))
        prev = w
    return Graph(
        name=name,
        layers=layers,
        edges=edges,
        batch_size=batch,
        input_bytes=4 * batch * widths[0],
        inputs={"x": ["layers.0"]},
        peak_activation_bytes=sum(l.saved_bytes for l in layers),
        source={"model_file": None, "entry": None, "depth": None, "batch_size": batch, "torch": "test", "device": "fixture", "repeats": 0},
    )


def hand_plan(stages: int = 4, microbatches: int = 8, schedule: str = "gpipe") -> Plan:
    """A plan with round numbers, independent of the planner (for rendering tests)."""
    st = []
    for i in range(stages):
        st.append(
            Stage(
                index=i,
                layers=[f"layers.{j}" for j in range(3 * i, 3 * i + 3)],
                devices=[i],
                replicas=1,
                predicted=StagePrediction(
                    fwd_s=1e-3, bwd_s=2e-3, compute_s=3e-3, send_s=0.25e-3 if i < stages - 1 else 0.0,
                    send_bytes=(4 << 20) if i < stages - 1 else 0, memory_bytes=(10 + i) << 30,
                    weights_bytes=2 << 30, optimizer_bytes=6 << 30, activation_bytes=(2 + i) << 30,
                ),
            )
        )
    return Plan(
        graph={"fingerprint": "sha256:test", "name": "tiny-chain", "model_file": None, "entry": None, "depth": None,
               "trace_batch_size": 4, "layers": 3 * stages},
        profile="a100-80gb-sxm",
        schedule=schedule,
        microbatches=microbatches,
        batch_size=4 * microbatches,
        stages=st,
        predicted=Prediction(iteration_s=0.040, samples_per_s=800.0, bubble_fraction=0.3, peak_memory_bytes=(9 + stages) << 30,
                             achieved_flops_fraction=0.42),
        devices=stages,
        dtype="bf16",
        solver={"name": "dp", "status": "optimal", "time_s": 0.01},
    )
