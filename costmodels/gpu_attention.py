"""Attention counted as a GPU runs it, where the CPU would run another algorithm: for graphs planned on GPUs.

Saved bytes and tensors in flight are counted by running the exported program on fake
CPU tensors, so `F.scaled_dot_product_attention` takes the CPU's path. The CPU's fused
kernel (torch's flash attention for the CPU) takes neither dropout nor a value head size
other than the query's, so for attention with dropout in training (Hugging Face's GPT-2,
BERT, RoBERTa: 0.1) or with narrower value heads (multi-head latent attention: DeepSeek-V2/V3,
Kimi K2, 128 against 192) it runs the unfused math, which materializes the attention
probabilities and saves them (batch x heads x seq x seq; with dropout, the dropped ones
too): 2 GiB a layer for DeepSeek-V3 at 2,048 tokens in fp32. A GPU runs both fused (torch's
flash and memory-efficient kernels take dropout, and the memory-efficient one a value head
size of its own, sdp_utils.cpp `check_head_dim_size_mem_efficient`), saving queries, keys,
values, the output, a log-sum-exp per row and the dropout RNG's state, and recomputing the
scores in backward. A graph traced for a catalogue profile (untimed, `trace.py`) counts the
memory-efficient kernel instead, on the same fake tensors (its meta kernels and autograd
formula are torch's), so its memory is the GPU's. FLOPs follow: the fused backward's
recomputation is counted (flop_counter's formula), as it is for every other model's fused
attention (measure.py's CPU flash formulas).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

aten = torch.ops.aten

# Set while counting for a GPU: a list that collects why, for each attention replaced ("dropout 0.1", ...).
_REPLACED: ContextVar[list[str] | None] = ContextVar("gpu_attention", default=None)


@contextlib.contextmanager
def counting_as_gpu(enabled: bool = True) -> Iterator[list[str]]:
    """Within it, `call` runs attention the CPU would leave unfused as a GPU's fused kernel; yields what it did."""
    replaced: list[str] = []
    token = _REPLACED.set(replaced if enabled else None)
    try:
        yield replaced
    finally:
        _REPLACED.reset(token)


def call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`target(*args, **kwargs)`, with scaled-dot-product attention as a GPU runs it inside `counting_as_gpu`."""
    replaced = _REPLACED.get()
    if replaced is None or target is not aten.scaled_dot_product_attention.default:
        return target(*args, **kwargs)
    params = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
                      args, strict=False))
    params.update(kwargs)
    q, k, v = params["query"], params["key"], params["value"]
    dropout_p = float(params.get("dropout_p", 0.0))
    why = [f"dropout {dropout_p:g}"] if dropout_p > 0 else []
    if v.shape[-1] != q.shape[-1]:
        why.append(f"value heads {v.shape[-1]} wide against {q.shape[-1]}")
    if not why or k.shape[-1] != q.shape[-1] or params.get("enable_gqa", False) or k.shape[-3] != q.shape[-3]:
        return target(*args, **kwargs)  # the CPU fuses it too, or the GPU kernel would not take it as it is
    mask = params.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:  # torch's own conversion (convert_boolean_attn_mask)
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
    out = aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, compute_log_sumexp=q.requires_grad or k.requires_grad or v.requires_grad,
        dropout_p=dropout_p, is_causal=bool(params.get("is_causal", False)), scale=params.get("scale"))[0]
    replaced.append(", ".join(why))
    return out


def note(replaced: list[str]) -> str | None:
    """The graph note saying attention was counted as a GPU's fused kernel (None when none was)."""
    if not replaced:
        return None
    return (f"attention the CPU runs unfused ({'; '.join(sorted(set(replaced)))}) is counted as a GPU's fused kernel "
            "keeps it (no score matrices saved; costmodels/gpu_attention.py), as this untimed graph is for a "
            "catalogue profile")
