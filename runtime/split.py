"""Cut an exported program into one module per pipeline stage.

Why not `torch.distributed.pipelining.pipeline()`: its tracer-built stages refuse
skip connections between non-adjacent stages, and its split points are module
boundaries rather than the planner's layers. Here every stage is a plain
`torch.fx.GraphModule` copied out of the unlifted exported graph (`ep.module()`),
so the plan's layers (lists of exported node names) map one to one onto nodes.

Wiring rule (the one thing to understand in this file): the *live-in* set of stage
s is every value (model input or node output) produced before stage s and read
at stage s or later. Stage s takes its live-in set as positional inputs and
returns the live-in set of stage s+1, so a tensor needed three stages downstream
is forwarded by the stages in between. `torch.distributed.pipelining` can then
back-propagate through adjacent stages only, as it requires, and a forwarded
tensor's gradient flows back along the same chain.

Parameters are `get_attr` nodes: each stage copies the ones it reads, so a tied
embedding / LM head ends up held by both stages; the worker sums their gradients
(see `shared_params`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from pipeplan.costmodels.recompute import block_runs
from pipeplan.errors import UserError


@dataclass
class StageInfo:
    """What one stage reads, computes, holds and sends (same on every rank)."""

    index: int
    inputs: list[str]  # value names received, in order (stage 0: the flat model inputs)
    outputs: list[str]  # value names sent downstream (empty for the last stage)
    nodes: list[str]  # call_function node names computed here
    attrs: list[str] = field(default_factory=list)  # get_attr targets (parameter / buffer FQNs)


def unlifted_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """`ep.module()` with parameters as attributes (FQNs as in the original model)."""
    return ep.module()


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def node_stages(gm: fx.GraphModule, layer_nodes: dict[str, list[str]], layer_stage: dict[str, int]) -> dict[str, int]:
    """Stage of every call_function node.

    Nodes the plan lists (through its layers) keep their stage. Glue nodes the
    tracer left out of every layer go to the earliest stage that reads them (so
    constants such as `arange` are made where needed rather than forwarded), but
    never before the stage of anything they read. `getitem` on a multi-output op
    stays with the op, so only tensors ever cross a stage boundary.
    """
    stage: dict[str, int] = {}
    for layer, nodes in layer_nodes.items():
        for name in nodes:
            stage[name] = layer_stage[layer]
    compute = _compute_nodes(gm)
    known = {n.name for n in compute}
    unknown = sorted(set(stage) - known)
    if unknown:
        raise UserError(
            f"the plan's layers name {len(unknown)} node(s) the exported model does not have (e.g. {unknown[0]!r})",
            "re-trace the model and re-plan",
        )
    last = max(layer_stage.values(), default=0)
    # earliest user stage, from the back
    for n in reversed(compute):
        if n.name in stage:
            continue
        user_stages = [stage[u.name] for u in n.users if u.name in stage]
        if any(u.op == "output" for u in n.users):
            user_stages.append(last)
        if user_stages:
            stage[n.name] = min(user_stages)
    # never before a producer; getitem with its producer
    for n in compute:
        producers = [stage[a.name] for a in n.all_input_nodes if a.name in stage]
        floor = max(producers, default=0)
        if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) and n.args[0].name in stage:
            stage[n.name] = stage[n.args[0].name]
        elif n.name not in stage:
            stage[n.name] = floor
        elif stage[n.name] < floor:
            if any(n.name in nodes for nodes in layer_nodes.values()):
                raise UserError(
                    f"node {n.name!r} is planned on stage {stage[n.name]} but reads a value computed on stage {floor}",
                    "the plan's stages must follow the execution order; re-plan",
                )
            stage[n.name] = floor
    return stage


def _baked(node: fx.Node) -> bool:
    """A model input export baked into the program: a Python number (non-strict export specializes it), which
    only ep.module()'s input guard reads. No stage takes it (torch's stages take tensors only), and it is not fed."""
    return "val" in node.meta and not isinstance(node.meta["val"], torch.Tensor) and \
        all(u.op == "call_module" for u in node.users)


def plan_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> list[StageInfo]:
    """Live-in / live-out sets of every stage (see the module docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and not _baked(n)]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    produced_at = {n.name: 0 for n in placeholders}  # model inputs enter at stage 0
    produced_at.update(stage_of)
    last_use: dict[str, int] = {}
    infos = [StageInfo(index=s, inputs=[], outputs=[], nodes=[]) for s in range(num_stages)]
    for n in gm.graph.nodes:
        if n.op == "call_function":
            s = stage_of[n.name]
            infos[s].nodes.append(n.name)
            users_stage = s
        elif n.op == "output":
            users_stage = num_stages - 1
        else:
            continue
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                if a.target not in infos[users_stage].attrs:
                    infos[users_stage].attrs.append(a.target)
            elif a.op in ("placeholder", "call_function"):
                last_use[a.name] = max(last_use.get(a.name, 0), users_stage)
    del output
    # value v crosses into stage s when produced_at[v] < s <= last_use[v]
    for s in range(num_stages):
        if s == 0:
            infos[0].inputs = [n.name for n in placeholders]
            continue
        live = [v for v, u in last_use.items() if produced_at[v] < s <= u]
        infos[s].inputs = sorted(live, key=order.__getitem__)
        infos[s - 1].outputs = list(infos[s].inputs)
    return infos


def _non_tensor_output(nodes: dict[str, fx.Node], info: StageInfo) -> tuple[str, str] | None:
    """(name, type) of a value `info` would send that is not a tensor, or None (`nodes`: the graph's, by name)."""
    for v in info.outputs:
        val = nodes[v].meta.get("val")
        if val is not None and not isinstance(val, torch.Tensor):
            return v, type(val).__name__
    return None


def _check_tensor_values(gm: fx.GraphModule, infos: list[StageInfo]) -> None:
    nodes = {n.name: n for n in gm.graph.nodes}
    for info in infos[:-1]:
        bad = _non_tensor_output(nodes, info)
        if bad is not None:
            raise UserError(
                f"value {bad[0]!r} ({bad[1]}) would cross from stage {info.index} to {info.index + 1}; only tensors can",
                "move the cut so that this value stays inside one stage",
            )


def build_stage_module(gm: fx.GraphModule, info: StageInfo, num_stages: int, *, copy: bool = False,
                       own_outputs: bool = False, attrs_from: torch.nn.Module | None = None,
                       block: bool = False) -> fx.GraphModule:
    """One stage as a GraphModule: forward(*info.inputs) -> tuple(info.outputs).

    The last stage returns the model's flat output leaves as a tuple; `unflatten_output`
    rebuilds the model's own output structure for the loss. With copy=True the
    stage gets its own clones of parameters and buffers (single-process tests,
    where stages must not share storage the way separate ranks do not).
    own_outputs=True (zero-bubble schedules): every output is sent as a fresh copy. torch's
    input-gradient pass detaches the stage's outputs in place (_backward.stage_backward_input), which
    fails on a view ("Can't detach views in-place": a reshape cut right after it) and breaks the
    weight-gradient pass of an op that saved that very tensor (a LayerNorm on a residual stream cut
    right after it: "saved tensor that has been detached in-place"). A copy of what is sent anyway is
    small beside the stage's compute.
    attrs_from: the module whose parameters and buffers the new one holds (default `gm`): a block of a stage takes
    the stage module's own, which moving it to a device may have replaced (`Split.block_modules`, which also passes
    `block`: a block's inputs come from its own stage, so their gradients need no contiguous copy for gloo).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in info.inputs:
        env[name] = graph.placeholder(name)
        if "val" in nodes[name].meta:
            env[name].meta["val"] = nodes[name].meta["val"]

    def lookup(a: fx.Node) -> fx.Node:
        if a.name not in env:
            if a.op != "get_attr":
                raise RuntimeError(f"stage {info.index}: value {a.name} is neither received nor computed here")
            env[a.name] = graph.get_attr(a.target)
        return env[a.name]

    for name in info.nodes:
        n = nodes[name]
        env[name] = graph.node_copy(n, lookup)
    if info.index == num_stages - 1:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        leaves = pytree.tree_leaves(out_node.args[0])
        graph.output(tuple(lookup(x) if isinstance(x, fx.Node) else x for x in leaves))
    else:
        # gloo sends only contiguous tensors; contiguous() is a no-op (same tensor) when already so
        def sent(v: str) -> fx.Node:
            if own_outputs:
                return graph.call_function(torch.clone, (lookup(nodes[v]),), {"memory_format": torch.contiguous_format})
            return graph.call_method("contiguous", (lookup(nodes[v]),))

        graph.output(tuple(sent(v) for v in info.outputs))
    root: dict[str, Any] = {}
    for target in info.attrs:
        t = _get_attr(gm if attrs_from is None else attrs_from, target)
        if copy:
            if isinstance(t, torch.nn.Parameter):
                t = torch.nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
            elif isinstance(t, torch.Tensor):
                t = t.detach().clone()
        root[target] = t
    graph.lint()
    module = fx.GraphModule(root, graph, class_name=f"Stage{info.index}")
    if info.index > 0 and not block:  # a block's input gradients stay in its stage: none go to gloo
        module.register_forward_pre_hook(_contiguous_input_grads)
    return module


def _contiguous_input_grads(module, args):
    """Gradients of received tensors are sent back upstream, and gloo sends only contiguous tensors."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            a.register_hook(lambda g: g.contiguous() if g is not None else g)


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def unflatten_output(leaves: Any, gm: fx.GraphModule) -> Any:
    """The model's output structure from the last stage's flat tuple."""
    spec = getattr(gm, "_out_spec", None)
    leaves = list(leaves) if isinstance(leaves, (tuple, list)) else [leaves]
    if spec is None:
        return leaves[0] if len(leaves) == 1 else tuple(leaves)
    return pytree.tree_unflatten(leaves, spec)


def flat_inputs(args: tuple, gm: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """Model inputs (as example_inputs gives them) in the order of stage 0's placeholders, less the ones export
    baked into the program (`_baked`)."""
    spec = getattr(gm, "_in_spec", None)
    if spec is not None and spec.num_children == 2:  # (args, kwargs)
        leaves = pytree.tree_leaves((tuple(args), {}))
    else:
        leaves = pytree.tree_leaves(tuple(args))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) == len(leaves):
        leaves = [leaf for leaf, n in zip(leaves, inputs, strict=True) if not _baked(n)]
    return tuple(leaves)


@dataclass
class Split:
    """Everything about the cut, computed identically on every rank."""

    gm: fx.GraphModule
    stage_of: dict[str, int]
    infos: list[StageInfo]
    layer_nodes: dict[str, list[str]] = field(default_factory=dict)  # the plan's layers, in execution order
    layer_stage: dict[str, int] = field(default_factory=dict)
    layer_block: dict[str, int] = field(default_factory=dict)  # recomputed per block: each layer's (`block_modules`)

    @property
    def num_stages(self) -> int:
        return len(self.infos)

    def module(self, stage: int, *, copy: bool = False, own_outputs: bool = False) -> fx.GraphModule:
        return build_stage_module(self.gm, self.infos[stage], self.num_stages, copy=copy, own_outputs=own_outputs)

    def block_modules(self, stage: int, owner: torch.nn.Module) -> list[fx.GraphModule]:
        """`stage` as one module per block of it, in execution order, holding `owner`'s (the stage module's)
        parameters and buffers: run one after the other they compute what the stage module computes.

        Blocks: `layer_block` (planner/problem.checkpoint_units; each layer its own where it is empty), a block the
        stage boundary cuts counting as its part inside the stage. The program is cut at every block by the same
        wiring rule as at the stages' boundaries (the module docstring), so the first block of a stage takes the
        stage's inputs and its last returns the stage's outputs, in the same order: the blocks refine the stages (a
        glue node goes to the earliest block reading it, in the earliest stage reading it, and never before what it
        reads). A block that would pass on a value other than a tensor is merged with the next, as a stage boundary
        could not be there either. runtime/recompute.recompute_blocks.
        """
        names = list(self.layer_nodes)  # a region: a run of layers with one stage and one block
        keys = [(self.layer_stage[layer], self.layer_block.get(layer, k)) for k, layer in enumerate(names)]
        region = {layer: r for r, (a, b) in enumerate(block_runs(keys)) for layer in names[a:b]}
        nodes = {n.name: n for n in self.gm.graph.nodes}
        while True:
            count = max(region.values()) + 1
            infos = plan_stages(self.gm, node_stages(self.gm, self.layer_nodes, region), count)
            mine = sorted({region[layer] for layer, s in self.layer_stage.items() if s == stage})
            bad = next((k for k in mine[:-1] if _non_tensor_output(nodes, infos[k]) is not None), None)
            if bad is None:
                return [build_stage_module(self.gm, infos[k], count, attrs_from=owner, block=True) for k in mine]
            region = {layer: r - (r > bad) for layer, r in region.items()}

    def shared_attrs(self) -> dict[str, list[int]]:
        """Parameter FQN -> stages holding it, for parameters held by more than one stage."""
        holders: dict[str, list[int]] = {}
        for info in self.infos:
            for t in info.attrs:
                if isinstance(_get_attr(self.gm, t), torch.nn.Parameter):
                    holders.setdefault(t, []).append(info.index)
        return {k: v for k, v in holders.items() if len(v) > 1}


def split_program(gm: fx.GraphModule, layer_nodes: dict[str, list[str]], layer_stage: dict[str, int], num_stages: int) -> Split:
    """Cut `gm` (an unlifted exported module) at the plan's stage boundaries."""
    # drop the export guard call (it checks input shapes of the whole model only)
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and not n.users:
            gm.graph.erase_node(n)
    bad = [n for n in gm.graph.nodes if n.op == "call_module"]
    if bad:
        raise UserError(f"the exported model calls submodule {bad[0].target!r}; pipeplan can only split flat exported graphs")
    stage_of = node_stages(gm, layer_nodes, layer_stage)
    infos = plan_stages(gm, stage_of, num_stages)
    _check_tensor_values(gm, infos)
    return Split(gm=gm, stage_of=stage_of, infos=infos, layer_nodes=dict(layer_nodes), layer_stage=dict(layer_stage))


def run_sequential(modules: list[fx.GraphModule], inputs: tuple) -> tuple:
    """Run stage modules one after the other in one process (reference and tests)."""
    values = tuple(inputs)
    for m in modules:
        values = m(*values)
    return values
