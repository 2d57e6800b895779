"""Placement heuristics: where a unit's cells go on the ranks.

    Decision                      a unit's kind, grid (r x c) and communication
    unit_cells(cm, u, d)          a sharded unit's cells, their loads and memory
    best_node(...)                the node whose ranks a one-node unit leaves least loaded
    place_interleaved(...)        every cell, heaviest first, on the least-loaded rank with room

Loads are the seconds a cell puts on its owner (`cost.owner_seconds`); room is the weights,
state and buffers within `hbm_bytes - memory_headroom`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embarkc.planner.clusters import (
    Unit,
)
from embarkc.planner.cost import CostModel, owner_seconds
from embarkc.planner.search.tuning import HEAP_POPS, OWN_HEAP_CELLS
from embarkc.planner.types import Placement, column_widths


@dataclass(frozen=True)
class Decision:
    kind: str
    r: int = 1
    c: int = 1
    comm: str = "flat"

    @property
    def hierarchical(self) -> bool:
        return self.kind == "rb" and self.comm == "hierarchical"

    def placement(self, dim: int) -> Placement:
        """The r x c grid of a sharded kind for a table of width `dim`, every cell on
        rank 0 (a template: the search assigns the ranks)."""
        return Placement(
            kind=self.kind,  # type: ignore[arg-type]
            row_shards=self.r,
            widths=column_widths(dim, self.c),
            ranks=(0,) * (self.r * self.c),
            communication="hierarchical" if self.comm == "hierarchical" else "flat",
        )


def one_node(u: Unit, d: Decision) -> bool:
    """Whether the unit's cells all go to the node of its first cell: a `within_node`
    constraint, or hierarchical rb, whose partials are summed inside the owner node so
    that one vector per sample crosses the network only when every row shard is there."""
    return u.within_node or d.hierarchical


def best_node(
    cm: CostModel,
    ref: np.ndarray,
    mem: np.ndarray,
    free: float,
    load_c: np.ndarray,
    mem_c: np.ndarray,
) -> int | None:
    """The node on which cells (loads `load_c`, memory `mem_c`, heaviest first), placed
    each on the least-loaded rank of the node with room, leave the smallest maximum of
    `ref` (then the smallest sum); None when no node has room for all of them."""
    N, G = cm.nodes, cm.G
    t = ref.reshape(N, G).copy()
    m = mem.reshape(N, G).copy()
    n = len(load_c)
    if 0 < n <= G and float(m.max()) + float(mem_c.max()) <= free and np.isfinite(t).all():
        # every rank has room for any one cell and each gets at most one: the cells go,
        # heaviest first, to the ranks in order of load (ties by index), where the loop
        # would place them one by one (planning time: most units have at most G cells)
        order = np.argsort(t, axis=1, kind="stable")[:, :n]
        t[np.arange(N)[:, None], order] += load_c[None, :]
        return int(np.lexsort((t.sum(axis=1), t.max(axis=1)))[0])
    return _best_node_placed(t, m, free, load_c, mem_c)


def _best_node_placed(
    t: np.ndarray, m: np.ndarray, free: float, load_c: np.ndarray, mem_c: np.ndarray
) -> int | None:
    """`best_node` on loads `t` and memory `m` of shape (nodes, G), `t` changed in place:
    on each node the cells placed one at a time by `_heap_place` (a rank no cell of the
    unit holds first). Planning time: the cells were placed on all nodes at once with a
    dozen numpy calls per cell, a third of the search on hierarchical programs whose units
    have tens of cells (30 tables on 8 x 8 GPUs at 90 % of their memory)."""
    N, G = t.shape
    ok = np.ones(N, dtype=bool)
    loads = load_c.tolist()
    mems = mem_c.tolist()
    least = np.minimum.accumulate(mem_c[::-1])[::-1].tolist() if len(mems) else []
    times, held = t.tolist(), m.tolist()
    cand = list(range(G))
    for n in range(N):
        try:
            _heap_place(times[n], held[n], cand, loads, mems, least, free)
        except RanksFull:
            ok[n] = False
    if not ok.any():
        return None
    t[...] = times
    worst = np.where(ok, t.max(axis=1), np.inf)
    total = np.where(ok, t.sum(axis=1), np.inf)
    return int(np.lexsort((total, worst))[0])


def unit_cells(
    cm: CostModel, u: Unit, d: Decision
) -> tuple[np.ndarray, np.ndarray, list[tuple[str, Placement]]]:
    """Per-cell proxy load (`owner_seconds`) and memory
    of a unit's grid `d` (summed over its tables), and each table's template placement."""
    n = d.r * d.c
    load = np.zeros(n)
    mem = np.zeros(n)
    templates = []
    for name in u.tables:
        tf = cm.facts[name]
        p = d.placement(tf.dim)
        cv = cm.grid_values(tf, p)
        load += owner_seconds(cm, cv, p.hierarchical)
        mem += cv.weights + cv.state + cv.buf_own
        templates.append((name, p))
    return load, mem, templates


class RanksFull(Exception):
    """`assign_heaps`: a cell finds no rank with room."""


def assign_heaps(
    mem: np.ndarray,
    free: float,
    allowed: np.ndarray,
    order: np.ndarray,
    load_c: np.ndarray,
    mem_c: np.ndarray,
    ref: np.ndarray,
) -> np.ndarray:
    """The ranks of `Search._assign` for the cells in `order`, in that order, with `ref`
    updated by what they add; raises RanksFull, changing nothing, when a cell finds no rank
    with room. Each cell goes to the allowed rank with room of least `ref` (ties to the
    lower rank), among the ranks no cell of the unit holds yet when one of those has room
    (`_heap_place`). Planning time: a loop of numpy calls over all ranks per cell, which
    this replaced, took most of the search on units of hundreds of cells (12 tables on
    128 GPUs at 90 % of their memory: 1.6 million numpy calls, 25 of 32 s)."""
    cand = np.flatnonzero(allowed)
    times = ref.tolist()
    least = np.minimum.accumulate(mem_c[order][::-1])[::-1].tolist() if len(order) else []
    placed = _heap_place(
        times,
        mem.tolist(),
        cand.tolist(),
        load_c[order].tolist(),
        mem_c[order].tolist(),
        least,
        free,
    )
    ref[cand] = np.asarray(times)[cand]
    return np.asarray(placed, dtype=np.int64)


def _heap_place(
    times: list[float],
    held: list[float],
    cand: list[int],
    loads: list[float],
    mems: list[float],
    least: list[float],
    free: float,
) -> list[int]:
    """Ranks for cells of loads `loads` and memory `mems`, in that order, among the ranks
    `cand` (ascending) of `times` and `held` (both updated in place; raises RanksFull, with
    `times` maybe changed, when a cell finds no rank with room): each cell to the rank
    with room of least time (ties to the lower rank), among the ranks no earlier cell took
    when one of those has room. Two heaps of (time, rank), fresh and used; the ranks
    without room for the cell are set aside and put back after it, dropped when they have
    none for `least[k]`, the smallest cell from the k-th on."""
    fresh = [(times[a], a) for a in cand]
    fresh.sort()  # a valid heap as it is
    used: list[tuple[float, int]] = []
    out = []
    for k, mc in enumerate(mems):
        a = -1
        for heap in (fresh, used):
            aside = []
            while heap:
                t, b = heapq.heappop(heap)
                if held[b] + mc <= free:
                    a = b
                    break
                if held[b] + least[k] <= free:
                    aside.append((t, b))
            for item in aside:
                heapq.heappush(heap, item)
            if a >= 0:
                break
        if a < 0:
            raise RanksFull
        times[a] += loads[k]
        held[a] += mc
        heapq.heappush(used, (times[a], a))
        out.append(a)
    return out


def place_interleaved(
    loads: np.ndarray,
    mem: np.ndarray,
    free: float,
    cells: list[tuple[int, int]],
    load_cs: list[np.ndarray],
    mem_cs: list[np.ndarray],
    restricted: list[bool],
    node_of: np.ndarray,
    node_for: Callable[[int], int | None],
) -> list[np.ndarray]:
    """`Search.place_all`'s placement of the cells `(unit, cell)`, in that order, with
    `loads` and `mem` (per rank) updated in place; raises RanksFull(unit) when a cell finds no
    rank with room. Each cell goes to the rank with room of least load (ties to the lower
    rank) among its unit's allowed ranks, those no cell of the unit holds first when one
    of those has room; a `restricted` unit's allowed ranks are the node `node_for(unit)`
    names at its first cell (None: any rank). It is the rule of the loop of half a dozen
    numpy calls over all ranks per cell that it replaced (374,000 cells, 4.4 of 4.7 s,
    where 5 tables on 128 GPUs at 90 % were cut ever finer to find no room), made from
    lazy heaps of (load, rank): loads only grow, so an entry below its rank's load is
    stale and goes back with the load. A rank without room for the smallest cell still to
    place leaves a heap for good."""
    W = len(loads)
    L, M = loads.tolist(), mem.tolist()
    lcs = [x.tolist() for x in load_cs]
    mcs = [x.tolist() for x in mem_cs]
    order_mem = np.array([mcs[u][c] for u, c in cells], dtype=np.float64)
    least = np.minimum.accumulate(order_mem[::-1])[::-1].tolist()
    finite = bool(np.isfinite(loads).all()) and all(
        bool(np.isfinite(x).all()) and (len(x) == 0 or float(x.min()) >= 0.0) for x in load_cs
    )
    pops = HEAP_POPS if finite else 0  # lazy heaps need loads that only grow
    shared: dict[int | None, list[tuple[float, int]]] = {None: sorted((L[a], a) for a in range(W))}
    U = len(load_cs)
    out = [np.full(len(x), -1, dtype=np.int64) for x in load_cs]
    begun = [False] * U
    node: list[int | None] = [None] * U
    own: list[list[tuple[float, int]] | None] = [None] * U
    used: list[set[int]] = [set() for _ in range(U)]
    used_heap: list[list[tuple[float, int]]] = [[] for _ in range(U)]

    def search(
        heap: list[tuple[float, int]], skip: set[int] | None, drop_used: bool, mc: float, lk: float
    ) -> tuple[int, bool]:
        """(rank, whether the heap was searched to its end) for a cell of memory `mc`."""
        aside = []
        a = -1
        left = pops
        while heap and left:
            left -= 1
            t, b = heapq.heappop(heap)
            if t != L[b]:
                heapq.heappush(heap, (L[b], b))
                continue
            if skip is not None and b in skip:
                if not drop_used:
                    aside.append((t, b))
                continue
            if M[b] + mc <= free:
                a = b
                break
            if M[b] + lk <= free:
                aside.append((t, b))
        done = a >= 0 or not heap
        for item in aside:
            heapq.heappush(heap, item)
        return a, done

    for k, (ui, ci) in enumerate(cells):
        lc, mc, lk = lcs[ui][ci], mcs[ui][ci], least[k]
        n_cells = len(lcs[ui])
        if not begun[ui]:
            begun[ui] = True
            if restricted[ui]:
                node[ui] = node_for(ui)
            ranks = range(W) if node[ui] is None else np.flatnonzero(node_of == node[ui]).tolist()
            if node[ui] is not None and node[ui] not in shared:
                shared[node[ui]] = sorted((L[a], a) for a in ranks)
            if n_cells > 1 and (n_cells >= OWN_HEAP_CELLS or 4 * n_cells >= len(ranks)):
                own[ui] = sorted((L[a], a) for a in ranks)
        single = n_cells == 1
        mine = used[ui]
        heap = own[ui]
        from_shared = heap is None
        if heap is None:
            heap = shared[node[ui]]
        a, done = search(heap, None if single else mine, not from_shared, mc, lk)
        src = "fresh" if a >= 0 else ""
        if a < 0 and done and not single:
            a, done = search(used_heap[ui], None, False, mc, lk)
            src = "used" if a >= 0 else ""
        if a < 0 and done:
            raise RanksFull(ui)
        if a < 0:
            # the numpy rule itself
            room = mem + mc <= free
            if node[ui] is not None:
                room &= node_of == node[ui]
            cand = room
            if not single and mine:
                held = np.zeros(W, dtype=bool)
                held[list(mine)] = True
                fresh = room & ~held
                cand = fresh if fresh.any() else room
            if not cand.any():
                raise RanksFull(ui)
            a = int(np.argmin(np.where(cand, loads, np.inf)))
        L[a] += lc
        M[a] += mc
        loads[a] = L[a]
        mem[a] = M[a]
        out[ui][ci] = a
        if src == "fresh" and from_shared:
            heapq.heappush(heap, (L[a], a))
        if not single:
            if a not in mine:
                mine.add(a)
                heapq.heappush(used_heap[ui], (L[a], a))
            elif src == "used":
                heapq.heappush(used_heap[ui], (L[a], a))
    return out


class NoRoom(Exception):
    def __init__(self, unit: Unit):
        self.unit = unit


@dataclass
class _Applied:
    ranks: np.ndarray
    load: np.ndarray
    mem: np.ndarray
    uniform_load: float
    uniform_mem: float

    def load_on(self, rank: int) -> float | None:
        """What the unit's cells put on `rank` (None when none is there)."""
        if rank not in self.rank_set:
            return None
        return float(self.load[self.ranks == rank].sum())

    @property
    def rank_set(self) -> frozenset[int]:
        rs = self.__dict__.get("_rank_set")
        if rs is None:
            rs = frozenset(self.ranks.tolist())
            self.__dict__["_rank_set"] = rs
        return rs
