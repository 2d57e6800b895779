"""Exact per-rank traffic and work of a plan, counted from sampled batches.

`simulate(plan, batches, seed)` draws real batches from `embark_runtime.synthetic` (the
generator the trainer uses), counts for every rank and step the ids it looks up, the
distinct rows it updates, its HBM bytes and the bytes it sends and receives per cluster
and component, exactly as docs/communication.md defines them, and turns the counts into a
step time with `step_time_of` (the one conversion, below). `count_bytes(plan, batches)`
returns the bytes per cluster for given per-rank batches, the figure the runtime's
collectives must reproduce byte for byte.

WHAT IS COUNTED (docs/communication.md is the definition of the bytes on the wire)
==========================================================================
Wire bytes, at the sender, for messages between different ranks; intra-node when both
ranks are on one node. Each message belongs to a phase (`PHASES`): `distributor` (keys,
bag lengths, per-id weights), `forward` (rb partials, ub vectors), `backward` (their
gradients), `dp_exchange` (dp sparse rail all-gather), `ring` (dp dense hierarchical
all-reduce) and `dense` (the dense model's hierarchical all-reduce, cluster `dense`).
Hierarchical ub (a ub cluster with `communication` "hierarchical", on several nodes)
routes every other node's keys, vectors and gradients through the owner's rail peer on
that node, the aggregator, which deduplicates the node's ids: their bytes stay in the
phases of flat ub (keys `distributor`, vectors `forward`, gradients `backward`).
One detail the page leaves open: in hierarchical rb the rail peer of node n sends, per
(sample, feature), one summed vector covering the union of the column ranges of the
table's cells on node n.

HBM bytes of a rank (the `lookup` component) follow the physical model of the planner's
cost model (embarkc/planner/cost.py: forward lookups with key reads, pooled outputs,
backward gradient reads and scatters, the update of every touched row, weights and state
read and written, the requesters' summing and pooling), applied to COUNTED quantities
instead of expectations: the ids of each row shard over the global batch, the distinct
ids per requester and row shard, the distinct rows updated. With n ids served by a cell
of width w, B*F outputs, D distinct rows, K = 8 key bytes, A = max(w * elem, 64) bytes
per row read, G = max(4w, 64) per gradient access, T = 2 * (weights + state of a row):

    rb owner     n (K + A) + 2 B F 4w + n (G + 2K) + D T;   every rank  b F 4w per cell
    ub owner     U (K + A + 4w) + U (4w + K) + D T + 2 U K   (U = sum over requesters;
                 hierarchical: U_a,o of the requesters on the owner's node plus the
                 union U_n,o of every other node n)
    ub requester n_a,j (4K + 2G) + 2 U_a,j 4w per cell, + 2 b F 4 dim per table
                 (the same in hierarchical ub)
    aggregator   R (4K + 4 * 4w) per hierarchical ub cell of another node's owner,
                 R = sum of U_a,o over the ranks a of its node, its own included (dedup
                 of the keys received, forward gather and copy, backward read and add)
    dp           n_a (K + A) + 2 b F 4 dim + n_a G, and dense: 2 S + rows (T + 4 dim);
                 sparse: (all ranks' messages) + D T + 2 n_a K

The ids a rank "looks up" are the n (rb) or U (ub) it serves and its local dp ids; its
distinct rows are the D of its cells (every row of a dense-exchange dp table).

HOST-TIER CELLS (docs/host_tier.md, "Simulate"): each host-tier cell's cache is replayed
from cold over the consecutive sampled steps with the runtime's policy
(`embarkc.cache_replay`), fed the distinct local rows its owner admits. Its host link
carries, per step, `in` = fetches x P + host_reads x (P + row weights) and `out` =
write-backs x P + host_reads x P (P = a row's weights and optimizer state at the cell's
width); the busier direction over the topology's `host_bandwidth` adds to the owner's
lookup, and in + out to its HBM bytes, as the cost model charges its expected misses.

THE CONVERSION TO TIME (`step_time_of`)
======================================
Links are full duplex with the topology's per-direction bandwidth, and the phases of a
step run one after the other, so a rank's time in a phase on a link is
max(bytes sent, bytes received) / (bandwidth * efficiency). Per rank, with `a2a` the
number of rb/ub clusters (one all-to-all each), `hier` the hierarchical rb ones, `hub`
the hierarchical ub ones on more than one node (0 on one node; `hierarchical_ub_clusters`)
and `call` = COLLECTIVE_LATENCY (+ INTER_NODE_LATENCY on more than one node):

    lookup       hbm_bytes / (hbm_bandwidth * HBM_EFFICIENCY)
                 + (3 * (a2a + [any dp]) + 2 * [ub clusters] + 3 * hub)
                   * KERNEL_LAUNCH_SECONDS
                 + max(host in, host out) / host_bandwidth   (host-tier cells)
    distributor  max(0, t_intra + t_inter of the key phase - window) + (a2a + hub) * call
    nvlink       t_intra of the forward phase + t_intra of the backward phase
    network      t_inter of the forward phase + t_inter of the backward phase
                 + (2 * a2a + 2 * hier + 2 * hub) * call on the network (on nvlink with
                 one node)
    dp_exchange  ring time (the dense all-reduce on the slowest rank's links, the same
                 for every rank) + t_intra + t_inter of the sparse all-gather
                 + call if any dp table

(no latencies on a single rank). `window` is the dense compute during which the trainer
sends the next batch's keys (`key_window`, dense.prefetch_window): key traffic beyond it
delays the step, traffic within it is hidden. A rank's time is the sum of its
components; the step time is the largest rank's time (collectives wait for the slowest
rank). The dense model's all-reduce is the same for every plan and is reported apart
(`dense_allreduce_time`), as the planner's estimate does. Wire sizes are those of
embarkc/planner/constants.py; efficiencies, latencies and the smallest read are its
defaults unless the plan's `topology.constants` (the spec's hardware block) sets them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from embark_runtime.cache_stats import CacheStats
from embark_runtime.dtypes import DTYPE_BYTES
from embark_runtime.formatting import format_bytes
from embark_runtime.keys import local_row, row_shard_of
from embark_runtime.plan import Plan, PlanTable
from embark_runtime.synthetic import Bag, Batch, SyntheticData
from embarkc.cache_replay import LruReplay
from embarkc.dense import DenseShape, prefetch_window
from embarkc.planner import constants as K

COMPONENTS = ("lookup", "distributor", "nvlink", "network", "dp_exchange")
"""Components of a rank's step time, as in the plan's estimate."""
PHASES = ("distributor", "forward", "backward", "dp_exchange", "ring", "dense")
"""Communication phases of a step, each timed on its own: the key all-to-all, the forward
results, the backward gradients, the dp sparse rail all-gather, the dp dense hierarchical
all-reduce and the dense model's hierarchical all-reduce."""
LINKS = ("intra", "inter")
DENSE_CLUSTER = "dense"

MAX_ALLREDUCE_ELEMENTS = 1 << 40
"""The most fp32 values an all-reduce of one step may carry (the dense model's gradients,
a dense-exchange dp table's): 4 TiB, more than any GPU holds a copy of. The counts of its
messages, summed over the ranks, stay exact in 64-bit integers."""

SAMPLED_BYTES_PER_ID = 32
"""Peak memory per id of one table's sampled batch while it is counted (the ids, their
bags' offsets, row shards and the deduplication's temporaries): 33.5 M ids of variable
bags took 1.03 GiB of RSS."""


# --------------------------------------------------------------------------- results


@dataclass
class RankCounts:
    """Counts of one rank, averaged over the simulated steps."""

    rank: int
    ids: float = 0.0
    """Ids looked up on the rank (served lookups, see the module docstring)."""
    distinct: float = 0.0
    """Distinct rows updated on the rank."""
    hbm_bytes: float = 0.0
    sent: dict[str, dict[str, float]] = field(default_factory=dict)
    """phase (see PHASES) -> {"intra", "inter"} bytes sent."""
    received: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_bytes: int = 0
    components: dict[str, float] = field(default_factory=dict)
    """Seconds per component (`step_time_of`)."""
    host_in: float = 0.0
    """Host tier: bytes over the rank's host link into HBM (fetches, rows read from host)."""
    host_out: float = 0.0
    """Host tier: bytes over the rank's host link back to host (write-backs, updates of
    rows read from host)."""

    @property
    def time(self) -> float:
        return sum(self.components.values())


@dataclass
class SimResult:
    """What `simulate` counted: per rank, per cluster, and the step time."""

    batches: int
    seed: int
    per_rank: list[RankCounts]
    clusters: dict[str, dict[str, float]]
    """cluster name (and `dense`) -> {"intra", "inter"} bytes per step (mean over steps)."""
    step_time: float
    critical_rank: int
    step_times: list[float]
    """Step time of every simulated batch on its own."""
    components: dict[str, float]
    """Components of the critical rank, seconds."""
    dense_allreduce_time: float = 0.0
    """The dense model's gradient all-reduce (the same for every plan; not in step_time)."""
    host_tier: dict[str, CacheStats] = field(default_factory=dict)
    """Host tier: per table with host-tier cells, its caches' counters summed over its
    host-tier cells and over the steps, from cold caches (`embarkc.cache_replay`)."""

    @property
    def critical_path(self) -> float:
        """The step time if every phase waited for its slowest rank (the planner's
        `RankState.critical_path`, of the counted components)."""
        from embarkc.planner.cost import critical_path_of

        return critical_path_of([rc.components for rc in self.per_rank])


# --------------------------------------------------------------------------- counting


@dataclass
class _TableStats:
    """Per-step counts of one table. Arrays are indexed [requester rank a, row shard j]."""

    n: np.ndarray  # id occurrences
    nw: np.ndarray  # id occurrences of weighted features
    uniq: np.ndarray | None  # distinct ids per (a, j); None when not needed
    distinct_shard: np.ndarray  # [R] distinct ids over the global batch
    per_rank_uniq: np.ndarray | None  # [W] distinct ids of each rank (all row shards)
    node_uniq: np.ndarray | None = None  # [N, R] distinct ids of each node's samples


class _Flows:
    """Messages collected as (cluster, group, src, dst, bytes) arrays; self-messages dropped."""

    def __init__(self, world: int, gpus_per_node: int):
        self.world = world
        self.g = gpus_per_node
        self.parts: list[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, cluster: str, group: str, src, dst, nbytes) -> None:
        src, dst, nbytes = np.broadcast_arrays(
            np.asarray(src, dtype=np.int64),
            np.asarray(dst, dtype=np.int64),
            np.asarray(nbytes, dtype=np.int64),
        )
        keep = (src != dst) & (nbytes != 0)
        if np.any(keep):
            self.parts.append((cluster, group, src[keep], dst[keep], nbytes[keep]))

    def totals(self, clusters: Sequence[str]):
        """(per-cluster {"intra","inter"}, sent[group][link] per rank, received likewise)."""
        w = self.world
        per_cluster = {c: {"intra": 0, "inter": 0} for c in clusters}
        sent = {gr: {lk: np.zeros(w, np.int64) for lk in LINKS} for gr in PHASES}
        recv = {gr: {lk: np.zeros(w, np.int64) for lk in LINKS} for gr in PHASES}
        for cluster, group, src, dst, nb in self.parts:
            intra = (src // self.g) == (dst // self.g)
            for link, m in (("intra", intra), ("inter", ~intra)):
                if not np.any(m):
                    continue
                per_cluster.setdefault(cluster, {"intra": 0, "inter": 0})
                per_cluster[cluster][link] += int(nb[m].sum())
                sent[group][link] += np.bincount(src[m], weights=nb[m], minlength=w).astype(
                    np.int64
                )
                recv[group][link] += np.bincount(dst[m], weights=nb[m], minlength=w).astype(
                    np.int64
                )
        return per_cluster, sent, recv


def _table_stats(
    plan: Plan,
    table: PlanTable,
    row_shards: int,
    features: list[tuple[int, bool]],
    source: _Source,
    world: int,
    need_ids: bool,
    need_uniq: bool,
    need_rank_uniq: bool,
    node_gpus: int = 0,
) -> _TableStats:
    """Counts of one table over the global batch of its `features` (index, weighted).

    Without `need_ids` only bag lengths are read (a dp table with a dense exchange needs
    no more), which spares drawing its ids. With `need_uniq` and `node_gpus` = G > 0
    the distinct ids per (node of G ranks, row shard) are counted too (hierarchical ub).
    """
    b = plan.batch_size // world
    rows = table.rows
    r = row_shards
    n = np.zeros((world, r), np.int64)
    nw = np.zeros((world, r), np.int64)
    ranked: list[np.ndarray] = []
    seen = np.zeros(rows, dtype=bool) if need_ids and rows <= (1 << 27) else None
    present_parts: list[np.ndarray] = []
    for i, weighted in features:
        if not need_ids:
            per_rank = source.lengths(i).reshape(world, b).sum(axis=1)
            n[:, 0] += per_rank
            if weighted:
                nw[:, 0] += per_rank
            continue
        bag = source.bag(i)
        per_rank = np.diff(bag.offsets[::b])
        if r > 1 or need_uniq or need_rank_uniq:
            rank_of = np.repeat(np.arange(world, dtype=np.int64), per_rank)
        if r > 1:
            j = row_shard_of(bag.ids, rows, r, plan.row_partition)
            counts = np.bincount(rank_of * r + j, minlength=world * r).reshape(world, r)
        else:
            counts = per_rank.reshape(world, 1)
        n += counts
        if weighted:
            nw += counts
        if need_uniq or need_rank_uniq:
            ranked.append(rank_of * rows + bag.ids)
        if seen is not None:
            # a presence mask is linear time; a sort is n log n on millions of ids
            seen[bag.ids] = True
        else:
            present_parts.append(np.unique(bag.ids))
    distinct_shard = np.zeros(r, np.int64)
    if need_ids:
        if seen is not None:
            present = np.flatnonzero(seen)
        elif present_parts:
            present = np.unique(np.concatenate(present_parts))
        else:
            present = np.zeros(0, np.int64)
        if r > 1:
            distinct_shard = np.bincount(
                row_shard_of(present, rows, r, plan.row_partition), minlength=r
            )
        else:
            distinct_shard[0] = len(present)
    uniq = per_rank_uniq = node_uniq = None
    if ranked:
        pairs = np.unique(np.concatenate(ranked))
        a = pairs // rows
        if need_uniq:
            k = pairs - a * rows
            js = row_shard_of(k, rows, r, plan.row_partition) if r > 1 else 0
            uniq = np.bincount(a * r + js, minlength=world * r).reshape(world, r)
            if node_gpus:
                nodes = world // node_gpus
                node_pairs = np.unique((a // node_gpus) * rows + k)
                m = node_pairs // rows
                kn = node_pairs - m * rows
                jn = row_shard_of(kn, rows, r, plan.row_partition) if r > 1 else 0
                node_uniq = np.bincount(m * r + jn, minlength=nodes * r).reshape(nodes, r)
        if need_rank_uniq:
            per_rank_uniq = np.bincount(a, minlength=world)
    return _TableStats(n, nw, uniq, distinct_shard, per_rank_uniq, node_uniq)


class _Source:
    """Where one step's global bags come from: synthetic data or given per-rank batches."""

    def bag(self, feature_index: int) -> Bag:
        raise NotImplementedError

    def lengths(self, feature_index: int) -> np.ndarray:
        return np.diff(self.bag(feature_index).offsets)


class _SyntheticSource(_Source):
    def __init__(self, data: SyntheticData, step: int):
        self.data, self.step = data, step

    def bag(self, feature_index: int) -> Bag:
        return self.data.bag(self.step, feature_index, 0, self.data.batch_size)

    def lengths(self, feature_index: int) -> np.ndarray:
        return self.data.lengths(self.step, feature_index, 0, self.data.batch_size)


def _results_count(plan: Plan, table: str) -> tuple[int, int]:
    """(F_t: result vectors per sample, features reading the table)."""
    f_t = nfeat = 0
    for f in plan.features:
        if f.table == table:
            nfeat += 1
            f_t += max(1, int(round(f.hotness))) if f.pooling == "concat" else 1
    return f_t, nfeat


def dense_shape(plan: Plan) -> DenseShape | None:
    """The dense model of `plan.model` (runtime/dense.py's architecture); None when the
    plan carries no `model`."""
    model = (plan.model_extra or {}).get("model")
    if not model:
        return None
    widths = [
        plan.table(f.table).dim * (max(1, int(round(f.hotness))) if f.pooling == "concat" else 1)
        for f in plan.features
    ]
    return DenseShape.of(model, widths)


def dense_parameters(plan: Plan) -> int:
    """Parameters of the plan's dense model; 0 when the plan carries no `model` (then
    nothing is all-reduced for it)."""
    shape = dense_shape(plan)
    return shape.parameters() if shape is not None else 0


def key_window(plan: Plan) -> float:
    """Seconds of dense compute that hide the next batch's key traffic
    (`dense.prefetch_window`); 0 without a model or a dense rate."""
    shape = dense_shape(plan)
    if shape is None:
        return 0.0
    topo = plan.topology
    return prefetch_window(
        shape, plan.batch_size / plan.world_size, topo.dense_flops, K.of(topo).dense_efficiency
    )


def _chunks(elements, parts: int, index):
    """Size of chunk `index` of numpy's array_split of `elements` into `parts`."""
    q, r = np.divmod(elements, parts)
    return q + (index < r)


def hierarchical_allreduce_flows(
    elements: int, world: int, g: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) of the hierarchical all-reduce of `elements` fp32 values on
    `world` ranks of `g` per node (docs/communication.md, dp `dense` and the dense model):
    chunk i (of G, array_split) of every rank to local index i of its node; the ring of
    chunk i over the nodes on rail i (every part but (n+1) % N, then every part but
    (n+2) % N, to the successor node); reduced chunk i to the other ranks of the node."""
    ranks = np.arange(world, dtype=np.int64)
    nodes = world // g
    node, local = ranks // g, ranks % g
    peers = np.arange(g, dtype=np.int64)
    src = [np.repeat(ranks, g)] * 2
    dst = [np.repeat(node * g, g) + np.tile(peers, world)] * 2
    vec = K.WIRE_ELEMENT_BYTES
    nbytes = [
        vec * _chunks(elements, g, np.tile(peers, world)),  # 1. reduce-scatter in the node
        vec * _chunks(elements, g, np.repeat(local, g)),  # 3. all-gather in the node
    ]
    if nodes > 1:  # 2. ring all-reduce across nodes on each rail
        mine = _chunks(elements, g, local)
        skip = _chunks(mine, nodes, (node + 1) % nodes) + _chunks(mine, nodes, (node + 2) % nodes)
        src.append(ranks)
        dst.append(((node + 1) % nodes) * g + local)
        nbytes.append(vec * (2 * mine - skip))
    return np.concatenate(src), np.concatenate(dst), np.concatenate(nbytes)


def rail_allgather_flows(message: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) of the rail all-gather of `message[a]` bytes from every rank a
    (docs/communication.md, dp `sparse`): to the rail peers on the other nodes, then
    everything the rank holds (its rail's messages) to the other ranks of its node."""
    message = np.asarray(message, dtype=np.int64)
    world = len(message)
    ranks = np.arange(world, dtype=np.int64)
    nodes = world // g
    node, local = ranks // g, ranks % g
    rail_total = np.bincount(local, weights=message, minlength=g).astype(np.int64)
    across = np.repeat(ranks, nodes), np.tile(np.arange(nodes) * g, world) + np.repeat(local, nodes)
    inside = np.repeat(ranks, g), np.repeat(node * g, g) + np.tile(np.arange(g), world)
    return (
        np.concatenate([across[0], inside[0]]),
        np.concatenate([across[1], inside[1]]),
        np.concatenate([message[across[0]], rail_total[local[inside[0]]]]),
    )


@dataclass
class _Acc:
    """One step's flows and per-rank ids, distinct rows and HBM bytes, being summed."""

    flows: _Flows
    ids: np.ndarray
    distinct: np.ndarray
    hbm: np.ndarray
    host_in: np.ndarray = field(default_factory=lambda: np.zeros(0))
    host_out: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cache: dict[str, CacheStats] = field(default_factory=dict)
    """per table with host-tier cells: this step's counters, summed over those cells"""
    replayed: dict[tuple, CacheStats] = field(default_factory=dict)
    """this step's counters of each replayed cache (cells of one row shard and cache size
    see the same rows: one replay serves them all)"""


class _StepCounter:
    """Counts one step of a plan from its features' global bags."""

    def __init__(self, plan: Plan):
        self.plan = plan
        topo = plan.topology
        self.world = topo.world_size
        self.g = topo.gpus_per_node
        if plan.batch_size % self.world:
            raise ValueError(
                f"the global batch {plan.batch_size} does not split evenly over {self.world} ranks"
            )
        self.b = plan.batch_size // self.world
        self.cluster_of = {name: c for c in plan.clusters for name in c.tables}
        self.features_of: dict[str, list[int]] = {t.name: [] for t in plan.tables}
        for i, f in enumerate(plan.features):
            self.features_of[f.table].append(i)
        self.cells: dict[str, list] = {t.name: [] for t in plan.tables}
        for s in plan.shards:
            self.cells[s.table].append(s)
        self.replays: dict[tuple, LruReplay] = {}
        """the caches of the host-tier cells, from cold, kept across steps"""

    def count(self, source: _Source) -> tuple[_Flows, np.ndarray, np.ndarray, np.ndarray]:
        """Flows, and per-rank ids looked up, distinct rows updated and HBM bytes."""
        acc = self.start()
        for t in self.plan.tables:
            self.count_table(acc, t, source)
        acc = self.finish(acc)
        return acc.flows, acc.ids, acc.distinct, acc.hbm

    def start(self) -> _Acc:
        w_ = self.world
        z = np.zeros
        return _Acc(_Flows(w_, self.g), z(w_), z(w_), z(w_), z(w_), z(w_))

    def finish(self, acc: _Acc) -> _Acc:
        """Add the dense model's all-reduce: the step's flows and per-rank counts."""
        w_ = self.world
        params = dense_parameters(self.plan)
        if params and w_ > 1:
            acc.flows.add(DENSE_CLUSTER, "dense", *hierarchical_allreduce_flows(params, w_, self.g))
        return acc

    def count_table(self, acc: _Acc, t: PlanTable, source: _Source) -> None:
        """Add one table's traffic and work to `acc`."""
        plan, w_, g, b = self.plan, self.world, self.g, self.b
        flows, ids, distinct, hbm = acc.flows, acc.ids, acc.distinct, acc.hbm
        ranks = np.arange(w_, dtype=np.int64)
        node = ranks // g
        key = K.KEY_BYTES
        floor = K.of(plan.topology).small_vector_bytes
        cluster = self.cluster_of[t.name]
        fidx = self.features_of[t.name]
        f_t, nfeat = _results_count(plan, t.name)
        cells = self.cells[t.name]
        r = cells[0].row_shards if cells else 1
        kind = cluster.kind
        exchange = cluster.gradient_exchange or "dense"
        # hierarchical ub on one node is flat ub
        node_dedup = (
            kind == "ub" and cluster.communication == "hierarchical" and plan.topology.nodes > 1
        )
        stats = _table_stats(
            plan,
            t,
            r,
            [(i, plan.features[i].weighted) for i in fidx],
            source,
            w_,
            need_ids=kind != "dp" or exchange == "sparse",
            need_uniq=kind == "ub",
            need_rank_uniq=kind == "ub" or (kind == "dp" and exchange == "sparse"),
            node_gpus=g if node_dedup else 0,
        )
        local_n = stats.n.sum(axis=1)
        if kind == "dp":
            vec = 4 * t.dim
            touched = _touched_row_bytes(t, t.dim)
            local = local_n * (key + _row_access(t, t.dim, floor)) + 2 * b * f_t * vec
            local = local + local_n * _grad_access(t.dim, floor)
            ids += local_n
            if exchange == "dense":
                size = t.rows * vec
                distinct += t.rows
                # scatter into a zeroed dense gradient, then update every row
                hbm += local + 2 * size + t.rows * (touched + vec)
                if w_ > 1:
                    flows.add(
                        cluster.name, "ring", *hierarchical_allreduce_flows(t.rows * t.dim, w_, g)
                    )
            else:
                assert stats.per_rank_uniq is not None
                d_rows = int(stats.distinct_shard.sum())
                msg = stats.per_rank_uniq * (key + vec)
                distinct += d_rows
                hbm += local + msg.sum() + d_rows * touched + local_n * 2 * key
                flows.add(cluster.name, "dp_exchange", *rail_allgather_flows(msg, g))
            return
        owners = {j: sorted({s.rank for s in cells if s.row_shard == j}) for j in range(r)}
        # distributor: once per distinct owner rank of a row shard
        for j, os_ in owners.items():
            if kind == "rb":
                nb = (
                    key * stats.n[:, j]
                    + K.LENGTH_BYTES * b * nfeat
                    + K.WEIGHT_BYTES * stats.nw[:, j]
                )
                for o in os_:
                    flows.add(cluster.name, "distributor", ranks, o, nb)
            elif node_dedup:
                assert stats.uniq is not None and stats.node_uniq is not None
                for o in os_:
                    h = _NodeDedup(o, g, stats.uniq[:, j], stats.node_uniq[:, j])
                    flows.add(cluster.name, "distributor", h.near, o, key * h.u[h.near])
                    flows.add(cluster.name, "distributor", h.far, h.agg[h.far], key * h.u[h.far])
                    flows.add(cluster.name, "distributor", h.aggregators, o, key * h.un)
            else:
                assert stats.uniq is not None
                for o in os_:
                    flows.add(cluster.name, "distributor", ranks, o, key * stats.uniq[:, j])
        for s in cells:
            w, j, o = s.width, s.row_shard, s.rank
            vec = 4 * w
            touched = _touched_row_bytes(t, w)
            d_rows = int(stats.distinct_shard[j])
            if kind == "rb":
                n = int(stats.n[:, j].sum())
                outputs = plan.batch_size * f_t
                hbm[o] += n * (key + _row_access(t, w, floor)) + outputs * vec
                hbm[o] += outputs * vec + n * (_grad_access(w, floor) + 2 * key) + d_rows * touched
                hbm += b * f_t * vec  # every requester sums the partials it receives
                per_req = b * f_t * vec
                served = n
                if cluster.communication == "hierarchical":
                    same = node == node[o]
                    other = ranks[~same]
                    peer = node[o] * g + other % g
                    flows.add(cluster.name, "forward", o, ranks[same], per_req)
                    flows.add(cluster.name, "backward", ranks[same], o, per_req)
                    flows.add(cluster.name, "forward", o, peer, per_req)
                    flows.add(cluster.name, "backward", peer, o, per_req)
                else:
                    flows.add(cluster.name, "forward", o, ranks, per_req)
                    flows.add(cluster.name, "backward", ranks, o, per_req)
            else:
                assert stats.uniq is not None
                u = stats.uniq[:, j]
                if node_dedup:
                    assert stats.node_uniq is not None
                    h = _NodeDedup(o, g, u, stats.node_uniq[:, j])
                    served = int(u[h.near].sum() + h.un.sum())
                    # an aggregator: dedup of the keys it holds, forward gather and copy,
                    # backward read and add, per id it received (its own included)
                    hbm[h.aggregators] += h.received * (4 * key + 4 * vec)
                    for phase, src, dst, nb in (
                        ("forward", o, h.near, u[h.near] * vec),
                        ("forward", o, h.aggregators, h.un * vec),
                        ("forward", h.agg[h.far], h.far, u[h.far] * vec),
                    ):
                        flows.add(cluster.name, phase, src, dst, nb)
                        flows.add(cluster.name, "backward", dst, src, nb)
                else:
                    served = int(u.sum())
                    flows.add(cluster.name, "forward", o, ranks, u * vec)
                    flows.add(cluster.name, "backward", ranks, o, u * vec)
                hbm[o] += served * (key + _row_access(t, w, floor) + vec)
                hbm[o] += served * (vec + key) + d_rows * touched + served * 2 * key
                # requesters: dedup of their ids, pooling, backward scatter per id
                hbm += stats.n[:, j] * (4 * key + 2 * _grad_access(w, floor)) + u * vec * 2
            ids[o] += served
            distinct[o] += d_rows
        if kind == "ub":
            hbm += 2.0 * b * f_t * 4 * t.dim
        if any(s.on_host for s in cells):
            self.count_host_tier(acc, t, cells, source, node_dedup)
        if kind == "rb" and cluster.communication == "hierarchical":
            for n_ in sorted({int(node[s.rank]) for s in cells}):
                width = _union_width([s.columns for s in cells if node[s.rank] == n_])
                other = ranks[node != n_]
                peer = n_ * g + other % g
                nb = b * f_t * 4 * width
                flows.add(cluster.name, "forward", peer, other, nb)
                flows.add(cluster.name, "backward", other, peer, nb)

    def count_host_tier(
        self, acc: _Acc, t: PlanTable, cells: list, source: _Source, node_dedup: bool
    ) -> None:
        """Replay one step of the table's host-tier caches; add their counters, host link
        bytes and HBM bytes (docs/host_tier.md, "Simulate")."""
        plan, w_, g = self.plan, self.world, self.g
        r = cells[0].row_shards
        ids = [source.bag(i) for i in self.features_of[t.name]]
        keys = np.concatenate([bag.ids for bag in ids]) if ids else np.zeros(0, np.int64)
        keys = keys.astype(np.int64, copy=False)
        ub = self.cluster_of[t.name].kind == "ub"
        if ub:
            # an owner admits the union of its requests; a row's count is the requests
            # holding it: one per requester (hierarchical: per requester of the owner's
            # node and per other node, whose aggregator sent the node's union)
            b = self.b
            rank_of = np.concatenate(
                [np.repeat(np.arange(w_, dtype=np.int64), np.diff(bag.offsets[::b])) for bag in ids]
            ) if ids else np.zeros(0, np.int64)  # fmt: skip
            pairs = np.unique(rank_of * t.rows + keys)
            req, keys = pairs // t.rows, pairs % t.rows
        shard = row_shard_of(keys, t.rows, r, plan.row_partition) if r > 1 else None
        st = acc.cache.setdefault(t.name, CacheStats())
        row_bytes = {}
        for s in cells:
            if not s.on_host:
                continue
            j, cap = s.row_shard, s.cache_rows or 0
            group = -1
            if ub and node_dedup:
                group = s.rank // g
            key = (t.name, j, cap, group)
            step = acc.replayed.get(key)
            if step is None:
                mine = keys if shard is None else keys[shard == j]
                local = local_row(mine, t.rows, r, plan.row_partition)
                if ub:
                    rq = req if shard is None else req[shard == j]
                    if group >= 0:
                        node = rq // g
                        rq = np.where(node == group, rq, w_ + node)
                    local = np.unique(rq * t.rows + local) % t.rows
                rows, counts = np.unique(local, return_counts=True)
                replay = self.replays.setdefault(key, LruReplay(cap))
                step = acc.replayed[key] = replay.step(rows, counts)
            st.add(step)
            w = s.width
            if w not in row_bytes:
                row_bytes[w] = (t.bytes_for(1, w), w * DTYPE_BYTES[t.dtype])
            row, weights = row_bytes[w]
            # fetched rows and their state in; a row read from host: its weights for the
            # forward, then weights and state staged for its update and written back
            into = step.fetches * row + step.host_reads * (weights + row)
            out = step.writebacks * row + step.host_reads * row
            acc.host_in[s.rank] += into
            acc.host_out[s.rank] += out
            # every byte over the link is written into HBM or read out of it once
            acc.hbm[s.rank] += into + out


class _NodeDedup:
    """Hierarchical ub for one owner `o` of a row shard (docs/communication.md): who
    sends to whom, given the distinct ids `u[a]` of every rank and `un[n]` of every node
    in that row shard."""

    def __init__(self, o: int, g: int, u: np.ndarray, un: np.ndarray):
        ranks = np.arange(len(u), dtype=np.int64)
        node = ranks // g
        m = o // g
        self.u = u
        self.near = ranks[node == m]
        """Requesters on the owner's node, served as in flat ub."""
        self.far = ranks[node != m]
        """Requesters on the other nodes, served by their aggregator."""
        self.agg = node * g + o % g
        """The aggregator of every rank's node: the owner's rail peer there."""
        others = np.flatnonzero(np.arange(len(un)) != m)
        self.aggregators = others * g + o % g
        """The aggregators of the other nodes, in node order."""
        self.un = un[others]
        """The union of ids of each aggregator's node (keys it sends the owner)."""
        self.received = np.bincount(node, weights=u, minlength=len(un))[others].astype(np.int64)
        """R: the ids each aggregator holds before its dedup (its own included)."""


def _row_access(t: PlanTable, w: int, floor: float) -> float:
    """HBM bytes of reading one row of width w (a DRAM sector pair at least)."""
    return max(w * DTYPE_BYTES[t.dtype], floor)


def _grad_access(w: int, floor: float) -> float:
    """HBM bytes of reading or writing one fp32 gradient of width w."""
    return max(w * K.WIRE_ELEMENT_BYTES, floor)


def _touched_row_bytes(t: PlanTable, w: int) -> int:
    """The update of one row of width w: weights and optimizer state, read and written."""
    return 2 * t.bytes_for(1, w)


def _union_width(ranges: list[tuple[int, int]]) -> int:
    covered, end = 0, -1
    for lo, hi in sorted(ranges):
        lo = max(lo, end)
        if hi > lo:
            covered += hi - lo
            end = hi
    return covered


# --------------------------------------------------------------------------- time


def ring_seconds(plan: Plan, sent: dict[str, np.ndarray]) -> float:
    """Time of all-reduces whose per-rank bytes sent are `sent` {"intra", "inter"}.

    The phases of the hierarchical all-reduce move in lock step, so every rank waits for
    the rank whose links are busiest (its NVLink time plus its NIC time).
    """
    topo = plan.topology
    k = K.of(topo)
    intra_bw = topo.intra_node_bandwidth * k.nvlink_efficiency
    inter_bw = topo.inter_node_bandwidth * k.network_efficiency
    hops = sent["intra"] / intra_bw + sent["inter"] / inter_bw
    return float(hops.max()) if len(hops) else 0.0


def hierarchical_rb_clusters(plan: Plan) -> int:
    """`hier` of the conversion: the plan's hierarchical rb clusters, 0 on one node (where
    the trainer runs hierarchical rb flat: its reduce inside the node is no step of its
    own)."""
    if plan.topology.nodes == 1:
        return 0
    return sum(1 for c in plan.clusters if c.kind == "rb" and c.communication == "hierarchical")


def hierarchical_ub_clusters(plan: Plan) -> int:
    """`hub` of the conversion: the plan's hierarchical ub clusters, 0 on one node (where
    hierarchical ub is flat ub)."""
    if plan.topology.nodes == 1:
        return 0
    return sum(1 for c in plan.clusters if c.kind == "ub" and c.communication == "hierarchical")


def step_time_of(
    plan: Plan,
    hbm_bytes: float,
    sent: dict[str, dict[str, float]],
    received: dict[str, dict[str, float]],
    ring: float = 0.0,
    window: float | None = None,
    host_link: float = 0.0,
) -> dict[str, float]:
    """Seconds per component of one rank's step (the conversion of the module docstring).

    `sent` / `received`: phase (distributor | forward | backward | dp_exchange) ->
    {"intra", "inter"} bytes of this rank; `ring`: seconds of the dp tables' dense ring
    all-reduce (`ring_seconds`), the same on every rank; `window`: the dense compute
    that hides key traffic (`key_window(plan)` when None); `host_link`: the bytes of the
    busier direction of the rank's host link (host-tier caches), added to the lookup at
    the topology's `host_bandwidth`.
    """
    if window is None:
        window = key_window(plan)
    topo = plan.topology
    k = K.of(topo)
    many = topo.world_size > 1
    intra_bw = topo.intra_node_bandwidth * k.nvlink_efficiency
    inter_bw = topo.inter_node_bandwidth * k.network_efficiency

    def link(phase: str, lk: str) -> float:
        nbytes = max(sent.get(phase, {}).get(lk, 0.0), received.get(phase, {}).get(lk, 0.0))
        return nbytes / (intra_bw if lk == "intra" else inter_bw)

    a2a = sum(1 for c in plan.clusters if c.kind != "dp")
    hier = hierarchical_rb_clusters(plan)
    ub = sum(1 for c in plan.clusters if c.kind == "ub")
    hub = hierarchical_ub_clusters(plan)
    dp = int(any(c.kind == "dp" for c in plan.clusters))
    call = k.collective_latency_seconds + (k.inter_node_latency_seconds if topo.nodes > 1 else 0.0)
    results_latency = (2 * a2a + 2 * hier + 2 * hub) * call if many else 0.0
    return {
        "lookup": hbm_bytes / (topo.hbm_bandwidth * k.hbm_efficiency)
        + (3 * (a2a + dp) + 2 * ub + 3 * hub) * k.kernel_launch_seconds
        + (host_link / (topo.host_bandwidth or K.HOST_BANDWIDTH) if host_link else 0.0),
        "distributor": max(
            0.0, link("distributor", "intra") + link("distributor", "inter") - window
        )
        + ((a2a + hub) * call if many else 0.0),
        "nvlink": link("forward", "intra")
        + link("backward", "intra")
        + (results_latency if topo.nodes == 1 else 0.0),
        "network": link("forward", "inter")
        + link("backward", "inter")
        + (results_latency if topo.nodes > 1 else 0.0),
        "dp_exchange": ring
        + link("dp_exchange", "intra")
        + link("dp_exchange", "inter")
        + (dp * call if many else 0.0),
    }


# --------------------------------------------------------------------------- public API


class _BatchesSource(_Source):
    """The global bags of a step, from every rank's slice."""

    def __init__(self, plan: Plan, batch_by_rank: Sequence[Batch]):
        world = plan.world_size
        if len(batch_by_rank) != world:
            raise ValueError(
                f"expected {world} per-rank batches (one per rank), got {len(batch_by_rank)}"
            )
        self.names = [f.name for f in plan.features]
        self.batches = batch_by_rank
        self.b = plan.batch_size // world

    def bag(self, feature_index: int) -> Bag:
        name = self.names[feature_index]
        parts = [batch.sparse[name] for batch in self.batches]
        for a, p in enumerate(parts):
            if len(p.offsets) != self.b + 1:
                raise ValueError(
                    f"rank {a}'s bag of `{name}` has {len(p.offsets) - 1} samples, "
                    f"expected {self.b}"
                )
        ids = np.concatenate([np.asarray(p.ids, dtype=np.int64) for p in parts])
        lengths = np.concatenate([np.diff(np.asarray(p.offsets, dtype=np.int64)) for p in parts])
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Bag(ids=ids, offsets=offsets)


def count_bytes(
    plan: Plan, batch_by_rank: Sequence[Batch], include_dense: bool = False
) -> dict[str, dict[str, int]]:
    """Bytes one step moves per cluster: {cluster name: {"intra": int, "inter": int}}.

    `batch_by_rank[a]` is rank a's slice of the step's batch. Every cluster of the plan
    is present (dp clusters: their gradient exchange). The dense model's all-reduce is
    the extra entry `dense` only when `include_dense` (the embeddings do not move it).
    """
    flows, *_ = _StepCounter(plan).count(_BatchesSource(plan, batch_by_rank))
    names = [c.name for c in plan.clusters] + ([DENSE_CLUSTER] if include_dense else [])
    per_cluster, _, _ = flows.totals(names)
    return {name: dict(per_cluster[name]) for name in names}


def simulate(plan: Plan, batches: int = 2, seed: int = 0, progress=None) -> SimResult:
    """Count `batches` synthetic steps of `plan` (seed `seed`) and estimate the step time.

    Counts are means over the steps; the step time is that of the mean counts (and
    `step_times` lists each step's own). `progress(step, batches)`, when given, is called
    before each step. Raises ValueError for an unusable plan (an uneven batch split, bad
    histogram keys).
    """
    return simulate_many([plan], batches=batches, seed=seed, progress=progress)[0]


def simulate_many(
    plans: Sequence[Plan], batches: int = 2, seed: int = 0, progress=None
) -> list[SimResult]:
    """`simulate` for several plans of the same tables, features and batch, on the same
    batches; each table's ids are drawn once for all of them (the plans may differ in
    topology, clusters and shards)."""
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    if not plans:
        return []
    base = plans[0]
    for p in plans[1:]:
        if (
            p.batch_size != base.batch_size
            or p.tables != base.tables
            or p.features != base.features
        ):
            raise ValueError("simulate_many needs plans of the same tables, features and batch")
    for p in plans:
        _check_allreduce_sizes(p)
    _check_sampling_memory(base)
    data = SyntheticData(base, seed=seed)
    counters = [_StepCounter(p) for p in plans]
    totals = [_Totals(c) for c in counters]
    for step in range(batches):
        if progress is not None:
            progress(step, batches)
        source = _CachedSource(_SyntheticSource(data, step))
        accs = [c.start() for c in counters]
        for t in base.tables:
            for c, acc in zip(counters, accs, strict=True):
                c.count_table(acc, t, source)
            source.clear()
        for c, acc, tot in zip(counters, accs, totals, strict=True):
            tot.add(c.finish(acc), batches)
    return [tot.result(batches, seed) for tot in totals]


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_allreduce_sizes(plan: Plan) -> None:
    """Raise ValueError when an all-reduce of `plan` would carry more than
    MAX_ALLREDUCE_ELEMENTS values (the plan loader bounds every width, not their
    products)."""
    sizes = [("the dense model's gradients", dense_parameters(plan))]
    for c in plan.clusters:
        if c.kind == "dp" and (c.gradient_exchange or "dense") == "dense":
            for name in c.tables:
                t = plan.table(name)
                sizes.append((f"dp table `{name}`'s dense gradient", t.rows * t.dim))
    for what, elements in sizes:
        if elements > MAX_ALLREDUCE_ELEMENTS:
            raise ValueError(
                f"{what} would be all-reduced as {elements:.3e} fp32 values every step, "
                f"more than the {MAX_ALLREDUCE_ELEMENTS:.3e} that the simulator counts "
                "(4 TiB, more than a GPU holds): is the plan's `model` or table size "
                "what was meant?"
            )


def _check_sampling_memory(plan: Plan, available: int | None = None) -> None:
    """Raise ValueError when one table's sampled batch would not fit in this machine's
    available memory (the simulator counts a table at a time on the whole global batch)."""
    ids: dict[str, int] = {}
    for f in plan.features:
        ids[f.table] = ids.get(f.table, 0) + plan.batch_size * f.bag_max
    if not ids:
        return
    table = max(ids, key=lambda t: ids[t])
    need = ids[table] * SAMPLED_BYTES_PER_ID
    available = _available_memory() if available is None else available
    if available is not None and need > available:
        raise ValueError(
            f"a sampled batch of table `{table}` holds up to {ids[table]:,} ids (global batch "
            f"{plan.batch_size:,} x its features' bags), about {format_bytes(need)} to "
            f"count, and this machine has {format_bytes(available)} available: simulate "
            "on a machine with more memory, or a spec with a smaller batch or hotness (the "
            "plan's own estimate needs no sampling: `embarkc check` prints it)"
        )


class _CachedSource(_Source):
    """Keeps the bags drawn for the current table, for every plan that counts it."""

    def __init__(self, inner: _Source):
        self.inner = inner
        self.bags: dict[int, Bag] = {}
        self.lens: dict[int, np.ndarray] = {}

    def bag(self, feature_index: int) -> Bag:
        if feature_index not in self.bags:
            self.bags[feature_index] = self.inner.bag(feature_index)
        return self.bags[feature_index]

    def lengths(self, feature_index: int) -> np.ndarray:
        if feature_index in self.bags:
            return np.diff(self.bags[feature_index].offsets)
        if feature_index not in self.lens:
            self.lens[feature_index] = self.inner.lengths(feature_index)
        return self.lens[feature_index]

    def clear(self) -> None:
        self.bags.clear()
        self.lens.clear()


class _Totals:
    """Means over the simulated steps of one plan's counts."""

    def __init__(self, counter: _StepCounter):
        self.plan = counter.plan
        w_ = counter.world
        self.world = w_
        self.cluster_names = [c.name for c in self.plan.clusters] + [DENSE_CLUSTER]
        self.cluster = {c: {"intra": 0.0, "inter": 0.0} for c in self.cluster_names}
        self.sent = {gr: {lk: np.zeros(w_) for lk in LINKS} for gr in PHASES}
        self.recv = {gr: {lk: np.zeros(w_) for lk in LINKS} for gr in PHASES}
        self.ids, self.distinct, self.hbm = np.zeros(w_), np.zeros(w_), np.zeros(w_)
        self.host_in, self.host_out = np.zeros(w_), np.zeros(w_)
        self.cache: dict[str, CacheStats] = {}
        self.step_times: list[float] = []

    def add(self, acc: _Acc, batches: int) -> None:
        plan = self.plan
        ids, distinct, hbm = acc.ids, acc.distinct, acc.hbm
        per_cluster, sent, recv = acc.flows.totals(self.cluster_names)
        for c, v in per_cluster.items():
            for lk in LINKS:
                self.cluster[c][lk] += v[lk] / batches
        for gr in PHASES:
            for lk in LINKS:
                self.sent[gr][lk] += sent[gr][lk] / batches
                self.recv[gr][lk] += recv[gr][lk] / batches
        self.ids += ids / batches
        self.distinct += distinct / batches
        self.hbm += hbm / batches
        self.host_in += acc.host_in / batches
        self.host_out += acc.host_out / batches
        for name, st in acc.cache.items():
            self.cache.setdefault(name, CacheStats()).add(st)
        ring = ring_seconds(plan, sent["ring"])
        window = key_window(plan)
        link = np.maximum(acc.host_in, acc.host_out)
        self.step_times.append(
            max(
                sum(
                    step_time_of(
                        plan, hbm[a], _of(sent, a), _of(recv, a), ring, window, float(link[a])
                    ).values()
                )
                for a in range(self.world)
            )
        )

    def result(self, batches: int, seed: int) -> SimResult:
        plan = self.plan
        memory = plan.memory_by_rank()
        ring = ring_seconds(plan, self.sent["ring"])
        window = key_window(plan)
        per_rank = []
        for a in range(self.world):
            s, rv = _of(self.sent, a), _of(self.recv, a)
            link = max(float(self.host_in[a]), float(self.host_out[a]))
            per_rank.append(
                RankCounts(
                    rank=a,
                    ids=float(self.ids[a]),
                    distinct=float(self.distinct[a]),
                    hbm_bytes=float(self.hbm[a]),
                    sent=s,
                    received=rv,
                    memory_bytes=memory[a],
                    components=step_time_of(plan, float(self.hbm[a]), s, rv, ring, window, link),
                    host_in=float(self.host_in[a]),
                    host_out=float(self.host_out[a]),
                )
            )
        critical = max(per_rank, key=lambda rc: (rc.time, -rc.rank))
        dense = ring_seconds(plan, self.sent["dense"])
        if dense > 0:
            k = K.of(plan.topology)
            dense += k.collective_latency_seconds + (
                k.inter_node_latency_seconds if plan.topology.nodes > 1 else 0.0
            )
        return SimResult(
            batches=batches,
            seed=seed,
            per_rank=per_rank,
            clusters=self.cluster,
            step_time=critical.time,
            critical_rank=critical.rank,
            step_times=self.step_times,
            components=dict(critical.components),
            dense_allreduce_time=dense,
            host_tier=self.cache,
        )


def _of(arrs: dict[str, dict[str, np.ndarray]], a: int) -> dict[str, dict[str, float]]:
    return {gr: {lk: float(v[a]) for lk, v in d.items()} for gr, d in arrs.items()}


# --------------------------------------------------------------------------- comparison


def compare_with_estimate(plan: Plan, result: SimResult) -> dict[str, float | None]:
    """How far the plan's `estimate` is from the simulation, in % of the simulated value.

    Keys: every component (the estimate's critical rank against the same simulated rank),
    `step_time`, `critical_path`, and `mean_rank_time` (the mean over ranks of |estimate - simulated| of
    each rank's time). Signed values are (estimate - simulated) / simulated. None where
    the estimate lacks the figure or the simulated value is 0.
    """
    est = plan.estimate
    extra = est.model_extra or {}
    out: dict[str, float | None] = {}
    crit = extra.get("critical_rank")
    by_rank = {rc.rank: rc for rc in result.per_rank}
    est_comps = extra.get("components") or {}
    sim_comps = result.components
    if isinstance(crit, int) and crit in by_rank:
        sim_comps = by_rank[crit].components
    for name in COMPONENTS:
        out[name] = _pct(est_comps.get(name), sim_comps.get(name, 0.0))
    out["step_time"] = _pct(est.step_time, result.step_time)
    out["critical_path"] = _pct(extra.get("critical_path"), result.critical_path)
    diffs = []
    for pr in est.per_rank:
        p = _pct(pr.time, by_rank[pr.rank].time if pr.rank in by_rank else 0.0)
        if p is not None:
            diffs.append(abs(p))
    out["mean_rank_time"] = float(np.mean(diffs)) if diffs else None
    return out


def _pct(estimate: float | None, simulated: float) -> float | None:
    if estimate is None or not simulated or not math.isfinite(simulated):
        return None
    return 100.0 * (float(estimate) - simulated) / simulated


# --------------------------------------------------------------------------- host tier

HIT_RATE_TOLERANCE = 0.05
"""How far (absolute, as a fraction of the lookups) a counted hit rate may be from the
cold-start expectation before `embarkc simulate` flags it. Two sources of difference
are expected: sampling (a few steps of a few thousand lookups each: a standard error of
about 1 %) and Che's approximation of LRU, within 1-3 % for zipf streams (Fricker,
Robert and Roberts, ITC 2012); beyond 5 % the cache model misjudges the table."""


@dataclass
class HostTierRow:
    """One table's host-tier caches: counted against the planner's expectations."""

    table: str
    counted: CacheStats
    """summed over its host-tier cells and the simulated steps, from cold caches"""
    cold_lookups: float | None = None
    """the cache model's distinct rows over the same cells and steps (None: no program)"""
    cold_misses: float | None = None
    """... and its misses from cold caches (step t with history t - 1)"""
    steady_hit_rate: float | None = None
    """the plan's estimate (`estimate.host_tier`): the steady state"""

    @property
    def cold_hit_rate(self) -> float | None:
        if self.cold_lookups is None or self.cold_misses is None:
            return None
        return 1.0 - self.cold_misses / self.cold_lookups if self.cold_lookups > 0 else 1.0

    @property
    def flagged(self) -> bool:
        """The counted hit rate is beyond HIT_RATE_TOLERANCE of the cold expectation."""
        h, e = self.counted.hit_rate, self.cold_hit_rate
        return h is not None and e is not None and abs(h - e) > HIT_RATE_TOLERANCE

    def as_dict(self) -> dict:
        return {
            "table": self.table,
            **self.counted.as_dict(),
            "hit_rate": self.counted.hit_rate,
            "expected_cold_hit_rate": self.cold_hit_rate,
            "expected_cold_lookups": self.cold_lookups,
            "expected_cold_misses": self.cold_misses,
            "expected_steady_hit_rate": self.steady_hit_rate,
            "beyond_tolerance": self.flagged,
        }


def host_tier_comparison(plan: Plan, result: SimResult, program=None) -> list[HostTierRow]:
    """Per table with host-tier cells: the counted hit rate, the cache model's for the
    same steps from cold caches (`embarkc.planner.cache_model`, which needs the plan's
    `program`; None without), and the plan's steady-state estimate."""
    if not result.host_tier:
        return []
    steady = {
        t["table"]: t.get("hit_rate")
        for t in ((plan.estimate.model_extra or {}).get("host_tier") or {}).get("tables", [])
    }
    cm = None
    if program is not None:
        from embarkc.planner.cost import CostModel

        cm = CostModel(program)
    out = []
    for name, counted in result.host_tier.items():
        row = HostTierRow(name, counted, steady_hit_rate=steady.get(name))
        if cm is not None and name in cm.facts:
            from embarkc.planner.cache_model import cell_misses

            cells = [s for s in plan.shards if s.table == name and s.on_host]
            tf, r = cm.facts[name], cells[0].row_shards
            j = np.array([s.row_shard for s in cells], dtype=np.intp)
            c = np.array([s.cache_rows or 0 for s in cells], dtype=np.float64)
            row.cold_lookups = float(cell_misses(cm, tf, r, j, c)[0].sum()) * result.batches
            row.cold_misses = sum(
                float(cell_misses(cm, tf, r, j, c, history=t)[1].sum())
                for t in range(result.batches)
            )
        out.append(row)
    return out
