"""Helpers for runtime tests: small plans, random batches, and a multi-process harness.

`spawn(worker, world, *args)` starts `world` gloo processes once (torch.multiprocessing,
meeting through a FileStore in a temporary folder, so no port is picked and raced for
with other jobs), runs `worker(rank, world, *args)` in each and returns the
list of the workers' (picklable) results, re-raising a worker's exception with its
traceback. Tests loop over many configurations inside one spawn to amortise start-up.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass

import numpy as np

from embark_runtime.plan import (
    Cluster,
    Estimate,
    PlanFeature,
    PlannerInfo,
    PlanTable,
    PlanTopology,
    Shard,
    Source,
    validate_rules,
)
from embark_runtime.plan import Plan as PlanModel


def _entry(rank: int, worker, world: int, outdir: str, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.FileStore(os.path.join(outdir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = ("ok", worker(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def spawn(worker, world: int, *args):
    """Run worker(rank, world, *args) on `world` gloo processes; return their results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(worker, world, outdir, args),
            nprocs=world,
            join=False,
            start_method="fork",
        )
        try:
            while not ctx.join():
                pass
        except Exception:
            pass
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results


# --------------------------------------------------------------------------- plans


@dataclass
class TableSpec:
    name: str
    rows: int
    dim: int
    kind: str = "rb"  # dp | rb | ub
    grid: tuple[int, int] = (1, 1)  # (row shards R, column shards C)
    optimizer: str = "sgd"
    communication: str = "flat"
    exchange: str = "dense"
    lr: float = 0.05
    weight_decay: float = 0.0


@dataclass
class FeatureSpec:
    name: str
    table: str
    hotness: float = 2.0
    pooling: str = "sum"
    max_hotness: int | None = 4
    weighted: bool = False


def column_cuts(dim: int, parts: int) -> list[tuple[int, int]]:
    edges = [dim * k // parts for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts)]


def make_plan(
    tables: list[TableSpec],
    features: list[FeatureSpec],
    *,
    nodes: int,
    gpus_per_node: int,
    batch_size: int,
    partition: str = "mod",
    placement_seed: int = 0,
) -> PlanModel:
    """A valid plan: one cluster per (kind, communication/exchange) group of tables (a
    flat ub cluster has no `communication`, a hierarchical one says so), cells placed on
    ranks by a seeded shuffle (so owners differ between tables and cells)."""
    world = nodes * gpus_per_node
    rng = np.random.default_rng(placement_seed)
    shards = []
    groups: dict[tuple[str, str], list[str]] = {}
    for t in tables:
        if t.kind == "dp":
            extra = t.exchange
        elif t.kind == "ub":
            # flat ub clusters keep communication None (the plans of before hierarchical ub)
            extra = "hierarchical" if t.communication == "hierarchical" else ""
        else:
            extra = t.communication
        key = (t.kind, extra)
        groups.setdefault(key, []).append(t.name)
        if t.kind == "dp":
            continue
        r, c = t.grid
        ranks = rng.permutation(max(world, r * c))
        i = 0
        for j in range(r):
            for lo, hi in column_cuts(t.dim, c):
                shards.append(
                    Shard(
                        table=t.name,
                        row_shard=j,
                        row_shards=r,
                        columns=(lo, hi),
                        rank=int(ranks[i] % world),
                    )
                )
                i += 1
    clusters = []
    for n, ((kind, extra), names) in enumerate(sorted(groups.items())):
        kw: dict = {}
        if kind == "rb" or (kind == "ub" and extra):
            kw["communication"] = extra
        if kind == "dp":
            kw["gradient_exchange"] = extra
        clusters.append(Cluster(name=f"{kind}{n}", kind=kind, tables=names, **kw))
    plan = PlanModel(
        source=Source(spec="<test>", sha256="0" * 64),
        topology=PlanTopology(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            hbm_bytes=1 << 40,
            hbm_bandwidth=1e12,
            intra_node_bandwidth=1e11,
            inter_node_bandwidth=1e10,
        ),
        batch_size=batch_size,
        tables=[
            PlanTable(
                name=t.name,
                rows=t.rows,
                dim=t.dim,
                optimizer=t.optimizer,
                optimizer_params={"lr": t.lr, "weight_decay": t.weight_decay, "eps": 1e-6},
            )
            for t in tables
        ],
        features=[
            PlanFeature(
                name=f.name,
                table=f.table,
                hotness=f.hotness,
                pooling=f.pooling,
                access={"kind": "uniform"},
                max_hotness=f.max_hotness,
                fixed=f.pooling == "concat",
                weighted=f.weighted,
            )
            for f in features
        ],
        row_partition=partition,
        clusters=clusters,
        shards=shards,
        estimate=Estimate(step_time=0.0, per_rank=[]),
        planner=PlannerInfo(strategy="test", solver="none", status="greedy"),
    )
    validate_rules(plan)
    return plan


# --------------------------------------------------------------------------- batches


@dataclass
class Bag:
    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None = None


def random_global_batch(plan, step: int, seed: int = 0) -> dict[str, Bag]:
    """Bags of the whole batch: variable lengths (empty bags included) for sum/mean, up to
    the hotness for concat, ids concentrated on a few hot rows half of the time (so that
    dedup and multi-feature accumulation are exercised), weights for weighted features."""
    rng = np.random.default_rng([seed, step])
    out = {}
    for f in plan.features:
        rows = plan.table(f.table).rows
        bmax = f.bag_max
        lo = 1 if f.pooling == "concat" else 0
        lengths = rng.integers(lo, bmax + 1, size=plan.batch_size)
        nnz = int(lengths.sum())
        hot = rng.integers(0, min(rows, 5), size=nnz)
        cold = rng.integers(0, rows, size=nnz)
        ids = np.where(rng.random(nnz) < 0.5, hot, cold).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        weights = rng.uniform(0.5, 1.5, size=nnz).astype(np.float32) if f.weighted else None
        out[f.name] = Bag(ids, offsets, weights)
    return out


def slice_batch(batch: dict[str, Bag], lo: int, hi: int) -> dict[str, Bag]:
    out = {}
    for name, bag in batch.items():
        a, b = int(bag.offsets[lo]), int(bag.offsets[hi])
        out[name] = Bag(
            bag.ids[a:b].copy(),
            (bag.offsets[lo : hi + 1] - a).copy(),
            None if bag.weights is None else bag.weights[a:b].copy(),
        )
    return out
