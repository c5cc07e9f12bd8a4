"""`pipeplan profiles list|show|calibrate`: browse the hardware catalogue and measure this machine.

Listing and showing only read YAML (no torch import), so they stay instant;
`calibrate` imports torch and spawns two processes for the link test.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from pipeplan._io import check_destination
from pipeplan.choices import DTYPES
from pipeplan.cli.console import stdout_console
from pipeplan.errors import UserError
from pipeplan.hardware_profiles import list_profiles, load_profile, profile_to_dict, save_profile, user_profile_dir
from pipeplan.hardware_profiles.loader import CATALOG_DIR, NAME_RE
from pipeplan.hardware_profiles.profile import HardwareProfile, Link
from pipeplan.units import GIB


def _tf(x: float | None) -> str:
    return "—" if not x else f"{x / 1e12:.4g}"


def _link(l: Link) -> str:
    return f"{l.kind} {l.bandwidth_bytes_per_s / 1e9:.5g} GB/s {l.latency_s * 1e6:.3g} µs"


def _origin(p: HardwareProfile) -> str:
    if p.path and Path(p.path).resolve().parent == CATALOG_DIR:
        return "catalog"
    return "local" if p.local else "user"


def _as_json(p: HardwareProfile) -> dict:
    d = profile_to_dict(p)
    d["origin"] = _origin(p)
    d["path"] = p.path
    return d


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=1))


@click.group()
def profiles() -> None:
    """Hardware profiles: the catalogue, your own YAML files, and calibration of this machine."""


@profiles.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of profiles (YAML fields, datasheet units).")
def list_cmd(as_json: bool) -> None:
    """List catalogue profiles and those in the user folder ($PIPEPLAN_PROFILE_DIR)."""
    items = list_profiles()
    if as_json:
        _print_json([_as_json(p) for p in items])
        return
    table = Table(title="Hardware profiles", caption=f"user profiles: {user_profile_dir()}")
    for col, just in [("name", "left"), ("device", "left"), ("memory GiB\nusable/total", "right"),
                      ("mem BW\nGB/s", "right"), ("bf16\nTFLOP/s", "right"), ("fp32\nTFLOP/s", "right"),
                      ("per\nnode", "right"), ("intra-node link", "left"), ("inter-node link", "left"), ("from", "left")]:
        table.add_column(col, justify=just)
    for p in items:
        table.add_row(
            p.name, p.device,
            f"{p.usable_memory_bytes / GIB:.4g}/{p.memory_bytes / GIB:.4g}",
            f"{p.mem_bw_bytes_per_s / 1e9:.4g}",
            _tf(p.peak_flops.get("bf16")), _tf(p.peak_flops.get("fp32")),
            str(p.devices_per_node), _link(p.intra_node), _link(p.inter_node), _origin(p),
        )
    stdout_console().print(table)


@profiles.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as one JSON document.")
def show_cmd(name: str, as_json: bool) -> None:
    """Show one profile: NAME is a catalogue name, an alias, a user profile name or a YAML path."""
    p = load_profile(name)
    if as_json:
        _print_json(_as_json(p))
        return
    t = Table(title=f"{p.name} — {p.device}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("aliases", ", ".join(p.aliases) or "—")
    t.add_row("file", f"{p.path} ({_origin(p)})")
    t.add_row("memory", f"{p.memory_bytes / GIB:.4g} GiB nominal, {p.usable_memory_bytes / GIB:.4g} GiB usable")
    t.add_row("memory bandwidth", f"{p.mem_bw_bytes_per_s / 1e9:.4g} GB/s")
    for d in DTYPES:
        v = p.peak_flops.get(d)
        t.add_row(f"peak {d}", f"{v / 1e12:.4g} TFLOP/s" if v else "not supported")
    t.add_row("devices per node", str(p.devices_per_node))
    t.add_row("intra-node link", _link(p.intra_node))
    t.add_row("inter-node link", _link(p.inter_node))
    t.add_row("efficiency overrides", ", ".join(f"{k}={v:.3g}" for k, v in p.efficiency.items()) or "— (cost-model defaults)")
    if p.op_overhead_s:
        t.add_row("runtime per op", p.op_overhead_text())
    for label, value in _overhead_rows(p):
        t.add_row(label, value)
    if p.confidence:
        t.add_row("confidence", ", ".join(f"{k}:{v}" for k, v in p.confidence.items()))
    if p.notes:
        t.add_row("notes", p.notes)
    for k, v in p.calibration.items():
        t.add_row("calibration" if k == next(iter(p.calibration)) else "", f"{k}: {_brief(v)}")
    for i, s in enumerate(p.sources):
        t.add_row("sources" if i == 0 else "", s)
    stdout_console().print(t)


def _overhead_rows(p) -> list[tuple[str, str]]:
    """The per-kernel, per-op and optimizer figures a profile measured (or states), one row each."""
    rows = []
    if p.kernel_overhead_s is not None or p.dispatch_s is not None:
        k = "—" if p.kernel_overhead_s is None else f"{p.kernel_overhead_s * 1e6:.3g} µs a kernel"
        d = "—" if p.dispatch_s is None else f"{p.dispatch_s * 1e6:.3g} µs an op"
        rows.append(("kernel / host per op", f"{k}; {d}"))
    if p.dispatch_by_kind_s:
        rows.append(("host per op by kind", ", ".join(f"{k} {f * 1e6:.3g}/{b * 1e6:.3g}"
                                                     for k, (f, b) in p.dispatch_by_kind_s.items()) + " µs fwd/bwd"))
    if p.optimizer_tensor_s or p.optimizer_param_s:
        rows.append(("optimizer step", ", ".join(
            f"{name} {p.optimizer_tensor_s.get(name, 0) * 1e6:.3g} µs a tensor + "
            f"{p.optimizer_param_s.get(name, 0) * 1e9:.3g} ns a parameter"
            for name in sorted(set(p.optimizer_tensor_s) | set(p.optimizer_param_s)))))
    for key, (fwd, bwd) in p.channel_factors.items():
        scaled = "memory efficiency" if key.split("@")[0] == "norm" else "curve"  # part_costs.channel_factor
        rows.append((f"{key} by channels", f"x the {scaled}: forward " + ", ".join(f"{c:g}: {f:.2f}" for c, f in fwd)
                     + "; backward " + ", ".join(f"{c:g}: {f:.2f}" for c, f in bwd)))
    if p.efficiency_curve:
        rows.append(("efficiency curves", ", ".join(f"{k} ({len(v)} points)" for k, v in p.efficiency_curve.items())))
    return rows


def _brief(value, limit: int = 160) -> str:
    """A calibration value as text, a long one (a table of measurements) cut with a pointer to the file."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters; the YAML file has it all)"


@profiles.command("calibrate")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file to write (atomically).")
@click.option("--name", default="local", show_default=True, help="Profile name to store in the file.")
@click.option("--budget-s", default=45.0, show_default=True, type=click.FloatRange(5.0, 600.0),
              help="Wall-time cap for the compute and memory timing loops (they stop sooner once stable); on a "
                   "CPU the link, collective and pipeline measurements take ~40-55 s more, ~25 s less with a "
                   "budget under 30 s (one round of pipelines, noisier op overheads).")
@click.option("--json", "as_json", is_flag=True, help="Also print the measured profile as JSON on stdout.")
@click.option("--quiet", is_flag=True, help="No progress display.")
@click.option("--device", "device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="What to measure: cuda (GPU 0: efficiency curves, bandwidth, overheads, NCCL with 2+ GPUs) or "
                   "cpu (one core per device); auto picks cuda when a GPU is visible.")
def calibrate_cmd(output: Path, name: str, budget_s: float, as_json: bool, quiet: bool, device: str) -> None:
    """Measure this machine (matmul/conv FLOP/s, memory and process-to-process bandwidth) into a profile."""
    from pipeplan.cli.progress import progress_display
    from pipeplan.costmodels.trace import resolve_device
    from pipeplan.hardware_profiles.calibrate import calibrate

    if not math.isfinite(budget_s):  # click's range lets "nan" through (every comparison with NaN is false)
        raise UserError(f"--budget-s {budget_s}: not a number of seconds", "e.g. --budget-s 45")
    if not NAME_RE.match(name):
        raise UserError(f"--name {name!r}: use lower-case letters, digits, '.', '_' or '-'", "e.g. --name my-workstation")
    check_destination(output, "-o")
    if resolve_device(device) == "cuda":  # --device cuda without a GPU: exit 2 here
        _calibrate_cuda(output, name, as_json, quiet)
        return
    with progress_display(enabled=not quiet) as phases:
        prof = calibrate(budget_s=budget_s, progress=phases("calibrate: "), name=name)
    save_profile(prof, output)
    prof = dataclasses.replace(prof, path=str(output))
    if as_json:
        _print_json(_as_json(prof))
    else:
        c = Console(stderr=True)
        c.print(f"wrote {output}: fp32 {_tf(prof.peak_flops['fp32'])} TFLOP/s per core, bf16 {_tf(prof.peak_flops['bf16'])}, "
                f"memory {prof.mem_bw_bytes_per_s / 1e9:.3g} GB/s, link {_link(prof.intra_node)}")
        c.print(f"use it with --profile {output}")


def _calibrate_cuda(output: Path, name: str, as_json: bool, quiet: bool) -> None:
    """`profiles calibrate` on GPU 0 (hardware_profiles/calibrate_cuda.py); --budget-s does not apply (~1 min)."""
    from pipeplan.cli.progress import progress_display
    from pipeplan.costmodels.norm_calibration import with_batch_norm_factors
    from pipeplan.hardware_profiles.calibrate_cuda import calibrate_cuda

    with progress_display(enabled=not quiet) as phases:
        prof = with_batch_norm_factors(calibrate_cuda(name=name, progress=phases("calibrate (cuda): ")))
    save_profile(prof, output)
    prof = dataclasses.replace(prof, path=str(output))
    if as_json:
        _print_json(_as_json(prof))
        return
    best = prof.calibration.get("best_gemm_tflops", {})
    c = Console(stderr=True)
    c.print(f"wrote {output}: {prof.device}; best GEMM TFLOP/s {best}; copy {prof.calibration.get('copy_gbps')} GB/s; "
            f"kernel {(prof.kernel_overhead_s or 0) * 1e6:.2f} µs, dispatch {(prof.dispatch_s or 0) * 1e6:.2f} µs")
    c.print(f"use it with --profile {output}")
