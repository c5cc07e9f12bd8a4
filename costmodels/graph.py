"""The layer graph: the one data structure every later stage reads.

A `Graph` is a DAG of `Layer`s listed in execution (topological) order. Layers
carry what was measured on the tracing machine; edges carry the tensors that
flow between layers. The JSON form (`pipeplan.graph/v1`, see docs/graph-format.md)
is the contract with other tools, so it is written and read here and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pipeplan._io import atomic_write_json, check_format, read_json
from pipeplan.errors import UserError

if TYPE_CHECKING:
    import networkx as nx  # no type information: DiGraph is Any to mypy

_COUNTER = re.compile(r"_\d+$")  # torch.fx's per-name counter (`linear_7`; torch/fx/graph.py, _Namespace)


def _structure_hash(structure: dict[str, Any]) -> str:
    """The fingerprints' hash of a JSON-able structure."""
    blob = json.dumps(structure, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]

GRAPH_FORMAT = "pipeplan.graph/v1"
# Layer.autocast: the devices whose torch.autocast lists a trace replays, and the byte counts it keeps for each
# (each means what the Layer field of the same name means; costmodels/autocast_bytes.py)
AUTOCAST_DEVICES = ("cuda", "cpu")
AUTOCAST_FIELDS = ("saved_bytes", "output_bytes", "transient_bytes", "deferred_grad_bytes", "loss_saved_bytes",
                   "nonweight_saved_bytes", "input_saved_bytes", "input_nonweight_saved_bytes")
AUTOCAST_OPTIONAL = ("input_saved_bytes", "input_nonweight_saved_bytes")  # of those, absent from older files: 0

# Kinds of op a layer is dominated by; the roofline uses one efficiency per kind.
LAYER_KINDS = ("matmul", "conv", "attention", "embedding", "norm", "elementwise", "other")

# Finer kinds for a layer's cost parts (`CostPart`): a layer of one kind holds ops of several, and each is
# priced by its own roofline. conv3x3: a dense 3x3 stride-1 convolution, which cuDNN may run by Winograd's
# algorithm with fewer multiplies than its direct FLOPs; dropout: writes a mask beside its output.
PART_KINDS = (*LAYER_KINDS, "conv3x3", "dropout")


@dataclass(frozen=True)
class CostPart:
    """The ops of one kind inside a layer, summed: what a per-op roofline needs without the ops themselves.

    A grouped layer (a whole decoder block) is one `kind` for display, but its norms,
    residual adds and activations move bytes while its GEMMs compute; pricing the block
    by one max(FLOPs, bytes) hides the memory-bound ops under the GEMMs' FLOPs. `ops`
    counts the kernels (views excluded) for the per-kernel overheads, and `param_bytes`
    the weight bytes those ops read, which do not grow with the batch.
    """

    kind: str
    fwd_flops: int = 0
    bwd_flops: int = 0
    bytes_moved: int = 0  # one forward's traffic of these ops, inputs + outputs + weights read
    param_bytes: int = 0  # of bytes_moved: parameter reads
    ops: int = 0
    # Convolutions only: input + output bytes of the ones traced channels-first (NCHW), which cuDNN's tensor-core
    # kernels transpose to NHWC and back (costmodels/part_costs.layout_traffic); 0 for channels-last (NHWC) ones.
    layout_bytes: int = 0
    # Convolutions: min(output channels, input channels per group), FLOP-weighted over the part's convolutions;
    # a narrow convolution fills few of a kernel tile's columns. Norms: the channels of its channels-first batch
    # norms, byte-weighted; one thread block reduces each channel (part_costs.channel_factor). 0 where unknown.
    channels: int = 0


@dataclass
class Layer:
    name: str
    kind: str = "other"
    module: str = ""  # dotted module path (nn_module_stack), "" for glue-only layers
    fwd_flops: int = 0
    bwd_flops: int = 0
    param_bytes: int = 0  # parameters owned by this layer; a shared parameter is owned by its first user
    # of param_bytes, parameters that need no gradient (requires_grad False: a frozen backbone, an adapter's base):
    # they hold weights but no gradient, optimizer state or all-reduce (costmodels/memory.py, `model_state_bytes`)
    frozen_param_bytes: int = 0
    output_bytes: int = 0  # sum of `outputs`
    saved_bytes: int = 0  # bytes autograd saves for backward during this layer's forward
    # peak bytes of the tensors in flight while its ops run (outputs not yet read, gradients passed on; the loss's
    # on the last layer), beyond saved tensors and model state (costmodels/transient.py); 0: not traced
    transient_bytes: int = 0
    # bytes of the gradients of its weight ops' outputs, which a split backward's input pass (zero bubble's B) keeps
    # for the weight pass W (costmodels/transient.py, `_DeferredGrads`); 0: not traced
    deferred_grad_bytes: int = 0
    # of saved_bytes, what the loss saves (the last layer's, which the loss counts as; 0 elsewhere): zero bubble's B
    # on the last stage frees it, not its W (costmodels/transient.py); 0: not traced
    loss_saved_bytes: int = 0
    # of saved_bytes, what its ops other than weight ops save (the loss's aside): a recomputed stage's split backward
    # re-runs them once per parameter group in W and keeps every re-run until W ends (costmodels/transient.py)
    nonweight_saved_bytes: int = 0
    # of saved_bytes, what it saves of tensors earlier layers made, and of that what its ops other than weight ops
    # save: a stage starting at this layer holds it as its received input already (costmodels/memory.py,
    # `stage_memory`; costmodels/transient.py, `saved_inputs`); 0: not traced
    input_saved_bytes: int = 0
    input_nonweight_saved_bytes: int = 0
    fwd_s: float = 0.0  # measured on the tracing machine (median of repeats)
    bwd_s: float = 0.0
    bytes_moved: int = 0  # estimated memory traffic of one forward (inputs + outputs + weights), for the roofline
    outputs: dict[str, int] = field(default_factory=dict)  # tensor name -> bytes, for tensors other layers read
    params: list[str] = field(default_factory=list)  # fully qualified parameter names this layer uses
    # of params, those that need no gradient: no weight-gradient pass, optimizer tensor or W for them
    frozen_params: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # exported-program node names that make up the layer
    parts: list[CostPart] = field(default_factory=list)  # per op kind; empty: priced as one op of `kind`
    bwd_weight_flops: int | None = None  # of bwd_flops, the weight-gradient part (zero bubble's W); None: not split
    bwd_weight_s: float | None = None  # of bwd_s, the measured weight-gradient time W; None: not timed apart
    # Recomputation's re-run stops after the last saved tensor (costmodels/recompute.py): of fwd_s, the time up to
    # this layer's last save, and how many tensors it saves; None: not timed (the re-run is priced as a whole forward).
    last_save_s: float | None = None
    saved_tensors: int | None = None
    # of bwd_s, the in-place adds into existing weight gradients, which a backward into fresh ones (each stage's first
    # of a step) skips (costmodels/accumulate.py); None: not timed (every backward priced as accumulating)
    grad_accumulate_s: float | None = None
    # the byte counts above (AUTOCAST_FIELDS) as a bf16/fp16 step under torch.autocast holds them, per device whose
    # autocast lists were replayed (AUTOCAST_DEVICES); empty: not counted (priced at half the fp32 bytes)
    autocast: dict[str, dict[str, int]] = field(default_factory=dict)


def trainable_params(layer: Layer) -> list[str]:
    """The parameter names a layer uses that get a gradient: what its weight-gradient passes and the optimizer's
    per-tensor work count (a frozen one has neither). Read per layer for every plan the search prices
    (predict_inputs._param_tensors): a layer without frozen parameters returns its own list, not a copy."""
    if not layer.frozen_params:
        return layer.params
    frozen = set(layer.frozen_params)
    return [p for p in layer.params if p not in frozen]


def weight_grad_share(layer: Layer) -> float:
    """The share of a layer's backward that is its weight gradient W (the rest is the input gradient B).

    Traced graphs count it (`bwd_weight_flops`, docs/graph-format.md); for graphs without it the rule is
    half for a layer with parameters, none without: a Linear's (or a convolution's) input gradient and
    weight gradient are each 2*m*n*k FLOPs (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" §2), and a
    layer without weights has no W. It splits a layer's time too where the trace did not time W apart
    (weight_grad_time_share).
    """
    if layer.bwd_weight_flops is not None:
        return min(1.0, layer.bwd_weight_flops / layer.bwd_flops) if layer.bwd_flops > 0 else 0.0
    return 0.5 if layer.param_bytes > 0 else 0.0


def weight_grad_time_share(layer: Layer) -> float:
    """The share of a layer's backward *time* that is W: measured where the trace timed B apart.

    FLOPs misjudge it: a weight gradient reduces over the batch (one large GEMM into a small
    output) while the input gradient writes an activation-sized tensor, so equal FLOPs rarely take
    equal time. `pipeplan trace` times both (costmodels/measure.py, `bwd_weight_s`); graphs without
    the timing (analytic, imported, traced with --no-time) fall back to the FLOP share.
    """
    if layer.bwd_weight_s is not None and layer.bwd_s > 0:
        return min(1.0, max(0.0, layer.bwd_weight_s / layer.bwd_s))
    return weight_grad_share(layer)


@dataclass
class Edge:
    src: str
    dst: str
    bytes: int
    tensors: list[str] = field(default_factory=list)  # names of src's outputs that dst reads


@dataclass
class SharedParam:
    """A parameter used by several layers (e.g. a tied embedding and LM head)."""

    name: str
    bytes: int
    layers: list[str]


@dataclass
class Graph:
    name: str
    layers: list[Layer]
    edges: list[Edge]
    batch_size: int
    dtype: str = "float32"
    input_bytes: int = 0  # bytes of the model inputs for one batch
    inputs: dict[str, list[str]] = field(default_factory=dict)  # input name -> layers that read it
    shared_params: list[SharedParam] = field(default_factory=list)
    peak_activation_bytes: int = 0  # measured peak of saved activations over one training step
    source: dict[str, Any] = field(default_factory=dict)  # model_file, entry, depth, torch version, device, repeats
    notes: list[str] = field(default_factory=list)  # e.g. fvcore vs FlopCounterMode disagreements

    # ---- derived views -------------------------------------------------
    def __post_init__(self) -> None:
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}
        if len(self._index) != len(self.layers):
            raise UserError(f"graph {self.name!r}: duplicate layer names")

    def index(self, name: str) -> int:
        return self._index[name]

    def layer(self, name: str) -> Layer:
        return self.layers[self._index[name]]

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def frozen_param_bytes(self) -> int:
        return sum(layer.frozen_param_bytes for layer in self.layers)

    @property
    def fwd_flops(self) -> int:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> int:
        return sum(layer.bwd_flops for layer in self.layers)

    def totals(self) -> dict[str, int]:
        return {
            "layers": len(self.layers),
            "param_bytes": self.param_bytes,
            "frozen_param_bytes": self.frozen_param_bytes,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "peak_activation_bytes": self.peak_activation_bytes,
            "input_bytes": self.input_bytes,
        }

    def to_networkx(self) -> nx.DiGraph:
        import networkx as nx

        g = nx.DiGraph()
        for layer in self.layers:
            g.add_node(layer.name, layer=layer)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes, tensors=e.tensors)
        return g

    def cut_bytes(self, share: Sequence[float] | None = None) -> list[int]:
        """Bytes live across each cut of the execution order.

        Entry i is the cut between layers i and i+1. A tensor counts once per cut
        it spans (from its producer to its last consumer), however many layers
        beyond the cut read it, so a skip connection over three stages is paid
        on each of the links it crosses. `share`: per layer, a factor on its
        outputs' traced bytes (the step's dtypes, planner/problem.build_problem).
        """
        n = len(self.layers)
        diff = [0] * (n + 1)
        last_use: dict[tuple[int, str], int] = {}
        for e in self.edges:
            s, d = self._index[e.src], self._index[e.dst]
            names = e.tensors or [f"{e.src}:*"]
            for t in names:
                key = (s, t)
                last_use[key] = max(last_use.get(key, s), d)
        for (s, t), d in last_use.items():
            layer = self.layers[s]
            size = layer.outputs.get(t)
            if size is None:  # edge without tensor detail: the whole output crosses
                size = layer.output_bytes
            if share is not None:
                size = int(round(size * share[s]))
            diff[s] += size
            diff[d] -= size
        cuts, run = [], 0
        for i in range(n - 1):
            run += diff[i]
            cuts.append(run)
        return cuts

    def fingerprint(self) -> str:
        """Hash of the structure (names, nodes, parameters, wiring), not of measurements.

        The runtime re-exports the model at the microbatch size and compares this,
        so batch size, bytes and timings are deliberately left out.
        """
        return _structure_hash({
            "layers": [[l.name, l.nodes, sorted(l.params)] for l in self.layers],
            "edges": sorted([e.src, e.dst, sorted(e.tensors)] for e in self.edges),
        })

    def op_fingerprint(self) -> str:
        """`fingerprint` without torch.fx's name counters: layer names, each layer's op kinds in order and its
        parameters, and which layers feed which, with how many tensors.

        Why a second hash: node names count each kind of op over the whole program (`linear_7`), so a model whose
        code runs two alike computations in an order Python's string hashing picks anew in every process (Gemma
        3's forward computes the rotary embedding once per attention kind, iterating `set(config.layer_types)`)
        numbers its ops differently from one process to the next; the runtime accepts a plan whose graph differs
        from its own export only so (runtime/worker.py), since it cuts the program by layer names.
        """
        return _structure_hash({
            "layers": [[l.name, [_COUNTER.sub("", n) for n in l.nodes], sorted(l.params)] for l in self.layers],
            "edges": sorted([e.src, e.dst, len(e.tensors)] for e in self.edges),
        })

    # ---- JSON ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GRAPH_FORMAT,
            "name": self.name,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "fingerprint": self.fingerprint(),
            "source": self.source,
            "totals": self.totals(),
            "input_bytes": self.input_bytes,
            "inputs": self.inputs,
            "shared_params": [asdict(s) for s in self.shared_params],
            "notes": self.notes,
            "layers": [asdict(l) for l in self.layers],
            "edges": [asdict(e) for e in self.edges],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], path: str | os.PathLike[str] = "<graph>") -> Graph:
        check_format(doc, path, GRAPH_FORMAT)
        from pipeplan.costmodels.graph_check import check_graph_doc

        check_graph_doc(doc, path, LAYER_KINDS, PART_KINDS)
        try:
            layer_keys = {f.name for f in fields(Layer)}
            edge_keys = {f.name for f in fields(Edge)}
            layers = [_layer_from_dict(d, layer_keys) for d in doc["layers"]]
            edges = [Edge(**{k: v for k, v in d.items() if k in edge_keys}) for d in doc["edges"]]
            g = cls(
                name=doc["name"],
                layers=layers,
                edges=edges,
                batch_size=int(doc["batch_size"]),
                dtype=doc.get("dtype", "float32"),
                input_bytes=int(doc.get("input_bytes", 0)),
                inputs=doc.get("inputs", {}),
                shared_params=[SharedParam(**s) for s in doc.get("shared_params", [])],
                peak_activation_bytes=int(doc.get("totals", {}).get("peak_activation_bytes", 0)),
                source=doc.get("source", {}),
                notes=doc.get("notes", []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: malformed graph file ({type(e).__name__}: {e})", "re-run `pipeplan trace`") from None
        names = g._index
        for edge in g.edges:
            if edge.src not in names or edge.dst not in names:
                raise UserError(f"{path}: edge {edge.src} -> {edge.dst} names an unknown layer")
            if names[edge.src] >= names[edge.dst]:
                raise UserError(f"{path}: edge {edge.src} -> {edge.dst} goes against the execution order")
        return g

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_dict())


def backward_free(graph: Graph) -> list[bool]:
    """Per layer, whether its backward runs nothing because a frozen parameter starts a chain without gradients.

    Autograd records an op only if a tensor it reads needs a gradient, so the layers of a frozen prefix (a frozen
    backbone before a trainable head) run no backward at all, where a roofline would charge each a backward pass. A
    layer is such when none of its parameters trains, it saved nothing for backward and counted no backward FLOPs
    (the trace's own sign that autograd recorded nothing), no tied parameter reaches it, and it either holds frozen
    parameters or reads only such layers. A parameter-free layer reading the model's inputs alone stays priced: a
    graph does not record whether those inputs need gradients.
    """
    tied = {name for sp in graph.shared_params for name in sp.layers}
    sources: list[list[int]] = [[] for _ in graph.layers]
    for e in graph.edges:
        sources[graph.index(e.dst)].append(graph.index(e.src))
    free: list[bool] = []
    for i, layer in enumerate(graph.layers):
        quiet = (layer.param_bytes == layer.frozen_param_bytes and not layer.saved_bytes and not layer.bwd_flops
                 and layer.name not in tied)
        free.append(quiet and all(free[j] for j in sources[i])
                    and (layer.frozen_param_bytes > 0 or bool(sources[i])))
    return free


def _layer_from_dict(d: dict[str, Any], layer_keys: set[str]) -> Layer:
    layer = Layer(**{k: v for k, v in d.items() if k in layer_keys})
    layer.parts = [CostPart(**p) for p in d.get("parts", [])]
    return layer


def load_graph(path: str | os.PathLike[str]) -> Graph:
    return Graph.from_dict(read_json(path, "graph file (pipeplan.graph/v1)"), path)
