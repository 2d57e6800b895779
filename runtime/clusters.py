"""The three kinds of embedding clusters: forward and backward of one step.

Every cluster works in three phases, called in the same order on every rank:
`distribute` (the data distributor's key traffic; may run a batch ahead, see
ShardedEmbeddings.prefetch), `forward` (lookup, pooling, result traffic) and `backward`
(gradient traffic and the fused sparse optimizer update). ShardedEmbeddings wraps the
forward and backward of all clusters into one autograd function, so that the collectives
of the backward are issued in the same order on every rank whatever the dense model.

Message layouts. Both ends of a message enumerate the same plan-derived lists, so only
the number of ids per segment travels as (uncounted) bookkeeping:
* `cells_on[o]`: the cells of the cluster on rank o, by (table, row shard, first column);
* `rowshards_on[o]`: the distinct (table, row shard) pairs among them;
* an owner's pooling input of (table, row shard) concatenates, source rank by source rank,
  then feature by feature (plan order), the slots of the bags it received (see
  `embark_runtime.distributor`); `block(t, j, a)` is source a's range of slots.

What travels is exactly docs/communication.md: rb sends int64 keys, one int32 bag length
per (sample, feature) and fp32 per-id weights to every owner rank of a row shard, and
fp32 partial vectors back (flat: owner -> requester; hierarchical: owner -> the
requester's rail peer on the owner's node, which sums the node's row shards and sends,
across the network, one vector per (sample, feature) covering the union of the columns
of the table's cells on its node); ub sends distinct keys and gets one vector per key
back (flat: requester <-> owner; hierarchical: requesters on the owner's node are served
flat, those of another node go through the aggregator, the rank of their node with the
owner's local index, which sends the owner the sorted union of its node's ids, hands out
the vectors over NVLink and sums the node's gradients per id); dp sends nothing forward
and exchanges gradients by the hierarchical all-reduce (dense) or the rail all-gather
(sparse) of `embark_runtime.comm`. Two uncounted extras: the position of every id of a
concat feature in its bag (rb, needed to place it when a bag is split over row shards),
and, for dense dp exchange, a touched-row mask (4 bytes per row) so that exactly the
rows present in the global batch are updated, as in the reference.

Value buffers (partial vectors, vectors per key, gradients) are in the kernels'
accumulation dtype `kernels.accum`: fp32 as above, or fp64 in the exact mode
(`TorchKernels(torch.float64)`), where they carry twice the bytes.

Waits for the device. On kernels that keep their counts on the device (`wait_free`: the
generated CUDA kernels, embark_runtime.cuda_kernels) the backward and the updates never
wait per table: rb owners run the fused backward + update on their bags; updates of rows
that may repeat (ub owners, sparse dp) run it on bags of one id, which sums the repeats;
requesters' and dp row gradients stay padded to the ids' count (`pooled_backward_padded`)
and are scattered past a spare row; dense dp updates the rows of the exchanged mask at
the mask's count (`sparse_update_padded`). What remains is what sizes a message: a sparse
dp cluster reads its tables' row counts once, for the all-gather. Rows outside a table
are said at the kernels' next `check_rows`. The torch path (CPU) runs the two steps
(row gradients, then `apply_update`), as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from embark_runtime.cache import CacheStats
from embark_runtime.comm import Comm, Pending, Traffic
from embark_runtime.distributor import (
    FeatureInput,
    local_rows_of,
    offsets_of,
    split_by_row_shard,
    unique_by_row_shard,
    unit_lengths_at_owner,
)
from embark_runtime.kernels import Kernels
from embark_runtime.optim import apply_update
from embark_runtime.storage import Cell, new_cell

I64 = torch.int64
F32 = torch.float32


WAIT_FREE = ("pooled_backward_update", "pooled_backward_padded", "sparse_update_padded")
"""The kernels' extensions of Kernels that keep counts on the device (CudaKernels)."""


def wait_free(kernels: Kernels) -> bool:
    return all(hasattr(kernels, name) for name in WAIT_FREE)


def one_id_bags(n: int, device) -> Tensor:
    """Offsets of n bags of one id each."""
    return torch.arange(n + 1, dtype=I64, device=device)


def scatter_padded(
    rows: int, unique: Tensor, values: Tensor, count: Tensor, dtype: torch.dtype
) -> Tensor:
    """[rows, *values.shape[1:]] zeros with `values[i]` at row `unique[i]` for i < count
    (a [1] tensor on the device), without reading the count: the entries past it go to a
    spare last row, cut off."""
    slot = torch.where(torch.arange(unique.numel(), device=unique.device) < count, unique, rows)
    out = torch.zeros(rows + 1, *values.shape[1:], dtype=dtype, device=values.device)
    out.index_put_((slot,), values.to(dtype))
    return out[:rows]


def _cat(parts: list[Tensor], dtype: torch.dtype, device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([p.reshape(-1).to(dtype) for p in parts])


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """The union of column ranges as sorted disjoint maximal ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def combine_bags(
    parts: list[tuple[Tensor, Tensor, Tensor | None]], weighted: bool, device
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Concatenate (rows, slot lengths, weights) groups into one bag list for one kernel
    call; unweighted groups get weight 1 when any group is weighted."""
    rows = _cat([p[0] for p in parts], I64, device)
    lengths = _cat([p[1] for p in parts], I64, device)
    weights = None
    if weighted:
        weights = _cat(
            [p[2] if p[2] is not None else torch.ones(p[0].numel(), device=device) for p in parts],
            F32,
            device,
        )
    return rows, offsets_of(lengths), weights


@dataclass(frozen=True)
class CellKey:
    table: str
    row_shard: int
    lo: int
    hi: int

    @property
    def width(self) -> int:
        return self.hi - self.lo


class Cluster:
    """Common layout of one cluster of the plan on one rank."""

    kind = ""

    def __init__(self, plan, cluster, comm: Comm, kernels: Kernels, seed: int, device):
        self.plan = plan
        self.spec = cluster
        self.name = cluster.name
        self.comm = comm
        self.kernels = kernels
        self.acc: torch.dtype = kernels.accum
        """dtype of pooled results, gradients and every value buffer sent (kernels.accum)"""
        self.device = device
        self.partition = plan.row_partition
        self.tables = [plan.table(n) for n in cluster.tables]
        self.table_by_name = {t.name: t for t in self.tables}
        self.features = {
            t.name: [f for f in plan.features if f.table == t.name] for t in self.tables
        }
        order = {t.name: i for i, t in enumerate(self.tables)}
        self.row_shards = {t.name: 1 for t in self.tables}
        self.cells_on: dict[int, list[CellKey]] = {r: [] for r in range(comm.world)}
        tiers: dict[CellKey, tuple[str, int]] = {}
        for s in plan.shards:
            if s.table in order:
                self.row_shards[s.table] = s.row_shards
                key = CellKey(s.table, s.row_shard, *s.columns)
                self.cells_on[s.rank].append(key)
                tiers[key] = (s.tier or "hbm", s.cache_rows or 0)
        for r in self.cells_on:
            self.cells_on[r].sort(key=lambda c: (order[c.table], c.row_shard, c.lo))
        self.rowshards_on = {
            r: sorted({(c.table, c.row_shard) for c in cs}, key=lambda p: (order[p[0]], p[1]))
            for r, cs in self.cells_on.items()
        }
        me = comm.rank
        self.cells: dict[CellKey, Cell] = {}
        for c in self.cells_on[me]:
            t = self.table_by_name[c.table]
            tier, cache_rows = tiers[c]
            self.cells[c] = new_cell(
                t, c.row_shard, self.row_shards[c.table], (c.lo, c.hi), self.partition, seed,
                device, tier=tier, cache_rows=cache_rows,
            )  # fmt: skip
        self.staged: dict[CellKey, tuple[Tensor, Tensor]] = {}
        """host-tier cells' lookups of the next step, made ahead by `stage`"""
        self.any_weighted = any(f.weighted for fs in self.features.values() for f in fs)
        self.any_concat = any(f.pooling == "concat" for fs in self.features.values() for f in fs)
        self.wait_free = wait_free(kernels)
        """the backward and the updates keep every count on the device (module docstring)"""

    def resident(self, key: CellKey, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, index) for this step's lookup of local `rows` of a cell: the cell's
        weight and `rows` themselves in HBM; for a host-tier cell, the rows admitted to its
        cache (embark_runtime.cache) read into a buffer of the distinct rows, and every
        id's position in it. The values are the same either way."""
        cell = self.cells[key]
        if cell.cache is None:
            return cell.weight, rows
        staged = self.staged.pop(key, None)
        if staged is not None:
            cell.cache.stats.add(cell.cache.take_ahead())
            return staged
        unique, inverse = self.kernels.dedup(rows)
        counts = torch.bincount(inverse, minlength=unique.numel()) if rows.numel() else None
        slots = cell.cache.admit(unique, counts)
        return cell.cache.read(unique, slots), inverse

    def has_host_tier(self) -> bool:
        return any(cell.cache is not None for cell in self.cells.values())

    def stage(self, dist_state, bvec) -> None:
        """Make the host-tier cells' lookups of the step `dist_state` was distributed for
        now (admission, fetches, the rows read), ahead of its forward: called once the
        last step's updates are all applied, so that the values read are the forward's.
        The forward then uses them (`resident`)."""
        self.clear_staged()
        for key, rows in self.owner_rows(dist_state, bvec).items():
            cache = self.cells[key].cache
            if cache is not None:
                # the counters of this admission belong to the step that reads it
                now, cache.stats = cache.stats, CacheStats()
                self.staged[key] = self.resident(key, rows)
                cache.ahead, cache.stats = cache.stats, now

    def clear_staged(self) -> None:
        """Forget the lookups made ahead (their step is not the next one, or the values
        they read were overwritten); their counters go to the current step."""
        for key in self.staged:
            cache = self.cells[key].cache
            assert cache is not None
            cache.stats.add(cache.take_ahead())
        self.staged = {}

    def owner_rows(self, dist_state, bvec) -> dict[CellKey, Tensor]:
        """Local rows (with repeats) this rank's cells read in the step of `dist_state`."""
        return {}

    def update_cell(self, key: CellKey, rows: Tensor, grads: Tensor) -> None:
        """Update a cell's local `rows` (they may repeat) with their gradients."""
        cell = self.cells[key]
        table = self.table_by_name[key.table]
        if cell.cache is not None:
            cell.cache.update(self.kernels, rows, grads, table)
            return
        self._update(cell, table, rows, grads)

    def _update(self, cell: Cell, table, rows: Tensor, grads: Tensor) -> None:
        if self.wait_free:
            self._fused(cell, table, grads, rows, one_id_bags(rows.numel(), self.device), None)
            return
        apply_update(self.kernels, cell.weight, cell.state, rows, grads, table)

    def _fused(self, cell: Cell, table, grad, rows, offsets, weights) -> None:
        self.kernels.pooled_backward_update(  # type: ignore[attr-defined]
            cell.weight,
            cell.state,
            grad,
            rows,
            offsets,
            weights,
            "sum",
            table.optimizer,
            table.optimizer_params,
        )

    def row_grads(
        self, grad: Tensor, rows: Tensor, offsets: Tensor, weights: Tensor | None, num_rows: int
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(distinct rows, their gradients, count): exact with count None (the torch path),
        or padded to the ids' count with the count on the device (wait_free)."""
        if self.wait_free:
            return self.kernels.pooled_backward_padded(  # type: ignore[attr-defined]
                grad, rows, offsets, weights, "sum", num_rows
            )
        unique, grads = self.kernels.pooled_backward(grad, rows, offsets, weights, "sum", num_rows)
        return unique, grads, None

    def feature_slots(self, table: str, b: int) -> list[int]:
        return [b * f.bag_max if f.pooling == "concat" else b for f in self.features[table]]

    def slots(self, table: str, b: int) -> int:
        return sum(self.feature_slots(table, b))

    def finish_table(
        self, table: str, acc: Tensor, feats: dict[str, FeatureInput]
    ) -> dict[str, Tensor]:
        """Split a table's summed slots into its features' outputs."""
        dim = self.table_by_name[table].dim
        out = {}
        start = 0
        for f in self.features[table]:
            fi = feats[f.name]
            out[f.name] = fi.finish(acc[start : start + fi.slots], dim)
            start += fi.slots
        return out

    def table_unit_grads(self, table: str, feats, grads: dict[str, Tensor]) -> Tensor:
        dim = self.table_by_name[table].dim
        parts = [feats[f.name].unit_grads(grads[f.name], dim) for f in self.features[table]]
        if not parts:
            return torch.zeros(0, dim, dtype=self.acc, device=self.device)
        return torch.cat(parts)


# --------------------------------------------------------------------------- dp


class DpCluster(Cluster):
    """Tables replicated on every rank: local lookups, gradients exchanged in backward."""

    kind = "dp"

    def __init__(self, plan, cluster, comm, kernels, seed, device):
        super().__init__(plan, cluster, comm, kernels, seed, device)
        self.exchange = cluster.gradient_exchange or "dense"
        for t in self.tables:
            self.cells[CellKey(t.name, 0, 0, t.dim)] = new_cell(
                t, 0, 1, (0, t.dim), self.partition, seed, device
            )

    def replica(self, table: str) -> Cell:
        t = self.table_by_name[table]
        return self.cells[CellKey(table, 0, 0, t.dim)]

    def distribute(self, feats, bvec, traffic) -> None:
        return None

    def forward(self, dist_state, feats, bvec, traffic, saved: dict) -> dict[str, Tensor]:
        out = {}
        for t in self.tables:
            w = self.replica(t.name).weight
            for f in self.features[t.name]:
                fi = feats[f.name]
                pooled = self.kernels.pooled_forward(
                    w, fi.ids, fi.slot_offsets(), fi.weights, "sum"
                )
                out[f.name] = fi.finish(pooled, t.dim)
        return out

    def start_backward(self, saved, feats, grads, traffic: Traffic):
        """Local gradients and the asynchronous exchange; returns what `finish_backward` needs."""
        touched = {}
        for t in self.tables:
            fs = self.features[t.name]
            rows, offsets, weights = combine_bags(
                [
                    (feats[f.name].ids, feats[f.name].slot_offsets().diff(), feats[f.name].weights)
                    for f in fs
                ],
                any(f.weighted for f in fs),
                self.device,
            )
            g = self.table_unit_grads(t.name, feats, grads)
            touched[t.name] = self.row_grads(g, rows, offsets, weights, t.rows)
        if self.exchange == "dense":
            buf = _cat(
                [self._dense(t, *touched[t.name]) for t in self.tables], self.acc, self.device
            )
            mask = torch.zeros(
                sum(t.rows for t in self.tables), dtype=torch.int32, device=self.device
            )
            base = 0
            for t in self.tables:
                unique, _, count = touched[t.name]
                if count is None:
                    mask[base + unique] = 1
                else:
                    ones = torch.ones(unique.numel(), dtype=torch.int32, device=self.device)
                    mask[base : base + t.rows] = scatter_padded(
                        t.rows, unique, ones, count, torch.int32
                    )
                base += t.rows
            # one hierarchical all-reduce, every table cut into its own chunks (the doc
            # counts one all-reduce per table)
            p1 = self.comm.hierarchical_all_reduce(
                buf,
                traffic=traffic,
                cluster=self.name,
                segments=[t.rows * t.dim for t in self.tables],
                async_op=True,
            )
            p2 = self.comm.all_reduce(mask, async_op=True)
            return ("dense", p1, p2)
        if self.wait_free:
            # the one wait of the backward: the all-gather is sized by the tables' rows
            used = torch.cat([touched[t.name][2] for t in self.tables]).tolist()  # type: ignore[misc]
            touched = {
                t.name: (touched[t.name][0][:n], touched[t.name][1][:n], None)
                for t, n in zip(self.tables, used, strict=True)
            }
        keys = _cat([touched[t.name][0] for t in self.tables], I64, self.device)
        vals = _cat([touched[t.name][1] for t in self.tables], self.acc, self.device)
        counts = self.comm.all_gather_ints([touched[t.name][0].numel() for t in self.tables])
        p1 = self.comm.rail_all_gather(
            keys,
            lengths=[sum(c) for c in counts],
            traffic=traffic,
            cluster=self.name,
            async_op=True,
        )
        p2 = self.comm.rail_all_gather(
            vals,
            lengths=[sum(n * t.dim for n, t in zip(c, self.tables, strict=True)) for c in counts],
            traffic=traffic,
            cluster=self.name,
            async_op=True,
        )
        return ("sparse", p1, p2, counts)

    def _dense(self, t, rows: Tensor, grads: Tensor, count: Tensor | None) -> Tensor:
        if count is not None:
            return scatter_padded(t.rows, rows, grads, count, self.acc)
        d = torch.zeros(t.rows, t.dim, dtype=self.acc, device=self.device)
        d[rows] = grads
        return d

    def finish_backward(self, pending) -> None:
        if pending[0] == "dense":
            buf, mask = pending[1].wait(), pending[2].wait()
            base_m = base_b = 0
            for t in self.tables:
                touched = mask[base_m : base_m + t.rows]
                summed = buf[base_b : base_b + t.rows * t.dim].reshape(t.rows, t.dim)
                cell = self.replica(t.name)
                if self.wait_free:
                    # the touched rows first, at their count on the device
                    rows = torch.nonzero_static(touched, size=t.rows, fill_value=0).reshape(-1)
                    count = (touched != 0).sum().reshape(1)
                    self.kernels.sparse_update_padded(  # type: ignore[attr-defined]
                        cell.weight,
                        cell.state,
                        rows,
                        summed[rows],
                        count,
                        t.optimizer,
                        t.optimizer_params,
                    )
                else:
                    rows = torch.nonzero(touched).reshape(-1)
                    apply_update(self.kernels, cell.weight, cell.state, rows, summed[rows], t)
                base_m += t.rows
                base_b += t.rows * t.dim
            return
        keys_by_rank, vals_by_rank, counts = pending[1].wait(), pending[2].wait(), pending[3]
        per_table: dict[str, list[tuple[Tensor, Tensor]]] = {t.name: [] for t in self.tables}
        for r in range(self.comm.world):
            kpos = vpos = 0
            for t, n in zip(self.tables, counts[r], strict=True):
                per_table[t.name].append(
                    (
                        keys_by_rank[r][kpos : kpos + n],
                        vals_by_rank[r][vpos : vpos + n * t.dim].reshape(n, t.dim),
                    )
                )
                kpos += n
                vpos += n * t.dim
        for t in self.tables:
            rows = _cat([k for k, _ in per_table[t.name]], I64, self.device)
            g = torch.cat([v for _, v in per_table[t.name]]) if per_table[t.name] else None
            if g is None or rows.numel() == 0:
                continue
            self._update(self.replica(t.name), t, rows, g)


# --------------------------------------------------------------------------- rb / ub shared


@dataclass
class KeyDist:
    """Result of `distribute` for an rb/ub cluster (payloads possibly still in flight)."""

    counts: list[list[int]]
    """counts[a][s]: ids (rb) or distinct keys (ub) of segment s received from source a"""
    keys: Pending
    lengths: Pending | None = None
    weights: Pending | None = None
    positions: Pending | None = None
    local: dict = field(default_factory=dict)
    """requester-side data kept for forward (ub: the UniqueSplit of every table)"""


class ShardedCluster(Cluster):
    """rb and ub: tables cut into cells owned by single ranks."""

    def my_segments(self) -> list[tuple[str, int, str]]:
        """Segments (table, row shard, feature) this rank receives, in wire order (rb)."""
        return [
            (t, j, f.name) for t, j in self.rowshards_on[self.comm.rank] for f in self.features[t]
        ]

    def _exchange_counts(
        self, meta: list[list[int]], expect: int, scope: str = "world"
    ) -> list[list[int]]:
        """Bookkeeping (uncounted): send `meta[i]` to the i-th rank of `scope`, receive
        `expect` ints from every rank of it."""
        chunks = [torch.tensor(m, dtype=I64, device=self.device) for m in meta]
        got = self.comm.all_to_all(chunks, [expect] * len(chunks), scope=scope)
        assert isinstance(got, list)
        return [g.tolist() for g in got]

    def remote_rail(self, q: int) -> list[int]:
        """q's rail peers on the other nodes (same local index), in rank order."""
        return [
            r for r in self.comm.rail_ranks(self.comm.local_of(q)) if not self.comm.same_node(r, q)
        ]

    def _a2a(self, chunks, counts, traffic, *, scope="world", async_op=False):
        return self.comm.all_to_all(
            chunks, counts, scope=scope, traffic=traffic, cluster=self.name, async_op=async_op
        )


# --------------------------------------------------------------------------- rb


@dataclass
class OwnerBags:
    rows: Tensor
    offsets: Tensor
    weights: Tensor | None
    blocks: list[tuple[int, int]]
    """slots of every source rank: [start, end) in the pooled output"""


class RbCluster(ShardedCluster):
    """Reduction-based: owners pool their rows of each bag; partial vectors travel."""

    kind = "rb"

    def __init__(self, plan, cluster, comm, kernels, seed, device):
        super().__init__(plan, cluster, comm, kernels, seed, device)
        self.hierarchical = cluster.communication == "hierarchical" and comm.nodes > 1
        self.groups: dict[tuple[int, str], list[tuple[int, int]]] = {}
        for n in range(comm.nodes):
            for t in self.tables:
                ranges = {
                    (c.lo, c.hi)
                    for r in comm.node_ranks(n)
                    for c in self.cells_on[r]
                    if c.table == t.name
                }
                self.groups[(n, t.name)] = merge_ranges(ranges)

    def group_of(self, node: int, c: CellKey) -> tuple[int, int]:
        """The merged column range of `node` that contains cell `c`'s columns."""
        return next(g for g in self.groups[(node, c.table)] if g[0] <= c.lo and c.hi <= g[1])

    def _remote_slice(self, remote, r: int, c: CellKey) -> Tensor:
        g = self.group_of(self.comm.node_of(self.comm.rank), c)
        return remote[(r, c.table, g)][:, c.lo - g[0] : c.hi - g[0]]

    # ------------------------------------------------------------------ distribute
    def distribute(self, feats, bvec, traffic) -> KeyDist:
        dev = self.device
        parts = {
            t.name: {
                f.name: split_by_row_shard(
                    self.kernels, feats[f.name], t.rows, self.row_shards[t.name], self.partition
                )
                for f in self.features[t.name]
            }
            for t in self.tables
        }
        meta, keys, lens, ws, ps = [], [], [], [], []
        for o in range(self.comm.world):
            m, k, ln, w, p = [], [], [], [], []
            for t, j in self.rowshards_on[o]:
                for f in self.features[t]:
                    part = parts[t][f.name][j]
                    m.append(part.keys.numel())
                    k.append(part.keys)
                    ln.append(part.lengths)
                    if f.weighted:
                        w.append(part.weights)
                    if f.pooling == "concat":
                        p.append(part.positions)
            meta.append(m)
            keys.append(_cat(k, I64, dev))
            lens.append(_cat(ln, torch.int32, dev))
            ws.append(_cat(w, F32, dev))
            ps.append(_cat(p, I64, dev))
        segs = self.my_segments()
        counts = self._exchange_counts(meta, len(segs))
        fdef = {f.name: f for fs in self.features.values() for f in fs}
        n_keys = [sum(c) for c in counts]
        n_lens = [len(segs) * bvec[a] for a in range(self.comm.world)]
        n_w = [sum(n for n, s in zip(c, segs, strict=True) if fdef[s[2]].weighted) for c in counts]
        n_p = [
            sum(n for n, s in zip(c, segs, strict=True) if fdef[s[2]].pooling == "concat")
            for c in counts
        ]
        kd = KeyDist(counts, self._a2a(keys, n_keys, traffic, async_op=True))
        kd.lengths = self._a2a(lens, n_lens, traffic, async_op=True)
        if self.any_weighted:
            kd.weights = self._a2a(ws, n_w, traffic, async_op=True)
        if self.any_concat:
            kd.positions = self.comm.all_to_all(ps, n_p, async_op=True)
        return kd

    # ------------------------------------------------------------------ forward
    def owner_rows(self, dist_state, bvec) -> dict[CellKey, Tensor]:
        owner = self._owner_bags(dist_state, bvec)
        return {c: owner[(c.table, c.row_shard)].rows for c in self.cells_on[self.comm.rank]}

    def _owner_bags(self, kd: KeyDist, bvec) -> dict[tuple[str, int], OwnerBags]:
        if "owner" not in kd.local:
            kd.local["owner"] = self._receive_bags(kd, bvec)
        return kd.local["owner"]

    def _receive_bags(self, kd: KeyDist, bvec) -> dict[tuple[str, int], OwnerBags]:
        keys, lens = kd.keys.wait(), kd.lengths.wait()  # type: ignore[union-attr]
        ws = kd.weights.wait() if kd.weights else None
        ps = kd.positions.wait() if kd.positions else None
        segs = self.my_segments()
        fdef = {f.name: f for fs in self.features.values() for f in fs}
        groups: dict[tuple[str, int], list] = {p: [] for p in self.rowshards_on[self.comm.rank]}
        blocks: dict[tuple[str, int], list[tuple[int, int]]] = {p: [] for p in groups}
        units_so_far = dict.fromkeys(groups, 0)
        for a in range(self.comm.world):
            ki = li = wi = pi = 0
            start = dict(units_so_far)
            for (t, j, fname), n in zip(segs, kd.counts[a], strict=True):
                f = fdef[fname]
                k = keys[a][ki : ki + n]
                ln = lens[a][li : li + bvec[a]]
                ki += n
                li += bvec[a]
                w = None
                if f.weighted:
                    assert ws is not None
                    w = ws[a][wi : wi + n]
                    wi += n
                pos = None
                if f.pooling == "concat":
                    assert ps is not None
                    pos = ps[a][pi : pi + n]
                    pi += n
                ul = unit_lengths_at_owner(ln, pos, f.pooling, f.bag_max)
                rows = local_rows_of(
                    k, self.table_by_name[t].rows, j, self.row_shards[t], self.partition
                )
                groups[(t, j)].append((rows, ul, w))
                units_so_far[(t, j)] += ul.numel()
            for p in groups:
                blocks[p].append((start[p], units_so_far[p]))
        out = {}
        for p, parts in groups.items():
            weighted = any(f.weighted for f in self.features[p[0]])
            rows, offsets, weights = combine_bags(parts, weighted, self.device)
            out[p] = OwnerBags(rows, offsets, weights, blocks[p])
        return out

    def forward(self, kd: KeyDist, feats, bvec, traffic, saved: dict) -> dict[str, Tensor]:
        me = self.comm.rank
        owner = self._owner_bags(kd, bvec)
        saved["owner"] = owner
        pooled = {}
        for c in self.cells_on[me]:
            ob = owner[(c.table, c.row_shard)]
            weight, rows = self.resident(c, ob.rows)
            pooled[c] = self.kernels.pooled_forward(weight, rows, ob.offsets, ob.weights, "sum")

        def piece(c: CellKey, r: int) -> Tensor:
            s, e = owner[(c.table, c.row_shard)].blocks[r]
            return pooled[c][s:e]

        acc = {
            t.name: torch.zeros(
                self.slots(t.name, bvec[me]), t.dim, dtype=self.acc, device=self.device
            )
            for t in self.tables
        }
        if not self.hierarchical:
            chunks = [
                _cat([piece(c, a) for c in self.cells_on[me]], self.acc, self.device)
                for a in range(self.comm.world)
            ]
            counts = [
                sum(self.slots(c.table, bvec[me]) * c.width for c in self.cells_on[o])
                for o in range(self.comm.world)
            ]
            got = self._a2a(chunks, counts, traffic)
            for o in range(self.comm.world):
                self._unpack_into(
                    acc, got[o], [(c, self.slots(c.table, bvec[me])) for c in self.cells_on[o]]
                )
        else:
            self._forward_hierarchical(piece, acc, bvec, traffic)
        out = {}
        for t in self.tables:
            out.update(self.finish_table(t.name, acc[t.name], feats))
        return out

    def _unpack_into(self, acc, flat: Tensor, layout) -> None:
        pos = 0
        for c, slots in layout:
            n = slots * c.width
            acc[c.table][:, c.lo : c.hi] += flat[pos : pos + n].reshape(slots, c.width)
            pos += n

    def _forward_hierarchical(self, piece, acc, bvec, traffic) -> None:
        comm, me = self.comm, self.comm.rank
        node_peers = comm.peers("node")
        mynode = comm.node_of(me)
        # step A (NVLink): partials to own-node requesters, and to rail peers for remote ones
        chunks = [
            _cat(
                [piece(c, r) for r in [q, *self.remote_rail(q)] for c in self.cells_on[me]],
                self.acc,
                self.device,
            )
            for q in node_peers
        ]
        mine = [me, *self.remote_rail(me)]
        counts = [
            sum(self.slots(c.table, bvec[r]) * c.width for r in mine for c in self.cells_on[o])
            for o in node_peers
        ]
        got = self._a2a(chunks, counts, traffic, scope="node")
        sums = {
            (r, t.name, g): torch.zeros(
                self.slots(t.name, bvec[r]), g[1] - g[0], dtype=self.acc, device=self.device
            )
            for r in mine[1:]
            for t in self.tables
            for g in self.groups[(mynode, t.name)]
        }
        for o, flat in zip(node_peers, got, strict=True):
            pos = 0
            for r in mine:
                for c in self.cells_on[o]:
                    slots = self.slots(c.table, bvec[r])
                    n = slots * c.width
                    block = flat[pos : pos + n].reshape(slots, c.width)
                    pos += n
                    if r == me:
                        acc[c.table][:, c.lo : c.hi] += block
                    else:
                        g = self.group_of(mynode, c)
                        sums[(r, c.table, g)][:, c.lo - g[0] : c.hi - g[0]] += block
        # step B (network): per node, one summed vector per (sample, feature) covering the union
        # of the node's column ranges of the table (as embarkc.simulate counts it)
        rail = comm.peers("rail")
        chunks = [
            _cat(
                []
                if p == me
                else [
                    sums[(p, t.name, g)] for t in self.tables for g in self.groups[(mynode, t.name)]
                ],
                self.acc,
                self.device,
            )
            for p in rail
        ]
        counts = [
            0
            if p == me
            else sum(
                self.slots(t.name, bvec[me]) * (g[1] - g[0])
                for t in self.tables
                for g in self.groups[(comm.node_of(p), t.name)]
            )
            for p in rail
        ]
        got = self._a2a(chunks, counts, traffic, scope="rail")
        for p, flat in zip(rail, got, strict=True):
            if p == me:
                continue
            pos = 0
            for t in self.tables:
                slots = self.slots(t.name, bvec[me])
                for lo, hi in self.groups[(comm.node_of(p), t.name)]:
                    n = slots * (hi - lo)
                    acc[t.name][:, lo:hi] += flat[pos : pos + n].reshape(slots, hi - lo)
                    pos += n

    # ------------------------------------------------------------------ backward
    def backward(self, saved, feats, grads, bvec, traffic) -> None:
        comm, me = self.comm, self.comm.rank
        gt = {t.name: self.table_unit_grads(t.name, feats, grads) for t in self.tables}
        received: dict[CellKey, dict[int, Tensor]] = {c: {} for c in self.cells_on[me]}
        if not self.hierarchical:
            chunks = [
                _cat([gt[c.table][:, c.lo : c.hi] for c in self.cells_on[o]], self.acc, self.device)
                for o in range(comm.world)
            ]
            counts = [
                sum(self.slots(c.table, bvec[a]) * c.width for c in self.cells_on[me])
                for a in range(comm.world)
            ]
            got = self._a2a(chunks, counts, traffic)
            for a, flat in enumerate(got):
                self._unpack_blocks(received, flat, [a], bvec)
        else:
            self._backward_hierarchical(gt, received, bvec, traffic)
        owner: dict[tuple[str, int], OwnerBags] = saved["owner"]
        for c in self.cells_on[me]:
            ob = owner[(c.table, c.row_shard)]
            g = torch.cat([received[c][a] for a in range(comm.world)])
            cell = self.cells[c]
            if self.wait_free and cell.cache is None:
                self._fused(cell, self.table_by_name[c.table], g, ob.rows, ob.offsets, ob.weights)
                continue
            rows, row_grads = self.kernels.pooled_backward(
                g, ob.rows, ob.offsets, ob.weights, "sum", cell.rows
            )
            self.update_cell(c, rows, row_grads)

    def _unpack_blocks(self, received, flat: Tensor, sources: list[int], bvec) -> None:
        pos = 0
        for r in sources:
            for c in self.cells_on[self.comm.rank]:
                slots = self.slots(c.table, bvec[r])
                n = slots * c.width
                received[c][r] = flat[pos : pos + n].reshape(slots, c.width)
                pos += n

    def _backward_hierarchical(self, gt, received, bvec, traffic) -> None:
        comm, me = self.comm, self.comm.rank
        mynode = comm.node_of(me)
        # step B' (network): per remote node, one gradient per (sample, feature) over its union
        rail = comm.peers("rail")
        chunks = [
            _cat(
                []
                if p == me
                else [
                    gt[t.name][:, g[0] : g[1]]
                    for t in self.tables
                    for g in self.groups[(comm.node_of(p), t.name)]
                ],
                self.acc,
                self.device,
            )
            for p in rail
        ]
        counts = [
            0
            if p == me
            else sum(
                self.slots(t.name, bvec[p]) * (g[1] - g[0])
                for t in self.tables
                for g in self.groups[(mynode, t.name)]
            )
            for p in rail
        ]
        got = self._a2a(chunks, counts, traffic, scope="rail")
        remote: dict[tuple[int, str, tuple[int, int]], Tensor] = {}
        for p, flat in zip(rail, got, strict=True):
            if p == me:
                continue
            pos = 0
            for t in self.tables:
                slots = self.slots(t.name, bvec[p])
                for g in self.groups[(mynode, t.name)]:
                    n = slots * (g[1] - g[0])
                    remote[(p, t.name, g)] = flat[pos : pos + n].reshape(slots, g[1] - g[0])
                    pos += n
        # step A' (NVLink): own gradients and the remote ones, to every owner of the node
        node_peers = comm.peers("node")
        mine = [me, *self.remote_rail(me)]
        chunks = [
            _cat(
                [
                    gt[c.table][:, c.lo : c.hi] if r == me else self._remote_slice(remote, r, c)
                    for r in mine
                    for c in self.cells_on[o]
                ],
                self.acc,
                self.device,
            )
            for o in node_peers
        ]
        counts = [
            sum(
                self.slots(c.table, bvec[r]) * c.width
                for r in [q, *self.remote_rail(q)]
                for c in self.cells_on[me]
            )
            for q in node_peers
        ]
        got = self._a2a(chunks, counts, traffic, scope="node")
        for q, flat in zip(node_peers, got, strict=True):
            self._unpack_blocks(received, flat, [q, *self.remote_rail(q)], bvec)


# --------------------------------------------------------------------------- ub


@dataclass
class Aggregate:
    """What an aggregator holds for one (remote owner, row shard) of a hierarchical ub
    cluster: the sorted union of its node's distinct ids, and where every rank of the node
    finds its own ids in it."""

    union: Tensor
    positions: dict[int, Tensor]
    """positions[q]: the index in `union` of every id rank q asked for, in q's order"""


class UbCluster(ShardedCluster):
    """Unique-based: distinct keys travel, owners return one vector per key, the requester
    pools; backward sends one accumulated gradient per key.

    Hierarchical (the cluster's `communication` is "hierarchical", several nodes): owners
    serve their own node flat; for every other node the rank with the owner's local index
    (the aggregator, one of `remote_rail(owner)`) gathers its node's ids over NVLink,
    sends the owner their sorted union over the network, spreads the returned vectors in
    its node and sums the node's gradients per id before sending them back.
    """

    kind = "ub"

    def __init__(self, plan, cluster, comm, kernels, seed, device):
        super().__init__(plan, cluster, comm, kernels, seed, device)
        self.hierarchical = cluster.communication == "hierarchical" and comm.nodes > 1

    def _keys_for(self, splits, r: int) -> list[Tensor]:
        """The distinct keys this rank asks owner r for, one segment per row shard of r."""
        return [splits[t].keys_of_shard(j) for t, j in self.rowshards_on[r]]

    def _wanted(self, splits, c: CellKey) -> int:
        """How many distinct keys this rank asks for in cell c's row shard."""
        return splits[c.table].index_of_shard[c.row_shard].numel()

    # ------------------------------------------------------------------ distribute
    def distribute(self, feats, bvec, traffic) -> KeyDist:
        splits = {}
        for t in self.tables:
            fs = self.features[t.name]
            keys = _cat([feats[f.name].ids for f in fs], I64, self.device)
            splits[t.name] = unique_by_row_shard(
                self.kernels, keys, t.rows, self.row_shards[t.name], self.partition
            )
        if self.hierarchical:
            kd = self._distribute_hierarchical(splits, traffic)
        else:
            meta, chunks = [], []
            for o in range(self.comm.world):
                ks = self._keys_for(splits, o)
                meta.append([k.numel() for k in ks])
                chunks.append(_cat(ks, I64, self.device))
            counts = self._exchange_counts(meta, len(self.rowshards_on[self.comm.rank]))
            kd = KeyDist(
                counts, self._a2a(chunks, [sum(c) for c in counts], traffic, async_op=True)
            )
        kd.local["splits"] = splits
        return kd

    def _distribute_hierarchical(self, splits, traffic) -> KeyDist:
        """Keys in two steps: to every rank q of the node (NVLink) the keys of q's own row
        shards and of the remote owners q aggregates for; then (network, still in flight
        on return) every aggregator's unions to their owners. `counts[i]` are the union
        sizes per row shard received from the i-th rail peer; `local` keeps the keys of
        the node's requesters ("direct") and this rank's aggregates ("agg")."""
        comm, me = self.comm, self.comm.rank
        node, rail = comm.peers("node"), comm.peers("rail")
        mine = [me, *self.remote_rail(me)]
        meta, chunks = [], []
        for q in node:
            ks = [k for r in [q, *self.remote_rail(q)] for k in self._keys_for(splits, r)]
            meta.append([k.numel() for k in ks])
            chunks.append(_cat(ks, I64, self.device))
        counts = self._exchange_counts(
            meta, sum(len(self.rowshards_on[r]) for r in mine), scope="node"
        )
        got = self._a2a(chunks, [sum(c) for c in counts], traffic, scope="node")
        direct: dict[tuple[str, int], dict[int, Tensor]] = {p: {} for p in self.rowshards_on[me]}
        asked: dict[tuple[int, str, int], dict[int, Tensor]] = {
            (r, t, j): {} for r in mine[1:] for t, j in self.rowshards_on[r]
        }
        for q, flat, cs in zip(node, got, counts, strict=True):
            pos, seg = 0, 0
            for r in mine:
                for t, j in self.rowshards_on[r]:
                    k = flat[pos : pos + cs[seg]]
                    pos += cs[seg]
                    seg += 1
                    if r == me:
                        direct[(t, j)][q] = k
                    else:
                        asked[(r, t, j)][q] = k
        agg: dict[tuple[int, str, int], Aggregate] = {}
        for key, by_q in asked.items():
            union, inverse = self.kernels.dedup(_cat([by_q[q] for q in node], I64, self.device))
            where = torch.split(inverse, [by_q[q].numel() for q in node])
            agg[key] = Aggregate(union, dict(zip(node, where, strict=True)))
        empty = [0] * len(self.rowshards_on[me])
        meta = [
            empty if o == me else [agg[(o, t, j)].union.numel() for t, j in self.rowshards_on[o]]
            for o in rail
        ]
        rail_counts = self._exchange_counts(meta, len(empty), scope="rail")
        chunks = [
            _cat(
                [] if o == me else [agg[(o, t, j)].union for t, j in self.rowshards_on[o]],
                I64,
                self.device,
            )
            for o in rail
        ]
        kd = KeyDist(
            rail_counts,
            self._a2a(chunks, [sum(c) for c in rail_counts], traffic, scope="rail", async_op=True),
        )
        kd.local["direct"], kd.local["agg"] = direct, agg
        return kd

    # ------------------------------------------------------------------ forward
    def forward(self, kd: KeyDist, feats, bvec, traffic, saved: dict) -> dict[str, Tensor]:
        splits = kd.local["splits"]
        table_rows = {
            t.name: torch.zeros(
                splits[t.name].unique.numel(), t.dim, dtype=self.acc, device=self.device
            )
            for t in self.tables
        }
        if self.hierarchical:
            self._forward_hierarchical(kd, splits, table_rows, traffic, saved)
        else:
            self._forward_flat(kd, splits, table_rows, traffic, saved)
        saved["splits"] = splits
        out = {}
        for t in self.tables:
            inv = splits[t.name].inverse
            start = 0
            for f in self.features[t.name]:
                fi = feats[f.name]
                local = inv[start : start + fi.ids.numel()]
                start += fi.ids.numel()
                pooled = self.kernels.pooled_forward(
                    table_rows[t.name], local, fi.slot_offsets(), fi.weights, "sum"
                )
                out[f.name] = fi.finish(pooled, t.dim)
        return out

    def _owner_rows(
        self, keys_of: dict[tuple[str, int], list[tuple[int, Tensor]]]
    ) -> tuple[dict[tuple[str, int], Tensor], dict[tuple[str, int], dict[int, tuple[int, int]]]]:
        """An owner's (local rows, {source: [start, end)}) per row shard from the keys it
        received, source by source in the order given."""
        rows: dict[tuple[str, int], Tensor] = {}
        blocks: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}
        for (t, j), parts in keys_of.items():
            local = [
                local_rows_of(k, self.table_by_name[t].rows, j, self.row_shards[t], self.partition)
                for _, k in parts
            ]
            rows[(t, j)] = _cat(local, I64, self.device)
            blocks[(t, j)] = {}
            start = 0
            for (a, _), r in zip(parts, local, strict=True):
                blocks[(t, j)][a] = (start, start + r.numel())
                start += r.numel()
        return rows, blocks

    def _lookup(self, rows) -> dict[CellKey, Tensor]:
        out = {}
        for c in self.cells_on[self.comm.rank]:
            weight, index = self.resident(c, rows[(c.table, c.row_shard)])
            out[c] = self.kernels.gather_rows(weight, index).to(self.acc)
        return out

    def owner_rows(self, dist_state, bvec) -> dict[CellKey, Tensor]:
        rows, _ = self._requests(dist_state)
        return {c: rows[(c.table, c.row_shard)] for c in self.cells_on[self.comm.rank]}

    def _requests(self, kd: KeyDist):
        """The owner's (local rows, blocks) per row shard (`_owner_rows`) of the keys it
        received: from every rank (flat), or from its node's ranks and then the other
        nodes' aggregators (hierarchical). Made once per step (kept in `kd.local`)."""
        if "requests" in kd.local:
            return kd.local["requests"]
        me = self.comm.rank
        keys_of: dict[tuple[str, int], list[tuple[int, Tensor]]]
        if self.hierarchical:
            node, rail = self.comm.peers("node"), self.comm.peers("rail")
            direct = kd.local["direct"]
            unions = dict(zip(rail, kd.keys.wait(), strict=True))
            union_counts = dict(zip(rail, kd.counts, strict=True))
            keys_of = {p: [(q, direct[p][q]) for q in node] for p in self.rowshards_on[me]}
            for p in self.remote_rail(me):
                pos = 0
                for seg, n in zip(self.rowshards_on[me], union_counts[p], strict=True):
                    keys_of[seg].append((p, unions[p][pos : pos + n]))
                    pos += n
        else:
            keys = kd.keys.wait()
            keys_of = {p: [] for p in self.rowshards_on[me]}
            for a in range(self.comm.world):
                pos = 0
                for p, n in zip(self.rowshards_on[me], kd.counts[a], strict=True):
                    keys_of[p].append((a, keys[a][pos : pos + n]))
                    pos += n
        kd.local["requests"] = self._owner_rows(keys_of)
        return kd.local["requests"]

    def _forward_flat(self, kd: KeyDist, splits, table_rows, traffic, saved: dict) -> None:
        comm, me = self.comm, self.comm.rank
        rows, blocks = self._requests(kd)
        vals = self._lookup(rows)
        chunks = []
        for a in range(comm.world):
            parts = []
            for c in self.cells_on[me]:
                s, e = blocks[(c.table, c.row_shard)][a]
                parts.append(vals[c][s:e])
            chunks.append(_cat(parts, self.acc, self.device))
        counts = [
            sum(self._wanted(splits, c) * c.width for c in self.cells_on[o])
            for o in range(comm.world)
        ]
        got = self._a2a(chunks, counts, traffic)
        for o, flat in enumerate(got):
            self._place(table_rows, splits, flat, [o])
        saved["rows"], saved["blocks"] = rows, blocks

    def _place(self, table_rows, splits, flat: Tensor, owners: list[int]) -> None:
        """Write the vectors of `flat` (owner by owner, cell by cell) into the requester's
        rows of its distinct keys."""
        pos = 0
        for o in owners:
            for c in self.cells_on[o]:
                idx = splits[c.table].index_of_shard[c.row_shard]
                n = idx.numel() * c.width
                table_rows[c.table][idx, c.lo : c.hi] = flat[pos : pos + n].reshape(
                    idx.numel(), c.width
                )
                pos += n

    def _forward_hierarchical(self, kd: KeyDist, splits, table_rows, traffic, saved) -> None:
        comm, me = self.comm, self.comm.rank
        node, rail = comm.peers("node"), comm.peers("rail")
        remote = self.remote_rail(me)
        agg = kd.local["agg"]
        # the owner's requests: its node's ranks, then the aggregators of the other nodes
        rows, blocks = self._requests(kd)
        vals = self._lookup(rows)

        def block(c: CellKey, a: int) -> Tensor:
            s, e = blocks[(c.table, c.row_shard)][a]
            return vals[c][s:e]

        # step 2a (network): one vector per union id, owner -> aggregator
        chunks = [
            _cat([] if p == me else [block(c, p) for c in self.cells_on[me]], self.acc, self.device)
            for p in rail
        ]
        counts = [
            0
            if o == me
            else sum(
                agg[(o, c.table, c.row_shard)].union.numel() * c.width for c in self.cells_on[o]
            )
            for o in rail
        ]
        got = self._a2a(chunks, counts, traffic, scope="rail")
        union_vals: dict[tuple[int, CellKey], Tensor] = {}
        for o, flat in zip(rail, got, strict=True):
            if o == me:
                continue
            pos = 0
            for c in self.cells_on[o]:
                u = agg[(o, c.table, c.row_shard)].union.numel()
                union_vals[(o, c)] = flat[pos : pos + u * c.width].reshape(u, c.width)
                pos += u * c.width
        # step 2b (NVLink): to every rank of the node, the vectors it asked this rank for,
        # as owner and as aggregator of the remote owners
        chunks = [
            _cat(
                [block(c, a) for c in self.cells_on[me]]
                + [
                    union_vals[(o, c)][agg[(o, c.table, c.row_shard)].positions[a]]
                    for o in remote
                    for c in self.cells_on[o]
                ],
                self.acc,
                self.device,
            )
            for a in node
        ]
        counts = [
            sum(
                self._wanted(splits, c) * c.width
                for r in [q, *self.remote_rail(q)]
                for c in self.cells_on[r]
            )
            for q in node
        ]
        got = self._a2a(chunks, counts, traffic, scope="node")
        for q, flat in zip(node, got, strict=True):
            self._place(table_rows, splits, flat, [q, *self.remote_rail(q)])
        saved["rows"], saved["blocks"], saved["agg"] = rows, blocks, agg

    # ------------------------------------------------------------------ backward
    def backward(self, saved, feats, grads, bvec, traffic) -> None:
        splits = saved["splits"]
        key_grads = {}
        for t in self.tables:
            fs = self.features[t.name]
            inv = splits[t.name].inverse
            parts, start = [], 0
            for f in fs:
                fi = feats[f.name]
                parts.append(
                    (inv[start : start + fi.ids.numel()], fi.slot_offsets().diff(), fi.weights)
                )
                start += fi.ids.numel()
            rows, offsets, weights = combine_bags(parts, any(f.weighted for f in fs), self.device)
            u = splits[t.name].unique.numel()
            idx, g, count = self.row_grads(
                self.table_unit_grads(t.name, feats, grads), rows, offsets, weights, u
            )
            if count is not None:
                key_grads[t.name] = scatter_padded(u, idx, g, count, self.acc)
                continue
            full = torch.zeros(u, t.dim, dtype=self.acc, device=self.device)
            full[idx] = g
            key_grads[t.name] = full

        def grads_for(owners: list[int]) -> Tensor:
            return _cat(
                [
                    key_grads[c.table][splits[c.table].index_of_shard[c.row_shard], c.lo : c.hi]
                    for o in owners
                    for c in self.cells_on[o]
                ],
                self.acc,
                self.device,
            )

        if self.hierarchical:
            per_cell = self._backward_hierarchical(saved, grads_for, traffic)
        else:
            per_cell = self._backward_flat(saved, grads_for, traffic)
        for c, received in per_cell.items():
            rows = saved["rows"][(c.table, c.row_shard)]
            g = (
                torch.cat(received)
                if received
                else torch.zeros(0, c.width, dtype=self.acc, device=self.device)
            )
            self.update_cell(c, rows, g)

    def _sizes(self, blocks, c: CellKey, a: int) -> int:
        s, e = blocks[(c.table, c.row_shard)][a]
        return e - s

    def _backward_flat(self, saved, grads_for, traffic) -> dict[CellKey, list[Tensor]]:
        """The owner's received gradients per cell, in the order of its rows."""
        comm, me = self.comm, self.comm.rank
        blocks = saved["blocks"]
        chunks = [grads_for([o]) for o in range(comm.world)]
        counts = [
            sum(self._sizes(blocks, c, a) * c.width for c in self.cells_on[me])
            for a in range(comm.world)
        ]
        got = self._a2a(chunks, counts, traffic)
        per_cell: dict[CellKey, list[Tensor]] = {c: [] for c in self.cells_on[me]}
        for a, flat in enumerate(got):
            pos = 0
            for c in self.cells_on[me]:
                n = self._sizes(blocks, c, a)
                per_cell[c].append(flat[pos : pos + n * c.width].reshape(n, c.width))
                pos += n * c.width
        return per_cell

    def _backward_hierarchical(self, saved, grads_for, traffic) -> dict[CellKey, list[Tensor]]:
        comm, me = self.comm, self.comm.rank
        node, rail = comm.peers("node"), comm.peers("rail")
        remote = self.remote_rail(me)
        mine = [me, *remote]
        blocks, agg = saved["blocks"], saved["agg"]

        def asked(a: int, r: int, c: CellKey) -> int:
            """Gradients rank a of the node sends this rank for cell c of owner r."""
            if r == me:
                return self._sizes(blocks, c, a)
            return agg[(r, c.table, c.row_shard)].positions[a].numel()

        # step 3a (NVLink): one gradient per distinct id to the owner (own node) or to the
        # aggregator; the aggregator sums its node's per union id, its own included
        got = self._a2a(
            [grads_for([q, *self.remote_rail(q)]) for q in node],
            [sum(asked(a, r, c) * c.width for r in mine for c in self.cells_on[r]) for a in node],
            traffic,
            scope="node",
        )
        received: dict[CellKey, dict[int, Tensor]] = {c: {} for c in self.cells_on[me]}
        summed = {
            (o, c): torch.zeros(
                agg[(o, c.table, c.row_shard)].union.numel(),
                c.width,
                dtype=self.acc,
                device=self.device,
            )
            for o in remote
            for c in self.cells_on[o]
        }
        for a, flat in zip(node, got, strict=True):
            pos = 0
            for r in mine:
                for c in self.cells_on[r]:
                    n = asked(a, r, c)
                    g = flat[pos : pos + n * c.width].reshape(n, c.width)
                    pos += n * c.width
                    if r == me:
                        received[c][a] = g
                    else:
                        where = agg[(r, c.table, c.row_shard)].positions[a]
                        self.kernels.scatter_add_rows(summed[(r, c)], where, g)
        # step 3b (network): one gradient per union id, aggregator -> owner
        got = self._a2a(
            [
                _cat(
                    [] if o == me else [summed[(o, c)] for c in self.cells_on[o]],
                    self.acc,
                    self.device,
                )
                for o in rail
            ],
            [
                0
                if p == me
                else sum(self._sizes(blocks, c, p) * c.width for c in self.cells_on[me])
                for p in rail
            ],
            traffic,
            scope="rail",
        )
        for p, flat in zip(rail, got, strict=True):
            if p == me:
                continue
            pos = 0
            for c in self.cells_on[me]:
                n = self._sizes(blocks, c, p)
                received[c][p] = flat[pos : pos + n * c.width].reshape(n, c.width)
                pos += n * c.width
        return {c: [received[c][a] for a in [*node, *remote]] for c in self.cells_on[me]}


CLUSTER_KINDS = {"dp": DpCluster, "rb": RbCluster, "ub": UbCluster}
