"""Random kicks: iterated local search from the greedy plan (`kicked`)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    default_comm,
)
from embarkc.planner.cost import CostModel
from embarkc.planner.search.board import Progress
from embarkc.planner.search.cells import Search
from embarkc.planner.search.finish import balanced_phases, decision_of, fits_exactly
from embarkc.planner.search.runs import GreedyResult
from embarkc.planner.search.tuning import KICK_PATIENCE, KICK_UNITS, POLISH_ROUNDS


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
