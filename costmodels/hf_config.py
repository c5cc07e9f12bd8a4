"""A Hugging Face `config.json` as a model: `AutoModelForCausalLM.from_config`, no download, no weights.

`load_hf_config` turns the file into the same `ModelSpec` a model.py gives, whose
module is synthetic: `build_model()` (random weights, fp32, `use_cache=False`,
SDPA attention), `example_inputs(b)` (token ids of shape (b, seq_len)),
`example_target(b)` (the labels: the same ids) and `loss_fn(output, target)`
(next-token cross-entropy, as transformers computes it for `labels=input_ids`).
Tracing and the runtime then treat it like any model file.

The sequence length is the one thing a config does not say about training: it is
`--seq-len`, by default the config's `max_position_embeddings` capped at
DEFAULT_MAX_SEQ_LEN. It is recorded in the graph's source (and the plan's graph
summary) so the runtime rebuilds the same inputs.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import types
from typing import Any

import torch
import torch.nn.functional as F

from pipeplan._io import read_json
from pipeplan.costmodels.hf_config_check import (
    ConfigValues,
    check_config,
    check_fields,
    check_relations,
    is_field_error,
    name_non_finite,
    one_line,
    rejection,
)
from pipeplan.errors import UserError
from pipeplan.fields import Fields, quote

DEFAULT_MAX_SEQ_LEN = 4096  # the default --seq-len: max_position_embeddings, but no more than this
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few KiB; anything this big is another file
GRAPH_FORMAT_PREFIX = "pipeplan.graph/"

def is_json_path(path: str) -> bool:
    return os.path.splitext(path)[1].lower() == ".json"


def read_config_dict(path: str) -> dict[str, Any]:
    """The file's JSON object, checked to be a Hugging Face config (an object with a string "model_type")."""
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise UserError(f"{path}: not a Hugging Face config ({size} bytes; a config.json is a few KiB)",
                        "pass the model's config.json")
    try:
        doc = read_json(path, "Hugging Face config.json")
    except UserError:
        name_non_finite(path)  # NaN, Infinity, 1e400: say which field
        raise
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a Hugging Face config (the JSON is a {type(doc).__name__}, not an object)",
                        "pass the model's config.json")
    fmt = doc.get("format")
    if isinstance(fmt, str) and fmt.startswith(GRAPH_FORMAT_PREFIX):
        raise UserError(f"{path}: is a pipeplan graph, not a model",
                        "pass it where a graph is read (`pipeplan analyze` or `pipeplan plan`), or pass a model.py or config.json")
    if "model_type" not in doc:
        raise UserError(f"{path}: not a Hugging Face config (no \"model_type\" field)", "pass the model's config.json")
    if not isinstance(doc["model_type"], str):
        raise UserError(f"{path}: not a Hugging Face config "
                        f"(\"model_type\" is {quote(doc['model_type'])}, not a string)", "pass the model's config.json")
    return doc


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as e:
        raise UserError("reading a Hugging Face config.json needs the transformers package",
                        "pip install 'pipeplan[hf]'") from e
    return transformers


def make_config(path: str, doc: dict[str, Any]) -> Any:
    """The transformers config object: the model_type must be known and the values valid."""
    transformers = _transformers()
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = doc["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{path}: unknown model_type {quote(model_type)} "
                        f"(transformers {transformers.__version__} does not know it)",
                        "check the spelling, or install a transformers that has this architecture")
    config_class = CONFIG_MAPPING[model_type]
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"{path}: model_type {quote(model_type)} has no causal language model in transformers "
                        f"(AutoModelForCausalLM cannot build a {config_class.__name__})",
                        "pass the config of a decoder-only language model (Llama, Mistral, Mixtral, GPT-2, ...)")
    check_fields(path, doc, types=False)  # ranges first: a zero head count or a 10**30 width is not for transformers
    fields = {k: v for k, v in doc.items() if k != "model_type"}
    try:
        config = config_class.from_dict(fields)
    except Exception as e:  # transformers validates types and shapes (heads dividing the width, ...)
        rejects = f"{path}: transformers rejects this {model_type} config"
        if not is_field_error(e):  # a rule across fields (heads dividing the width, ...): name the field if we can
            try:
                check_relations(Fields(rejects, "fix the config's values"), ConfigValues(doc, None, config_class))
            except UserError as named:
                raise named from e
        raise UserError(f"{rejects}: {rejection(e, doc)}", "fix the config's values") from e
    check_config(path, doc, config)
    config.use_cache = False  # no KV cache in the output: a training graph
    return config


def default_seq_len(config: Any) -> int:
    max_pos = getattr(config, "max_position_embeddings", None)
    return min(int(max_pos), DEFAULT_MAX_SEQ_LEN) if isinstance(max_pos, int) and max_pos > 0 else DEFAULT_MAX_SEQ_LEN


def check_seq_len(path: str, config: Any, seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise UserError(f"--seq-len {seq_len!r} must be a positive integer", "pass --seq-len N with N >= 1")
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0 and seq_len > max_pos:
        raise UserError(f"{path}: --seq-len {seq_len} is longer than the model's max_position_embeddings {max_pos}",
                        f"pass --seq-len {max_pos} or less")


def causal_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict target t + 1, mean over the batch's tokens.

    What transformers' ForCausalLMLoss computes for labels=target with no ignored (-100)
    labels; the logits are upcast to fp32 as there.
    """
    logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    shifted = logits[:, :-1, :].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target[:, 1:].reshape(-1))


_MOE_FLOPS_REGISTERED = False


def register_moe_flop_formulas() -> None:
    """FLOP formulas for transformers' grouped expert matmul (a custom op FlopCounterMode does not know).

    Mixture-of-experts layers (Mixtral, ...) run their experts through
    `transformers::grouped_mm_fallback` on CPU and in fp32: input (S, in) sorted by
    expert, weight (E, in, out), S = tokens x experts per token. Without a formula the
    experts, most of such a model's FLOPs, would count as zero. 2 FLOPs per multiply-add.
    """
    global _MOE_FLOPS_REGISTERED
    if _MOE_FLOPS_REGISTERED:
        return
    from torch.utils.flop_counter import register_flop_formula

    ops = getattr(torch.ops, "transformers", None)
    fwd = getattr(ops, "grouped_mm_fallback", None) if ops is not None else None
    bwd = getattr(ops, "grouped_mm_fallback_backward", None) if ops is not None else None
    if fwd is not None:
        @register_flop_formula(fwd)
        def _fwd_flops(input_shape: Any, weight_shape: Any, offs_shape: Any, *args: Any, **kwargs: Any) -> int:
            return 2 * int(input_shape[0]) * int(weight_shape[1]) * int(weight_shape[2])

    if bwd is not None:
        @register_flop_formula(bwd)
        def _bwd_flops(input_shape: Any, weight_shape: Any, offs_shape: Any, grad_shape: Any, *args: Any,
                       **kwargs: Any) -> int:
            return 4 * int(input_shape[0]) * int(weight_shape[1]) * int(weight_shape[2])  # grad input + grad weight

    _MOE_FLOPS_REGISTERED = True


def _explicit_position_ids(module: torch.nn.Module, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: position ids 0..seq_len-1 per row, made without `expand`.

    Left to itself, transformers makes them as arange(seq_len).unsqueeze(0).expand(batch, -1),
    and torch.export drops that expand at batch 1, so a graph traced at batch 1 would not match
    the runtime's export at a larger microbatch (the fingerprint check). These are the same ids
    (so the same logits), built from ops that are there at every batch size.
    """
    if kwargs.get("position_ids") is None and args and isinstance(args[0], torch.Tensor):
        kwargs = {**kwargs, "position_ids": torch.ones_like(args[0]).cumsum(-1) - 1}
    return args, kwargs


# What transformers says building a model whose class has no torch.nn.functional.scaled_dot_product_attention path
# (modeling_utils.PreTrainedModel._check_and_adjust_attn_implementation, transformers 5.x).
SDPA_REFUSED = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
EAGER_NOTE = ("attention runs transformers' eager implementation: this architecture has no scaled_dot_product_"
              "attention path, so its score matrices are computed, saved and priced as separate ops")


def build_module(path: str, config: Any, seq_len: int) -> types.ModuleType:
    """A synthetic model-file module for `config` at `seq_len` (what load_model_file expects of a model.py)."""
    name = "pipeplan_hf_config_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = types.ModuleType(name, f"Hugging Face config {path}, sequence length {seq_len}")
    vocab = int(config.vocab_size)

    def build_model() -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        # fp32 whatever the config's torch_dtype/dtype says: the graph is fp32 and --dtype picks the training precision.
        try:
            try:
                model: torch.nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    config, dtype=torch.float32, attn_implementation="sdpa")
            except ValueError as e:
                if SDPA_REFUSED not in str(e):
                    raise
                # Bloom, GPT-Neo, Gemma 2 and others have no SDPA path: their own (eager) attention, as they train
                model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    config, dtype=torch.float32, attn_implementation="eager")
                # an attention-free model (Mamba, RWKV: no heads in the config) has no score matrices to speak of
                heads = getattr(config, "num_attention_heads", None)
                module.attention = "eager" if heads else "none"  # type: ignore[attr-defined]
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, AssertionError) as e:
            # values the config class let through but the model cannot be built with; a RuntimeError or
            # MemoryError (out of memory building real weights) is left to ModelSpec's handling
            raise UserError(f"{path}: transformers cannot build this {config.model_type} model: {one_line(e)}",
                            "fix the config's values") from e
        register_moe_flop_formulas()  # transformers has loaded its expert ops by now
        if "position_ids" in inspect.signature(model.forward).parameters:
            model.register_forward_pre_hook(_explicit_position_ids, with_kwargs=True)
        return model

    def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)

    def example_target(batch_size: int) -> torch.Tensor:
        return example_inputs(batch_size)[0]  # labels = input_ids, shifted inside the loss as transformers does

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(output, target)

    module.build_model = build_model  # type: ignore[attr-defined]
    module.example_inputs = example_inputs  # type: ignore[attr-defined]
    module.example_target = example_target  # type: ignore[attr-defined]
    module.loss_fn = loss_fn  # type: ignore[attr-defined]
    module.config = config  # type: ignore[attr-defined]
    module.seq_len = seq_len  # type: ignore[attr-defined]
    module.attention = "sdpa"  # type: ignore[attr-defined]  # "eager" (or "none") once build_model fell back
    return module


def load_hf_config(path: str, seq_len: int | None = None) -> tuple[types.ModuleType, int]:
    """(synthetic model module, sequence length) for the config.json at `path` (absolute)."""
    doc = read_config_dict(path)
    config = make_config(path, doc)
    if seq_len is None:
        seq_len = default_seq_len(config)
    check_seq_len(path, config, seq_len)
    return build_module(path, config, seq_len), seq_len
