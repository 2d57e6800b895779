"""CP-SAT refinement of the greedy placement (OR-tools), warm-started from greedy.

The grids (kind, row and column shards) come from the greedy search; CP-SAT re-decides
the rank of every cell. Model (times in integer nanoseconds, memory in bytes):

    x[i, a]   cell i (of a unit: the same cell of every colocated table) is on rank a
    T         the makespan of the owner loads

    each cell on exactly one rank:            sum_a x[i, a] == 1
    memory fits on every rank:                sum_i mem_i x[i, a] <= capacity - replicated
    T bounds every rank's owner load:         sum_i load_i x[i, a] <= T
    within_node units keep the greedy node:   x[i, a] == 0 for a off that node
    minimise T; hints: x[i, greedy_rank(i)] = 1

`load_i` is `cost.owner_seconds` (what a cell puts on its owner); the terms every rank
pays alike are left out. When `cells x ranks` is small the whole model is solved; beyond
`FULL_MODEL_LIMIT` a large-neighbourhood search solves the sub-model of the critical rank
and a few other ranks (seeded choice) at a time. Either way each candidate is re-costed
by the exact model and the refinement returns the greedy layout unless it found a
strictly better one. Solves use one worker and a deterministic time limit
(`max_deterministic_time`), so a fixed seed gives the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embarkc.planner.clusters import Unit
from embarkc.planner.cost import CostModel, owner_seconds
from embarkc.planner.greedy import P_NORM, GreedyResult
from embarkc.planner.types import Layout

FULL_MODEL_LIMIT = 4096
"""Largest cells x ranks for which the full assignment model is built."""

LNS_RANKS = 8
"""Ranks freed per large-neighbourhood step."""

LNS_STALL = 60
"""Consecutive non-improving neighbourhoods after which the search stops early."""

LNS_STEPS_PER_SECOND = 5
"""Neighbourhoods allowed per second of time limit: bounds the Python work around the
solver (re-costing every candidate) as deterministically as the solver's own limit."""

TIME_SCALE = 1e9
"""Integer model time unit: nanoseconds."""


@dataclass
class RefineResult:
    layout: Layout
    status: str
    """optimal | feasible | greedy (CP-SAT did not beat the greedy plan)."""
    objective: float | None
    """Makespan of the owner loads in CP-SAT's model (seconds)."""
    bound: float | None
    """CP-SAT's lower bound on that makespan (seconds)."""
    deterministic_time: float
    message: str


@dataclass
class _Cell:
    unit: Unit
    index: int
    load: int
    mem: int
    allowed: np.ndarray


def _cells(cm: CostModel, g: GreedyResult) -> tuple[list[_Cell], np.ndarray, float]:
    """Every movable cell, the greedy rank of each, and the memory every rank pays alike."""
    cells: list[_Cell] = []
    ranks: list[int] = []
    replicated = 0.0
    for u in g.units:
        first = g.layout[u.tables[0]]
        if first.kind == "dp":
            for n in u.tables:
                tf = cm.facts[n]
                dv = cm.dp_values(tf, g.layout[n].exchange)
                replicated += dv.weights + dv.state + dv.buf
            continue
        load = np.zeros(first.cells)
        mem = np.zeros(first.cells)
        for n in u.tables:
            cv = cm.grid_values(cm.facts[n], g.layout[n])
            load += owner_seconds(cm, cv)
            mem += cv.weights + cv.state + cv.buf_own
            replicated += cv.buf_all
        for i, r in enumerate(first.ranks):
            if u.within_node:
                allowed = cm.node_of == cm.node_of[r]
            else:
                allowed = np.ones(cm.W, dtype=bool)
            cells.append(
                _Cell(u, i, int(round(load[i] * TIME_SCALE)), int(np.ceil(mem[i])), allowed)
            )
            ranks.append(r)
    return cells, np.asarray(ranks, dtype=np.int64), replicated


def _layout(g: GreedyResult, cells: list[_Cell], ranks: np.ndarray) -> Layout:
    per_unit: dict[str, list[int]] = {}
    for c, r in zip(cells, ranks, strict=True):
        per_unit.setdefault(c.unit.name, list(g.layout[c.unit.tables[0]].ranks))[c.index] = int(r)
    out = dict(g.layout)
    for u in g.units:
        if u.name in per_unit:
            for n in u.tables:
                out[n] = g.layout[n].with_ranks(tuple(per_unit[u.name]))
    return out


def _base_loads(
    cm: CostModel,
    layout: Layout,
    cells: list[_Cell],
    ranks: np.ndarray,
    free: Any,
    times: np.ndarray | None = None,
) -> dict[int, int]:
    """What each rank in `free` costs besides the owner loads of the movable cells on it:
    its full-model time minus those loads (ns). This linearises the full cost model around
    the current placement (receiving, requester work and latencies stay where they are)."""
    t = cm.layout_state(layout).times() if times is None else times
    own = np.zeros(cm.W)
    np.add.at(own, ranks, np.array([c.load for c in cells], dtype=np.float64))
    return {int(a): max(0, int(round(t[a] * TIME_SCALE - own[a]))) for a in free}


def _norm(t: np.ndarray) -> float:
    m = float(t.max())
    return m * float(((t / m) ** P_NORM).sum()) ** (1.0 / P_NORM) if m > 0 else 0.0


def _solve(
    cells: list[_Cell],
    idx: list[int],
    ranks_s: list[int],
    hint: np.ndarray,
    capacity: int,
    base_load: dict[int, int],
    base_mem: dict[int, int],
    time_limit: float,
    seed: int,
) -> tuple[str, dict[int, int], float, float, float]:
    """Assign cells `idx` to ranks `ranks_s`; returns (status, assignment, objective,
    bound, deterministic time)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    for i in idx:
        opts = [a for a in ranks_s if cells[i].allowed[a]]
        if not opts:
            return "infeasible", {}, 0.0, 0.0, 0.0
        for a in opts:
            x[i, a] = m.new_bool_var(f"x{i}_{a}")
        m.add_exactly_one(x[i, a] for a in opts)
    top = sum(c.load for c in cells) + max(base_load.values(), default=0) + 1
    makespan = m.new_int_var(0, top, "T")
    for a in ranks_s:
        here = [(i, x[i, a]) for i in idx if (i, a) in x]
        m.add(sum(cells[i].mem * v for i, v in here) + base_mem.get(a, 0) <= capacity)
        m.add(sum(cells[i].load * v for i, v in here) + base_load.get(a, 0) <= makespan)
    m.minimize(makespan)
    for (i, a), v in x.items():
        m.add_hint(v, int(hint[i] == a))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = max(time_limit, 0.01)
    # the owner-load model ignores terms of the full cost model worth more than 1 %
    solver.parameters.relative_gap_limit = 0.01
    # a wall-clock safety net far above the deterministic limit (it never binds in
    # practice, so results stay reproducible)
    solver.parameters.max_time_in_seconds = 10.0 * time_limit + 30.0
    status = solver.solve(m)
    dt = float(solver.deterministic_time)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "infeasible" if status == cp_model.INFEASIBLE else "unknown", {}, 0.0, 0.0, dt
    assign = {i: a for (i, a), v in x.items() if solver.value(v)}
    name = "optimal" if status == cp_model.OPTIMAL else "feasible"
    return name, assign, solver.objective_value, solver.best_objective_bound, dt


def refine(
    cm: CostModel,
    g: GreedyResult,
    time_limit: float,
    seed: int = 0,
    progress: Callable[[str, float, float], None] | None = None,
) -> RefineResult:
    """Refine the greedy placement with CP-SAT; never returns a worse layout than greedy."""
    cells, greedy_ranks, replicated = _cells(cm, g)
    greedy_time = g.step_time
    if not cells or cm.W == 1:
        return RefineResult(g.layout, "greedy", None, None, 0.0, "nothing to place")
    capacity = int(cm.capacity - replicated)
    if len(cells) * cm.W <= FULL_MODEL_LIMIT:
        base = _base_loads(cm, g.layout, cells, greedy_ranks, range(cm.W))
        status, assign, obj, bound, dt = _solve(
            cells,
            list(range(len(cells))),
            list(range(cm.W)),
            greedy_ranks,
            capacity,
            base,
            {},
            time_limit,
            seed,
        )
        if not assign:
            return RefineResult(g.layout, "greedy", None, None, dt, f"cp-sat: {status}")
        ranks = greedy_ranks.copy()
        for i, a in assign.items():
            ranks[i] = a
        layout = _layout(g, cells, ranks)
        t = cm.step_time(layout)
        msg = f"cp-sat full model ({len(cells)} cells x {cm.W} ranks), {status} in its model"
        if t < greedy_time * (1 - 1e-9):
            return RefineResult(layout, status, obj / TIME_SCALE, bound / TIME_SCALE, dt, msg)
        return RefineResult(
            g.layout,
            "greedy",
            obj / TIME_SCALE,
            bound / TIME_SCALE,
            dt,
            msg + "; its placement is not faster by the full cost model, greedy kept",
        )
    return _lns(cm, g, cells, greedy_ranks, capacity, time_limit, seed, progress)


def _lns(
    cm: CostModel,
    g: GreedyResult,
    cells: list[_Cell],
    start: np.ndarray,
    capacity: int,
    time_limit: float,
    seed: int,
    progress: Callable[[str, float, float], None] | None,
) -> RefineResult:
    rng = np.random.default_rng(seed)
    ranks = start.copy()
    load_v = np.array([c.load for c in cells], dtype=np.int64)
    best_layout = cur_layout = g.layout
    best_t = g.step_time
    cur_times = cm.layout_state(g.layout).times()
    cur_norm = _norm(cur_times)
    spent = 0.0
    steps = improved = stall = 0
    per_step = max(0.05, min(1.0, time_limit / 50))
    max_steps = max(1, int(LNS_STEPS_PER_SECOND * time_limit))
    while spent + per_step <= time_limit + 1e-9 and stall < LNS_STALL and steps < max_steps:
        crit = int(np.argmax(cur_times))
        others = np.argsort(cur_times, kind="stable")
        pool = [int(a) for a in others if a != crit]
        light = pool[: LNS_RANKS // 2]
        rest = [a for a in pool if a not in light]
        extra = rng.choice(
            len(rest), size=min(len(rest), LNS_RANKS - 1 - len(light)), replace=False
        )
        free = sorted({crit, *light, *(rest[int(e)] for e in extra)})
        idx = [i for i in range(len(cells)) if int(ranks[i]) in free]
        base = _base_loads(cm, cur_layout, cells, ranks, free, cur_times)
        status, assign, _, _, dt = _solve(
            cells,
            idx,
            free,
            ranks,
            capacity,
            base,
            {},
            per_step,
            seed + steps,
        )
        spent += dt if dt > 0 else per_step
        steps += 1
        if not assign:
            stall += 1
            continue
        trial = ranks.copy()
        for i, a in assign.items():
            trial[i] = a
        layout = _layout(g, cells, trial)
        t_r = cm.layout_state(layout).times()
        norm = _norm(t_r)
        if norm < cur_norm * (1 - 1e-9):
            ranks, cur_layout, cur_times, cur_norm, stall = trial, layout, t_r, norm, 0
            if float(t_r.max()) < best_t * (1 - 1e-9):
                best_t, best_layout = float(t_r.max()), cur_layout
                improved += 1
        else:
            stall += 1
        if progress is not None:
            progress("cp-sat", min(1.0, spent / time_limit), best_t)
    loads = np.zeros(cm.W, dtype=np.int64)
    np.add.at(loads, ranks, load_v)
    total = float(load_v.sum())
    bound = max(total / cm.W, float(load_v.max())) / TIME_SCALE
    msg = (
        f"cp-sat large-neighbourhood search ({len(cells)} cells x {cm.W} ranks, "
        f"{steps} neighbourhoods of {LNS_RANKS} ranks, {improved} improved the step time)"
    )
    if best_t < g.step_time * (1 - 1e-9):
        return RefineResult(
            best_layout, "feasible", float(loads.max()) / TIME_SCALE, bound, spent, msg
        )
    return RefineResult(
        g.layout, "greedy", float(loads.max()) / TIME_SCALE, bound, spent, msg + "; greedy kept"
    )
