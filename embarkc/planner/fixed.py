"""The fixed strategies beside the search: their step times (recorded in the plan), their
layouts offered to the greedy as starts, and the last word of a search that ended slower
than one of them.

    fixed_offer(program, cm, budget) -> FixedOffer      costed where the limit has room
    faster_fixed(cm, layout, offer) -> (name, layout) | None
    fixed_plan(program, cm, name, layout=None) -> (layout, Plan)

A strategy's layout is offered only when its plan passes the checker with the spec's
constraints: the search honours every constraint, a fixed strategy by itself does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from embark_runtime.plan import Plan
from embarkc.ir import Program
from embarkc.planner import baselines as bl
from embarkc.planner.budget import PlanBudget, WorkMeter
from embarkc.planner.build import build_plan
from embarkc.planner.cost import CostModel
from embarkc.planner.search.runs import FixedStart
from embarkc.planner.types import Layout


@dataclass(frozen=True)
class FixedOffer:
    """The fixed strategies' step times, when the limit had room to cost them."""

    times: dict[str, float] | None
    """Every fixed strategy that fits, with its step time; None: not costed (the limit
    is too short for them, `PlanBudget.baselines_fit`)."""
    start: FixedStart | None
    """Their layouts as starts of the greedy; None when none fits or none was costed."""


def fixed_offer(program: Program, cm: CostModel, budget: PlanBudget) -> FixedOffer:
    """The fixed strategies' step times and starts, costed (on the budget's meter) where
    their time fits in the limit, whether or not the caller records them: their time was
    reserved either way, so the plan does not depend on it."""
    if not budget.baselines_fit:
        return FixedOffer(None, None)
    times = bl.baseline_times(cm, budget.meter)
    start = fixed_start(program, cm, times, budget.meter) if times else None
    return FixedOffer(times, start)


def fixed_start(
    program: Program, cm: CostModel, fixed: dict[str, float], meter: WorkMeter | None = None
) -> FixedStart:
    """The fixed strategies (`fixed`: their step times) as starts of the greedy: a
    strategy's layout is offered when its plan passes the checker with the spec's
    constraints (on one node, with the communication the spec names); each strategy is
    built (on `meter`: inside the greedy, it is the search's work) and checked once, for
    the greedy and for the plan's last word (`faster_fixed`)."""
    from embarkc.planner.check import validate_plan

    allowed: dict[str, Layout | None] = {}

    def layout_of(name: str) -> Layout | None:
        if name not in allowed:
            layout = bl.build_layout(cm, name, meter)
            mode = program.options.communication
            if cm.nodes == 1 and mode != "auto":
                # on one node the spec's communication costs as flat does
                # (docs/language.md): the strategy's layout in the spec's word, the same
                # step time
                layout = {
                    t: p if p.kind == "dp" else replace(p, communication=mode)
                    for t, p in layout.items()
                }
            plan = fixed_plan(program, cm, name, layout, meter)[1]
            allowed[name] = None if validate_plan(program, plan) else layout
        return allowed[name]

    return FixedStart(dict(fixed), layout_of)


def faster_fixed(cm: CostModel, layout: Layout, offer: FixedStart) -> tuple[str, Layout] | None:
    """The fastest of the fixed strategies `offer` holds that is faster than `layout` and
    that the spec allows (`FixedStart.layout_of`, the greedy's own check), with its
    layout; None when none is. A search cut short by its limit may end slower than a
    fixed strategy: the plan is then that strategy."""
    current = cm.step_time(layout)
    for name, t in sorted(offer.times.items(), key=lambda kv: (kv[1], kv[0])):
        if not t < current * (1 - 1e-9):
            return None
        candidate = offer.layout_of(name)
        if candidate is not None:
            return name, candidate
    return None


def fixed_plan(
    program: Program,
    cm: CostModel,
    name: str,
    layout: Layout | None = None,
    meter: WorkMeter | None = None,
) -> tuple[Layout, Plan]:
    """The layout of the fixed strategy `name` (`baselines.FIXED`) and its plan file, as
    `plan_program` would write it without the search's record; `layout`: that strategy's
    layout when the caller has built it."""
    if layout is None:
        layout = bl.build_layout(cm, name, meter)
    info = {"strategy": name, "solver": "none", "status": "baseline", "seed": 0}
    written = layout
    if cm.tiers:
        from embarkc.planner.tiers import materialize

        # the host tables' caches on their cells, as the search's plan will write them
        written = materialize(cm, layout)
    return layout, build_plan(program, written, info, cm.evaluate_layout(written, meter))
