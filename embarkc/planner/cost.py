"""The analytic cost model: per rank and per step, what a plan costs in time and memory.

Everything here is an expected value over the spec's access distributions, computed from
the IR's hardware numbers and the constants of `embarkc.planner.constants`. The bytes are
those that docs/communication.md defines (the simulator counts the same bytes from
sampled batches); this module turns them into seconds:

* lookup: HBM bytes of the forward lookup and pooling, the backward and the optimizer
  update (rows touched x (weights + state), read and written), over
  `hbm_bandwidth * HBM_EFFICIENCY`, plus kernel launches;
* distributor, nvlink, network: every all-to-all phase moves `max(sent, received)` bytes
  through each link of a rank (links are full duplex, so the busier direction decides),
  over the link's bandwidth times its efficiency, plus collective latencies; the
  backward mirrors the forward (same bytes, opposite direction);
* dp_exchange: the dp tables' gradient all-reduce (dense: hierarchical, reduce-scatter
  in the node, all-reduce of 1/G of it on every rail, all-gather in the node) or
  all-gather (sparse: rail exchange, then inside the node), whichever the plan says (the
  planner picks the cheaper); `embarkc.planner.collectives` gives bytes and seconds.

A rank's estimate is the sum of its components; the step time is the largest rank's
estimate (the collectives wait for the slowest rank). The dense MLP's compute and its
gradient all-reduce are the same for every plan; they are reported separately
(`dense_allreduce_time`) and are not part of the step time.

Access statistics per row shard (share of lookups, expected distinct ids for n draws,
sum_i 1 - (1 - p_i)^n) are exact for the head of a zipf distribution (the first
`HEAD_RANKS` ranks, placed in their row shard through `embark_runtime.keys.permute` when
the ids are permuted) and integrated for the tail. Features of one table with different
access distributions are treated as independent streams (their distinct counts add,
capped at the shard's rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from embark_runtime import keys as keymod
from embark_runtime.optimizers import STATE_ELEMENT_BYTES, optimizer
from embark_runtime.plan import Plan
from embarkc.dense import DenseShape, prefetch_window
from embarkc.ir import Program, Table
from embarkc.planner import collectives as coll
from embarkc.planner import constants as K
from embarkc.planner.types import Layout, Placement

if TYPE_CHECKING:
    from embarkc.planner.budget import WorkMeter

HEAD_RANKS = 1 << 16
"""Zipf ranks whose probabilities are summed exactly when a table is row-split (their keys
decide which shard is hot); the rest is integrated."""

HEAD_RANKS_WHOLE = 1 << 12
"""The exact head for an unsplit table, where only totals matter: beyond rank 4096 the
midpoint integral of a zipf density is accurate to well under 0.1 %."""

_TAIL_POINTS = 257
COMPONENTS = ("lookup", "distributor", "nvlink", "network", "dp_exchange")
PHASE_GROUPS = (("lookup",), ("distributor",), ("nvlink", "network"), ("dp_exchange",))
"""The components of a step that run as phases between collectives: the HBM work, the
key all-to-all, the result and gradient all-to-alls (NVLink then network in each, the
backward mirroring the forward), the dp exchange. `RankState.critical_path` charges each
its slowest rank, as a runtime whose collectives wait for every rank does (TorchRec's
planner assumes a synchronisation after each of forward and backward communication and
computation)."""


# --------------------------------------------------------------------------- access statistics


def _distinct(p: np.ndarray, n: float) -> np.ndarray:
    """1 - (1 - p)^n, elementwise, accurate for tiny p."""
    return -np.expm1(n * np.log1p(-np.minimum(p, 1.0 - 1e-16)))


def zipf_tail_mass(lo: np.ndarray, hi: np.ndarray, alpha: float) -> np.ndarray:
    """Integral of t^-alpha over [lo, hi] (midpoint rule for ranks lo-0.5 .. hi-0.5)."""
    if abs(alpha - 1.0) < 1e-12:
        return np.log(hi) - np.log(lo)
    return (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)


def _zipf_tail_distinct(
    lo: np.ndarray, hi: np.ndarray, alpha: float, z: float, ns: tuple[float, ...]
) -> np.ndarray:
    """Integral over t in [lo, hi] of 1 - (1 - t^-alpha / z)^n, for each n: shape (len(ns), len(lo))."""
    out = np.zeros((len(ns), len(lo)))
    ok = hi > lo
    if not ok.any():
        return out
    t, p, du = tail_grid(lo[ok], hi[ok], alpha, z)
    for i, n in enumerate(ns):
        out[i, ok] = tail_sum(_distinct(p, n) * t, du)
    return out


def tail_grid(
    lo: np.ndarray, hi: np.ndarray, alpha: float, z: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The points of the trapezoid rule over ranks [lo, hi] of a zipf tail, log-spaced
    (`_TAIL_POINTS` an interval): the ranks t, their probabilities t^-alpha / z and the
    step in log t, per interval."""
    ulo, uhi = np.log(lo), np.log(hi)
    u = ulo[:, None] + (uhi - ulo)[:, None] * np.linspace(0.0, 1.0, _TAIL_POINTS)[None, :]
    t = np.exp(u)
    return t, t ** (-alpha) / z, (uhi - ulo) / (_TAIL_POINTS - 1)


def tail_sum(f: np.ndarray, du: np.ndarray) -> np.ndarray:
    """The trapezoid rule of `tail_grid`: f (an integrand times t) summed in log t."""
    return (f[:, :-1] + f[:, 1:]).sum(axis=1) * 0.5 * du  # type: ignore[no-any-return]


def shard_rows(rows: int, r: int, partition: str) -> np.ndarray:
    """Rows held by each of `r` row shards."""
    j = np.arange(r, dtype=np.int64)
    if partition == "mod":
        return (rows - j + r - 1) // r
    block = -(-rows // r)
    return np.clip(rows - j * block, 0, block)


def cache_rows_of(rows: np.ndarray, share: float) -> np.ndarray:
    """HBM cache rows of host-tier cells of `rows` rows that cache `share` of them."""
    return np.minimum(rows, np.floor(share * np.asarray(rows))).astype(np.int64)


@lru_cache(maxsize=65536)
def access_stats(
    rows: int,
    access: tuple[Any, ...],
    r: int,
    partition: str,
    table_index: int,
    ns: tuple[float, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """(q, d): share of lookups in each of `r` row shards, and expected distinct ids per
    shard for each number of draws in `ns` (shape (len(ns), r)).

    `access` is ("uniform",), ("zipf", alpha, permuted) or ("histogram", keys, counts).
    """
    rs = shard_rows(rows, r, partition).astype(np.float64)
    kind = access[0]
    sh: np.ndarray
    q: np.ndarray
    if kind == "uniform":
        q = rs / rows
        d = np.stack([rs * float(_distinct(np.array(1.0 / rows), n)) for n in ns])
        return q, d
    if kind == "histogram":
        keys = np.asarray(access[1], dtype=np.int64)
        counts = np.asarray(access[2], dtype=np.float64)
        p = counts / counts.sum()
        sh = keymod.row_shard_of(keys, rows, r, partition) if r > 1 else np.zeros_like(keys)
        q = np.bincount(sh, p, minlength=r)
        d = np.stack([np.bincount(sh, _distinct(p, n), minlength=r) for n in ns])
        return q, d
    alpha, permuted = float(access[1]), bool(access[2])
    k = min(rows, HEAD_RANKS if r > 1 else HEAD_RANKS_WHOLE)
    ranks = np.arange(k, dtype=np.int64)
    p, head_d, z, tail_w, tail_d = _zipf_head(rows, alpha, ns, k)
    if r == 1:
        q = np.array([p.sum()])
        d = head_d.sum(axis=1, keepdims=True)
        sh = np.zeros(k, dtype=np.int64)
    else:
        key = _head_keys(rows, table_index, k) if permuted else ranks
        # as intp once: bincount would convert int32 shards on each of its calls
        sh = keymod.row_shard_of(key, rows, r, partition).astype(np.intp, copy=False)
        q = np.bincount(sh, p, minlength=r)
        d = np.stack([np.bincount(sh, head_d[i], minlength=r) for i in range(len(ns))])
    if rows > k:
        if permuted or partition == "mod" or r == 1:
            # the tail's keys are spread evenly over the shards' remaining rows
            head = np.bincount(sh, minlength=r).astype(np.float64)
            share = (rs - head) / (rows - k)
            q = q + (tail_w / z) * share
            d = d + tail_d[:, None] * share[None, :]
        else:
            # sorted ids in contiguous blocks: shard j holds ranks [j*block, (j+1)*block)
            block = -(-rows // r)
            j = np.arange(r)
            lo = np.maximum(j * block, k) + 0.5
            hi = np.minimum((j + 1) * block, rows) + 0.5
            hi = np.maximum(hi, lo)
            q = q + zipf_tail_mass(lo, hi, alpha) / z
            d = d + _zipf_tail_distinct(lo, hi, alpha, z, ns)
    return q, np.minimum(d, rs[None, :])


@lru_cache(maxsize=1024)
def _head_keys(rows: int, table_index: int, k: int) -> np.ndarray:
    """The keys of the first k frequency ranks of a permuted table (they do not depend on
    the number of row shards, so every grid of the table shares them); int32 when they
    fit, so the cache holds at most 1024 x HEAD_RANKS x 4 bytes (256 MiB)."""
    keys = keymod.permute(np.arange(k, dtype=np.int64), rows, table_index)
    if rows <= np.iinfo(np.int32).max:
        keys = keys.astype(np.int32)
    keys.flags.writeable = False
    return keys


@lru_cache(maxsize=64)
def zipf_weights(alpha: float, k: int) -> np.ndarray:
    """(rank + 1)^-alpha for the first k ranks: shared by every table of the same skew and
    head size (the power is most of a head's cost)."""
    w = (np.arange(k, dtype=np.float64) + 1.0) ** (-alpha)
    w.flags.writeable = False
    return w


@lru_cache(maxsize=1024)
def _zipf_head(
    rows: int, alpha: float, ns: tuple[float, ...], k: int
) -> tuple[np.ndarray, np.ndarray, float, float, np.ndarray]:
    """Head probabilities p (the first k ranks), their distinct-id terms for every n,
    the normaliser z, the tail's unnormalised mass and its integrated distinct ids."""
    w = zipf_weights(alpha, k)
    tail_lo, tail_hi = k + 0.5, rows + 0.5
    tail_w = float(zipf_tail_mass(np.array(tail_lo), np.array(tail_hi), alpha)) if rows > k else 0.0
    z = float(w.sum()) + tail_w
    p = w / z
    # `_distinct` for every n, its logarithm taken once
    log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-16))
    head_d = np.stack([-np.expm1(n * log_miss) for n in ns])
    if rows > k:
        tail_d = _zipf_tail_distinct(np.array([tail_lo]), np.array([tail_hi]), alpha, z, ns)[:, 0]
    else:
        tail_d = np.zeros(len(ns))
    return p, head_d, z, tail_w, tail_d


def access_key(access: Any) -> tuple[Any, ...]:
    if access.kind == "uniform":
        return ("uniform",)
    if access.kind == "zipf":
        return ("zipf", float(access.alpha), bool(access.permuted))
    return ("histogram", tuple(access.keys), tuple(access.counts))


# --------------------------------------------------------------------------- per table facts


@dataclass
class TableFacts:
    """What the cost model needs of one table and the features that read it."""

    name: str
    index: int
    rows: int
    dim: int
    elem: int
    state_per_elem: int
    """fp32 state elements per weight element (adagrad 1, adam 2)."""
    state_per_row: int
    """fp32 state elements per row, replicated on every column cell (rowwise_adagrad, adam)."""
    groups: tuple[tuple[tuple[Any, ...], float], ...]
    """(access key, ids per sample) for each distinct access distribution of its features."""
    ids: float
    """H: ids per sample over all features reading the table."""
    outputs: float
    """F: pooled vectors per sample (a concat feature of hotness h counts h)."""
    bags: int
    """features reading the table: one bag length per (sample, feature)."""
    weighted_ids: float
    optimizer: str
    signature_id: int = -1
    """A small integer per distinct `signature` in the program (`table_facts`), so that
    the cost caches hash two ints instead of the signature."""

    @property
    def signature(self) -> tuple[Any, ...]:
        """Everything the costs depend on except the name and, for permuted ids, the index:
        tables with equal signatures share cached cell costs."""
        return (
            self.rows,
            self.dim,
            self.elem,
            self.state_per_elem,
            self.state_per_row,
            self.groups,
            self.outputs,
            self.bags,
            self.weighted_ids,
        )

    def cache_key(self, r: int) -> tuple[int, int]:
        """Tables of equal signature share cell costs, unless their ids are permuted (by
        the table's index) and the table is row-split."""
        if r > 1 and self.permuted:
            return (self.signature_id, self.index)
        return (self.signature_id, -1)

    @cached_property
    def permuted(self) -> bool:
        return any(k[0] == "zipf" and k[2] for k, _ in self.groups)

    def cell_bytes(self, rows: float, width: int) -> tuple[float, float]:
        """(weights, optimizer state) bytes of `rows` rows of `width` columns."""
        weights = rows * width * self.elem
        state = rows * (width * self.state_per_elem + self.state_per_row) * STATE_ELEMENT_BYTES
        return weights, state


def signature_count(facts: dict[str, TableFacts]) -> int:
    """Distinct signatures among `facts` (`table_facts`): part of the plan command's rest
    scales with them (`planner.REST_SECONDS_PER_SIGNATURE`)."""
    return len({tf.signature_id for tf in facts.values()})


def head_weight(facts: dict[str, TableFacts]) -> float:
    """The exact zipf heads that row-splitting every table of `facts` computes, in whole
    heads of HEAD_RANKS ranks (one per distinct signature, smaller for fewer rows): part of
    the fixed strategies' time scales with it (`planner.BASELINE_SECONDS_PER_HEAD`)."""
    rows = {tf.signature_id: tf.rows for tf in facts.values()}
    return sum(min(r, HEAD_RANKS) for r in rows.values()) / HEAD_RANKS


class CommandSize(NamedTuple):
    """What the plan command's rest and the fixed strategies' time scale with
    (`planner.command_reserve`, `baselines_fit`, `baselines_limit`, in this order)."""

    tables: int
    signatures: int
    """`signature_count`"""
    heads: float
    """`head_weight`"""

    @classmethod
    def of(cls, facts: dict[str, TableFacts]) -> CommandSize:
        return cls(len(facts), signature_count(facts), head_weight(facts))


def table_facts(program: Program) -> dict[str, TableFacts]:
    out: dict[str, TableFacts] = {}
    for i, t in enumerate(program.tables):
        feats = program.features_of[t.name]
        groups: dict[tuple[Any, ...], float] = {}
        outputs = 0.0
        weighted = 0.0
        for f in feats:
            key = access_key(f.access)
            groups[key] = groups.get(key, 0.0) + f.hotness
            outputs += f.max_hotness if f.pooling == "concat" else 1
            if f.weighted:
                weighted += f.hotness
        out[t.name] = TableFacts(
            name=t.name,
            index=i,
            rows=t.rows,
            dim=t.dim,
            elem=t.element_bytes,
            state_per_elem=_state_per_elem(t),
            state_per_row=_state_per_row(t),
            groups=tuple(groups.items()),
            ids=sum(f.hotness for f in feats),
            outputs=outputs,
            bags=len(feats),
            weighted_ids=weighted,
            optimizer=t.optimizer.kind,
        )
    ids: dict[tuple[Any, ...], int] = {}
    for tf in out.values():
        tf.signature_id = ids.setdefault(tf.signature, len(ids))
    return out


def _state_per_elem(t: Table) -> int:
    return optimizer(t.optimizer.kind).per_element


def _state_per_row(t: Table) -> int:
    return optimizer(t.optimizer.kind).per_row


# --------------------------------------------------------------------------- cells


@dataclass
class CellValues:
    """Per-cell costs of one table's cells, independent of where the cells are placed.

    Arrays are indexed by cell (in `Placement` order, or the explicit order of a plan's
    shards). Bytes per step unless said otherwise.
    """

    j: np.ndarray
    lo: np.ndarray
    width: np.ndarray
    hbm_own: np.ndarray
    """HBM bytes the owner moves for the cell (lookup, pooling, backward, update)."""
    dist: np.ndarray
    """Distributor bytes every other rank sends to the owner (deduplicated per (j, rank))."""
    res: np.ndarray
    """Forward bytes the owner sends to every other rank (the backward mirrors them)."""
    weights: np.ndarray
    state: np.ndarray
    buf_own: np.ndarray
    hbm_all: float
    """HBM bytes every rank moves for the table as a requester (summing partials, ub pooling)."""
    buf_all: float
    owner: dict[bool, np.ndarray] = field(default_factory=dict)
    """Cache of `owner_seconds` for these cells, by hierarchical."""
    _scalars: list[tuple[float, ...]] | None = field(default=None, repr=False, compare=False)
    _peers: list[tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    node_dedup: bool = False
    """Hierarchical ub on several nodes: every other node's aggregator (the owner's rail
    peer there) deduplicates its node's ids. `res` and `dist` are then what one requester
    receives and sends, over NVLink to its aggregator or to an owner of its own node."""
    res_node: np.ndarray | None = None
    """node_dedup: vectors the owner sends each other node's aggregator (forward bytes)."""
    dist_node: np.ndarray | None = None
    """node_dedup: key bytes each other node's aggregator sends the owner."""
    agg_hbm: np.ndarray | None = None
    """node_dedup: HBM bytes of one aggregator for the cell."""
    agg_buf: np.ndarray | None = None
    """node_dedup: buffer bytes of one aggregator for the cell."""
    hub_res: np.ndarray | None = None
    """node_dedup: per cell the row of `HUB_TERMS` sums its results add (x, X, h, b)."""
    hub_dist: np.ndarray | None = None
    """node_dedup: per cell the row its keys add (d, D), once per (row shard, owner)."""
    cache: np.ndarray | None = None
    """Host tier: per cell its HBM cache rows, -1 for a cell in HBM; None: every cell in
    HBM (`weights` and `state` are then what HBM holds: a host cell's cache)."""
    host: np.ndarray | None = None
    """Host tier: bytes per step each cell moves over its owner's host link in each
    direction (misses fetched with their optimizer state, as many written back)."""
    host_memory: np.ndarray | None = None
    """Host tier: weights and optimizer state each cell keeps in host memory."""
    misses: np.ndarray | None = None
    """Host tier: expected cache misses per step of each cell (`cache_model`)."""
    lookups: np.ndarray | None = None
    """Host tier: distinct rows each cell's owner reads per step."""

    def scalars(self, ci: int) -> tuple[float, ...]:
        """Cell `ci`'s (hbm_own, weights, state, buf_own, res, res_node or 0, dist, host or 0)
        as Python floats: `RankState.move_cell` reads them once per move tried, and
        indexing the arrays each time was most of its cost."""
        if self._scalars is None:
            zero = np.zeros(len(self.j))
            node = self.res_node if self.res_node is not None else zero
            host = self.host if self.host is not None else zero
            cols = (
                self.hbm_own,
                self.weights,
                self.state,
                self.buf_own,
                self.res,
                node,
                self.dist,
                host,
            )
            self._scalars = list(zip(*(c.tolist() for c in cols), strict=True))
        return self._scalars[ci]

    def peers(self, ci: int) -> tuple[int, ...]:
        """The other cells of cell `ci`'s row shard."""
        if self._peers is None:
            js = self.j.tolist()
            by: dict[int, list[int]] = {}
            for k, jk in enumerate(js):
                by.setdefault(jk, []).append(k)
            self._peers = [tuple(k for k in by[jk] if k != i) for i, jk in enumerate(js)]
        return self._peers[ci]


@dataclass
class DpValues:
    hbm: float
    exchange_time: float
    weights: float
    state: float
    buf: float
    sent_intra: float
    sent_inter: float


class CostModel:
    """The analytic cost model of one program on its topology.

    `evaluate(plan)` costs any plan (a `Plan` from the planner, a baseline, or a file).
    The search uses `RankState` directly to cost layouts incrementally.
    """

    def __init__(self, program: Program, tiers: Mapping[str, float] | None = None):
        self.program = program
        self.tiers = dict(tiers or {})
        """Tables the host-tier stage put in host memory, each with the share of its
        cells' rows cached in HBM (`embarkc.planner.tiers`): the search costs their
        cells so. A placement's own `cache` (a plan's cells) takes precedence."""
        topo = program.topology
        self.W = topo.world_size
        self.G = topo.gpus_per_node
        self.nodes = topo.nodes
        self.B = float(program.batch_size)
        self.b = self.B / self.W
        self.partition = program.options.row_partition
        self.k = k = K.of(topo)
        """The constants the hardware block set, over the defaults."""
        self.bw_hbm = topo.hbm_bandwidth * k.hbm_efficiency
        self.bw_intra = topo.intra_node_bandwidth * k.nvlink_efficiency
        self.bw_inter = topo.inter_node_bandwidth * k.network_efficiency
        self.capacity = float(topo.hbm_bytes - program.options.memory_headroom)
        self.bw_host = topo.host_bandwidth or K.HOST_BANDWIDTH
        """Host <-> GPU bytes/s per GPU per direction: a host-tier cell's fetches and
        write-backs."""
        self.facts = table_facts(program)
        self.node_of = np.arange(self.W) // self.G
        self.local_of = np.arange(self.W) % self.G
        # one GPU runs no collective: the runtime copies its all-to-all chunks locally
        # (embark_runtime.comm.Comm.all_to_all), and the simulator charges none either
        self.collective_latency = (
            k.collective_latency_seconds + (k.inter_node_latency_seconds if self.nodes > 1 else 0.0)
            if self.W > 1
            else 0.0
        )
        self.dense = dense_shape(program)
        self.key_window = prefetch_window(self.dense, self.b, topo.dense_flops, k.dense_efficiency)
        """Seconds of dense compute that hide the next batch's key traffic."""
        self._cells: dict[tuple[Any, ...], CellValues] = {}
        self._dp: dict[tuple[Any, str], DpValues] = {}
        self._exchange: dict[tuple[Any, ...], str] = {}
        self._grid: dict[tuple[Any, ...], CellValues] = {}
        self.unit_cache: dict[tuple[Any, ...], Any] = {}
        """Memo of the search's cell loads, memory and templates per (unit, grid
        decision) (`Search.prepare`): a pure function of the program, read-only."""
        self.least_held: float | None = None
        """Memo of `bound.least_memory` (a refusal's message, at each start)."""
        self._stat_cache: dict[
            tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
        ] = {}
        self.cache_tables: dict[tuple[Any, ...], Any] = {}
        """Memo of `cache_model.table_cache` per (table signature, row shards)."""

    # ------------------------------------------------------------------ statistics
    def stats(self, tf: TableFacts, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, distinct per requester, distinct over the global batch) per row shard."""
        q, ul, ug, _ = self._stats(tf, r)
        return q, ul, ug

    def node_distinct(self, tf: TableFacts, r: int) -> np.ndarray:
        """Expected distinct ids per row shard among the samples of one node (G * b)."""
        return self._stats(tf, r)[3]

    def _stats(
        self, tf: TableFacts, r: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`stats` and, on several nodes, `node_distinct` (zeros on one), in one pass over
        the access distributions."""
        key_ = (tf.cache_key(r), r)
        hit = self._stat_cache.get(key_)
        if hit is not None:
            return hit
        q, ul, ug, un = np.zeros(r), np.zeros(r), np.zeros(r), np.zeros(r)
        node = self.nodes > 1
        for key, h in tf.groups:
            perm_index = tf.index if (key[0] == "zipf" and key[2] and r > 1) else 0
            ns = (self.b * h, self.B * h) + ((self.G * self.b * h,) if node else ())
            qg, d = access_stats(tf.rows, key, r, self.partition, perm_index, ns)
            q += qg * (h / tf.ids)
            ul += d[0]
            ug += d[1]
            if node:
                un += d[2]
        rs = shard_rows(tf.rows, r, self.partition)
        out = (q, np.minimum(ul, rs), np.minimum(ug, rs), np.minimum(un, rs))
        self._stat_cache[key_] = out
        return out

    # ------------------------------------------------------------------ cells
    def cell_values(
        self,
        tf: TableFacts,
        kind: str,
        r: int,
        cells: tuple[tuple[int, int, int], ...],
        node_dedup: bool = False,
        cache: tuple[int, ...] | None = None,
    ) -> CellValues:
        """Costs of the cells `(row_shard, lo, hi)` of a table split into `r` row shards;
        `node_dedup`: hierarchical ub (ignored on one node, where it is flat ub); `cache`:
        each cell's HBM cache rows, -1 for a cell in HBM (None: the table's share in
        `tiers`, else every cell in HBM)."""
        node_dedup = node_dedup and kind == "ub" and self.nodes > 1
        share = self.tiers.get(tf.name) if cache is None else None
        key = (tf.cache_key(r), kind, r, cells, node_dedup, cache, share)
        hit = self._cells.get(key)
        if hit is not None:
            return hit
        q, ul, ug = self.stats(tf, r)
        rs = shard_rows(tf.rows, r, self.partition).astype(np.float64)
        j = np.array([c[0] for c in cells], dtype=np.int64)
        lo = np.array([c[1] for c in cells], dtype=np.int64)
        w = np.array([c[2] - c[1] for c in cells], dtype=np.float64)
        B, b, W = self.B, self.b, self.W
        qj, ulj, ugj, rsj = q[j], ul[j], ug[j], rs[j]
        floor = self.k.small_vector_bytes
        row_access = np.maximum(w * tf.elem, floor)
        grad_access = np.maximum(w * K.WIRE_ELEMENT_BYTES, floor)
        weights, state = tf.cell_bytes(rsj, w)  # type: ignore[arg-type]
        touched_row = 2.0 * (w * tf.elem + (w * tf.state_per_elem + tf.state_per_row) * 4)
        vec = K.WIRE_ELEMENT_BYTES * w
        if kind == "rb":
            n = B * tf.ids * qj  # ids of the global batch that fall into the row shard
            fwd = n * (K.KEY_BYTES + row_access) + B * tf.outputs * vec
            bwd = B * tf.outputs * vec + n * (grad_access + 2 * K.KEY_BYTES) + ugj * touched_row
            hbm_own = fwd + bwd
            dist = b * tf.ids * qj * K.KEY_BYTES + b * tf.weighted_ids * qj * K.WEIGHT_BYTES
            dist = dist + b * tf.bags * K.LENGTH_BYTES
            res = b * tf.outputs * vec
            hbm_all = float((b * tf.outputs * vec).sum())
            buf_own = B * tf.outputs * vec + n * K.KEY_BYTES
            buf_all = float((b * tf.outputs * vec).sum())
        elif kind == "ub":
            G, N = self.G, self.nodes
            if node_dedup:
                unj = self.node_distinct(tf, r)[j]
                # the ids of its own node's requesters, and one union per other node
                recv = G * ulj + (N - 1) * unj
            else:
                recv = W * ulj  # distinct ids received from all requesters (its own included)
            fwd = recv * (K.KEY_BYTES + row_access + vec)
            bwd = recv * (vec + K.KEY_BYTES) + ugj * touched_row + recv * 2 * K.KEY_BYTES
            hbm_own = fwd + bwd
            dist = ulj * K.KEY_BYTES
            res = ulj * vec
            occ = b * tf.ids * qj
            # requester: dedup (hash) of its ids, pooling of the received vectors, and
            # the backward scatter of pooled gradients into per-distinct-id gradients
            per_req = occ * (4 * K.KEY_BYTES + 2 * grad_access) + ulj * vec * 2
            hbm_all = float(per_req.sum()) + 2.0 * b * tf.outputs * K.WIRE_ELEMENT_BYTES * tf.dim
            buf_own = recv * (K.KEY_BYTES + vec)
            buf_all = float((ulj * (K.KEY_BYTES + vec)).sum()) + b * tf.outputs * 4 * tf.dim
        else:
            raise ValueError(kind)
        if cache is None and share is not None:
            cache = tuple(cache_rows_of(rsj, share).tolist())
        tier: dict[str, Any] = {}
        if cache is not None and max(cache) >= 0:
            tier = self._host_cells(tf, r, j, w, rsj, np.asarray(cache, dtype=np.float64))
            hbm_own = hbm_own + 2.0 * tier["host"]  # rows into the cache and out of it
            weights, state = tier.pop("held")
        cv = CellValues(
            j=j,
            lo=lo,
            width=w,
            hbm_own=hbm_own,
            dist=dist,
            res=res,
            weights=np.asarray(weights, dtype=np.float64),
            state=np.asarray(state, dtype=np.float64),
            buf_own=buf_own,
            hbm_all=hbm_all,
            buf_all=buf_all,
            node_dedup=node_dedup,
            **tier,
        )
        if node_dedup:
            # an aggregator: dedup of the G requests it holds, the forward gather and copy
            # per request, the backward read and add per request
            agg = self.G * ulj
            cv.res_node = res_node = unj * vec
            cv.dist_node = dist_node = unj * K.KEY_BYTES
            cv.agg_hbm = agg_hbm = agg * (4 * K.KEY_BYTES + 4 * vec)
            cv.agg_buf = agg_buf = (agg + unj) * (K.KEY_BYTES + vec)
            z = np.zeros_like(cv.res)
            cv.hub_res = np.stack([cv.res, res_node, z, z, agg_hbm, agg_buf], axis=1)
            cv.hub_dist = np.stack([z, z, cv.dist, dist_node, z, z], axis=1)
        self._cells[key] = cv
        return cv

    def _host_cells(
        self, tf: TableFacts, r: int, j: np.ndarray, w: np.ndarray, rsj: np.ndarray, c: np.ndarray
    ) -> dict[str, Any]:
        """The host-tier fields of cells (row shards `j`, widths `w`, rows `rsj`) whose
        caches are `c` rows (-1: in HBM), and the bytes HBM holds of each (`held`)."""
        from embarkc.planner.cache_model import cell_misses

        on_host = c >= 0
        lookups, misses = cell_misses(self, tf, r, j, np.where(on_host, c, 0.0))
        misses = np.where(on_host, misses, 0.0)
        weight_row, state_row = tf.cell_bytes(1.0, w)  # type: ignore[arg-type]
        per_row = weight_row + state_row
        # misses beyond the slots the step's hits leave are served from host: their
        # weights read for the lookup, then weights and state for the update, written back
        host_reads = np.maximum(misses - np.maximum(c - (lookups - misses), 0.0), 0.0)
        held = np.where(on_host, np.minimum(c, rsj), rsj)
        whole = np.add(*tf.cell_bytes(rsj, w))  # type: ignore[arg-type]
        return {
            "cache": np.where(on_host, c, -1.0),
            "host": misses * per_row + np.where(on_host, host_reads, 0.0) * weight_row,
            "host_memory": np.where(on_host, whole, 0.0),
            "misses": misses,
            "lookups": np.where(on_host, lookups, 0.0),
            "held": tf.cell_bytes(held, w),  # type: ignore[arg-type]
        }

    def placement_values(self, tf: TableFacts, p: Placement) -> CellValues:
        """The cells of a placement: its regular grid, or the cells a plan spelled out."""
        if p.cells_explicit is None:
            return self.grid_values(tf, p)
        cells = tuple((c[0], c[1], c[2]) for c in p.cells_explicit)
        return self.cell_values(tf, p.kind, p.row_shards, cells, p.node_dedup, p.cache)

    def grid_values(self, tf: TableFacts, p: Placement) -> CellValues:
        share = self.tiers.get(tf.name) if p.cache is None else None
        key = (
            tf.cache_key(p.row_shards),
            p.kind,
            p.row_shards,
            p.widths,
            p.node_dedup,
            p.cache,
            share,
        )
        hit = self._grid.get(key)
        if hit is not None:
            return hit
        offs = p.offsets()
        cells = tuple(
            (j, offs[k], offs[k] + p.widths[k])
            for j in range(p.row_shards)
            for k in range(len(p.widths))
        )
        cv = self.cell_values(tf, p.kind, p.row_shards, cells, p.node_dedup, p.cache)
        self._grid[key] = cv
        return cv

    def dp_values(self, tf: TableFacts, exchange: str) -> DpValues:
        key = (tf.signature, exchange)
        hit = self._dp.get(key)
        if hit is not None:
            return hit
        W, G, b = self.W, self.G, self.b
        _, ul, ug = self.stats(tf, 1)
        u_loc, u_glob = float(ul[0]), float(ug[0])
        dim = tf.dim
        vec = K.WIRE_ELEMENT_BYTES * dim
        row_access = max(dim * tf.elem, self.k.small_vector_bytes)
        grad_access = max(vec, self.k.small_vector_bytes)
        n = b * tf.ids
        weights, state = tf.cell_bytes(tf.rows, dim)
        touched_row = 2.0 * (dim * tf.elem + (dim * tf.state_per_elem + tf.state_per_row) * 4)
        local = n * (K.KEY_BYTES + row_access) + 2 * b * tf.outputs * vec + n * grad_access
        size = tf.rows * vec  # S, the dense gradient
        sent_intra = sent_inter = 0.0
        buf: float
        if exchange == "dense":
            # scatter into a zeroed dense gradient, then update every row
            hbm = local + 2 * size + tf.rows * (touched_row + vec)
            tr = coll.allreduce(size, G, self.nodes, self.bw_intra, self.bw_inter)
            buf = size
        else:
            msg = u_loc * (K.KEY_BYTES + vec)
            tr = coll.allgather(msg, G, self.nodes, self.bw_intra, self.bw_inter)
            hbm = local + W * msg + u_glob * touched_row + n * 2 * K.KEY_BYTES
            buf = W * msg
        t, sent_intra, sent_inter = tr.seconds, tr.intra, tr.inter
        dv = DpValues(
            hbm=hbm,
            exchange_time=t,
            weights=weights,
            state=state,
            buf=buf + b * tf.outputs * vec,
            sent_intra=sent_intra,
            sent_inter=sent_inter,
        )
        self._dp[key] = dv
        return dv

    def best_exchange(self, tf: TableFacts) -> str:
        """The dp gradient exchange with the smaller time per rank."""
        hit = self._exchange.get(tf.signature)
        if hit is not None:
            return hit
        if self.W == 1:
            best = "sparse"
        else:
            d, s = self.dp_values(tf, "dense"), self.dp_values(tf, "sparse")
            td = d.exchange_time + d.hbm / self.bw_hbm
            ts = s.exchange_time + s.hbm / self.bw_hbm
            best = "dense" if td < ts else "sparse"
        self._exchange[tf.signature] = best
        return best

    # ------------------------------------------------------------------ layouts
    def state(self, meter: WorkMeter | None = None) -> RankState:
        """An empty layout's state; its work counted on `meter` when given."""
        return RankState(self, meter)

    def layout_state(self, layout: Layout, meter: WorkMeter | None = None) -> RankState:
        """The state of `layout`, tables added in the program's order."""
        st = RankState(self, meter)
        for name in sorted(layout, key=lambda n: self.facts[n].index):
            st.add_table(name, layout[name], 1.0)
        return st

    def evaluate_layout(self, layout: Layout, meter: WorkMeter | None = None) -> dict[str, Any]:
        """The plan file's `estimate` of `layout`."""
        return self.layout_state(layout, meter).estimate(layout)

    def evaluate(self, plan: Plan) -> dict[str, Any]:
        """The `estimate` of any plan of this program (see docs/plan.md)."""
        est = self.evaluate_layout(layout_of_plan(plan))
        names = {t: c.name for c in plan.clusters for t in c.tables}
        for row in est["per_table"]:
            row["cluster"] = names[row["table"]]
        return est

    def step_time(self, layout: Layout, meter: WorkMeter | None = None) -> float:
        """The step time of `layout` (its slowest rank)."""
        return self.layout_state(layout, meter).step_time()

    def keys_beyond_window(self, seconds: np.ndarray) -> np.ndarray:
        """Key link seconds that outlast the dense compute window (`key_window`): what of
        the key phase delays the step (docs/communication.md, "Overlap")."""
        return np.maximum(seconds - self.key_window, 0.0)

    def dense_allreduce_time(self) -> float:
        """Hierarchical all-reduce of the dense model's fp32 gradients
        (`collectives.allreduce`; not part of the step time)."""
        if self.W == 1:
            return 0.0
        params = self.dense.parameters()
        tr = coll.allreduce(params * 4.0, self.G, self.nodes, self.bw_intra, self.bw_inter)
        return tr.seconds + self.collective_latency


def dense_shape(program: Program) -> DenseShape:
    """The program's dense model (runtime/dense.py's architecture, features in order)."""
    dims = program.table_by_name
    widths = [
        dims[f.table].dim * (f.max_hotness if f.pooling == "concat" else 1)
        for f in program.features
    ]
    return DenseShape.of(program.model.model_dump(mode="json"), widths)


# --------------------------------------------------------------------------- rank state

HUB_TERMS = ("x", "X", "d", "D", "h", "b")
"""Sums of hierarchical ub cells kept per owner rank and per rail (`RankState.hub_own`,
`hub_rail`, one column each): the vector bytes one requester receives (x) and one
aggregator receives (X) per cell, the key bytes one requester sends (d) and one
aggregator sends (D), an aggregator's HBM bytes (h) and buffers (b)."""
(
    HUB_X_REQUESTER,  # x: vector bytes one requester receives
    HUB_X_AGGREGATOR,  # X: vector bytes one aggregator receives
    HUB_D_REQUESTER,  # d: key bytes one requester sends
    HUB_D_AGGREGATOR,  # D: key bytes one aggregator sends
    HUB_HBM,  # h: an aggregator's HBM bytes
    HUB_BUFFERS,  # b: an aggregator's buffers
) = range(len(HUB_TERMS))


@dataclass
class RankState:
    """Per-rank sums of a layout's costs, updated table by table (add, then subtract).

    Only sums are kept, so adding and removing a table is O(its cells + nodes); the
    per-rank times are derived from the sums in O(ranks).
    """

    cm: CostModel
    meter: WorkMeter | None = None
    """Where the search counts this state's evaluations and additions; None: nowhere."""
    hbm_own: np.ndarray = field(init=False)
    dist_own: np.ndarray = field(init=False)
    dist_node: np.ndarray = field(init=False)
    res_sent_intra: np.ndarray = field(init=False)
    res_sent_inter: np.ndarray = field(init=False)
    res_sent_inter_node: np.ndarray = field(init=False)
    res_recv_intra_node: np.ndarray = field(init=False)
    res_recv_intra_sub: np.ndarray = field(init=False)
    res_recv_inter_node_sub: np.ndarray = field(init=False)
    weights: np.ndarray = field(init=False)
    state_b: np.ndarray = field(init=False)
    buf: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        W, N = self.cm.W, self.cm.nodes
        for name in (
            "hbm_own dist_own res_sent_intra res_sent_inter res_recv_intra_sub weights state_b buf"
        ).split():
            setattr(self, name, np.zeros(W))
        for name in (
            "dist_node res_sent_inter_node res_recv_intra_node res_recv_inter_node_sub"
        ).split():
            setattr(self, name, np.zeros(N))
        self.hbm_all = 0.0
        self.dist_tot = 0.0
        self.res_recv_inter_tot = 0.0
        self.dp_time = 0.0
        self.all_weights = 0.0
        self.all_state = 0.0
        self.all_buf = 0.0
        self.counts = {"rb_flat": 0, "rb_hier": 0, "ub": 0, "ub_hier": 0, "dp": 0}
        # hierarchical ub (node_dedup cells): sums by owner rank and by the owner's local
        # index (its rail); an aggregator serves the cells of its rail on other nodes
        G = self.cm.G
        self.hub_own = np.zeros((W, len(HUB_TERMS)))
        self.hub_rail = np.zeros((G, len(HUB_TERMS)))
        self.hub_x_tot = 0.0
        self.hub_d_tot = 0.0
        # host tier: bytes per step over each rank's host link, host memory per rank, and
        # how many tables added have host-tier cells (none: the link is not costed)
        self.host_link = np.zeros(W)
        self.host_mem = np.zeros(W)
        self.host_tables = 0

    # ------------------------------------------------------------------ updates
    def add_table(self, name: str, p: Placement, sign: float) -> None:
        """Add (sign 1) or remove (sign -1) the costs of table `name` placed as `p`."""
        cm = self.cm
        tf = cm.facts[name]
        if p.kind == "dp":
            dv = cm.dp_values(tf, p.exchange)
            self.hbm_all += sign * dv.hbm
            self.dp_time += sign * dv.exchange_time
            self.all_weights += sign * dv.weights
            self.all_state += sign * dv.state
            self.all_buf += sign * dv.buf
            self.counts["dp"] += int(sign)
            return
        cv = cm.placement_values(tf, p)
        ranks = np.asarray(p.rank_list(), dtype=np.int64)
        self.add_cells(cv, ranks, sign, hierarchical=p.hierarchical)
        if cv.host is not None:
            self.host_tables += int(sign)
        if p.kind == "ub":
            key = "ub_hier" if cv.node_dedup else "ub"
        else:
            key = "rb_hier" if p.communication == "hierarchical" else "rb_flat"
        self.counts[key] += int(sign)

    def add_cells(
        self,
        cv: CellValues,
        ranks: np.ndarray,
        sign: float,
        hierarchical: bool = False,
    ) -> None:
        """Add (sign 1) or remove (sign -1) the cells of `cv` on `ranks` (one per cell),
        with the table-wide requester terms; the distributor bytes are deduplicated per
        (row shard, rank)."""
        cm = self.cm
        if self.meter is not None:
            self.meter.additions += 1
        W, G, nodes = cm.W, cm.G, cm.nodes
        if len(ranks) == 1:
            self._add_one(cv, int(ranks[0]), sign, hierarchical)
            return
        j = cv.j
        node = ranks // G
        np.add.at(self.hbm_own, ranks, sign * cv.hbm_own)
        np.add.at(self.weights, ranks, sign * cv.weights)
        np.add.at(self.state_b, ranks, sign * cv.state)
        np.add.at(self.buf, ranks, sign * cv.buf_own)
        if cv.host is not None:
            assert cv.host_memory is not None
            np.add.at(self.host_link, ranks, sign * cv.host)
            np.add.at(self.host_mem, ranks, sign * cv.host_memory)
        # distributor: once per distinct (row shard, owner rank)
        pair = j * W + ranks
        _, first = np.unique(pair, return_index=True)
        d = cv.dist[first]
        dr = ranks[first]
        x = cv.res
        if cv.node_dedup:
            assert cv.res_node is not None
            assert cv.hub_dist is not None and cv.hub_res is not None
            self._hub_add(dr, sign * cv.hub_dist[first])
            self.hub_d_tot += sign * float(d.sum())
            np.add.at(self.res_sent_intra, ranks, sign * (G - 1) * x)
            np.add.at(self.res_sent_inter, ranks, sign * (nodes - 1) * cv.res_node)
            self._hub_add(ranks, sign * cv.hub_res)
            self.hub_x_tot += sign * float(x.sum())
            self.hbm_all += sign * cv.hbm_all
            self.all_buf += sign * cv.buf_all
            return
        np.add.at(self.dist_own, dr, sign * d)
        np.add.at(self.dist_node, dr // G, sign * d)
        self.dist_tot += sign * float(d.sum())
        if not hierarchical or nodes == 1:
            np.add.at(self.res_sent_intra, ranks, sign * (G - 1) * x)
            np.add.at(self.res_sent_inter, ranks, sign * (W - G) * x)
            np.add.at(self.res_recv_intra_node, node, sign * x)
            np.add.at(self.res_recv_intra_sub, ranks, sign * x)
            self.res_recv_inter_tot += sign * float(x.sum())
            np.add.at(self.res_recv_inter_node_sub, node, sign * x)
        else:
            np.add.at(self.res_sent_intra, ranks, sign * nodes * (G - 1) * x)
            np.add.at(self.res_recv_intra_node, node, sign * nodes * x)
            np.add.at(self.res_recv_intra_sub, ranks, sign * nodes * x)
            # one summed vector per (column range, node) crosses the network per requester
            lo = cv.lo
            group = lo * nodes + node
            _, gfirst = np.unique(group, return_index=True)
            xg = x[gfirst]
            gn = node[gfirst]
            np.add.at(self.res_sent_inter_node, gn, sign * (nodes - 1) * xg)
            self.res_recv_inter_tot += sign * float(xg.sum())
            np.add.at(self.res_recv_inter_node_sub, gn, sign * xg)
        self.hbm_all += sign * cv.hbm_all
        self.all_buf += sign * cv.buf_all

    def _hub_add(self, ranks: np.ndarray | int, rows: np.ndarray) -> None:
        """Add `rows` (HUB_TERMS per cell) to the hierarchical-ub sums of owners `ranks`
        and of their rails."""
        if isinstance(ranks, int):
            self.hub_own[ranks] += rows
            self.hub_rail[ranks % self.cm.G] += rows
            return
        np.add.at(self.hub_own, ranks, rows)
        np.add.at(self.hub_rail, ranks % self.cm.G, rows)

    def move_cell(
        self, cv: CellValues, ranks: np.ndarray, ci: int, b: int, hierarchical: bool = False
    ) -> None:
        """Move cell `ci` of a table added with `cv` on `ranks` to rank `b` (`ranks` is left
        as it is): the same sums as removing the table and adding it again with
        `ranks[ci] = b`, in O(its cells). A hierarchical cell moves within its node (its
        partials' group is unchanged); across nodes it is removed and added whole."""
        G, nodes = self.cm.G, self.cm.nodes
        a = int(ranks[ci])
        if a == b:
            return
        na, nb = a // G, b // G
        if hierarchical and nodes > 1 and na != nb:
            moved = ranks.copy()
            moved[ci] = b
            self.add_cells(cv, ranks, -1.0, hierarchical)
            self.add_cells(cv, moved, 1.0, hierarchical)
            return
        # the cell's own terms leave `a` and join `b`; a hierarchical cell stays in its
        # node, so the summed vector its node sends over the network is unchanged
        self._cell_terms(cv, ci, a, -1.0, hierarchical)
        self._cell_terms(cv, ci, b, 1.0, hierarchical)
        # distributor: once per distinct (row shard, owner rank)
        others = [int(ranks[k]) for k in cv.peers(ci)]
        if a not in others:
            self._dist_one(cv, ci, a, -1.0)
        if b not in others:
            self._dist_one(cv, ci, b, 1.0)

    def _dist_one(self, cv: CellValues, ci: int, a: int, sign: float) -> None:
        """The distributor keys of cell `ci` on rank `a` (the first of its row shard there)."""
        d = sign * cv.scalars(ci)[6]
        if cv.node_dedup:
            assert cv.dist_node is not None
            assert cv.hub_dist is not None
            self._hub_add(a, sign * cv.hub_dist[ci])
            self.hub_d_tot += d
            return
        self.dist_own[a] += d
        self.dist_node[a // self.cm.G] += d
        self.dist_tot += d

    def _add_one(self, cv: CellValues, a: int, sign: float, hierarchical: bool) -> None:
        """`add_cells` for a table of one cell (the common case), without numpy calls."""
        self._cell_terms(cv, 0, a, sign, hierarchical)
        self._dist_one(cv, 0, a, sign)
        self.hbm_all += sign * cv.hbm_all
        self.all_buf += sign * cv.buf_all

    def _cell_terms(self, cv: CellValues, ci: int, a: int, sign: float, hierarchical: bool) -> None:
        """Add (sign 1) or remove (sign -1) cell `ci` of `cv` on rank `a`, as the only cell
        of its table: everything but the distributor's keys and the requester terms."""
        cm = self.cm
        W, G, nodes = cm.W, cm.G, cm.nodes
        n = a // G
        hbm_own, weights, state, buf_own, res, res_node, _, host = cv.scalars(ci)
        self.hbm_own[a] += sign * hbm_own
        self.weights[a] += sign * weights
        self.state_b[a] += sign * state
        self.buf[a] += sign * buf_own
        if cv.host is not None:
            assert cv.host_memory is not None
            self.host_link[a] += sign * host
            self.host_mem[a] += sign * float(cv.host_memory[ci])
        x = sign * res
        if cv.node_dedup:
            assert cv.hub_res is not None
            self.res_sent_intra[a] += (G - 1) * x
            self.res_sent_inter[a] += (nodes - 1) * sign * res_node
            self._hub_add(a, sign * cv.hub_res[ci])
            self.hub_x_tot += x
            return
        if not hierarchical or nodes == 1:
            self.res_sent_intra[a] += (G - 1) * x
            self.res_sent_inter[a] += (W - G) * x
            self.res_recv_intra_node[n] += x
            self.res_recv_intra_sub[a] += x
        else:
            self.res_sent_intra[a] += nodes * (G - 1) * x
            self.res_recv_intra_node[n] += nodes * x
            self.res_recv_intra_sub[a] += nodes * x
            self.res_sent_inter_node[n] += (nodes - 1) * x
        self.res_recv_inter_tot += x
        self.res_recv_inter_node_sub[n] += x

    # ------------------------------------------------------------------ results
    def links(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Bytes (sent, received) per rank of each all-to-all link: the distributor's keys
        and the forward results (the backward mirrors them), intra- and inter-node."""
        cm = self.cm
        W, G, N = cm.W, cm.G, cm.nodes
        no = cm.node_of
        out = {
            "dist_intra": (self.dist_node[no] - self.dist_own, (G - 1) * self.dist_own),
            "dist_inter": (self.dist_tot - self.dist_node[no], (W - G) * self.dist_own),
            "res_intra": (
                self.res_sent_intra,
                self.res_recv_intra_node[no] - self.res_recv_intra_sub,
            ),
            "res_inter": (
                self.res_sent_inter + self.res_sent_inter_node[no],
                self.res_recv_inter_tot - self.res_recv_inter_node_sub[no],
            ),
        }
        if self.counts["ub_hier"] == 0:
            return out
        # hierarchical ub: rank a (local index l) aggregates the cells of the rank-l owners
        # of the other nodes (rail - own) and receives over NVLink everything else not its own
        rail = self.hub_rail[cm.local_of]
        agg = rail - self.hub_own
        hub = {
            "dist_intra": (
                self.hub_d_tot - rail[:, HUB_D_REQUESTER],
                (G - 1) * rail[:, HUB_D_REQUESTER],
            ),
            "dist_inter": (agg[:, HUB_D_AGGREGATOR], (N - 1) * self.hub_own[:, HUB_D_AGGREGATOR]),
            "res_intra": (
                (G - 1) * agg[:, HUB_X_REQUESTER],
                self.hub_x_tot - rail[:, HUB_X_REQUESTER],
            ),
            "res_inter": (np.zeros(W), agg[:, HUB_X_AGGREGATOR]),
        }
        return {k: (s + hub[k][0], r + hub[k][1]) for k, (s, r) in out.items()}

    def aggregator(self, term: int) -> np.ndarray:
        """Per rank, the hierarchical-ub sum `term` (HUB_HBM HBM bytes, HUB_BUFFERS buffers) of the cells
        it aggregates (its rail's owners on the other nodes)."""
        return self.hub_rail[self.cm.local_of, term] - self.hub_own[:, term]

    def components(self) -> dict[str, np.ndarray]:
        """Seconds per rank of every component."""
        cm = self.cm
        if self.meter is not None:
            self.meter.evaluations += 1
        W = cm.W
        c = self.counts
        hub = int(c["ub_hier"] > 0)
        ubs = int(c["ub"] > 0) + hub
        a2a = int(c["rb_flat"] > 0) + int(c["rb_hier"] > 0) + ubs
        launches = 3 * (a2a + int(c["dp"] > 0)) + 2 * ubs + 3 * hub
        hbm = self.hbm_own + self.hbm_all
        if hub:
            hbm = hbm + self.aggregator(HUB_HBM)
        lookup = hbm / cm.bw_hbm + launches * cm.k.kernel_launch_seconds
        if self.host_tables:
            # host-tier misses fetched and evicted rows written back, both directions at once
            lookup = lookup + self.host_link / cm.bw_host
        lk = self.links()
        # the keys travel during the previous step's dense compute (the trainer's prefetch):
        # only what outlasts that window delays the step
        keys = self.key_seconds(lk)
        distributor = cm.keys_beyond_window(keys) + (a2a + hub) * cm.collective_latency
        (rs_i, rr_i), (rs_n, rr_n) = lk["res_intra"], lk["res_inter"]
        # hierarchical rb's reduce inside the node is a step of its own on several nodes;
        # on one node the trainer runs it flat (embark_runtime.clusters)
        rb_hier = int(c["rb_hier"] > 0 and cm.nodes > 1)
        res_lat = (2 * a2a + 2 * rb_hier + 2 * hub) * cm.collective_latency
        nvlink = 2.0 * np.maximum(rs_i, rr_i) / cm.bw_intra
        network = 2.0 * np.maximum(rs_n, rr_n) / cm.bw_inter
        if cm.nodes > 1:
            network = network + res_lat
        else:
            nvlink = nvlink + res_lat
        dp = np.full(W, self.dp_time + (cm.collective_latency if c["dp"] > 0 and W > 1 else 0.0))
        out = {
            "lookup": lookup,
            "distributor": distributor,
            "nvlink": nvlink,
            "network": network,
            "dp_exchange": dp,
        }
        return {k: np.maximum(v, 0.0) for k, v in out.items()}

    def key_seconds(self, lk: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
        """Seconds per rank of the key all-to-all, NVLink and network, before the dense
        compute window hides any of it (of the links `lk`, `links()` when None)."""
        lk = self.links() if lk is None else lk
        (ds_i, dr_i), (ds_n, dr_n) = lk["dist_intra"], lk["dist_inter"]
        return coll.alltoall_seconds(ds_i, dr_i, ds_n, dr_n, self.cm.bw_intra, self.cm.bw_inter)

    def times(self) -> np.ndarray:
        comp = self.components()
        return sum(comp.values(), np.zeros(self.cm.W))  # type: ignore[no-any-return]

    def step_time(self) -> float:
        return float(self.times().max())

    def critical_path(self, comp: dict[str, np.ndarray] | None = None) -> float:
        """The step time if every phase waited for its slowest rank (`PHASE_GROUPS`), of
        `comp` (`components()` when None)."""
        comp = self.components() if comp is None else comp
        return float(sum(t.max() for t in phase_times(comp)))

    def memory(self) -> np.ndarray:
        """Weights + optimizer state + buffers per rank."""
        out = (
            self.weights
            + self.state_b
            + self.buf
            + (self.all_weights + self.all_state + self.all_buf)
        )
        if self.counts["ub_hier"]:
            out = out + self.aggregator(HUB_BUFFERS)
        return out

    def estimate(self, layout: Layout) -> dict[str, Any]:
        """The plan's `estimate` field (unrounded)."""
        cm = self.cm
        comp = self.components()
        times = sum(comp.values(), np.zeros(cm.W))
        crit = int(np.argmax(times))
        agg_buf = self.aggregator(HUB_BUFFERS) if self.counts["ub_hier"] else np.zeros(cm.W)
        per_rank = []
        for r in range(cm.W):
            w = float(self.weights[r] + self.all_weights)
            s = float(self.state_b[r] + self.all_state)
            bu = float(self.buf[r] + self.all_buf + agg_buf[r])
            per_rank.append(
                {
                    "rank": r,
                    "memory_bytes": int(round(w + s)),
                    "time": float(times[r]),
                    "components": {k: float(v[r]) for k, v in comp.items()},
                    "memory": {
                        "weights": int(round(w)),
                        "optimizer_state": int(round(s)),
                        "buffers": int(round(bu)),
                    },
                }
            )
        out: dict[str, Any] = {
            "step_time": float(times[crit]),
            "critical_rank": crit,
            "critical_path": self.critical_path(comp),
            "components": {k: float(v[crit]) for k, v in comp.items()},
            "per_rank": per_rank,
            "per_table": per_table(cm, layout),
            "dense_allreduce_time": cm.dense_allreduce_time(),
            "key_window": cm.key_window,
        }
        if self.host_tables:
            for r, row in enumerate(per_rank):
                row["host_memory_bytes"] = int(round(float(self.host_mem[r])))
            out["host_tier"] = host_tier_summary(cm, layout, self.host_mem)
        return out


def phase_times(comp: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Seconds per rank of each of PHASE_GROUPS, from the components `comp` (new arrays,
    summed in the group's order)."""
    out = []
    for g in PHASE_GROUPS:
        t = comp[g[0]].copy()
        for c in g[1:]:
            t += comp[c]
        out.append(t)
    return out


def critical_path_of(per_rank: list[dict[str, float]]) -> float:
    """`RankState.critical_path` of per-rank component seconds (a plan's
    `per_rank[].components`, the simulator's counts; a component absent is 0)."""
    return sum(max(sum(r.get(c, 0.0) for c in g) for r in per_rank) for g in PHASE_GROUPS)


def owner_seconds(cm: CostModel, cv: CellValues, hierarchical: bool = False) -> np.ndarray:
    """Seconds each cell puts on its owner (HBM work, receiving ids, sending results).

    With `hierarchical` (rb only, several nodes) the owner sends its partials over NVLink
    to the rail peers of its node, and each rank of the node sends its rail's share over
    its own NIC: the owner keeps the NVLink part and one rank's share of the network part.
    Hierarchical ub cells (`CellValues.node_dedup`) talk to their node's requesters and to
    one aggregator per other node; what they put on each aggregator is
    `aggregator_seconds`.

    A cell's keys count only beyond the dense compute window (`CostModel.key_window`), as
    if they were the only keys of its owner (the rank's keys share the window:
    `RankState.components`).
    """
    hier = hierarchical and cm.nodes > 1
    got = cv.owner.get(hier)
    if got is None:
        got = cv.owner[hier] = _owner_seconds(cm, cv, hier)
    return got


def aggregator_seconds(cm: CostModel, cv: CellValues) -> np.ndarray:
    """Seconds a hierarchical ub cell puts on each of its aggregators besides their
    network side (which is the owner's): HBM work and the vectors and gradients they
    exchange with their node over NVLink. Their NVLink keys are apart (they hide under the
    dense compute window with the rest of the rank's keys)."""
    assert cv.agg_hbm is not None
    return cv.agg_hbm / cm.bw_hbm + 2.0 * (cm.G - 1) * cv.res / cm.bw_intra


def _owner_seconds(cm: CostModel, cv: CellValues, hierarchical: bool) -> np.ndarray:
    W, G, N = cm.W, cm.G, cm.nodes
    if cv.node_dedup:
        # keys from its node's requesters and one union per other node; results likewise
        assert cv.dist_node is not None and cv.res_node is not None
        links = (G - 1) * cv.dist / cm.bw_intra + (N - 1) * cv.dist_node / cm.bw_inter
        res = (G - 1) * cv.res / cm.bw_intra + (N - 1) * cv.res_node / cm.bw_inter
        return cv.hbm_own / cm.bw_hbm + cm.keys_beyond_window(links) + 2.0 * res
    key_links = (G - 1) * cv.dist / cm.bw_intra + (W - G) * cv.dist / cm.bw_inter
    key_links = cm.keys_beyond_window(key_links)
    keys = cv.hbm_own / cm.bw_hbm + key_links
    if hierarchical:
        return keys + 2.0 * (N * (G - 1) * cv.res / cm.bw_intra + (N - 1) * cv.res / cm.bw_inter)
    return keys + 2.0 * ((G - 1) * cv.res / cm.bw_intra + (W - G) * cv.res / cm.bw_inter)


def per_table(cm: CostModel, layout: Layout) -> list[dict[str, Any]]:
    """Per table: cluster kind, the seconds it puts on its busiest rank, memory, ranks."""
    out = []
    for name in sorted(layout, key=lambda n: cm.facts[n].index):
        p = layout[name]
        tf = cm.facts[name]
        if p.kind == "dp":
            dv = cm.dp_values(tf, p.exchange)
            out.append(
                {
                    "table": name,
                    "cluster": "dp",
                    "time": dv.hbm / cm.bw_hbm + dv.exchange_time,
                    "memory_bytes": int(round(dv.weights + dv.state)),
                    "ranks": cm.W,
                }
            )
            continue
        cv = cm.placement_values(tf, p)
        ranks = np.asarray(p.rank_list(), dtype=np.int64)
        load = np.zeros(cm.W)
        np.add.at(load, ranks, owner_seconds(cm, cv))
        out.append(
            {
                "table": name,
                "cluster": p.kind,
                "time": float(load.max() + cv.hbm_all / cm.bw_hbm),
                "memory_bytes": int(round(float(cv.weights.sum() + cv.state.sum()))),
                "ranks": len(set(ranks.tolist())),
            }
        )
    return out


def host_tier_summary(cm: CostModel, layout: Layout, host_mem: np.ndarray) -> dict[str, Any]:
    """The estimate's `host_tier`: per table with host-tier cells, its rows, its cells in
    host memory, their rows and cached rows summed over the cells (a row of two column
    cells counts twice), the bytes in HBM and in host memory, the
    expected distinct rows read and missed per step, the hit rate and the host link's
    bytes per step; and the totals, per node from `host_mem` (the layout's
    `RankState.host_mem`) (docs/host_tier.md)."""
    tables = []
    for name in sorted(layout, key=lambda n: cm.facts[n].index):
        p = layout[name]
        if p.kind == "dp":
            continue
        cv = cm.placement_values(cm.facts[name], p)
        if cv.cache is None or cv.misses is None or cv.lookups is None:
            continue
        assert cv.host is not None and cv.host_memory is not None
        on = cv.cache >= 0
        rows = shard_rows(cm.facts[name].rows, p.row_shards, cm.partition)[cv.j]
        lookups = float(cv.lookups[on].sum())
        misses = float(cv.misses[on].sum())
        tables.append(
            {
                "table": name,
                "table_rows": cm.facts[name].rows,
                "cells": int(on.sum()),
                "hbm_cells": int((~on).sum()),
                "rows": int(rows[on].sum()),
                "cache_rows": int(cv.cache[on].sum()),
                "hbm_bytes": int(round(float((cv.weights + cv.state)[on].sum()))),
                "host_bytes": int(round(float(cv.host_memory.sum()))),
                "lookups": lookups,
                "misses": misses,
                "hit_rate": 1.0 - misses / lookups if lookups > 0 else 1.0,
                "host_link_bytes": float(cv.host.sum()),
            }
        )
    node = np.zeros(cm.nodes)
    np.add.at(node, cm.node_of, host_mem)
    return {
        "cells": sum(t["cells"] for t in tables),
        "host_bytes": sum(t["host_bytes"] for t in tables),
        "node_host_bytes": [int(round(float(x))) for x in node],
        "tables": tables,
    }


def layout_of_plan(plan: Plan) -> Layout:
    """The Layout of a plan's clusters and shards (any valid plan, hand-written included)."""
    layout: Layout = {}
    by_table: dict[str, list[Any]] = {}
    for s in plan.shards:
        by_table.setdefault(s.table, []).append(s)
    for c in plan.clusters:
        for name in c.tables:
            if c.kind == "dp":
                layout[name] = Placement(kind="dp", exchange=c.gradient_exchange or "dense")
                continue
            cells = sorted(by_table.get(name, []), key=lambda s: (s.row_shard, s.columns[0]))
            r = cells[0].row_shards
            cache = tuple((s.cache_rows or 0) if s.on_host else -1 for s in cells)
            layout[name] = Placement(
                kind=c.kind,
                row_shards=r,
                communication=c.communication or "flat",
                cells_explicit=tuple(
                    (s.row_shard, s.columns[0], s.columns[1], s.rank) for s in cells
                ),
                cache=cache if max(cache) >= 0 else None,
            )
    return layout
