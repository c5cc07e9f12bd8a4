"""Check a Hugging Face config.json's numbers before transformers or torch see them, naming the field.

Outside plausible bounds a config is a typo, and building the model would end in
an overflow, a hang or an error from deep inside torch that names no field; a
rule across fields (heads dividing the width, KV heads dividing heads, top-k
within the experts) is checked both before and after transformers fills in its
defaults. costmodels/hf_config.py reads the file and builds the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from pipeplan.errors import UserError
from pipeplan.fields import Fields, quote, shorten

# Plausible bounds on a config's numbers (the largest real configs are far inside them: Llama 3.1 405B has
# 126 layers, width 16384 and a vocabulary of 128256; Llama 4 has 10M positions), checked before transformers
# sees the file: outside them a model is a typo, and building it would end in an overflow, a hang or an
# error from deep inside torch that names no field.
MAX_SIZE = 10**7  # widths, vocabulary, head dimension
MAX_LAYERS = 10**5
MAX_HEADS = 10**5
MAX_EXPERTS = 10**4  # experts x width x expert width stays inside torch's 64-bit element counts
MAX_POSITIONS = 10**8
FIX_HINT = "fix the value in the config.json"


class _NonFinite(str):
    """A number JSON cannot hold (NaN, Infinity, 1e400, a 5000-digit integer), as the file spells it."""


def _non_finite(doc: Any, where: str = "") -> tuple[str, str] | None:
    """(field path, text) of the first _NonFinite in `doc`."""
    if isinstance(doc, _NonFinite):
        return where or "the document", str(doc)
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found = _non_finite(value, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key)
        if found:
            return found
    return None


def name_non_finite(path: str) -> None:
    """If the file parses once NaN, Infinity and overflowing numbers are let through: a user error naming the field."""

    def number(text: str) -> Any:
        value = float(text)
        return value if math.isfinite(value) else _NonFinite(text)

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read(), parse_constant=_NonFinite, parse_float=number,
                             parse_int=lambda t: int(t) if len(t) <= 4000 else _NonFinite(t))
        found = _non_finite(doc)
    except (ValueError, OSError, RecursionError):
        return
    if found:
        field, text = found
        raise UserError(f"{path}: {field} is {shorten(text)}: must be a finite JSON number (not NaN, Infinity, or past 1.8e308)",
                        FIX_HINT)


@dataclass(frozen=True)
class _Spec:
    """What one config field must be: an integer in [low, high], or a finite number in a (half-)open range."""

    kind: str  # "int" or "float"
    low: float
    high: float
    low_open: bool = False
    nullable: bool = True  # null is left to transformers (some fields are optional)

    def ok_type(self, value: Any) -> bool:
        if isinstance(value, bool):
            return False
        return isinstance(value, int) if self.kind == "int" else isinstance(value, (int, float))

    def in_range(self, value: Any) -> bool:
        if self.kind == "float" and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return bool(above and value <= self.high)

    def must(self) -> str:
        if self.kind == "int":
            return f"an integer >= {int(self.low)} and <= {int(self.high)}"
        return f"a finite number {'>' if self.low_open else '>='} {self.low:g} and <= {self.high:g}"


def _ints(low: int, high: int, names: str, nullable: bool = True) -> dict[str, _Spec]:
    return {n: _Spec("int", low, high, nullable=nullable) for n in names.split()}


def _floats(low: float, high: float, names: str, low_open: bool = False) -> dict[str, _Spec]:
    return {n: _Spec("float", low, high, low_open=low_open) for n in names.split()}


# Fields the causal LMs of transformers read (their GPT-2 style aliases included), under every name they go by.
FIELD_SPECS: dict[str, _Spec] = {
    **_ints(1, MAX_SIZE, "hidden_size n_embd d_model vocab_size", nullable=False),
    **_ints(1, MAX_SIZE, "intermediate_size n_inner ffn_dim ffn_hidden_size moe_intermediate_size "
                         "shared_expert_intermediate_size head_dim kv_channels kv_lora_rank q_lora_rank "
                         "qk_rope_head_dim qk_nope_head_dim v_head_dim rotary_dim word_embed_proj_dim"),
    **_ints(1, MAX_LAYERS, "num_hidden_layers n_layer num_layers", nullable=False),
    **_ints(1, MAX_HEADS, "num_attention_heads n_head num_heads", nullable=False),
    **_ints(1, MAX_HEADS, "num_key_value_heads num_kv_heads multi_query_group_num pretraining_tp"),
    **_ints(1, MAX_POSITIONS, "max_position_embeddings n_positions n_ctx seq_length sliding_window"),
    **_ints(1, MAX_EXPERTS, "num_local_experts num_experts n_routed_experts num_experts_per_tok"),
    **_ints(0, MAX_EXPERTS, "n_shared_experts"),
    **_floats(0.0, 1.0, "rms_norm_eps layer_norm_eps layer_norm_epsilon norm_eps norm_epsilon", low_open=True),
    **_floats(0.0, 1.0, "attention_dropout hidden_dropout resid_pdrop embd_pdrop attn_pdrop dropout "
                        "activation_dropout embedding_dropout attention_probs_dropout_prob hidden_dropout_prob "
                        "summary_first_dropout classifier_dropout mlp_dropout"),
    **_floats(0.0, 1.0, "partial_rotary_factor rotary_pct", low_open=True),
    **_floats(0.0, 10.0, "initializer_range"),
    **_floats(0.0, 1e12, "rope_theta", low_open=True),
    **_floats(0.0, 1e3, "router_aux_loss_coef"),
}


def check_fields(path: str, doc: dict[str, Any], *, types: bool) -> None:
    """Every field of FIELD_SPECS the file sets is in its range (and, with `types`, of its type).

    Without `types` a value of the wrong type is left alone: transformers' own check names it (and its
    declared type) better; the second pass, after transformers accepted the file, catches what it let through.
    """
    fields = Fields(path, FIX_HINT)
    for key, spec in FIELD_SPECS.items():
        if key not in doc:
            continue
        value = doc[key]
        if value is None:
            if types and not spec.nullable:
                raise fields.fail(key, value, spec.must())
            continue
        if not spec.ok_type(value):
            if types:
                raise fields.fail(key, value, spec.must())
            continue
        if not spec.in_range(value):
            raise fields.fail(key, value, spec.must())


class ConfigValues:
    """A config's values by transformers' attribute names, and the name the file gives each.

    `config`: what transformers made of the file (defaults included). Without one (transformers rejected
    the file as a whole), the file's own values over the config class's defaults.
    """

    def __init__(self, doc: dict[str, Any], config: Any = None, config_class: Any = None):
        self.doc = doc
        self.config = config
        self.defaults: Any = None
        if config is None and config_class is not None:
            try:
                self.defaults = config_class()
            except Exception:  # no defaults to go on: only the file's values
                self.defaults = None
        source = config if config is not None else self.defaults if self.defaults is not None else config_class
        self.amap: dict[str, str] = dict(getattr(source, "attribute_map", None) or {})

    def name(self, attr: str) -> str:
        """The name the file gives `attr` (GPT-2's n_embd for hidden_size, ...), or 'the default ATTR'."""
        names = [attr, self.amap.get(attr, attr)] + [k for k, v in self.amap.items() if v == attr]
        return next((n for n in names if n in self.doc), f"the default {attr}")

    def get(self, attr: str) -> Any:
        if self.config is not None:
            return getattr(self.config, attr, None)
        name = self.name(attr)
        if name in self.doc:
            return self.doc[name]
        return None if self.defaults is None or attr == "head_dim" else getattr(self.defaults, attr, None)


def check_relations(fields: Fields, values: ConfigValues) -> None:
    """Each counted field in its range, then how they fit together: heads and width, KV heads, experts, padding."""

    def value(attr: str) -> int | None:
        v = values.get(attr)
        if v is None:
            return None
        spec = FIELD_SPECS[attr]
        if not spec.ok_type(v) or not spec.in_range(v):  # a default, or a value set under a name we do not know
            raise fields.fail(values.name(attr), v, spec.must())
        return int(v)

    hidden, heads, vocab = value("hidden_size"), value("num_attention_heads"), value("vocab_size")
    value("num_hidden_layers")
    value("intermediate_size")
    value("max_position_embeddings")
    head_dim = values.get("head_dim")
    if hidden is not None and heads is not None and hidden % heads and (
            head_dim is None or isinstance(head_dim, bool) or not isinstance(head_dim, int)):
        # no head_dim of its own: the architecture splits the width evenly between the heads
        raise fields.fail(values.name("num_attention_heads"), heads,
                          f"a divisor of {values.name('hidden_size')} ({hidden})")
    for kv_attr in ("num_key_value_heads", "num_kv_heads"):
        kv = value(kv_attr)
        if heads is not None and kv is not None and heads % kv:
            raise fields.fail(values.name(kv_attr), kv, f"a divisor of {values.name('num_attention_heads')} ({heads})")
    per_token = value("num_experts_per_tok")
    for experts_attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = value(experts_attr)
        if per_token is not None and experts is not None:
            if per_token > experts:
                raise fields.fail(values.name("num_experts_per_tok"), per_token,
                                  f"<= {values.name(experts_attr)} ({experts})")
            break
    pad = values.get("pad_token_id")
    if pad is not None and vocab is not None and (
            isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab):
        raise fields.fail(values.name("pad_token_id"), pad,
                          f"null or an integer from 0 to {values.name('vocab_size')} - 1 ({vocab - 1})")


def check_config(path: str, doc: dict[str, Any], config: Any) -> None:
    """The fields' types and ranges, then how they fit together, on the config transformers made (defaults included)."""
    check_fields(path, doc, types=True)
    check_relations(Fields(path, FIX_HINT), ConfigValues(doc, config))


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception's text on one line (transformers' validation errors span several)."""
    text = shorten(" ".join(str(e).split()), limit)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_field_error(e: BaseException) -> bool:
    return re.match(r"Validation error for field '", str(e)) is not None


def rejection(e: BaseException, doc: dict[str, Any]) -> str:
    """transformers' complaint, short: 'FIELD is VALUE: REASON' for one field (its text repeats the whole value)."""
    m = re.match(r"Validation error for field '([^']+)'", str(e))
    cause = e.__cause__
    if m is None or cause is None:
        return one_line(e, 200)
    field = m.group(1)
    reason = " ".join(str(cause).split())
    reason = re.sub(r"^Field '[^']*' ", "", reason)
    reason = re.sub(r"^with value .* doesn't match", "doesn't match", reason)
    reason = re.sub(r"\s*\(value: .*$", "", reason)  # the value, in full: quoted short below
    if not isinstance(cause, TypeError):
        reason = re.sub(r",? got .*$", "", reason)  # "..., got <the value>."
    reason = reason[:120]
    shown = f" is {quote(doc[field])}" if field in doc else ""
    return f"{field}{shown}: {type(cause).__name__}: {reason}"
