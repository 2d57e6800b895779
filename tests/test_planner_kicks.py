"""Random kicks after the greedy (`greedy.kicked`): an iterated local search that the
refinement runs in what the time limit leaves beyond CP-SAT's share."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from embarkc.frontend import load_program_text
from embarkc.planner import plan_program
from embarkc.planner.check import validate_plan
from embarkc.planner.cost import CostModel
from tests.test_planner_properties import _check_invariants, programs

# seed 46 of bench/plan_time_fuzz.py: five tables on 8 x 8 GPUs of 70 MiB, 70 % full. The
# greedy ends in two clusters (rb hierarchical and ub, 0.723 ms): no single move of one
# table's kind pays for itself while the other cluster's collectives stay. A kick moves
# two tables at once, and their descent finds one ub cluster (0.363 ms).
FEW_TABLES = """
hardware { preset dgx_h100 nodes 8 hbm 73150738 B }
model { batch 65536 }
table t0 { rows 716753 dim 32 hotness 15 optimizer sgd pooling sum access zipf(1.04) }
table t1 { rows 27566 dim 16 hotness 49 optimizer adagrad pooling sum access zipf(1.17) }
table t2 { rows 21327 dim 64 hotness 86 optimizer sgd pooling sum access zipf(1.13) }
table t3 { rows 1491051 dim 64 hotness 2 optimizer rowwise_adagrad pooling sum access zipf(1.15) }
table t4 { rows 1361693 dim 256 hotness 2 optimizer adagrad pooling mean access zipf(1.16) }
"""


def _program():  # type: ignore[no-untyped-def]
    return load_program_text(FEW_TABLES, "few_tables.embark")


def test_kicks_cross_what_no_single_move_of_the_greedy_does() -> None:
    from embarkc.planner.search.kicks import kicked
    from embarkc.planner.search.runs import greedy
    from embarkc.planner.search.tuning import KICK_PATIENCE

    cm = CostModel(_program())
    g = greedy(cm)
    assert g.step_time > 0.7e-3
    assert len({d.kind for d in g.decisions.values()}) == 2
    k = kicked(cm, g, budget=30.0, seed=0)
    assert k.kicked_from == g.step_time
    assert k.step_time < 0.55 * g.step_time
    assert k.step_time == pytest.approx(cm.step_time(k.layout), rel=1e-12)
    assert k.kicks > KICK_PATIENCE  # it found faster plans, then ran out of patience
    assert k.work > g.work
    assert float(cm.layout_state(k.layout).memory().max()) <= cm.capacity
    # the same seed, the same plan; no budget, no kick
    again = kicked(cm, g, budget=30.0, seed=0)
    assert again.layout == k.layout
    assert kicked(cm, g, budget=0.0, seed=0) is g


def test_kicks_stop_at_their_budget() -> None:
    from embarkc.planner.budget import WorkMeter
    from embarkc.planner.search.kicks import kicked
    from embarkc.planner.search.runs import greedy

    cm = CostModel(_program())
    meter = WorkMeter(cm.W)
    g = greedy(cm, meter=meter)
    before = meter.seconds()
    k = kicked(cm, g, budget=0.05, seed=0, meter=meter)
    spent = meter.seconds() - before
    # a kick's descent ends at the budget; the last one can pass it by one evaluation
    assert spent < 0.05 + 0.02
    assert k.kicks >= 1 and k.step_time <= g.step_time


def test_the_plan_records_the_kicks_and_passes_the_checker() -> None:
    program = _program()
    plan = plan_program(program, time_limit=30)
    extra = plan.planner.model_extra or {}
    assert extra["kicked_from"] > 0.7e-3
    assert plan.estimate.step_time < 0.55 * extra["kicked_from"]
    # CP-SAT refines the kicked plan (never slower than it)
    assert plan.estimate.step_time <= extra["greedy_step_time"] * (1 + 1e-9)
    assert extra["greedy_step_time"] < 0.55 * extra["kicked_from"]
    assert "random kicks took the greedy plan from 0.723 to" in extra["message"]
    assert validate_plan(program, plan) == []
    # `--solver greedy` is EMBark's greedy alone
    alone = plan_program(program, solver="greedy", time_limit=30)
    assert "kicked_from" not in (alone.planner.model_extra or {})
    assert alone.estimate.step_time > 0.7e-3


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_kicks_never_lengthen_the_step_or_the_waits_and_keep_every_rule(program) -> None:
    """On random programs (constraints, colocated groups, one node or several): the kicked
    plan is never slower than the greedy's, its critical path no longer, and it passes
    the checker and every invariant of the search's plans; the same seed, the same plan."""
    from embarkc.diagnostics import EmbarkError
    from embarkc.planner import build_plan
    from embarkc.planner.search.kicks import kicked
    from embarkc.planner.search.runs import greedy

    cm = CostModel(program)
    try:
        g = greedy(cm)
    except EmbarkError:
        return
    k = kicked(cm, g, budget=0.3, seed=1)
    assert k.step_time <= g.step_time * (1 + 1e-9)
    st, st_g = cm.layout_state(k.layout), cm.layout_state(g.layout)
    assert st.critical_path() <= st_g.critical_path() * (1 + 1e-9)
    assert float(st.memory().max()) <= cm.capacity
    info = {"strategy": "embark", "solver": "cp-sat", "status": "greedy", "seed": 0}
    plan = build_plan(program, k.layout, info, cm.evaluate_layout(k.layout))
    assert validate_plan(program, plan) == []
    _check_invariants(program, plan)
    assert kicked(CostModel(program), g, budget=0.3, seed=1).layout == k.layout
