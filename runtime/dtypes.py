"""The storage dtypes of embedding weights and their sizes: the one table of them.

Torch-free (the compiler reads it); the torch dtypes are in `embark_runtime.storage`.
"""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes per element of each embedding dtype."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)
