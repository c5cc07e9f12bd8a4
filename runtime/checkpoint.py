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

import io
import os
from pathlib import Path
from typing import Any

import torch

from pipeplan._io import atomic_write_bytes, atomic_write_json, read_json
from pipeplan.errors import UserError

CHECKPOINT_FORMAT = "pipeplan.checkpoint/v1"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_shard(root: str | os.PathLike, step: int, stage: int, module: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> None:
    """One stage's parameters, buffers and optimizer state (none for a stage without trainable parameters)."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    opt_state = optimizer.state_dict() if optimizer is not None else {}
    torch.save({"step": step, "stage": stage, "model": module.state_dict(), "optimizer": opt_state}, buf)
    atomic_write_bytes(folder / f"stage-{stage}.pt", buf.getvalue())


def save_manifest(root: str | os.PathLike, step: int, *, stages: int, fingerprint: str, losses: list[float]) -> None:
    """Called once every shard of `step` exists (after a barrier)."""
    folder = step_dir(root, step)
    missing = [s for s in range(stages) if not (folder / f"stage-{s}.pt").exists()]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: shards of stages {missing} are missing")
    doc = {"format": CHECKPOINT_FORMAT, "step": step, "stages": stages, "fingerprint": fingerprint,
           "shards": [f"stage-{s}.pt" for s in range(stages)], "losses": losses}
    atomic_write_json(folder / "manifest.json", doc)
    atomic_write_json(Path(root) / "latest.json", {"format": CHECKPOINT_FORMAT, "step": step, "dir": folder.name})


def latest(root: str | os.PathLike, *, stages: int, fingerprint: str) -> dict[str, Any] | None:
    """The newest complete checkpoint's manifest, or None when there is none."""
    root = Path(root)
    candidates = sorted(root.glob("step-*/manifest.json"), reverse=True)
    for manifest in candidates:
        doc = read_json(manifest, "checkpoint manifest")
        if doc.get("format") != CHECKPOINT_FORMAT:
            continue
        if doc.get("fingerprint") != fingerprint or doc.get("stages") != stages:
            raise UserError(
                f"{manifest}: checkpoint is of another model or plan (fingerprint/stages differ)",
                "pass the plan it was written with, or another --checkpoint-dir",
            )
        doc["path"] = str(manifest.parent)
        return doc
    return None


def load_shard(manifest: dict[str, Any], stage: int, module: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> None:
    path = Path(manifest["path"]) / f"stage-{stage}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    module.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
