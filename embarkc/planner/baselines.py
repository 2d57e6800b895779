"""Fixed sharding strategies, for comparison with the search (`--strategy`).

* table-wise: every table whole (rb, one cell) on one rank; tables heaviest first onto
  the least-loaded rank with room (TorchRec's table-wise sharding with its greedy
  partitioner).
* row-wise: every table rb, split into min(W, rows) row shards, shard j on rank j.
* column-wise: every table rb, split into column cells of 16 columns or more (at most W),
  cells placed heaviest first; rowwise_adagrad tables keep one column.
* table-row-wise: the EMBark paper's baseline (TorchRec TWRW): table i on node i mod N,
  row-sharded over that node's GPUs, hierarchical communication when there are several
  nodes.
* data-parallel: every table replicated (dp), when all of them fit on one GPU.

Baselines honour memory but not the spec's placement constraints: they are what the
named strategy would do. `plan_program` records the constraints a baseline breaks in
`planner.ignored_constraints`, and the commands print a warning at each one.
`build_layout` raises EmbarkError when a strategy cannot fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from embark_runtime.formatting import format_bytes
from embark_runtime.optimizers import columns_may_be_cut
from embark_runtime.plan import Plan
from embarkc.diagnostics import EmbarkError
from embarkc.ir import STRATEGIES
from embarkc.planner.cost import CostModel, owner_seconds
from embarkc.planner.types import Layout, Placement, column_widths

if TYPE_CHECKING:
    from embarkc.planner.budget import WorkMeter

FIXED = STRATEGIES[2:]


def _unfit(cm: CostModel, name: str, why: str) -> EmbarkError:
    return EmbarkError.at(
        cm.program.sources[0].path,
        f"strategy `{name}` does not fit this spec: {why}",
        hint="use --strategy embark, or more GPUs",
    )


def _lpt(cm: CostModel, name: str, items: list[tuple[str, Placement]]) -> Layout:
    """Place every cell of `items` heaviest first on the least-loaded rank with room."""
    loads = np.zeros(cm.W)
    mem = np.zeros(cm.W)
    cells: list[tuple[float, int, int, float]] = []
    uniform = 0.0  # the requesters' buffers, on every rank
    for ti, (tname, p) in enumerate(items):
        cv = cm.grid_values(cm.facts[tname], p)
        secs = owner_seconds(cm, cv)
        m = cv.weights + cv.state + cv.buf_own
        uniform += cv.buf_all
        for ci in range(len(secs)):
            cells.append((-float(secs[ci]), ti, ci, float(m[ci])))
    cells.sort()
    ranks = [[-1] * p.cells for _, p in items]
    for neg, ti, ci, m in cells:
        room = mem + m <= cm.capacity - uniform
        if not room.any():
            raise _unfit(cm, name, f"a cell of `{items[ti][0]}` finds no GPU with room")
        a = int(np.argmin(np.where(room, loads, np.inf)))
        ranks[ti][ci] = a
        loads[a] -= neg
        mem[a] += m
    return {t: p.with_ranks(tuple(ranks[i])) for i, (t, p) in enumerate(items)}


def column_wise_cells(table: Any, W: int) -> int:
    """The column cells column-wise cuts `table` into on `W` ranks: 16 columns or more
    each, at most one per rank; a table whose optimizer forbids column cuts
    (rowwise_adagrad) stays whole."""
    if not columns_may_be_cut(table.optimizer.kind):
        return 1
    return max(1, min(W, table.dim // 16))


def build_layout(cm: CostModel, name: str, meter: WorkMeter | None = None) -> Layout:
    """The layout of fixed strategy `name` (one of FIXED)."""
    prog = cm.program
    W, G = cm.W, cm.G
    layout: Layout = {}
    if name == "table-wise":
        items = [(t.name, Placement("rb", 1, (t.dim,), (0,))) for t in prog.tables]
        layout = _lpt(cm, name, items)
    elif name == "column-wise":
        items = []
        for t in prog.tables:
            c = column_wise_cells(t, W)
            items.append((t.name, Placement("rb", 1, column_widths(t.dim, c), (0,) * c)))
        layout = _lpt(cm, name, items)
    elif name == "row-wise":
        for t in prog.tables:
            r = min(W, t.rows)
            layout[t.name] = Placement("rb", r, (t.dim,), tuple(range(r)))
    elif name == "table-row-wise":
        comm = "hierarchical" if cm.nodes > 1 else "flat"
        for i, t in enumerate(prog.tables):
            node = i % cm.nodes
            r = min(G, t.rows)
            ranks = tuple(node * G + j for j in range(r))
            layout[t.name] = Placement("rb", r, (t.dim,), ranks, communication=comm)  # type: ignore[arg-type]
    elif name == "data-parallel":
        for t in prog.tables:
            layout[t.name] = Placement("dp", exchange=cm.best_exchange(cm.facts[t.name]))  # type: ignore[arg-type]
    else:
        raise EmbarkError.at(
            prog.sources[0].path,
            f"unknown strategy `{name}`",
            hint=f"strategies: {', '.join(STRATEGIES)}",
        )
    mem = cm.layout_state(layout, meter).memory()
    worst = int(np.argmax(mem))
    if mem[worst] > cm.capacity:
        raise _unfit(
            cm,
            name,
            f"rank {worst} would hold {format_bytes(mem[worst])} (weights, optimizer state "
            f"and buffers), more than {format_bytes(cm.capacity)}",
        )
    return layout


def baseline_times(cm: CostModel, meter: WorkMeter | None = None) -> dict[str, float]:
    """Step time of every fixed strategy that fits (strategies that do not fit are left
    out); their costing counted on `meter` when given."""
    out: dict[str, float] = {}
    for name in FIXED:
        try:
            out[name] = cm.step_time(build_layout(cm, name, meter), meter)
        except EmbarkError:
            continue
    return out


def build_baseline(program: Any, name: str) -> Plan:
    """The plan of fixed strategy `name` for `program` (EmbarkError when it cannot fit)."""
    from embarkc.planner import plan_program

    if name in ("embark", "greedy"):
        return plan_program(program, strategy=name, solver="greedy")
    return plan_program(program, strategy=name)
