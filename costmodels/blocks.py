"""Identical blocks cost one trace: trace a few copies of a repeated block, then unroll the graph.

A decoder of 80 identical layers is 80 copies of one block, so exporting, counting
and timing all 80 learns nothing the first few do not already say. The tracer finds
the largest `nn.ModuleList` whose children are structurally identical
(`find_repeated_blocks`), shortens it to `TRACED` children for the duration of the
trace (`shortened`), so the model's own forward runs over three blocks, and then
builds the graph of the whole model from that (`expand`): first block as traced,
middle blocks cloned from the second copy, last block from the third, everything
after the blocks shifted. Three copies, not two, because the first block's
boundary with the code before it and the last block's boundary with the code after
it may differ from a middle block's (what it saves for backward, what reads its
output); the second copy is the one block that has a block on both sides. Children
that are not identical but repeat in groups (Gemma's alternating sliding-window and
full attention) are handled the same way with a group of `period` children as the
block (`Repeat`).

Exported node names are predictable: torch.export names an op after its ATen
packet plus a per-name counter (`linear`, `linear_1`, ...), in execution order, so
block m's `linear_i` is the second copy's `linear_j` with j + (m - 1) * step, where
`step` is how many names of that kind one block uses. `expand` measures the steps
on the traced copies and refuses (`NotRepeated`) whenever what it sees does not
fit this model: copies that differ in any number or name, edges that skip a block,
code after the blocks that reads any but the last, op code between the blocks. docs/tracing.md
says the same for users.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from pipeplan.costmodels.export import VIEW_OPS
from pipeplan.costmodels.graph import Edge, Graph, Layer, SharedParam

MIN_BLOCKS = 4  # below this many blocks (groups), three traced copies save too little to be worth the check
MAX_PERIOD = 8  # the longest group of different blocks looked for (Gemma 3: 6; Jamba: attention every 8 layers)
TRACED = 3  # first, middle and last block: see the module docstring
# Integer attributes whose name says they are the block's own index (HF's layer_idx, Megatron's layer_number).
INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "idx", "index",
                         "block_idx", "block_id", "block_index", "block_num", "i"})
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping attributes
_SUFFIX = re.compile(r"(.*)_(\d+)$")  # torch.fx's name-counter suffix (torch/fx/graph.py, _Namespace)
_CHILD = re.compile(r"(\d+)(?=$|[.:])")  # a child's key after the list's path (`:2`: export's second layer)


class NotRepeated(Exception):
    """The traced copies do not show a plain repetition; the caller traces the whole model instead."""


@dataclass
class Repeat:
    """A ModuleList of `count` children at dotted path `module` that repeat a group of `period` of them; `traced`
    groups are traced.

    `period` is 1 for identical blocks. Gemma 2 and gpt-oss alternate sliding-window and full attention (a group
    of 2), Gemma 3 runs five sliding-window layers to one full one (6). A count that is not a multiple of the
    period ends in `rest` children, the start of one more group (Gemma-3-4B's 34 layers: five groups of six, then
    four), which are traced as they are, with the code after the groups.
    """

    module: str
    count: int
    traced: int = TRACED
    period: int = 1

    @property
    def groups(self) -> int:
        return self.count // self.period

    @property
    def rest(self) -> int:
        return self.count % self.period

    def record(self) -> dict[str, Any]:
        """What `graph.source["repeated_blocks"]` says."""
        out: dict[str, Any] = {"module": self.module, "count": self.count, "traced": self.traced}
        if self.period > 1:
            out["period"] = self.period
        return out

    def describe(self) -> str:
        """'model.layers holds 80 identical blocks', or how its blocks repeat, for graph notes."""
        if self.period == 1:
            return f"{self.module} holds {self.count} identical blocks"
        more = f", then {self.rest} more" if self.rest else ""
        return f"{self.module} holds {self.count} blocks, a group of {self.period} repeated {self.groups} times{more}"

    def traced_text(self) -> str:
        """'3' (blocks) or '3 groups (6 blocks)': what the trace ran."""
        if self.period == 1:
            return str(self.traced)
        return f"{self.traced} groups ({self.traced * self.period + self.rest} blocks)"


# ---- finding identical blocks ---------------------------------------------------------------

def _value_signature(value: Any, key: str, seen: set[int], depth: int) -> Any:
    """A comparable form of one attribute value; a block's own index (by attribute name) is left out."""
    if isinstance(value, bool) or value is None or isinstance(value, (float, str, bytes)):
        return value
    if isinstance(value, int):
        return "<index>" if key in INDEX_NAMES else value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if isinstance(value, torch.Tensor):  # a plain tensor attribute (not a buffer): shape, dtype and small values
        return ("tensor", tuple(value.shape), str(value.dtype), _small_values(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_signature(v, key, seen, depth) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _value_signature(v, str(k), seen, depth)) for k, v in value.items())))
    if isinstance(value, functools.partial):  # one per block, made alike (transformers' GELUTanh: gelu, tanh)
        return ("partial", _value_signature(value.func, key, seen, depth),
                _value_signature(value.args, key, seen, depth), _value_signature(value.keywords, key, seen, depth))
    if isinstance(value, torch.nn.Module):
        return ("module", id(value))  # a module held as a plain attribute: the very same object, or not identical
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and depth < 3 and id(value) not in seen and not callable(value):
        seen = seen | {id(value)}  # a config object: equal contents are as good as the same object
        return (type(value).__qualname__, _value_signature(attrs, key, seen, depth + 1))
    return ("object", type(value).__qualname__, id(value))  # functions, enums-by-identity, anything opaque


def _small_values(t: torch.Tensor) -> Any:
    """A small tensor's values, when it has real ones (not on the meta device, not a fake tensor)."""
    if t.numel() > 64:
        return None
    try:
        return t.detach().cpu().tolist()
    except Exception:  # meta and fake tensors have no values: shape and dtype must do
        return None


def module_signature(module: torch.nn.Module) -> tuple[Any, ...]:
    """Structure of a block: classes, parameter/buffer names, shapes, dtypes, grad flags, other attributes.

    Two blocks with equal signatures run the same code on the same shapes, so one trace
    stands for both. Integers named like a block index (`INDEX_NAMES`) are the one
    difference allowed: HF decoder layers keep `layer_idx` for the KV cache only.
    """
    parts: list[Any] = []
    for name, m in module.named_modules():
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, None if b is None else (tuple(b.shape), str(b.dtype)), n in m._non_persistent_buffers_set)
                        for n, b in m._buffers.items())
        attrs = {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
        hooks = tuple(len(v) for k, v in vars(m).items() if k.endswith("hooks") and isinstance(v, dict))
        parts.append((name, type(m).__module__, type(m).__qualname__, m.training, params, buffers, hooks,
                      _value_signature(attrs, "", set(), 0)))
    return tuple(parts)


def _shares_tensors(model: torch.nn.Module, children: list[torch.nn.Module]) -> bool:
    """True when a child's parameter or buffer is also reachable elsewhere (tied across blocks or with the model)."""
    inside: list[int] = [id(t) for c in children for t in [*c.parameters(), *c.buffers()]]
    if len(set(inside)) != len(inside) or len({id(c) for c in children}) != len(children):
        return True
    owned = set(inside)
    everywhere = [id(t) for _, t in [*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)]]
    return sum(1 for t in everywhere if t in owned) != len(inside)


def find_repeated_blocks(model: torch.nn.Module, min_blocks: int = MIN_BLOCKS) -> Repeat | None:
    """The ModuleList of at least `min_blocks` repeated blocks (or groups) that covers the most modules, or None.

    Its children must repeat the signatures of the first `period` of them (`_period`), and own
    their tensors (no weight tied between blocks): runs of identical blocks inside a list that
    otherwise does not repeat are not grouped, the whole list is traced as it is.
    """
    best: Repeat | None = None
    best_size = 0
    for path, m in model.named_modules():
        if not path or not isinstance(m, torch.nn.ModuleList) or len(m) < min_blocks:
            continue
        children = list(m)
        size = sum(1 for c in children for _ in c.modules())
        if size <= best_size:
            continue
        period = _period([module_signature(c) for c in children], min_blocks)
        if period is not None and not _shares_tensors(model, children):
            best, best_size = Repeat(module=path, count=len(children), period=period), size
    return best


def _period(signatures: list[tuple[Any, ...]], min_blocks: int) -> int | None:
    """The shortest p (up to MAX_PERIOD) where every child i has child (i mod p)'s signature and there are at least
    `min_blocks` whole groups of p; None when there is none."""
    for p in range(1, MAX_PERIOD + 1):
        if len(signatures) // p < min_blocks:
            return None
        if all(signatures[i] == signatures[i % p] for i in range(p, len(signatures))):
            return p
    return None


@contextmanager
def shortened(model: torch.nn.Module, repeat: Repeat) -> Iterator[torch.nn.Module]:
    """The model with `repeat.module` cut to its first `repeat.traced` groups (and the `rest` after the last
    group); restored on exit.

    The list is shortened in place, so the model's own forward (a `for block in
    self.h` loop, HF's `self.layers[:n]`) runs over the traced blocks only, and the
    parameters of the others are out of `named_parameters()` for the trace. The rest
    keep their keys, so their layers have the whole model's names already; a forward
    that looks a block's kind up by its position (`layer_types[i]`) sees the same kind
    there, since the cut is a whole number of groups.
    """
    lst = model.get_submodule(repeat.module)
    original = lst._modules
    keys = list(original)
    kept = keys[:repeat.traced * repeat.period] + keys[repeat.groups * repeat.period:]
    lst.__dict__["_modules"] = {k: original[k] for k in kept}
    try:
        yield model
    finally:
        lst.__dict__["_modules"] = original


# ---- the traced copies and how names move from one block to the next -------------------------

def _split_name(name: str) -> tuple[str, int]:
    """'linear_13' -> ('linear', 13), 'linear' -> ('linear', 0): torch.fx's counter suffix."""
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _join_name(base: str, num: int) -> str:
    return base if num == 0 else f"{base}_{num}"


class _Layout:
    """Which traced layers are before the blocks (P), in copy j, or after them (T); name steps per block."""

    def __init__(self, graph: Graph, repeat: Repeat, module_of: Mapping[str, str] | None = None):
        self.graph, self.repeat, self.k = graph, repeat, repeat.traced
        self.module_of = module_of or {}  # node name -> the module it ran under (export.module_paths)
        self.copy_of: dict[str, int] = {}  # layer name -> traced copy it belongs to
        copies: list[list[Layer]] = [[] for _ in range(self.k)]
        first = last = None
        for i, layer in enumerate(graph.layers):
            j = self._copy(layer)
            if j is None:
                continue
            if copies[j] == [] and j > 0 and not copies[j - 1]:
                raise NotRepeated(f"block {j} runs before block {j - 1}")
            copies[j].append(layer)
            self.copy_of[layer.name] = j
            first = i if first is None else first
            last = i
        if first is None or last is None or any(not c for c in copies):
            raise NotRepeated("the traced blocks do not all appear in the program")
        if [graph.index(layer.name) for c in copies for layer in c] != list(range(first, last + 1)):
            raise NotRepeated("other code runs between the blocks, or the blocks interleave")
        if len({len(c) for c in copies}) != 1:
            raise NotRepeated(f"the traced blocks have {', '.join(str(len(c)) for c in copies)} layers")
        self.copies = copies
        self.pre, self.post = graph.layers[:first], graph.layers[last + 1:]
        self.post_names = {layer.name for layer in self.post}
        self.trailing = self._trailing()
        self.step = self._steps()

    def _child(self, path: str) -> int | None:
        """The index of the list's child a module path, layer or parameter name is in (None: outside the list)."""
        head = self.repeat.module + "."
        found = _CHILD.match(path, len(head)) if path.startswith(head) else None
        return int(found.group(1)) if found else None

    def _copy(self, layer: Layer) -> int | None:
        return self._copy_of_path(layer.module)

    def _copy_of_path(self, module: str) -> int | None:
        """The traced copy (group) a module path is in (None: outside the traced groups, the rest included)."""
        c = self._child(module)
        return None if c is None or c >= self.k * self.repeat.period else c // self.repeat.period

    def rename_path(self, path: str, j: int, m: int) -> str:
        """'model.layers.1.mlp' (copy j=1) -> 'model.layers.7.mlp' (block m=7): the child moves m - j groups;
        other paths unchanged."""
        c = self._child(path)
        if c is None or self._copy_of_path(path) != j:
            return path
        head = f"{self.repeat.module}.{c}"
        return f"{self.repeat.module}.{c + (m - j) * self.repeat.period}{path[len(head):]}"

    def _steps(self) -> dict[str, int]:
        """Names of each kind one block uses, measured between copies; they must agree everywhere."""
        step: dict[str, int] = {}
        for pos, layer1 in enumerate(self.copies[1]):
            rows = self._aligned(pos)
            if any(len(r) != len(layer1.nodes) for r in rows):
                raise NotRepeated(f"block layers differ in op count at {layer1.name}")
            for names in zip(*rows, strict=True):
                split = [_split_name(n) for n in names]
                if len({b for b, _ in split}) != 1:
                    raise NotRepeated(f"blocks run different ops: {', '.join(names)}")
                deltas = {split[j + 1][1] - split[j][1] for j in range(self.k - 1)}
                base = split[0][0]
                if len(deltas) != 1 or step.setdefault(base, deltas.pop()) != split[1][1] - split[0][1]:
                    raise NotRepeated(f"op names do not advance evenly from block to block at {names[0]}")
        self._check_quiet_bases(step)
        return step

    def _boundary_nodes(self, j: int, pos: int) -> list[str]:
        """Copy j's node names in its layer `pos`, less the views that only a boundary copy has (`_aligned`)."""
        nodes = self.copies[j][pos].nodes
        if j not in (0, self.k - 1):
            return list(nodes)
        middle = {_split_name(n)[0] for n in self.copies[1][pos].nodes}
        return [n for n in nodes if _split_name(n)[0] in middle or _split_name(n)[0] not in VIEW_OPS]

    def _trailing(self) -> int:
        """How many nodes end the last copy's last layer beyond the middle copy's: the code after the block loop.

        Code that runs after the loop and has no module of its own (a masked mean pooling: `mul`, `sum`, `div`)
        is glue, which export.group_nodes folds into the layer before it: the last block's last layer. The whole
        model's export does the same, and its last block is cloned from the last copy, trailing ops and all; only
        the checks that the last copy is the middle one's twin must leave them out. Only ops that ran outside
        every block (`module_of`) count: an op of the last copy's own is a block that differs (0: the checks
        refuse it).
        """
        last_pos = len(self.copies[1]) - 1
        nodes = self._boundary_nodes(self.k - 1, last_pos)
        extra = len(nodes) - len(self.copies[1][last_pos].nodes)
        if extra <= 0 or not all(n in self.module_of and self._copy_of_path(self.module_of[n]) is None
                                 for n in nodes[-extra:]):
            return 0
        return extra

    def _aligned(self, pos: int) -> list[list[str]]:
        """Each copy's node names in its layer `pos`, less the views that only a boundary copy has (and, in the last
        layer, the last copy's code after the loop: `_trailing`).

        Code before or after the blocks may take a view of the first or last block's tensor, and torch.export
        files that view (a node that runs no kernel) under the layer that made the tensor: transformers'
        BertLMHeadModel slices the last block's hidden states for its head (`slice_logits_to_keep`, a full slice
        exported as `aten.alias`). A middle copy has a block on both sides and no such view; the unrolled first
        and last blocks are cloned from the first and last copies, views and all, where the whole model's export
        has them too (tests/test_blocks.py holds the unrolled graph against that export).
        """
        rows = [self._boundary_nodes(j, pos) for j in range(self.k)]
        if pos == len(self.copies[1]) - 1 and self.trailing:  # the code after the loop (`_trailing`)
            rows[-1] = rows[-1][:-self.trailing]
        return rows

    def _check_quiet_bases(self, step: dict[str, int]) -> None:
        """An op kind not seen in the blocks must not have a hole in its numbering there (a removed node).

        A hole would mean the blocks used up names of that kind that the unrolled graph
        cannot account for, and the names after the blocks would be guessed wrong.
        """
        last_before: dict[str, int] = {}
        after_loop = self._boundary_nodes(self.k - 1, len(self.copies[1]) - 1)[-self.trailing:] if self.trailing else []
        for n in [n for layer in self.pre for n in layer.nodes] + after_loop:  # the names used before `post`'s
            b, num = _split_name(n)
            last_before[b] = max(last_before.get(b, -1), num)
        first_after: dict[str, int] = {}
        for layer in self.post:
            for n in layer.nodes:
                b, num = _split_name(n)
                first_after.setdefault(b, num)
        for b, num in first_after.items():
            if b not in step and num != last_before.get(b, -1) + 1:
                raise NotRepeated(f"op name {_join_name(b, num)} after the blocks skips names the blocks may have "
                                  "used up")

    def shift(self, name: str, blocks: int) -> str:
        """The node name `blocks` blocks later (0: unchanged)."""
        base, num = _split_name(name)
        return _join_name(base, num + blocks * self.step.get(base, 0)) if blocks else name

    # ---- checks: the copies are one block -------------------------------------------------

    def check(self) -> None:
        """Copies 1 and 2 agree on everything measured; copy 0 on everything but its boundary costs; edges too.
        Where code after the loop ends copy 2's last layer (`_trailing`), that layer's costs include the code, so
        only its names and ops (`_aligned`) are held against copy 1's; copy 0's costs still are."""
        last = len(self.copies[1]) - 1
        for pos, (l0, l1, l2) in enumerate(zip(*self.copies, strict=True)):
            tail_fields = () if pos == last and self.trailing else _BLOCK_FIELDS + _BOUNDARY_FIELDS
            for j, other, fields in ((0, l0, _BLOCK_FIELDS), (2, l2, tail_fields)):
                if self.rename_path(other.name, j, 1) != l1.name or self.rename_path(other.module, j, 1) != l1.module:
                    raise NotRepeated(f"block layers differ: {other.name} vs {l1.name}")
                if [self.rename_path(p, j, 1) for p in other.params] != l1.params:
                    raise NotRepeated(f"block layers read different parameters: {other.name} vs {l1.name}")
                diff = [f for f in fields if getattr(other, f) != getattr(l1, f)]
                if diff:
                    raise NotRepeated(f"{other.name} and {l1.name} differ in {', '.join(diff)}")
            if l0.output_bytes != l1.output_bytes:
                raise NotRepeated(f"{l0.name} and {l1.name} differ in output_bytes")
        if self._in_pattern(1) != self._in_pattern(2):
            raise NotRepeated("the second and third block are wired differently (an edge skips a block, or one "
                              "block reads what another does not)")
        for e in self.graph.edges:
            src_copy = self.copy_of.get(e.src)
            if src_copy is not None and src_copy < self.k - 1 and e.dst in self.post_names:
                raise NotRepeated(f"code after the blocks reads block {src_copy} ({e.src} -> {e.dst}), not only "
                                  "the last")

    def _in_pattern(self, j: int) -> set[tuple[Any, ...]]:
        """Edges into copy j, with sources relative to it: ('B', blocks back, layer in copy 0) or ('P', name)."""
        out: set[tuple[Any, ...]] = set()
        for e in self.graph.edges:
            if self.copy_of.get(e.dst) != j:
                continue
            js = self.copy_of.get(e.src)
            if js is None:
                src: tuple[Any, ...] = ("P", e.src)
                tensors = tuple(sorted(e.tensors))
            else:
                src = ("B", j - js, self.rename_path(e.src, js, 0))
                tensors = tuple(sorted(self.shift(t, -js) for t in e.tensors))
            out.add((self.rename_path(e.dst, j, 0), src, tensors, e.bytes))
        return out

    # ---- unrolling ------------------------------------------------------------------------

    def _clone(self, layer: Layer, j: int, m: int) -> Layer:
        """Copy j's layer as block m's: module paths, parameter names and node names moved m - j blocks."""
        return replace(layer, name=self.rename_path(layer.name, j, m), module=self.rename_path(layer.module, j, m),
                       params=[self.rename_path(p, j, m) for p in layer.params],
                       frozen_params=[self.rename_path(p, j, m) for p in layer.frozen_params],
                       nodes=[self.shift(n, m - j) for n in layer.nodes],
                       outputs={self.shift(t, m - j): b for t, b in layer.outputs.items()})

    def _after(self, layer: Layer, n: int) -> Layer:
        """A layer after the blocks: same name, node names moved past n - k more blocks."""
        return replace(layer, params=list(layer.params), frozen_params=list(layer.frozen_params),
                       nodes=[self.shift(x, n - self.k) for x in layer.nodes],
                       outputs={self.shift(t, n - self.k): b for t, b in layer.outputs.items()})

    def unrolled(self, n: int) -> list[_Unrolled]:
        """The full model's layers in order: (layer, traced origin, origin copy, block) ."""
        out = [_Unrolled(replace(x, params=list(x.params), frozen_params=list(x.frozen_params), nodes=list(x.nodes),
                                 outputs=dict(x.outputs)), x, None, None) for x in self.pre]
        for m in range(n):
            j = 0 if m == 0 else self.k - 1 if m == n - 1 else 1
            out.extend(_Unrolled(self._clone(x, j, m), x, j, m) for x in self.copies[j])
        out.extend(_Unrolled(self._after(x, n), x, None, None) for x in self.post)
        return out

    def edges(self, full: list[_Unrolled], n: int) -> list[Edge]:
        """Every traced copy's in-edges, replayed for each block it stands for; sorted as export.py sorts."""
        into: dict[str, list[Edge]] = {}
        for e in self.graph.edges:
            into.setdefault(e.dst, []).append(e)
        index = {u.layer.name: i for i, u in enumerate(full)}
        out: list[tuple[int, int, Edge]] = []
        for u in full:
            for e in into.get(u.origin.name, []):
                js = self.copy_of.get(e.src)
                if js is not None:
                    mb = js + (n - self.k) if u.block is None or u.copy is None else u.block - (u.copy - js)
                    src, tensors = self.rename_path(e.src, js, mb), [self.shift(t, mb - js) for t in e.tensors]
                elif e.src in self.post_names:
                    src, tensors = e.src, [self.shift(t, n - self.k) for t in e.tensors]
                else:
                    src, tensors = e.src, list(e.tensors)
                out.append((index[src], index[u.layer.name], Edge(src, u.layer.name, e.bytes, sorted(tensors))))
        out.sort(key=lambda t: (t[0], t[1]))
        return [e for _, _, e in out]

    def shared(self, full: list[_Unrolled], n: int) -> list[SharedParam]:
        """Shared parameters: a model-level one gains every block that reads it; a block's own, one per block."""
        out: list[SharedParam] = []
        inserted = False
        for sp in self.graph.shared_params:
            if self._copy_of_path(sp.name) is None:
                users = set(sp.layers)
                out.append(SharedParam(sp.name, sp.bytes, [u.layer.name for u in full if u.origin.name in users]))
            elif not inserted:
                inserted = True
                for m in range(n):
                    j = 0 if m == 0 else self.k - 1 if m == n - 1 else 1
                    out.extend(SharedParam(self.rename_path(s.name, j, m), s.bytes,
                                           [self.rename_path(x, j, m) for x in s.layers])
                               for s in self.graph.shared_params if self._copy_of_path(s.name) == j)
        return out


class _Unrolled(NamedTuple):
    layer: Layer  # the full model's layer
    origin: Layer  # the traced layer it was made from
    copy: int | None  # which traced copy the origin is in (None: before or after the blocks)
    block: int | None  # the block it is in (None: before or after the blocks)


# Fields every copy of a block layer must agree on; the first copy may differ in _BOUNDARY_FIELDS, since
# what it saves for backward and its backward work can depend on the code before the blocks.
_BLOCK_FIELDS = ("kind", "fwd_flops", "param_bytes", "frozen_param_bytes", "bytes_moved")
_BOUNDARY_FIELDS = ("bwd_flops", "saved_bytes")


def expand(graph: Graph, repeat: Repeat, module_of: Mapping[str, str] | None = None) -> Graph:
    """The graph of the whole model (repeat.groups blocks) from the one traced with repeat.traced blocks.

    Raises NotRepeated when the traced copies do not show one block repeated (see
    `_Layout.check`); the caller then traces the whole model. Times are the traced
    copies' own: middle blocks get the second copy's, the last block the third's.
    `module_of` (export.module_paths of the traced program) lets code after the loop
    end the last block's last layer (`_Layout._trailing`); without it that is refused.
    """
    layout = _Layout(graph, repeat, module_of)
    layout.check()
    n = repeat.groups
    full = layout.unrolled(n)
    inputs = {name: [u.layer.name for u in full if u.origin.name in readers]
              for name, readers in graph.inputs.items()}
    layers = [u.layer for u in full]
    traced_saved = sum(x.saved_bytes for x in graph.layers)
    return Graph(name=graph.name, layers=layers, edges=layout.edges(full, n), batch_size=graph.batch_size,
                 dtype=graph.dtype, input_bytes=graph.input_bytes, inputs=inputs,
                 shared_params=layout.shared(full, n),
                 peak_activation_bytes=graph.peak_activation_bytes - traced_saved + sum(x.saved_bytes for x in layers),
                 source=dict(graph.source), notes=list(graph.notes))


def expand_node_values(graph: Graph, repeat: Repeat, values: dict[str, Any],
                       module_of: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per-node data of the traced program (FLOPs, op families) under the whole model's node names."""
    layout = _Layout(graph, repeat, module_of)
    out: dict[str, Any] = {}
    for u in layout.unrolled(repeat.groups):
        for new, old in zip(u.layer.nodes, u.origin.nodes, strict=True):
            if old in values:
                out[new] = values[old]
    return out


def expand_module_counts(counts: Mapping[str, Mapping[str, int]], repeat: Repeat) -> dict[str, dict[str, int]]:
    """Per-module op counts of the model cut to its traced groups (`shortened`), as the whole model's: every
    block of a cloned group gets its traced copy's counts under its own path (the first group the first copy's,
    middle groups the second's, the last group the third's, as `expand` clones layers), and the list and the
    modules holding it gain the middle groups' counts once per group not traced. `counts` maps a module path
    ('' the root) to op -> count, as fvcore's by_module_and_operator does (costmodels/fvcheck.py)."""
    head, p, n, k = repeat.module + ".", repeat.period, repeat.groups, repeat.traced
    out: dict[str, dict[str, int]] = {}
    middle: dict[str, int] = {}
    for o in range(p):
        for op, v in counts.get(f"{head}{p + o}", {}).items():
            middle[op] = middle.get(op, 0) + v
    for path, ops in counts.items():
        child, _, tail = path[len(head):].partition(".") if path.startswith(head) else ("", "", "")
        if child.isdigit() and int(child) < k * p:  # a traced block: to every block cloned from it
            j, o = divmod(int(child), p)
            targets = [0] if j == 0 else [n - 1] if j == k - 1 else range(1, n - 1)
            for m in targets:
                out[f"{head}{m * p + o}" + (f".{tail}" if tail else "")] = dict(ops)
        elif path == repeat.module or path == "" or repeat.module.startswith(path + "."):
            out[path] = {op: ops.get(op, 0) + (n - k) * middle.get(op, 0) for op in {*ops, *middle}}
        else:  # outside the list, or a rest block (it keeps its own key in the shortened list)
            out[path] = dict(ops)
    return out


class Measured(NamedTuple):
    """What the tracer measures on one program: the graph and the per-node data the fvcore check needs (and,
    for the traced copies of a block, the module each node ran under: `expand`)."""

    graph: Graph
    node_flops: dict[str, int]
    family: dict[str, str | None]
    module_of: Mapping[str, str] | None = None


def measure_once_per_block(model: torch.nn.Module, measure: Callable[[torch.nn.Module], Measured], *,
                           enabled: bool = True) -> Measured:
    """`measure(model)` on a few copies of the model's repeated block, unrolled; the whole model when that fails.

    Falls back (with a note in graph.notes) when the shortened model does not trace
    (a forward that indexes blocks by a count of its own), when the copies differ, or
    when the unrolled graph's parameter bytes are not the whole model's.
    """
    repeat = find_repeated_blocks(model) if enabled else None
    if repeat is None:
        return measure(model)
    try:
        with shortened(model, repeat):
            short = measure(model)
        graph = expand(short.graph, repeat, short.module_of)
        _check_params(graph, model)
        result = Measured(graph, expand_node_values(short.graph, repeat, short.node_flops, short.module_of),
                          expand_node_values(short.graph, repeat, short.family, short.module_of))
    except Exception as e:  # anything: the whole-model trace below is the answer, and says why in a note
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        full = measure(model)
        full.graph.notes.append(f"{repeat.describe()}, but tracing {repeat.traced_text()} of them did not stand "
                                f"for all ({reason}); the whole model was traced")
        return full
    graph.source["repeated_blocks"] = repeat.record()
    graph.notes.append(f"{repeat.describe()}: {repeat.traced_text()} were traced and the others cloned from them "
                       "(docs/tracing.md)")
    return result


def _check_params(graph: Graph, model: torch.nn.Module) -> None:
    """The unrolled layers own exactly the whole model's parameters; restates the unused-parameter note for it."""
    named = dict(model.named_parameters(remove_duplicate=False))
    unique: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for fqn, p in named.items():
        unique.setdefault(id(p), (fqn, p))
    total = sum(p.numel() * p.element_size() for _, p in unique.values())
    if graph.param_bytes != total:
        raise NotRepeated(f"unrolled parameter bytes {graph.param_bytes} != the model's {total}")
    frozen = sum(p.numel() * p.element_size() for _, p in unique.values() if not p.requires_grad)
    if graph.frozen_param_bytes != frozen:
        raise NotRepeated(f"unrolled frozen parameter bytes {graph.frozen_param_bytes} != the model's {frozen}")
    used = {id(named[f]) for layer in graph.layers for f in layer.params if f in named}
    unused = [fqn for pid, (fqn, _) in unique.items() if pid not in used]
    marker = " parameter(s) are not used by forward() (e.g. "
    for i, note in enumerate(graph.notes):
        if marker in note and unused:  # export.py's wording, with the whole model's count and first name
            graph.notes[i] = (f"{len(unused)}{marker}{unused[0]}); their bytes are charged to the layer of their "
                              "module, or to the first layer")


# ---- one layer per block for very large models ------------------------------------------------

MAX_LEAF_LAYERS = 256
"""Above this many leaf modules, a model with repeated blocks is traced one layer per block.

Why: the partitioner's work grows with the layer count (a 70B decoder has ~800 leaf modules,
~80 blocks), and for such models a cut inside a block buys next to nothing: a block is
~1/80 of the model, and the frameworks plans are taken to (Megatron-LM, torchtitan) cut
at block boundaries only. Every bundled example has fewer leaves and keeps leaf layers.
"""


def block_depth(model: torch.nn.Module, repeat: Repeat) -> int:
    """The module depth (as `--depth` counts it) at which each repeated block is one layer.

    `--depth` counts the modules an op runs under, outermost first; containers
    (ModuleList, ModuleDict) are never called, so they do not count.
    """
    parts = f"{repeat.module}.0".split(".")
    depth = 0
    for i in range(1, len(parts) + 1):
        if not isinstance(model.get_submodule(".".join(parts[:i])), (torch.nn.ModuleList, torch.nn.ModuleDict)):
            depth += 1
    return depth


def coarse_depth(model: torch.nn.Module, max_leaf_layers: int | None = None) -> tuple[int, str] | None:
    """(depth, note) when the model is large enough to trace one layer per repeated block, else None."""
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    if leaves <= (MAX_LEAF_LAYERS if max_leaf_layers is None else max_leaf_layers):
        return None
    repeat = find_repeated_blocks(model)
    if repeat is None:
        return None
    depth = block_depth(model, repeat)
    return depth, (f"{leaves} leaf modules: traced one layer per block of {repeat.module} (--depth {depth}), "
                   f"so stages are cut between blocks; pass --depth to choose another grouping")
