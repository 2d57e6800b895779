"""The runtime's HBM cache of a host-tier cell, replayed on row ids (numpy, no torch).

`LruReplay` is `embark_runtime.cache.RowCache` without the rows' values: the same
bookkeeping (a slot per cached row, its last use, whether it is dirty) and the same
decisions, step by step, so its counters are the ones the trainer logs for the same
batches (`tests/test_cache_replay.py` checks them against `RowCache` on random
sequences). Per step, `step(rows, counts)` with the step's distinct local rows (sorted
ascending, as the runtime's `dedup` gives them) and how often each is read:

1. rows already cached are hits and become the most recently used;
2. misses take free slots, then those of the least recently used rows the step does not
   read (ties by slot index);
3. when there are fewer such slots than misses, the misses read most often get them
   (ties by row) and the others are served from host (`host_reads`);
4. an evicted row is written back when dirty; every row cached at the end of the step
   is dirty, since the step's backward updates every row it read.

Slots are found by a binary search over the cached rows, so memory follows the cache's
capacity, not the cell's rows (a paper table's row shard may hold a billion rows).
"""

from __future__ import annotations

import numpy as np

from embark_runtime.cache_stats import CacheStats


class LruReplay:
    """The cache of `capacity` rows of one host-tier cell, from a cold start."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"a cache of {capacity} rows")
        self.capacity = capacity
        self.row_in = np.full(capacity, -1, dtype=np.int64)
        self.last_use = np.full(capacity, -1, dtype=np.int64)
        self.dirty = np.zeros(capacity, dtype=bool)
        self.clock = 0
        self.stats = CacheStats()
        """Counters since the start."""

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The slot of each of `rows` (-1: not cached)."""
        if not self.capacity or not len(rows):
            return np.full(len(rows), -1, dtype=np.int64)
        order = np.argsort(self.row_in, kind="stable")
        held = self.row_in[order]
        pos = np.minimum(np.searchsorted(held, rows), self.capacity - 1)
        return np.where(held[pos] == rows, order[pos], -1)

    def step(self, rows: np.ndarray, counts: np.ndarray | None = None) -> CacheStats:
        """Admit one step's distinct local `rows` (`counts[i]`: reads of rows[i]) and
        update them; the step's counters (also added to `stats`)."""
        rows = np.asarray(rows, dtype=np.int64)
        self.clock += 1
        n = len(rows)
        st = CacheStats(lookups=n)
        slots = self.slots_of(rows)
        hit = slots >= 0
        st.hits = int(hit.sum())
        st.misses = n - st.hits
        self.last_use[slots[hit]] = self.clock
        missing = np.flatnonzero(~hit)
        if len(missing) and self.capacity:
            free = np.flatnonzero(self.last_use < self.clock)
            victims = free[np.argsort(self.last_use[free], kind="stable")]
            k = min(len(victims), len(missing))
            if k < len(missing) and counts is not None:
                c = np.asarray(counts, dtype=np.int64)[missing]
                by_rows = np.argsort(rows[missing], kind="stable")
                missing = missing[by_rows]
                missing = missing[np.argsort(-c[by_rows], kind="stable")]
            admitted, victims = missing[:k], victims[:k]
            held = self.row_in[victims]
            occupied = held >= 0
            st.evictions = int(occupied.sum())
            st.writebacks = int(self.dirty[victims[occupied]].sum())
            self.row_in[victims] = rows[admitted]
            self.last_use[victims] = self.clock
            self.dirty[victims] = False
            st.fetches = k
            slots[admitted] = victims
        st.host_reads = int((slots < 0).sum())
        # the backward updates every row the step read: its cached copies become dirty
        self.dirty[slots[slots >= 0]] = True
        self.stats.add(st)
        return st
