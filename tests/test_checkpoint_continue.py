"""A checkpoint written under plan A and loaded under plan B continues as training under A
would have: the real ShardedEmbeddings on one rank (Comm-free), several grids and row
partitions, every optimizer, then the same batches on both."""

from __future__ import annotations

import pytest
import torch
from mp_harness import FeatureSpec, TableSpec, make_plan

from embark_runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from embark_runtime.synthetic import SyntheticData

embedding = pytest.importorskip("embark_runtime.embedding")

FEATURES = [
    FeatureSpec("f0", "a", 2, "sum"),
    FeatureSpec("f1", "a", 2, "mean", weighted=True),
    FeatureSpec("f2", "b", 2, "concat", 2),
    FeatureSpec("f3", "c", 2, "sum"),
    FeatureSpec("f4", "d", 3, "mean"),
]


def plan_of(grids: dict[str, tuple[str, tuple[int, int]]], partition: str):
    opts = {"a": "adagrad", "b": "adam", "c": "rowwise_adagrad", "d": "sgd"}
    rows = {"a": 60, "b": 33, "c": 25, "d": 17}
    tables = [
        TableSpec(n, rows[n], 8, kind, grid, opts[n], weight_decay=0.01 if n == "b" else 0.0)
        for n, (kind, grid) in grids.items()
    ]
    return make_plan(tables, FEATURES, nodes=1, gpus_per_node=1, batch_size=8, partition=partition)


PLAN_A = plan_of(
    {"a": ("rb", (2, 2)), "b": ("ub", (3, 1)), "c": ("dp", (1, 1)), "d": ("rb", (1, 2))}, "mod"
)
PLAN_B = plan_of(
    {"a": ("ub", (3, 1)), "b": ("rb", (2, 2)), "c": ("rb", (4, 1)), "d": ("dp", (1, 1))}, "range"
)


def train(emb, data: SyntheticData, steps: range) -> None:
    for step in steps:
        out = emb(data.global_batch(step).sparse)
        g = torch.Generator().manual_seed(step)
        loss = sum((out[k] * torch.randn(out[k].shape, generator=g)).sum() for k in sorted(out))
        loss.backward()


def tables_of(emb, plan):
    return {t.name: (emb.gather_table(t.name), emb.gather_state(t.name)) for t in plan.tables}


@pytest.mark.parametrize(("a", "b"), [(PLAN_A, PLAN_B), (PLAN_B, PLAN_A)], ids=["A-to-B", "B-to-A"])
def test_resumed_under_another_plan_continues_like_the_original(tmp_path, a, b):
    data = SyntheticData(a, seed=5)
    original = embedding.ShardedEmbeddings(a, 0, 1, seed=11)
    train(original, data, range(3))
    save_checkpoint(tmp_path, 3, a, 0, 1, original.cells())
    train(original, data, range(3, 6))

    resumed = embedding.ShardedEmbeddings(b, 0, 1, seed=99)  # other initial values
    step, cells, _ = load_checkpoint(latest_checkpoint(tmp_path), b, 0)
    assert step == 3
    resumed.load_cells(cells)
    train(resumed, data, range(step, 6))

    want, got = tables_of(original, a), tables_of(resumed, b)
    for name, (w, state) in want.items():
        assert torch.allclose(got[name][0], w, rtol=1e-5, atol=1e-7), name
        for k, s in state.items():
            assert torch.allclose(got[name][1][k], s, rtol=1e-5, atol=1e-7), (name, k)


def _multi_rank_plan(grids, partition, nodes, gpus_per_node):
    plan = plan_of(grids, partition)
    topo = plan.topology.model_copy(update={"nodes": nodes, "gpus_per_node": gpus_per_node})
    world = nodes * gpus_per_node
    shards = [s.model_copy(update={"rank": i % world}) for i, s in enumerate(plan.shards)]
    return plan.model_copy(update={"topology": topo, "shards": shards})


def _rank_train(emb, data, rank, world, steps):
    for step in steps:
        out = emb(data.batch(step, rank, world).sparse)
        g = torch.Generator().manual_seed(step)
        b = data.batch_size // world
        loss = 0
        for k in sorted(out):
            full = torch.randn((data.batch_size, *out[k].shape[1:]), generator=g)
            loss = loss + (out[k] * full[rank * b : (rank + 1) * b]).sum()
        loss.backward()


def _worker(rank, world, plan, root, phase, seed):
    import torch.distributed as dist

    from embark_runtime.checkpoint import finalize_checkpoint

    emb = embedding.ShardedEmbeddings(plan, rank, world, seed=seed)
    data = SyntheticData(plan, seed=5)
    start = 0
    if phase == "resume":
        start, cells, _ = load_checkpoint(root, plan, rank)
        emb.load_cells(cells)
    else:
        _rank_train(emb, data, rank, world, range(3))
        save_checkpoint(root, 3, plan, rank, world, emb.cells(), finalize=False)
        dist.barrier()
        if rank == 0:
            finalize_checkpoint(root, 3, plan, world)
        dist.barrier()
        start = 3
    _rank_train(emb, data, rank, world, range(start, 6))
    return {t.name: (emb.gather_table(t.name), emb.gather_state(t.name)) for t in plan.tables}


@pytest.mark.slow
def test_four_ranks_to_two_ranks_over_gloo_continues_like_the_original(tmp_path):
    from mp_harness import spawn

    a = _multi_rank_plan(
        {"a": ("rb", (2, 2)), "b": ("ub", (3, 1)), "c": ("dp", (1, 1)), "d": ("rb", (1, 2))},
        "mod",
        nodes=2,
        gpus_per_node=2,
    )
    b = _multi_rank_plan(
        {"a": ("ub", (3, 1)), "b": ("rb", (2, 2)), "c": ("rb", (4, 1)), "d": ("dp", (1, 1))},
        "range",
        nodes=1,
        gpus_per_node=2,
    )
    want = spawn(_worker, 4, a, tmp_path, "original", 11)[0]
    got = spawn(_worker, 2, b, tmp_path, "resume", 99)[0]
    for name, (w, state) in want.items():
        assert torch.allclose(got[name][0], w, rtol=1e-5, atol=1e-7), name
        for k, s in state.items():
            assert torch.allclose(got[name][1][k], s, rtol=1e-5, atol=1e-7), (name, k)
