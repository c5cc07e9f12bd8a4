"""GPT models as Megatron-LM's legacy model ran them in the Megatron and Zero Bubble papers: attention unfused.

Why this file: Hugging Face's SDPA attention, which `trace` uses for a config.json, is a fused (FlashAttention-
like) kernel that never writes the score matrix. The runs these rows quote did write it. Megatron-LM's
CoreAttention (megatron/model/transformer.py) computes the scores with one `torch.baddbmm` (the 1/sqrt(d)
scale in its `alpha`), normalises them with FusedScaleMaskSoftmax (one kernel that applies the causal mask
inside), applies dropout to the probabilities and multiplies by the values with `torch.bmm`: four passes over
a (batch x heads, seq, seq) tensor forward and their gradients backward. FlashAttention came only with
`--use-flash-attn`, which Narayanan et al. 2021 predates and which the Zero Bubble repository's paper-time
script (sail-sg/zero-bubble-pipeline-parallelism, examples/pretrain_zero_bubble.sh at 7c89dd42, Nov 2023)
does not pass (its current script does).

`megatron_attention` is that sequence in PyTorch ops, registered with transformers' AttentionInterface: the
scale and the causal mask go into the baddbmm (its `alpha` and its additive input), so the score matrix is
written once, read and written once by the softmax, once more by dropout (with its mask) and read by the bmm,
as in Megatron. The additive mask is one (1, seq, seq) tensor per layer, 1/(batch x heads) of a score matrix.

The models are the config.json files beside this file (GPT-2 architecture, as Megatron's GPT), built with
transformers' GPT2LMHeadModel; each sequence length has its model file (`megatron_gpt_s2048.py`,
`megatron_gpt_s1024.py`), whose inputs `model_file_functions` takes from the config.json path. Left as Hugging
Face runs them: bias + GELU and bias + dropout + residual add are separate ops here where Megatron fuses them (a
few passes over (batch, seq, hidden) per layer, small beside the score matrices at these sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

NAME = "megatron_core_attention"
HERE = Path(__file__).resolve().parent


def megatron_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention as Megatron-LM's CoreAttention: baddbmm (scale, mask), softmax, dropout, bmm."""
    b, heads, s, d = query.shape
    scale = d ** -0.5 if scaling is None else scaling
    causal = torch.full((s, s), float("-inf"), dtype=query.dtype, device=query.device).triu(1).unsqueeze(0)
    scores = torch.baddbmm(causal, query.reshape(b * heads, s, d), key.reshape(b * heads, s, d).transpose(1, 2),
                           alpha=scale)
    probs = torch.nn.functional.softmax(scores, dim=-1)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    context = torch.bmm(probs, value.reshape(b * heads, s, d)).view(b, heads, s, d)
    return context.transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, megatron_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a mask transformers can build; megatron_attention ignores it


def build_gpt(config: str | Path) -> torch.nn.Module:
    """GPT2LMHeadModel of a config.json (a name: the file beside this one), with Megatron's attention; the config is
    read and checked as `trace` reads a config.json (costmodels/hf_config.py), only the attention differs."""
    from transformers import GPT2LMHeadModel

    from pipeplan.costmodels.hf_config import make_config, read_config_dict

    _register()
    path = str(HERE / config)
    gpt = make_config(path, read_config_dict(path))
    gpt._attn_implementation = NAME
    return GPT2LMHeadModel(gpt)


def model_file_functions(config: str | Path, seq_len: int) -> tuple[Any, Any, Any]:
    """The model-file protocol's (example_inputs, example_target, loss_fn) for a config.json at `seq_len`: those of
    the module `trace` makes of the config itself (hf_config.load_hf_config), so the rows get the inputs, target and
    loss they had when they were traced from their config.json."""
    from pipeplan.costmodels.hf_config import load_hf_config

    module, _ = load_hf_config(str(HERE / config), seq_len)
    return module.example_inputs, module.example_target, module.loss_fn
