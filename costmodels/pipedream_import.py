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
import math
import os
import re
from pathlib import Path

from pipeplan._io import read_text
from pipeplan.costmodels.graph import Edge, Graph, Layer
from pipeplan.errors import UserError
from pipeplan.fields import quote

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


# Plausible upper bounds, far above any real profile (the shipped ones peak at 636 ms and 1.6 GB): a
# value past them is a corrupted file, and would overflow or dominate the planner's arithmetic.
MAX_TIME_MS = 1e7  # about 2.8 hours for one layer's pass over one minibatch
MAX_BYTES = 1e15  # a petabyte for one layer's activations or parameters
_LIMITS = {
    "forward_compute_time": (MAX_TIME_MS, "ms"),
    "backward_compute_time": (MAX_TIME_MS, "ms"),
    "activation_size": (MAX_BYTES, "bytes"),
    "parameter_size": (MAX_BYTES, "bytes"),
}
_FIELDS = tuple(_LIMITS)
_HINT = "pass an unmodified PipeDream graph.txt"


def _number(text: str, path: str, lineno: int, what: str) -> float:
    """A field's value: a finite number >= 0 and no more than the field's plausible bound."""
    high, unit = _LIMITS[what]
    must = f"must be a finite number >= 0 and <= {high:g} ({unit})"
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{path}:{lineno}: {what} is {quote(text.strip())}: not a number; {must}", _HINT) from None
    if not math.isfinite(value) or value < 0 or value > high:
        raise UserError(f"{path}:{lineno}: {what} is {quote(text.strip())}: {must}", _HINT)
    return value


def _activation(text: str, path: str, lineno: int) -> float:
    """activation_size: one number, or a list `[a; b; ...]` of them (summed), within the same bound."""
    if not text.startswith("["):
        return _number(text, path, lineno, "activation_size")
    if not text.endswith("]"):
        raise UserError(f"{path}:{lineno}: activation_size is {quote(text)}: a list must be '[a; b; ...]'", _HINT)
    items = [x for x in text[1:-1].split(";") if x.strip()]
    total = sum(_number(x, path, lineno, "activation_size") for x in items)
    if total > MAX_BYTES:
        raise UserError(f"{path}:{lineno}: activation_size is {quote(text)}: its sum {total:g} must be "
                        f"<= {MAX_BYTES:g} (bytes)", _HINT)
    return total


def _node_line_error(path: str, lineno: int, line: str) -> UserError:
    """Why a node line does not parse: a missing field by name when one is, else the line itself (shortened)."""
    if " -- " in line:
        for f in _FIELDS:
            if f"{f}=" not in line:
                return UserError(f"{path}:{lineno}: {f} is missing from node line {quote(line)}", _HINT)
            if re.search(rf"{f}=\s*(,|$)", line):
                return UserError(f"{path}:{lineno}: {f} has no value in node line {quote(line)}", _HINT)
    return UserError(f"{path}:{lineno}: not a PipeDream node line: {quote(line)}",
                     "each node line is 'nodeN -- <description> -- forward_compute_time=<ms>, "
                     "backward_compute_time=<ms>, activation_size=<bytes>, parameter_size=<bytes>'")


def parse_pipedream(
    text: str, path: str = "<graph.txt>"
) -> tuple[dict[str, tuple[str, float, float, float, float]], list[tuple[str, str]]]:
    """-> ({node_id: (desc, fwd_ms, bwd_ms, act_bytes, param_bytes)}, [(src, dst)]), file order."""
    nodes: dict[str, tuple[str, float, float, float, float]] = {}
    edges: list[tuple[str, str, int]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if raw.startswith("\t"):
            parts = raw.strip().split(" -- ")
            if len(parts) != 2 or not all(x.strip() for x in parts):
                raise UserError(f"{path}:{lineno}: edge line {quote(raw.strip())} must be 'nodeA -- nodeB'",
                                "pass a PipeDream graph.txt")
            edges.append((parts[0].strip(), parts[1].strip(), lineno))
            continue
        line = raw.strip()
        node_id, sep, rest = line.partition(" -- ")
        m = _META.search(rest)
        if not sep or m is None or not node_id.strip():
            raise _node_line_error(path, lineno, line)
        desc = rest[: m.start()].rstrip()
        desc = desc[: -len("--")].rstrip() if desc.endswith("--") else desc
        act = _activation(m.group("a").strip(), path, lineno)
        if node_id in nodes:
            raise UserError(f"{path}:{lineno}: node {quote(node_id)} is defined twice", "pass a PipeDream graph.txt")
        nodes[node_id] = (
            desc,
            _number(m.group("f"), path, lineno, "forward_compute_time"),
            _number(m.group("b"), path, lineno, "backward_compute_time"),
            act,
            _number(m.group("p"), path, lineno, "parameter_size"),
        )
    if not nodes:
        raise UserError(f"{path}: no nodes found", "pass a PipeDream profiler graph.txt")
    for src, dst, lineno in edges:
        for end in (src, dst):
            if end not in nodes:
                raise UserError(f"{path}:{lineno}: edge {quote(src)} -- {quote(dst)} names unknown node {quote(end)}",
                                "pass a complete graph.txt")
    return nodes, [(s, d) for s, d, _ in edges]


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
