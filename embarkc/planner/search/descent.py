"""A start's descent: its placement, splitting rows of a unit that finds no room
(`place_splitting`), then improve and polish while the step time falls (`descend`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from embarkc.planner.clusters import (
    NoFit,
    Unit,
    dp_bytes,
    initial_grid,
    smaller_tables,
    unit_bytes,
)
from embarkc.planner.search.cells import Search
from embarkc.planner.search.place import Decision, NoRoom
from embarkc.planner.search.tuning import (
    DESCENT_CYCLES,
    FINE_CELL_SHARE,
    FOUR_START_UNITS,
    POLISH_ROUNDS,
)
from embarkc.planner.types import Layout
from embarkc.units import format_bytes


def descend(search: Search, limit: int) -> tuple[float, Layout, dict[str, Decision]]:
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


def _split_helps(search: Search, u: Unit, d: Decision) -> bool:
    """Whether doubling the row shards of `d` makes the unit's cells pack better (see
    FINE_CELL_SHARE). The cells' values come from the search's cache, where the next
    placement finds the finer grid's."""
    mem = search._prepare(u, d)[1]
    finer = search._prepare(u, replace(d, r=min(u.max_r, d.r * 2)))[1]
    biggest = float(mem.max())
    return biggest > FINE_CELL_SHARE * search.cm.capacity and float(finer.max()) <= 0.75 * biggest


def place_splitting(
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
    raise NoFit.at(
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
