"""EMBark's greedy search: place cells by cost, split what is on the critical rank.

1. Every unit (a table or a colocate group) starts with a kind (`clusters.initial_kinds`,
   or rb for every unit in the second start) and the smallest grid whose cells fit
   comfortably (`clusters.initial_grid`). On several nodes, when the spec leaves the
   communication to the planner, a further start makes every rb unit hierarchical
   (`hierarchical_start`). When the keys hide under the dense compute, the first start
   is also searched with its heavy units cut into columns, once per cell size of
   COLUMN_SHARES (`column_start`). All ub units of a start share one communication,
   flat or hierarchical (ids deduplicated per node before the network, on the owner's
   rail peer there: docs/communication.md); where the spec leaves it to the planner on
   several nodes, small programs search both (`_ub_worlds`), large ones the one whose
   first start has less work (`choose_ub_comm`). Small programs also start from the kinds
   of the lower bound's kind set (`bound_start`, and its column starts): kinds that share
   a cluster's fixed costs, which no single unit's choice or move reaches.
2. `place_all`: all cells, heaviest first, each on the least-loaded rank that has room
   (load = the seconds a cell puts on its owner, `cost.owner_seconds`, keys only beyond
   the dense compute window; room = weights, state and buffers within
   `hbm_bytes - memory_headroom`). Cells of one unit prefer
   distinct ranks. `within_node` units and hierarchical rb units keep all their cells on
   one node (`one_node`): the node whose ranks they leave least loaded (`best_node`).
   A hierarchical table's partials are summed inside that node, so one vector per
   sample crosses the network, and each of the node's NICs sends its rail's share.
3. `Search.improve`: on the critical rank of the exact cost model, for the units that
   load it most (and the units alone in their cluster kind), try re-placing the unit,
   row and column splits and merges (cuts at multiples of 4), rows traded for columns,
   another kind and, for rb, the other communication; keep the move that lowers the
   16-norm of the rank times most; stop when no move helps. The best step time seen wins.
4. `Search.polish`: for the heaviest units of the critical rank, their moves and wider
   grids (`POLISH_GRIDS`), judged by the step time itself; a few rounds. The norm's
   descent stops in local minima that a jump to a grid several steps away leaves
   (T510 on 128 GPUs with the keys in full and flat ub: 6.50 -> 5.87 ms). Descent and
   polish repeat while the step time falls (`DESCENT_CYCLES`).
5. A fresh heaviest-first placement of the final grids, improved again; the faster of the
   two, and of the starts, is kept.
6. `Search.rebalance` (programs of up to FOUR_START_UNITS units): single cells of the
   critical rank moved, or swapped with lighter cells, onto the least-loaded ranks and
   the ranks of their node, by the exact model.
7. `balanced_phases`: the critical path (every phase at its slowest rank,
   `RankState.critical_path`) lowered by cell and unit moves that do not raise the step
   time (`Search.balance_phases`); the result is returned.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np

from embarkc.diagnostics import EmbarkError
from embarkc.planner.baselines import column_wise_cells
from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    Unit,
    check_fits,
    default_comm,
    dp_bytes,
    dp_total_seconds,
    initial_grid,
    initial_kinds,
    sharded_total_seconds,
    smaller_tables,
    unit_bytes,
    units_of,
)
from embarkc.planner.cost import CostModel, RankState, owner_seconds, phase_times
from embarkc.planner.types import Layout, Placement, column_widths
from embarkc.units import format_bytes

Progress = Callable[[str, float, float], None]
"""progress(stage, fraction done, best step time so far)."""

_S = TypeVar("_S")
"""What `Search.judged` judges a layout by."""


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


MULTI_START_UNITS = 1000
"""Above this many units the greedy searches one start only (planning time)."""

FINE_START_RANKS = (128, 256)
"""On more ranks than the first, programs of more than FOUR_START_UNITS units also start
from the column-wise strategy's grids (`fine_column_start`), as programs of more than
MULTI_START_UNITS units do on any number of ranks; on up to the second, after their other
starts (where a short limit ends the search before it, it takes nothing from them)."""

FOUR_START_UNITS = 300
"""Up to this many units each start is also searched placing cells by owner loads alone
(the other mode places them by the full model's rank times): neither mode wins always."""

COLUMN_SHARES = (0.95, 0.63, 0.42, 0.28, 0.19)
"""The cell sizes `column_start` is run with, as fractions of a rank's fair share of the
owners' work: a geometric ladder of ratio 1.5, each searched and the fastest kept. Finer
cells pack the ranks closer but add work (narrow cells pay whole DRAM sectors, and every
cell reads its ids again), and where the balance lies depends on the workload: on 128 GPUs the best
share is 0.42-0.63 for T180 (4.241 ms; 4.544 at 0.25 alone), 0.63 for T200 (3.224; 3.310),
0.19 for T510 (4.709; 4.989), and a descent from each ends in its own local minimum
(T180: 4.478, 4.554, 4.242, 4.241, 4.480 from fine to coarse)."""

COLUMN_ONLY_RANKS = 64
"""On more ranks than this, a program of more than FOUR_START_UNITS units whose keys hide
searches the column start alone: a descent's cost grows with the ranks (T510 on 128
GPUs: the first start's took 1.2 s), while on T510 at 32 GPUs the first start still
wins (13.750 ms against 13.767) in a fraction of a second."""

P_NORM = 16.0
"""Exponent of the norm the search descends on (see `Search.score`)."""

POLISH_GRIDS = tuple((r, c) for r in (1, 2, 4, 8) for c in (1, 2, 4))
"""Grids the polish (`Search.polish`) tries for the heaviest units of the critical rank,
beside their neighbouring grids: jumps that single steps of the descent cannot make."""

DESCENT_CYCLES = 4
"""Rounds of descent and polish `_descend` repeats while the step time falls (the polish
moves the critical rank, so the next descent starts elsewhere); one round for programs
of more than FOUR_START_UNITS units (planning time)."""

POLISH_ROUNDS = 6
"""Moves the polish applies at most (each one a full scan of its candidates)."""

REBALANCE_EVALS = 6000
"""Layouts `Search.rebalance` evaluates at most (about 0.2 ms each on 128 GPUs, by
`RankState.move_cell`). The gains come after long plateaus of equal ranks: T200 on 128
GPUs 3.224 ms, 3.224 after 1,000 evaluations, 3.112 after 3,000; T180 on 8 GPUs 37.401,
37.139 after 1,000, 37.056 after 3,000, 37.023 after 6,000; DCNv2 on 32 GPUs 1.233,
1.219, 1.212, 1.198 (1.196 after 12,000)."""

REBALANCE_FIRST_EVALS = 10_000
"""Layouts the second pass of `Search.rebalance` (`first=True`: the heaviest cell of the
critical rank that has a move takes its best one, partners of any size) evaluates at
most. A pass that looks at every cell before it moves one spends its budget on a single
round where the critical rank holds many cells: T510 on 32 GPUs 12.634 ms, 12.620 after
10,000 evaluations that way, 11.698 after 10,000 this way (about 1 s; whole rb tables
swap with column cells of other tables: a rank whose links receive more than they send
carries more results for nothing, and one whose HBM is busy sheds lookups). It keeps
the column cells of one row shard on distinct ranks. On the paper's programs of up to
FOUR_START_UNITS units it gains up to 0.5 % (DCNv2 on 128 GPUs 0.636 -> 0.633 ms, T180
on 128 GPUs 4.199 -> 4.184)."""

PHASE_EVALS = 16000
"""Layouts one pass of `Search.balance_phases` evaluates at most (cell moves and unit
moves alike) on programs of up to FOUR_START_UNITS units. Where many ranks share a
phase's maximum, every one of them must shed work before the critical path falls: T200
on 128 GPUs (10 ranks tied in its lookups and results) gains nothing within 4,000
layouts and 3.372 -> 3.279 ms (step 3.112 -> 3.107) within 16,000, in 1.3 s of CPU; on
32 GPUs 9.754 -> 9.569 (step 9.474 -> 9.395) in 4.2 s. T180 on 128 GPUs: four passes in
1.1 s, the same plan as with 4,000."""

PHASE_EVALS_LARGE = 4000
"""The same for larger programs (planning time: T510 on 128 GPUs, one pass in 0.55 s)."""

RUNS_SHARE = 0.6
"""Share of a greedy's work budget (`greedy`'s `budget`) after which no further start
begins and the later starts' descents stop; the rest is for the rebalance and the phase
passes (T180 on 128 GPUs: its 20 runs take 7.8 s of its 11.4 s of work, the rebalance 1.2
and the phase pass 1.9). Before the later descents stopped there too, one begun just
under it ran to the end of the budget and the passes after it ran past: T180 on 16 x 8
GPUs at `--time-limit 2` took 1.9-2.0 s (now 1.6 s, its plan 4.716 -> 4.880 ms; at 5 s
4.199 -> 4.178, T200 3.237 -> 3.208)."""

PHASE_PASSES = 4
"""Passes of `Search.balance_phases` at most (`balanced_phases`; one for programs of more
than FOUR_START_UNITS units)."""

PHASE_MIN_GAIN = 0.01
"""`balanced_phases` stops after a pass that lowered the critical path by less than this
share (planning time; T180 on 128 GPUs 5.026 -> 4.779 -> 4.729 -> 4.581 ms, then
nothing)."""

REBALANCE_TARGETS = 16
"""`Search.rebalance` tries the critical rank's cells on this many of the least-loaded
ranks, and on every rank of the critical rank's node."""


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
        except _Full:
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


class _Full(Exception):
    """`_assign_heaps`: a cell finds no rank with room."""


def _assign_heaps(
    mem: np.ndarray,
    free: float,
    allowed: np.ndarray,
    order: np.ndarray,
    load_c: np.ndarray,
    mem_c: np.ndarray,
    ref: np.ndarray,
) -> np.ndarray:
    """The ranks of `Search._assign` for the cells in `order`, in that order, with `ref`
    updated by what they add; raises _Full, changing nothing, when a cell finds no rank
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
    `cand` (ascending) of `times` and `held` (both updated in place; raises _Full, with
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
            raise _Full
        times[a] += loads[k]
        held[a] += mc
        heapq.heappush(used, (times[a], a))
        out.append(a)
    return out


HEAP_POPS = 32
"""Heap entries `_place_interleaved` looks at for one cell before it decides by numpy
calls over all ranks (where many ranks lack room for the cell, or its unit's ranks fill
the head of a shared heap). Either way the cell goes to the same rank."""

OWN_HEAP_CELLS = 16
"""Units of at least this many cells (or of a quarter of their allowed ranks) get a heap
of their own fresh ranks in `_place_interleaved`; smaller ones share one heap of all
ranks (per node for one-node units) and skip the ranks they already hold."""


def _place_interleaved(
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
    `loads` and `mem` (per rank) updated in place; raises _Full(unit) when a cell finds no
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
            raise _Full(ui)
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
                raise _Full(ui)
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


class Search:
    """Greedy placement state: proxy loads and memory per rank, plus the exact RankState."""

    def __init__(
        self,
        cm: CostModel,
        units: list[Unit],
        progress: Progress | None = None,
        exact_ref: bool = True,
        ub_comm: str | None = None,
        *,
        meter: WorkMeter,
    ):
        self.cm = cm
        self.meter = meter
        """Where this search counts its work, and the deadline its passes stop at."""
        self.exact_ref = exact_ref
        self.ub_comm = ub_comm if ub_comm is not None else default_comm(cm, "ub")
        """The communication a unit gets when a move makes it ub (`choose_ub_comm`)."""
        self.units = units
        self.by_name = {u.name: u for u in units}
        self.progress = progress
        self.comm_mode = cm.program.options.communication
        self.cut_short = False
        """`_place_splitting` gave up at its deadline (no start had fit yet)."""
        self.reset()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        W = self.cm.W
        self.loads = np.zeros(W)
        self.mem = np.zeros(W)
        self.uniform_load = 0.0
        self.uniform_mem = 0.0
        self.layout: Layout = {}
        self.applied: dict[str, _Applied] = {}
        self.decisions: dict[str, Decision] = {}
        self.state = RankState(self.cm, self.meter)

    def _cells(
        self, u: Unit, d: Decision
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, Placement]]]:
        return unit_cells(self.cm, u, d)

    def _room_everywhere(self, extra: float) -> bool:
        """Whether every rank has room for `extra` more bytes (what a unit puts on all)."""
        return float(self.mem.max()) + self.uniform_mem + extra <= self.cm.capacity

    def _uniform_bytes(self, templates: list[tuple[str, Placement]]) -> float:
        """Bytes a sharded unit puts on every rank: the requesters' buffers."""
        cm = self.cm
        return float(sum(cm.grid_values(cm.facts[n], p).buf_all for n, p in templates))

    def _node_send(self, u: Unit, d: Decision) -> float:
        """Result bytes a hierarchical rb unit on one node returns to each requester on
        another node (one vector per column range; 0 for other kinds): every rank of the
        node sends that much to each of its rail's remote ranks."""
        cm = self.cm
        if not d.hierarchical or cm.nodes == 1:
            return 0.0
        total = 0.0
        for name in u.tables:
            cv = cm.grid_values(cm.facts[name], d.placement(cm.facts[name].dim))
            total += float(cv.res[cv.j == 0].sum())
        return total

    def _dp(self, u: Unit) -> tuple[float, float, list[tuple[str, Placement]]]:
        cm = self.cm
        load = 0.0
        out = []
        for name in u.tables:
            tf = cm.facts[name]
            ex = cm.best_exchange(tf)
            dv = cm.dp_values(tf, ex)
            load += dv.hbm / cm.bw_hbm + dv.exchange_time
            out.append((name, Placement(kind="dp", exchange=ex)))  # type: ignore[arg-type]
        return load, dp_bytes(cm, u), out

    def remove(self, u: Unit) -> None:
        a = self.applied.pop(u.name)
        np.add.at(self.loads, a.ranks, -a.load)
        np.add.at(self.mem, a.ranks, -a.mem)
        self.uniform_load -= a.uniform_load
        self.uniform_mem -= a.uniform_mem
        for name in u.tables:
            self.state.add_table(name, self.layout.pop(name), -1.0)
        del self.decisions[u.name]

    def place(self, u: Unit, d: Decision, ref: np.ndarray | None = None) -> None:
        """Place one unit with decision `d` on the current loads (raises NoRoom); `ref`:
        the rank times of the current state when the caller has them (it is consumed)."""
        if d.kind != "dp":
            load_c, mem_c, templates, uni = self._prepare(u, d)
            if not self._room_everywhere(uni):
                raise NoRoom(u)
            order = np.argsort(-load_c, kind="stable")
            send = self._node_send(u, d)
            ranks = self._assign(u, order, load_c, mem_c, ref, one_node(u, d), send, uni)
            self.uniform_mem += uni
            self._install(u, d, load_c, mem_c, templates, ranks, uni)
            return
        load, mem, placements = self._dp(u)
        if not self._room_everywhere(mem):
            raise NoRoom(u)
        self.uniform_load += load
        self.uniform_mem += mem
        empty = np.zeros(0, dtype=np.int64)
        self.applied[u.name] = _Applied(empty, np.zeros(0), np.zeros(0), load, mem)
        for name, p in placements:
            self.layout[name] = p
            self.state.add_table(name, p, 1.0)
        self.decisions[u.name] = d

    def _assign(
        self,
        u: Unit,
        order: np.ndarray,
        load_c: np.ndarray,
        mem_c: np.ndarray,
        ref: np.ndarray | None = None,
        one_node: bool = False,
        node_send: float = 0.0,
        uniform: float = 0.0,
    ) -> np.ndarray:
        """Ranks for the unit's cells in `order`; `uniform`: bytes the unit puts on every
        rank besides its cells (the requesters' communication buffers)."""
        cm = self.cm
        allowed = np.ones(cm.W, dtype=bool)
        free = cm.capacity - self.uniform_mem - uniform
        # rank times of the exact model without this unit (or the owner loads alone, in
        # the owner-load mode), plus what its cells add
        if not self.exact_ref:
            ref = self.loads.copy()
        elif ref is None:
            ref = self.state.times()
        if one_node:
            if node_send > 0 and self.exact_ref:
                # every rank of the owner node sends its rail's share of the results, and
                # the node's own requesters receive them over NVLink instead
                sent, received = self.state.links()["res_inter"]
                n1 = cm.nodes - 1
                ref += (
                    2.0
                    * (
                        np.maximum(sent + n1 * node_send, received - node_send)
                        - np.maximum(sent, received)
                    )
                    / cm.bw_inter
                )
            node = best_node(cm, ref, self.mem, free, load_c[order], mem_c[order])
            if node is not None:
                allowed = cm.node_of == node
            elif u.within_node:
                raise NoRoom(u)
        try:
            placed = _assign_heaps(self.mem, free, allowed, order, load_c, mem_c, ref)
        except _Full:
            raise NoRoom(u) from None
        ranks = np.empty(len(load_c), dtype=np.int64)
        ranks[order] = placed
        # in placement order, as one cell at a time would add them (the same sums to the bit)
        np.add.at(self.loads, placed, load_c[order])
        np.add.at(self.mem, placed, mem_c[order])
        return ranks

    def place_all(self, decisions: dict[str, Decision]) -> None:
        """Place every unit from scratch: dp first, then all cells heaviest first."""
        self.reset()
        cells: list[tuple[float, int, int]] = []
        prepared: dict[str, Any] = {}
        sharded: list[Unit] = []
        for u in self.units:
            d = decisions[u.name]
            if d.kind == "dp":
                self.place(u, d)
                continue
            load_c, mem_c, templates, uni = self._prepare(u, d)
            prepared[u.name] = (load_c, mem_c, templates, uni)
            si = len(sharded)
            sharded.append(u)
            for ci, x in enumerate(load_c.tolist()):
                cells.append((-x, si, ci))
        cells.sort()
        cm = self.cm
        self.meter.placed += len(self.units) + len(cells)
        # every rank holds every sharded unit's requester buffers
        buffers = sum(v[3] for v in prepared.values())
        if prepared and not self._room_everywhere(buffers):
            raise NoRoom(self.by_name[next(iter(prepared))])
        self.uniform_mem += buffers
        free = cm.capacity - self.uniform_mem

        def node_for(si: int) -> int | None:
            u = sharded[si]
            load_c, mem_c = prepared[u.name][:2]
            order = np.argsort(-load_c, kind="stable")
            node = best_node(cm, self.loads, self.mem, free, load_c[order], mem_c[order])
            if node is None and u.within_node:
                raise NoRoom(u)
            return node

        try:
            placed = _place_interleaved(
                self.loads,
                self.mem,
                free,
                [(si, ci) for _, si, ci in cells],
                [prepared[u.name][0] for u in sharded],
                [prepared[u.name][1] for u in sharded],
                [one_node(u, decisions[u.name]) for u in sharded],
                cm.node_of,
                node_for,
            )
        except _Full as e:
            raise NoRoom(sharded[e.args[0]]) from None
        for si, u in enumerate(sharded):
            load_c, mem_c, templates, uni = prepared[u.name]
            self._install(u, decisions[u.name], load_c, mem_c, templates, placed[si], uni)

    def _prepare(
        self, u: Unit, d: Decision
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, Placement]], float]:
        """A sharded unit's cell loads, cell memory, template placements and the bytes it
        puts on every rank (cached on the cost model for every search: read-only)."""
        key = (u.name, d)
        hit = self.cm.unit_cache.get(key)
        if hit is None:
            load_c, mem_c, templates = self._cells(u, d)
            load_c.flags.writeable = False
            mem_c.flags.writeable = False
            hit = self.cm.unit_cache[key] = (
                load_c,
                mem_c,
                templates,
                self._uniform_bytes(templates),
            )
        return hit

    def _install(
        self,
        u: Unit,
        d: Decision,
        load_c: np.ndarray,
        mem_c: np.ndarray,
        templates: list[tuple[str, Placement]],
        ranks: np.ndarray,
        uni: float,
    ) -> None:
        """Record sharded unit `u`, its cells on `ranks`, in the layout and the exact state
        (the proxy loads and memory are the caller's)."""
        self.applied[u.name] = _Applied(ranks, load_c, mem_c, 0.0, uni)
        for name, p in templates:
            q = p.with_ranks(tuple(int(x) for x in ranks))
            self.layout[name] = q
            self.state.add_table(name, q, 1.0)
        self.decisions[u.name] = d

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> tuple[Any, ...]:
        st = self.state
        arrays = {k: v.copy() for k, v in vars(st).items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in vars(st).items() if isinstance(v, float)}
        return (
            self.loads.copy(),
            self.mem.copy(),
            self.uniform_load,
            self.uniform_mem,
            dict(self.layout),
            dict(self.applied),
            dict(self.decisions),
            arrays,
            scalars,
            dict(st.counts),
        )

    def restore(self, snap: tuple[Any, ...]) -> None:
        (loads, mem, ul, um, layout, applied, decisions, arrays, scalars, counts) = snap
        self.loads, self.mem = loads.copy(), mem.copy()
        self.uniform_load, self.uniform_mem = ul, um
        self.layout, self.applied, self.decisions = dict(layout), dict(applied), dict(decisions)
        for k, v in arrays.items():
            setattr(self.state, k, v.copy())
        for k, v in scalars.items():
            setattr(self.state, k, v)
        self.state.counts = dict(counts)

    def adopt(self, decisions: dict[str, Decision], layout: Layout) -> None:
        """Set the state to `layout`, whose units have the grids of `decisions`."""
        self.reset()
        for u in self.units:
            d = decisions[u.name]
            if d.kind == "dp":
                self.place(u, d)
                continue
            load_c, mem_c, templates, uni = self._prepare(u, d)
            ranks = np.asarray(layout[u.tables[0]].ranks, dtype=np.int64)
            np.add.at(self.loads, ranks, load_c)
            np.add.at(self.mem, ranks, mem_c)
            self.uniform_mem += uni
            self._install(u, d, load_c, mem_c, templates, ranks, uni)

    def _set_ranks(self, u: Unit, ranks: np.ndarray) -> None:
        """Move the cells of sharded unit `u` to `ranks` (one per cell), grid unchanged."""
        a = self.applied[u.name]
        np.add.at(self.loads, a.ranks, -a.load)
        np.add.at(self.mem, a.ranks, -a.mem)
        for name in u.tables:
            p = self.layout[name]
            self.state.add_table(name, p, -1.0)
            q = p.with_ranks(tuple(int(x) for x in ranks))
            self.layout[name] = q
            self.state.add_table(name, q, 1.0)
        np.add.at(self.loads, ranks, a.load)
        np.add.at(self.mem, ranks, a.mem)
        self.applied[u.name] = _Applied(ranks, a.load, a.mem, a.uniform_load, a.uniform_mem)

    def rebalance(self, max_evals: int, first: bool = False) -> float:
        """Move single cells off the critical rank: each cell there to one of the
        REBALANCE_TARGETS least-loaded ranks or to a rank of its node, alone or swapped
        with a lighter cell of that rank (memory and one-node units respected), judged by
        the exact model; apply the move that lowers the 16-norm most, and repeat until
        none does or `max_evals` layouts have been evaluated. With `first`, the cells are
        tried heaviest first and the first one that has a move takes its best, swapped with
        a cell of any size (REBALANCE_FIRST_EVALS says why). Whole-unit moves cannot make
        these trades: re-placing a unit moves all its cells, and the owner loads that
        place them overstate what a cell adds to a rank whose links have slack (a rank
        that receives more than it sends carries a cell's results for nothing). Ends in
        the layout of the lowest step time seen, which it returns."""
        cm = self.cm
        free = cm.capacity - self.uniform_mem
        cur = self.score()
        best = (cur[1], self.snapshot())
        evals = 0
        while evals < max_evals and not self.meter.spent():
            t = self.state.times()
            crit = int(np.argmax(t))
            node = int(cm.node_of[crit])
            order = [int(a) for a in np.argsort(t, kind="stable")]
            targets = list(
                dict.fromkeys(
                    order[:REBALANCE_TARGETS]
                    + [a for a in order if cm.node_of[a] == node and a != crit]
                )
            )
            on = self._cells_by_rank()
            moving = sorted(on.get(crit, []))
            found: tuple[float, list[tuple[str, int, int]]] | None = None
            for neg, name, ci in moving:
                stay = one_node(self.by_name[name], self.decisions[name])
                for tr in targets:
                    if tr == crit or (stay and cm.node_of[tr] != node):
                        continue
                    options: list[tuple[str, int] | None] = [None]
                    options += [
                        (n2, cj)
                        for neg2, n2, cj in sorted(on.get(tr, []))
                        if n2 != name and (first or -neg2 < -neg)
                    ]
                    for other in options:
                        moves = self._cell_moves(name, ci, tr, crit, other, free, first)
                        if moves is None:
                            continue
                        if evals >= max_evals or self.meter.spent():
                            break
                        sc = self._score_moves(moves)
                        evals += 1
                        if self.better(sc, cur) and (found is None or sc[0] < found[0]):
                            found = (sc[0], moves)
                if first and found is not None:
                    break
            if found is None:
                break
            self._apply_cell_moves(found[1])
            cur = self.score()
            if cur[1] < best[0] * (1 - 1e-9):
                best = (cur[1], self.snapshot())
        self.restore(best[1])
        return best[0]

    def _cell_moves(
        self,
        name: str,
        ci: int,
        tr: int,
        crit: int,
        other: tuple[str, int] | None,
        free: float,
        apart: bool = False,
    ) -> list[tuple[str, int, int]] | None:
        """(unit, cell, new rank) of the cells that change when cell `ci` of `name` moves
        from `crit` to `tr` (and cell `other` of `tr` to `crit`); None when memory or the
        other unit's node forbids it, or with `apart` when a cell would join another cell
        of its row shard (a layout the grid search's wider cell expresses, which CP-SAT's
        model of the keys does not: it sends them once per cell)."""
        a = self.applied[name]
        if apart and self._row_shard_on(name, ci, tr):
            return None
        if other is None:
            if self.mem[tr] + a.mem[ci] > free:
                return None
            return [(name, ci, tr)]
        n2, cj = other
        b = self.applied[n2]
        if one_node(self.by_name[n2], self.decisions[n2]) and (
            self.cm.node_of[crit] != self.cm.node_of[tr]
        ):
            return None
        if self.mem[tr] - b.mem[cj] + a.mem[ci] > free:
            return None
        if apart and n2 != name and self._row_shard_on(n2, cj, crit):
            return None
        if self.mem[crit] - a.mem[ci] + b.mem[cj] > free:
            return None
        return [(name, ci, tr), (n2, cj, crit)]

    def balance_phases(self, max_evals: int, cap: float | None = None) -> tuple[float, float]:
        """Lower the critical path (`RankState.critical_path`: every phase waits for its
        slowest rank) without raising the step time. The step time lets a rank light in
        one phase carry more of another, which a runtime whose collectives wait for every
        rank does not credit; among the layouts of equal step time this moves towards
        those whose phases are balanced too. Moves: single cells off the slowest rank of
        a phase (phases by how far their slowest rank is above their mean), alone or
        swapped with a cell of any size, to the ranks lightest in that phase, lightest
        in all, or of its node (memory and one-node units respected); when no cell move
        helps, the `candidates` of the heaviest units of that rank. It applies the move
        that lowers the phases' 16-norms most (`_phase_score`) with the step time at most
        `cap` (where it started when None), and repeats until none does or `max_evals`
        layouts have been evaluated; it ends in the layout of the lowest critical path
        seen and returns (step time, critical path) there."""
        cm = self.cm
        free = cm.capacity - self.uniform_mem
        st = self.state
        cur = self._phase_score()
        cap = cur[0] if cap is None else cap
        best = (cur[2], self.snapshot())
        evals = 0
        while evals < max_evals and not self.meter.spent():
            groups = phase_times(st.components())
            totals = np.sum(groups, axis=0)
            # the phases by how far their slowest rank is above their mean rank
            order = sorted(
                range(len(groups)),
                key=lambda g: (-float(groups[g].max() - groups[g].mean()), g),
            )
            on = self._cells_by_rank()
            found: tuple[tuple[float, ...], list[tuple[str, int, int]]] | None = None
            for g in order:
                t = groups[g]
                if t.max() - t.mean() <= 1e-12 * max(cur[1], 1e-30):
                    break
                crit = int(np.argmax(t))
                node = int(cm.node_of[crit])
                light = [int(a) for a in np.argsort(t, kind="stable")]
                idle = [int(a) for a in np.argsort(totals, kind="stable")]
                targets = list(
                    dict.fromkeys(
                        light[:REBALANCE_TARGETS]
                        + idle[:REBALANCE_TARGETS]
                        + [a for a in light if cm.node_of[a] == node and a != crit]
                    )
                )
                for _, name, ci in sorted(on.get(crit, [])):
                    stay = one_node(self.by_name[name], self.decisions[name])
                    for tr in targets:
                        if tr == crit or (stay and cm.node_of[tr] != node):
                            continue
                        options: list[tuple[str, int] | None] = [None]
                        options += [(n2, cj) for _, n2, cj in sorted(on.get(tr, [])) if n2 != name]
                        for other in options:
                            moves = self._cell_moves(name, ci, tr, crit, other, free, True)
                            if moves is None or evals >= max_evals or self.meter.spent():
                                continue
                            sc = self._score_moves(moves, self._phase_score)
                            evals += 1
                            if sc[0] <= cap and sc[1] < cur[1] * (1 - 1e-9):
                                if found is None or sc[1] < found[0][1]:
                                    found = (sc[:2], moves)
                    if found is not None:
                        break  # the heaviest cell that has a move takes its best
                if found is not None:
                    break
            if found is None:
                if self.meter.spent():
                    break
                # no cell move helps: re-place or re-grid a whole unit of a phase's
                # slowest rank
                which, d, spent = self._phase_unit_move(order, groups, cap, cur)
                evals += spent
                if which is None or d is None:
                    break
                u = self.by_name[which]
                self.remove(u)
                self.place(u, d)
            else:
                self._apply_cell_moves(found[1])
            cur = self._phase_score()
            if cur[2] < best[0] * (1 - 1e-9):
                best = (cur[2], self.snapshot())
        self.restore(best[1])
        return st.step_time(), st.critical_path()

    def _phase_unit_move(
        self,
        order: list[int],
        groups: list[np.ndarray],
        cap: float,
        cur: tuple[float, float, float],
        top_units: int = 3,
    ) -> tuple[str | None, Decision | None, int]:
        """The best move (`candidates`) of the `top_units` heaviest units on the slowest
        rank of the phases in `order` that lowers the phase norm with the step time at
        most `cap`: (unit, decision, layouts evaluated), or (None, None, evaluated)."""
        evals = 0
        for g in order:
            t = groups[g]
            if t.max() - t.mean() <= 1e-12 * max(cur[1], 1e-30):
                break
            crit = int(np.argmax(t))
            on_crit = {
                name: load
                for name, a in self.applied.items()
                if (load := a.load_on(crit)) is not None
            }
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], self.cm.facts[n].index))
            best: tuple[float, str, Decision] | None = None
            for name in ranked[:top_units]:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name])
                failed = (math.inf, math.inf, math.inf)
                judged = self.judged(u, moves, self._phase_score, failed)
                for d, sc in zip(moves, judged, strict=True):
                    if sc[0] <= cap and sc[1] < cur[1] * (1 - 1e-9):
                        if best is None or sc[1] < best[0]:
                            best = (sc[1], name, d)
                evals += len(moves)
            if best is not None:
                return best[1], best[2], evals
        return None, None, evals

    def _phase_score(self) -> tuple[float, float, float]:
        """(step time, the sum over `cost.PHASE_GROUPS` of the 16-norms of their rank times,
        critical path): the norm is the search's smooth stand-in for the critical path,
        as in `score`."""
        groups = np.array(phase_times(self.state.components()))
        times = groups.sum(axis=0)
        peak = groups.max(axis=1)
        on = peak > 0
        top = peak[on]
        norms = top * ((groups[on] / top[:, None]) ** P_NORM).sum(axis=1) ** (1.0 / P_NORM)
        norm = crit = 0.0
        for x in norms.tolist():
            norm += x
        for x in peak.tolist():
            crit += x
        return float(times.max()), norm, crit

    def _row_shard_on(self, name: str, ci: int, rank: int) -> bool:
        """Whether another cell of cell `ci`'s row shard of unit `name` is on `rank`."""
        c = self.decisions[name].c
        j = ci // c
        ranks = self.applied[name].ranks
        return any(int(ranks[k]) == rank for k in range(j * c, (j + 1) * c) if k != ci)

    def _move_cell(self, name: str, ranks: np.ndarray, ci: int, to: int) -> None:
        """Move cell `ci` of unit `name`, whose cells are on `ranks`, to rank `to` in the
        exact state only (`RankState.move_cell`); `ranks` is updated."""
        cm = self.cm
        for t in self.by_name[name].tables:
            p = self.layout[t]
            cv = cm.placement_values(cm.facts[t], p)
            self.state.move_cell(cv, ranks, ci, to, p.hierarchical)
        ranks[ci] = to

    def _score_moves(
        self,
        moves: list[tuple[str, int, int]],
        score: Callable[[], tuple[float, ...]] | None = None,
    ) -> tuple[float, ...]:
        """`score` (`self.score` when None) with the cell `moves` made; the state is left
        as it was."""
        ranks = {name: self.applied[name].ranks.copy() for name, _, _ in moves}
        for name, ci, to in moves:
            self._move_cell(name, ranks[name], ci, to)
        sc = (score or self.score)()
        for name, ci, _ in reversed(moves):
            self._move_cell(name, ranks[name], ci, int(self.applied[name].ranks[ci]))
        return sc

    def _apply_cell_moves(self, moves: list[tuple[str, int, int]]) -> None:
        """Make the (unit, cell, new rank) `moves` in the search state."""
        for name, ci, to in moves:
            ranks = self.applied[name].ranks.copy()
            ranks[ci] = to
            self._set_ranks(self.by_name[name], ranks)

    def _cells_by_rank(self) -> dict[int, list[tuple[float, str, int]]]:
        """Per rank, its cells as (-load, unit, cell index), for sorting heaviest first."""
        on: dict[int, list[tuple[float, str, int]]] = {}
        for name, a in self.applied.items():
            for ci, r in enumerate(a.ranks.tolist()):
                on.setdefault(r, []).append((-float(a.load[ci]), name, ci))
        return on

    # ------------------------------------------------------------------ moves
    def candidates(
        self, u: Unit, d: Decision, extra_grids: tuple[tuple[int, int], ...] = ()
    ) -> list[Decision]:
        """The moves of unit `u` now at `d`: re-placed, neighbouring grids (and
            `extra_grids`), the other kinds and, for rb, the other communication (ub keeps the
        search's, `choose_ub_comm`)."""
        cm = self.cm
        out: list[Decision] = []
        if d.kind != "dp":
            out.append(d)  # the same grid re-placed: its cells move to the least-loaded ranks
        if d.kind == "dp":
            r, c = initial_grid(cm, u)
            for k in u.kinds:
                if k != "dp":
                    out.append(Decision(k, r, c, self._kind_comm(k)))
            return out
        grids = {
            (d.r + 1, d.c),
            (2 * d.r, d.c),
            (d.r - 1, d.c),
            (d.r, d.c + 1),
            (d.r, 2 * d.c),
            (d.r, d.c - 1),
            (d.r // 2, 2 * d.c),
            (2 * d.r, d.c // 2),
            *extra_grids,
        }
        for r2, c2 in sorted(grids):
            if (r2, c2) == (d.r, d.c) or not (u.min_r <= r2 <= u.max_r):
                continue
            if not (u.min_c <= c2 <= u.max_c) or r2 * c2 > 4 * cm.W:
                continue
            out.append(replace(d, r=r2, c=c2, comm=self._comm(d.comm)))
        for k in u.kinds:
            if k == d.kind:
                continue
            if k == "dp":
                out.append(Decision("dp"))
            else:
                out.append(replace(d, kind=k, comm=self._kind_comm(k)))
        if d.kind == "rb" and cm.nodes > 1 and self.comm_mode == "auto":
            out.append(replace(d, comm="flat" if d.comm == "hierarchical" else "hierarchical"))
        return out

    def _kind_comm(self, kind: str) -> str:
        return kind_comm(self.cm, kind, self.ub_comm)

    def _comm(self, current: str = "flat") -> str:
        if self.comm_mode != "auto":
            return self.comm_mode
        return current

    def scores(self, u: Unit, moves: list[Decision]) -> list[tuple[float, float]]:
        """`try_move` of every move in `moves` (`score`; (inf, inf) when it does not fit),
        each from the current state, which is restored afterwards."""
        return self.judged(u, moves, self.score, (math.inf, math.inf))

    def judged(
        self, u: Unit, moves: list[Decision], judge: Callable[[], _S], failed: _S
    ) -> list[_S]:
        """`judge()` of the layout after re-placing `u` with each move in `moves` (`failed`
        when it does not fit), each from the current state, which is restored afterwards;
        `u` is removed and the rank times without it computed once."""
        base = self.snapshot()
        self.remove(u)
        without = self.snapshot()
        ref = self.state.times() if self.exact_ref else None
        out: list[_S] = []
        for d in moves:
            try:
                self.place(u, d, None if ref is None else ref.copy())
                out.append(judge())
            except NoRoom:
                out.append(failed)
            self.restore(without)
        self.restore(base)
        return out

    def try_move(self, u: Unit, d: Decision) -> tuple[float, float]:
        """Score after re-placing `u` with `d` ((inf, inf) when it does not fit); kept."""
        self.remove(u)
        try:
            self.place(u, d)
        except NoRoom:
            return (math.inf, math.inf)
        return self.score()

    def score(self) -> tuple[float, float]:
        """(the 16-norm of the rank times, the step time).

        The search descends on the 16-norm, a smooth stand-in for the maximum: when many
        ranks share the maximum (every one holding a heavy cell), no single move lowers the
        maximum, but each move that unloads one of them lowers the norm. The best step
        time seen is kept separately.
        """
        t = self.state.times()
        m = float(t.max())
        if m <= 0:
            return 0.0, 0.0
        return m * float(((t / m) ** P_NORM).sum()) ** (1.0 / P_NORM), m

    def polish(self, rounds: int = POLISH_ROUNDS, top_units: int = 3) -> float:
        """Lower the step time itself: for the `top_units` heaviest units of the critical
        rank, try their moves and the grids of POLISH_GRIDS, apply the one that lowers the
        step time most, and repeat until none does. Ends in the state it returns the step
        time of (never worse than where it started)."""
        cm = self.cm
        best = self.score()[1]
        for _ in range(rounds):
            if self.meter.spent():
                break  # the time limit
            crit = int(np.argmax(self.state.times()))
            on_crit = {
                name: load
                for name, a in self.applied.items()
                if (load := a.load_on(crit)) is not None
            }
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], cm.facts[n].index))
            best_move: tuple[float, str, Decision] | None = None
            for name in ranked[:top_units]:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name], POLISH_GRIDS)
                for m, (_, t) in zip(moves, self.scores(u, moves), strict=True):
                    if t < best * (1 - 1e-9) and (best_move is None or t < best_move[0]):
                        best_move = (t, name, m)
            if best_move is None:
                break
            best = self.try_move(self.by_name[best_move[1]], best_move[2])[1]
        return best

    @staticmethod
    def better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return a[0] < b[0] * (1 - 1e-9)

    def improve(self, max_iterations: int, top_units: int = 3) -> tuple[float, float]:
        """Apply the best move on the critical rank until no move helps; the search ends
        in the best layout (by step time) it has seen."""
        best = self.score()
        best_seen = (best[1], dict(self.layout), self.snapshot())
        for it in range(max_iterations):
            if self.meter.spent():
                break  # the time limit: the best layout seen so far
            times = self.state.times()
            crit = int(np.argmax(times))
            on_crit: dict[str, float] = {}
            for name, a in self.applied.items():
                load = a.load_on(crit)
                if load is not None:
                    on_crit[name] = load
                elif a.uniform_load > 0:
                    on_crit[name] = a.uniform_load
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], self.cm.facts[n].index))
            # the units alone in their cluster kind: moving them removes a whole cluster's
            # collectives and kernel launches from every rank
            kinds: dict[tuple[str, str], list[str]] = {}
            for name, d in self.decisions.items():
                kinds.setdefault((d.kind, d.comm if d.kind == "rb" else ""), []).append(name)
            lonely = sorted(
                (v[0] for v in kinds.values() if len(v) == 1 and v[0] not in ranked[:top_units]),
                key=lambda n: self.cm.facts[n].index,
            )
            best_move: tuple[tuple[float, float], str, Decision] | None = None
            for name in ranked[:top_units] + lonely:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name])
                for d, sc in zip(moves, self.scores(u, moves), strict=True):
                    if self.better(sc, best) and (
                        best_move is None or self.better(sc, best_move[0])
                    ):
                        best_move = (sc, name, d)
            if best_move is None:
                break
            _, name, d = best_move
            best = self.try_move(self.by_name[name], d)
            if best[1] < best_seen[0] * (1 - 1e-9):
                best_seen = (best[1], dict(self.layout), self.snapshot())
            if self.progress is not None and it % 10 == 0:
                self.progress("greedy", min(1.0, it / max_iterations), best_seen[0])
        self.restore(best_seen[2])
        return self.score()


@dataclass
class GreedyResult:
    layout: Layout
    step_time: float
    decisions: dict[str, Decision]
    units: list[Unit]
    work: float = 0.0
    """The search's deterministic work (`WorkMeter.seconds`), all of it."""
    phase_work: float = 0.0
    """The part of `work` its `balanced_phases` took."""
    stopped: bool = False
    """The budget ran out: later starts were not begun, or the work reached the budget,
    where the descents, the rebalance and the phase passes stop (rarely, a last pass that
    ends on its own just past the budget counts too)."""
    first_cut: bool = False
    """The budget ran out in the first start's descent: the plan is barely searched."""
    from_fixed: str | None = None
    """The fixed strategy whose layout the plan was searched on from (`greedy`'s `fixed`),
    when that layout was faster than every start's descent; None otherwise."""
    kicks: int = 0
    """Kicks that `kicked` tried after the greedy."""
    kicked_from: float | None = None
    """The greedy's step time before `kicked` found a faster plan; None when it did not."""


def greedy(
    cm: CostModel,
    progress: Progress | None = None,
    max_iterations: int | None = None,
    budget: float | None = None,
    fixed: FixedStart | None = None,
    meter: WorkMeter | None = None,
) -> GreedyResult:
    """EMBark's greedy search on the cost model `cm` (see the module docstring).

    Up to three starts are searched and the fastest result kept: the kinds the cost model
    prefers for each unit alone, the same without dp (a replicated table is cheap alone
    but its descent can end in a worse plan), and every unit sharded with its first
    allowed kind (rb where allowed, dp only if pinned), since a plan's best kinds depend
    on the whole plan, not on each table alone; small programs search each start in two
    placement modes (`FOUR_START_UNITS`), programs with more than `MULTI_START_UNITS`
    units the first start only. When keys hide under the dense compute
    (`CostModel.key_window`), more: the first start with its heavy units cut into
    columns, once per share of COLUMN_SHARES (`column_start`; for programs of more than
    FOUR_START_UNITS units on more than COLUMN_ONLY_RANKS ranks these replace the other
    starts). Programs of up to FOUR_START_UNITS units also search the lower bound's kinds
    (`bound_start`) and, when the keys hide, their column starts; programs of more than
    MULTI_START_UNITS units, and those of more than FOUR_START_UNITS on more than
    FINE_START_RANKS[0] ranks, the column-wise strategy's grids (`fine_column_start`),
    right after their first start (after the others on up to FINE_START_RANKS[1] ranks).
    The fastest result is rebalanced cell by cell (`Search.rebalance`): on
    programs of up to FOUR_START_UNITS units by the best move of all, then on those and on
    larger programs on up to COLUMN_ONLY_RANKS ranks by the first cell's best move. Last,
    every program's critical path is lowered without raising its step time
    (`balanced_phases`).

    `budget`: the work (`WorkMeter.seconds`) the search may take, from a time limit. The first
    start's placement always runs whole; the others start, and their descents run, only
    within RUNS_SHARE of the budget; the first start's descent, the rebalance and the
    phase passes stop where it ends (each with the best layout it has seen). None: no
    limit.

    `fixed`: the fixed strategies' step times and layouts (`FixedStart`). When the fastest
    that the spec's constraints allow is faster than every start's descent, or no start
    fits, the search takes its layout up and descends from it like a later start
    (`_from_fixed`): the starts' grids placed by the search can miss a layout as regular
    as the column-wise strategy's, whose every rank carries the same share (16 ranks,
    four tables of 100M rows cut into 4 columns and ten small ones: the starts end at
    0.184 ms, column-wise is 0.170 ms).
    """
    meter = meter if meter is not None else WorkMeter(cm.W)
    start_work = meter.seconds()
    if budget is None:
        return _greedy(cm, meter, progress, max_iterations, start_work, fixed=fixed)
    with meter.until(start_work + budget):
        return _greedy(
            cm,
            meter,
            progress,
            max_iterations,
            start_work,
            start_work + RUNS_SHARE * budget,
            fixed=fixed,
        )


def _greedy(
    cm: CostModel,
    meter: WorkMeter,
    progress: Progress | None,
    max_iterations: int | None,
    start_work: float,
    runs_until: float = math.inf,
    flat_ub: bool = False,
    fixed: FixedStart | None = None,
) -> GreedyResult:
    """`greedy`, its later starts only while the work stays below `runs_until`;
    `flat_ub`: every ub unit flat (the search again when every plan of its hierarchical
    ub overran a rank with its aggregators' buffers)."""
    units = units_of(cm)
    check_fits(cm, units)
    known: dict[str, dict[str, str]] = {}
    ub_comm, other = ("flat", None) if flat_ub else _ub_worlds(cm, units, known)
    kinds = known.get(ub_comm) or initial_kinds(cm, units, ub_comm=ub_comm)
    # planning time: large programs whose keys hide search the column starts only
    columns_only = cm.key_window > 0 and len(units) > FOUR_START_UNITS and cm.W > COLUMN_ONLY_RANKS
    starts = [_start(cm, units, partial(_kind_of, kinds), ub_comm)]
    if not columns_only:
        sharded = initial_kinds(cm, units, allow_dp=False, ub_comm=ub_comm)
        for choose in (partial(_kind_of, sharded), lambda u: u.kinds[0]):
            decisions = _start(cm, units, choose, ub_comm)
            if decisions not in starts:
                starts.append(decisions)
        hier = hierarchical_start(cm, units, starts[0])
        if hier is not None and hier not in starts:
            starts.append(hier)
    runs = [(d, True) for d in starts]
    # small programs also descend every start again with the rough reference (a second
    # look at the same starts): last, so that a short limit reaches the other starts first
    second_looks = [(d, False) for d in starts] if len(units) <= FOUR_START_UNITS else []
    if len(units) > MULTI_START_UNITS:
        runs = runs[:1]
    if cm.key_window > 0:
        # keys hide under the dense compute: column cuts cost the owners nothing more
        cols: list[dict[str, Decision]] = []
        for share in COLUMN_SHARES:
            col = column_start(cm, units, starts[0], share)
            if col not in starts and col not in cols:
                cols.append(col)
        if cols and columns_only:
            # planning time: on large programs they replace the other starts, and they
            # end lower (T510 on 128 GPUs 4.709 ms in about 0.2 s of descent each, the
            # first start 5.394 ms in 1.2 s; 5,000 tables on 1,024 GPUs 6.184 against 6.872)
            runs = []
        runs += [(col, True) for col in cols]
    bounded = bound_start(cm, units, starts[0], meter)
    if bounded is not None and bounded not in starts:
        # the lower bound's kinds: clusters whose fixed costs no unit pays for alone;
        # searched right after the first start, so that a short limit reaches them too
        # (at 5 s on 16 x 8 GPUs: DCNv2 0.609 -> 0.558 ms, T200 3.541 -> 3.230; at 10 s
        # T200 3.107 -> 3.112; every plan at 30 s and without a limit the same)
        more_runs = [bounded]
        if cm.key_window > 0:
            more_runs += [column_start(cm, units, bounded, share) for share in COLUMN_SHARES]
        runs[1:1] = [(b, True) for b in more_runs if (b, True) not in runs]
    if other is not None:
        # the other ub communication: its first start, hierarchical rb start and column
        # starts (one unit's move to the other communication cannot show what all of
        # them gain, and the better depends on the workload)
        kinds_o = initial_kinds(cm, units, ub_comm=other)
        first = _start(cm, units, partial(_kind_of, kinds_o), other)
        more = [first, hierarchical_start(cm, units, first)]
        if cm.key_window > 0:
            more += [column_start(cm, units, first, share) for share in COLUMN_SHARES]
        for d in more:
            if d is not None and d not in starts and (d, True) not in runs:
                runs.append((d, True))
    if len(units) > MULTI_START_UNITS or (
        len(units) > FOUR_START_UNITS and cm.W > FINE_START_RANKS[0]
    ):
        # the column-wise strategy's grids: on many tables and ranks the descents balance
        # no better than its cells of 16 columns placed heaviest first (5,000 generated
        # tables on 1,024 GPUs: 6.228 ms from the other starts at the default limit, the
        # column-wise strategy 5.712, the descent from its grids 5.712; unlimited greedy
        # on generated programs: 350 tables on 1,024 GPUs 1.387 -> 1.240 ms, 600 on 512
        # 1.997 -> 1.955 (column-wise 1.977), 1,000 on 256 4.752 -> 4.461 (column-wise
        # 4.461)), and the plan command cannot cost the fixed strategies there within
        # the default limit. Right after the first start, as the later starts share what
        # is left of the budget (at 15 s of work: 350 tables on 1,024 GPUs 1.240 ms, 1.390
        # with the start last; 800 on 512 2.276 against 2.324), except on up to
        # FINE_START_RANKS[1] ranks, where it comes last: at 2 s of work 400 tables on
        # 256 GPUs 2.526 ms with it last or without, 2.692 right after the first start.
        # Programs of up to FOUR_START_UNITS units search more starts, and on up to
        # FINE_START_RANKS[0] ranks the start gains nothing for its work (T180 on 128
        # GPUs at 30 s: 4.156 -> 4.164 ms with it last; T510 on 128 and 32 GPUs the same
        # plans unlimited, and at 2 s 4.405 -> 4.696 and 12.19 -> 12.95 ms right after
        # the first start)
        fine = fine_column_start(cm, units, starts[0])
        if fine not in starts and (fine, True) not in runs:
            if len(units) > MULTI_START_UNITS or cm.W > FINE_START_RANKS[1]:
                runs.insert(1, (fine, True))
            else:
                runs.append((fine, True))
    runs += second_looks
    limit = max_iterations if max_iterations is not None else 20 * len(units) + 200
    best: tuple[float, Layout, dict[str, Decision]] | None = None
    stopped = first_cut = overran = False
    deadline = meter.deadline
    refused: EmbarkError | None = None
    refusal: EmbarkError | None = None  # why no start fits, while a fixed start may
    for i, (decisions, exact_ref) in enumerate(runs):
        if i > 0 and best is not None and meter.seconds() >= runs_until:
            stopped = True
            break  # the time limit: the rest is for the rebalance and the phase passes
        if best is None and refused is not None and meter.placed_past(deadline):
            # no start has fit, and trying them has taken the greedy's whole budget: the
            # last start's refusal, with the starts left untried (near the memory's end a
            # start can take seconds to fail: 200 tables at 97 % took 6 s at a 3 s limit)
            refusal = _cut_refusal(refused, i, len(runs))
            if fixed is None:
                raise refusal from None
            break
        if best is not None:
            # the later starts' descents stop where no further start may begin
            meter.deadline = min(deadline, runs_until)
        comm = next((x.comm for x in decisions.values() if x.kind == "ub"), ub_comm)
        search = Search(cm, units, progress, exact_ref, comm, meter=meter)
        try:
            # while none has fit, a start also stops splitting at the greedy's budget
            decisions = _place_splitting(search, decisions, deadline if best is None else None)
        except EmbarkError as e:
            if best is None and i == len(runs) - 1:
                refusal = _cut_refusal(e, len(runs), len(runs)) if search.cut_short else e
                if fixed is None:
                    raise refusal from None
                break
            refused = e
            continue
        found = _descend(search, limit)
        if best is None:
            # the first start that fits (its descent had the whole budget)
            first_cut = meter.seconds() >= deadline
        elif meter.spent():
            stopped = True  # a later start's descent, cut where no further start may begin
        if best is None or found[0] < best[0] * (1 - 1e-9):
            if fits_exactly(cm, found[1]):
                best = found
            else:
                overran = True  # the aggregators' buffers of its hierarchical ub
    meter.deadline = deadline
    from_fixed: str | None = None
    offered = sorted(fixed.times.items(), key=lambda kv: (kv[1], kv[0])) if fixed else []
    layout_of = fixed.layout_of if fixed else None
    for name, t in offered:
        if best is not None and not t < best[0] * (1 - 1e-9):
            break
        # a fixed strategy's layout beats every start: the search goes on from there, a
        # start of its own (on the whole budget when no other start fits)
        start = layout_of(name) if layout_of else None
        if start is None:
            continue  # the spec's constraints forbid it
        meter.deadline = deadline if best is None else min(deadline, runs_until)
        taken = _from_fixed(cm, units, progress, ub_comm, start, limit, meter)
        meter.deadline = deadline
        if taken is not None and (best is None or taken[0] < best[0] * (1 - 1e-9)):
            best, from_fixed = taken, name
            stopped = stopped or meter.spent()
            break
    auto = cm.program.options.communication == "auto"
    if best is None and overran and auto and not flat_ub:
        return _greedy(
            cm, meter, progress, max_iterations, start_work, runs_until, flat_ub=True, fixed=fixed
        )
    if best is None and refusal is not None:
        raise refusal from None
    if best is None:
        raise EmbarkError.at(
            cm.program.sources[0].path,
            f"no placement fits in {cm.W} GPUs of {format_bytes(cm.capacity)}: the "
            "buffers of the hierarchical ub aggregators overrun a GPU in every plan found",
            hint="plan with `communication flat` (or auto), lower memory_headroom, or add GPUs",
        )
    best = (cm.step_time(best[1], meter), best[1], best[2])  # from scratch: no drift of the sums
    if cm.W > 1 and (len(units) <= FOUR_START_UNITS or cm.W <= COLUMN_ONLY_RANKS):
        best = _rebalanced(cm, units, progress, best, meter)
    phase_start = meter.seconds()
    layout = balanced_phases(cm, units, best[1], progress, meter)
    phase_work = meter.seconds() - phase_start
    if layout is not best[1]:
        decisions = {u.name: decision_of(layout[u.tables[0]]) for u in units}
        best = (cm.step_time(layout, meter), layout, decisions)
    if progress is not None:
        progress("greedy", 1.0, best[0])
    work = meter.seconds() - start_work
    stopped = stopped or meter.spent()
    return GreedyResult(
        best[1], best[0], best[2], units, work, phase_work, stopped, first_cut, from_fixed
    )


@dataclass(frozen=True)
class FixedStart:
    """The fixed strategies offered to the greedy as starts (`greedy`'s `fixed`)."""

    times: dict[str, float]
    """The step time of each fixed strategy that fits."""
    layout_of: Callable[[str], Layout | None]
    """A strategy's layout, or None when the spec's constraints forbid it (called only
    for a strategy faster than every start: its check costs 0.25 s on T510 at 128 GPUs)."""


def _from_fixed(
    cm: CostModel,
    units: list[Unit],
    progress: Progress | None,
    ub_comm: str,
    layout: Layout,
    limit: int,
    meter: WorkMeter,
) -> tuple[float, Layout, dict[str, Decision]] | None:
    """The descent (`_descend`, within `WorkMeter.deadline`) from a fixed strategy's
    `layout`, or None when the search cannot hold that layout as it is: a unit whose
    tables the strategy placed apart, or a kind or grid outside a unit's constraints.
    Never slower than the layout itself."""
    decisions: dict[str, Decision] = {}
    for u in units:
        p = layout.get(u.tables[0])
        if p is None or p.cells_explicit is not None:
            return None
        d = decision_of(p)
        if d.kind not in u.kinds:
            return None
        if d.kind != "dp":
            if not (u.min_r <= d.r <= u.max_r and u.min_c <= d.c <= u.max_c):
                return None
            if u.within_node and len({r // cm.G for r in p.ranks}) > 1:
                return None
        decisions[u.name] = d
    search = Search(cm, units, progress, True, ub_comm, meter=meter)
    try:
        search.adopt(decisions, layout)
    except NoRoom:
        return None  # a replica finds no room beside the cells, by the search's count
    if set(search.layout) != set(layout) or any(search.layout[t] != p for t, p in layout.items()):
        return None  # the search lays out a unit's grid otherwise (a colocated group)
    adopted = (search.state.step_time(), dict(search.layout), dict(search.decisions))
    found = _descend(search, limit)
    if found[0] < adopted[0] * (1 - 1e-9) and fits_exactly(cm, found[1]):
        return found
    return adopted


def _cut_refusal(refused: EmbarkError, tried: int, starts: int) -> EmbarkError:
    """`refused` (the last start's), saying that the time limit left starts untried, or
    cut the last one short (`tried == starts`)."""
    first, *rest = refused.diagnostics
    untried = starts - tried
    message = (
        f"the time limit ended the search after {tried} of its {starts} starts, and none of "
        f"them fits; the last one: {first.message}"
    )
    longer = (
        f"a longer --time-limit tries the {untried} other start{'s' if untried != 1 else ''}"
        if untried
        else "a longer --time-limit lets the last start split its tables further"
    )
    hint = longer + (f"; {first.hint}" if first.hint else "")
    return EmbarkError([replace(first, message=message, hint=hint), *rest], refused.sources)


KICK_UNITS = 2
"""Units a kick re-decides at random (`kicked`) before the descent."""

KICK_PATIENCE = 40
"""Kicks in a row that find nothing faster, after which `kicked` stops."""


def kicked(
    cm: CostModel,
    g: GreedyResult,
    budget: float,
    seed: int,
    progress: Progress | None = None,
    meter: WorkMeter | None = None,
) -> GreedyResult:
    """Iterated local search from the greedy plan `g`, within `budget` of work
    (`WorkMeter.seconds`): each kick re-decides KICK_UNITS units drawn at random (a random move
    of `Search.candidates` that fits: another grid, kind or communication, or the same
    grid re-placed), then descends and polishes as a start does; a faster plan by the
    full model (`fits_exactly`) whose critical path is no longer than the greedy plan's
    becomes the one the next kick starts from. Stops after KICK_PATIENCE kicks in a row
    without a faster plan, or at the budget, keeping room for a phase pass
    (`balanced_phases`) on the plan it found. The moves of the search change one unit at
    a time and take only what lowers the 16-norm; a kick crosses what no single move does
    (a random spec of 5 tables on 8 x 8 GPUs: every table's kind at once, two clusters
    into one, 0.723 -> 0.363 ms). Deterministic for a `seed`."""
    if budget <= 0 or cm.W == 1 or not g.units:
        return g
    meter = meter if meter is not None else WorkMeter(cm.W)
    start = meter.seconds()
    saved = meter.deadline
    ub = next((d.comm for d in g.decisions.values() if d.kind == "ub"), default_comm(cm, "ub"))
    search = Search(cm, g.units, progress, True, ub, meter=meter)
    search.adopt(g.decisions, g.layout)
    best, best_snap = g.step_time, search.snapshot()
    path = cm.layout_state(g.layout, meter).critical_path()
    rng = random.Random(seed)
    limit = 20 * len(g.units) + 200
    kicks = idle = 0
    try:
        # the kicks stop where a phase pass as long as the greedy's still fits
        meter.deadline = start + max(0.0, budget - g.phase_work)
        while idle < KICK_PATIENCE and not meter.spent():
            search.restore(best_snap)
            for _ in range(KICK_UNITS):
                u = g.units[rng.randrange(len(g.units))]
                moves = search.candidates(u, search.decisions[u.name])
                rng.shuffle(moves)
                for m in moves:
                    snap = search.snapshot()
                    if search.try_move(u, m)[0] != math.inf:
                        break
                    search.restore(snap)  # no room: the unit back where it was
            search.improve(limit)
            search.polish(rounds=min(POLISH_ROUNDS, limit))
            kicks += 1
            layout = dict(search.layout)
            st = cm.layout_state(layout, meter)
            t = st.step_time()
            # as CP-SAT's: a shorter step, not bought with longer waits (item 5 of "How
            # the plan is searched", docs/plan.md)
            waits = st.critical_path() <= path * (1 + 1e-9)
            if t < best * (1 - 1e-9) and waits and fits_exactly(cm, layout, st):
                best, best_snap, idle = t, search.snapshot(), 0
            else:
                idle += 1
            if progress is not None:
                progress("random kicks", min(1.0, idle / KICK_PATIENCE), best)
        work = meter.seconds() - start
        if not best < g.step_time * (1 - 1e-9):
            return replace(g, work=g.work + work, kicks=kicks)
        search.restore(best_snap)
        layout = dict(search.layout)
        meter.deadline = start + budget
        phase_start = meter.seconds()
        layout = balanced_phases(cm, g.units, layout, progress, meter)
        phase_work = meter.seconds() - phase_start
    finally:
        meter.deadline = saved
    decisions = {u.name: decision_of(layout[u.tables[0]]) for u in g.units}
    return replace(
        g,
        layout=layout,
        step_time=cm.step_time(layout, meter),
        decisions=decisions,
        work=g.work + meter.seconds() - start,
        phase_work=max(g.phase_work, phase_work),
        kicks=kicks,
        kicked_from=g.step_time,
    )


def _rebalanced(
    cm: CostModel,
    units: list[Unit],
    progress: Progress | None,
    best: tuple[float, Layout, dict[str, Decision]],
    meter: WorkMeter,
) -> tuple[float, Layout, dict[str, Decision]]:
    """`best` with single cells moved off the critical rank (`Search.rebalance`), or as it
    is when no move helps. Programs of up to FOUR_START_UNITS units run both passes (the
    best move of all; the first cell's best move) in both orders from `best` and keep the
    faster end (neither order wins always: T180 on 128 GPUs 4.199 ms best-first, 4.184
    first-first; T180 on 8 GPUs 36.997 and 37.053); larger ones the second pass alone
    (planning time)."""
    both = ((REBALANCE_EVALS, False), (REBALANCE_FIRST_EVALS, True))
    orders = [both, both[::-1]] if len(units) <= FOUR_START_UNITS else [both[1:]]
    out = best
    for order in orders:
        search = Search(cm, units, progress, meter=meter)
        search.adopt(best[2], best[1])
        for evals, first in order:
            if evals > 0:
                search.rebalance(evals, first=first)
        layout = dict(search.layout)
        t = cm.step_time(layout, meter)
        if t < out[0] * (1 - 1e-9) and fits_exactly(cm, layout):
            out = (t, layout, dict(search.decisions))
    return out


def fits_exactly(cm: CostModel, layout: Layout, state: RankState | None = None) -> bool:
    """Whether every rank of `layout` holds its weights, state and buffers by the full
    model. The search's own room checks count every buffer but the hierarchical ub
    aggregators' (on the owner's rail peers of the other nodes, which a cell's placement
    fills without looking at them); this is the check that catches them. Without them
    the room checks are exact, and the layout fits without being costed again. `state`:
    the layout's full-model state when the caller has it."""
    if cm.nodes == 1 or not any(
        p.kind == "ub" and p.communication == "hierarchical" for p in layout.values()
    ):
        return True
    if state is not None:
        return float(state.memory().max()) <= cm.capacity
    # a check, not search work: a build of the state from scratch costs little (8 ms for
    # T510 on 128 GPUs, 0.1 s for 5,000 tables on 1,024) against what its additions count
    # at the searches' incremental rate, and counted it cut T510's later starts at a 2 s
    # limit (4.405 -> 4.696 ms)
    return float(cm.layout_state(layout).memory().max()) <= cm.capacity


def decision_of(p: Placement) -> Decision:
    """The grid decision of a planner placement."""
    if p.kind == "dp":
        return Decision("dp")
    return Decision(p.kind, p.row_shards, len(p.widths), p.communication)


def balanced_phases(
    cm: CostModel,
    units: list[Unit],
    layout: Layout,
    progress: Progress | None = None,
    meter: WorkMeter | None = None,
) -> Layout:
    """`layout` after `Search.balance_phases`: a step time no higher (from scratch) and a
    lower critical path, or `layout` itself when no move finds one."""
    if cm.W == 1:
        return layout
    meter = meter if meter is not None else WorkMeter(cm.W)
    decisions = {u.name: decision_of(layout[u.tables[0]]) for u in units}
    ub = next((d.comm for d in decisions.values() if d.kind == "ub"), None)
    before = cm.layout_state(layout, meter)
    out = layout
    before_step, crit = before.step_time(), before.critical_path()
    # a pass ends in the best layout it saw, not where it stopped: from there the next
    # pass can find more (T180 on 128 GPUs 5.026 -> 4.779 -> 4.729 -> 4.581 ms)
    # planning time: programs of more than FOUR_START_UNITS units make one pass (T510 on
    # 128 GPUs: 5.001 -> 4.853 ms in 0.55 s of CPU; a second pass, 4.837, as long again)
    passes = PHASE_PASSES if len(units) <= FOUR_START_UNITS else min(PHASE_PASSES, 1)
    for _ in range(passes):
        if meter.spent():
            break
        search = Search(cm, units, progress, ub_comm=ub, meter=meter)
        search.adopt(decisions, out)
        # the step time may come back up to where it was before the first pass
        search.balance_phases(
            PHASE_EVALS if len(units) <= FOUR_START_UNITS else PHASE_EVALS_LARGE, cap=before_step
        )
        decisions = dict(search.decisions)
        st = cm.layout_state(search.layout, meter)
        if (
            st.step_time() > before_step
            or st.critical_path() >= crit * (1 - 1e-9)
            or float(st.memory().max()) > cm.capacity
        ):
            break
        out = dict(search.layout)
        gain = 1.0 - st.critical_path() / crit
        crit = st.critical_path()
        if gain < PHASE_MIN_GAIN:
            break  # planning time: another pass would find less still
    return out


def _start(
    cm: CostModel, units: list[Unit], choose: Callable[[Unit], str], ub_comm: str
) -> dict[str, Decision]:
    """Each unit on its `choose`n kind and initial grid, ub with `ub_comm`."""
    out: dict[str, Decision] = {}
    for u in units:
        k = choose(u)
        if k == "dp":
            out[u.name] = Decision("dp")
        else:
            r, c = initial_grid(cm, u)
            out[u.name] = Decision(k, r, c, kind_comm(cm, k, ub_comm))
    return out


def kind_comm(cm: CostModel, kind: str, ub_comm: str) -> str:
    """The communication of a sharded unit of `kind` in a search whose ub is `ub_comm`."""
    return ub_comm if kind == "ub" else default_comm(cm, kind)


def _kind_of(kinds: dict[str, str], u: Unit) -> str:
    return kinds[u.name]


def _ub_worlds(
    cm: CostModel, units: list[Unit], known: dict[str, dict[str, str]] | None = None
) -> tuple[str, str | None]:
    """(the ub communication of the search's starts, the other one whose first starts are
    also searched, or None). Where the spec leaves it to the planner on several nodes:
    programs of up to FOUR_START_UNITS units search every start with flat ub and a few
    with hierarchical ub; larger ones one communication (`choose_ub_comm`)."""
    default = default_comm(cm, "ub")
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return default, None
    if not any("ub" in u.kinds for u in units):
        return default, None
    if len(units) <= FOUR_START_UNITS:
        return "flat", "hierarchical"
    return choose_ub_comm(cm, units, known), None


def choose_ub_comm(
    cm: CostModel, units: list[Unit], known: dict[str, dict[str, str]] | None = None
) -> str:
    """The communication of every ub unit of a large program's search: the spec's, or
    under `auto` on several nodes the one whose first start (the kinds the cost model
    prefers for each unit alone with that ub) has less work over all ranks, the work the
    descent then balances. One unit's move to the other communication cannot show what all
    of them gain (a second cluster costs its own collectives), so the search keeps one.
    On T510 at 128 GPUs hierarchical ub (4.709 -> 4.405 ms). `known` receives the
    starting kinds of each communication."""
    default = default_comm(cm, "ub")
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return default
    if not any("ub" in u.kinds for u in units):
        return default
    work = {}
    for comm in ("hierarchical", "flat"):
        kinds = initial_kinds(cm, units, ub_comm=comm)
        if known is not None:
            known[comm] = kinds
        total = 0.0
        for u in units:
            k = kinds[u.name]
            if k == "dp":
                total += dp_total_seconds(cm, u)
            else:
                total += sharded_total_seconds(cm, u, k, *initial_grid(cm, u), ub_comm=comm)
        work[comm] = total
    return min(work, key=lambda c: (work[c], c != default))


def column_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision], share: float
) -> dict[str, Decision]:
    """`start` with every sharded unit whose owner work (`owner_seconds`) exceeds `share`
    of a rank's fair share (the owners' total work over the ranks) cut into enough
    column shards, within its bounds, that each cell is about that size.

    With the keys hidden under the dense compute a column cut adds no owner work (every
    column cell's owner receives the keys, which hide; the results are split, not
    copied, and each cell's HBM work falls with its width), and small cells let the
    heaviest-first placement pack the ranks closely. Row cuts are not used: each row
    shard adds a partial vector per sample."""
    out = dict(start)
    loads = {
        u.name: float(unit_cells(cm, u, start[u.name])[0].sum())
        for u in units
        if start[u.name].kind != "dp"
    }
    piece = share * sum(loads.values()) / cm.W
    if piece <= 0:
        return out
    for u in units:
        if u.name not in loads:
            continue
        d = start[u.name]
        c = min(u.max_c, max(d.c, math.ceil(loads[u.name] / (piece * d.r))))
        if c != d.c:
            out[u.name] = replace(d, c=c)
    return out


def fine_column_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision]
) -> dict[str, Decision]:
    """`start` with every unit that may be rb cut as the column-wise strategy cuts its
    tables (`baselines.column_wise_cells`; the fewest of a colocated group's tables,
    within the unit's bounds): rb with its starting communication, the fewest row shards
    allowed. Units that may not be rb keep `start`'s decision."""
    out = dict(start)
    tables = cm.program.table_by_name
    for u in units:
        if "rb" not in u.kinds:
            continue
        c = min(column_wise_cells(tables[n], cm.W) for n in u.tables)
        c = max(u.min_c, min(u.max_c, c))
        out[u.name] = Decision("rb", u.min_r, c, default_comm(cm, "rb"))
    return out


def hierarchical_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision]
) -> dict[str, Decision] | None:
    """`start` with every rb unit hierarchical, and twice the row shards for each rb unit
    whose owner work (`owner_seconds`, hierarchical) exceeds the mean per rank of all rb
    units' owner work, for programs of several nodes whose spec leaves the communication to
    the planner and of at most FOUR_START_UNITS units (planning time); None otherwise.
    Each node's NICs then share what its owners send, and a row-split table's partials are
    summed in the node before they cross the network (T180 on 128 GPUs: 6.42 -> 5.98 ms)."""
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return None
    if len(units) > FOUR_START_UNITS:
        return None
    by_name = {u.name: u for u in units}
    hier = {n: replace(d, comm="hierarchical") if d.kind == "rb" else d for n, d in start.items()}
    loads = {
        u.name: float(unit_cells(cm, u, hier[u.name])[0].sum())
        for u in units
        if hier[u.name].kind == "rb"
    }
    # a unit heavier than a rank's fair share of the owners' work cannot be balanced
    # whole; split in rows on its node, its partials are summed before the network
    fair = sum(loads.values()) / cm.W
    for name, load in loads.items():
        d = hier[name]
        if load > fair and 2 * d.r <= by_name[name].max_r:
            hier[name] = replace(d, r=2 * d.r)
    return hier


def bound_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision], meter: WorkMeter | None = None
) -> dict[str, Decision] | None:
    """Every unit on the kind and communication of its category in the lower bound's
    kind set (`bound.bound_categories`; the spec's communication where it names one) and
    its initial grid, for programs of at most FOUR_START_UNITS units (planning time);
    units without one keep `start`'s decision. None when the set has both flat and
    hierarchical ub (a search shares one ub communication).

    The other starts choose each unit's kind alone, and a descent moves one unit's kind
    at a time, so neither reaches a plan in which several tables share a cluster whose
    fixed costs (its collectives' latencies) none of them pays for alone: on DLRM-DCNv2
    at 16 x 8 GPUs the ten smallest tables replicated (dp) and the rest rb, no ub
    cluster (0.633 -> 0.558 ms with its column starts)."""
    if len(units) > FOUR_START_UNITS or cm.W == 1:
        return None
    from embarkc.planner.bound import bound_categories

    cats = bound_categories(cm, meter)
    auto = cm.program.options.communication == "auto"
    if auto and "ub" in cats.values() and "ub_hier" in cats.values():
        return None
    out = dict(start)
    for u in units:
        cat = cats.get(u.name)
        if cat is None:
            continue
        if cat == "dp":
            out[u.name] = Decision("dp")
            continue
        kind, _, comm = cat.partition("_")
        r, c = initial_grid(cm, u)
        if auto:
            comm = "hierarchical" if comm == "hier" else "flat"
        else:
            comm = default_comm(cm, kind)  # the spec's communication
        out[u.name] = Decision(kind, r, c, comm)
    return out


def _descend(search: Search, limit: int) -> tuple[float, Layout, dict[str, Decision]]:
    """Improve and polish (again while that lowers the step time, `DESCENT_CYCLES`), re-pack
    the chosen grids heaviest first, improve again; the best by the step time."""
    before = math.inf
    cycles = DESCENT_CYCLES if len(search.units) <= FOUR_START_UNITS else 1
    for _ in range(cycles):
        search.improve(limit)
        t = search.polish(rounds=min(POLISH_ROUNDS, limit))
        if not t < before * (1 - 1e-9):
            break
        before = t
    layout, dec = dict(search.layout), dict(search.decisions)
    # by the search's incremental state (`greedy` re-costs the plan it keeps from scratch)
    best = (search.state.step_time(), layout, dec)
    if search.meter.spent():
        return best  # the time limit: no re-pack
    try:
        search.place_all(dec)
        search.improve(limit)
        t = search.state.step_time()
        if t < best[0] * (1 - 1e-9):
            best = (t, dict(search.layout), dict(search.decisions))
    except NoRoom:
        pass
    return best


FINE_CELL_SHARE = 1 / 32
"""`_place_splitting` stops splitting the rows of a unit that finds no room once its cells
are this small against a GPU, or once a split no longer makes them a quarter smaller (their
communication buffers do not shrink with the rows): finer cells then pack no better, and
what is short is room itself. Without the rule a unit went on doubling its row shards up
to 64 per rank: 12 tables of 1 GB kept on one node each (hierarchical rb) on 4 x 8 GPUs
of 396 MB, 97 % full, made 12,288 cells a table and took 33 s at a 3 s limit to find that
they do not fit."""


def _split_helps(search: Search, u: Unit, d: Decision) -> bool:
    """Whether doubling the row shards of `d` makes the unit's cells pack better (see
    FINE_CELL_SHARE). The cells' values come from the search's cache, where the next
    placement finds the finer grid's."""
    mem = search._prepare(u, d)[1]
    finer = search._prepare(u, replace(d, r=min(u.max_r, d.r * 2)))[1]
    biggest = float(mem.max())
    return biggest > FINE_CELL_SHARE * search.cm.capacity and float(finer.max()) <= 0.75 * biggest


def _place_splitting(
    search: Search, decisions: dict[str, Decision], deadline: float | None = None
) -> dict[str, Decision]:
    """place_all, splitting rows of a unit that finds no room until everything fits; with
    a `deadline`, giving up (`search.cut_short`) once the search's work and the placing
    reach it."""
    cm = search.cm
    replicated: set[str] = set()  # units already tried as dp
    for _ in range(64):
        try:
            search.place_all(decisions)
            return decisions
        except NoRoom as e:
            if deadline is not None and search.meter.placed_past(deadline):
                search.cut_short = True
                break
            u = e.unit
            d = decisions[u.name]
            if d.kind == "dp":
                replicated.add(u.name)
                sharded = [k for k in u.kinds if k != "dp"]
                if not sharded:
                    break
                r, c = initial_grid(cm, u)
                decisions[u.name] = Decision(sharded[0], r, c, search._kind_comm(sharded[0]))
                continue
            if d.r * 2 > u.max_r or not _split_helps(search, u, d):
                if "dp" in u.kinds and u.name not in replicated:
                    # no more rows to split: a replica holds no communication buffers, which
                    # is what a hot table's keys fill on few GPUs
                    replicated.add(u.name)
                    decisions[u.name] = Decision("dp")
                    continue
                break
            decisions[u.name] = replace(d, r=min(u.max_r, d.r * 2))
    dp = [u for u in search.units if decisions[u.name].kind == "dp"]
    spread = [u for u in search.units if decisions[u.name].kind != "dp"] or search.units
    biggest = max(spread, key=lambda u: unit_bytes(cm, u))
    total = sum(unit_bytes(cm, u) for u in spread)
    copies = ""
    if dp:
        tables = [t for u in dp for t in u.tables]
        names = ", ".join(tables[:3]) + (", ..." if len(tables) > 3 else "")
        copies = (
            f"; the replicated (dp) tables ({names}) take "
            f"{format_bytes(sum(dp_bytes(cm, u) for u in dp))} on every GPU"
        )
    from embarkc.planner.bound import least_memory

    # how full any plan leaves the GPUs on average: the tables with their buffers
    least = least_memory(cm)
    fixes = ["more GPUs"] + smaller_tables(cm) + ["a lower memory_headroom"]
    fixes += ["sharding a dp table (cluster rb or ub)"] if dp else []
    raise EmbarkError.at(
        cm.program.sources[0].path,
        f"no placement fits in {cm.W} GPU{'s' if cm.W != 1 else ''} of "
        f"{format_bytes(cm.capacity)}: the tables with the buffers of their communication "
        f"need at least {format_bytes(least)} a GPU on average "
        f"({100 * least / cm.capacity:.1f} % of it); the largest sharded table group "
        f"({', '.join(biggest.tables[:3])}) needs {format_bytes(unit_bytes(cm, biggest))}, "
        f"the sharded tables {format_bytes(total)} ({format_bytes(total / cm.W)} per GPU)"
        f"{copies}, and the shard constraints or the buffers every GPU holds leave no room "
        "for their cells",
        hint="it may fit with " + ", or ".join(fixes) + "; or allow more row shards",
    )
