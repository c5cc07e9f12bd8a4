"""Read PipeDream profiler output (`graph.txt`) as a pipeplan Graph.

PipeDream users already have per-layer profiles of their models; reading them
lets pipeplan plan those models (and lets us check our optimizer against
PipeDream's on real workloads). Format (msr-fiddle/pipedream graph/graph.py,
docs/pipedream-import.md):

    nodeN -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>, activation_size=<bytes or [a; b]>, parameter_size=<bytes>
    <TAB>nodeA -- nodeB

Mapping, as PipeDream's optimizer does it: sources named `Input*` are model
inputs (not layers); sink nodes named `__getitem__*` are dropped. A node's
`activation_size` is its output (a list is summed), every out-edge carries it,
and it also stands in for the bytes saved for backward (the profile has nothing
better; documented approximation).
"""

from __future__ import annotations

import heapq
import os
import re
from pathlib import Path

from pipeplan._io import read_text
from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.errors import UserError

_META = re.compile(
    r"forward_compute_time=(?P<f>[^,]+),\s*backward_compute_time=(?P<b>[^,]+),\s*"
    r"activation_size=(?P<a>\[[^\]]*\]|[^,]+),\s*parameter_size=(?P<p>[^,\s]+)"
)

_KINDS = (
    ("conv", ("Conv",)),
    ("matmul", ("Linear", "LSTM", "EmuBidirLSTM", "Classifier", "RecurrentAttention")),
    ("embedding", ("Embedding",)),
    ("norm", ("BatchNorm", "LayerNorm")),
    ("elementwise", ("ReLU", "Add", "Dropout", "Concat", "Sigmoid", "Tanh", "Mul")),
)


def _kind(desc: str) -> str:
    for kind, prefixes in _KINDS:
        if desc.startswith(prefixes):
            return kind
    return "other"


def _number(text: str, path: str, lineno: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{path}:{lineno}: {what} {text!r} is not a number", "pass an unmodified PipeDream graph.txt") from None
    if value < 0 or value != value:
        raise UserError(f"{path}:{lineno}: {what} is negative or NaN", "pass an unmodified PipeDream graph.txt")
    return value


def parse_pipedream(
    text: str, path: str = "<graph.txt>"
) -> tuple[dict[str, tuple[str, float, float, float, float]], list[tuple[str, str]]]:
    """-> ({node_id: (desc, fwd_ms, bwd_ms, act_bytes, param_bytes)}, [(src, dst)]), file order."""
    nodes: dict[str, tuple[str, float, float, float, float]] = {}
    edges: list[tuple[str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if raw.startswith("\t"):
            parts = raw.strip().split(" -- ")
            if len(parts) != 2:
                raise UserError(f"{path}:{lineno}: edge line must be 'nodeA -- nodeB'", "pass a PipeDream graph.txt")
            edges.append((parts[0].strip(), parts[1].strip()))
            continue
        node_id, sep, rest = raw.strip().partition(" -- ")
        m = _META.search(rest)
        if not sep or m is None:
            raise UserError(f"{path}:{lineno}: not a PipeDream node line", "pass a PipeDream profiler graph.txt")
        desc = rest[: m.start()].rstrip()
        desc = desc[: -len("--")].rstrip() if desc.endswith("--") else desc
        act_text = m.group("a").strip()
        if act_text.startswith("["):
            items = [x for x in act_text.strip("[]").split(";") if x.strip()]
            act = sum(_number(x.strip(), path, lineno, "activation_size") for x in items)
        else:
            act = _number(act_text, path, lineno, "activation_size")
        if node_id in nodes:
            raise UserError(f"{path}:{lineno}: node {node_id} is defined twice", "pass a PipeDream graph.txt")
        nodes[node_id] = (
            desc,
            _number(m.group("f"), path, lineno, "forward_compute_time"),
            _number(m.group("b"), path, lineno, "backward_compute_time"),
            act,
            _number(m.group("p"), path, lineno, "parameter_size"),
        )
    if not nodes:
        raise UserError(f"{path}: no nodes found", "pass a PipeDream profiler graph.txt")
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise UserError(f"{path}: edge {src} -- {dst} names unknown node {end}", "pass a complete graph.txt")
    return nodes, edges


def _node_key(node_id: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", node_id)
    return (int(digits) if digits else 1 << 60, node_id)


def load_pipedream_graph(path: str | os.PathLike[str], *, batch_size: int = 1, name: str | None = None) -> Graph:
    """A Graph from a PipeDream graph.txt (times ms -> s; sizes in bytes).

    `batch_size` is the minibatch the profile was taken at; PipeDream's files do
    not record it, so the default 1 makes every time and size "per profiled
    minibatch".
    """
    p = Path(path)
    text = read_text(p, what="PipeDream graph.txt", missing="no such PipeDream graph file")
    nodes, edges = parse_pipedream(text, str(p))

    out_edges: dict[str, list[str]] = {n: [] for n in nodes}
    in_edges: dict[str, list[str]] = {n: [] for n in nodes}
    for s, d in edges:
        if d not in out_edges[s]:
            out_edges[s].append(d)
            in_edges[d].append(s)
    inputs = [n for n in nodes if not in_edges[n] and nodes[n][0].startswith("Input")]
    dropped = {n for n in nodes if not out_edges[n] and nodes[n][0].startswith("__getitem__")}
    keep = [n for n in nodes if n not in dropped and n not in inputs]
    if not keep:
        raise UserError(f"{p}: the graph has no layers besides inputs", "pass a complete graph.txt")

    # Kahn's algorithm, ties broken by node number (PipeDream numbers nodes in execution order)
    keep_set = set(keep)
    indeg = {n: sum(1 for s in in_edges[n] if s in keep_set) for n in keep}
    heap = [(_node_key(n), n) for n in keep if indeg[n] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for d in out_edges[n]:
            if d in keep_set:
                indeg[d] -= 1
                if indeg[d] == 0:
                    heapq.heappush(heap, (_node_key(d), d))
    if len(order) != len(keep):
        raise UserError(f"{p}: the graph has a cycle", "pass a PipeDream graph.txt (a DAG)")

    layers = []
    for n in order:
        desc, f_ms, b_ms, act, param = nodes[n]
        layers.append(Layer(
            name=n, kind=_kind(desc), module=desc[:200], param_bytes=int(round(param)),
            output_bytes=int(round(act)), saved_bytes=int(round(act)),
            fwd_s=f_ms / 1000.0, bwd_s=b_ms / 1000.0,
        ))
    graph_edges = [Edge(src=s, dst=d, bytes=int(round(nodes[s][3])))
                   for s in order for d in out_edges[s] if d in keep_set]
    graph_inputs = {nodes[i][0]: [d for d in out_edges[i] if d in keep_set] for i in inputs}
    if name is None:
        name = p.name[: -len(".graph.txt")] if p.name.endswith(".graph.txt") else (
            p.parent.name if p.name == "graph.txt" and p.parent.name else p.stem)
    return Graph(
        name=name,
        layers=layers,
        edges=graph_edges,
        batch_size=int(batch_size),
        input_bytes=int(round(sum(nodes[i][3] for i in inputs))),
        inputs=graph_inputs,
        source={"model_file": None, "entry": None, "depth": None, "batch_size": int(batch_size),
                "format": "pipedream-graph.txt", "path": str(p.resolve()), "device": "pipedream-profile",
                "torch": None, "repeats": None},
        notes=[
            f"imported from PipeDream profile {p.name}: layer times were measured on the profiling GPU "
            "(plan with --times measured); saved_bytes = activation_size (approximation)",
        ] + ([f"dropped {len(dropped)} __getitem__ sink node(s), as PipeDream's optimizer does"] if dropped else []),
    )
