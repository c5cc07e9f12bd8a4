"""Per-stage checkpoint shards plus a manifest, so a run can resume after a failure.

Layout of `--checkpoint-dir D`:
    D/step-000012/stage-0.pt ...   one shard per stage (its parameters, buffers, optimizer state)
    D/step-000012/manifest.json    written last, by rank 0, after every shard is on disk
    D/latest.json                  points at the newest complete step (written after its manifest)
Each file is written atomically (temp file + rename), so a crash leaves either
the previous complete checkpoint or the new one, never a half-written one: a
step folder without a manifest is ignored. Shards are plain tensors and dicts
(`torch.load(weights_only=True)`), never pickled objects.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from pipeplan._io import atomic_write_bytes, atomic_write_json, check_format, read_json
from pipeplan.errors import UserError
from pipeplan.fields import Fields

CHECKPOINT_FORMAT = "pipeplan.checkpoint/v1"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_shard(root: str | os.PathLike, step: int, stage: int, module: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None, loss_scale: dict[str, Any] | None = None) -> None:
    """One stage's parameters, buffers and optimizer state (none for a stage without trainable parameters), and an
    fp16 run's loss scaler (runtime/loss_scale.py; every rank holds the same)."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    opt_state = optimizer.state_dict() if optimizer is not None else {}
    doc = {"step": step, "stage": stage, "model": module.state_dict(), "optimizer": opt_state}
    if loss_scale is not None:
        doc["loss_scale"] = loss_scale
    torch.save(doc, buf)
    atomic_write_bytes(folder / f"stage-{stage}.pt", buf.getvalue())


def save_manifest(root: str | os.PathLike, step: int, *, stages: int, fingerprint: str, losses: list[float]) -> None:
    """Called once every shard of `step` exists (after a barrier). Each shard's size and SHA-256 go in the
    manifest, so a resume can tell a truncated or damaged shard and fall back to an older checkpoint."""
    folder = step_dir(root, step)
    missing = [s for s in range(stages) if not (folder / f"stage-{s}.pt").exists()]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: shards of stages {missing} are missing")
    shards = [f"stage-{s}.pt" for s in range(stages)]
    doc = {"format": CHECKPOINT_FORMAT, "step": step, "stages": stages, "fingerprint": fingerprint,
           "shards": shards, "shard_bytes": [(folder / s).stat().st_size for s in shards],
           "shard_sha256": [_sha256(folder / s) for s in shards], "losses": losses}
    atomic_write_json(folder / "manifest.json", doc)
    atomic_write_json(Path(root) / "latest.json", {"format": CHECKPOINT_FORMAT, "step": step, "dir": folder.name})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest, every field checked (pipeplan/fields.py), with "path" set to its folder."""
    doc = read_json(path, "checkpoint manifest")
    check_format(doc, path, CHECKPOINT_FORMAT)
    f = Fields(path, "delete this checkpoint folder or resume from another --checkpoint-dir")
    f.integer(f.require(doc, "step", "step"), "step")
    stages = f.integer(f.require(doc, "stages", "stages"), "stages", low=1)
    f.string(f.require(doc, "fingerprint", "fingerprint"), "fingerprint")
    shards = f.strings(f.require(doc, "shards", "shards"), "shards")
    if shards != [f"stage-{s}.pt" for s in range(stages)]:
        raise f.fail("shards", shards, f"stage-0.pt .. stage-{stages - 1}.pt")
    for key in ("shard_bytes", "shard_sha256"):
        if key in doc and len(f.items(doc[key], key)) != stages:
            raise f.fail(key, doc[key], f"one entry per shard ({stages})")
    doc["path"] = str(path.parent)
    return doc


def damage(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a checkpoint's shards (missing, truncated, changed), or None when intact."""
    for stage in range(len(manifest["shards"])):
        problem = shard_damage(manifest, stage)
        if problem is not None:
            return problem
    return None


def shard_damage(manifest: dict[str, Any], stage: int) -> str | None:
    """What is wrong with one stage's shard, or None when it matches the manifest's size and SHA-256."""
    shard = Path(manifest["path"]) / manifest["shards"][stage]
    if not shard.is_file():
        return f"{shard} is missing"
    if "shard_bytes" in manifest and shard.stat().st_size != manifest["shard_bytes"][stage]:
        return f"{shard} has {shard.stat().st_size} bytes, the manifest says {manifest['shard_bytes'][stage]}"
    if "shard_sha256" in manifest and _sha256(shard) != manifest["shard_sha256"][stage]:
        return f"{shard} does not match its SHA-256 in the manifest"
    return None


def latest(root: str | os.PathLike, *, stages: int, fingerprint: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest intact checkpoint's manifest (or None) and one line per newer one skipped as damaged.

    A step folder without a manifest was interrupted while saving and is ignored;
    a manifest of another model or plan is an error (resuming from it would
    silently train something else).
    """
    skipped = []
    for manifest_path in sorted(Path(root).glob("step-*/manifest.json"), reverse=True):
        doc = read_manifest(manifest_path)
        if doc["fingerprint"] != fingerprint or doc["stages"] != stages:
            raise UserError(
                f"{manifest_path}: checkpoint is of another model or plan (fingerprint/stages differ)",
                "pass the plan it was written with, or another --checkpoint-dir",
            )
        problem = damage(doc)
        if problem is None:
            return doc, skipped
        skipped.append(f"skipped the checkpoint of step {doc['step']}: {problem}")
    return None, skipped


def load_shard(manifest: dict[str, Any], stage: int, module: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """Load one stage's shard, checked against the manifest first (the launcher checked the whole checkpoint,
    but a file can change in between); a shard torch cannot read is a user error naming it, not a traceback.
    Returns the loss scaler's state where an fp16 run saved one."""
    path = Path(manifest["path"]) / f"stage-{stage}.pt"
    hint = "delete that step folder to resume from the one before"
    problem = shard_damage(manifest, stage)
    if problem is not None:
        raise UserError(f"damaged checkpoint shard: {problem}", hint)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        scaled = state.get("loss_scale")
        return dict(scaled) if isinstance(scaled, dict) else None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError) as e:
        raise UserError(f"{path}: unreadable checkpoint shard ({str(e)[:80]})", hint) from None
