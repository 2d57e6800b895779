"""Storage of embedding shards: one `Cell` per (table, row shard, column range) held here.

A cell keeps the rows of its row shard in local order (`embark_runtime.keys.local_row`:
local row i of row shard j is global row j + i * R under `mod`, j * ceil(rows / R) + i
under `range`), the columns [lo, hi) of the table, in the table's dtype, and the fp32
optimizer state of those rows and columns (see `embark_runtime.optim`). A dp table is
one cell covering the whole table, replicated on every rank.

A host-tier cell (`tier: "host"` in the plan) keeps `weight` and `state` in host memory
and has a `cache` (embark_runtime.cache.RowCache) of `cache_rows` rows on the device;
whoever reads `weight` or `state` whole flushes the cache first (ShardedEmbeddings.flush).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from embark_runtime.cache import RowCache, host_tensor
from embark_runtime.init import initial_values
from embark_runtime.optim import new_state

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def global_rows(rows: int, row_shard: int, row_shards: int, partition: str, device=None) -> Tensor:
    """Global row index of every local row of one row shard, in local order (int64)."""
    if partition == "mod":
        return torch.arange(row_shard, rows, row_shards, dtype=torch.int64, device=device)
    if partition == "range":
        block = -(-rows // row_shards)
        lo = min(rows, row_shard * block)
        return torch.arange(lo, min(rows, lo + block), dtype=torch.int64, device=device)
    raise ValueError(f"unknown row partition {partition!r}; expected 'mod' or 'range'")


@dataclass
class Cell:
    table: str
    row_shard: int
    row_shards: int
    columns: tuple[int, int]
    weight: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    cache: RowCache | None = None
    """host-tier cells only: the device cache of their rows"""

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])


def new_cell(
    table,
    row_shard: int,
    row_shards: int,
    columns: tuple[int, int],
    partition: str,
    seed: int,
    device: torch.device | str = "cpu",
    *,
    tier: str = "hbm",
    cache_rows: int = 0,
) -> Cell:
    """A freshly initialised cell of `table` (a PlanTable) with fresh optimizer state; in
    host memory with a device cache of `cache_rows` rows when `tier` is "host"."""
    g = global_rows(table.rows, row_shard, row_shards, partition, device)
    lo, hi = columns
    weight = initial_values(seed, table.name, g, lo, hi, table.init).to(TORCH_DTYPES[table.dtype])
    state = new_state(table.optimizer, g.numel(), hi - lo, table.optimizer_params, device)
    if tier == "hbm":
        return Cell(table.name, row_shard, row_shards, (lo, hi), weight, state)
    if tier != "host":
        raise ValueError(f"unknown storage tier {tier!r}; expected 'hbm' or 'host'")
    weight = host_tensor(weight)
    state = {k: host_tensor(v) for k, v in state.items()}
    cache = RowCache(weight, state, cache_rows, device)
    return Cell(table.name, row_shard, row_shards, (lo, hi), weight, state, cache)


def load_into(cell: Cell, weight: Tensor, state: dict[str, Tensor], what: str) -> None:
    """Copy checkpointed values into `cell`, checking shapes (clear error naming `what`)."""
    if tuple(weight.shape) != tuple(cell.weight.shape):
        raise ValueError(
            f"{what}: weight has shape {tuple(weight.shape)}, this plan's cell needs "
            f"{tuple(cell.weight.shape)}"
        )
    cell.weight.copy_(weight.to(cell.weight.dtype))
    for name, t in cell.state.items():
        if name not in state:
            raise ValueError(f"{what}: optimizer state `{name}` is missing")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(
                f"{what}: optimizer state `{name}` has shape {tuple(state[name].shape)}, "
                f"expected {tuple(t.shape)}"
            )
        t.copy_(state[name].to(t.dtype))
    if cell.cache is not None:
        cell.cache.invalidate()
