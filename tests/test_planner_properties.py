"""Planner invariants on random small programs (hypothesis), plus the infeasible message."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embark_runtime.plan import dumps_plan, parse_plan, validate_rules
from embarkc.diagnostics import EmbarkError
from embarkc.ir import (
    Access,
    Colocate,
    DenseModel,
    Feature,
    Optimizer,
    PlanOptions,
    Program,
    Source,
    Table,
    TableConstraint,
    Topology,
)
from embarkc.planner import plan_program
from embarkc.planner.baselines import FIXED
from embarkc.planner.cost import CostModel, layout_of_plan
from tests.conftest import SHARED, small_hardware


@st.composite
def programs(draw):
    nodes = draw(st.integers(1, 2))
    gpus = draw(st.integers(1, 4))
    n = draw(st.integers(1, 5))
    tables, feats, cons = [], [], []
    for i in range(n):
        rows = draw(st.integers(1, 5000))
        dim = draw(st.sampled_from([4, 8, 12, 16, 32, 10]))
        opt = draw(st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam"]))
        tables.append(Table(name=f"t{i}", rows=rows, dim=dim, optimizer=Optimizer(kind=opt)))
        h = draw(st.integers(1, 8))
        acc = draw(
            st.sampled_from(
                [
                    Access(kind="uniform"),
                    Access(kind="zipf", alpha=1.1, permuted=True),
                    Access(kind="zipf", alpha=1.2, permuted=False),
                ]
            )
        )
        feats.append(Feature(name=f"f{i}", table=f"t{i}", hotness=h, max_hotness=h, access=acc))
        if draw(st.booleans()):
            cons.append(
                TableConstraint(
                    table=f"t{i}",
                    cluster=draw(st.sampled_from([None, "rb", "ub"])),
                    max_column_shards=draw(st.sampled_from([None, 1])),
                    within_node=draw(st.booleans()),
                )
            )
    colocate = ()
    if n >= 2 and draw(st.booleans()):
        colocate = (Colocate(tables=("t0", "t1")),)
    topo = Topology(
        nodes=nodes,
        gpus_per_node=gpus,
        hbm_bytes=draw(st.sampled_from([1 << 20, 1 << 30])),
        hbm_bandwidth=1e12,
        intra_node_bandwidth=1e11,
        inter_node_bandwidth=1e10,
        # no window, one that hides every key, and ones that hide some (the key phase
        # of these small programs is 0.1-10 us; the dense part a few thousand FLOPs)
        dense_flops=draw(st.sampled_from([0.0, 1e9, 1e13, 1e15])),
    )
    return Program(
        name="p",
        sources=(Source(path="<p>", sha256="0"),),
        topology=topo,
        tables=tuple(tables),
        features=tuple(feats),
        model=DenseModel(batch_size=64 * nodes * gpus, dense_features=1),
        options=PlanOptions(
            time_limit=1.5,
            row_partition=draw(st.sampled_from(["mod", "range"])),
            communication=draw(st.sampled_from(["auto", "auto", "flat", "hierarchical"])),
        ),
        constraints=tuple(cons),
        colocate=colocate,
    )


def _check_invariants(program: Program, plan) -> None:
    validate_rules(plan)
    cm = CostModel(program)
    for t in program.tables:
        cl = plan.cluster_of(t.name)
        c = program.constraint_of.get(t.name)
        cells = plan.shards_of(t.name)
        if c is not None and c.cluster is not None:
            assert cl.kind == c.cluster
        if cl.kind == "dp":
            assert not (c and c.within_node and program.topology.nodes > 1)
            continue
        r = cells[0].row_shards
        for j in range(r):  # every row shard's columns tile [0, dim) exactly once
            cols = sorted(s.columns for s in cells if s.row_shard == j)
            assert cols[0][0] == 0 and cols[-1][1] == t.dim
            assert all(a[1] == b[0] for a, b in zip(cols, cols[1:], strict=False))
        widths = {s.columns[1] - s.columns[0] for s in cells}
        if len(widths) > 1 or len({s.columns for s in cells}) > r:
            assert all(s.columns[0] % 4 == 0 for s in cells)
        if t.optimizer.kind == "rowwise_adagrad" or (c and c.max_column_shards == 1):
            assert all(s.columns == (0, t.dim) for s in cells)
        if c is not None and c.within_node:
            assert len({s.rank // program.topology.gpus_per_node for s in cells}) == 1
    for col in program.colocate:
        sets = [
            {s.rank for s in plan.shards_of(n)} if plan.cluster_of(n).kind != "dp" else None
            for n in col.tables
        ]
        assert all(s == sets[0] for s in sets)
    mem = cm.layout_state(layout_of_plan(plan)).memory()
    assert mem.max() <= cm.capacity + 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_every_plan_is_valid_deterministic_and_fits(program):
    try:
        plan = plan_program(program, solver="greedy")
    except EmbarkError as e:
        msg = str(e)
        assert any(
            w in msg for w in ("hold only", "placement", "pinned to dp", "contradict", "colocated")
        ), msg
        return
    _check_invariants(program, plan)
    # no plan beats the lower bound (within the distinct-id statistics' accuracy)
    low = (plan.planner.model_extra or {})["lower_bound"]
    assert 0 < low <= plan.estimate.step_time * (1 + 1e-5)
    # waiting for every rank in every phase can only lengthen the step
    path = (plan.estimate.model_extra or {})["critical_path"]
    assert path >= plan.estimate.step_time * (1 - 1e-9)
    text = dumps_plan(plan)
    assert dumps_plan(plan_program(program, solver="greedy")) == text
    assert dumps_plan(parse_plan(text)) == text  # the loader accepts it unchanged
    from embarkc.planner.check import validate_plan

    assert validate_plan(program, plan) == []


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_cpsat_never_worse_than_greedy(program):
    try:
        g = plan_program(program, solver="greedy", baselines=False)
    except EmbarkError:
        return
    c = plan_program(program, solver="cp-sat", time_limit=1.5, baselines=False)
    assert c.estimate.step_time <= g.estimate.step_time * (1 + 1e-9)
    # nor with phases that wait longer for their slowest rank
    crit = (c.estimate.model_extra or {})["critical_path"]
    assert crit <= (g.estimate.model_extra or {})["critical_path"] * (1 + 1e-9)
    assert (c.planner.model_extra or {})["lower_bound"] <= c.estimate.step_time * (1 + 1e-5)
    assert c.planner.status in ("optimal", "feasible", "greedy")
    _check_invariants(program, c)
    from embarkc.planner.check import validate_plan

    assert validate_plan(program, c) == []
    assert dumps_plan(
        plan_program(program, solver="cp-sat", time_limit=1.5, baselines=False)
    ) == dumps_plan(c)


def test_infeasible_spec_says_what_would_fit():
    from embarkc.workload import program_from_workload

    prog = program_from_workload(SHARED / "workloads" / "t200.json", nodes=1, gpus_per_node=2)
    # without host memory (the preset's would take the tables beyond HBM: the host tier)
    topo = prog.topology.model_copy(update={"host_memory": None})
    prog = prog.model_copy(update={"topology": topo})
    with pytest.raises(EmbarkError) as e:
        plan_program(prog, solver="greedy")
    msg = str(e.value)
    assert "GiB" in msg and "GPUs" in msg and "fp16" in msg and "nodes of 2 GPUs" in msg


def test_baselines_are_valid_plans():
    from embarkc.workload import program_from_workload

    prog = program_from_workload(SHARED / "workloads" / "dcnv2.json", nodes=2)
    g = plan_program(prog, solver="greedy")
    for name in FIXED:
        try:
            plan = plan_program(prog, strategy=name)
        except EmbarkError:
            assert name == "data-parallel"
            continue
        validate_rules(plan)
        assert plan.estimate.step_time >= g.estimate.step_time * 0.999 or name == "column-wise"


def _fixed_strategies_fit_or_say_so(cm: CostModel) -> None:
    """Every fixed strategy's layout fits in memory, buffers included, or the strategy
    says it does not fit."""
    from embarkc.planner.baselines import build_layout

    for name in FIXED:
        try:
            layout = build_layout(cm, name)
        except EmbarkError as err:
            assert "does not fit" in str(err), str(err)
            continue
        assert cm.layout_state(layout).memory().max() <= cm.capacity + 1, name


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_fixed_strategies_fit_their_buffers_or_say_they_do_not(program):
    _fixed_strategies_fit_or_say_so(CostModel(program))


def test_every_ranks_buffers_count_against_its_memory():
    """The requesters' buffers of every sharded table sit on every rank: the greedy and
    the fixed strategies leave room for them (a plan of 1.0 MiB of weights, state and
    buffers on a 1.0 MiB GPU was accepted when they did not), and say what does not fit."""
    from embarkc.ir import Access, Optimizer, Table, TableConstraint

    uni = Access(kind="uniform")
    zipf = Access(kind="zipf", alpha=1.2, permuted=False)
    shapes = [
        (2699, 8, "sgd", 8, zipf),
        (1881, 32, "adam", 3, uni),
        (1581, 8, "adam", 8, zipf),
        (1, 4, "sgd", 1, uni),
    ]
    hbm = 1 << 20

    def program(hbm_bytes: int) -> Program:
        return Program(
            name="p",
            sources=(Source(path="<p>", sha256="0"),),
            topology=Topology(
                nodes=1,
                gpus_per_node=1,
                hbm_bytes=hbm_bytes,
                hbm_bandwidth=1e12,
                intra_node_bandwidth=1e11,
                inter_node_bandwidth=1e10,
            ),
            tables=tuple(
                Table(name=f"t{i}", rows=r, dim=d, optimizer=Optimizer(kind=o))
                for i, (r, d, o, _, _) in enumerate(shapes)
            ),
            features=tuple(
                Feature(name=f"f{i}", table=f"t{i}", hotness=h, max_hotness=h, access=a)
                for i, (_, _, _, h, a) in enumerate(shapes)
            ),
            model=DenseModel(batch_size=64, dense_features=1),
            constraints=(TableConstraint(table="t0", cluster="ub"),),
            colocate=(Colocate(tables=("t0", "t1")),),
        )

    tight = program(hbm)
    cm = CostModel(tight)
    with pytest.raises(EmbarkError) as e:
        plan_program(tight, solver="greedy", baselines=False)
    assert "no placement fits in 1 GPU of 1.0 MiB" in str(e.value)
    assert "buffers every GPU holds" in str(e.value)
    _fixed_strategies_fit_or_say_so(cm)
    roomy = program(2 * hbm)
    plan = plan_program(roomy, solver="greedy", baselines=False)
    _check_invariants(roomy, plan)


def test_a_refusal_counts_the_replicated_tables_on_every_gpu() -> None:
    """t0 pinned to dp takes 128.1 KiB (weights and buffers) on each of the 2 GPUs of
    300 KiB; t1 (175 KiB) may not be split, so it finds no GPU with room. The message names
    the dp copies and does not call t0 the largest table group."""
    from embarkc.frontend import load_program_text

    program = load_program_text(
        small_hardware(2, "300 KiB")
        + "table t0 { rows 1000 dim 32 optimizer sgd { lr 0.05 } hotness 1 }\n"
        "table t1 { rows 1400 dim 32 optimizer sgd { lr 0.1 } hotness 2 }\n"
        "model { batch 16 dense_features 0 bottom_mlp [] interaction dot top_mlp [1] }\n"
        "plan { table t0 { cluster dp } table t1 { row_shards 1 column_shards 1 } }\n",
        "dp.embark",
    )
    with pytest.raises(EmbarkError) as e:
        plan_program(program, solver="greedy", baselines=False)
    msg = str(e.value)
    assert "the largest sharded table group (t1) needs 175.0 KiB" in msg
    assert "the replicated (dp) tables (t0) take 128.1 KiB on every GPU" in msg
    assert "sharding a dp table (cluster rb or ub)" in msg
    # how full the GPUs are whatever the plan: t0's replica and buffers on both, t1 and
    # its buffers spread
    assert "need at least 2" in msg and "KiB a GPU on average (" in msg
