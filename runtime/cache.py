"""Host-tier cells: rows in host memory, an HBM cache of a fixed number of rows.

A plan may put a cell of an rb/ub table in host memory (`tier: "host"` on its shard, see
docs/plan.md and docs/host_tier.md) with an HBM cache of `cache_rows` rows (0: uncached).
The cell's `weight` and `state` (embark_runtime.storage.Cell) are then the host copy
(pinned on CUDA) and its `cache` a `RowCache`: `cache_rows` rows of weights with their
optimizer state, on the device.

Protocol, per step and cell (the clusters call it; every call is local to the rank):

* `admit(rows)` with the step's distinct local rows, at the lookup: hits stay, misses
  are fetched from host into free or evicted slots, the rest are served from host;
  returns every row's slot (-1: served from host this step). Rows admitted this step are
  pinned until the next `admit`, so the backward finds them where the forward did.
* `read(rows, slots)`: the rows' weights, from the cache or from host (the lookup).
* `update(kernels, rows, grads, table)`: the fused sparse optimizer update of the rows
  (duplicates summed first, as `embark_runtime.optim.apply_update` does), applied to the
  cached copy of a cached row and, for a row served from host, to a staged copy written
  straight back to host (weights and state together).
* `flush()` writes every dirty cached row back (before a checkpoint, a gather, an
  export); `invalidate()` forgets the cache after the host copy was overwritten (load).

Policy: LRU. A miss evicts the least recently used slot not pinned by the current step
(ties by slot index); when more rows miss than there are such slots, the misses read most
often in this step are admitted first (ties by row) and the others are served from host.
An evicted row is written back with its optimizer state when it was updated since it was
fetched (dirty). Every copy is exact and every row's update is the same fp32 arithmetic
whatever its residence, so training with any cache size gives the unsharded reference's
values bit for bit in exact numerics.

Read-ahead: when the next batch was prefetched (ShardedEmbeddings.prefetch), the
`admit` and `read` of its step run as soon as the current step's updates are all applied
(`ShardedEmbeddings.finish_backward`), not at its lookup (on the compute stream: a side
stream overlapping the dense work is not done). Nothing changes a row in between, so
the values are the same; the counters of that admission go to the step that reads it
(`ahead`). See docs/host_tier.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embark_runtime.cache_stats import STAT_NAMES, CacheStats

I64 = torch.int64


def host_tensor(t: Tensor) -> Tensor:
    """`t` in host memory: pinned when CUDA is there (the cache copies run async), else
    the CPU tensor itself."""
    t = t.detach().to("cpu")
    if torch.cuda.is_available():
        return t.pin_memory()
    return t


class RowCache:
    """The HBM cache of one host-tier cell. See the module docstring for the protocol."""

    def __init__(
        self,
        host_weight: Tensor,
        host_state: dict[str, Tensor],
        capacity: int,
        device: torch.device | str,
    ):
        rows = int(host_weight.shape[0])
        if not 0 <= capacity <= rows:
            raise ValueError(f"a cache of {capacity} rows for a cell of {rows} rows")
        self.host_weight = host_weight
        self.host_state = host_state
        self.capacity = capacity
        self.device = torch.device(device)
        self.weight = torch.zeros(
            capacity, *host_weight.shape[1:], dtype=host_weight.dtype, device=self.device
        )
        self.state = {
            k: torch.zeros(capacity, *v.shape[1:], dtype=v.dtype, device=self.device)
            for k, v in host_state.items()
        }
        # bookkeeping lives on the host: the policy's decisions are a few small index ops
        self.slot_of = torch.full((rows,), -1, dtype=I64)
        self.row_in = torch.full((capacity,), -1, dtype=I64)
        self.last_use = torch.full((capacity,), -1, dtype=I64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.clock = 0
        self.stats = CacheStats()
        self.ahead = CacheStats()
        """counters of a lookup made ahead for the next step (ShardedEmbeddings'
        read-ahead), added to `stats` when that step reads it"""

    # ------------------------------------------------------------------ the step
    def admit(self, rows: Tensor, counts: Tensor | None = None) -> Tensor:
        """Slots of the distinct local rows `rows` for this step (-1: read from host).
        `counts[i]`: how often rows[i] is read this step (admission order of misses)."""
        rows = rows.to("cpu", I64)
        self.clock += 1
        n = rows.numel()
        slots = self.slot_of[rows].clone()
        hit = slots >= 0
        n_hit = int(hit.sum())
        self.stats.lookups += n
        self.stats.hits += n_hit
        self.stats.misses += n - n_hit
        self.last_use[slots[hit]] = self.clock
        missing = torch.nonzero(~hit).reshape(-1)
        if missing.numel() and self.capacity:
            # free or unpinned slots, least recently used first (free ones have -1)
            free = torch.nonzero(self.last_use < self.clock).reshape(-1)
            order = torch.argsort(self.last_use[free], stable=True)
            victims = free[order]
            k = min(victims.numel(), missing.numel())
            if k < missing.numel() and counts is not None:
                c = counts.to("cpu", I64)[missing]
                # most-read first, ties by row (stable sort over rows in ascending order)
                by_rows = torch.argsort(rows[missing], stable=True)
                missing = missing[by_rows]
                missing = missing[torch.argsort(-c[by_rows], stable=True)]
            admitted, victims = missing[:k], victims[:k]
            self._evict(victims)
            new_rows = rows[admitted]
            self._fetch(victims, new_rows)
            slots[admitted] = victims
        self.stats.host_reads += int((slots < 0).sum())
        return slots

    def _evict(self, victims: Tensor) -> None:
        held = self.row_in[victims]
        occupied = held >= 0
        if not bool(occupied.any()):
            return
        v, r = victims[occupied], held[occupied]
        self.stats.evictions += v.numel()
        dirty = self.dirty[v]
        self._write_back(v[dirty], r[dirty])
        self.slot_of[r] = -1
        self.row_in[v] = -1

    def _fetch(self, slots: Tensor, rows: Tensor) -> None:
        if not slots.numel():
            return
        dev = slots.to(self.device)
        self.weight[dev] = self.host_weight[rows].to(self.device, non_blocking=True)
        for k, s in self.state.items():
            s[dev] = self.host_state[k][rows].to(self.device, non_blocking=True)
        self.slot_of[rows] = slots
        self.row_in[slots] = rows
        self.last_use[slots] = self.clock
        self.dirty[slots] = False
        self.stats.fetches += slots.numel()

    def _write_back(self, slots: Tensor, rows: Tensor) -> None:
        if not slots.numel():
            return
        dev = slots.to(self.device)
        self.host_weight[rows] = self.weight[dev].to("cpu")
        for k, s in self.state.items():
            self.host_state[k][rows] = s[dev].to("cpu")
        self.dirty[slots] = False
        self.stats.writebacks += slots.numel()

    def read(self, rows: Tensor, slots: Tensor) -> Tensor:
        """The weights of `rows` [n, w] on the device: cached rows from their slots, the
        others from host."""
        out = torch.empty(
            rows.numel(), *self.weight.shape[1:], dtype=self.weight.dtype, device=self.device
        )
        cached = slots >= 0
        if bool(cached.any()):
            out[cached.to(self.device)] = self.weight[slots[cached].to(self.device)]
        if not bool(cached.all()):
            out[(~cached).to(self.device)] = self.host_weight[rows.to("cpu")[~cached]].to(
                self.device
            )
        return out

    def update(self, kernels, rows: Tensor, grads: Tensor, table) -> None:
        """Apply `table`'s optimizer to `rows` (local, may repeat) with their gradients;
        every row was admitted this step."""
        if rows.numel() == 0:
            return
        unique, inverse = kernels.dedup(rows)
        if unique.numel() != rows.numel():
            summed = torch.zeros(
                unique.numel(), grads.shape[1], dtype=kernels.accum, device=grads.device
            )
            kernels.scatter_add_rows(summed, inverse, grads.to(kernels.accum))
            rows, grads = unique, summed
        host_rows = rows.to("cpu", I64)
        slots = self.slot_of[host_rows]
        cached = slots >= 0
        opt, params = table.optimizer, table.optimizer_params
        if bool(cached.any()):
            s = slots[cached]
            kernels.sparse_update(
                self.weight,
                self.state,
                s.to(self.device),
                grads[cached.to(grads.device)],
                opt,
                params,
            )
            self.dirty[s] = True
        if not bool(cached.all()):
            # rows served from host: staged on the device, updated, written straight back
            r = host_rows[~cached]
            w = self.host_weight[r].to(self.device)
            st = {k: v[r].to(self.device) for k, v in self.host_state.items()}
            idx = torch.arange(r.numel(), dtype=I64, device=self.device)
            kernels.sparse_update(w, st, idx, grads[(~cached).to(grads.device)], opt, params)
            self.host_weight[r] = w.to("cpu")
            for k, v in st.items():
                self.host_state[k][r] = v.to("cpu")

    # ------------------------------------------------------------------ whole cell
    def flush(self) -> None:
        """Write every dirty cached row back to host (the cache keeps its rows)."""
        held = self.row_in >= 0
        slots = torch.nonzero(held & self.dirty).reshape(-1)
        self._write_back(slots, self.row_in[slots])

    def invalidate(self) -> None:
        """Forget every cached row without writing it back (host was overwritten)."""
        self.slot_of.fill_(-1)
        self.row_in.fill_(-1)
        self.last_use.fill_(-1)
        self.dirty.fill_(False)

    def take_ahead(self) -> CacheStats:
        out, self.ahead = self.ahead, CacheStats()
        return out

    def take_stats(self) -> CacheStats:
        """The counters since the last call, and reset them."""
        out, self.stats = self.stats, CacheStats()
        return out


# --------------------------------------------------------------------------- the log


def host_tier_clusters(plan) -> list[str]:
    """The clusters of `plan` with a host-tier cell, in plan order (the same on every
    rank: the order of the counters each rank contributes to the step's all-reduce)."""
    tables = {s.table for s in plan.shards if s.tier == "host"}
    return [c.name for c in plan.clusters if tables & set(c.tables)]


def stats_flat(stats: dict[str, CacheStats], clusters: list[str]) -> list[float]:
    """This rank's counters of `clusters`, flat, for a sum over ranks."""
    out: list[float] = []
    for name in clusters:
        out += [float(v) for v in stats.get(name, CacheStats()).as_list()]
    return out


def stats_record(values: list[float], clusters: list[str]) -> dict[str, dict]:
    """The log's `cache` field from summed `stats_flat` values: per cluster, every
    counter (rows, all ranks) and the hit rate (hits / lookups; null with no lookup)."""
    out: dict[str, dict] = {}
    n = len(STAT_NAMES)
    for i, name in enumerate(clusters):
        s = CacheStats(*(int(v) for v in values[i * n : (i + 1) * n]))
        out[name] = {**dict(zip(STAT_NAMES, s.as_list(), strict=True)), "hit_rate": s.hit_rate}
    return out


def cache_text(record: dict[str, dict] | None) -> str:
    """The step line's cache part: `; cache hits rb0 41.2%, ub0 7.5%` (empty without)."""
    if not record:
        return ""
    parts = [
        f"{name} " + ("-" if v["hit_rate"] is None else f"{100 * v['hit_rate']:.1f}%")
        for name, v in record.items()
    ]
    return "; cache hits " + ", ".join(parts)
