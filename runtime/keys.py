"""Key-space helpers shared by the data generator, the cost model and the simulator.

`permuted zipf` spreads the hot keys over the key space: the r-th most frequent id of a
table is stored at key `permute(r)`, an affine bijection of [0, rows). The same function
is used wherever the position of hot keys matters (which row shard holds the hottest
rows), so the planner, the simulator and the trainer agree on it. numpy only.
"""

from __future__ import annotations

import math

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15


def _multiplier(rows: int) -> int:
    """An odd multiplier coprime to `rows`, about rows / golden ratio."""
    if rows <= 2:
        return 1
    a = max(1, (rows * 0x9E3779B9 >> 32) | 1)
    while math.gcd(a, rows) != 1:
        a += 2
    return a % rows or 1


def permutation_params(rows: int, table_index: int = 0) -> tuple[int, int]:
    """(A, C) of key = (rank * A + C) mod rows for one table."""
    a = _multiplier(rows)
    c = ((table_index + 1) * _GOLDEN) % rows if rows > 1 else 0
    return a, c


def permute(ranks: np.ndarray, rows: int, table_index: int = 0) -> np.ndarray:
    """Key of each frequency rank (int64 in, int64 out); a bijection of [0, rows)."""
    a, c = permutation_params(rows, table_index)
    r = np.asarray(ranks, dtype=np.int64)
    if rows < (1 << 31):
        return (r * a + c) % rows
    # avoid int64 overflow for huge tables: Python ints, vectorised through object dtype
    return np.array([(int(x) * a + c) % rows for x in r.ravel()], dtype=np.int64).reshape(r.shape)


def row_shard_of(keys: np.ndarray, rows: int, row_shards: int, partition: str) -> np.ndarray:
    """Row shard of each key under the plan's row partition (`mod` or `range`), in the
    keys' signed integer dtype (int32 keys are not copied to int64 first), else int64."""
    k = np.asarray(keys)
    if k.dtype.kind != "i":
        k = k.astype(np.int64)
    if partition == "mod":
        return k % row_shards
    block = -(-rows // row_shards)
    return k // block


def local_row(keys: np.ndarray, rows: int, row_shards: int, partition: str) -> np.ndarray:
    """Index of each key inside its row shard."""
    k = np.asarray(keys, dtype=np.int64)
    if partition == "mod":
        return k // row_shards
    block = -(-rows // row_shards)
    return k % block


def shard_row_count(rows: int, row_shard: int, row_shards: int, partition: str) -> int:
    """Rows of row shard `row_shard` of `row_shards` of a table of `rows` rows."""
    if partition == "mod" or row_shards == 1:
        return len(range(row_shard, rows, row_shards))
    block = -(-rows // row_shards)
    return max(0, min(rows, (row_shard + 1) * block) - row_shard * block)


def shard_global_rows(
    rows: int, row_shard: int, row_shards: int, partition: str, lo: int, hi: int
) -> np.ndarray:
    """Global rows of local rows [lo, hi) of a row shard."""
    local = np.arange(lo, hi, dtype=np.int64)
    if partition == "mod" or row_shards == 1:
        return row_shard + row_shards * local
    return row_shard * -(-rows // row_shards) + local
