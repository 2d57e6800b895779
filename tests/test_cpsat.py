"""CP-SAT refinement: re-decides grids as well as placements, is deterministic for a seed
and never returns a plan slower than greedy's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from embark_runtime.plan import dumps_plan
from embarkc.ir import Access, DenseModel, Feature, Optimizer, Program, Source, Table, Topology
from embarkc.planner import plan_program
from embarkc.planner.budget import WorkMeter
from embarkc.planner.cost import CostModel
from embarkc.planner.cpsat import WHOLE_RANKS, decision_of, refine
from embarkc.planner.search.place import Decision
from embarkc.planner.search.runs import greedy
from embarkc.workload import program_from_workload
from tests.conftest import ROOT, SHARED, keys_in_full


def _crafted() -> Program:
    """One hot wide table and two small ones on 4 GPUs: one cell per table (greedy's
    starting grids) leaves the hot table's rank far above the others."""
    topo = Topology(
        nodes=1,
        gpus_per_node=4,
        hbm_bytes=1 << 30,
        hbm_bandwidth=1e12,
        intra_node_bandwidth=1e11,
        inter_node_bandwidth=1e10,
    )
    shapes = [(200_000, 64, 40), (20_000, 32, 4), (20_000, 32, 4)]
    zipf = Access(kind="zipf", alpha=1.1, permuted=True)
    return Program(
        name="crafted",
        sources=(Source(path="<crafted>", sha256="0"),),
        topology=topo,
        tables=tuple(
            Table(name=f"t{i}", rows=r, dim=d, optimizer=Optimizer(kind="sgd"))
            for i, (r, d, _) in enumerate(shapes)
        ),
        features=tuple(
            Feature(name=f"f{i}", table=f"t{i}", hotness=h, max_hotness=h, access=zipf)
            for i, (_, _, h) in enumerate(shapes)
        ),
        model=DenseModel(batch_size=4096, dense_features=0),
    )


def test_refinement_changes_a_suboptimal_grid_and_is_strictly_faster(monkeypatch):
    import embarkc.planner.search.finish as search_finish

    monkeypatch.setattr(search_finish, "PHASE_PASSES", 0)  # it may re-grid too
    cm = CostModel(_crafted())
    start = greedy(cm, max_iterations=0)  # greedy's initial grids, before any split
    assert all(p.kind == "rb" and p.cells == 1 for p in start.layout.values())
    r = refine(cm, start, time_limit=1.0, seed=0)
    assert cm.step_time(r.layout) < start.step_time * 0.95
    assert r.status in ("optimal", "feasible")
    changed = [n for n in r.layout if decision_of(r.layout[n]) != decision_of(start.layout[n])]
    assert changed  # not only a re-placement: some table's kind or grid changed
    assert r.bound is not None and r.objective is not None and r.bound <= r.objective


def test_same_seed_gives_the_same_layout():
    a = refine(CostModel(_crafted()), greedy(CostModel(_crafted()), max_iterations=0), 1.0, 7)
    b = refine(CostModel(_crafted()), greedy(CostModel(_crafted()), max_iterations=0), 1.0, 7)
    assert a.layout == b.layout and a.status == b.status and a.objective == b.objective


def test_lns_is_deterministic_and_never_worse_than_greedy():
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=4)
    cm = CostModel(prog)
    g = greedy(cm)
    assert cm.W > WHOLE_RANKS  # this case takes the neighbourhood path
    r1 = refine(cm, g, time_limit=0.6, seed=3)
    r2 = refine(CostModel(prog), greedy(CostModel(prog)), time_limit=0.6, seed=3)
    assert r1.layout == r2.layout and r1.status == r2.status
    assert cm.step_time(r1.layout) <= g.step_time * (1 + 1e-12)
    assert r1.status in ("feasible", "greedy")


def test_the_greedys_work_is_counted_the_same_every_time_and_shortens_the_refinement():
    """The greedy's work is a deterministic count (the same on any machine, so the same
    limit gives the same plan); the refinement gets what the limit leaves after it, and
    the plan says which limit would refine when it leaves nothing."""
    from dataclasses import replace

    from embarkc.planner.budget import REFINE_SHARE, refine_budget
    from embarkc.planner.pipeline import no_refine_message

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=1)
    a, b = greedy(CostModel(prog)), greedy(CostModel(prog))
    assert a.work == b.work > a.phase_work > 0 and not a.stopped
    assert refine_budget(30.0, a.work, a.phase_work) == 30.0 * REFINE_SHARE
    short = refine_budget(3.0, a.work, a.phase_work)
    assert 0 < short < 3.0 - a.work - a.phase_work
    budget = refine_budget(a.work, a.work, a.phase_work)
    assert budget < 0
    need = math.ceil(a.work - budget + 1.0)
    assert no_refine_message(a, a.work, budget).endswith(
        f"time limit for CP-SAT; a limit of {need} s or more refines the plan"
    )
    assert refine_budget(need, a.work, a.phase_work) >= 1.0  # that limit does
    cut = no_refine_message(replace(a, stopped=True), a.work, budget)
    assert "cut short by the limit" in cut and cut.endswith("a longer limit gives both more")


def test_a_greedy_budget_cuts_the_later_starts_and_passes_and_is_deterministic():
    """With a budget (from a time limit) the greedy places its first start whole, stops
    its later starts at RUNS_SHARE of the budget and its descents, rebalance and phase
    passes at the budget, by the deterministic work count: the same layout every time,
    here no faster than the search without a budget (DCNv2 on 32 GPUs, a third of its
    work), and well below the whole search's work. With no budget at all the plan is the
    first start's placement, not descended."""
    from embarkc.planner.search.tuning import RUNS_SHARE

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=4)
    full = greedy(CostModel(prog))
    budget = full.work / 3
    a, b = greedy(CostModel(prog), budget=budget), greedy(CostModel(prog), budget=budget)
    assert a.stopped and not full.stopped
    assert a.layout == b.layout and a.work == b.work
    assert full.work * 0.2 < a.work < full.work * 0.5
    assert a.step_time >= full.step_time * (1 - 1e-12)
    cm = CostModel(prog)
    meter = WorkMeter(cm.W)
    one = greedy(cm, budget=0.0, meter=meter)  # the first start's placement alone
    assert meter.deadline == math.inf  # the budget does not outlive the call
    assert one.stopped and one.work < 0.05 * full.work
    assert one.step_time > a.step_time * 1.05
    assert RUNS_SHARE * budget < a.work
    # a budget within the first start's descent: its work stops near it
    first = greedy(CostModel(prog), budget=0.5)
    assert first.stopped and 0.5 <= first.work < 0.5 + 0.05 * full.work
    assert one.step_time > first.step_time > a.step_time


def test_the_later_starts_descend_only_within_the_runs_share(monkeypatch):
    """T180 on 16 x 8 GPUs with the budget of a 2 s limit: a later start begun just under
    RUNS_SHARE of the budget used to descend to its end, and the rebalance and phase
    passes then ran past it (0.83 of 0.80 s of work before the rebalance; 0.51 now).
    Its descent now stops at RUNS_SHARE, which leaves the rest to those passes; the first
    start is not cut, and the plan says neither."""
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner.search.tuning import RUNS_SHARE

    prog = program_from_workload(SHARED / "workloads" / "t180.json", nodes=16)
    seen: list[float] = []
    rebalanced = search_runs.rebalanced

    def spy(cm, units, progress, best, meter):  # type: ignore[no-untyped-def]
        seen.append(meter.seconds())
        return rebalanced(cm, units, progress, best, meter)

    monkeypatch.setattr(search_runs, "rebalanced", spy)
    budget = 0.8
    g = greedy(CostModel(prog), budget=budget)
    assert g.stopped and not g.first_cut
    # (a descent checks between its moves: it ends a little past)
    assert len(seen) == 1 and seen[0] <= RUNS_SHARE * budget + 0.05, seen
    assert g.work <= budget + 0.05, g.work


def test_a_search_whose_last_start_was_cut_at_the_runs_share_says_it_was_cut(monkeypatch):
    """T180 on 4 x 8 GPUs with 1.9 s of greedy work: all nine starts begin, and the last
    one's descent stops where no further start may begin (RUNS_SHARE). The search was cut
    by the limit, and says so; it used to say it was not (the 5,000 generated tables at
    the default 30 s: "a limit of 36 s or more refines the plan", as if a longer limit
    left the greedy as it was)."""
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner.pipeline import no_refine_message

    prog = program_from_workload(SHARED / "workloads" / "t180.json", nodes=4)
    cut: list[bool] = []
    descend = search_runs.descend

    def spy(search, limit):  # type: ignore[no-untyped-def]
        found = descend(search, limit)
        cut.append(search.meter.spent())
        return found

    monkeypatch.setattr(search_runs, "descend", spy)
    g = greedy(CostModel(prog), budget=1.9)
    assert len(cut) == 9 and cut[-1] and not any(cut[:-1]), cut
    assert g.work < 1.9 and not g.first_cut
    assert g.stopped
    assert "its search cut short by the limit" in no_refine_message(g, 2.0, 0.0)


def test_a_large_programs_search_starts_from_the_column_wise_grids_too(monkeypatch):
    """Programs of more than MULTI_START_UNITS units search one start besides the column
    ladder, and their descents balance many ranks no better than the column-wise
    strategy's cells of 16 columns placed heaviest first (5,000 generated tables on 1,024
    GPUs: 6.228 ms against its 5.712). A start on its grids keeps the plan at least as
    fast: 1,050 generated tables on 256 GPUs within 2 s of work 4.978 ms without it,
    4.734 with it, the column-wise strategy's own 4.734."""
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner import baselines as bl
    from embarkc.planner.search.tuning import MULTI_START_UNITS
    from embarkc.workload import generated_program

    prog = generated_program(1050, 32, 8)
    assert len(prog.tables) > MULTI_START_UNITS
    column_wise = CostModel(prog).step_time(bl.build_layout(CostModel(prog), "column-wise"))
    with_start = greedy(CostModel(prog), budget=2.0).step_time
    # (the greedy's placement of those cells is not the strategy's to the last bit)
    assert with_start <= column_wise * (1 + 1e-6)
    monkeypatch.setattr(search_runs, "fine_column_start", lambda cm, units, start: dict(start))
    without = greedy(CostModel(prog), budget=2.0).step_time
    assert without > column_wise * 1.02, (without, column_wise)


def test_a_mid_sized_program_on_many_ranks_starts_from_the_column_wise_grids_early(
    monkeypatch,
):
    """Programs of 300 to 1,000 units on more than 256 ranks also start from the
    column-wise grids, right after their first start: 350 generated tables on 1,024 GPUs
    within 3 s of work 1.446 ms without the start, 1.240 with it."""
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner.search.tuning import FINE_START_RANKS, FOUR_START_UNITS, MULTI_START_UNITS
    from embarkc.workload import generated_program

    prog = generated_program(350, 128, 8)
    assert FOUR_START_UNITS < len(prog.tables) <= MULTI_START_UNITS
    assert prog.topology.world_size > FINE_START_RANKS[1]
    with_start = greedy(CostModel(prog), budget=3.0).step_time
    monkeypatch.setattr(search_runs, "fine_column_start", lambda cm, units, start: dict(start))
    without = greedy(CostModel(prog), budget=3.0).step_time
    assert with_start < without * 0.9, (with_start, without)


def test_the_second_looks_at_the_starts_come_last(monkeypatch):
    """Small programs descend every start twice, the second time with the rough reference
    (cells placed by owner load alone); a limit that cuts the search must reach the other
    starts (the lower bound's, the column starts) first, so the second looks run last."""
    import embarkc.planner.search.runs as search_runs

    order: list[bool] = []
    descend = search_runs.descend

    def recording(search, limit):
        order.append(search.exact_ref)
        return descend(search, limit)

    monkeypatch.setattr(search_runs, "descend", recording)
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=1)
    greedy(CostModel(prog))
    firsts = order.count(True)
    assert firsts > 4 and order.count(False) >= 2  # column and bound starts, second looks
    assert order == [True] * firsts + [False] * (len(order) - firsts)


def test_a_short_limit_holds_for_t510_and_leaves_out_the_baselines_that_do_not_fit():
    """T510 on 16 x 8 GPUs at a 2 s limit: the baselines would take 1.4 s of it (2.8 ms a
    table), more than BASELINE_SHARE of what the rest of the command leaves, so they are
    neither reserved nor recorded; the greedy's descent stops where the limit ends (its
    first start's placement is all it must finish), and the plan says so. From 4 s on
    they fit and are reserved."""
    import re

    from embarkc.planner import (
        baseline_seconds,
        baselines_fit,
        baselines_limit,
        command_reserve,
        greedy_budget,
    )
    from embarkc.planner.cost import head_weight, signature_count, table_facts

    prog = program_from_workload(SHARED / "workloads" / "t510.json", nodes=16)
    facts = table_facts(prog)
    n, sigs, heads = len(prog.tables), signature_count(facts), head_weight(facts)
    assert not baselines_fit(2.0, n, sigs, heads) and not baselines_fit(3.0, n, sigs, heads)
    assert baselines_limit(n, sigs, heads) == 4 and baselines_fit(4.0, n, sigs, heads)
    reserved = command_reserve(4.0, n, sigs, heads) - command_reserve(2.0, n, sigs, heads)
    assert reserved == pytest.approx(baseline_seconds(n, heads))
    plan = plan_program(prog, solver="cp-sat", time_limit=2.0)
    assert plan.planner.status == "greedy"
    assert "baselines" not in (plan.planner.model_extra or {})
    said = re.search(
        r"the greedy's work \(about ([0-9.]+) s, its search cut short", plan.planner.message
    )
    assert said, plan.planner.message
    budget = greedy_budget(2.0, command_reserve(2.0, n, sigs, heads))
    assert float(said.group(1)) <= budget + 0.15
    assert plan_program(prog, solver="cp-sat", time_limit=2.0, baselines=False) == plan


def test_the_rest_of_the_command_counts_each_distinct_table_signature(monkeypatch):
    """Reading a spec, the access statistics, every unit's starting kinds and the lower
    bound cost per distinct table (`TableFacts.signature`), and none of it is the search's
    counted work: 5,000 generated tables (5,000 signatures) took 24-30 s at the default
    30 s limit, and 24 s at 20 s, while the rest counted 5.5 s. The greedy's budget now
    leaves REST_SECONDS_PER_SIGNATURE a signature besides the rest per table; T180's 177
    tables share 14 signatures and keep nearly all of theirs."""
    import embarkc.planner.pipeline as pipeline_mod
    from embarkc.planner.budget import (
        BASELINE_SECONDS_PER_HEAD,
        REST_SECONDS_PER_SIGNATURE,
        command_reserve,
        greedy_budget,
    )
    from embarkc.planner.cost import head_weight, signature_count, table_facts
    from embarkc.workload import generated_program

    budgets: list[float | None] = []
    real = pipeline_mod.greedy

    def spy(cm, **kwargs):  # type: ignore[no-untyped-def]
        budgets.append(kwargs["budget"])
        return real(cm, **kwargs)

    monkeypatch.setattr(pipeline_mod, "greedy", spy)
    many = generated_program(60, 2, 8)
    t180 = program_from_workload(SHARED / "workloads" / "t180.json", nodes=2)
    assert signature_count(table_facts(many)) == 60
    assert signature_count(table_facts(t180)) == 14
    for prog in (many, t180):
        facts = table_facts(prog)
        n, sigs, heads = len(prog.tables), signature_count(facts), head_weight(facts)
        budgets.clear()
        plan_program(prog, solver="greedy", time_limit=30.0)
        assert budgets == [greedy_budget(30.0, command_reserve(30.0, n, sigs, heads))]
        kept = command_reserve(30.0, n, sigs, heads) - command_reserve(30.0, n, 0, heads)
        assert kept == pytest.approx(REST_SECONDS_PER_SIGNATURE * sigs)
        # the fixed strategies' time (reserved at 30 s) grows with the signatures' heads
        more = command_reserve(30.0, n, sigs, heads) - command_reserve(30.0, n, sigs)
        assert more == pytest.approx(BASELINE_SECONDS_PER_HEAD * heads) and heads > 5


def test_the_baselines_time_is_reserved_whether_or_not_the_caller_records_them():
    """DCNv2 on 16 x 8 GPUs at 2 s: its 26 tables' baselines fit, so their time is kept
    from the search either way, and the plan is the same with or without them."""
    from embarkc.planner import baseline_seconds, command_reserve
    from embarkc.planner.cost import head_weight, table_facts

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=16)
    heads = head_weight(table_facts(prog))
    assert command_reserve(2.0, 26, 26, heads) > baseline_seconds(26, heads)
    a = plan_program(prog, solver="cp-sat", time_limit=2.0)
    b = plan_program(prog, solver="cp-sat", time_limit=2.0, baselines=False)
    assert set((a.planner.model_extra or {})["baselines"]) >= {"table-wise", "column-wise"}
    assert "baselines" not in (b.planner.model_extra or {})
    assert a.shards == b.shards and a.clusters == b.clusters


def test_a_search_cut_in_its_first_start_says_so_and_goes_on_from_a_faster_fixed_strategy(
    monkeypatch,
):
    """DCNv2 on 16 x 8 GPUs. At 0.7 s the limit cuts the greedy in its first start
    (1.166 ms), slower than column-wise (1.102 ms), whose time was reserved: the greedy
    takes column-wise's layout up as a start (`greedy.FixedStart`; the limit leaves it no
    descent), and the plan says both. (With the baselines' time counted per table alone,
    as before their heads were: the heads' 0.08 s no longer leaves them room at 0.7 s.)"""
    import embarkc.planner.budget as budget_mod
    from embarkc.planner.check import validate_plan

    monkeypatch.setattr(budget_mod, "BASELINE_SECONDS_PER_HEAD", 0.0)
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=16)
    plan = plan_program(prog, solver="cp-sat", time_limit=0.7)
    extra = plan.planner.model_extra or {}
    assert extra["fixed_start"] == "column-wise" and "fixed_strategy" not in extra
    assert plan.estimate.step_time <= extra["baselines"]["column-wise"] * (1 + 1e-9)
    assert extra["greedy_step_time"] == pytest.approx(plan.estimate.step_time, rel=1e-9)
    assert "cut the search in its first start" in plan.planner.message
    assert "went on from the column-wise strategy's layout" in plan.planner.message
    assert validate_plan(prog, plan) == []


def test_a_search_cut_in_its_first_start_keeps_a_faster_fixed_strategy_it_cannot_take_up(
    tmp_path, capsys, monkeypatch
):
    """As above, with the greedy unable to take column-wise's layout up (`_from_fixed`
    made to say so): the plan is column-wise itself, says so, passes the checker, and is
    the same whether or not the caller records the baselines. At 0.5 s the baselines do
    not fit and the cut plan stays."""
    import embarkc.planner.budget as budget_mod
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner.check import validate_plan

    monkeypatch.setattr(budget_mod, "BASELINE_SECONDS_PER_HEAD", 0.0)
    monkeypatch.setattr(search_runs, "_from_fixed", lambda *a: None)

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=16)
    plan = plan_program(prog, solver="cp-sat", time_limit=0.7)
    extra = plan.planner.model_extra or {}
    assert extra["fixed_strategy"] == "column-wise"
    assert plan.estimate.step_time == pytest.approx(extra["baselines"]["column-wise"], rel=1e-9)
    assert extra["greedy_step_time"] > plan.estimate.step_time
    assert "cut the search in its first start" in plan.planner.message
    assert "the fixed strategy column-wise is faster" in plan.planner.message
    assert validate_plan(prog, plan) == []
    # `embarkc check` of the file says which strategy the plan is
    from embarkc.cli import main
    from tests.conftest import ROOT

    path = tmp_path / "plan.json"
    spec = ROOT / "specs" / "paper" / "dcnv2.embark"
    assert main(["plan", str(spec), "--time-limit", "0.7", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    said = "the plan is the fixed strategy column-wise (faster than what the search found)"
    assert said in capsys.readouterr().out
    # and so does `embarkc report`'s planner line
    from embarkc.report import report_data

    facts = dict(report_data(plan).facts)
    assert f"; {said}" in facts["planner"]
    quiet = plan_program(prog, solver="cp-sat", time_limit=0.7, baselines=False)
    assert quiet.shards == plan.shards and quiet.clusters == plan.clusters
    short = plan_program(prog, solver="cp-sat", time_limit=0.5)
    assert "fixed_strategy" not in (short.planner.model_extra or {})
    assert "cut the search in its first start" in short.planner.message
    assert "the plan is barely searched; a longer limit searches it" in short.planner.message
    # with the whole limit the search beats every fixed strategy by itself
    full = plan_program(prog, solver="cp-sat", time_limit=2.0)
    assert "fixed_strategy" not in (full.planner.model_extra or {})
    assert "first start" not in full.planner.message


def test_the_fixed_strategy_kept_for_a_cut_search_respects_the_specs_constraints(
    tmp_path, monkeypatch
):
    """With every table `no_column_split`, column-wise breaks the spec and is not taken;
    table-row-wise, the next, is slower than the cut search's plan, which stays (the
    baselines' time per table alone, as in the test above)."""
    import embarkc.planner.budget as budget_mod
    from embarkc.frontend import load_program

    monkeypatch.setattr(budget_mod, "BASELINE_SECONDS_PER_HEAD", 0.0)
    from embarkc.planner.check import validate_plan
    from tests.conftest import ROOT

    spec = tmp_path / "pinned.embark"
    spec.write_text(
        f'include "{ROOT / "specs" / "paper" / "dcnv2.embark"}"\n'
        "plan {\n  table t[0..25] { no_column_split }\n}\n"
    )
    prog = load_program(spec)
    plan = plan_program(prog, solver="cp-sat", time_limit=0.7)
    extra = plan.planner.model_extra or {}
    assert "fixed_strategy" not in extra
    assert extra["baselines"]["column-wise"] < plan.estimate.step_time
    assert plan.estimate.step_time < extra["baselines"]["table-row-wise"]
    assert validate_plan(prog, plan) == []


def test_plan_records_solver_fields_and_is_byte_identical_for_a_seed():
    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=1)
    a = plan_program(prog, solver="cp-sat", time_limit=3.0, baselines=False)
    b = plan_program(prog, solver="cp-sat", time_limit=3.0, baselines=False)
    assert dumps_plan(a) == dumps_plan(b)
    extra = a.planner.model_extra or {}
    assert a.planner.status in ("optimal", "feasible", "greedy")
    assert a.planner.wall_time > 0  # the limit left CP-SAT work to do (its deterministic s)
    assert extra["greedy_step_time"] >= a.estimate.step_time
    assert "message" in extra and a.planner.wall_time >= 0


def test_the_greedy_polish_leaves_the_norms_local_minimum(monkeypatch):
    """T510 on 16 x 8 GPUs with the keys charged in full and flat ub: the descent on the
    16-norm stops at 6.500 ms; the polish by the step time itself jumps the critical rank's
    heaviest tables to wider grids (5.865 ms). (The planner's own choice here is
    hierarchical ub, whose first start has less work, 4.728 ms a rank against 5.343, but
    whose search ends at 6.075 ms, polished or not.)"""
    import embarkc.planner.search.descent as search_descent
    import embarkc.planner.search.finish as search_finish
    import embarkc.planner.search.runs as search_runs
    import embarkc.planner.search.starts as search_starts

    monkeypatch.setattr(search_finish, "PHASE_PASSES", 0)  # the figures are the search's
    program = program_from_workload(SHARED / "workloads" / "t510.json", 16)
    cm = CostModel(keys_in_full(program))
    assert search_starts.choose_ub_comm(cm, search_runs.units_of(cm)) == "hierarchical"
    assert round(greedy(cm).step_time * 1e3, 3) == 6.075
    monkeypatch.setattr(search_starts, "choose_ub_comm", lambda cm, units, known=None: "flat")
    polished = greedy(cm).step_time
    monkeypatch.setattr(search_descent, "POLISH_ROUNDS", 0)  # _descend polishes this many rounds
    unpolished = greedy(cm).step_time
    assert round(unpolished * 1e3, 3) == 6.500
    assert polished < unpolished * 0.95, (polished, unpolished)
    assert round(polished * 1e3, 3) == 5.865


def _steps(cm: CostModel, n: int, seed: int = 0):
    """The first `n` neighbourhoods of a refinement, alternating plain and plateau ones,
    each solved and re-costed by the full model (accepted when the 16-norm falls)."""
    from embarkc.planner import cpsat

    ref = cpsat._Refiner(cm, greedy(cm))
    rng = np.random.default_rng(seed)
    for s in range(n):
        ranks, free, partial = ref.neighbourhood(rng, False, plateau=s % 2 == 1)
        status, chosen, obj, bound, _ = ref.step(ranks, free, partial, 0.25, seed + s)
        if not chosen:
            continue
        st = ref.trial(free + partial, chosen)
        times = st.times()
        yield ref, ranks, chosen, obj, st
        if cpsat._norm(times) < cpsat._norm(ref.times):
            ref.accept(free + partial, chosen, st, times)


@pytest.mark.parametrize("window", ["preset", "none", "partial"])
def test_the_neighbourhood_model_is_the_full_cost_model(window: str, monkeypatch):
    """What a neighbourhood's model says its free ranks' makespan is, the full cost model
    says too, grid changes included: a moved cell changes the far side of the links of the
    ranks it talks to (keys they send it, results they receive from it), and the model
    has those as variables. On one node every rank is free, so nothing is left outside.
    The same holds of the critical path, each phase at its slowest rank: the model's
    phase maxima. (Their sum may rise 0.5 % above the greedy plan's here: with keys in
    full, the first neighbourhoods hold no grid change within the plan's own.)
    The key phase counts beyond the dense compute window: the preset's window hides every
    key; with none, keys count in full; a window of half the median rank's key phase hides
    some ranks' keys whole and others' in part."""
    from embarkc.planner import cpsat

    monkeypatch.setattr(cpsat, "CRIT_SLACK", 0.005)
    cm = CostModel(program_from_workload(SHARED / "workloads" / "t510.json", nodes=1))
    if window != "preset":
        cm.key_window = 0.0
    if window == "partial":
        keys = cm.layout_state(greedy(cm).layout).components()["distributor"]
        cm.key_window = 0.5 * float(np.median(keys))
        assert cm.key_window > 0
    seen = changed = 0
    for ref, ranks, chosen, obj, st in _steps(cm, 4):
        assert obj == pytest.approx(float(st.times()[ranks].max()), rel=1e-6)
        assert ref.last_critical_path == pytest.approx(st.critical_path(), rel=1e-6)
        seen += 1
        changed += sum(o.d != ref.decision[u] for u, (o, _) in chosen.items())
    assert seen == 4 and changed > 0


def test_the_neighbourhood_model_has_hierarchical_ub_links_exactly(monkeypatch):
    """Hierarchical ub cells talk along rails, not nodes (`RankState.links`): every rank
    off the owner's rail sends its keys and receives the vectors over NVLink, the owner's
    rail peers on the other nodes aggregate them over the network, and the owner and each
    aggregator serve their own node over NVLink. On T200 at 4 x 8 GPUs (100 such tables)
    the model gives every free rank the full cost model's time, with hierarchical ub cells
    moved across nodes and rails and their grids changed. (The model once spread their
    network side over every rank of a node and their NVLink side over the owner's node:
    its free ranks were up to 0.7 % off in these neighbourhoods.) The solver searches
    without its LP relaxation here: it then ranges further from the hint within the limit,
    moving many hierarchical ub cells at once."""
    from ortools.sat.python import cp_model

    solve = cp_model.CpSolver.solve

    def without_lp(self, model, *args, **kwargs):
        self.parameters.linearization_level = 0
        return solve(self, model, *args, **kwargs)

    monkeypatch.setattr(cp_model.CpSolver, "solve", without_lp)
    cm = CostModel(program_from_workload(SHARED / "workloads" / "t200.json", nodes=4))
    seen = moved = 0
    for ref, ranks, chosen, obj, st in _steps(cm, 4):
        times = st.times()
        for a in ranks:
            assert ref.last_rank_times[a] == pytest.approx(float(times[a]), rel=1e-6)
        assert obj == pytest.approx(float(times[ranks].max()), rel=1e-6)
        seen += 1
        for u, (o, where) in chosen.items():
            if o.d.kind == "ub" and o.d.comm == "hierarchical":
                moved += o.d != ref.decision[u] or list(where) != list(ref.ranks[u])
    assert seen >= 3 and moved >= 5


def test_what_an_option_adds_to_every_rank_is_the_same_on_every_rank():
    """`U_o`, what an option adds besides owner HBM work and links, is one number for
    every rank, so the part `_shared_parts` measures must change alike on all ranks. A
    hierarchical ub cell's aggregators do HBM work on their rail only; the model has it
    per rail (`R`), and it was once also in the shared part (U_o took its maximum: free
    ranks up to 1.1 us off the full model on T200 at 4 x 8 GPUs)."""
    from embarkc.planner import cpsat

    cm = CostModel(program_from_workload(SHARED / "workloads" / "t200.json", nodes=4))
    ref = cpsat._Refiner(cm, greedy(cm))
    name = next(n for n, d in ref.decision.items() if d.kind == "ub" and d.comm == "hierarchical")
    work = cpsat._clone(ref.state)
    cpsat._apply(work, ref.option(ref.by_name[name], ref.decision[name]), ref.ranks[name], -1.0)
    per_rank: list[np.ndarray] = []
    lookups: list[np.ndarray] = []
    for option in (None, Decision("ub", 2, 1, "hierarchical")):
        if option is not None:
            o = ref.option(ref.by_name[name], option)
            cpsat._apply(work, o, np.array([3, 20]), 1.0)
        shared, phases = cpsat._shared_parts(work)
        per_rank.append(shared)
        lookups.append(phases[0])
        assert cpsat._shared_seconds(work)[0] == float(shared.max())
    for before, after in (per_rank, lookups):
        change = after - before
        assert change.min() > 0
        assert change.max() - change.min() < 1e-12


@pytest.mark.parametrize(("name", "nodes", "limit"), [("t180", 16, 6.0), ("dcnv2", 4, 2.0)])
def test_the_refinement_never_lengthens_the_critical_path(name, nodes, limit, monkeypatch):
    """CP-SAT lowers the step time without a longer critical path than the greedy plan's
    (every phase at its slowest rank) and without more key time on any rank than the
    greedy plan's busiest. Without the first cap it trades: on T180 at 16 x 8 GPUs a step
    0.001 ms shorter for a critical path 0.54 ms longer (4.581 -> 5.1 ms); on DCNv2 at
    4 x 8 it traded nothing faster for 1.246 -> 1.265 ms from the greedy plan before the
    lower bound's start (`greedy.bound_start`), and finds no such trade from today's. Without
    the second, T180's keys pile up on some ranks (the window hides them): 3.359 -> 3.990
    ms on the busiest, for a step of 4.1752 ms against 4.1774 with the cap."""
    from embarkc.planner import cpsat

    cm = CostModel(program_from_workload(SHARED / "workloads" / f"{name}.json", nodes))
    g = greedy(cm)
    g_state = cm.layout_state(g.layout)
    g_crit, g_keys = g_state.critical_path(), float(g_state.key_seconds().max())
    r = refine(cm, g, time_limit=limit, seed=0)
    st = cm.layout_state(r.layout)
    assert st.step_time() <= g.step_time
    assert st.critical_path() <= g_crit * (1 + 1e-9)
    assert float(st.key_seconds().max()) <= g_keys * (1 + 1e-9)
    if name == "t180":
        assert r.status == "feasible" and st.step_time() < g.step_time
        monkeypatch.setattr(cpsat, "KEY_CAP", False)
        piled = cm.layout_state(refine(cm, g, time_limit=limit, seed=0).layout)
        assert float(piled.key_seconds().max()) > g_keys * 1.1
        monkeypatch.setattr(cpsat, "KEY_CAP", True)
        monkeypatch.setattr(cpsat, "CRIT_SLACK", float("inf"))
        free = cm.layout_state(refine(cm, g, time_limit=limit, seed=0).layout)
        assert free.critical_path() > g_crit * 1.01


def test_plateau_neighbourhoods_free_the_ranks_that_share_the_maximum(monkeypatch):
    """T180 on 16 x 8 GPUs, keys charged in full, the greedy plan before its rebalance:
    three ranks lie within 0.2 % of its step time, on three nodes. A plateau
    neighbourhood frees all three; a plain one frees the critical rank and the ranks of
    its units, not the other two, so it cannot lower the step time."""
    import embarkc.planner.search.finish as search_finish
    from embarkc.planner import cpsat

    monkeypatch.setattr(search_finish, "REBALANCE_EVALS", 0)
    monkeypatch.setattr(search_finish, "REBALANCE_FIRST_EVALS", 0)
    monkeypatch.setattr(search_finish, "PHASE_PASSES", 0)

    program = program_from_workload(SHARED / "workloads" / "t180.json", nodes=16)
    cm = CostModel(keys_in_full(program))
    ref = cpsat._Refiner(cm, greedy(cm))
    t = ref.times
    top = set(np.flatnonzero(t >= t.max() * (1 - cpsat.PLATEAU)).tolist())
    assert len(top) == 3
    plain, _, _ = ref.neighbourhood(np.random.default_rng(0), False, plateau=False)
    plateau, _, _ = ref.neighbourhood(np.random.default_rng(0), False, plateau=True)
    assert not top <= set(plain)
    assert top <= set(plateau)


def test_plateau_neighbourhoods_free_the_slowest_rank_of_each_phase(monkeypatch):
    """T180 on 16 x 8 GPUs: the slowest ranks of its phases (lookups and results; the keys
    and the dp exchange are even) are not the critical rank, and the cap on the critical
    path binds there. A plateau neighbourhood frees them (`PHASE_RANKS`); without that,
    or in a plain neighbourhood, the lookups' slowest rank stays outside."""
    from embarkc.planner import cpsat
    from embarkc.planner.cost import phase_times

    cm = CostModel(program_from_workload(SHARED / "workloads" / "t180.json", nodes=16))
    ref = cpsat._Refiner(cm, greedy(cm))
    slow = {
        int(np.argmax(p))
        for p in phase_times(ref.state.components())
        if p.max() > p.min() * (1 + 1e-9)
    }
    assert len(slow) == 2 and int(np.argmax(ref.times)) not in slow
    plateau, _, _ = ref.neighbourhood(np.random.default_rng(0), False, plateau=True)
    plain, _, _ = ref.neighbourhood(np.random.default_rng(0), False, plateau=False)
    assert slow <= set(plateau)
    assert not slow & set(plain)
    monkeypatch.setattr(cpsat, "PHASE_RANKS", False)
    without, _, _ = ref.neighbourhood(np.random.default_rng(0), False, plateau=True)
    assert not slow <= set(without)


def test_grown_neighbourhoods_free_more_ranks_and_units():
    """When small neighbourhoods are proven to hold nothing faster, the search doubles
    them: twice the ranks (up to 2 x (MAX_RANKS + LNS_RANKS)) and more units (up to twice
    as many re-decided; how many have all their cells inside depends on the plan)."""
    from embarkc.planner import cpsat

    cm = CostModel(program_from_workload(SHARED / "workloads" / "t180.json", nodes=16))
    ref = cpsat._Refiner(cm, greedy(cm))
    small = ref.neighbourhood(np.random.default_rng(0), False)
    large = ref.neighbourhood(np.random.default_rng(0), False, scale=2)
    most = cpsat.MAX_RANKS + cpsat.LNS_RANKS
    assert len(small[0]) <= most and len(small[0]) < len(large[0]) <= 2 * most
    # more units join, re-decided (all their cells inside) or movable (some inside)
    assert len(large[1]) >= len(small[1])
    assert len(large[1]) + len(large[2]) > len(small[1]) + len(small[2])


def test_a_grid_option_of_one_row_shard_keeps_the_specs_hierarchical_rb():
    """Found by hypothesis: under `communication hierarchical` a neighbourhood's options
    gave an rb unit of one row shard flat communication, and the refined plan broke the
    spec's rule (the checker's `communication`). One row shard has no partials to reduce,
    so flat is its default under `auto` only."""
    from embarkc.frontend import load_program_text
    from embarkc.planner.clusters import units_of
    from embarkc.planner.cpsat import grid_options
    from tests.conftest import small_hardware

    def spec(mode: str) -> Program:
        return load_program_text(
            small_hardware(2, "1 MiB")
            + "table t0 { rows 1 dim 4 optimizer sgd { lr 0.01 } hotness 1 access uniform }\n"
            "table t1 { rows 1 dim 8 optimizer sgd { lr 0.01 } hotness 1 access uniform }\n"
            "model { batch 128 dense_features 1 bottom_mlp [] interaction dot top_mlp [1] }\n"
            f"plan {{ communication {mode} table t0 {{ cluster ub }} table t1 {{ cluster rb }} }}\n",
            "h.embark",
        )

    for mode, want in (("hierarchical", "hierarchical"), ("flat", "flat"), ("auto", "flat")):
        cm = CostModel(spec(mode))
        unit = next(u for u in units_of(cm) if u.tables == ("t1",))
        options = grid_options(cm, unit, Decision("rb", 1, 2, want), max_cells=8)
        assert {o.comm for o in options if o.kind == "rb" and o.r == 1} == {want}, mode
    # the whole command: the refined plan passes the checker (plan_program asserts it)
    plan = plan_program(spec("hierarchical"), solver="cp-sat", time_limit=1.5, baselines=False)
    assert {c.communication for c in plan.clusters if c.kind == "rb"} == {"hierarchical"}


def _scripted_refine(monkeypatch, cm: CostModel, g: Any, statuses: list[str]) -> Any:
    """`refine` of `g` whose solves return `statuses` in turn, none with a better plan,
    each at a tenth of its deterministic limit."""
    from embarkc.planner import cpsat

    left = iter(statuses)

    def step(self, ranks_f, free_units, partial_units, time_limit, seed):
        return next(left), {}, 0.0, 0.0, time_limit / 10

    monkeypatch.setattr(cpsat._Refiner, "step", step)
    return refine(cm, g, time_limit=1000.0, seed=0)


def test_the_search_stops_after_its_neighbourhoods_end_at_their_limit_in_a_row(monkeypatch):
    """LNS_AT_LIMIT neighbourhoods in a row that end at their limit without a better plan
    stop the search; a neighbourhood proven to hold nothing faster ends the run (it counts
    towards growing them instead), and so does one that is proven infeasible."""
    from embarkc.planner import cpsat

    cm = CostModel(program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=4))
    g = greedy(cm)  # DCNv2 at 4 x 8 GPUs: a neighbourhood search
    k = cpsat.LNS_AT_LIMIT
    r = _scripted_refine(
        monkeypatch, cm, g, ["feasible"] * (k - 1) + ["unknown"] + ["feasible"] * 99
    )
    assert (r.neighbourhoods, r.stopped, r.status) == (k, "at-limit", "greedy")
    assert f"{k} neighbourhoods, 0 improved the step time; stopped: {k} neighbourhoods" in r.message
    runs = ["feasible"] * (k - 1) + ["optimal"] + ["feasible"] * (k - 1) + ["infeasible"]
    r = _scripted_refine(monkeypatch, cm, g, runs + ["feasible"] * 99)
    assert (r.neighbourhoods, r.stopped) == (len(runs) + k, "at-limit")
    # proven neighbourhoods alone stop at LNS_STALL (after growing)
    r = _scripted_refine(monkeypatch, cm, g, ["optimal"] * 99)
    assert (r.neighbourhoods, r.stopped) == (cpsat.LNS_STALL, "stall")


def test_a_whole_program_solve_at_its_limit_is_solved_again_with_twice_the_limit(monkeypatch):
    """The whole-program model is one model, not a neighbourhood: a solve that ends at its
    limit without a better plan is repeated with twice the limit until the time limit is
    spent, whatever LNS_AT_LIMIT says."""
    from embarkc.planner import cpsat

    limits: list[float] = []

    def step(self, ranks_f, free_units, partial_units, time_limit, seed):
        limits.append(time_limit)
        return "feasible", {}, 0.0, 0.0, time_limit

    monkeypatch.setattr(cpsat._Refiner, "step", step)
    cm = CostModel(_crafted())
    r = refine(cm, greedy(cm, max_iterations=0), time_limit=300.0, seed=0)
    assert cm.W <= WHOLE_RANKS and r.stopped == "limit"
    assert r.neighbourhoods == len(limits) > cpsat.LNS_AT_LIMIT
    assert limits[1] == 2 * limits[0] and limits[2] == 2 * limits[1]


def test_a_search_that_finds_nothing_stops_when_it_stalls_not_at_its_limit(monkeypatch):
    """DCNv2 at 4 x 8 GPUs: CP-SAT finds nothing faster than the greedy plan, every
    neighbourhood ending at its limit. The search stops after LNS_AT_LIMIT of them, with
    the plan it keeps either way; with the old rule alone (LNS_STALL) it ran to its limit."""
    from embarkc.planner import cpsat

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=4)
    cm = CostModel(prog)
    g = greedy(cm)
    k = cpsat.LNS_AT_LIMIT
    r = refine(cm, g, time_limit=14.0, seed=0)
    assert (r.neighbourhoods, r.stopped, r.status) == (k, "at-limit", "greedy")
    assert r.layout == g.layout
    monkeypatch.setattr(cpsat, "LNS_AT_LIMIT", 1 << 30)
    old = refine(CostModel(prog), greedy(CostModel(prog)), time_limit=14.0, seed=0)
    assert old.stopped == "limit" and old.neighbourhoods > k
    assert old.layout == g.layout and r.deterministic_time < old.deterministic_time


def test_a_search_that_improves_goes_on_and_the_plan_says_why_it_stopped():
    """DCNv2 at 16 x 8 GPUs, the paper spec's own options: CP-SAT improves the greedy plan
    after 13 neighbourhoods without a better one (4 at their limit, never more than 1 in a
    row), when its proven ones have grown the neighbourhoods; it runs to its limit. The plan
    records how many it ran and why it stopped, and its message says so."""
    from embarkc.frontend import load_program

    plan = plan_program(load_program(ROOT / "specs" / "paper" / "dcnv2.embark"))
    extra = plan.planner.model_extra or {}
    assert plan.planner.status == "feasible"
    assert plan.estimate.step_time < extra["greedy_step_time"] * (1 - 1e-3)
    assert extra["stopped"] == "limit" and extra["neighbourhoods"] == 24
    assert "24 neighbourhoods, 6 improved the step time; stopped: its share" in extra["message"]
