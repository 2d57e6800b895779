"""The host tier: which tables leave HBM, and how many of their rows each cache keeps.

    host_tier_available(program)       the hardware gives host memory
    needs_host(cm)                     no plan of the tables fits in the cluster's HBM
    choose_tiers(cm, fill)             tables to host memory with a cached share, cheapest first
    materialize(cm, layout)            every host cell's cache rows, explicit on its placement
    grow_caches(cm, layout)            each rank's free HBM to its host cells' caches
    host_memory_problem(cm, estimate)  a node whose host-tier cells exceed its host memory

A spec whose tables fit in HBM never comes here: its plans are what they were before the
host tier. One that does not fit is planned in three steps (`pipeline.search_plan`):

1. `choose_tiers` decides which tables go to host memory and what share of their rows
   their cells cache, so that the tables need at most `fill` of the cluster's HBM. Each
   table's options are the shares of `SHARES`; moving a table from one share to a
   smaller one frees its rows' bytes (weights and optimizer state) and costs the host
   link's seconds of the extra misses (`cache_model`, the table unsplit). The options
   are taken cheapest per byte freed first (the lower convex hull of each table's
   cost-against-bytes curve), as a fractional knapsack: skewed tables, whose hottest
   rows take most reads, leave first and keep small caches; uniform ones stay in HBM.
2. The search (greedy, kicks, CP-SAT) places every table with those tiers: the cost
   model costs a host table's cells with their caches (HBM bytes, misses over the host
   link), so kinds, grids and ranks are chosen knowing the tiers.
3. `grow_caches` hands every rank's HBM that the placement left free to the caches of
   its host cells, the most seconds of misses saved per byte first, in the same steps
   of `SHARES`; a cell whose cache reaches all its rows returns to HBM.

When the search finds no placement, `fill` is lowered (`FILLS`) and the tiers chosen
again. docs/host_tier.md.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Any

import numpy as np

from embark_runtime.formatting import format_bytes
from embarkc.diagnostics import EmbarkError
from embarkc.ir import Program
from embarkc.planner.budget import WorkMeter
from embarkc.planner.cache_model import cell_misses, ideal_misses, shard_mass
from embarkc.planner.cost import CostModel, cache_rows_of, shard_rows
from embarkc.planner.types import Layout, Placement

SHARES = (
    1.0,
    1 / 2,
    1 / 4,
    1 / 8,
    1 / 16,
    1 / 32,
    1 / 64,
    1 / 128,
    1 / 256,
    1 / 1024,
    1 / 4096,
    0.0,
)
"""The shares of a host table's rows its caches may hold (1: in HBM; 0: uncached)."""

FILLS = (0.9, 0.75, 0.6, 0.45, 0.3)
"""Shares of the cluster's HBM the tables may take after `choose_tiers`, tried in turn
while the search finds no placement (the rest is room for buffers and packing)."""


HOST_FILL = 0.9
"""Share of the cluster's host memory `choose_tiers` fills with tables (the rest is room
for the placement's imbalance between nodes)."""


MAX_CANDIDATES = 16384
"""The largest tables `choose_tiers` prices for host memory, at most (0.3 ms each)."""

CANDIDATE_COVER = 4.0
"""`choose_tiers` costs the largest tables until they hold this many times the bytes HBM
is short of (and at least 8), so that the cheapest per byte freed are among them."""


def host_tier_available(program: Program) -> bool:
    return program.topology.host_memory is not None


def table_bytes(cm: CostModel, name: str) -> float:
    """Weights and optimizer state of a whole table."""
    tf = cm.facts[name]
    w, s = tf.cell_bytes(float(tf.rows), tf.dim)
    return float(w + s)


def needs_host(cm: CostModel, meter: WorkMeter | None = None) -> bool:
    """Whether no plan of the program fits in the cluster's HBM: its tables with the
    buffers of their least-holding options need more than every GPU holds (the bound's
    options costed on `meter`, which the plan's bound then shares)."""
    from embarkc.planner.bound import least_memory

    return host_tier_available(cm.program) and least_memory(cm, meter) > cm.capacity


def _options(cm: CostModel, name: str) -> list[tuple[float, float, float]]:
    """(share, bytes freed, host-link seconds per step) of each share of SHARES for table
    `name`, unsplit: its cache of share x rows, priced by an ideal cache's misses
    (`cache_model.ideal_misses`, one pass over the rows: the price is a ranking of the
    tables, which the search then costs by the LRU's expectation)."""
    tf = cm.facts[name]
    whole = table_bytes(cm, name)
    per_row = whole / tf.rows
    cache = np.array([float(cache_rows_of(np.array([tf.rows]), s)[0]) for s in SHARES])
    misses = np.zeros(len(SHARES))
    for access, h in tf.groups:
        mass = shard_mass(tf.rows, access, 1, cm.partition, 0)
        misses += ideal_misses(mass, cm.B * h, cache)
    misses[0] = 0.0  # in HBM
    return [
        (s, whole - c * per_row if s < 1.0 else 0.0, m * per_row / cm.bw_host)
        for s, c, m in zip(SHARES, cache.tolist(), misses.tolist(), strict=True)
    ]


def _hull(opts: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The options on the lower convex hull of seconds against bytes freed, from the
    first (in HBM): each step frees bytes at a higher price than the one before."""
    pts = sorted(opts, key=lambda o: (o[1], o[2]))
    hull: list[tuple[float, float, float]] = []
    for o in pts:
        if hull and o[1] <= hull[-1][1]:
            continue  # frees no more than a cheaper option
        while len(hull) >= 2:
            (_, b1, c1), (_, b2, c2) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the chord to `o`
            if (c2 - c1) * (o[1] - b1) >= (o[2] - c1) * (b2 - b1):
                hull.pop()
            else:
                break
        if hull and o[2] < hull[-1][2]:
            continue  # never cheaper to free more (misses only grow as the cache shrinks)
        hull.append(o)
    return hull


def choose_tiers(cm: CostModel, fill: float) -> dict[str, float]:
    """Tables to host memory, each with the share of its rows cached, so that the tables
    and their buffers need at most `fill` of the cluster's HBM (module docstring, step
    1); {} when no choice of tables does it. `cm` costs every table in HBM."""
    from embarkc.planner.bound import least_memory
    from embarkc.planner.clusters import units_of

    need = least_memory(cm) * cm.W
    short = need - fill * cm.capacity * cm.W
    if short <= 0:
        return {}
    movable = [n for u in units_of(cm) if set(u.kinds) & {"rb", "ub"} for n in u.tables]
    # the biggest first, as many as hold several times the shortfall: the pricing stays
    # bounded on huge programs
    movable.sort(key=lambda n: (-table_bytes(cm, n), cm.facts[n].index))
    candidates: list[str] = []
    held = 0.0
    for n in movable:
        if len(candidates) >= MAX_CANDIDATES:
            break
        if held >= CANDIDATE_COVER * short and len(candidates) >= 8:
            break
        candidates.append(n)
        held += table_bytes(cm, n)
    heap: list[tuple[float, int, str, int]] = []
    hulls: dict[str, list[tuple[float, float, float]]] = {}
    for n in candidates:
        key = ("tier hull", cm.facts[n].signature_id)
        if key not in cm.cache_tables:
            cm.cache_tables[key] = _hull(_options(cm, n))
        hulls[n] = h = cm.cache_tables[key]
        if len(h) > 1:
            heapq.heappush(heap, (_price(h, 0), cm.facts[n].index, n, 0))
    chosen: dict[str, float] = {}
    freed = 0.0
    # a table in host memory keeps all its rows there: the tables chosen fit in the
    # cluster's host memory (each node's share is the placement's, `host_memory_problem`)
    host_left = float(cm.program.topology.host_memory or 0) * cm.nodes * HOST_FILL
    while heap and freed < short:
        _, _, n, i = heapq.heappop(heap)
        h = hulls[n]
        if n not in chosen:
            if table_bytes(cm, n) > host_left:
                continue
            host_left -= table_bytes(cm, n)
        freed += h[i + 1][1] - h[i][1]
        chosen[n] = h[i + 1][0]
        if i + 2 < len(h):
            heapq.heappush(heap, (_price(h, i + 1), cm.facts[n].index, n, i + 1))
    if freed < short:
        return {}  # even the largest tables uncached leave the rest too big for HBM
    return chosen


def _price(h: list[tuple[float, float, float]], i: int) -> float:
    """Seconds per byte freed of the step from hull point i to i + 1."""
    return (h[i + 1][2] - h[i][2]) / max(h[i + 1][1] - h[i][1], 1e-300)


def materialize(cm: CostModel, layout: Layout) -> Layout:
    """`layout` with every host table's cache rows written on its placement (`cm.tiers`
    shares of each cell's rows), so that any cost model costs it alike."""
    out = dict(layout)
    for name, share in cm.tiers.items():
        p = layout[name]
        if p.kind == "dp" or p.cache is not None:
            continue
        rows = shard_rows(cm.facts[name].rows, p.row_shards, cm.partition)
        j = np.array([c[0] for c in p.cell_list()], dtype=np.int64)
        cache = tuple(int(x) for x in cache_rows_of(rows[j], share).tolist())
        out[name] = _with_cache(p, cache)
    return out


def _with_cache(p: Placement, cache: tuple[int, ...] | None) -> Placement:
    return Placement(
        p.kind,
        p.row_shards,
        p.widths,
        p.ranks,
        p.communication,
        p.exchange,
        p.cells_explicit,
        cache if cache is not None and max(cache) >= 0 else None,
    )


GROW_MARGIN = 1e-4
"""Share of every rank's HBM `grow_caches` leaves free: the memory sums are floats, the
checker's integers (embarkc.planner.check) must find the rank within its capacity."""


def grow_caches(cm: CostModel, layout: Layout) -> Layout:
    """Each rank's free HBM (its capacity less what the layout holds there) to the caches
    of its host cells, the most host-link seconds saved per byte first, in steps of
    SHARES of the cell's rows; a cell caching all its rows returns to HBM. `cm` costs
    the placements' own caches (module docstring, step 3)."""
    st = cm.layout_state(layout)
    free = cm.capacity * (1.0 - GROW_MARGIN) - st.memory()
    cells: list[tuple[str, int, int, float, float, np.ndarray, np.ndarray]] = []
    caches: dict[str, list[int]] = {}
    for name in sorted(layout, key=lambda n: cm.facts[n].index):
        p = layout[name]
        if p.cache is None:
            continue
        tf = cm.facts[name]
        caches[name] = list(p.cache)
        rows = shard_rows(tf.rows, p.row_shards, cm.partition)
        for i, (j, lo, hi, rank) in enumerate(p.cell_list()):
            c = p.cache[i]
            if c < 0:
                continue
            n = int(rows[j])
            sizes = sorted({int(np.floor(s * n)) for s in SHARES} | {n})
            ladder = np.array([c] + [s for s in sizes if s > c], dtype=np.float64)
            if len(ladder) < 2:
                continue
            shard = np.full(len(ladder), j, dtype=np.int64)
            misses = cell_misses(cm, tf, p.row_shards, shard, ladder)[1]
            per_row = float(np.add(*tf.cell_bytes(1.0, hi - lo)))
            cells.append((name, i, rank, per_row, per_row / cm.bw_host, ladder, misses))
    heap: list[tuple[float, int, int]] = []
    for k, cell in enumerate(cells):
        _push(heap, k, 0, cell)
    while heap:
        _, k, at = heapq.heappop(heap)
        name, i, rank, per_row, _, ladder, _ = cells[k]
        room = float(np.floor(free[rank] / per_row))
        if room <= 0:
            continue
        now = ladder[at]
        if ladder[at + 1] - now <= room:
            new = ladder[at + 1]
            if at + 2 < len(ladder):
                _push(heap, k, at + 1, cells[k])
        else:
            new = now + room  # what is left of the rank's HBM, the last step of this cell
        free[rank] -= (new - now) * per_row
        caches[name][i] = int(new)
    out = dict(layout)
    for name, cache in caches.items():
        p = layout[name]
        rows = shard_rows(cm.facts[name].rows, p.row_shards, cm.partition)
        js = [c[0] for c in p.cell_list()]
        full = tuple(-1 if c >= int(rows[j]) else c for c, j in zip(cache, js, strict=True))
        out[name] = _with_cache(p, full)
    return out


def _push(heap: list[tuple[float, int, int]], k: int, at: int, cell: tuple[Any, ...]) -> None:
    """Queue cell `k`'s next step from ladder position `at`, by seconds saved per byte."""
    _, _, _, per_row, sec_per_row, ladder, misses = cell
    gain = (misses[at] - misses[at + 1]) * sec_per_row
    cost = (ladder[at + 1] - ladder[at]) * per_row
    heapq.heappush(heap, (-gain / max(cost, 1e-300), k, at))


def host_memory_problem(cm: CostModel, estimate: dict[str, Any]) -> str | None:
    """What is wrong when a node's host-tier cells (the estimate's `host_tier`) exceed
    the hardware's host memory."""
    cap = cm.program.topology.host_memory
    node = estimate["host_tier"]["node_host_bytes"]
    worst = int(np.argmax(node))
    if cap is None or node[worst] <= cap:
        return None
    return (
        f"node {worst} would keep {format_bytes(float(node[worst]))} of host-tier cells, more "
        f"than its host_memory of {format_bytes(cap)}"
    )


def tier_message(estimate: dict[str, Any], searched: float, fill: float) -> str:
    """What the plan's `planner.message` adds of its host tier."""
    ht = estimate["host_tier"]
    tables = ht["tables"]
    lookups = sum(t["lookups"] for t in tables)
    misses = sum(t["misses"] for t in tables)
    hit = 1.0 - misses / lookups if lookups > 0 else 1.0
    cached = sum(t["cache_rows"] for t in tables) / max(sum(t["rows"] for t in tables), 1)
    grown = ""
    if estimate["step_time"] < searched:
        grown = (
            f"; the caches grown into the HBM the placement left free took the step from "
            f"{searched * 1e3:.3f} to {estimate['step_time'] * 1e3:.3f} ms"
        )
    return (
        f"; host tier: {len(tables)} table{'s' if len(tables) != 1 else ''} "
        f"({format_bytes(float(ht['host_bytes']))}) in host memory, chosen to leave "
        f"{fill:.0%} of HBM to the tables, caching {cached:.1%} of their rows, "
        f"expected hit rate {hit:.1%}{grown}"
    )


def with_tiers_said(e: EmbarkError, chosen: dict[str, float], fill: float) -> EmbarkError:
    """`e` (the tiered search's refusal: its time limit ended it) saying that the tables
    were planned with `chosen` in host memory, whose shares of HBM its figures are."""
    first, *rest = e.diagnostics
    message = (
        f"the tables do not fit in HBM; with {len(chosen)} of them in host memory (chosen "
        f"to leave {fill:.0%} of HBM to the tables and their buffers): {first.message}"
    )
    return EmbarkError([replace(first, message=message), *rest], e.sources)


def refusal(cm: CostModel, refused: Exception | None) -> Exception:
    """The error of tables that fit neither in HBM nor with some in host memory: naming
    both capacities when the bytes exceed them together, else the search's last word."""
    prog = cm.program
    topo = prog.topology
    total = float(prog.embedding_bytes)
    hbm = cm.capacity * cm.W
    host = float(topo.host_memory or 0) * topo.nodes
    if total > hbm + host:
        return EmbarkError.at(
            prog.sources[0].path,
            f"the tables need {format_bytes(total)} (weights and optimizer state), more than "
            f"the cluster's HBM ({format_bytes(hbm)}: {cm.W} GPUs x "
            f"{format_bytes(cm.capacity)}) and host memory ({format_bytes(host)}: "
            f"{topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
            f"{format_bytes(float(topo.host_memory or 0))}) hold together",
            hint="add nodes or host_memory, or make the tables smaller",
        )
    if refused is not None:
        return refused
    from embarkc.planner.bound import least_memory

    return EmbarkError.at(
        prog.sources[0].path,
        f"the tables need {format_bytes(total)} (weights and optimizer state) and "
        f"{format_bytes(least_memory(cm) * cm.W - total)} of communication buffers at "
        f"least; with the tables that may leave HBM in host memory ({format_bytes(host)}, "
        f"{HOST_FILL:.0%} of it for tables), what stays does not fit in the cluster's HBM "
        f"({format_bytes(hbm)}: {cm.W} GPUs x {format_bytes(cm.capacity)})",
        hint="add nodes, hbm or host_memory, or let more tables shard (a table pinned to "
        "dp stays in HBM)",
    )


def summary_lines(host_tier: dict[str, Any], host_memory: int | None) -> list[str]:
    """The lines `plan` and `check` print of a plan's `estimate.host_tier`: each host
    table's cells, cached rows, bytes in HBM and host memory and expected hit rate, and
    the fullest node's host memory."""
    tables = host_tier.get("tables") or []
    if not tables:
        return []
    width = max(len(t["table"]) for t in tables)
    out = [
        f"host tier: {host_tier['cells']} cells of {len(tables)} "
        f"table{'s' if len(tables) != 1 else ''} in host memory behind HBM caches "
        "(LRU; expected hit rates: docs/host_tier.md)"
    ]
    for t in tables:
        share = t["cache_rows"] / t["rows"] if t["rows"] else 0.0
        out.append(
            f"  {t['table']:{width}s}  {t['table_rows']:>13,} rows  {t['cells']:3d} cells  "
            f"cached {share:6.1%}  HBM {format_bytes(t['hbm_bytes']):>10}"
            f"  host {format_bytes(t['host_bytes']):>10}  hit rate {t['hit_rate']:6.1%}"
        )
    nodes = host_tier.get("node_host_bytes") or []
    if nodes:
        cap = f" of its host_memory {format_bytes(host_memory)}" if host_memory else ""
        out.append(
            f"  host memory {format_bytes(float(host_tier['host_bytes']))} in all; the "
            f"fullest node holds {format_bytes(float(max(nodes)))}{cap}"
        )
    return out
