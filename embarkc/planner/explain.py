"""`--explain TABLE`: the cost of every alternative placement of one table.

Each alternative (kind x grid, and for rb and ub on several nodes each communication
the spec allows) re-places the table's cells on the least-loaded ranks of the plan with that table
removed (a hierarchical table's on one node, as the search does), keeps everything else
where it is, and is costed by the full cost model. The verdict says why an alternative
lost: it does not fit, or it makes the step time longer (and which component grew most on
the critical rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embarkc.planner.clusters import units_of
from embarkc.planner.cost import CostModel, TableFacts, owner_seconds
from embarkc.planner.search.place import best_node
from embarkc.planner.types import Layout, Placement, column_widths


def _grids(cm: CostModel, rows_max: int, cols_max: int) -> list[tuple[int, int]]:
    rs = sorted({1, 2, 4, 8, cm.G, cm.W} & set(range(1, rows_max + 1)))
    cs = sorted({1, 2, 4} & set(range(1, cols_max + 1)))
    return [(r, c) for r in rs for c in cs if r * c <= cm.W]


def _communications(cm: CostModel) -> tuple[str, ...]:
    """The rb and ub communications the planner may choose: both on several nodes when
    the spec leaves it open, else the spec's (flat on one node)."""
    mode = cm.program.options.communication
    if cm.nodes == 1:
        return ("flat",)
    return ("flat", "hierarchical") if mode == "auto" else (mode,)


def _placed(
    cm: CostModel,
    tf: TableFacts,
    p: Placement,
    loads: np.ndarray,
    mem: np.ndarray,
    within_node: bool,
) -> Placement:
    """`p` with its cells heaviest first on the least-loaded ranks with room; a
    hierarchical or `within_node` table's cells on one node, as the search places them."""
    cv = cm.grid_values(tf, p)
    secs = owner_seconds(cm, cv, p.hierarchical)
    need = cv.weights + cv.state + cv.buf_own
    order = np.argsort(-secs, kind="stable")
    allowed = np.ones(cm.W, dtype=bool)
    if p.hierarchical or within_node:
        node = best_node(cm, loads, mem, cm.capacity, secs[order], need[order])
        if node is not None:
            allowed = cm.node_of == node
    l2, m2 = loads.copy(), mem.copy()
    rk = [0] * len(secs)
    for i in order:
        room = allowed & (m2 + need[i] <= cm.capacity)
        a = int(np.argmin(np.where(room, l2, np.inf))) if room.any() else int(np.argmin(m2))
        rk[int(i)] = a
        l2[a] += secs[i]
        m2[a] += need[i]
    return p.with_ranks(tuple(rk))


def alternatives(cm: CostModel, layout: Layout, table: str) -> list[dict[str, Any]]:
    """Rows {kind, communication, grid, step_time, max_memory, chosen, verdict}, the
    plan's own first (communication: flat or hierarchical for rb, else None)."""
    unit = next(u for u in units_of(cm) if table in u.tables)
    current = layout[table]
    base = dict(layout)
    del base[table]
    st = cm.layout_state(base)
    loads = st.times()
    mem = st.memory()
    tf = cm.facts[table]
    options: list[Placement] = [current]
    for kind in unit.kinds:
        if kind == "dp":
            options.append(Placement("dp", exchange=cm.best_exchange(tf)))  # type: ignore[arg-type]
            continue
        for comm in _communications(cm):
            for r, c in _grids(cm, min(unit.max_r, tf.rows), unit.max_c):
                if not (unit.min_r <= r and unit.min_c <= c):
                    continue
                widths = column_widths(tf.dim, c)
                p = Placement(kind, r, widths, (0,) * (r * c), communication=comm)  # type: ignore[arg-type]
                options.append(_placed(cm, tf, p, loads, mem, unit.within_node))
    rows = []
    chosen_time = None
    chosen_comp: dict[str, np.ndarray] = {}
    for k, p in enumerate(options):
        trial = dict(base)
        trial[table] = p
        s = cm.layout_state(trial)
        t = s.times()
        m = s.memory()
        comp = s.components()
        # a plan read from a file spells its cells out (no widths): cells per row shard
        cols = p.column_shards or p.cells // max(p.row_shards, 1)
        grid = "-" if p.kind == "dp" else f"{p.row_shards}x{cols}"
        row = {
            "kind": p.kind,
            "communication": p.communication if p.kind in ("rb", "ub") else None,
            "grid": grid,
            "step_time": float(t.max()),
            "max_memory": float(m.max()),
            "chosen": k == 0,
        }
        if k == 0:
            chosen_time, chosen_comp = float(t.max()), comp
            row["verdict"] = "chosen"
        elif float(m.max()) > cm.capacity:
            row["verdict"] = "does not fit in memory"
        else:
            crit = int(np.argmax(t))
            grew = max(comp, key=lambda c: comp[c][crit] - float(chosen_comp[c].max()))
            assert chosen_time is not None
            if float(t.max()) >= chosen_time:
                row["verdict"] = f"slower by {(float(t.max()) - chosen_time) * 1e3:.3f} ms ({grew})"
            else:
                row["verdict"] = "faster alone, but the search judged the whole plan"
        rows.append(row)
    return rows
