"""Byte units, defined once (binary: what `nvidia-smi` and PyTorch's allocator report)."""

from __future__ import annotations

from typing import Final

__all__ = ["KIB", "MIB", "GIB"]

KIB: Final = 2**10
MIB: Final = 2**20
GIB: Final = 2**30
