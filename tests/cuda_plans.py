"""Hand-built plans for the CUDA kernel tests (the planner builds real ones; these pin the
cell shapes the kernels must cover: every pooling, dtype, optimizer, column cuts)."""

from __future__ import annotations

import json
from pathlib import Path

from embark_runtime.plan import (
    Access,
    Cluster,
    Estimate,
    Plan,
    PlanFeature,
    PlannerInfo,
    PlanTable,
    PlanTopology,
    Shard,
    Source,
)

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads"


def _plan(spec, topo, tables, features, clusters, shards, partition="mod") -> Plan:
    return Plan(
        source=Source(spec=spec, sha256="0" * 64),
        topology=topo,
        batch_size=256,
        tables=tables,
        features=features,
        row_partition=partition,
        clusters=clusters,
        shards=shards,
        estimate=Estimate(step_time=0.0, per_rank=[]),
        planner=PlannerInfo(strategy="hand", solver="none", status="greedy"),
    )


def _topo(nodes, gpus, arch) -> PlanTopology:
    return PlanTopology(
        nodes=nodes,
        gpus_per_node=gpus,
        hbm_bytes=80 << 30,
        hbm_bandwidth=3e12,
        intra_node_bandwidth=4.5e11,
        inter_node_bandwidth=5e10,
        arch=arch,
    )


def _rows(table: str, shards: int, cuts: list[tuple[int, int]], first_rank: int, world: int):
    out, r = [], first_rank
    for j in range(shards):
        for cols in cuts:
            out.append(
                Shard(table=table, row_shard=j, row_shards=shards, columns=cols, rank=r % world)
            )
            r += 1
    return out


UNIFORM = Access(kind="uniform")


def tiny_plan() -> Plan:
    """The tables and features of specs/tiny.embark, with a hand-made 4-rank plan."""
    t = [
        PlanTable(name="country", rows=100, dim=16, optimizer="sgd"),
        PlanTable(name="item", rows=20_000, dim=32, optimizer="adagrad"),
        PlanTable(name="category", rows=1000, dim=8, optimizer="rowwise_adagrad"),
        PlanTable(name="tag", rows=5000, dim=16, optimizer="adam"),
        PlanTable(name="history", rows=10_000, dim=24, optimizer="adagrad"),
        PlanTable(name="brand", rows=2000, dim=12, optimizer="rowwise_adagrad"),
    ]
    f = [
        PlanFeature(name="country", table="country", hotness=4, access=UNIFORM),
        PlanFeature(name="item", table="item", hotness=30, access=UNIFORM),
        PlanFeature(name="category", table="category", hotness=1, pooling="concat", access=UNIFORM),
        PlanFeature(name="tag", table="tag", hotness=3, weighted=True, access=UNIFORM),
        PlanFeature(
            name="history", table="history", hotness=8, max_hotness=20, fixed=False, access=UNIFORM
        ),
        PlanFeature(name="brand_viewed", table="brand", hotness=2, pooling="mean", access=UNIFORM),
        PlanFeature(name="brand_bought", table="brand", hotness=1, access=UNIFORM),
    ]
    c = [
        Cluster(name="dp0", kind="dp", tables=["country", "brand"], gradient_exchange="sparse"),
        Cluster(name="rb0", kind="rb", tables=["category", "tag", "history"], communication="flat"),
        Cluster(name="ub0", kind="ub", tables=["item"]),
    ]
    s = (
        _rows("item", 4, [(0, 32)], 0, 4)
        + _rows("category", 2, [(0, 8)], 1, 4)
        + _rows("tag", 2, [(0, 8), (8, 16)], 0, 4)
        + _rows("history", 4, [(0, 24)], 2, 4)
    )
    return _plan("specs/tiny.embark", _topo(2, 2, "sm_80"), t, f, c, s)


def dtype_plan() -> Plan:
    """fp16 and bf16 tables, odd widths and a range partition."""
    t = [
        PlanTable(name="h", rows=3000, dim=64, dtype="fp16", optimizer="adam"),
        PlanTable(name="b", rows=3000, dim=256, dtype="bf16", optimizer="rowwise_adagrad"),
        PlanTable(name="o", rows=3000, dim=20, dtype="fp16", optimizer="adagrad"),
        PlanTable(name="u", rows=3000, dim=48, dtype="bf16", optimizer="sgd"),
    ]
    f = [
        PlanFeature(name="h", table="h", hotness=5, pooling="mean", weighted=True, access=UNIFORM),
        PlanFeature(name="b", table="b", hotness=2, pooling="concat", access=UNIFORM),
        PlanFeature(name="o", table="o", hotness=1, access=UNIFORM),
        PlanFeature(name="u", table="u", hotness=7, access=UNIFORM),
    ]
    c = [
        Cluster(name="rb0", kind="rb", tables=["h", "b", "o"], communication="hierarchical"),
        Cluster(name="ub0", kind="ub", tables=["u"]),
    ]
    s = (
        _rows("h", 2, [(0, 32), (32, 64)], 0, 8)
        + _rows("b", 2, [(0, 256)], 4, 8)
        + _rows("o", 1, [(0, 20)], 6, 8)
        + _rows("u", 2, [(0, 16), (16, 48)], 7, 8)
    )
    return _plan("dtypes.embark", _topo(1, 8, "sm_90"), t, f, c, s, partition="range")


def dcnv2_plan() -> Plan:
    """The DLRM-DCNv2 workload of the paper (26 tables, dim 128, adagrad) on 16 x 8 H100s:
    the two 40M-row tables row-sharded 16 ways with a column cut, the next largest rb,
    middle ones ub, the small ones dp."""
    w = json.loads((WORKLOADS / "dcnv2.json").read_text())
    tables, features, shards = [], [], []
    dp, rb, ub = [], [], []
    for i, g in enumerate(x for grp in w["groups"] for x in [grp] * grp["tables"]):
        name = f"t{i}"
        tables.append(PlanTable(name=name, rows=g["rows"], dim=g["dim"], optimizer=w["optimizer"]))
        features.append(
            PlanFeature(
                name=f"f{i}",
                table=name,
                hotness=g["hotness"],
                access=Access(kind="zipf", alpha=1.1, permuted=True),
            )
        )
        if g["rows"] >= 10_000_000:
            rb.append(name)
            shards += _rows(name, 16, [(0, 64), (64, 128)], i, 128)
        elif g["rows"] >= 1_000_000:
            rb.append(name)
            shards += _rows(name, 8, [(0, 128)], i, 128)
        elif g["rows"] >= 100_000:
            ub.append(name)
            shards += _rows(name, 4, [(0, 128)], i, 128)
        else:
            dp.append(name)
    clusters = [
        Cluster(name="dp0", kind="dp", tables=dp, gradient_exchange="dense"),
        Cluster(name="rb0", kind="rb", tables=rb, communication="hierarchical"),
        Cluster(name="ub0", kind="ub", tables=ub),
    ]
    return _plan(
        "specs/paper/dcnv2.embark", _topo(16, 8, "sm_90"), tables, features, clusters, shards
    )
