"""Exact migration cost between two plans: the bytes that move to go from A's checkpoint to B.

A checkpoint of plan A holds every table's trained weights and optimizer state, split
over ranks as A placed them. Starting B from it, every rank must receive, for every cell
B puts on it, the elements of that cell that A did not already keep on the same rank.

Counting rules (the contract of `migration_cost`; tests check it against an explicit
loop over every (table, row, column) element):

* Ranks are identified by number in both plans: rank r of A and rank r of B are the same
  GPU. The node of a source rank is `rank // gpus_per_node` of A, of a destination rank
  `rank // gpus_per_node` of B.
* Rows belong to row shards by each plan's own `row_partition` and each plan's row count
  of the table (`mod`: r % R; `range`: r // ceil(rows / R)); columns by the cells'
  `columns` ranges. A dp table is one cell `[0, rows) x [0, dim)` on every rank: present
  on every rank of A, needed on every rank of B. A rank that A does not have (B has more
  nodes) receives an A-dp table from A's rank `rank % world_A`.
* Only data that exists in A's checkpoint moves: rows below min(rows_A, rows_B) and
  columns below min(dim_A, dim_B) of tables present in both plans. Other rows, columns
  and tables of B start from their initialiser. Weights move in A's dtype.
* Optimizer state moves only when both plans use the same optimizer for the table
  (otherwise B starts it fresh). Element-wise state (adagrad's accumulator, adam's
  moments) moves with its element; row-wise state (rowwise_adagrad's accumulator, adam's
  step count) moves once per (destination rank, row) when the rank holds no cell of that
  row under A. It is sent by an A holder of the row on the destination's node if there is
  one, else by the holder of the row's first column cell.
* A sharded element has exactly one owner rank under A, which sends it.

Host tier (docs/host_tier.md, "Diff"): an element that stays on its rank but changes
tier, in HBM under one plan and in a host-tier cell under the other, is copied between
that rank's HBM and its node's host memory: `host_hbm` counts it apart (`to_hbm`,
`to_host`), weights and element-wise state with the element, row-wise state once per
(rank, row shard of B, row shard of A) whose tiers differ. A host-tier cell's whole rows
count, never its cache: the checkpoint holds the host copy (caches are flushed into it)
and loading invalidates the caches, which refill from host in the first steps. So a
change of cache size alone moves nothing, and an element that changes rank is counted
between ranks only (the sender reads it from its tier, the receiver writes it into its
own). `host_hbm` is None when neither plan has a host-tier cell.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict

from embark_runtime.dtypes import DTYPE_BYTES
from embark_runtime.optimizers import STATE_ELEMENT_BYTES, optimizer
from embark_runtime.plan import Plan, PlanTable


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodeFlow(_Frozen):
    """Bytes sent from the ranks of node `src` (under A) to the ranks of node `dst` (B)."""

    src: int
    dst: int
    bytes: int


class TableFlow(_Frozen):
    table: str
    weight_bytes: int
    state_bytes: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.state_bytes


class RankFlow(_Frozen):
    """Bytes a rank sends (as an A holder) and receives (for its B cells)."""

    rank: int
    sent: int
    received: int


class TableHostMove(_Frozen):
    """Bytes of one table copied between its ranks' HBM and host memory."""

    table: str
    to_hbm_bytes: int
    to_host_bytes: int


class HostMoves(_Frozen):
    """Bytes copied between a rank's HBM and its host memory (tier changes in place)."""

    to_hbm_bytes: int
    to_host_bytes: int
    by_table: tuple[TableHostMove, ...]
    """largest first"""

    @property
    def total_bytes(self) -> int:
        return self.to_hbm_bytes + self.to_host_bytes


class Migration(_Frozen):
    """Totals and breakdowns; every list is sorted deterministically (largest first)."""

    weight_bytes: int
    state_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    by_node: tuple[NodeFlow, ...]
    by_table: tuple[TableFlow, ...]
    by_rank: tuple[RankFlow, ...]
    fresh_tables: tuple[str, ...]
    """Tables of B that start from their initialiser (not in A)."""
    fresh_state_tables: tuple[str, ...]
    """Tables in both plans whose optimizer changed: B's optimizer state starts fresh."""
    host_hbm: HostMoves | None = None
    """Host tier: tier changes on the same rank (None: neither plan has host-tier cells)."""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes


@dataclass(frozen=True)
class _Cell:
    row_shard: int
    row_shards: int
    lo: int
    hi: int
    rank: int
    host: bool = False
    """a host-tier cell"""


def _cells(plan: Plan, table: PlanTable) -> tuple[bool, list[_Cell]]:
    """(is_dp, cells); a dp table is one full cell on every rank."""
    if plan.cluster_of(table.name).kind == "dp":
        return True, [_Cell(0, 1, 0, table.dim, r) for r in range(plan.world_size)]
    cells = [
        _Cell(s.row_shard, s.row_shards, s.columns[0], s.columns[1], s.rank, s.on_host)
        for s in plan.shards_of(table.name)
    ]
    return False, cells


def _range_block(rows: int, shards: int) -> int:
    return -(-rows // shards)


def _mod_in(lo: int, hi: int, shards: int) -> np.ndarray:
    """For every residue i < shards: how many x in [lo, hi) have x % shards == i."""
    i = np.arange(shards, dtype=np.int64)

    def below(x: int) -> np.ndarray:
        return np.maximum(0, (x - i + shards - 1) // shards)

    return below(hi) - below(lo)


def row_overlap(
    common_rows: int,
    a_partition: str,
    a_rows: int,
    a_shards: int,
    b_partition: str,
    b_rows: int,
    b_shards: int,
) -> np.ndarray:
    """Matrix M[i, j]: rows x < common_rows in row shard i of A and row shard j of B.

    Each side partitions its own row count (`a_rows`, `b_rows`) into its shards; only rows
    below `common_rows` (<= both) are counted. Exact, in O(lcm) for mod/mod and
    O(a_shards * b_shards) otherwise.
    """
    n = common_rows
    m = np.zeros((a_shards, b_shards), dtype=np.int64)
    if n <= 0:
        return m
    if a_partition == "mod" and b_partition == "mod":
        period = math.lcm(a_shards, b_shards)
        x = np.arange(min(period, n), dtype=np.int64)
        # x and x + k * period fall into the same pair of shards
        np.add.at(m, (x % a_shards, x % b_shards), (n - x + period - 1) // period)
        return m
    if a_partition == "range" and b_partition == "range":
        ba, bb = _range_block(a_rows, a_shards), _range_block(b_rows, b_shards)
        cuts = sorted(
            {0, n}
            | {k * ba for k in range(a_shards) if k * ba < n}
            | {k * bb for k in range(b_shards) if k * bb < n}
        )
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            m[lo // ba, lo // bb] += hi - lo
        return m
    if a_partition == "mod":  # b is range
        bb = _range_block(b_rows, b_shards)
        for j in range(b_shards):
            lo, hi = min(j * bb, n), min((j + 1) * bb, n)
            if hi > lo:
                m[:, j] = _mod_in(lo, hi, a_shards)
        return m
    return row_overlap(
        common_rows, b_partition, b_rows, b_shards, a_partition, a_rows, a_shards
    ).T.copy()


@dataclass(frozen=True)
class _Pair:
    """A table of both plans: its cells in each, the rows their row shards share, and the
    bytes an element and a row carry from A's checkpoint."""

    ta: PlanTable
    tb: PlanTable
    a_dp: bool
    a_cells: list[_Cell]
    b_cells: list[_Cell]
    overlap: np.ndarray
    """rows in row shard i of A and j of B (`row_overlap`)"""
    dim: int
    """columns that exist in both"""
    carry_state: bool
    elem_w: int
    elem_s: int
    row_s: int


def _common_tables(a: Plan, b: Plan):
    """A `_Pair` for every table of B that A has, in B's order."""
    a_tables = {t.name: t for t in a.tables}
    for tb in b.tables:
        ta = a_tables.get(tb.name)
        if ta is None:
            continue
        carry_state = ta.optimizer == tb.optimizer
        opt = optimizer(ta.optimizer)
        a_dp, a_cells = _cells(a, ta)
        _, b_cells = _cells(b, tb)
        ra, rb = a_cells[0].row_shards, b_cells[0].row_shards
        n = min(ta.rows, tb.rows)
        yield _Pair(
            ta=ta,
            tb=tb,
            a_dp=a_dp,
            a_cells=a_cells,
            b_cells=b_cells,
            overlap=row_overlap(n, a.row_partition, ta.rows, ra, b.row_partition, tb.rows, rb),
            dim=min(ta.dim, tb.dim),
            carry_state=carry_state,
            elem_w=DTYPE_BYTES[ta.dtype],
            elem_s=opt.per_element * STATE_ELEMENT_BYTES if carry_state else 0,
            row_s=opt.per_row * STATE_ELEMENT_BYTES if carry_state else 0,
        )


def migration_cost(a: Plan, b: Plan) -> Migration:
    """Bytes of weights and optimizer state that move between ranks from A's checkpoint to B.

    See the module docstring for the exact counting rules.
    """
    ga, gb = a.topology.gpus_per_node, b.topology.gpus_per_node
    a_tables = {t.name: t for t in a.tables}
    pair_bytes: dict[tuple[int, int], int] = defaultdict(int)
    by_table: list[TableFlow] = []
    fresh_state: list[str] = []

    for pair in _common_tables(a, b):
        tb, overlap, dim = pair.tb, pair.overlap, pair.dim
        a_cells, b_cells = pair.a_cells, pair.b_cells
        elem_w, elem_s, row_s = pair.elem_w, pair.elem_s, pair.row_s
        if not pair.carry_state:
            fresh_state.append(tb.name)
        if pair.a_dp:
            weight = state = 0
            new_shards: set[tuple[int, int]] = set()
            for cb in b_cells:
                if cb.rank < a.world_size:
                    continue
                src, rows = cb.rank % a.world_size, int(overlap[0, cb.row_shard])
                cols = max(0, min(cb.hi, dim) - cb.lo)
                w, s = rows * cols * elem_w, rows * cols * elem_s
                if (cb.rank, cb.row_shard) not in new_shards:
                    new_shards.add((cb.rank, cb.row_shard))
                    s += rows * row_s
                weight += w
                state += s
                pair_bytes[(src, cb.rank)] += w + s
            by_table.append(TableFlow(table=tb.name, weight_bytes=weight, state_bytes=state))
            continue
        a_by_shard: dict[int, list[_Cell]] = defaultdict(list)
        for c in sorted(a_cells, key=lambda c: (c.row_shard, c.lo)):
            a_by_shard[c.row_shard].append(c)
        a_shards_on: dict[int, set[int]] = defaultdict(set)
        for c in a_cells:
            a_shards_on[c.rank].add(c.row_shard)
        weight = state = 0

        for cb in b_cells:
            lo_b, hi_b = cb.lo, min(cb.hi, dim)
            if hi_b <= lo_b:
                continue
            for i in np.flatnonzero(overlap[:, cb.row_shard]).tolist():
                rows = int(overlap[i, cb.row_shard])
                for ca in a_by_shard[i]:
                    if ca.rank == cb.rank:
                        continue
                    cols = min(ca.hi, hi_b) - max(ca.lo, lo_b)
                    if cols <= 0:
                        continue
                    w, s = rows * cols * elem_w, rows * cols * elem_s
                    weight += w
                    state += s
                    pair_bytes[(ca.rank, cb.rank)] += w + s

        if row_s:
            b_shards_on: dict[int, set[int]] = defaultdict(set)
            for c in b_cells:
                b_shards_on[c.rank].add(c.row_shard)
            for rank in sorted(b_shards_on):
                held = a_shards_on.get(rank, set())
                for j in sorted(b_shards_on[rank]):
                    for i in np.flatnonzero(overlap[:, j]).tolist():
                        if i in held:
                            continue
                        holders = a_by_shard[i]
                        same_node = [c for c in holders if c.rank // ga == rank // gb]
                        src = (same_node or holders)[0].rank
                        s = int(overlap[i, j]) * row_s
                        state += s
                        pair_bytes[(src, rank)] += s
        by_table.append(TableFlow(table=tb.name, weight_bytes=weight, state_bytes=state))

    node_bytes: dict[tuple[int, int], int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    intra = inter = 0
    for (src, dst), nbytes in pair_bytes.items():
        if nbytes == 0:
            continue
        node_pair = (src // ga, dst // gb)
        node_bytes[node_pair] += nbytes
        sent[src] += nbytes
        received[dst] += nbytes
        if node_pair[0] == node_pair[1]:
            intra += nbytes
        else:
            inter += nbytes
    return Migration(
        weight_bytes=sum(t.weight_bytes for t in by_table),
        state_bytes=sum(t.state_bytes for t in by_table),
        intra_node_bytes=intra,
        inter_node_bytes=inter,
        by_node=tuple(
            NodeFlow(src=s, dst=d, bytes=v)
            for (s, d), v in sorted(node_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
        ),
        by_table=tuple(sorted((t for t in by_table if t.bytes), key=lambda t: (-t.bytes, t.table))),
        by_rank=tuple(
            RankFlow(rank=r, sent=sent.get(r, 0), received=received.get(r, 0))
            for r in sorted(set(sent) | set(received))
        ),
        fresh_tables=tuple(t.name for t in b.tables if t.name not in a_tables),
        fresh_state_tables=tuple(fresh_state),
        host_hbm=host_moves(a, b),
    )


def host_moves(a: Plan, b: Plan) -> HostMoves | None:
    """Bytes copied between a rank's HBM and host memory from A's checkpoint to B (the
    module docstring's host-tier rule); None when neither plan has a host-tier cell."""
    if not any(s.on_host for s in a.shards) and not any(s.on_host for s in b.shards):
        return None
    rows_out: list[TableHostMove] = []
    for pair in _common_tables(a, b):
        tb, overlap, dim, row_s = pair.tb, pair.overlap, pair.dim, pair.row_s
        a_cells, b_cells = pair.a_cells, pair.b_cells
        elem = pair.elem_w + pair.elem_s
        a_on: dict[int, list[_Cell]] = defaultdict(list)
        for c in a_cells:
            a_on[c.rank].append(c)
        moved = {True: 0, False: 0}  # by B's side: into host (True) or into HBM
        row_pairs: set[tuple[int, int, int]] = set()
        for cb in b_cells:
            for ca in a_on.get(cb.rank, []):
                if ca.host == cb.host:
                    continue
                rows = int(overlap[ca.row_shard, cb.row_shard])
                cols = min(ca.hi, cb.hi, dim) - max(ca.lo, cb.lo)
                if rows <= 0 or cols <= 0:
                    continue
                moved[cb.host] += rows * cols * elem
                if row_s and (cb.rank, cb.row_shard, ca.row_shard) not in row_pairs:
                    row_pairs.add((cb.rank, cb.row_shard, ca.row_shard))
                    moved[cb.host] += rows * row_s
        if moved[True] or moved[False]:
            rows_out.append(
                TableHostMove(table=tb.name, to_hbm_bytes=moved[False], to_host_bytes=moved[True])
            )
    return HostMoves(
        to_hbm_bytes=sum(t.to_hbm_bytes for t in rows_out),
        to_host_bytes=sum(t.to_host_bytes for t in rows_out),
        by_table=tuple(
            sorted(rows_out, key=lambda t: (-(t.to_hbm_bytes + t.to_host_bytes), t.table))
        ),
    )
