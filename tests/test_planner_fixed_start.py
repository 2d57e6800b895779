"""The greedy's fixed starts: a fixed strategy faster than every start of the search is
where the search goes on from (`greedy.FixedStart`, `fixed.fixed_start`)."""

from __future__ import annotations

import pytest

from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program_text
from embarkc.planner import baselines as bl
from embarkc.planner import plan_program
from embarkc.planner.check import validate_plan
from embarkc.planner.cost import CostModel

# four tables of 100M rows (adam: 76.8 GB each with its state) and ten small ones on
# 16 GPUs: each big table must span two GPUs at least, and the column-wise strategy's
# 4 cells of 16 columns give every GPU the same share; the starts' grids placed by the
# search stop at two halves per big table (0.184 ms against column-wise's 0.170)
REGULAR = """
hardware {{ preset dgx_h100 nodes 2 }}
defaults {{ dim 64 optimizer adam pooling mean access zipf(1.05) }}
tables big[0..3] {{ rows 100M hotness 20 }}
tables small[0..9] {{ rows 1000 hotness 2 dim 16 }}
model {{ batch 8192 dense_features 13 bottom_mlp [256, 64] interaction dot top_mlp [256, 1] }}
{plan}
"""


def _program(plan: str = ""):  # type: ignore[no-untyped-def]
    return load_program_text(REGULAR.format(plan=plan), "regular.embark")


def test_the_search_goes_on_from_a_fixed_strategy_faster_than_its_own_starts() -> None:
    from embarkc.planner.search.runs import greedy

    program = _program()
    cm = CostModel(program)
    column_wise = cm.step_time(bl.build_layout(cm, "column-wise"))
    alone = greedy(cm)  # no fixed start: what the starts reach
    assert alone.from_fixed is None
    assert alone.step_time > column_wise * 1.05
    for solver in ("greedy", "cp-sat"):
        plan = plan_program(program, solver=solver, time_limit=30)
        extra = plan.planner.model_extra or {}
        assert plan.planner.strategy == "embark"
        assert extra["fixed_start"] == "column-wise"
        assert "fixed_strategy" not in extra  # the search's own plan, not the fallback
        assert extra["greedy_step_time"] <= column_wise * (1 + 1e-9)
        assert plan.estimate.step_time <= column_wise * (1 + 1e-9)
        assert (
            "went on from the column-wise strategy's layout, faster than what its own starts"
            in extra["message"]
        )
        assert validate_plan(program, plan) == []


@pytest.mark.parametrize(
    "constraint",
    ["table big0 { column_shards ..2 }", "colocate small0, small1"],
)
def test_a_fixed_strategy_the_constraints_forbid_is_no_start(constraint: str, monkeypatch) -> None:
    """Column-wise cuts big0 into 4 columns and puts small0 and small1 on two GPUs: with
    either constraint it is no start (the search asks for it, faster than its own starts,
    and is refused it), and the plan keeps the constraint."""
    import embarkc.planner.fixed as fixed_mod

    asked: dict[str, bool] = {}
    offer = fixed_mod.fixed_start

    def recorded(program, cm, fixed, meter=None):  # type: ignore[no-untyped-def]
        f = offer(program, cm, fixed, meter)

        def layout_of(name: str):  # type: ignore[no-untyped-def]
            layout = f.layout_of(name)
            asked[name] = layout is not None
            return layout

        return type(f)(f.times, layout_of)

    monkeypatch.setattr(fixed_mod, "fixed_start", recorded)
    program = _program(f"plan {{ {constraint} }}")
    plan = plan_program(program, solver="greedy", time_limit=30)
    assert asked == {"column-wise": False}
    extra = plan.planner.model_extra or {}
    assert extra.get("fixed_start") != "column-wise"
    assert validate_plan(program, plan) == []
    if "column_shards" in constraint:
        cols = {s.columns[0] for s in plan.shards if s.table == "big0"}
        assert len(cols) <= 2
    else:
        ranks = {t: {s.rank for s in plan.shards if s.table == t} for t in ("small0", "small1")}
        assert ranks["small0"] == ranks["small1"]


def test_a_fixed_start_plans_a_spec_on_which_no_start_fits(monkeypatch) -> None:
    """When every start finds no room (made so here), a fixed strategy that fits is the
    start the search takes up; without one the refusal stands."""
    import embarkc.planner.search.runs as search_runs

    def never_fits(search, decisions, deadline=None):  # type: ignore[no-untyped-def]
        raise search_runs.EmbarkError.at("regular.embark", "no placement fits (made up)")

    monkeypatch.setattr(search_runs, "place_splitting", never_fits)
    program = _program()
    plan = plan_program(program, solver="greedy", time_limit=30)
    extra = plan.planner.model_extra or {}
    assert extra["fixed_start"] == "column-wise"
    assert validate_plan(program, plan) == []
    cm = CostModel(program)
    forbidden = search_runs.FixedStart(bl.baseline_times(cm), lambda name: None)
    with pytest.raises(EmbarkError, match="no placement fits \\(made up\\)"):
        search_runs.greedy(cm, fixed=forbidden)


def test_a_layout_outside_a_units_constraints_is_not_taken_up() -> None:
    """`_from_fixed` holds the layout to each unit's kinds, grid bounds and node, besides
    the checker that `fixed.fixed_start` runs first."""
    from embarkc.planner.budget import WorkMeter
    from embarkc.planner.clusters import units_of
    from embarkc.planner.search.runs import _from_fixed

    program = _program("plan { table big0 { column_shards ..2 } table small0 { cluster dp } }")
    cm = CostModel(program)
    units = units_of(cm)
    column_wise = bl.build_layout(cm, "column-wise")
    assert _from_fixed(cm, units, None, "flat", column_wise, 10, WorkMeter(cm.W)) is None
    free = _program()
    cm_free = CostModel(free)
    meter = WorkMeter(cm_free.W)
    taken = _from_fixed(cm_free, units_of(cm_free), None, "flat", column_wise, 10, meter)
    assert taken is not None
    assert taken[0] <= cm_free.step_time(column_wise) * (1 + 1e-9)


def test_check_and_report_say_where_the_search_started() -> None:
    from types import SimpleNamespace

    from embarkc.planner import fixed_strategy_note

    def info(**extra: str) -> SimpleNamespace:
        return SimpleNamespace(model_extra=extra)

    assert fixed_strategy_note(info()) == ""
    assert fixed_strategy_note(info(fixed_start="column-wise")) == (
        "searched on from the fixed strategy column-wise (faster than the search's starts reached)"
    )
    assert fixed_strategy_note(info(fixed_strategy="table-wise")).startswith(
        "the plan is the fixed strategy table-wise"
    )


def _one_node(comm: str):  # type: ignore[no-untyped-def]
    text = REGULAR.format(plan=f"plan {{ communication {comm} }}")
    return load_program_text(text.replace("nodes 2", "nodes 1"), "one_node.embark")


def test_on_one_node_a_fixed_strategy_is_offered_in_the_specs_communication() -> None:
    """Fixed strategies lay rb out flat; a spec that names `communication hierarchical`
    forbids flat clusters. On one node the two cost the same, so the strategy's layout is
    offered in the spec's word, at its own step time."""
    from embarkc.planner.fixed import fixed_start

    program = _one_node("hierarchical")
    cm = CostModel(program)
    times = bl.baseline_times(cm)
    layout = fixed_start(program, cm, times).layout_of("column-wise")
    assert layout is not None
    assert {p.communication for p in layout.values()} == {"hierarchical"}
    assert cm.step_time(layout) == pytest.approx(times["column-wise"], rel=1e-12)
    on_two = _program("plan { communication hierarchical }")
    cm2 = CostModel(on_two)
    assert fixed_start(on_two, cm2, bl.baseline_times(cm2)).layout_of("column-wise") is None
