"""After the starts: the fastest plan rebalanced cell by cell (`rebalanced`), its
critical path lowered (`balanced_phases`), and the full model's memory check
(`fits_exactly`).
"""

from __future__ import annotations

from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    Unit,
)
from embarkc.planner.cost import CostModel, RankState
from embarkc.planner.search.board import Progress
from embarkc.planner.search.cells import Search
from embarkc.planner.search.place import Decision
from embarkc.planner.search.tuning import (
    FOUR_START_UNITS,
    PHASE_EVALS,
    PHASE_EVALS_LARGE,
    PHASE_MIN_GAIN,
    PHASE_PASSES,
    REBALANCE_EVALS,
    REBALANCE_FIRST_EVALS,
)
from embarkc.planner.types import Layout, Placement


def rebalanced(
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
