"""What a host-tier cell's HBM cache of C rows is expected to do per training step.

A host-tier cell (docs/host_tier.md) keeps its rows in host memory and `C` of them in an
HBM cache that the runtime manages as LRU at the granularity of a step
(`embark_runtime.cache.RowCache`: each step admits its distinct rows, the least recently
used rows not read by the step make room). Its owner reads, per step, the distinct rows
of the global batch that fall into the cell's row shard.

The expectation is Che's approximation of an LRU cache under independent references
(Che, Tung and Wang, IEEE JSAC 2002; Fricker, Robert and Roberts, ITC 2012), taken per
step: with `D(T)` the expected distinct rows of the row shard among the ids of `T`
steps, the cache holds the rows read within its *characteristic time* `T_C` steps,
the root of `D(T_C) = C`. A row of probability `p` per draw (`N` draws per step) is read
in a step with probability `1 - (1 - p)^N` and was read within the previous `T_C` steps
with probability `1 - (1 - p)^(N T_C)`, so per step

    lookups = sum_i 1 - (1 - p_i)^N                 (= D(1))
    misses  = sum_i (1 - (1 - p_i)^N) (1 - p_i)^(N T_C)

and hits = lookups - misses. `C = 0` misses every lookup; a cache of every row misses
none. From a cold cache, step `t` (from 1) has seen `min(T_C, t - 1)` steps of history,
which `misses(..., history=)` takes (what `embarkc simulate` compares its counts with).

The sums are exact over a zipf distribution's head (`WHOLE_HEAD` ranks of an unsplit
table; of a split one its first `HEAD_RANKS` ranks, each in the row shard its key falls
into, as `embarkc.planner.cost.access_stats` places them) and integrated over its tail; a histogram's keys are summed one by one; uniform rows
share one probability. A table read by features of different access distributions is
one cache fed by independent streams whose distinct rows add (as the cost model's
distinct counts do): `D` is their sum, `T_C` common, the misses add.

`T_C` is found on a table of `D` at `STEPS` (log-spaced, 1e-3 to 1e7 steps), linear in
log-log between the points; the misses at that `T_C` are summed exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import numpy as np

from embark_runtime import keys as keymod

if TYPE_CHECKING:
    from embarkc.planner.cost import CostModel, TableFacts

STEPS_PER_DECADE = 8
LOG_STEPS = np.arange(-3 * STEPS_PER_DECADE, 7 * STEPS_PER_DECADE + 1) / STEPS_PER_DECADE
"""log10 of the step counts at which `D` is tabulated (1e-3 to 1e7 steps)."""
STEPS = 10.0**LOG_STEPS


def _miss_prob(p: np.ndarray) -> np.ndarray:
    """log(1 - p), accurate for tiny p."""
    return np.log1p(-np.minimum(p, 1.0 - 1e-16))


WHOLE_HEAD = 256
"""Zipf ranks summed one by one for an unsplit table (a split one places the cost model's
HEAD_RANKS in their shards): beyond rank 256 the tail's trapezoid integral of the read
and miss probabilities is exact to well under 0.1 %, and the cache model costs one
table in a fraction of a millisecond."""


def _read(log_miss: np.ndarray, n: float) -> np.ndarray:
    """Probability a row is read among n draws: 1 - (1 - p)^n, of log(1 - p)."""
    return -np.expm1(n * log_miss)


def _missed(log_miss: np.ndarray, n: float, held: float) -> np.ndarray:
    """Probability a row is read in a step of n draws and not in the `held` steps before."""
    return -np.expm1(n * log_miss) * np.exp(n * held * log_miss)


@dataclass(frozen=True)
class ShardMass:
    """The per-draw probabilities of one access distribution's rows, by row shard: rows
    listed one by one (`p`, their row shard `sh`, `mult` rows of each such probability)
    and, for a zipf distribution longer than its head, a tail integrated per shard."""

    r: int
    p: np.ndarray
    sh: np.ndarray
    mult: np.ndarray
    tail: tuple[Any, ...] | None = None
    """("even", alpha, z, lo, hi, share[r]): the tail ranks [lo, hi) spread over the
    shards by `share`; ("blocks", alpha, z, lo[r], hi[r]): shard j holds ranks [lo_j, hi_j)."""

    @cached_property
    def log_miss(self) -> np.ndarray:
        return _miss_prob(self.p)

    @cached_property
    def tail_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The tail's trapezoid points (`cost.tail_grid`) per interval (one when "even",
        one per shard for "blocks"): which intervals are not empty, their ranks t,
        log(1 - p) there and the steps; None without a tail."""
        from embarkc.planner.cost import tail_grid

        if self.tail is None:
            return None
        _, alpha, z, lo, hi = self.tail[:5]
        lo, hi = np.atleast_1d(np.asarray(lo, dtype=np.float64)), np.atleast_1d(hi)
        ok = hi > lo
        t, p, du = tail_grid(lo[ok], hi[ok], alpha, z)
        return ok, t, _miss_prob(p), du

    def _tail_total(self, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The tail's sum of fn(log(1 - p)) per shard, shape (r,)."""
        from embarkc.planner.cost import tail_sum

        pts = self.tail_points
        assert pts is not None and self.tail is not None
        ok, t, lm, du = pts
        part = np.zeros(len(ok))
        if ok.any():
            part[ok] = tail_sum(fn(lm) * t, du)
        if self.tail[0] == "even":
            return part[0] * self.tail[5]  # type: ignore[no-any-return]
        return part

    def total(self, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """sum over the rows of each row shard of fn(log(1 - p)), shape (r,)."""
        out = np.bincount(self.sh, self.mult * fn(self.log_miss), minlength=self.r)
        if self.tail is None:
            return out
        return out + self._tail_total(fn)

    def distinct_many(self, ns: np.ndarray) -> np.ndarray:
        """Expected distinct rows per row shard among n draws, for every n of `ns` at
        once: shape (len(ns), r)."""
        from embarkc.planner.cost import tail_sum

        read = -np.expm1(ns[:, None] * self.log_miss[None, :]) * self.mult[None, :]
        if self.r == 1:
            out = read.sum(axis=1)[:, None]
        else:
            onehot = np.zeros((len(self.sh), self.r))
            onehot[np.arange(len(self.sh)), self.sh] = 1.0
            out = read @ onehot
        pts = self.tail_points
        if pts is None or self.tail is None:
            return out  # type: ignore[no-any-return]
        ok, t, lm, du = pts
        for k in np.flatnonzero(ok).tolist():
            i = int(np.count_nonzero(ok[:k]))
            f = -np.expm1(ns[:, None] * lm[i][None, :]) * t[i][None, :]
            part = tail_sum(f, np.full(len(ns), du[i]))
            if self.tail[0] == "even":
                out = out + part[:, None] * self.tail[5][None, :]
            else:
                out[:, k] += part
        return out  # type: ignore[no-any-return]


def _tail_integral(
    lo: np.ndarray, hi: np.ndarray, alpha: float, z: float, fn: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Integral over ranks t in [lo, hi] of fn(log(1 - t^-alpha / z)), per interval (0
    where empty), by the cost model's rule for zipf tails."""
    from embarkc.planner.cost import tail_grid, tail_sum

    out = np.zeros(len(lo))
    ok = hi > lo
    if not ok.any():
        return out
    t, p, du = tail_grid(lo[ok], hi[ok], alpha, z)
    out[ok] = tail_sum(fn(_miss_prob(p)) * t, du)
    return out


def shard_mass(rows: int, access: tuple[Any, ...], r: int, partition: str, index: int) -> ShardMass:
    """`ShardMass` of a table of `rows` rows in `r` row shards under `access` (a cost
    model access key: ("uniform",), ("zipf", alpha, permuted), ("histogram", keys,
    counts)); `index` is the table's index (its permutation of zipf ranks)."""
    from embarkc.planner.cost import HEAD_RANKS, shard_rows, zipf_tail_mass, zipf_weights

    rs = shard_rows(rows, r, partition).astype(np.float64)
    kind = access[0]
    if kind == "uniform":
        return ShardMass(r, np.full(r, 1.0 / rows), np.arange(r), rs)
    if kind == "histogram":
        keys = np.asarray(access[1], dtype=np.int64)
        counts = np.asarray(access[2], dtype=np.float64)
        sh = keymod.row_shard_of(keys, rows, r, partition) if r > 1 else np.zeros_like(keys)
        return ShardMass(r, counts / counts.sum(), sh.astype(np.intp), np.ones(len(keys)))
    alpha, permuted = float(access[1]), bool(access[2])
    k = min(rows, HEAD_RANKS if r > 1 else WHOLE_HEAD)
    ranks = np.arange(k, dtype=np.int64)
    w = zipf_weights(alpha, k)
    lo, hi = k + 0.5, rows + 0.5
    tail_w = float(zipf_tail_mass(np.array(lo), np.array(hi), alpha)) if rows > k else 0.0
    z = float(w.sum()) + tail_w
    if r == 1:
        sh = np.zeros(k, dtype=np.intp)
    else:
        key = keymod.permute(ranks, rows, index) if permuted else ranks
        sh = keymod.row_shard_of(key, rows, r, partition).astype(np.intp)
    tail: tuple[Any, ...] | None = None
    if rows > k:
        if permuted or partition == "mod" or r == 1:
            head = np.bincount(sh, minlength=r).astype(np.float64)
            tail = ("even", alpha, z, lo, hi, (rs - head) / (rows - k))
        else:
            block = -(-rows // r)
            j = np.arange(r)
            blo = np.maximum(j * block, k) + 0.5
            bhi = np.maximum(np.minimum((j + 1) * block, rows) + 0.5, blo)
            tail = ("blocks", alpha, z, blo, bhi)
    return ShardMass(r, w / z, sh, np.ones(k), tail)


def ideal_misses(mass: ShardMass, n: float, caches: np.ndarray) -> np.ndarray:
    """Misses per step of an *ideal* cache of each of `caches` rows of an unsplit table
    (`mass` of one row shard; `n` draws a step): the hottest rows always held, so a step
    misses the rows it reads beyond them. A lower bound of the LRU's misses, summed in one
    pass over the rows by probability (the head exact, a zipf tail integrated): what
    `tiers.choose_tiers` prices a table's cache sizes by on programs of any size."""
    assert mass.r == 1
    order = np.argsort(-mass.p, kind="stable")
    mult = mass.mult[order]
    read = _read(_miss_prob(mass.p[order]), n)
    rows_cum = np.concatenate(([0.0], np.cumsum(mult)))
    read_cum = np.concatenate(([0.0], np.cumsum(read * mult)))
    tail = 0.0
    alpha = z = hi = 0.0
    if mass.tail is not None:
        _, alpha, z, lo, hi, _ = mass.tail
        tail = float(
            _tail_integral(np.array([lo]), np.array([hi]), alpha, z, partial(_read, n=n))[0]
        )
    head_rows = float(rows_cum[-1])
    c = np.asarray(caches, dtype=np.float64)
    # within the listed rows the held reads grow linearly over rows of one probability
    out = read_cum[-1] - np.interp(np.minimum(c, head_rows), rows_cum, read_cum) + tail
    beyond = c > head_rows
    if beyond.any() and mass.tail is not None:
        lo_c = np.minimum(c[beyond] + 0.5, hi)
        out[beyond] = _tail_integral(lo_c, np.full(len(lo_c), hi), alpha, z, partial(_read, n=n))
    return np.maximum(out, 0.0)


@dataclass(frozen=True)
class TableCache:
    """The cache statistics of one table split into `r` row shards, for any cache size:
    its access distributions' masses with their draws per step, and `D` tabulated."""

    streams: tuple[tuple[ShardMass, float], ...]
    """(mass, N: draws per step of the global batch) per access distribution."""
    rows: np.ndarray
    """rows of each row shard"""
    curve: np.ndarray
    """D_j(T) at `STEPS`: shape (len(STEPS), r)"""

    def distinct(self, steps: float) -> np.ndarray:
        """Expected distinct rows per row shard among the ids of `steps` steps."""
        out = np.zeros(len(self.rows))
        for mass, n in self.streams:
            out += mass.total(partial(_read, n=n * steps))
        return np.minimum(out, self.rows)

    def lookups(self) -> np.ndarray:
        """Distinct rows each row shard's owner reads per step."""
        return self.distinct(1.0)

    def held_steps(self, j: int, cache_rows: float) -> float:
        """Che's characteristic time of a cache of `cache_rows` rows of row shard `j`, in
        steps (inf: the cache holds every row ever read; 0: no cache)."""
        if cache_rows <= 0:
            return 0.0
        col = self.curve[:, j]
        if cache_rows >= min(float(self.rows[j]), float(col[-1])):
            return float("inf")
        logd = np.log(np.maximum(col, 1e-300))
        # D rises with T; np.interp wants increasing abscissae: drop flat repeats
        keep = np.concatenate(([True], np.diff(logd) > 0))
        return float(10.0 ** np.interp(np.log(cache_rows), logd[keep], LOG_STEPS[keep]))

    def misses(
        self, j: np.ndarray, cache_rows: np.ndarray, history: float | None = None
    ) -> np.ndarray:
        """Expected misses per step of each cell (row shard `j[i]`, a cache of
        `cache_rows[i]` rows): in the steady state, or after `history` steps of a cold
        cache (at most the characteristic time counts)."""
        out = np.zeros(len(j))
        for i, (jj, c) in enumerate(zip(j.tolist(), cache_rows.tolist(), strict=True)):
            t = self.held_steps(jj, c)
            if history is not None:
                t = min(t, history)
            if t == float("inf"):
                continue
            total = 0.0
            for mass, n in self.streams:
                # read this step, not within the previous t steps
                total += float(mass.total(partial(_missed, n=n, held=t))[jj])
            out[i] = min(total, float(self.rows[jj]))
        return out


def table_cache(cm: CostModel, tf: TableFacts, r: int) -> TableCache:
    """The `TableCache` of table `tf` in `r` row shards under `cm`'s batch and row
    partition; memoised on `cm` (a pure function of the program)."""
    from embarkc.planner.cost import shard_rows

    key = (tf.cache_key(r), r)
    hit = cm.cache_tables.get(key)
    if hit is not None:
        return hit
    streams = []
    for access, h in tf.groups:
        index = tf.index if (access[0] == "zipf" and access[2] and r > 1) else 0
        streams.append((shard_mass(tf.rows, access, r, cm.partition, index), cm.B * h))
    rows = shard_rows(tf.rows, r, cm.partition).astype(np.float64)
    curve = np.zeros((len(STEPS), r))
    for mass, n in streams:
        curve += mass.distinct_many(n * STEPS)
    curve = np.minimum(curve, rows[None, :])
    tc = TableCache(tuple(streams), rows, curve)
    cm.cache_tables[key] = tc
    return tc


def spread_evenly(tf: TableFacts, r: int, partition: str) -> bool:
    """Whether every access distribution of the table spreads its ids evenly over `r`
    row shards (uniform, zipf with permuted ids, zipf under a mod partition): a row
    shard's cache then behaves as the whole table's cache scaled to the shard's rows."""
    if r == 1:
        return True
    return all(
        a[0] == "uniform" or (a[0] == "zipf" and (bool(a[2]) or partition == "mod"))
        for a, _ in tf.groups
    )


def cell_misses(
    cm: CostModel,
    tf: TableFacts,
    r: int,
    j: np.ndarray,
    cache_rows: np.ndarray,
    history: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows read, expected misses) per step of each cell (row shard `j[i]` of
    `r`, a cache of `cache_rows[i]` rows; `history` as `TableCache.misses`). Where the
    ids spread evenly (`spread_evenly`) a cell's cache of C rows of a shard of R_j misses
    the share of the whole table's misses of a cache of C x rows / R_j that its reads
    are (its distinct rows over the table's, per step): one `TableCache` per table
    serves every grid the search tries. Contiguous blocks of sorted ids (zipf under a
    range partition) and histograms have a `TableCache` per number of row shards."""
    from embarkc.planner.cost import shard_rows

    lookups = cm.stats(tf, r)[2][j]
    if not spread_evenly(tf, r, cm.partition):
        return lookups, table_cache(cm, tf, r).misses(j, cache_rows, history)
    whole = table_cache(cm, tf, 1)
    rows = shard_rows(tf.rows, r, cm.partition).astype(np.float64)[j]
    scaled = np.where(rows > 0, cache_rows * tf.rows / np.maximum(rows, 1.0), 0.0)
    share = lookups / max(float(whole.lookups()[0]), 1e-300)
    return lookups, whole.misses(np.zeros(len(j), dtype=np.int64), scaled, history) * share
