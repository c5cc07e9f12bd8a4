"""Read, validate and find hardware profiles (`pipeplan.profile/v1` YAML).

The YAML uses the units people read on datasheets (GiB, GB/s, TFLOP/s, µs) and
`HardwareProfile` uses SI units, so conversion happens here, once. Validation is
strict because a silently wrong number (bytes where GiB was meant, a typo'd key
that leaves a default in place) produces plausible-looking but wrong plans: every
problem is a `UserError` naming the file, the field and what was expected.

Profiles come from three places, searched in this order by `load_profile`:
an explicit path, the user folder ($PIPEPLAN_PROFILE_DIR, else
~/.config/pipeplan/profiles), and the catalogue shipped in `catalog/`.
A user profile with a catalogue name shadows the catalogue entry on purpose, so
users can correct a number without editing the installed package.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from pipeplan._io import MAX_NESTING, atomic_write_text, check_format, read_text
from pipeplan.choices import DTYPES, OPTIMIZERS
from pipeplan.errors import UserError
from pipeplan.fields import quote
from pipeplan.hardware_profiles.curve import MAX_CURVE_POINTS, MIN_CURVE_POINTS
from pipeplan.hardware_profiles.profile import DISPATCH_KINDS, HardwareProfile, Link
from pipeplan.schedules import SCHEDULE_NAMES
from pipeplan.units import GIB, MIB

PROFILE_FORMAT = "pipeplan.profile/v1"
CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
# Same kinds as costmodels.graph.LAYER_KINDS plus "memory" (achieved/peak bandwidth);
# duplicated because hardware_profiles must not import costmodels (a test keeps them in sync).
# costmodels.graph.PART_KINDS plus "memory" (bandwidth); each may also be given per dtype as "kind@dtype".
EFFICIENCY_KINDS = ("matmul", "conv", "attention", "embedding", "norm", "elementwise", "other", "conv3x3", "dropout",
                    "memory")

# A curve point's achieved/peak bound. Above 1 is real: PyTorch runs fp32 convolutions on TF32 tensor
# cores by default (torch.backends.cudnn.allow_tf32 = True), up to 494.7/66.9 = 7.4x the H100's fp32 peak
# (catalog/h100-sxm.yaml); 16 leaves room for that and catches percentages (80 for 0.80).
MAX_CURVE_EFFICIENCY = 16.0

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")  # 64 characters at most: names go in tables and messages
_UNIT_RE = re.compile(r"^\s*[-+]?[0-9.]+(e[-+]?[0-9]+)?\s*[a-zA-Zµ/%]+")

# field -> (unit shown in messages, largest plausible value). The upper bounds catch
# the usual unit slip (bytes for GiB, B/s for GB/s, FLOP/s for TFLOP/s, ns for µs).
_UNITS = {
    "memory_gib": ("GiB", 65536.0),
    "usable_memory_gib": ("GiB", 65536.0),
    "memory_bandwidth_gbps": ("GB/s", 1e5),
    "bandwidth_gbps": ("GB/s", 1e5),
    "latency_us": ("µs", 1e6),
    "op_overhead_us": ("µs", 1e6),
    "op_overhead_us_per_mib": ("µs per MiB", 1e6),
    "op_overhead_us_per_tensor": ("µs per tensor", 1e6),
    "op_overhead_us_alone": ("µs", 1e6),
    "op_overhead_us_more_chunks": ("µs", 1e6),
    "kernel_overhead_us": ("µs", 1e4),
    "dispatch_us": ("µs", 1e4),
    "dispatch_us_by_kind": ("µs", 1e4),
    "optimizer_us_per_tensor": ("µs", 1e4),
    "optimizer_ns_per_param": ("ns", 1e4),
    "optimizer_us_per_step": ("µs", 1e6),
    "recompute_overhead_us": ("µs", 1e6),
    "recompute_us_per_saved_tensor": ("µs", 1e4),
    "split_backward_overhead_us": ("µs", 1e6),
    "split_backward_us_per_group": ("µs", 1e4),
    "peak_tflops": ("TFLOP/s", 1e5),
}

_SLIPS = {"GiB": "bytes or MiB", "GB/s": "B/s or MB/s", "TFLOP/s": "FLOP/s or GFLOP/s", "µs": "ns", "ns": "ps"}

_TOP_KEYS = {
    "format": True,  # key -> required
    "name": True,
    "aliases": False,
    "device": True,
    "memory_gib": True,
    "usable_memory_gib": True,
    "memory_bandwidth_gbps": True,
    "peak_tflops": True,
    "devices_per_node": True,
    "intra_node": True,
    "inter_node": True,
    "efficiency": False,
    "efficiency_curve": False,
    "channel_factors": False,
    "op_overhead_us": False,
    "kernel_overhead_us": False,
    "dispatch_us": False,
    "dispatch_us_by_kind": False,
    "op_overhead_us_per_mib": False,
    "op_overhead_us_per_tensor": False,
    "op_overhead_us_alone": False,
    "op_overhead_us_more_chunks": False,
    "optimizer_us_per_tensor": False,
    "optimizer_ns_per_param": False,
    "optimizer_us_per_step": False,
    "recompute_overhead_us": False,
    "recompute_us_per_saved_tensor": False,
    "split_backward_overhead_us": False,
    "split_backward_us_per_group": False,
    "concurrency_slowdown": False,
    "memory_concurrency_slowdown": False,
    "sources": False,
    "confidence": False,
    "notes": False,
    "local": False,
    "calibration": False,
    "collectives": False,
}
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")
_LINK_KEYS = {"kind": True, "bandwidth_gbps": True, "latency_us": True, "notes": False}


def user_profile_dir() -> Path:
    """$PIPEPLAN_PROFILE_DIR, else $XDG_CONFIG_HOME/pipeplan/profiles (default ~/.config)."""
    env = os.environ.get("PIPEPLAN_PROFILE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "pipeplan" / "profiles"


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- validation helpers
class _Checker:
    """Carries the file path so every message can name it."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, problem: str, hint: str | None = None) -> UserError:
        return UserError(f"{self.path}: field '{field}' {problem}", hint or "see docs/profile-format.md")

    def keys(self, doc: dict[Any, Any], spec: dict[str, bool], prefix: str = "") -> None:
        for key in doc:
            if not isinstance(key, str) or key not in spec:
                close = difflib.get_close_matches(str(key), list(spec), n=1)
                guess = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
                raise UserError(
                    f"{self.path}: unknown field '{prefix}{quote(key, 40, bare=True)}'{guess}",
                    f"allowed here: {', '.join(spec)}",
                )
        for key, required in spec.items():
            if required and key not in doc:
                raise self.fail(f"{prefix}{key}", "is missing", "add it; see docs/profile-format.md")

    def number(self, value: Any, field: str, unit_key: str | None = None, *, allow_zero: bool = False) -> float:
        unit, top = _UNITS.get(unit_key or field.rsplit(".", 1)[-1], ("", math.inf))
        in_unit = f" in {unit}" if unit else ""
        if isinstance(value, str) and _is_float(value):
            if re.fullmatch(r"\s*[+-]?\d+[eE][+-]?\d+\s*", value):
                raise self.fail(field, f"is the text {quote(value)}, not a number (YAML reads exponents without a "
                                "'.' as text)", "write e.g. 1.0e3 or 1000")
            raise self.fail(field, f"is the text {quote(value)} (quoted), not a number{in_unit}",
                            f"write it without quotes: {field.rsplit('.', 1)[-1]}: {value.strip()}")
        if isinstance(value, str) and _UNIT_RE.match(value):
            raise self.fail(
                field,
                f"must be a plain number{in_unit} (the unit is fixed by the field name), got {quote(value)}",
                f"convert it to {unit or 'the unit in the field name'} and write only the number",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(field, f"must be a number{in_unit}, got {quote(value)}")
        if value < 0 or (value == 0 and not allow_zero):
            sign = "non-negative" if allow_zero else "positive"
            raise self.fail(field, f"must be a {sign} number{in_unit}, got {quote(value)}")
        if value > top:
            raise self.fail(
                field,
                f"is {quote(value)}, which is implausible{in_unit}",
                f"the field is in {unit}; was the value written in {_SLIPS.get(unit, 'another unit')}?",
            )
        return float(value)

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"must be a non-empty string, got {quote(value)}")
        return value

    def string_list(self, value: Any, field: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.fail(field, f"must be a list of strings, got {quote(value)}")
        return tuple(value)

    def schedule_map(self, doc: dict[str, Any], field: str) -> dict[str, float]:
        """An optional {schedule: non-negative number} field (the runtime's per-op overhead terms)."""
        m = self.mapping(doc.get(field) or {}, field)
        self.keys(m, {k: False for k in SCHEDULE_NAMES}, prefix=f"{field}.")
        return {k: self.number(v, f"{field}.{k}", field, allow_zero=True) for k, v in m.items()}

    def mapping(self, value: Any, field: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, f"must be a mapping (key: value lines), got {quote(value)}")
        return value

    def efficiency_keys(self, doc: dict[Any, Any], field: str) -> None:
        """Keys are op kinds (EFFICIENCY_KINDS), each optionally "@dtype"."""
        self.keys({str(k).split("@")[0]: v for k, v in doc.items()}, {k: False for k in EFFICIENCY_KINDS},
                  prefix=f"{field}.")
        for k in doc:
            if "@" in k and k.split("@", 1)[1] not in DTYPES:
                raise self.fail(f"{field}.{quote(k, 40, bare=True)}", f"names no dtype; write kind@dtype with one of "
                                f"{', '.join(DTYPES)}")

    def curve(self, value: Any, field: str) -> tuple[tuple[float, float], ...]:
        """A list of [flops_per_kernel, efficiency] pairs: MIN..MAX_CURVE_POINTS, FLOPs strictly increasing."""
        if not isinstance(value, list) or not MIN_CURVE_POINTS <= len(value) <= MAX_CURVE_POINTS:
            raise self.fail(field, f"must be a list of {MIN_CURVE_POINTS} to {MAX_CURVE_POINTS} "
                            f"[flops_per_kernel, efficiency] pairs, got {quote(value)}")
        points: list[tuple[float, float]] = []
        for i, pair in enumerate(value):
            where = f"{field}[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.fail(where, f"must be a pair [flops_per_kernel, efficiency], got {quote(pair)}")
            flops, eff = self.number(pair[0], where), self.number(pair[1], where)
            if flops > 1e18:
                raise self.fail(where, f"has {quote(pair[0])} FLOPs per kernel, which is implausible (at most 1e18)")
            if eff > MAX_CURVE_EFFICIENCY:
                raise self.fail(where, f"has efficiency {quote(pair[1])}; an achieved/peak fraction must be in "
                                f"(0, {MAX_CURVE_EFFICIENCY:g}]")
            if points and flops <= points[-1][0]:
                raise self.fail(where, f"FLOPs per kernel {quote(pair[0])} must be larger than the point before's "
                                f"({points[-1][0]:g}): sort the points by size")
            points.append((flops, eff))
        return tuple(points)

    def link(self, value: Any, field: str) -> Link:
        doc = self.mapping(value, field)
        self.keys(doc, _LINK_KEYS, prefix=f"{field}.")
        kind = self.string(doc["kind"], f"{field}.kind")
        bw = self.number(doc["bandwidth_gbps"], f"{field}.bandwidth_gbps")
        lat = self.number(doc["latency_us"], f"{field}.latency_us", allow_zero=True)
        if "notes" in doc:
            self.string(doc["notes"], f"{field}.notes")
        return Link(kind=kind, bandwidth_bytes_per_s=bw * 1e9, latency_s=lat / 1e6)


# ---------------------------------------------------------------- parse / dump
def parse_profile(doc: Any, path: str) -> HardwareProfile:
    """Validate one YAML document and convert it to SI units."""
    check_format(doc, path, PROFILE_FORMAT)
    c = _Checker(path)
    c.keys(doc, _TOP_KEYS)

    name = c.string(doc["name"], "name")
    if not NAME_RE.match(name):
        raise c.fail("name", f"must be up to 64 lower-case letters, digits, '.', '_' or '-' (got {quote(name)})", "e.g. name: my-a100")
    aliases = c.string_list(doc.get("aliases", []), "aliases")
    for a in aliases:
        if not NAME_RE.match(a):
            raise c.fail("aliases", f"entry {quote(a)} must be lower-case letters, digits, '.', '_' or '-'")
    device = c.string(doc["device"], "device")

    memory_gib = c.number(doc["memory_gib"], "memory_gib")
    usable_gib = c.number(doc["usable_memory_gib"], "usable_memory_gib")
    if usable_gib > memory_gib:
        raise c.fail("usable_memory_gib", f"({usable_gib:g} GiB) must not exceed memory_gib ({memory_gib:g} GiB)")
    bw = c.number(doc["memory_bandwidth_gbps"], "memory_bandwidth_gbps")

    peaks_doc = c.mapping(doc["peak_tflops"], "peak_tflops")
    c.keys(peaks_doc, {d: False for d in DTYPES}, prefix="peak_tflops.")
    peaks: dict[str, float | None] = {}
    for d in DTYPES:
        v = peaks_doc.get(d)
        peaks[d] = None if v is None else c.number(v, f"peak_tflops.{d}", "peak_tflops") * 1e12
    if not any(peaks.values()):
        raise c.fail("peak_tflops", "lists no dtype; give at least one of fp32, tf32, fp16, bf16")

    dpn = doc["devices_per_node"]
    if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
        raise c.fail("devices_per_node", f"must be a whole number >= 1, got {quote(dpn)}")

    intra = c.link(doc["intra_node"], "intra_node")
    inter = c.link(doc["inter_node"], "inter_node")

    eff_doc = c.mapping(doc.get("efficiency") or {}, "efficiency")
    c.efficiency_keys(eff_doc, "efficiency")
    curve_doc = c.mapping(doc.get("efficiency_curve") or {}, "efficiency_curve")
    c.efficiency_keys(curve_doc, "efficiency_curve")
    curves = {str(k): c.curve(v, f"efficiency_curve.{k}") for k, v in curve_doc.items()}
    channel_factors = _channel_factors(c, doc)
    efficiency = {}
    for k, v in eff_doc.items():
        e = c.number(v, f"efficiency.{k}")
        if e > 2.0:
            raise c.fail(f"efficiency.{k}", f"is an achieved/peak fraction and must be in (0, 2], got {quote(v)}")
        efficiency[k] = e

    slowdown = c.number(doc.get("concurrency_slowdown", 1.0), "concurrency_slowdown")
    collectives = c.mapping(doc.get("collectives") or {}, "collectives")
    c.keys(collectives, {k: False for k in COLLECTIVES}, prefix="collectives.")
    if not 1.0 <= slowdown <= 4.0:
        raise c.fail("concurrency_slowdown", f"is a factor on compute time in [1, 4], got {quote(slowdown)}")
    memory_slowdown = doc.get("memory_concurrency_slowdown")
    if memory_slowdown is not None:
        memory_slowdown = c.number(memory_slowdown, "memory_concurrency_slowdown")
        if not 1.0 <= memory_slowdown <= 4.0:
            raise c.fail("memory_concurrency_slowdown",
                         f"is a factor on memory-bound time in [1, 4], got {quote(memory_slowdown)}")
    overhead_s = {k: v * 1e-6 for k, v in c.schedule_map(doc, "op_overhead_us").items()}
    kernel_us = doc.get("kernel_overhead_us")
    dispatch_us = doc.get("dispatch_us")
    kernel_s = None if kernel_us is None else c.number(kernel_us, "kernel_overhead_us", allow_zero=True) * 1e-6
    dispatch_s = None if dispatch_us is None else c.number(dispatch_us, "dispatch_us", allow_zero=True) * 1e-6
    by_kind_s = _dispatch_by_kind(c, doc)
    per_byte_s = {k: v * 1e-6 / MIB for k, v in c.schedule_map(doc, "op_overhead_us_per_mib").items()}
    per_tensor_s = {k: v * 1e-6 for k, v in c.schedule_map(doc, "op_overhead_us_per_tensor").items()}
    alone_s = {k: v * 1e-6 for k, v in c.schedule_map(doc, "op_overhead_us_alone").items()}
    more_chunks_s = {k: v * 1e-6 for k, v in c.schedule_map(doc, "op_overhead_us_more_chunks").items()}
    optimizer_us = c.mapping(doc.get("optimizer_us_per_tensor") or {}, "optimizer_us_per_tensor")
    c.keys(optimizer_us, {k: False for k in OPTIMIZERS}, prefix="optimizer_us_per_tensor.")
    optimizer_s = {k: c.number(v, f"optimizer_us_per_tensor.{k}", "optimizer_us_per_tensor", allow_zero=True) * 1e-6
                   for k, v in optimizer_us.items()}
    param_ns = c.mapping(doc.get("optimizer_ns_per_param") or {}, "optimizer_ns_per_param")
    c.keys(param_ns, {k: False for k in OPTIMIZERS}, prefix="optimizer_ns_per_param.")
    param_s = {k: c.number(v, f"optimizer_ns_per_param.{k}", "optimizer_ns_per_param") * 1e-9
               for k, v in param_ns.items()}
    step_us = c.mapping(doc.get("optimizer_us_per_step") or {}, "optimizer_us_per_step")
    c.keys(step_us, {k: False for k in OPTIMIZERS}, prefix="optimizer_us_per_step.")
    step_s = {k: c.number(v, f"optimizer_us_per_step.{k}", "optimizer_us_per_step", allow_zero=True) * 1e-6
              for k, v in step_us.items()}
    recompute_s = c.number(doc.get("recompute_overhead_us", 0), "recompute_overhead_us", allow_zero=True) * 1e-6
    recompute_tensor_s = c.number(doc.get("recompute_us_per_saved_tensor", 0), "recompute_us_per_saved_tensor",
                                  allow_zero=True) * 1e-6
    split_s = c.number(doc.get("split_backward_overhead_us", 0), "split_backward_overhead_us", allow_zero=True) * 1e-6
    split_group_s = c.number(doc.get("split_backward_us_per_group", 0), "split_backward_us_per_group",
                             allow_zero=True) * 1e-6

    sources = c.string_list(doc.get("sources", []), "sources")
    confidence = c.mapping(doc.get("confidence") or {}, "confidence")
    for k, v in confidence.items():
        if v not in ("V", "S", "M"):
            raise c.fail(f"confidence.{k}", f"must be V, S or M, got {quote(v)}")
    notes = doc.get("notes", "")
    if not isinstance(notes, str):
        raise c.fail("notes", f"must be a string, got {quote(notes)}")
    local = doc.get("local", False)
    if not isinstance(local, bool):
        raise c.fail("local", f"must be true or false, got {quote(local)}")
    calibration = c.mapping(doc.get("calibration") or {}, "calibration")

    return HardwareProfile(
        name=name,
        device=device,
        memory_bytes=int(round(memory_gib * GIB)),
        usable_memory_bytes=int(round(usable_gib * GIB)),
        mem_bw_bytes_per_s=bw * 1e9,
        peak_flops=peaks,
        devices_per_node=dpn,
        intra_node=intra,
        inter_node=inter,
        efficiency=efficiency,
        sources=sources,
        local=local,
        path=str(path),
        aliases=aliases,
        confidence={str(k): v for k, v in confidence.items()},
        notes=notes,
        calibration=dict(calibration),
        op_overhead_s=overhead_s,
        op_overhead_s_per_byte=per_byte_s,
        op_overhead_s_per_tensor=per_tensor_s,
        op_overhead_alone_s=alone_s,
        op_overhead_more_chunks_s=more_chunks_s,
        concurrency_slowdown=slowdown,
        memory_concurrency_slowdown=memory_slowdown,
        collectives={k: c.link(v, f"collectives.{k}") for k, v in collectives.items()},
        kernel_overhead_s=kernel_s,
        dispatch_s=dispatch_s,
        dispatch_by_kind_s=by_kind_s,
        efficiency_curve=curves,
        channel_factors=channel_factors,
        optimizer_tensor_s=optimizer_s,
        optimizer_param_s=param_s,
        optimizer_step_s=step_s,
        recompute_overhead_s=recompute_s,
        recompute_tensor_s=recompute_tensor_s,
        split_backward_s=split_s,
        split_backward_group_s=split_group_s,
    )


def _num(x: float) -> float | int:
    """Short, exact-enough YAML numbers (10 significant digits; ints stay ints)."""
    r = float(f"{x:.10g}")
    return int(r) if r.is_integer() and abs(r) < 1e15 else r


def profile_to_dict(profile: HardwareProfile) -> dict[str, Any]:
    """The YAML document (datasheet units) for a profile; also the `--json` form."""

    def link(l: Link) -> dict[str, Any]:
        return {"kind": l.kind, "bandwidth_gbps": _num(l.bandwidth_bytes_per_s / 1e9), "latency_us": _num(l.latency_s * 1e6)}

    doc: dict[str, Any] = {"format": PROFILE_FORMAT, "name": profile.name}
    if profile.aliases:
        doc["aliases"] = list(profile.aliases)
    doc.update(
        device=profile.device,
        memory_gib=_num(profile.memory_bytes / GIB),
        usable_memory_gib=_num(profile.usable_memory_bytes / GIB),
        memory_bandwidth_gbps=_num(profile.mem_bw_bytes_per_s / 1e9),
        peak_tflops={d: (None if not (peak := profile.peak_flops.get(d)) else _num(peak / 1e12)) for d in DTYPES},
        devices_per_node=profile.devices_per_node,
        intra_node=link(profile.intra_node),
        inter_node=link(profile.inter_node),
    )
    if profile.efficiency:
        doc["efficiency"] = {k: _num(v) for k, v in profile.efficiency.items()}
    if profile.efficiency_curve:
        doc["efficiency_curve"] = {k: [[_num(f), _num(e)] for f, e in pts] for k, pts in profile.efficiency_curve.items()}
    if profile.kernel_overhead_s is not None:
        doc["kernel_overhead_us"] = _num(profile.kernel_overhead_s * 1e6)
    if profile.dispatch_s is not None:
        doc["dispatch_us"] = _num(profile.dispatch_s * 1e6)
    if profile.channel_factors:
        doc["channel_factors"] = {k: {"forward": [[_num(x), _num(y)] for x, y in fwd],
                                      "backward": [[_num(x), _num(y)] for x, y in bwd]}
                                  for k, (fwd, bwd) in profile.channel_factors.items()}
    if profile.dispatch_by_kind_s:
        doc["dispatch_us_by_kind"] = {k: [_num(f * 1e6), _num(b * 1e6)] for k, (f, b) in profile.dispatch_by_kind_s.items()}
    if profile.concurrency_slowdown != 1.0:
        doc["concurrency_slowdown"] = _num(profile.concurrency_slowdown)
    if profile.memory_concurrency_slowdown is not None:
        doc["memory_concurrency_slowdown"] = _num(profile.memory_concurrency_slowdown)
    if profile.op_overhead_s:
        doc["op_overhead_us"] = {k: _num(v * 1e6) for k, v in profile.op_overhead_s.items()}
    if profile.op_overhead_s_per_byte:
        doc["op_overhead_us_per_mib"] = {k: _num(v * 1e6 * MIB) for k, v in profile.op_overhead_s_per_byte.items()}
    if profile.op_overhead_s_per_tensor:
        doc["op_overhead_us_per_tensor"] = {k: _num(v * 1e6) for k, v in profile.op_overhead_s_per_tensor.items()}
    if profile.op_overhead_alone_s:
        doc["op_overhead_us_alone"] = {k: _num(v * 1e6) for k, v in profile.op_overhead_alone_s.items()}
    if profile.op_overhead_more_chunks_s:
        doc["op_overhead_us_more_chunks"] = {k: _num(v * 1e6) for k, v in profile.op_overhead_more_chunks_s.items()}
    if profile.optimizer_tensor_s:
        doc["optimizer_us_per_tensor"] = {k: _num(v * 1e6) for k, v in profile.optimizer_tensor_s.items()}
    if profile.optimizer_param_s:
        doc["optimizer_ns_per_param"] = {k: _num(v * 1e9) for k, v in profile.optimizer_param_s.items()}
    if profile.optimizer_step_s:
        doc["optimizer_us_per_step"] = {k: _num(v * 1e6) for k, v in profile.optimizer_step_s.items()}
    if profile.recompute_overhead_s or profile.recompute_tensor_s:
        doc["recompute_overhead_us"] = _num(profile.recompute_overhead_s * 1e6)
        doc["recompute_us_per_saved_tensor"] = _num(profile.recompute_tensor_s * 1e6)
    if profile.split_backward_s or profile.split_backward_group_s:
        doc["split_backward_overhead_us"] = _num(profile.split_backward_s * 1e6)
        doc["split_backward_us_per_group"] = _num(profile.split_backward_group_s * 1e6)
    if profile.local:
        doc["local"] = True
    if profile.collectives:
        doc["collectives"] = {k: link(v) for k, v in profile.collectives.items()}
    if profile.calibration:
        doc["calibration"] = profile.calibration
    if profile.confidence:
        doc["confidence"] = dict(profile.confidence)
    if profile.notes:
        doc["notes"] = profile.notes
    doc["sources"] = list(profile.sources)
    return doc


def _channel_factors(c: _Checker, doc: dict[str, Any]) -> dict[str, Any]:
    """`channel_factors: {kind@dtype: {forward: [[channels, factor], ...], backward: [...]}}`, each list checked as
    an efficiency curve (channels increasing, factors in (0, 16])."""
    raw = c.mapping(doc.get("channel_factors") or {}, "channel_factors")
    c.efficiency_keys(raw, "channel_factors")
    out = {}
    for key, sides in raw.items():
        sides = c.mapping(sides, f"channel_factors.{key}")
        c.keys(sides, {"forward": True, "backward": True}, prefix=f"channel_factors.{key}.")
        out[str(key)] = (c.curve(sides["forward"], f"channel_factors.{key}.forward"),
                         c.curve(sides["backward"], f"channel_factors.{key}.backward"))
    return out


def _dispatch_by_kind(c: _Checker, doc: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """`dispatch_us_by_kind: {kind: [forward µs, backward µs]}` in seconds (profile.DISPATCH_KINDS)."""
    raw = c.mapping(doc.get("dispatch_us_by_kind") or {}, "dispatch_us_by_kind")
    c.keys(raw, {k: False for k in DISPATCH_KINDS}, prefix="dispatch_us_by_kind.")
    out = {}
    for kind, pair in raw.items():
        field = f"dispatch_us_by_kind.{kind}"
        if not isinstance(pair, list) or len(pair) != 2:
            raise c.fail(field, f"is [forward µs, backward µs], got {quote(pair)}")
        fwd, bwd = (c.number(v, field, "dispatch_us_by_kind", allow_zero=True) * 1e-6 for v in pair)
        out[kind] = (fwd, bwd)
    return out


class _Dumper(yaml.SafeDumper):
    """Block style, except short lists/maps of scalars on one line (peak_tflops, links)."""


def _short(items: Iterable[object]) -> bool:
    return all(not isinstance(v, (list, dict)) and len(str(v)) <= 24 for v in items)


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=_short(v)))
_Dumper.add_representer(
    dict, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(), flow_style=len(v) <= 8 and _short(v.values()))
)


def dump_profile(profile: HardwareProfile) -> str:
    return yaml.dump(profile_to_dict(profile), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> None:
    """Write the YAML form atomically (an interrupted write never leaves half a file)."""
    atomic_write_text(path, dump_profile(profile))


def read_profile_file(path: str | os.PathLike[str]) -> HardwareProfile:
    """Load and validate one YAML file."""
    p = Path(path)
    text = read_text(p, what="profile YAML file", missing="no such profile file",
                     missing_hint="check the path, or run `pipeplan profiles list` for names")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        _refuse_aliases(text, p, loader)
        doc = yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "nesting depth" in problem:  # libyaml's own limit (0.2.5+), met while scanning ahead of our count
            raise UserError(f"{p}{where}: nested deeper than {MAX_NESTING} levels", "pass a profile") from None
        raise UserError(f"{p}: invalid YAML{where}: {problem}", "fix the YAML syntax") from None
    if doc is None:
        raise UserError(f"{p}: empty file, not a pipeplan profile", f"a profile starts with 'format: {PROFILE_FORMAT}'")
    return parse_profile(doc, str(p))


def _refuse_aliases(text: str, path: Path, loader: Any) -> None:
    """Profiles have no use for YAML anchors and aliases, and aliases are how a few hundred bytes expand
    to gigabytes ("billion laughs"): refuse the first one, and nesting deeper than MAX_NESTING, from the
    event stream, before anything is built."""
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionStartEvent):  # libyaml's loader recurses per level: deep input crashes it
            depth += 1
            if depth > MAX_NESTING:
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise UserError(f"{path}: line {line}: nested deeper than {MAX_NESTING} levels", "pass a profile")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark else 0
            raise UserError(f"{path}: line {line}: YAML aliases (*{quote(event.anchor, 30, bare=True)}) are not "
                            "allowed in a profile", "write the values out")


# ---------------------------------------------------------------- discovery
@functools.lru_cache(maxsize=1)
def _catalog() -> tuple[HardwareProfile, ...]:
    return tuple(read_profile_file(p) for p in sorted(CATALOG_DIR.glob("*.yaml")))


def catalog_profiles() -> list[HardwareProfile]:
    """Fresh copies: the parsed catalogue is cached, and a caller mutating a profile's
    dicts (peak_flops, efficiency) must not change what the next caller sees."""
    return copy.deepcopy(list(_catalog()))


def user_profiles() -> list[HardwareProfile]:
    """Profiles in the user folder; a broken file there is reported, not skipped."""
    d = user_profile_dir()
    if not d.is_dir():
        return []
    files = sorted([*d.glob("*.yaml"), *d.glob("*.yml")])
    out = [read_profile_file(p) for p in files]
    seen: dict[str, str] = {}
    for prof in out:
        for n in (prof.name, *prof.aliases):
            if n in seen and seen[n] != prof.path:
                raise UserError(f"{prof.path}: profile name {n!r} is also used by {seen[n]}", "rename one of them")
            seen[n] = prof.path
    return out


def list_profiles() -> list[HardwareProfile]:
    """Catalogue then user profiles; a user profile shadows a catalogue one of the same name."""
    users = user_profiles()
    user_names = {n for p in users for n in (p.name, *p.aliases)}
    return [p for p in catalog_profiles() if p.name not in user_names] + users


def _looks_like_path(s: str) -> bool:
    return s.endswith((".yaml", ".yml")) or "/" in s or os.sep in s or s.startswith(".")


def profile_reference(profile: HardwareProfile) -> str:
    """What a plan records so `show` finds the same profile again: a catalogue or user-folder profile by
    name, one loaded from a YAML path by that path (absolute: the plan may be shown from another folder)."""
    if not profile.path:
        return profile.name
    folder = Path(profile.path).resolve().parent
    if folder in (CATALOG_DIR.resolve(), user_profile_dir().resolve()):
        return profile.name
    return str(Path(profile.path).resolve())


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A profile by catalogue name/alias, user-folder name, or YAML path."""
    if isinstance(name_or_path, HardwareProfile):  # be forgiving to callers that already hold one
        return name_or_path
    s = os.fspath(name_or_path)
    if _looks_like_path(s):
        return read_profile_file(s)
    key = s.strip().lower()
    for prof in [*user_profiles(), *_catalog()]:  # user first: it shadows the catalogue
        if key == prof.name or key in prof.aliases:
            return copy.deepcopy(prof)
    names = [n for p in list_profiles() for n in (p.name, *p.aliases)]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UserError(
        f"unknown hardware profile {quote(s)}",
        f"{hint}run `pipeplan profiles list` for names, or pass a YAML file path",
    )
