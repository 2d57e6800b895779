"""embarkc.simulate: byte counts against brute-force loops, time conversion, consistency."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embark_runtime.plan import Plan
from embark_runtime.synthetic import SyntheticData
from embarkc.planner import constants as C
from embarkc.simulate import (
    count_bytes,
    dense_parameters,
    hierarchical_allreduce_flows,
    rail_allgather_flows,
    ring_seconds,
    simulate,
    simulate_many,
    step_time_of,
)

ZIPF = {"kind": "zipf", "alpha": 1.05, "permuted": True}


def make_plan(partition: str = "mod", nodes: int = 2, gpus: int = 2, batch: int = 16) -> Plan:
    """Two nodes of two GPUs; every cluster kind, both rb communications, 3D cells."""
    tables = [
        dict(name="a", rows=100, dim=8, optimizer="adagrad"),
        dict(name="b", rows=50, dim=8),
        dict(name="c", rows=40, dim=4, optimizer="adam"),
        dict(name="d", rows=10, dim=4),
        dict(name="e", rows=30, dim=4),
    ]
    features = [
        dict(name="fa", table="a", hotness=3, access=ZIPF),
        dict(
            name="fa_w",
            table="a",
            hotness=2,
            max_hotness=4,
            fixed=False,
            weighted=True,
            access={"kind": "uniform"},
        ),
        dict(name="fb", table="b", hotness=2, pooling="concat", access=ZIPF),
        dict(name="fb2", table="b", hotness=1, access={"kind": "uniform"}),
        dict(
            name="fc",
            table="c",
            hotness=4,
            pooling="mean",
            access={"kind": "zipf", "alpha": 1.2, "permuted": False},
        ),
        dict(name="fd", table="d", hotness=2, access={"kind": "uniform"}),
        dict(name="fe", table="e", hotness=3, access=ZIPF),
    ]
    shards = [
        dict(table="a", row_shard=0, row_shards=2, columns=(0, 4), rank=0),
        dict(table="a", row_shard=0, row_shards=2, columns=(4, 8), rank=0),
        dict(table="a", row_shard=1, row_shards=2, columns=(0, 4), rank=1),
        dict(table="a", row_shard=1, row_shards=2, columns=(4, 8), rank=3),
        dict(table="b", row_shard=0, row_shards=2, columns=(0, 4), rank=2),
        dict(table="b", row_shard=0, row_shards=2, columns=(4, 8), rank=0),
        dict(table="b", row_shard=1, row_shards=2, columns=(0, 8), rank=3),
        dict(table="c", row_shard=0, row_shards=3, columns=(0, 4), rank=1),
        dict(table="c", row_shard=1, row_shards=3, columns=(0, 4), rank=2),
        dict(table="c", row_shard=2, row_shards=3, columns=(0, 4), rank=2),
    ]
    clusters = [
        dict(name="rb_flat", kind="rb", communication="flat", tables=["a"]),
        dict(name="rb_hier", kind="rb", communication="hierarchical", tables=["b"]),
        dict(name="ub0", kind="ub", tables=["c"]),
        dict(name="dp_dense", kind="dp", gradient_exchange="dense", tables=["d"]),
        dict(name="dp_sparse", kind="dp", gradient_exchange="sparse", tables=["e"]),
    ]
    return Plan.model_validate(
        dict(
            source=dict(spec="t", sha256="0"),
            topology=dict(
                nodes=nodes,
                gpus_per_node=gpus,
                hbm_bytes=1 << 34,
                hbm_bandwidth=2e12,
                intra_node_bandwidth=3e11,
                inter_node_bandwidth=2.5e10,
            ),
            batch_size=batch,
            tables=tables,
            features=features,
            row_partition=partition,
            clusters=clusters,
            shards=shards,
            estimate=dict(step_time=0.0, per_rank=[]),
            planner=dict(strategy="t", solver="t", status="greedy"),
            model=dict(
                batch_size=batch,
                dense_features=13,
                bottom_mlp=[16, 8],
                interaction={"kind": "dot"},
                top_mlp=[8, 1],
            ),
        )
    )


def make_hub_plan(
    communication: str = "hierarchical", nodes: int = 2, gpus: int = 2, partition: str = "mod"
) -> Plan:
    """`make_plan` with ub cluster `ub0` of the given communication and table c cut so
    that hierarchical ub is exercised: row shard 0's columns on owners of local index 1
    (node 0) and 0 (node 1), row shard 1's two column cells on one owner (shared keys),
    row shard 2 on rank 0."""
    d = make_plan(partition, nodes=nodes, gpus=gpus, batch=4 * nodes * gpus).model_dump()
    d["shards"] = [s for s in d["shards"] if s["table"] != "c"] + [
        dict(table="c", row_shard=0, row_shards=3, columns=(0, 2), rank=1),
        dict(table="c", row_shard=0, row_shards=3, columns=(2, 4), rank=2),
        dict(table="c", row_shard=1, row_shards=3, columns=(0, 1), rank=3),
        dict(table="c", row_shard=1, row_shards=3, columns=(1, 4), rank=3),
        dict(table="c", row_shard=2, row_shards=3, columns=(0, 4), rank=0),
    ]
    for c in d["clusters"]:
        if c["name"] == "ub0":
            c["communication"] = communication
    return Plan.model_validate(d)


def brute_force(plan: Plan, batches, log: list | None = None) -> dict[str, dict[str, int]]:
    """docs/communication.md, read literally, with explicit loops over samples. `log`, when
    given, receives every rb and ub message as (cluster, phase, src, dst, bytes)."""
    g = plan.topology.gpus_per_node
    world = plan.world_size
    b = plan.batch_size // world
    out = {c.name: {"intra": 0, "inter": 0} for c in plan.clusters}

    def send(cluster: str, src: int, dst: int, nbytes: int, phase: str = "") -> None:
        if src != dst and nbytes:
            out[cluster]["intra" if src // g == dst // g else "inter"] += nbytes
            if log is not None:
                log.append((cluster, phase, src, dst, nbytes))

    def ids_of(a: int, feature: str) -> list[int]:
        bag = batches[a].sparse[feature]
        got = []
        for sample in range(b):
            for p in range(bag.offsets[sample], bag.offsets[sample + 1]):
                got.append(int(bag.ids[p]))
        return got

    for c in plan.clusters:
        for name in c.tables:
            t = plan.table(name)
            feats = [f for f in plan.features if f.table == name]
            if c.kind == "dp":
                nodes = world // g
                for a in range(world):
                    n, i = divmod(a, g)
                    rail = [m * g + i for m in range(nodes)]
                    if c.gradient_exchange == "sparse":
                        msg = [
                            len({k for f in feats for k in ids_of(r, f.name)}) * (8 + 4 * t.dim)
                            for r in range(world)
                        ]
                        for p in rail:  # across nodes, then everything held inside the node
                            send(c.name, a, p, msg[a])
                        for q in range(n * g, (n + 1) * g):
                            send(c.name, a, q, sum(msg[p] for p in rail))
                    else:
                        chunk = [len(x) for x in np.array_split(np.arange(t.rows * t.dim), g)]
                        part = [len(x) for x in np.array_split(np.arange(chunk[i]), nodes)]
                        for q in range(g):  # reduce-scatter, then all-gather in the node
                            send(c.name, a, n * g + q, 4 * chunk[q])
                            send(c.name, a, n * g + q, 4 * chunk[i])
                        if nodes > 1:  # ring of chunk i over the nodes on rail i
                            succ = rail[(n + 1) % nodes]
                            send(c.name, a, succ, 4 * (chunk[i] - part[(n + 1) % nodes]))
                            send(c.name, a, succ, 4 * (chunk[i] - part[(n + 2) % nodes]))
                continue
            cells = plan.shards_of(name)
            r = cells[0].row_shards
            block = math.ceil(t.rows / r)

            def shard(k: int) -> int:
                return k % r if plan.row_partition == "mod" else k // block  # noqa: B023

            def wants(a: int, j: int) -> set[int]:
                return {k for f in feats for k in ids_of(a, f.name) if shard(k) == j}  # noqa: B023

            if c.kind == "ub" and c.communication == "hierarchical" and world > g:
                for j in range(r):
                    for o in sorted({s.rank for s in cells if s.row_shard == j}):
                        widths = [s.width for s in cells if s.row_shard == j and s.rank == o]

                        def serve(
                            a: int, o: int, ids: set, widths: list[int] = widths, name=c.name
                        ) -> None:
                            """a asks o for `ids`: keys, then one vector (and gradient) each."""
                            send(name, a, o, 8 * len(ids), "distributor")
                            for w in widths:
                                send(name, o, a, len(ids) * 4 * w, "forward")
                                send(name, a, o, len(ids) * 4 * w, "backward")

                        for n in range(world // g):
                            node = range(n * g, (n + 1) * g)
                            if n == o // g:  # served as in flat ub
                                for a in node:
                                    serve(a, o, wants(a, j))
                                continue
                            p = n * g + o % g  # the aggregator: o's rail peer on node n
                            serve(p, o, set().union(*(wants(a, j) for a in node)))
                            for a in node:
                                serve(a, p, wants(a, j))
                continue
            f_t = sum(int(f.hotness) if f.pooling == "concat" else 1 for f in feats)
            for a in range(world):
                for j in range(r):
                    ids_j = [k for f in feats for k in ids_of(a, f.name) if shard(k) == j]
                    weighted = [
                        k for f in feats if f.weighted for k in ids_of(a, f.name) if shard(k) == j
                    ]
                    if c.kind == "rb":
                        nbytes = 8 * len(ids_j) + 4 * b * len(feats) + 4 * len(weighted)
                    else:
                        nbytes = 8 * len(set(ids_j))
                    for o in sorted({s.rank for s in cells if s.row_shard == j}):
                        send(c.name, a, o, nbytes, "distributor")
                for s in cells:
                    o, w = s.rank, s.width
                    if c.kind == "ub":
                        u = len(
                            {k for f in feats for k in ids_of(a, f.name) if shard(k) == s.row_shard}
                        )
                        send(c.name, o, a, u * 4 * w, "forward")
                        send(c.name, a, o, u * 4 * w, "backward")
                    elif c.communication == "flat" or a // g == o // g:
                        send(c.name, o, a, b * f_t * 4 * w, "forward")
                        send(c.name, a, o, b * f_t * 4 * w, "backward")
                    else:
                        p = (o // g) * g + a % g
                        send(c.name, o, p, b * f_t * 4 * w, "forward")
                        send(c.name, p, o, b * f_t * 4 * w, "backward")
                if c.kind == "rb" and c.communication == "hierarchical":
                    for n in sorted({s.rank // g for s in cells}):
                        if a // g == n:
                            continue
                        cols = set()
                        for s in cells:
                            if s.rank // g == n:
                                cols |= set(range(*s.columns))
                        p = n * g + a % g
                        send(c.name, p, a, b * f_t * 4 * len(cols), "forward")
                        send(c.name, a, p, b * f_t * 4 * len(cols), "backward")
    return out


@pytest.mark.parametrize("partition", ["mod", "range"])
@pytest.mark.parametrize("seed", [0, 7])
def test_count_bytes_equals_brute_force_counting(partition: str, seed: int) -> None:
    plan = make_plan(partition)
    data = SyntheticData(plan, seed=seed)
    for step in range(2):
        batches = [data.batch(step, a, plan.world_size) for a in range(plan.world_size)]
        got = count_bytes(plan, batches)
        assert got == brute_force(plan, batches)
        assert all(v["inter"] > 0 for v in got.values())


@pytest.mark.parametrize("partition", ["mod", "range"])
@pytest.mark.parametrize(("nodes", "gpus"), [(2, 2), (3, 2), (2, 3)])
def test_hierarchical_ub_bytes_equal_brute_force_counting(partition, nodes, gpus) -> None:
    plan = make_hub_plan("hierarchical", nodes, gpus, partition)
    flat = make_hub_plan("flat", nodes, gpus, partition)
    data = SyntheticData(plan, seed=4)
    for step in range(2):
        batches = [data.batch(step, a, plan.world_size) for a in range(plan.world_size)]
        got = count_bytes(plan, batches)
        assert got == brute_force(plan, batches)
        flat_got = count_bytes(flat, batches)
        assert {k: v for k, v in got.items() if k != "ub0"} == {
            k: v for k, v in flat_got.items() if k != "ub0"
        }
        # the node's union crosses the network instead of every rank's ids
        assert 0 < got["ub0"]["inter"] < flat_got["ub0"]["inter"]


def _per_rank(plan: Plan, log: list, cluster: str) -> dict:
    """(phase, link, "sent" | "received") -> bytes per rank, of `cluster`'s messages."""
    g = plan.topology.gpus_per_node
    out: dict = {}
    for name, phase, src, dst, nbytes in log:
        if name != cluster:
            continue
        link = "intra" if src // g == dst // g else "inter"
        for way, rank in (("sent", src), ("received", dst)):
            out.setdefault((phase, link, way), np.zeros(plan.world_size))[rank] += nbytes
    return out


@pytest.mark.parametrize(("nodes", "gpus"), [(2, 2), (3, 2)])
def test_hierarchical_ub_bytes_per_rank_and_phase_by_brute_force(nodes, gpus) -> None:
    """What each rank sends and receives in each phase: the other clusters are flat
    plan's, ub0's changes are the brute-force messages' changes."""
    plan = make_hub_plan("hierarchical", nodes, gpus)
    flat = make_hub_plan("flat", nodes, gpus)
    data = SyntheticData(plan, seed=8)
    batches = [data.batch(0, a, plan.world_size) for a in range(plan.world_size)]
    hier_log: list = []
    flat_log: list = []
    brute_force(plan, batches, hier_log)
    brute_force(flat, batches, flat_log)
    want_h, want_f = _per_rank(plan, hier_log, "ub0"), _per_rank(flat, flat_log, "ub0")
    got_h, got_f = simulate(plan, batches=1, seed=8), simulate(flat, batches=1, seed=8)
    zero = np.zeros(plan.world_size)
    for phase in ("distributor", "forward", "backward"):
        for link in ("intra", "inter"):
            for way in ("sent", "received"):
                got = [
                    getattr(h, way)[phase][link] - getattr(f, way)[phase][link]
                    for h, f in zip(got_h.per_rank, got_f.per_rank, strict=True)
                ]
                key = (phase, link, way)
                want = want_h.get(key, zero) - want_f.get(key, zero)
                assert got == list(want), key
    assert ("distributor", "inter", "sent") in want_h and ("backward", "intra", "sent") in want_h


def _ub_sets(plan: Plan, seed: int) -> list[list[set[int]]]:
    """Distinct ids of table c per [rank][row shard] in step 0 (mod partition)."""
    data = SyntheticData(plan, seed=seed)
    out = []
    for a in range(plan.world_size):
        ids = data.batch(0, a, plan.world_size).sparse["fc"].ids
        out.append([{int(k) for k in ids if k % 3 == j} for j in range(3)])
    return out


def test_hierarchical_ub_owner_and_aggregator_work_by_hand() -> None:
    """The owner serves its node's requests plus one union per other node; the aggregator
    adds R (4 keys + 4 vectors) per cell; requesters and everything else are unchanged."""
    plan, flat = make_hub_plan("hierarchical"), make_hub_plan("flat")
    hier_res, flat_res = simulate(plan, batches=1, seed=2), simulate(flat, batches=1, seed=2)
    u = _ub_sets(plan, seed=2)
    g, world = 2, 4
    t = plan.table("c")
    hbm, ids = np.zeros(world), np.zeros(world)
    for s in plan.shards_of("c"):
        o, j, vec = s.rank, s.row_shard, 4 * s.width
        per_id = 4 * 8 + max(s.width * 4, 64) + 2 * vec  # fp32 table: 4 bytes an element
        assert t.dtype == "fp32"
        near = sum(len(u[a][j]) for a in range(world) if a // g == o // g)
        far = [n for n in range(world // g) if n != o // g]
        served = near + sum(
            len(set().union(*(u[a][j] for a in range(n * g, n * g + g)))) for n in far
        )
        flat_served = sum(len(u[a][j]) for a in range(world))
        hbm[o] += (served - flat_served) * per_id
        ids[o] += served - flat_served
        for n in far:
            r_ = sum(len(u[a][j]) for a in range(n * g, n * g + g))
            hbm[n * g + o % g] += r_ * (4 * 8 + 4 * vec)
    assert ids.any() and hbm.any()
    for h, f, dh, di in zip(hier_res.per_rank, flat_res.per_rank, hbm, ids, strict=True):
        assert h.hbm_bytes - f.hbm_bytes == pytest.approx(dh)
        assert h.ids - f.ids == di
        assert h.distinct == f.distinct


def test_hierarchical_ub_on_one_node_is_flat_ub() -> None:
    plan = make_hub_plan("hierarchical", nodes=1, gpus=4)
    flat = make_hub_plan("flat", nodes=1, gpus=4)
    data = SyntheticData(plan, seed=6)
    batches = [data.batch(0, a, plan.world_size) for a in range(plan.world_size)]
    assert count_bytes(plan, batches) == count_bytes(flat, batches)
    assert count_bytes(plan, batches)["ub0"]["intra"] > 0
    hier_res, flat_res = simulate(plan, batches=2, seed=6), simulate(flat, batches=2, seed=6)
    assert hier_res.step_times == flat_res.step_times
    assert hier_res.clusters == flat_res.clusters
    for h, f in zip(hier_res.per_rank, flat_res.per_rank, strict=True):
        assert (h.hbm_bytes, h.ids, h.distinct) == (f.hbm_bytes, f.ids, f.distinct)
        assert (h.sent, h.received, h.components) == (f.sent, f.received, f.components)


def test_simulate_totals_agree_with_count_bytes_and_per_rank_counts() -> None:
    plan = make_plan()
    res = simulate(plan, batches=1, seed=3)
    data = SyntheticData(plan, seed=3)
    batches = [data.batch(0, a, plan.world_size) for a in range(plan.world_size)]
    counted = count_bytes(plan, batches, include_dense=True)
    assert {k: {lk: int(v) for lk, v in d.items()} for k, d in res.clusters.items()} == counted
    for link in ("intra", "inter"):
        sent = sum(rc.sent[g][link] for rc in res.per_rank for g in rc.sent)
        recv = sum(rc.received[g][link] for rc in res.per_rank for g in rc.received)
        assert sent == recv == sum(v[link] for v in counted.values())
    assert res.step_time == max(rc.time for rc in res.per_rank)
    assert res.step_times == [res.step_time]
    assert res.per_rank[res.critical_rank].time == res.step_time
    assert [rc.memory_bytes for rc in res.per_rank] == plan.memory_by_rank()


def test_lookup_and_distinct_counts_of_a_one_rank_plan() -> None:
    """One rank, one rb cell: every id is looked up there, distinct rows are the set."""
    plan = make_plan(nodes=1, gpus=1, batch=32)
    only = [
        dict(table=t, row_shard=0, row_shards=1, columns=(0, plan.table(t).dim), rank=0)
        for t in ("a", "b", "c")
    ]
    plan = plan.model_copy(update={"shards": [type(plan.shards[0])(**s) for s in only]})
    res = simulate(plan, batches=1, seed=1)
    g = SyntheticData(plan, seed=1).global_batch(0)
    rb_ids = sum(len(g.sparse[f].ids) for f in ("fa", "fa_w", "fb", "fb2"))
    ub_ids = len(np.unique(g.sparse["fc"].ids))
    dp_ids = len(g.sparse["fd"].ids) + len(g.sparse["fe"].ids)
    assert res.per_rank[0].ids == rb_ids + ub_ids + dp_ids
    distinct = (
        len(np.unique(np.concatenate([g.sparse["fa"].ids, g.sparse["fa_w"].ids])))
        + len(np.unique(np.concatenate([g.sparse["fb"].ids, g.sparse["fb2"].ids])))
        + ub_ids
        + 10  # dense exchange: the whole dp table is updated
        + len(np.unique(g.sparse["fe"].ids))
    )
    assert res.per_rank[0].distinct == distinct
    assert all(v == {"intra": 0, "inter": 0} for v in res.clusters.values())


def test_step_time_conversion_by_hand() -> None:
    plan = make_plan()  # 2 nodes: rb flat, rb hierarchical, ub, two dp clusters
    sent = {
        "distributor": {"intra": 3e9, "inter": 1e9},
        "forward": {"intra": 6e9, "inter": 0.0},
        "backward": {"intra": 1e9, "inter": 5e9},
        "dp_exchange": {"intra": 0.0, "inter": 2e9},
    }
    recv = {
        "distributor": {"intra": 1e9, "inter": 2e9},
        "forward": {"intra": 3e9, "inter": 4e9},
        "backward": {"intra": 2e9, "inter": 1e9},
        "dp_exchange": {"intra": 0.0, "inter": 1e9},
    }
    got = step_time_of(plan, 1.6e12, sent, recv, ring=0.25)
    nv, net = 3e11 * C.NVLINK_EFFICIENCY, 2.5e10 * C.NETWORK_EFFICIENCY
    call = C.COLLECTIVE_LATENCY_SECONDS + C.INTER_NODE_LATENCY_SECONDS
    launch = (3 * (3 + 1) + 2 * 1) * C.KERNEL_LAUNCH_SECONDS
    assert got["lookup"] == pytest.approx(1.6e12 / (2e12 * C.HBM_EFFICIENCY) + launch)
    assert got["distributor"] == pytest.approx(3e9 / nv + 2e9 / net + 3 * call)
    assert got["nvlink"] == pytest.approx(6e9 / nv + 2e9 / nv)
    assert got["network"] == pytest.approx(4e9 / net + 5e9 / net + (2 * 3 + 2 * 1) * call)
    assert got["dp_exchange"] == pytest.approx(0.25 + 2e9 / net + call)


def test_hierarchical_ub_latencies_by_hand() -> None:
    """hub = 1 on two nodes: one more key call, two more result calls, three launches."""
    plan, flat = make_hub_plan("hierarchical"), make_hub_plan("flat")
    sent = {"distributor": {"intra": 1e9, "inter": 1e9}, "forward": {"intra": 2e9, "inter": 3e9}}
    recv = {"backward": {"intra": 1e9, "inter": 2e9}}
    got = step_time_of(plan, 1e12, sent, recv, ring=0.1, window=0.0)
    base = step_time_of(flat, 1e12, sent, recv, ring=0.1, window=0.0)
    call = C.COLLECTIVE_LATENCY_SECONDS + C.INTER_NODE_LATENCY_SECONDS
    assert got["lookup"] - base["lookup"] == pytest.approx(3 * C.KERNEL_LAUNCH_SECONDS)
    assert got["distributor"] - base["distributor"] == pytest.approx(call)
    assert got["network"] - base["network"] == pytest.approx(2 * call)
    assert got["nvlink"] == base["nvlink"] and got["dp_exchange"] == base["dp_exchange"]
    nv, net = 3e11 * C.NVLINK_EFFICIENCY, 2.5e10 * C.NETWORK_EFFICIENCY
    assert got["distributor"] == pytest.approx(1e9 / nv + 1e9 / net + (3 + 1) * call)
    assert got["network"] == pytest.approx(3e9 / net + 2e9 / net + (2 * 3 + 2 * 1 + 2 * 1) * call)
    launch = (3 * (3 + 1) + 2 * 1 + 3 * 1) * C.KERNEL_LAUNCH_SECONDS
    assert got["lookup"] == pytest.approx(1e12 / (2e12 * C.HBM_EFFICIENCY) + launch)
    # on one node hierarchical ub costs what flat ub does
    one, one_flat = make_hub_plan("hierarchical", 1, 4), make_hub_plan("flat", 1, 4)
    assert step_time_of(one, 1e12, sent, recv, 0.1, 0.0) == step_time_of(
        one_flat, 1e12, sent, recv, 0.1, 0.0
    )


def test_dense_ring_waits_for_the_slowest_hop() -> None:
    plan = make_plan()
    sent = {"intra": np.array([8e9, 0.0, 8e9, 0.0]), "inter": np.array([0.0, 8e9, 0.0, 8e9])}
    assert ring_seconds(plan, sent) == pytest.approx(8e9 / (2.5e10 * C.NETWORK_EFFICIENCY))
    res = simulate(plan, batches=1)
    # hierarchical all-reduce of the 10 x 4 dp table on 2 nodes of 2: chunks of 20 values,
    # 2 * 20 * 4 bytes over NVLink and 20 * 4 over the NIC per rank
    ring = 160 / (3e11 * C.NVLINK_EFFICIENCY) + 80 / (2.5e10 * C.NETWORK_EFFICIENCY)
    assert [rc.sent["ring"] for rc in res.per_rank] == [{"intra": 160, "inter": 80}] * 4
    sparse = [
        max(rc.sent["dp_exchange"]["intra"], rc.received["dp_exchange"]["intra"]) / (3e11 * 0.75)
        for rc in res.per_rank
    ]
    assert all(
        rc.components["dp_exchange"] >= ring + s for rc, s in zip(res.per_rank, sparse, strict=True)
    )
    assert res.dense_allreduce_time > 0


def test_dense_parameters_match_the_runtime_dense_model() -> None:
    torch = pytest.importorskip("torch")
    from embark_runtime.dense import DenseConfig, DLRMDense

    plan = make_plan()
    widths = (8, 8, 16, 8, 4, 4, 4)
    for kind in ("dot", "dcnv2"):
        model = dict(
            batch_size=16,
            dense_features=13,
            bottom_mlp=[16, 8],
            interaction={"kind": kind, "layers": 2, "low_rank": 6},
            top_mlp=[8, 1],
        )
        p = plan.model_copy(update={"model": model})
        m = DLRMDense(DenseConfig(13, (16, 8), kind, (8, 1), widths, cross_layers=2, low_rank=6))
        assert dense_parameters(p) == sum(x.numel() for x in m.parameters())
    del torch


def test_uneven_batch_is_a_clear_error() -> None:
    plan = make_plan(batch=18)
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        simulate(plan, batches=1)


def test_simulate_many_equals_one_plan_at_a_time() -> None:
    plans = [make_plan("mod"), make_plan("mod", nodes=1, gpus=4)]
    many = simulate_many(plans, batches=2, seed=5)
    for plan, got in zip(plans, many, strict=True):
        one = simulate(plan, batches=2, seed=5)
        assert got.step_time == one.step_time and got.step_times == one.step_times
        assert got.clusters == one.clusters
        assert [rc.hbm_bytes for rc in got.per_rank] == [rc.hbm_bytes for rc in one.per_rank]
    assert many[0].clusters["rb_flat"]["inter"] > 0 == many[1].clusters["rb_flat"]["inter"]
    with pytest.raises(ValueError, match="same tables, features and batch"):
        simulate_many([make_plan(), make_plan(batch=32)])


def literal_allreduce(elements: int, world: int, g: int) -> dict[tuple[int, int], int]:
    """docs/communication.md's hierarchical all-reduce, message by message."""
    nodes = world // g
    out: dict[tuple[int, int], int] = {}

    def send(a: int, o: int, n: int) -> None:
        if a != o and n:
            out[(a, o)] = out.get((a, o), 0) + n

    chunk = [len(x) for x in np.array_split(np.arange(elements), g)]
    for a in range(world):
        n, i = divmod(a, g)
        part = [len(x) for x in np.array_split(np.arange(chunk[i]), nodes)]
        for q in range(g):
            send(a, n * g + q, 4 * chunk[q] + 4 * chunk[i])
        if nodes > 1:
            rs = sum(part) - part[(n + 1) % nodes]
            ag = sum(part) - part[(n + 2) % nodes]
            send(a, ((n + 1) % nodes) * g + i, 4 * (rs + ag))
    return out


def _pairs(flows) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for a, o, n in zip(*flows, strict=True):
        if a != o and n:
            out[(int(a), int(o))] = out.get((int(a), int(o)), 0) + int(n)
    return out


@pytest.mark.parametrize(("world", "g"), [(4, 1), (3, 1), (6, 2), (8, 2), (12, 4), (4, 4)])
@pytest.mark.parametrize("elements", [0, 1, 7, 1001])
def test_hierarchical_allreduce_and_rail_allgather_flows_follow_the_doc(world, g, elements):
    assert _pairs(hierarchical_allreduce_flows(elements, world, g)) == literal_allreduce(
        elements, world, g
    )
    msg = np.arange(world, dtype=np.int64) * 24 + elements
    want: dict[tuple[int, int], int] = {}
    for a in range(world):
        rail = [m * g + a % g for m in range(world // g)]
        for o in rail:
            want[(a, o)] = want.get((a, o), 0) + int(msg[a])
        for o in range(a // g * g, a // g * g + g):
            want[(a, o)] = want.get((a, o), 0) + int(sum(msg[p] for p in rail))
    want = {k: v for k, v in want.items() if k[0] != k[1] and v}
    assert _pairs(rail_allgather_flows(msg, g)) == want


def test_dense_model_bytes_are_its_hierarchical_allreduce() -> None:
    plan = make_plan()
    data = SyntheticData(plan, seed=1)
    batches = [data.batch(0, a, plan.world_size) for a in range(plan.world_size)]
    got = count_bytes(plan, batches, include_dense=True)["dense"]
    g = plan.topology.gpus_per_node
    want = {"intra": 0, "inter": 0}
    for (a, o), n in literal_allreduce(dense_parameters(plan), plan.world_size, g).items():
        want["intra" if a // g == o // g else "inter"] += n
    assert got == want and want["inter"] > 0


def test_a_batch_too_large_to_sample_here_is_refused_before_drawing() -> None:
    from embarkc.simulate import SAMPLED_BYTES_PER_ID, _check_sampling_memory

    plan = make_plan()
    # table a: fa (3 ids a bag) and fa_w (up to 4) on the global batch of 16
    need = 16 * (3 + 4) * SAMPLED_BYTES_PER_ID
    _check_sampling_memory(plan, available=need)
    with pytest.raises(ValueError, match=r"table `a` holds up to 112 ids .* smaller batch"):
        _check_sampling_memory(plan, available=need - 1)
