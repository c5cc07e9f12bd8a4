"""Which model inputs carry the batch, and cutting a batch on those alone.

A model may take inputs that are the same for every sample (a positional table of shape (T, D), a scalar): the
data-parallel replicas and the microbatches each need them whole. torch's schedules cut every tensor argument
along dim 0 unless told otherwise (`args_chunk_spec`), which made such a model fail in `pipeplan run` ("The size
of tensor a (16) must match the size of tensor b (8)") though it traced and planned. The model file says which
inputs are batch-sized by what grows with `example_inputs(batch_size)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeplan.runtime.split import flat_inputs

__all__ = ["batch_leaves", "chunk_spec", "cut"]


def batch_leaves(spec: Any) -> tuple[bool, ...] | None:
    """Per leaf of the model's inputs (pytree order, numbers included): whether its first dimension is the batch,
    i.e. grows from `example_inputs(1)` to `example_inputs(2)`; None where those cannot be made (a model file that
    wants larger batches): then every tensor with a first dimension is taken to carry it, as before."""
    try:
        one = pytree.tree_leaves(tuple(spec.example_inputs(1)))
        two = pytree.tree_leaves(tuple(spec.example_inputs(2)))
    except Exception:  # noqa: BLE001 -- the model file's own function; the runtime's own batch size still works
        return None
    if len(one) != len(two):
        return None
    return tuple(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() > 0 and b.dim() > 0
                 and a.shape[0] != b.shape[0] for a, b in zip(one, two, strict=True))


def cut(inputs: tuple, parts: int, batch: tuple[bool, ...] | None) -> list[tuple]:
    """`inputs` (as example_inputs gives them, dicts included) in `parts` along the batch; the inputs that do not
    carry it go whole into every part."""
    leaves, tree = pytree.tree_flatten(tuple(inputs))
    if batch is None:
        batch = tuple(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 for leaf in leaves)
    pieces = [leaf.tensor_split(parts) if is_batch else [leaf] * parts
              for leaf, is_batch in zip(leaves, batch, strict=True)]
    return [pytree.tree_unflatten([p[i] for p in pieces], tree) for i in range(parts)]


def chunk_spec(batch: tuple[bool, ...] | None, gm: Any) -> tuple[Any, ...] | None:
    """torch's `args_chunk_spec` for the inputs the first stage is fed (`flat_inputs`: numbers export baked into
    the program left out): dim 0 of the batch-sized ones, the others replicated; None (torch's default, dim 0 of
    all) where every one is batch-sized or which ones are is not known."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    fed = None if batch is None else flat_inputs(batch, gm)  # the same leaves as the inputs: flags in their place
    if fed is None or all(fed):
        return None
    return tuple(TensorChunkSpec(0) if is_batch else _Replicate() for is_batch in fed)
