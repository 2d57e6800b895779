"""The cost model only costs; the work meter (planner/budget.py) counts the search's work.

Costing a layout gives the same figures whatever was costed before, and leaves the cost
model as it was (its memos aside, which hold pure functions of the program); the
search's counts and deadlines live on the `WorkMeter` a plan's stages share, so a search
on a model that has costed other things before finds the same plan."""

from __future__ import annotations

import math

from embarkc.planner import baselines as bl
from embarkc.planner.bound import bound_categories, least_memory, lower_bound
from embarkc.planner.budget import PlanBudget, WorkMeter, greedy_budget
from embarkc.planner.cost import CommandSize, CostModel
from embarkc.planner.search.runs import greedy
from embarkc.workload import program_from_workload
from tests.conftest import SHARED

MEMOS = {"unit_cache", "least_held", "_cells", "_dp", "_exchange", "_grid", "_stat_cache"}
"""The cost model's memos: each a pure function of the program and its key."""


def _state(cm: CostModel) -> dict[str, object]:
    """Every attribute of the model but its memos, by identity and value where cheap."""
    return {k: (id(v), repr(v)[:200]) for k, v in vars(cm).items() if k not in MEMOS}


def _layouts(cm: CostModel) -> list[dict]:  # type: ignore[type-arg]
    return [bl.build_layout(cm, name) for name in ("table-wise", "column-wise", "row-wise")]


def test_costing_layouts_in_any_order_gives_the_same_figures_and_leaves_the_model_as_it_was():
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=2)
    a, b = CostModel(prog), CostModel(prog)
    layouts = _layouts(a)
    before = _state(a)
    forward = [a.evaluate_layout(x) for x in layouts]
    lb = lower_bound(a)
    backward = [b.evaluate_layout(x) for x in reversed(layouts)][::-1]
    assert forward == backward  # every figure, to the bit
    assert _state(a) == before
    assert [a.evaluate_layout(x) for x in layouts] == forward  # again: the same
    assert lower_bound(b) == lb and least_memory(a) == least_memory(b)
    for counter in ("evaluations", "additions", "placed", "work_deadline", "bound_options"):
        assert not hasattr(a, counter)


def test_a_meter_counts_what_is_costed_on_it_and_nothing_else():
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=2)
    cm = CostModel(prog)
    layout = _layouts(cm)[0]
    meter = WorkMeter(cm.W)
    t = cm.step_time(layout, meter)
    assert meter.evaluations == 1 and meter.additions == len(layout)
    assert meter.seconds() > 0 and not meter.spent()
    seen = meter.seconds()
    assert cm.step_time(layout) == t  # no meter: counted nowhere
    assert meter.seconds() == seen
    with meter.until(seen):
        assert meter.spent()
    assert meter.deadline == math.inf


def test_a_search_finds_the_same_plan_whatever_its_model_costed_before():
    """The old noticeboard: the bound's options, once costed on the model, made a later
    search's bound start free, so the same search under a budget went further. Now the
    options are kept on the plan's meter, and a search is a function of the program and
    its budget alone."""
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=2)
    used = CostModel(prog)
    bound_categories(used)
    lower_bound(used)
    for layout in _layouts(used):
        used.evaluate_layout(layout)
    budget = 0.4
    a = greedy(used, budget=budget)
    b = greedy(CostModel(prog), budget=budget)
    assert a.layout == b.layout and a.work == b.work and a.step_time == b.step_time


def test_the_plan_budget_shares_the_limit_as_the_functions_do():
    prog = program_from_workload(SHARED / "workloads" / "t180.json", nodes=4)
    cm = CostModel(prog)
    size = CommandSize.of(cm.facts)
    budget = PlanBudget.of(30.0, size, cm.W)
    assert budget.greedy_work() == greedy_budget(30.0, budget.reserve)
    assert budget.baselines_fit
    assert budget.refine_seconds(1.0, 0.5) == 30.0 * 0.7
    assert budget.kick_work(1.0, 0.5, 21.0) > 0
    assert PlanBudget.of(1.0, size, cm.W).greedy_work() < 1.0
