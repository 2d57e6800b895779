"""Initial embedding values: a pure function of (seed, table, global row, column).

Because no sequential generator is involved, the value of an element does not depend on
which rank holds it, in which order shards are created, or how the plan cut the table:
two plans (and the unsharded reference) start from bit-identical models, and any shard
is initialised independently with a few vectorised integer ops per element (on the
shard's device, so a 40M-row shard on a GPU is ready in seconds).

The hash: 32-bit lanes held in int64 tensors (so every product fits the wrap-around of
int64 and its low 32 bits are exact), the murmur3 finaliser as mixing function.
  stream = mix(mix(seed_lo ^ mix(seed_hi ^ table_hash)))           (a Python int)
  h(row, col) = mix(mix(mix(row_lo ^ stream) ^ row_hi) + col * GOLDEN32)
  uniform:  u = (h >> 8) * 2**-24 in [0, 1);  value = low + (high - low) * u
  normal:   Box-Muller of h and h' = mix(h ^ NORMAL_SALT): mean + std * sqrt(-2 ln u1) cos(2 pi u2)
  constant: value
"""

from __future__ import annotations

import hashlib
import math
from typing import Protocol

import torch
from torch import Tensor

M32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
NORMAL_SALT = 0x632BE5AB
CHUNK_ELEMENTS = 1 << 24
"""Elements hashed at once: bounds the temporary int64 tensors to a few hundred MiB."""


class InitParamsLike(Protocol):
    kind: str
    low: float
    high: float
    mean: float
    std: float
    value: float


def _mix_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    x ^= x >> 16
    return x


def _mix(x: Tensor) -> Tensor:
    """murmur3 fmix32 on int64 tensors holding values in [0, 2**32)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def table_stream(seed: int, table: str) -> int:
    """The 32-bit stream constant of one table under one seed."""
    digest = hashlib.sha256(table.encode()).digest()
    table_hash = int.from_bytes(digest[:4], "little")
    seed &= (1 << 64) - 1
    return _mix_int(_mix_int((seed & M32) ^ _mix_int((seed >> 32) ^ table_hash)))


def element_hash(stream: int, rows: Tensor, col_lo: int, col_hi: int) -> Tensor:
    """[len(rows), col_hi - col_lo] int64 hashes in [0, 2**32)."""
    r = rows.to(torch.int64).unsqueeze(1)
    cols = torch.arange(col_lo, col_hi, dtype=torch.int64, device=rows.device).unsqueeze(0)
    h = _mix(_mix((r & M32) ^ stream) ^ ((r >> 32) & M32))
    return _mix(h + cols * GOLDEN32)


def _values(h: Tensor, init: InitParamsLike) -> Tensor:
    if init.kind == "uniform":
        # 24 random bits are exact in fp32: no fp64 temporaries on the big path
        u = (h >> 8).to(torch.float32) * 2.0**-24
        return init.low + (init.high - init.low) * u
    if init.kind == "normal":
        u1 = ((h >> 8).to(torch.float64) + 1.0) * 2.0**-24
        u2 = (_mix(h ^ NORMAL_SALT) >> 8).to(torch.float64) * 2.0**-24
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return (init.mean + init.std * z).float()
    if init.kind == "constant":
        return torch.full(h.shape, float(init.value), dtype=torch.float32, device=h.device)
    raise ValueError(f"unknown init kind {init.kind!r}; expected uniform, normal or constant")


def initial_values(
    seed: int, table: str, rows: Tensor, col_lo: int, col_hi: int, init: InitParamsLike
) -> Tensor:
    """fp32 [len(rows), col_hi - col_lo]: the initial value of every (global row, column)
    of `table`; rows are global row indices (int64), any order, any device."""
    if not 0 <= col_lo <= col_hi:
        raise ValueError(f"bad column range [{col_lo}, {col_hi})")
    width = col_hi - col_lo
    out = torch.empty(rows.numel(), width, dtype=torch.float32, device=rows.device)
    if rows.numel() == 0 or width == 0:
        return out
    stream = table_stream(seed, table)
    step = max(1, CHUNK_ELEMENTS // width)
    for lo in range(0, rows.numel(), step):
        chunk = rows[lo : lo + step]
        out[lo : lo + chunk.numel()] = _values(element_hash(stream, chunk, col_lo, col_hi), init)
    return out
