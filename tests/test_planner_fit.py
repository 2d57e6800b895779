"""What the search makes fit: a spec that some plan fits is planned, not refused."""

from __future__ import annotations

from embarkc.frontend import load_program_text
from embarkc.planner import plan_program
from embarkc.planner.budget import WorkMeter
from embarkc.planner.check import validate_plan

# one GPU of 4 MiB; a table read 100,000 times per sample: sharded (rb or ub), its owner
# holds every id of the batch as keys (8 x 100,000 x 8 bytes = 6.1 MiB), more than the GPU;
# replicated (dp), it holds its 1.6 KiB and no communication buffers
HOT = """
hardware { nodes 1 gpus_per_node 1 hbm 4 MiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
           network 10 Gb/s arch sm_80 }
model { batch 8 }
table a { rows 100 dim 4 hotness 100000 }
"""


def test_a_table_whose_buffers_fill_the_gpu_is_replicated_where_no_row_split_helps() -> None:
    program = load_program_text(HOT, "hot.embark")
    for solver in ("greedy", "cp-sat"):
        plan = plan_program(program, solver=solver, time_limit=2)
        assert [(c.kind, c.tables) for c in plan.clusters] == [("dp", ["a"])]
        assert not plan.shards
        assert validate_plan(program, plan) == []


# six hot tables pinned to hierarchical ub on two nodes of two GPUs: each cell's
# aggregators (its owner's rail peer on the other node) hold the node's ids and vectors
HIERARCHICAL_UB = """
hardware {{ nodes 2 gpus_per_node 2 hbm {hbm} B hbm_bandwidth 1 TB/s nvlink 300 GB/s
           network 10 Gb/s dense_flops 1 GFLOP/s }}
model {{ batch 4096 }}
tables t[0..5] {{ rows 100000 dim 128 hotness 20 access zipf(1.05) }}
plan {{ communication hierarchical
  table t0 {{ cluster ub }} table t1 {{ cluster ub }} table t2 {{ cluster ub }}
  table t3 {{ cluster ub }} table t4 {{ cluster ub }} table t5 {{ cluster ub }} }}
"""


def test_no_plan_overruns_a_gpu_with_the_aggregators_buffers() -> None:
    """The search's room checks leave out the hierarchical ub aggregators' buffers; the
    full model checks every plan it keeps. At 120 MB the plan it kept used 137.3 MB."""
    import pytest

    from embarkc.diagnostics import EmbarkError
    from embarkc.planner.cost import CostModel
    from embarkc.planner.search.runs import greedy

    roomy = load_program_text(HIERARCHICAL_UB.format(hbm=140_000_000), "ub.embark")
    cm = CostModel(roomy)
    g = greedy(cm)
    assert cm.layout_state(g.layout).memory().max() <= cm.capacity
    tight = load_program_text(HIERARCHICAL_UB.format(hbm=120_000_000), "ub.embark")
    with pytest.raises(EmbarkError, match="hierarchical ub aggregators overrun") as e:
        greedy(CostModel(tight))
    assert "communication flat" in str(e.value)


def test_tables_that_fill_98_percent_of_the_cluster_are_planned_when_a_split_fits() -> None:
    """Four 40 MB tables on eight GPUs of 20.4 MB: each cut in two row shards, a cell of 20
    MB per GPU. The planner had refused any spec above 97 % of the cluster, saying
    "need 0.1 GiB ... hold only 0.2 GiB"."""
    spec = """
hardware { nodes 2 gpus_per_node 4 hbm 20_400_000 B hbm_bandwidth 1 TB/s nvlink 450 GB/s
           network 400 Gb/s }
model { batch 64 }
tables t[0..3] { rows 312_500 dim 32 optimizer sgd hotness 1 access uniform }
"""
    program = load_program_text(spec, "full.embark")
    plan = plan_program(program, solver="greedy", time_limit=2)
    assert validate_plan(program, plan) == []
    assert max(plan.memory_by_rank()) <= 20_400_000


def test_a_colocate_group_the_planner_cannot_form_is_reported_at_its_line() -> None:
    import pytest

    from embarkc.diagnostics import EmbarkError

    spec = """hardware { preset dgx_h100 nodes 1 }
model { batch 64 }
tables t[0..2] { rows 1000 dim 16 hotness 1 }
plan {
  colocate t0, t1
  table t0 { cluster rb }
  table t1 { cluster ub }
}
"""
    with pytest.raises(EmbarkError) as e:
        load_program_text(spec, "colo.embark")
    (d,) = e.value.diagnostics
    assert "`colocate` joins `t0` (pinned `rb`) with `t1` (pinned `ub`)" in d.message
    assert (d.span.file, d.span.line, d.span.col) == ("colo.embark", 5, 3)
    # a program built without the lowering (an API user's) meets the planner's own check
    program = load_program_text(spec.replace("cluster ub", "cluster rb"), "colo.embark")
    ub = program.constraint_of["t1"].model_copy(update={"cluster": "ub"})
    rest = tuple(c for c in program.constraints if c.table != "t1")
    fields = {k: getattr(program, k) for k in type(program).model_fields}
    program = type(program)(**{**fields, "constraints": (*rest, ub)})  # no cached lookups
    with pytest.raises(EmbarkError) as e:
        plan_program(program, solver="greedy", time_limit=1)
    (d,) = e.value.diagnostics
    assert "colocated but pinned to different clusters" in d.message
    assert (d.span.file, d.span.line, d.span.col) == ("colo.embark", 5, 3)


# six 35 MB tables on 2 x 2 GPUs of 100 MiB with every rb unit hierarchical (on one node
# each): the all-rb start cannot fit them; the ub starts can
SPLITS = """
hardware { nodes 2 gpus_per_node 2 hbm 100 MiB hbm_bandwidth 1 TB/s nvlink 100 GB/s
           network 10 Gb/s }
model { batch 4096 }
tables t[0..5] { rows 140000 dim 64 hotness 1 access zipf(1.1) }
plan { communication hierarchical }
"""


def test_a_start_that_cannot_fit_stops_splitting_once_its_cells_are_fine(monkeypatch) -> None:
    """A unit that finds no room has its rows split while that makes its cells pack
    better (greedy.FINE_CELL_SHARE): here at most 32 cells a unit are tried (32 row shards
    of 2.1 MiB, below 1/32 of the GPU's 100 MiB); before the rule, the all-rb start doubled them to 256
    cells without fitting (and on 4 x 8 GPUs to 12,288, 33 s at a 3 s limit). The plan
    found is the same."""
    import embarkc.planner.search.cells as search_cells
    import embarkc.planner.search.descent as search_descent

    tried: list[int] = []
    place_all = search_cells.Search.place_all

    def counting(self, decisions):  # type: ignore[no-untyped-def]
        tried.append(max(d.r * d.c for d in decisions.values()))
        return place_all(self, decisions)

    monkeypatch.setattr(search_cells.Search, "place_all", counting)
    program = load_program_text(SPLITS, "splits.embark")
    plan = plan_program(program, solver="greedy", time_limit=2, baselines=False)
    assert max(tried) == 32
    assert validate_plan(program, plan) == []
    monkeypatch.setattr(search_descent, "_split_helps", lambda search, u, d: True)
    tried.clear()
    old = plan_program(program, solver="greedy", time_limit=2, baselines=False)
    assert max(tried) == 256
    assert old.estimate.step_time == plan.estimate.step_time


def test_a_cluster_beyond_what_the_planner_plans_is_refused_at_its_hardware() -> None:
    """The language allows 2^26 GPUs; the planner plans up to MAX_PLANNED_GPUS (131,072)
    and says so, rather than running out of memory building per-rank arrays."""
    import pytest

    from embarkc.diagnostics import EmbarkError
    from embarkc.planner.budget import MAX_PLANNED_GPUS

    spec = (
        "hardware { preset dgx_h100 nodes 65536 gpus_per_node 4 }\n"
        "table a { rows 1000 dim 16 hotness 1 }\nmodel { batch 262144 }\n"
    )
    program = load_program_text(spec, "big.embark")
    assert program.topology.world_size == 2 * MAX_PLANNED_GPUS
    with pytest.raises(EmbarkError) as e:
        plan_program(program, solver="greedy", time_limit=1)
    (d,) = e.value.diagnostics
    assert d.message == "the cluster has 262,144 GPUs; the planner plans at most 131,072"
    assert (d.span.file, d.span.line) == ("big.embark", 1)


def test_a_spec_whose_plan_breaks_a_bound_of_plan_files_is_refused_by_the_planner() -> None:
    """1 B/s everywhere makes a step of years: the plan file's bound on times
    (embark_runtime.plan.MAX_SECONDS) would make every command refuse the plan, so the
    planner refuses the spec instead, saying which bound."""
    import pytest

    from embarkc.diagnostics import EmbarkError

    spec = (
        "hardware { preset dgx_h100 hbm_bandwidth 1 B/s nvlink 1 B/s network 1 B/s }\n"
        "tables t[0..3] { rows 1000 dim 64 hotness 10 }\nmodel { batch 65536 }\n"
    )
    with pytest.raises(EmbarkError) as e:
        plan_program(load_program_text(spec, "slow.embark"), solver="greedy", time_limit=1)
    (d,) = e.value.diagnostics
    assert d.message.startswith("the plan of this spec breaks a bound of plan files (field")
    assert "step_time" in d.message and d.hint and "bandwidths" in d.hint


NEAR_FULL = """hardware { preset dgx_h100 nodes 2 hbm 1538378445 B }
model { batch 16384 }
table t0 { rows 30753 dim 32 hotness 41 optimizer sgd pooling sum access zipf(1.28) }
table t1 { rows 2966 dim 32 hotness 2 optimizer adam pooling mean access zipf(1.2) }
table t2 { rows 7589864 dim 256 hotness 3 optimizer adam pooling sum access zipf(1.2) }
table t3 { rows 69679 dim 128 hotness 8 optimizer adagrad pooling mean access zipf(1.29) }
table t4 { rows 7549135 dim 16 hotness 2 optimizer sgd pooling sum access zipf(1.09) }
"""
"""Seed 104 of bench/plan_time_fuzz.py: 5 tables at 97 % of 16 GPUs' memory, refused."""


def test_a_limit_that_ends_before_any_start_fits_says_so_and_what_is_left() -> None:
    """Starts that find no room are not search work; trying them is held to the greedy's
    budget all the same (`WorkMeter.placing_seconds`): 200 tables at 97 % took 6.5 s to be
    refused at a 3 s limit. A short limit refuses after the starts its budget allows and
    says that a longer one tries the rest; a long one tries every start."""
    import re

    import pytest

    from embarkc.diagnostics import EmbarkError

    program = load_program_text(NEAR_FULL, "near_full.embark")
    with pytest.raises(EmbarkError) as e:
        plan_program(program, time_limit=0.7, baselines=False)
    d = e.value.diagnostics[0]
    m = re.match(r"the time limit ended the search after (\d+) of its (\d+) starts", d.message)
    assert m, d.message
    tried, starts = int(m[1]), int(m[2])
    assert 1 <= tried < starts
    assert "none of them fits; the last one: no placement fits in 16 GPUs" in d.message
    assert d.hint is not None
    assert d.hint.startswith(f"a longer --time-limit tries the {starts - tried} other starts; ")
    # a long limit tries every start and none fits in HBM: the preset's host memory then
    # takes tables, where without it the refusal says no placement fits (the next test)
    plan = plan_program(program, time_limit=30.0, baselines=False)
    assert any(s.on_host for s in plan.shards)
    assert "host tier" in (plan.planner.model_extra or {})["message"]
    hardware = (
        "hardware { nodes 2 gpus_per_node 8 hbm 1538378445 B hbm_bandwidth 3.35 TB/s "
        "nvlink 450 GB/s network 400 Gb/s }"
    )
    no_host = NEAR_FULL.replace("hardware { preset dgx_h100 nodes 2 hbm 1538378445 B }", hardware)
    with pytest.raises(EmbarkError) as e:
        plan_program(load_program_text(no_host, "no_host.embark"), time_limit=30.0, baselines=False)
    assert e.value.diagnostics[0].message.startswith("no placement fits in 16 GPUs")


def test_a_start_that_fits_after_one_that_did_not_is_kept_whatever_the_placing(
    monkeypatch,
) -> None:
    """The cut of `test_a_limit_that_ends_before_any_start_fits...` holds only while no
    start has fit: here the first start finds no room, the second fits, and then the
    placing count passes the budget; the search goes on and returns a plan."""
    from pathlib import Path

    import embarkc.planner.search.runs as search_runs

    calls = {"n": 0}
    place = search_runs.place_splitting

    def first_fails(search, decisions, deadline=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise search_runs.EmbarkError.at("x.embark", "no placement fits (made up)")
        return place(search, decisions, deadline)

    monkeypatch.setattr(search_runs, "place_splitting", first_fails)
    monkeypatch.setattr(WorkMeter, "placing_seconds", lambda meter: 1e9 if calls["n"] >= 2 else 0.0)
    tiny = Path(__file__).resolve().parent.parent / "specs" / "tiny.embark"
    program = load_program_text(tiny.read_text(), str(tiny))
    plan = plan_program(program, solver="greedy", time_limit=30.0, baselines=False)
    assert calls["n"] > 2 and plan.estimate.step_time > 0


def test_a_start_stops_splitting_at_the_budget_while_none_has_fit(monkeypatch) -> None:
    """A start can take seconds to fail on its own (it places every cell again for each
    split): while none has fit, it gives up at the greedy's budget too. With the placing
    counted as past any budget, the first start gives up at its first miss, and the
    refusal says 1 start was tried; a cut last start says a longer limit lets it split
    further."""
    import pytest

    import embarkc.planner.search.cells as search_cells
    import embarkc.planner.search.runs as search_runs
    from embarkc.diagnostics import EmbarkError

    program = load_program_text(NEAR_FULL, "near_full.embark")
    monkeypatch.setattr(WorkMeter, "placing_seconds", lambda meter: 1e9)
    placings = {"n": 0}
    place_all = search_cells.Search.place_all

    def counted(self, decisions):  # type: ignore[no-untyped-def]
        placings["n"] += 1
        return place_all(self, decisions)

    monkeypatch.setattr(search_cells.Search, "place_all", counted)
    with pytest.raises(EmbarkError) as e:
        plan_program(program, time_limit=30.0, baselines=False)
    assert e.value.diagnostics[0].message.startswith("the time limit ended the search after 1 of")
    assert placings["n"] == 1  # the first start's first try, and no split after it
    last = search_runs._cut_refusal(EmbarkError.at("x.embark", "no placement fits"), 4, 4)
    d = last.diagnostics[0]
    assert d.message.startswith("the time limit ended the search after 4 of its 4 starts")
    assert d.hint == "a longer --time-limit lets the last start split its tables further"
