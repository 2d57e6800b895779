"""Migration cost: the closed-form count agrees with an explicit loop over every element."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from embark_runtime.plan import (
    DTYPE_BYTES,
    Cluster,
    Estimate,
    Plan,
    PlannerInfo,
    PlanTable,
    PlanTopology,
    Shard,
    Source,
)
from embarkc.migration import migration_cost, row_overlap

_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _random_plan(rng: random.Random, tables: list[PlanTable], nodes: int, gpus: int) -> Plan:
    world = nodes * gpus
    clusters: list[Cluster] = []
    shards: list[Shard] = []
    for t in tables:
        kind = rng.choice(("dp", "rb", "ub", "rb"))
        if kind == "rb":
            clusters.append(
                Cluster(name=f"c_{t.name}", kind="rb", communication="flat", tables=[t.name])
            )
        else:
            clusters.append(Cluster(name=f"c_{t.name}", kind=kind, tables=[t.name]))
        if kind == "dp":
            continue
        r = rng.randint(1, min(4, t.rows))
        for j in range(r):
            cuts = sorted(rng.sample(range(1, t.dim), k=rng.randint(0, min(2, t.dim - 1))))
            bounds = [0, *cuts, t.dim]
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                shards.append(
                    Shard(
                        table=t.name,
                        row_shard=j,
                        row_shards=r,
                        columns=(lo, hi),
                        rank=rng.randrange(world),
                    )
                )
    return Plan(
        source=Source(spec="x.embark", sha256="0" * 64),
        topology=PlanTopology(
            nodes=nodes,
            gpus_per_node=gpus,
            hbm_bytes=1 << 30,
            hbm_bandwidth=1e12,
            intra_node_bandwidth=1e11,
            inter_node_bandwidth=1e10,
        ),
        batch_size=8,
        tables=tables,
        features=[],
        row_partition=rng.choice(("mod", "range")),
        clusters=clusters,
        shards=shards,
        estimate=Estimate(step_time=0.0, per_rank=[]),
        planner=PlannerInfo(strategy="test", solver="none", status="greedy"),
    )


def _holders(plan: Plan, t: PlanTable, row: int, col: int | None) -> list[int]:
    """Ranks holding (row, col) of `t` under `plan` (col None: any column), cell order."""
    if plan.cluster_of(t.name).kind == "dp":
        return list(range(plan.world_size))
    out = []
    for s in plan.shards_of(t.name):
        r = s.row_shards
        shard = row % r if plan.row_partition == "mod" else row // -(-t.rows // r)
        if shard == s.row_shard and (col is None or s.columns[0] <= col < s.columns[1]):
            out.append((s.columns[0], s.rank))
    return [rank for _, rank in sorted(out)]


def _brute_force(a: Plan, b: Plan) -> tuple[int, int, dict[tuple[int, int], int]]:
    """(weight bytes, state bytes, bytes per (src node, dst node)), one element at a time."""
    per_elem = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 0, "adam": 2}
    per_row = {"sgd": 0, "adagrad": 0, "rowwise_adagrad": 1, "adam": 1}
    ga, gb = a.topology.gpus_per_node, b.topology.gpus_per_node
    weight = state = 0
    nodes: dict[tuple[int, int], int] = defaultdict(int)
    a_tables = {t.name: t for t in a.tables}
    for tb in b.tables:
        ta = a_tables.get(tb.name)
        if ta is None:
            continue
        same_opt = ta.optimizer == tb.optimizer
        ew = DTYPE_BYTES[ta.dtype]
        es = 4 * per_elem[ta.optimizer] if same_opt else 0
        rs = 4 * per_row[ta.optimizer] if same_opt else 0
        for row in range(min(ta.rows, tb.rows)):
            for col in range(min(ta.dim, tb.dim)):
                owners = _holders(a, ta, row, col)
                for dst in set(_holders(b, tb, row, col)):
                    if dst in owners:
                        continue
                    # a sharded element has one owner; a dp one is on all of A's ranks
                    src = owners[0] if len(owners) == 1 else dst % a.world_size
                    assert len(owners) in (1, a.world_size)
                    weight += ew
                    state += es
                    nodes[(src // ga, dst // gb)] += ew + es
            if rs:
                a_row = _holders(a, ta, row, None)
                for dst in set(_holders(b, tb, row, None)) - set(a_row):
                    same = [r for r in a_row if r // ga == dst // gb]
                    src = (same or a_row)[0]
                    if a.cluster_of(ta.name).kind == "dp":
                        src = dst % a.world_size
                    state += rs
                    nodes[(src // ga, dst // gb)] += rs
    return weight, state, {k: v for k, v in nodes.items() if v}


def _tables(rng: random.Random, names: list[str]) -> list[PlanTable]:
    return [
        PlanTable(
            name=n,
            rows=rng.randint(1, 23),
            dim=rng.randint(1, 7),
            dtype=rng.choice(("fp32", "fp16")),
            optimizer=rng.choice(_OPTIMIZERS),
        )
        for n in names
    ]


@pytest.mark.parametrize("seed", range(40))
def test_migration_matches_brute_force(seed):
    rng = random.Random(seed)
    ta = _tables(rng, ["t0", "t1", "t2", "t3"])
    tb = []
    for t in ta[1:]:  # t0 removed, t1..t3 kept (sometimes resized or re-optimized), t9 added
        upd: dict = {}
        if rng.random() < 0.3:
            upd["rows"] = rng.randint(1, 23)
        if rng.random() < 0.3:
            upd["dim"] = rng.randint(1, 7)
        if rng.random() < 0.15:
            upd["optimizer"] = rng.choice(_OPTIMIZERS)
        tb.append(t.model_copy(update=upd))
    tb += _tables(rng, ["t9"])
    a = _random_plan(rng, ta, nodes=rng.randint(1, 2), gpus=2)
    b = _random_plan(rng, tb, nodes=rng.randint(1, 3), gpus=2)
    m = migration_cost(a, b)
    weight, state, nodes = _brute_force(a, b)
    assert (m.weight_bytes, m.state_bytes) == (weight, state)
    assert {(f.src, f.dst): f.bytes for f in m.by_node} == nodes
    assert m.intra_node_bytes + m.inter_node_bytes == m.total_bytes
    assert sum(r.received for r in m.by_rank) == m.total_bytes == sum(r.sent for r in m.by_rank)
    assert m.fresh_tables == ("t9",)


def test_same_plan_moves_nothing():
    rng = random.Random(7)
    a = _random_plan(rng, _tables(rng, ["x", "y", "z"]), nodes=2, gpus=2)
    m = migration_cost(a, a)
    assert m.total_bytes == 0 and m.by_node == () and m.by_rank == ()


def test_dp_to_sharded_moves_nothing_and_sharded_to_dp_replicates():
    t = PlanTable(name="t", rows=10, dim=4, optimizer="sgd")
    rng = random.Random(0)
    a = _random_plan(rng, [t], nodes=1, gpus=4)
    dp = a.model_copy(
        update={"clusters": [Cluster(name="d", kind="dp", tables=["t"])], "shards": []}
    )
    sharded = a.model_copy(
        update={
            "clusters": [Cluster(name="r", kind="rb", communication="flat", tables=["t"])],
            "shards": [Shard(table="t", row_shard=0, row_shards=1, columns=(0, 4), rank=2)],
        }
    )
    assert migration_cost(dp, sharded).total_bytes == 0
    # every rank but 2 receives the whole table: 3 * 10 rows * 4 cols * 4 bytes
    m = migration_cost(sharded, dp)
    assert m.weight_bytes == 3 * 10 * 4 * 4
    assert [(r.rank, r.sent, r.received) for r in m.by_rank] == [
        (0, 0, 160),
        (1, 0, 160),
        (2, 480, 0),
        (3, 0, 160),
    ]


@pytest.mark.parametrize("pa", ["mod", "range"])
@pytest.mark.parametrize("pb", ["mod", "range"])
@pytest.mark.parametrize(
    ("rows_a", "rows_b", "ra", "rb"), [(37, 37, 3, 4), (50, 41, 6, 4), (9, 20, 4, 9)]
)
def test_row_overlap_counts_each_common_row_once(pa, pb, rows_a, rows_b, ra, rb):
    n = min(rows_a, rows_b)
    m = row_overlap(n, pa, rows_a, ra, pb, rows_b, rb)
    want = np.zeros((ra, rb), dtype=np.int64)
    for x in range(n):
        i = x % ra if pa == "mod" else x // -(-rows_a // ra)
        j = x % rb if pb == "mod" else x // -(-rows_b // rb)
        want[i, j] += 1
    assert (m == want).all()
