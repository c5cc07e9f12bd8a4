"""Atomic file output and bounded, friendly JSON input, used by every writer and reader.

Outputs go to a temp file in the target's folder and are renamed into place, so
an interrupted run never leaves a half-written plan, graph or profile; the file
gets the mode any new file would get under the user's umask (mkstemp's 0600 is
for the temp name only). Destinations are checked before long work starts
(`check_destination`). Inputs are bounded in size and nesting so a hostile or
broken file is a one-line user error, not a hang or a memory blow-up.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeplan.errors import UserError

MAX_INPUT_BYTES = 256 * 2**20
"""Largest input file read (graphs of leaf-level traces of big models run to tens of MB)."""
MAX_NESTING = 64
"""Deepest nesting of lists/maps accepted in JSON and YAML input (real files nest fewer than 8 levels)."""


def _new_file_mode() -> int:
    """0666 less the process umask: what open() would give a new file (umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def check_destination(path: str | os.PathLike[str], option: str = "output") -> None:
    """Fail now, naming the option, if `path` cannot be written: before the work, not after it."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{option} {path}: is a folder", "give a file name")
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{option} {path}: {directory} is a file, not a folder", "pick another output path")
    if not directory.is_dir():
        raise UserError(f"{option} {path}: folder {directory} does not exist", "create it or pick another output path")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: folder {directory} is not writable", "pick another output path")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    check_destination(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, _new_file_mode())
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
    if p.is_dir():
        raise UserError(f"{p}: is a folder", f"pass a {what}")
    if not p.is_file():
        raise UserError(f"{p}: {missing or 'no such ' + what}", missing_hint)
    size = p.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise UserError(f"{p}: {size / 2**20:.0f} MiB is larger than any {what} ({MAX_INPUT_BYTES // 2**20} MiB at most)",
                        f"pass a {what}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a text file", f"pass a {what}") from None
    except OSError as e:
        raise UserError(f"{p}: cannot be read ({e.strerror})", "check its permissions") from None


def check_nesting(doc: Any, path: str | os.PathLike[str], limit: int = MAX_NESTING) -> None:
    """Reject documents nested deeper than `limit` (walked without recursion)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    raise UserError(f"{path}: nested deeper than {limit} levels", "pass a file pipeplan wrote")
                stack.append((child, depth + 1))


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """Read JSON, turning the usual failures into one-line user errors."""
    text = read_text(path, what=what)
    try:
        doc = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", f"pass a valid {what}") from None
    except RecursionError:
        raise UserError(f"{path}: nested deeper than {MAX_NESTING} levels", f"pass a valid {what}") from None
    except ValueError as e:  # NaN/Infinity (json accepts them, JSON does not), huge integers
        raise UserError(f"{path}: invalid JSON: {e}", f"pass a valid {what}") from None
    check_nesting(doc, path)
    return doc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


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
