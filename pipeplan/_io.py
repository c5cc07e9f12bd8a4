"""Atomic file output and friendly JSON input, used by every writer and reader.

Outputs go to a temp file in the target's folder and are renamed into place, so
an interrupted run never leaves a half-written plan, graph or profile.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeplan.errors import UserError


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise UserError(f"{path}: folder {directory} does not exist", "create it or pick another output path")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def read_text(path: str | os.PathLike[str], *, what: str, missing: str | None = None,
              missing_hint: str = "check the path") -> str:
    """A user's input file as text; a missing or binary file is a one-line user error.

    `what` names the kind of file expected ("a profile YAML file"); `missing` is
    the message's noun when the path does not exist (default: "no such " + what).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: {missing or 'no such ' + what}", missing_hint)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a text file", f"pass a {what}") from None


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """Read JSON, turning the usual failures into one-line user errors."""
    text = read_text(path, what=what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", f"pass a valid {what}") from None


def check_format(doc: Any, path: str | os.PathLike[str], expected: str) -> None:
    """Reject documents of another kind or version with a clear message.

    `expected` looks like "pipeplan.plan/v1"; the kind and the version are checked
    separately so the message can say which of the two is wrong.
    """
    if not isinstance(doc, dict) or "format" not in doc:
        raise UserError(f"{path}: not a pipeplan file (no \"format\" field; expected {expected!r})")
    got = doc["format"]
    kind, _, version = expected.partition("/")
    if not isinstance(got, str) or got.partition("/")[0] != kind:
        raise UserError(f"{path}: format is {got!r}, expected {expected!r}", "pass the right kind of file")
    if got != expected:
        raise UserError(
            f"{path}: format version {got.partition('/')[2]!r} is not supported (this pipeplan reads {version!r})",
            "regenerate the file with this version of pipeplan",
        )
