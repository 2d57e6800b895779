"""embarkc.planner.check: a valid hand-built plan passes; each rule, broken once, is named."""

from __future__ import annotations

from typing import Any

import pytest

from embark_runtime.plan import Plan
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
from embarkc.planner.check import check_plan, validate_plan

GIB = 1 << 30


def program(nodes: int = 1, gpus: int = 4, **extra: Any) -> Program:
    tables = (
        Table(name="a", rows=100, dim=8, optimizer=Optimizer(kind="adagrad")),
        Table(name="b", rows=60, dim=6, optimizer=Optimizer(kind="rowwise_adagrad")),
        Table(name="c", rows=20, dim=4),
    )
    features = (
        Feature(name="fa", table="a", hotness=2, max_hotness=2),
        Feature(
            name="fb",
            table="b",
            hotness=1.5,
            max_hotness=3,
            fixed=False,
            access=Access(kind="zipf", alpha=1.2, permuted=False),
        ),
        Feature(name="fc", table="c", hotness=1, max_hotness=1),
    )
    return Program(
        name="tiny",
        sources=(Source(path="tiny.embark", sha256="0" * 64),),
        topology=Topology(
            nodes=nodes,
            gpus_per_node=gpus,
            hbm_bytes=GIB,
            hbm_bandwidth=2e12,
            intra_node_bandwidth=3e11,
            inter_node_bandwidth=2.5e10,
        ),
        tables=tables,
        features=features,
        model=DenseModel(batch_size=16, dense_features=4),
        **extra,
    )


def plan_for(
    prog: Program,
    shards: list[dict[str, Any]] | None = None,
    clusters: list[dict[str, Any]] | None = None,
    **changes: Any,
) -> Plan:
    """A valid plan of `prog` by default: a split 2x2 (rb), b whole (ub), c dp."""
    topo = prog.topology
    data: dict[str, Any] = dict(
        source=dict(spec="tiny.embark", sha256="0" * 64),
        topology=dict(
            nodes=topo.nodes,
            gpus_per_node=topo.gpus_per_node,
            hbm_bytes=topo.hbm_bytes,
            hbm_bandwidth=topo.hbm_bandwidth,
            intra_node_bandwidth=topo.intra_node_bandwidth,
            inter_node_bandwidth=topo.inter_node_bandwidth,
        ),
        batch_size=prog.batch_size,
        tables=[
            dict(name=t.name, rows=t.rows, dim=t.dim, dtype=t.dtype, optimizer=t.optimizer.kind)
            for t in prog.tables
        ],
        features=[
            dict(
                name=f.name,
                table=f.table,
                hotness=f.hotness,
                pooling=f.pooling,
                max_hotness=f.max_hotness,
                fixed=f.fixed,
                access=f.access.model_dump(exclude={"span", "path", "keys", "counts"}),
            )
            for f in prog.features
        ],
        row_partition=prog.options.row_partition,
        clusters=clusters
        or [
            dict(name="rb0", kind="rb", communication="flat", tables=["a"]),
            dict(name="ub0", kind="ub", tables=["b"]),
            dict(name="dp0", kind="dp", tables=["c"]),
        ],
        shards=shards
        if shards is not None
        else [
            dict(table="a", row_shard=0, row_shards=2, columns=(0, 4), rank=0),
            dict(table="a", row_shard=0, row_shards=2, columns=(4, 8), rank=1),
            dict(table="a", row_shard=1, row_shards=2, columns=(0, 4), rank=2),
            dict(table="a", row_shard=1, row_shards=2, columns=(4, 8), rank=3),
            dict(table="b", row_shard=0, row_shards=1, columns=(0, 6), rank=1),
        ],
        estimate=dict(step_time=0.0, per_rank=[]),
        planner=dict(strategy="hand", solver="none", status="greedy"),
    )
    data.update(changes)
    return Plan.model_validate(data)


B_WHOLE = dict(table="b", row_shard=0, row_shards=1, columns=(0, 6), rank=1)


def a_cells(*cells: tuple[int, int, tuple[int, int], int]) -> list[dict[str, Any]]:
    return [
        dict(table="a", row_shard=j, row_shards=r, columns=c, rank=k) for j, r, c, k in cells
    ] + [B_WHOLE]


def rules(prog: Program, plan: Plan) -> list[str]:
    return [v.rule for v in validate_plan(prog, plan)]


def test_a_valid_hand_built_plan_passes() -> None:
    prog = program()
    assert validate_plan(prog, plan_for(prog)) == []
    check_plan(prog, plan_for(prog), "p.json")


def test_contract_rules_are_reported_by_number() -> None:
    prog = program()
    no_cluster = [
        dict(name="rb0", kind="rb", communication="flat", tables=["a"]),
        dict(name="ub0", kind="ub", tables=["b"]),
    ]
    assert rules(prog, plan_for(prog, clusters=no_cluster)) == ["rule 1"]
    no_comm = [
        dict(name="rb0", kind="rb", tables=["a"]),
        dict(name="ub0", kind="ub", tables=["b"]),
        dict(name="dp0", kind="dp", tables=["c"]),
    ]
    v = validate_plan(prog, plan_for(prog, clusters=no_comm))
    assert [x.rule for x in v] == ["rule 1"] and "communication" in v[0].message
    gap = a_cells((0, 1, (0, 4), 0))
    assert rules(prog, plan_for(prog, shards=gap)) == ["rule 2"]
    far = a_cells((0, 1, (0, 8), 9))
    assert rules(prog, plan_for(prog, shards=far)) == ["rule 3"]
    huge = program().topology.model_copy(update={"hbm_bytes": 100})
    assert rules(
        prog,
        plan_for(
            prog,
            topology=huge.model_dump(
                exclude={"span", "arch", "preset"},
            ),
        ),
    ) == ["rule 4"]


def test_a_plan_of_another_program_is_named() -> None:
    prog = program()
    plan = plan_for(prog)
    other_rows = prog.model_copy(
        update={"tables": (prog.tables[0].model_copy(update={"rows": 101}), *prog.tables[1:])}
    )
    v = validate_plan(other_rows, plan)
    assert [x.rule for x in v] == ["matches-program"] and "rows" in v[0].message
    other_batch = prog.model_copy(update={"model": DenseModel(batch_size=32, dense_features=4)})
    assert rules(other_batch, plan) == ["matches-program"]
    other_access = prog.model_copy(
        update={
            "features": (
                prog.features[0],
                prog.features[1].model_copy(update={"access": Access(kind="uniform")}),
                prog.features[2],
            )
        }
    )
    assert rules(other_access, plan) == ["matches-program"]
    bigger = prog.model_copy(update={"topology": prog.topology.model_copy(update={"nodes": 2})})
    assert rules(bigger, plan) == ["matches-program"]


def test_memory_counts_the_headroom() -> None:
    prog = program(options=PlanOptions(memory_headroom=GIB - 1000))
    v = validate_plan(prog, plan_for(prog))
    assert {x.rule for x in v} == {"memory"}
    assert "memory_headroom" in v[0].message
    roomy = program(options=PlanOptions(memory_headroom=GIB - 10_000))
    assert rules(roomy, plan_for(roomy)) == []


def test_column_cuts_lie_at_multiples_of_four() -> None:
    prog = program()
    odd = a_cells((0, 1, (0, 6), 0), (0, 1, (6, 8), 1))
    assert rules(prog, plan_for(prog, shards=odd)) == ["column-cuts", "column-cuts"]


def test_rowwise_adagrad_is_never_column_split() -> None:
    prog = program()
    split_b = a_cells((0, 1, (0, 8), 0))[:1] + [
        dict(table="b", row_shard=0, row_shards=1, columns=(0, 4), rank=1),
        dict(table="b", row_shard=0, row_shards=1, columns=(4, 6), rank=2),
    ]
    assert rules(prog, plan_for(prog, shards=split_b)) == ["rowwise-adagrad"] * 2


@pytest.mark.parametrize(
    ("constraint", "rule"),
    [
        (TableConstraint(table="a", cluster="ub"), "cluster-kind"),
        (TableConstraint(table="a", max_row_shards=1), "row-shards"),
        (TableConstraint(table="a", min_row_shards=4), "row-shards"),
        (TableConstraint(table="a", max_column_shards=1), "column-shards"),
        (TableConstraint(table="c", min_column_shards=2), "column-shards"),
    ],
)
def test_each_spec_constraint_is_named(constraint: TableConstraint, rule: str) -> None:
    prog = program(constraints=(constraint,))
    assert rules(prog, plan_for(prog)) == [rule]


def test_constraints_that_hold_pass() -> None:
    prog = program(
        constraints=(
            TableConstraint(
                table="a",
                cluster="rb",
                min_row_shards=2,
                max_row_shards=2,
                min_column_shards=2,
                max_column_shards=2,
            ),
            TableConstraint(table="b", max_column_shards=1, within_node=True),
        )
    )
    assert rules(prog, plan_for(prog)) == []


def test_within_node_over_two_nodes() -> None:
    prog = program(nodes=2, gpus=2, constraints=(TableConstraint(table="a", within_node=True),))
    across = a_cells((0, 2, (0, 8), 0), (1, 2, (0, 8), 2))
    assert rules(prog, plan_for(prog, shards=across)) == ["within-node"]
    inside = a_cells((0, 2, (0, 8), 0), (1, 2, (0, 8), 1))
    assert rules(prog, plan_for(prog, shards=inside)) == []
    dp_everywhere = program(
        nodes=2, gpus=2, constraints=(TableConstraint(table="c", within_node=True),)
    )
    assert rules(dp_everywhere, plan_for(dp_everywhere, shards=inside)) == ["within-node"]


def test_colocated_tables_share_their_ranks() -> None:
    prog = program(colocate=(Colocate(tables=("a", "b")),))
    apart = a_cells((0, 1, (0, 8), 0))
    v = validate_plan(prog, plan_for(prog, shards=apart))
    assert [x.rule for x in v] == ["colocate"] and x_names(v) == ["b"]
    together = a_cells((0, 1, (0, 8), 1))
    assert rules(prog, plan_for(prog, shards=together)) == []


def test_the_specs_communication_holds_for_rb_and_ub() -> None:
    hier = program(nodes=2, gpus=2, options=PlanOptions(communication="hierarchical"))
    v = validate_plan(hier, plan_for(hier))
    assert [x.rule for x in v] == ["communication"] and x_names(v) == ["a"]
    assert "hierarchical communication but rb cluster `rb0` is flat" in v[0].message
    clusters = [
        dict(name="rb0", kind="rb", communication="hierarchical", tables=["a"]),
        dict(name="ub0", kind="ub", communication="hierarchical", tables=["b"]),
        dict(name="dp0", kind="dp", tables=["c"]),
    ]
    within = a_cells((0, 2, (0, 8), 0), (1, 2, (0, 8), 1))  # rb on node 0, ub on rank 1
    assert rules(hier, plan_for(hier, clusters=clusters, shards=within)) == []
    # auto leaves it to the planner; flat asks for flat
    auto = program(nodes=2, gpus=2)
    assert rules(auto, plan_for(auto, clusters=clusters, shards=within)) == []
    flat = program(nodes=2, gpus=2, options=PlanOptions(communication="flat"))
    assert rules(flat, plan_for(flat, clusters=clusters, shards=within)) == [
        "communication",
        "communication",
    ]


def x_names(v: list[Any]) -> list[str | None]:
    return [x.table for x in v]


def test_check_plan_raises_naming_every_broken_rule() -> None:
    prog = program(constraints=(TableConstraint(table="a", cluster="ub"),))
    odd = a_cells((0, 1, (0, 6), 0), (0, 1, (6, 8), 1))
    with pytest.raises(EmbarkError) as err:
        check_plan(prog, plan_for(prog, shards=odd), "edited.json")
    text = err.value.render()
    assert "edited.json: error: invalid plan (column-cuts)" in text
    assert "invalid plan (cluster-kind)" in text
    assert "3 errors" in text
