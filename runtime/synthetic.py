"""Synthetic training data that follows a plan's access distributions (numpy only).

`SyntheticData(plan, seed).batch(step, rank, world)` returns rank `rank`'s slice of the
global batch of step `step`; `global_batch(step)` returns the whole batch. Every value is a
pure function of (seed, step, global sample index, feature, position): a counter-based
hash (splitmix64 over uint64 arrays), not a sequential generator, so the slice of rank `a`
of `W` ranks is bit-identical to samples `[a*b, (a+1)*b)` of the global batch whatever `W`
is, and any slice can be drawn without drawing the others.

THE DISTRIBUTIONS, EXACTLY
==========================
Uniform numbers. For a stream (seed, step, kind, feature) and a counter c, the uniform
number is `u = (splitmix64(base + c * GOLDEN) >> 11) * 2**-53`, in [0, 1); `base` is the
splitmix64 chain of (seed, step, kind, feature). Counters: the bag length of sample s uses
c = s; the id at position p of sample s uses c = s * max_hotness + p (likewise the per-id
weight, on its own stream); dense feature j of sample s uses c = s * dense_features + j.

Bag lengths. A `fixed` feature has exactly `round(hotness)` ids per sample. Otherwise the
length is `1 + Binomial(max_hotness - 1, p)` with `p = (hotness - 1) / (max_hotness - 1)`:
its range is [1, max_hotness] and its mean is exactly `hotness` (the mean the cost model
assumes), drawn by inverting the binomial CDF at one uniform per (sample, feature).

Ids. One uniform per (sample, position), mapped through the feature's access:
* uniform: `key = floor(u * rows)`.
* zipf(alpha) over a table of N rows: a frequency rank r in [0, N) is drawn with
  P(r) = w(r) / Z, where w(r) = (r + 1) ** -alpha for the head r < H = min(N, 2**16)
  and, for the tail r >= H,
  w(r) = integral of y ** -alpha dy over [r + 1/2, r + 3/2); Z = sum of the head weights
  + the integral over [H + 1/2, N + 1/2). A draw u < (head mass) / Z picks a head rank
  by Walker's alias method (v = u * Z / (head mass) * H, column floor(v), whose
  threshold is compared with the fraction of v: O(1) per id, exact probabilities);
  otherwise the analytic inverse of the tail integral at t = u * Z - (head mass) gives y
  and r = floor(y - 1/2). The tail weight equals (r + 1) ** -alpha to a relative
  alpha * (alpha + 1) / (24 (r + 1)**2) < 1e-9, so this is zipf to within rounding, at a
  cost independent of N (about 1.5 MiB of head tables per (N, alpha)).
  permuted=True: key = `embark_runtime.keys.permute(r, N, table_index)` (table_index is the
  table's position in plan.tables); permuted=False: key = r (key 0 the hottest).
* histogram: key `keys[i]` with probability counts[i] / sum(counts).

Per-id weights (weighted features only): `0.5 + u` on the feature's weight stream, in
[0.5, 1.5).

Dense features: `u` in [0, 1), float32, one per (sample, dense feature).

Labels, 0/1, a deterministic function of the sample so that a model can learn something:
each key of a table has a score `2u - 1` in [-1, 1) hashed from (seed, table, key) (the
same for every step); the sparse signal is the sum, over the first `LABEL_FEATURES`
features, of the mean score of the sample's bag; the dense signal is
`sum_j sign_j * (dense_j - 1/2)` with fixed hashed signs; the noise is `2u - 1` on the
label stream. label = 1 when `sparse + dense / 2 + noise / 2 > 0`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from embark_runtime.keys import permute
from embark_runtime.plan import Plan, PlanFeature, feature_problem

__all__ = ["Bag", "Batch", "SyntheticData", "ZipfSampler", "LABEL_FEATURES", "ZIPF_HEAD"]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ZIPF_HEAD = 1 << 16
"""Ranks of a zipf distribution whose probabilities are tabulated exactly."""
LABEL_FEATURES = 4
"""How many of the first features the label depends on."""
CHUNK_IDS = 1 << 17

# stream kinds: each is a separate family of uniform numbers
_LENGTH, _IDS, _WEIGHTS, _DENSE, _LABEL, _KEY_SCORE, _DENSE_SIGN = range(1, 8)


@dataclass
class Bag:
    """The ids of one feature for b samples: sample i owns ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray
    """int64[nnz], global keys of the feature's table."""
    offsets: np.ndarray
    """int64[b + 1], offsets[0] == 0, offsets[b] == nnz."""
    weights: np.ndarray | None = None
    """float32[nnz] per-id weights for weighted features, else None."""

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class Batch:
    dense: np.ndarray
    """float32[b, dense_features]."""
    labels: np.ndarray
    """float32[b], 0 or 1."""
    sparse: dict[str, Bag]
    """One bag per feature name."""


# --------------------------------------------------------------------------- hashing


def _mix_scalar(x: int) -> int:
    """splitmix64's finaliser on a Python int (for stream bases)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic), in place."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def stream_base(*parts: int) -> int:
    """The base of a stream: a splitmix64 chain over its coordinates."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix_scalar(h + (p & MASK64) * GOLDEN + 1)
    return h


def uniforms(base: int, counters: np.ndarray) -> np.ndarray:
    """float64 in [0, 1): `(splitmix64(base + c * GOLDEN) >> 11) * 2**-53` per counter."""
    c = np.array(counters, dtype=np.uint64)  # a fresh copy: hashed in place below
    c *= np.uint64(GOLDEN)
    c += np.uint64(base)
    _mix(c)
    c >>= np.uint64(11)
    return c.astype(np.float64) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------- distributions


class ZipfSampler:
    """zipf(alpha) over N ranks, as defined in the module docstring.

    `probability(r)` gives the exact P(r) of what `sample` draws, for the head and the tail,
    so a cost model can reproduce the sampler's expectations.
    """

    def __init__(self, rows: int, alpha: float):
        if rows <= 0 or alpha <= 0:
            raise ValueError(f"zipf needs rows > 0 and alpha > 0, got rows={rows} alpha={alpha}")
        self.rows = rows
        self.alpha = alpha
        self.head = min(rows, ZIPF_HEAD)
        w = np.arange(1, self.head + 1, dtype=np.float64) ** -alpha
        self.head_cum = np.cumsum(w)
        self.head_total = float(self.head_cum[-1])
        self.alias_prob, self.alias = alias_table(w)
        self.tail_lo = self.head + 0.5
        self.tail_total = self._integral(self.tail_lo, rows + 0.5) if rows > self.head else 0.0
        self.total = self.head_total + self.tail_total

    def _integral(self, lo: float, hi: float) -> float:
        a = self.alpha
        if abs(a - 1.0) < 1e-12:
            return math.log(hi / lo)
        return (hi ** (1.0 - a) - lo ** (1.0 - a)) / (1.0 - a)

    def probability(self, ranks: np.ndarray) -> np.ndarray:
        """P(rank) for each rank in [0, rows)."""
        r = np.asarray(ranks, dtype=np.float64)
        out = (r + 1.0) ** -self.alpha
        tail = r >= self.head
        if np.any(tail):
            a = self.alpha
            lo, hi = r[tail] + 0.5, r[tail] + 1.5
            if abs(a - 1.0) < 1e-12:
                out[tail] = np.log(hi / lo)
            else:
                out[tail] = (hi ** (1.0 - a) - lo ** (1.0 - a)) / (1.0 - a)
        return out / self.total

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Frequency ranks (int64) for uniforms u in [0, 1)."""
        u = np.asarray(u, dtype=np.float64)
        # v = u * Z / head_mass * H: the alias column and its fraction (head draws only)
        v = u * (self.total / self.head_total * self.head)
        col = v.astype(np.int64)
        has_tail = self.rows > self.head
        if has_tail:
            np.minimum(col, self.head - 1, out=col)
        v -= col
        ranks = np.where(v < self.alias_prob[col], col, self.alias[col])
        if has_tail:
            in_tail = u >= self.head_total / self.total
            if np.any(in_tail):
                x = u[in_tail] * self.total - self.head_total
                a = self.alpha
                if abs(a - 1.0) < 1e-12:
                    y = self.tail_lo * np.exp(x)
                else:
                    y = (self.tail_lo ** (1.0 - a) + (1.0 - a) * x) ** (1.0 / (1.0 - a))
                ranks[in_tail] = np.floor(y - 0.5).astype(np.int64)
            np.clip(ranks, 0, self.rows - 1, out=ranks)
        return ranks


def alias_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table (Vose's construction): (threshold[i], alias[i]).

    Column i is drawn with probability 1/n; it yields i when the fraction is below
    threshold[i], else alias[i]. Every outcome's total probability equals its weight share.
    """
    n = len(weights)
    scaled = (np.asarray(weights, dtype=np.float64) * (n / float(np.sum(weights)))).tolist()
    prob = [1.0] * n
    alias = list(range(n))
    small = [i for i, x in enumerate(scaled) if x < 1.0]
    large = [i for i, x in enumerate(scaled) if x >= 1.0]
    while small and large:
        s, g = small.pop(), large.pop()
        prob[s] = scaled[s]
        alias[s] = g
        scaled[g] = scaled[g] + scaled[s] - 1.0
        (small if scaled[g] < 1.0 else large).append(g)
    # leftovers are 1 up to rounding: they keep prob 1 and alias to themselves
    return np.array(prob), np.array(alias, dtype=np.int64)


@lru_cache(maxsize=64)
def zipf_sampler(rows: int, alpha: float) -> ZipfSampler:
    """Shared samplers: tables of the same size and skew share one head table."""
    return ZipfSampler(rows, alpha)


def length_cdf(hotness: float, max_hotness: int) -> np.ndarray:
    """CDF of the bag length 1 + Binomial(max_hotness - 1, p) with mean `hotness`.

    Entry k is P(length <= k + 1).
    """
    n = max_hotness - 1
    if n <= 0:
        return np.ones(1)
    p = min(max((hotness - 1.0) / n, 0.0), 1.0)
    if p <= 0.0:
        pmf = np.zeros(n + 1)
        pmf[0] = 1.0
    elif p >= 1.0:
        pmf = np.zeros(n + 1)
        pmf[n] = 1.0
    else:
        k = np.arange(n + 1, dtype=np.float64)
        lg = np.array([math.lgamma(x + 1.0) for x in range(n + 1)])
        logp = lg[n] - lg - lg[::-1] + k * math.log(p) + (n - k) * math.log1p(-p)
        pmf = np.exp(logp)
    cdf = np.cumsum(pmf)
    cdf /= cdf[-1]
    return cdf


# --------------------------------------------------------------------------- generator


class SyntheticData:
    """Deterministic batches for `plan`: see the module docstring for the distributions.

    Raises ValueError for an unusable plan (a histogram without counts, keys outside the
    table) or an uneven split of the batch.
    """

    def __init__(self, plan: Plan, seed: int = 0, dense_features: int = 13):
        if dense_features < 0:
            raise ValueError(f"dense_features must be >= 0, got {dense_features}")
        self.plan = plan
        self.seed = int(seed)
        self.dense_features = int(dense_features)
        self.batch_size = plan.batch_size
        self._table_index = {t.name: i for i, t in enumerate(plan.tables)}
        self._rows = {t.name: t.rows for t in plan.tables}
        for f in plan.features:
            self._check_feature(f)
        signs = uniforms(stream_base(self.seed, _DENSE_SIGN), np.arange(self.dense_features))
        self._dense_signs = np.where(signs < 0.5, -1.0, 1.0)

    def _check_feature(self, f: PlanFeature) -> None:
        if f.table not in self._rows:
            raise ValueError(f"feature `{f.name}` reads unknown table `{f.table}`")
        problem = feature_problem(f, self._rows[f.table])
        if problem is not None:
            raise ValueError(problem)

    # ------------------------------------------------------------------ pieces

    def slice_of(self, rank: int, world: int) -> tuple[int, int]:
        """Global sample range [lo, hi) of `rank` among `world` ranks."""
        if world <= 0 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        if self.batch_size % world:
            raise ValueError(
                f"the global batch {self.batch_size} does not split evenly over {world} ranks"
            )
        b = self.batch_size // world
        return rank * b, (rank + 1) * b

    def lengths(self, step: int, feature_index: int, lo: int, hi: int) -> np.ndarray:
        """Bag lengths (int64) of feature `feature_index` for global samples [lo, hi)."""
        f = self.plan.features[feature_index]
        if f.fixed:
            return np.full(hi - lo, max(1, int(round(f.hotness))), dtype=np.int64)
        cdf = _cached_length_cdf(f.hotness, f.bag_max)
        u = uniforms(stream_base(self.seed, step, _LENGTH, feature_index), np.arange(lo, hi))
        return np.searchsorted(cdf, u, side="right").astype(np.int64) + 1

    def bag(self, step: int, feature_index: int, lo: int, hi: int) -> Bag:
        """The bag of feature `feature_index` for global samples [lo, hi) of step `step`."""
        f = self.plan.features[feature_index]
        lengths = self.lengths(step, feature_index, lo, hi)
        offsets = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        nnz = int(offsets[-1])
        ids = np.empty(nnz, dtype=np.int64)
        weights = np.empty(nnz, dtype=np.float32) if f.weighted else None
        # counter of (sample s, position p) = s * width + p: unique within the stream
        width = max(f.bag_max, int(round(f.hotness)))
        id_base = stream_base(self.seed, step, _IDS, feature_index)
        weight_base = stream_base(self.seed, step, _WEIGHTS, feature_index)
        # chunks of about CHUNK_IDS ids keep the temporaries in cache (several times faster)
        per_chunk = max(1, CHUNK_IDS // width)
        for s0 in range(0, hi - lo, per_chunk):
            s1 = min(hi - lo, s0 + per_chunk)
            a, b = int(offsets[s0]), int(offsets[s1])
            if f.fixed and b - a == (s1 - s0) * width:
                # every bag is full: the counters are consecutive
                counters = np.arange((lo + s0) * width, (lo + s1) * width, dtype=np.int64)
            else:
                n = lengths[s0:s1]
                sample = np.repeat(np.arange(lo + s0, lo + s1, dtype=np.int64), n)
                pos = np.arange(a, b, dtype=np.int64) - np.repeat(offsets[s0:s1], n)
                counters = sample * width + pos
            ids[a:b] = self._keys(f, uniforms(id_base, counters))
            if weights is not None:
                weights[a:b] = 0.5 + uniforms(weight_base, counters)
        return Bag(ids=ids, offsets=offsets, weights=weights)

    def _keys(self, f: PlanFeature, u: np.ndarray) -> np.ndarray:
        rows = self._rows[f.table]
        a = f.access
        if a.kind == "uniform":
            return np.minimum((u * rows).astype(np.int64), rows - 1)
        if a.kind == "zipf":
            assert a.alpha is not None
            ranks = zipf_sampler(rows, float(a.alpha)).sample(u)
            if a.permuted is False:
                return ranks
            return permute(ranks, rows, self._table_index[f.table])
        keys = np.asarray(a.keys, dtype=np.int64)
        cum = np.cumsum(np.asarray(a.counts, dtype=np.float64))
        idx = np.searchsorted(cum, u * cum[-1], side="right")
        return keys[np.minimum(idx, len(keys) - 1)]

    def dense(self, step: int, lo: int, hi: int) -> np.ndarray:
        """Dense features, float32[hi - lo, dense_features], uniform in [0, 1)."""
        d = self.dense_features
        if d == 0:
            return np.zeros((hi - lo, 0), dtype=np.float32)
        counters = np.arange(lo * d, hi * d, dtype=np.int64)
        u = uniforms(stream_base(self.seed, step, _DENSE), counters)
        return u.reshape(hi - lo, d).astype(np.float32)

    def key_scores(self, table: str, keys: np.ndarray) -> np.ndarray:
        """The per-key score in [-1, 1) that the labels depend on (same every step)."""
        base = stream_base(self.seed, _KEY_SCORE, self._table_index[table])
        return 2.0 * uniforms(base, keys) - 1.0

    def labels(
        self, step: int, lo: int, hi: int, dense: np.ndarray, sparse: dict[str, Bag]
    ) -> np.ndarray:
        """0/1 labels (float32) of samples [lo, hi), given their dense and sparse inputs."""
        n = hi - lo
        signal = np.zeros(n)
        for f in self.plan.features[:LABEL_FEATURES]:
            bag = sparse[f.name]
            scores = self.key_scores(f.table, bag.ids)
            sums = np.add.reduceat(scores, bag.offsets[:-1]) if len(scores) else np.zeros(n)
            lengths = bag.lengths
            # reduceat repeats the next value for an empty bag; bags are never empty here
            signal += np.where(lengths > 0, sums / np.maximum(lengths, 1), 0.0)
        if self.dense_features:
            signal += 0.5 * ((dense.astype(np.float64) - 0.5) @ self._dense_signs)
        noise = 2.0 * uniforms(stream_base(self.seed, step, _LABEL), np.arange(lo, hi)) - 1.0
        return (signal + 0.5 * noise > 0).astype(np.float32)

    # ------------------------------------------------------------------ batches

    def samples(self, step: int, lo: int, hi: int) -> Batch:
        """Global samples [lo, hi) of step `step` as one Batch."""
        if step < 0 or not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"samples [{lo}, {hi}) of step {step} are outside the batch")
        sparse = {f.name: self.bag(step, i, lo, hi) for i, f in enumerate(self.plan.features)}
        dense = self.dense(step, lo, hi)
        return Batch(dense=dense, labels=self.labels(step, lo, hi, dense, sparse), sparse=sparse)

    def batch(self, step: int, rank: int, world: int) -> Batch:
        """Rank `rank`'s slice [rank*b, (rank+1)*b) of step `step`, b = batch_size // world."""
        lo, hi = self.slice_of(rank, world)
        return self.samples(step, lo, hi)

    def global_batch(self, step: int) -> Batch:
        """The whole global batch of step `step` (== every rank's slice, concatenated)."""
        return self.samples(step, 0, self.batch_size)


@lru_cache(maxsize=256)
def _cached_length_cdf(hotness: float, max_hotness: int) -> np.ndarray:
    return length_cdf(hotness, max_hotness)
