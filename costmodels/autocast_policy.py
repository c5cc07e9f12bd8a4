"""torch.autocast's casts, replayed on a traced program for a chosen device: what a 16-bit step really holds.

Why: `pipeplan run` trains a bf16 or fp16 plan under torch.autocast (pipeplan/precision.py), which is not "every
tensor in 16 bits". Autocast casts the inputs of a list of ops (matmuls, convolutions, attention) to 16 bits and
those of another list (on CUDA: norms, softmax, losses, upsampling) to fp32; every other op runs in the dtype it
is given, so a transformer's residual stream stays fp32 (embedding, residual adds), its norms save fp32 inputs,
its matmuls save a 16-bit copy, and the loss's log-probabilities are fp32. Priced as half the fp32 bytes, GPT-2
peaked 19% above its prediction on an H200 and a 2-stage GPT plan 32% above on this CPU (benchmarks/RESULTS.md).

The lists differ by device, and the tracer counts on CPU fake tensors whatever the target, so the casts are
replayed here per node of the exported program rather than left to the CPU's own autocast: the CUDA lists
are `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE` and `AT_FORALL_PROMOTE` in
aten/src/ATen/autocast_mode.h, the CPU ones `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)` in autocast_mode.cpp
(PyTorch 2.5-2.13; only ops a training step of a traced model meets are kept). The CPU replay is checked against
torch's own CPU autocast, saved byte for saved byte (tests/test_autocast_bytes.py), so the mechanism is torch's
and only the lists are transcribed.

Like torch (`cached_cast`), a cast of a parameter is made once and kept until the autocast region ends: the
runtime's region is the whole step, so those copies are model state of the step, not per-microbatch activations
(`Casts.cached`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch.utils import _pytree as pytree

# Ops whose floating inputs autocast casts to the 16-bit dtype.
_LOWER_COMMON: Final = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "addmm", "addbmm", "baddbmm", "bmm", "mm", "matmul", "linear", "linalg_vecdot", "_convolution",
    "scaled_dot_product_attention",
})
LOWER_PRECISION: Final[dict[str, frozenset[str]]] = {
    "cuda": _LOWER_COMMON | {"convolution", "addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot",
                             "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
                             "_scaled_dot_product_flash_attention"},
    "cpu": _LOWER_COMMON | {"_addmm_activation", "_native_multi_head_attention"},
}
# Ops whose 16-bit inputs autocast casts to fp32 (with the CUDA "set_opt_dtype" ones, which run in fp32 too).
FP32: Final[dict[str, frozenset[str]]] = {
    "cuda": frozenset({
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        # AT_FORALL_FP32_SET_OPT_DTYPE: run with dtype=float32 unless the call gives one
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
    }),
    "cpu": frozenset({
        "avg_pool3d", "binary_cross_entropy", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d", "prod", "cdist",
        "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
        "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss",
        "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
        "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    }),
}
# Ops whose floating inputs autocast casts to the widest of them.
PROMOTE: Final[dict[str, frozenset[str]]] = {
    "cuda": frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                       "tensordot", "scatter_add"}),
    "cpu": frozenset({"stack", "cat", "index_copy"}),
}
HALF: Final = {"bf16": torch.bfloat16, "fp16": torch.float16}


def op_name(target: Any) -> str:
    """'linear' for aten.linear.default: the name autocast registers a kernel under."""
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def cast_kind(device: str, name: str) -> str | None:
    """What autocast on `device` does to the inputs of the op `name`: "lower", "fp32", "promote", or None (nothing)."""
    if name in LOWER_PRECISION[device]:
        return "lower"
    if name in FP32[device]:
        return "fp32"
    return "promote" if name in PROMOTE[device] else None


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


@dataclass
class Casts:
    """The casts autocast would make on `device` with `dtype` as its 16-bit type, for a program run node by node."""

    device: str
    dtype: torch.dtype
    cached: dict[int, torch.Tensor] = field(default_factory=dict)  # id(parameter) -> its 16-bit copy
    storages: set[int] = field(default_factory=set)  # storage addresses of those copies

    def cast(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                                     dict[str, Any]]:
        """The arguments autocast would hand the op `target`."""
        kind = cast_kind(self.device, op_name(target))
        if kind == "lower":
            to: Callable[[torch.Tensor], torch.Tensor] = self._lower
        elif kind == "fp32":
            to = self._fp32
        elif kind == "promote":
            widest = torch.float32 if any(_floating(a) and a.dtype == torch.float32
                                          for a in pytree.tree_leaves((args, kwargs))) else self.dtype
            to = self._fp32 if widest == torch.float32 else self._lower
        else:
            return args, kwargs
        return pytree.tree_map(lambda a: to(a) if _floating(a) else a, (args, kwargs))  # type: ignore[no-any-return]

    def _lower(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32:
            return t
        if not (t.requires_grad and t.is_leaf):  # torch caches the casts of weights (leaves) only
            return t.to(self.dtype)
        if id(t) not in self.cached:
            self.cached[id(t)] = copy = t.to(self.dtype)
            self.storages.add(copy.untyped_storage()._cdata)
        return self.cached[id(t)]

    @staticmethod
    def _fp32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t

    def loss_context(self) -> Any:
        """Where the loss runs: torch's CPU autocast (the traced tensors are CPU ones). Cross-entropy, the losses
        models use, is fp32 on both lists (CPU `cross_entropy_loss`; CUDA its `log_softmax` and `nll_loss`)."""
        return torch.autocast("cpu", dtype=self.dtype)
