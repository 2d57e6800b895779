"""The runtime's multi-process exactness cases (imported by test_runtime_exactness.py and
run inside the spawned workers) and an independent count of docs/communication.md."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
from mp_harness import FeatureSpec, TableSpec, make_plan, random_global_batch, slice_batch

from embark_runtime.keys import row_shard_of
from embark_runtime.plan import Shard, validate_rules


@dataclass
class Case:
    name: str
    world: int
    gpus_per_node: int
    tables: list[TableSpec]
    features: list[FeatureSpec]
    batch_size: int = 8
    steps: int = 3
    partition: str = "mod"
    overlap: bool = True
    seed: int = 0
    placement_seed: int = 0
    shards: list[tuple[str, int, int, int, int, int]] | None = None
    """hand-placed cells (table, row shard, row shards, lo, hi, rank) replacing make_plan's"""
    exact: bool = False
    """the exact mode: TorchKernels(float64) against ReferenceEmbeddings(accum=float64)"""

    def plan(self):
        plan = make_plan(
            self.tables,
            self.features,
            nodes=self.world // self.gpus_per_node,
            gpus_per_node=self.gpus_per_node,
            batch_size=self.batch_size,
            partition=self.partition,
            placement_seed=self.placement_seed,
        )
        if self.shards is None:
            return plan
        cells = [
            Shard(table=t, row_shard=j, row_shards=r, columns=(lo, hi), rank=rank)
            for t, j, r, lo, hi, rank in self.shards
        ]
        plan = plan.model_copy(update={"shards": cells})
        validate_rules(plan)
        return plan


def uneven_cases() -> list[Case]:
    """Row shards of one table cut into different column ranges, several cells of a table
    on one rank, on 2 nodes of 2: the hierarchical sums must group exact column ranges.
    Hierarchical ub table `v`: two cells of row shard 0 on one owner (one set of keys),
    row shard 1's column cells on the two nodes at the same local index (each owner
    aggregates for the other), row shard 2's on one node at both local indexes."""
    tables = [
        TableSpec("h", 31, 6, "rb", (2, 2), "adagrad", "hierarchical"),
        TableSpec("u", 23, 5, "ub", (2, 2), "adam"),
        TableSpec("v", 29, 5, "ub", (3, 2), "sgd", "hierarchical", weight_decay=0.01),
    ]
    shards = [
        ("h", 0, 2, 0, 2, 0),
        ("h", 0, 2, 2, 6, 3),
        ("h", 1, 2, 0, 3, 1),
        ("h", 1, 2, 3, 6, 1),
        ("u", 0, 2, 0, 1, 2),
        ("u", 0, 2, 1, 5, 2),
        ("u", 1, 2, 0, 4, 0),
        ("u", 1, 2, 4, 5, 3),
        ("v", 0, 3, 0, 2, 1),
        ("v", 0, 3, 2, 5, 1),
        ("v", 1, 3, 0, 3, 0),
        ("v", 1, 3, 3, 5, 2),
        ("v", 2, 3, 0, 1, 3),
        ("v", 2, 3, 1, 5, 2),
    ]
    feats = three_features("h") + three_features("u") + three_features("v")
    return [
        Case("uneven-mod", 4, 2, tables, feats, shards=shards),
        Case("uneven-range", 4, 2, tables, feats, partition="range", seed=5, shards=shards),
    ]


def three_features(table: str) -> list[FeatureSpec]:
    return [
        FeatureSpec(f"{table}_sum", table, 2.0, "sum", 4),
        FeatureSpec(f"{table}_mean", table, 2.0, "mean", 4, weighted=True),
        FeatureSpec(f"{table}_cat", table, 3.0, "concat", 3),
    ]


def grid_cases() -> list[Case]:
    """Every cluster kind (rb and ub, flat and hierarchical; dp dense and sparse) x pooling
    (sum, weighted mean, concat: three features per table) x grid (R in 1, 2, 4; C in 1, 2)
    x optimizer, on 4 processes (2 nodes of 2) and on 2 processes (2 nodes of 1)."""
    cases = []
    n = 0
    for world, g in ((4, 2), (2, 1)):
        for opt in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            for r in (1, 2, 4):
                for c in (1, 2):
                    if opt == "rowwise_adagrad" and c == 2:
                        continue
                    dims = (6, 5, 4, 3, 4, 5)
                    tables = [
                        TableSpec("rf", 37, dims[0], "rb", (r, c), opt, "flat"),
                        TableSpec("rh", 29, dims[1], "rb", (r, c), opt, "hierarchical"),
                        TableSpec("u", 41, dims[2], "ub", (r, c), opt),
                        TableSpec("uh", 43, dims[5], "ub", (r, c), opt, "hierarchical"),
                        TableSpec("dd", 13, dims[3], "dp", optimizer=opt, exchange="dense"),
                        TableSpec("ds", 17, dims[4], "dp", optimizer=opt, exchange="sparse"),
                    ]
                    feats = [f for t in tables for f in three_features(t.name)]
                    cases.append(
                        Case(
                            name=f"w{world}g{g}-{opt}-R{r}C{c}",
                            world=world,
                            gpus_per_node=g,
                            tables=tables,
                            features=feats,
                            partition="mod" if n % 2 == 0 else "range",
                            overlap=n % 3 != 2,
                            seed=n,
                            placement_seed=n,
                        )
                    )
                    n += 1
    return cases


def overlap_cases() -> list[Case]:
    """The same training with and without prefetching (identical results expected)."""
    base = grid_cases()[4]
    return [
        Case(**{**base.__dict__, "name": f"overlap-{on}", "overlap": on, "steps": 4})
        for on in (True, False)
    ]


def random_cases(count: int, seed: int) -> list[Case]:
    """Random small specs: random tables, kinds, grids, owners, features, poolings,
    optimizers, weight decay, partitions, world 2 or 4 and node sizes; rb and ub tables
    are flat or hierarchical."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        world = int(rng.choice([2, 4]))
        g = int(rng.choice([d for d in (1, 2, 4) if world % d == 0]))
        tables, feats = [], []
        for ti in range(int(rng.integers(1, 4))):
            kind = str(rng.choice(["rb", "ub", "dp"]))
            opt = str(rng.choice(["sgd", "adagrad", "rowwise_adagrad", "adam"]))
            dim = int(rng.integers(1, 7))
            cmax = 1 if opt == "rowwise_adagrad" else min(dim, 3)
            grid = (int(rng.integers(1, 5)), int(rng.integers(1, cmax + 1)))
            name = f"t{ti}"
            tables.append(
                TableSpec(
                    name,
                    int(rng.integers(3, 60)),
                    dim,
                    kind,
                    grid,
                    opt,
                    str(rng.choice(["flat", "hierarchical"])),
                    str(rng.choice(["dense", "sparse"])),
                    lr=float(rng.uniform(0.01, 0.1)),
                    weight_decay=float(rng.choice([0.0, 0.01])),
                )
            )
            for fi in range(int(rng.integers(1, 3))):
                pooling = str(rng.choice(["sum", "mean", "concat"]))
                hot = int(rng.integers(1, 4))
                feats.append(
                    FeatureSpec(
                        f"{name}f{fi}",
                        name,
                        float(hot),
                        pooling,
                        hot,
                        weighted=bool(rng.integers(0, 2)),
                    )
                )
        cases.append(
            Case(
                name=f"random{i}",
                world=world,
                gpus_per_node=g,
                tables=tables,
                features=feats,
                batch_size=world * int(rng.integers(1, 5)),
                steps=2,
                partition=str(rng.choice(["mod", "range"])),
                overlap=bool(rng.integers(0, 2)),
                seed=int(rng.integers(0, 1000)),
                placement_seed=int(rng.integers(0, 1000)),
            )
        )
    return cases


def exact_cases(count: int, seed: int) -> list[Case]:
    """Random small plans in the exact mode, more steps: the adaptive optimizers then
    train the reference's tables bit for bit whatever the grid, kind or world."""
    return [
        Case(**{**c.__dict__, "name": f"exact-{c.name}", "exact": True, "steps": 4})
        for c in random_cases(count, seed)
    ]


def output_weights(plan, step: int, seed: int, dtype=None):
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out = {}
    for f in plan.features:
        dim = plan.table(f.table).dim
        width = dim * (f.bag_max if f.pooling == "concat" else 1)
        out[f.name] = torch.randn(plan.batch_size, width, generator=gen, dtype=dtype)
    return out


def run_case(case: Case, comm) -> dict:
    """Train `case` on `comm` and on the reference; return losses, errors and bytes."""
    import torch

    from embark_runtime.embedding import ReferenceEmbeddings, ShardedEmbeddings
    from embark_runtime.kernels import TorchKernels

    plan = case.plan()
    accum = torch.float64 if case.exact else torch.float32
    emb = ShardedEmbeddings(
        plan,
        comm.rank,
        comm.world,
        comm=comm,
        seed=case.seed,
        overlap=case.overlap,
        kernels=TorchKernels(accum),
    )
    ref = ReferenceEmbeddings(plan, seed=case.seed, accum=accum)
    b = plan.batch_size // comm.world
    lo, hi = comm.rank * b, (comm.rank + 1) * b
    globals_ = [random_global_batch(plan, s, case.seed) for s in range(case.steps)]
    locals_ = [slice_batch(gb, lo, hi) for gb in globals_]
    losses, bytes_ = [], []
    for s in range(case.steps):
        weights = output_weights(plan, s, case.seed, accum)
        out = emb(locals_[s])
        if s + 1 < case.steps:
            emb.prefetch(locals_[s + 1])
        loss = sum((out[k] * w[lo:hi]).sum() for k, w in weights.items())
        loss.backward()
        if case.overlap and any(c.kind == "dp" for c in plan.clusters):
            # the dp exchange is still in flight after the backward: another collective
            # (the trainer's dense all-reduce) runs meanwhile, then it completes
            assert emb._pending
            dummy = torch.ones(7)
            comm.hierarchical_all_reduce(dummy)
            assert torch.equal(dummy, torch.full((7,), float(comm.world)))
        emb.finish_backward()
        assert not emb._pending
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        comm.all_reduce(total)
        rout = ref(globals_[s])
        rloss = sum((rout[k] * w).sum() for k, w in weights.items())
        rloss.backward()
        losses.append((float(total), float(rloss)))
        bytes_.append(emb.bytes_moved())
    errors = {}
    digest = hashlib.sha256()
    for t in plan.tables:
        want = ref.table_weights(t.name)
        got = emb.gather_table(t.name)
        errors[f"{t.name}.weight"] = rel_error(got, want)
        digest.update(got.numpy().tobytes())
        for name, s in emb.gather_state(t.name).items():
            errors[f"{t.name}.{name}"] = rel_error(s, ref.table_state(t.name)[name])
            digest.update(s.numpy().tobytes())
    return {
        "name": case.name,
        "losses": losses,
        "errors": errors,
        "bytes": bytes_,
        "digest": digest.hexdigest(),
    }


def rel_error(got, want) -> float:
    """max |got - want| over max(|want|) (the table's scale), 0 for an all-zero table."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    import torch

    from embark_runtime.comm import Comm

    torch.manual_seed(0)
    comms = {}
    layouts = {(c.world, c.gpus_per_node) for c in cases}
    if world == 4:
        layouts |= set(PROBE_LAYOUTS)
    for key in sorted(layouts):
        comms[key] = Comm.create(key[1], ranks=list(range(key[0])))
    results = []
    for case in cases:
        comm = comms[(case.world, case.gpus_per_node)]
        if comm is not None:
            start = time.perf_counter()
            results.append(run_case(case, comm))
            results[-1]["seconds"] = time.perf_counter() - start
    if (4, 2) in comms:
        results.append(bad_batch_probe(comms[(4, 2)]))
        results.append(init_probe())
    if world == 4:
        results.append(collectives_probe(comms))
    return results


PROBE_LAYOUTS = ((4, 1), (4, 2), (4, 4), (2, 1), (2, 2))
PROBE_SEGMENTS = ([7], [13, 0, 5, 1, 2], [1])


def probe_values(rank: int, elements: int, salt: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(elements, generator=gen)


def collectives_probe(comms: dict) -> dict:
    """The hierarchical all-reduce and the rail all-gather on every layout of
    PROBE_LAYOUTS: each rank's result and its bytes per link."""
    import torch

    from embark_runtime.comm import Traffic

    got: dict = {}
    for world, g in PROBE_LAYOUTS:
        comm = comms[(world, g)]  # created by every process in `worker` (collective)
        if comm is None:
            continue
        for k, segs in enumerate(PROBE_SEGMENTS):
            t = Traffic()
            x = probe_values(comm.rank, sum(segs), k)
            # one segment: also the default (the trainer's dense model reduce)
            pending = comm.hierarchical_all_reduce(
                x,
                traffic=t,
                cluster="c",
                segments=segs if k == 1 else None,
                async_op=k % 2 == 0,
            )
            if k % 2 == 0:
                pending.wait()
            got[("allreduce", world, g, k)] = (x.tolist(), t.as_dict())
        t = Traffic()
        mine = torch.arange(comm.rank + 2, dtype=torch.int64) * 10 + comm.rank
        out = comm.rail_all_gather(mine, traffic=t, cluster="c")
        got[("allgather", world, g)] = ([o.tolist() for o in out], t.as_dict())
    return {"name": "collectives", "got": got}


def init_probe() -> dict:
    """init_distributed joins the running group and builds the plan's nodes and rails; a
    plan for another world size is refused with a message."""
    from embark_runtime.comm import CommError, init_distributed

    case = grid_cases()[0]
    comm = init_distributed(case.plan())
    layout = (comm.rank, comm.world, comm.nodes, comm.peers("node"), comm.peers("rail"))
    two = next(c for c in grid_cases() if c.world == 2).plan()
    try:
        init_distributed(two)
        refused = None
    except CommError as e:
        refused = str(e)
    return {"name": "init", "layout": layout, "refused": refused}


def bad_batch_probe(comm) -> dict:
    """Rank 1 feeds an id outside its table: every rank must raise, none may hang."""
    from embark_runtime.distributor import BatchError
    from embark_runtime.embedding import ShardedEmbeddings

    case = grid_cases()[0]
    plan = case.plan()
    emb = ShardedEmbeddings(plan, comm.rank, comm.world, comm=comm)
    b = plan.batch_size // comm.world
    local = slice_batch(random_global_batch(plan, 0), comm.rank * b, (comm.rank + 1) * b)
    if comm.rank == 1:
        local["rf_cat"].ids[0] = 10**6
    try:
        emb(local)
    except BatchError as e:
        return {"name": "bad-batch", "raised": str(e)}
    return {"name": "bad-batch", "raised": None}


# --------------------------------------------------------------------------- the doc's count


def doc_bytes(plan, gb, world: int) -> list[dict[str, dict[str, int]]]:
    """Bytes every rank sends in one step, per cluster, computed from docs/communication.md
    alone (independently of the runtime)."""
    g = plan.topology.gpus_per_node
    b = plan.batch_size // world
    node = [r // g for r in range(world)]
    out: list[dict[str, dict[str, int]]] = [
        {c.name: {"intra": 0, "inter": 0} for c in plan.clusters} for _ in range(world)
    ]

    def add(src: int, dst: int, cluster: str, n: int) -> None:
        if src != dst and n:
            out[src][cluster]["intra" if node[src] == node[dst] else "inter"] += int(n)

    for c in plan.clusters:
        for tname in c.tables:
            t = plan.table(tname)
            feats = [f for f in plan.features if f.table == tname]
            f_units = sum(f.bag_max if f.pooling == "concat" else 1 for f in feats)
            if c.kind == "dp":
                if (c.gradient_exchange or "dense") == "dense":
                    for a, dst, n in hierarchical_allreduce_messages(t.rows * t.dim, world, g):
                        add(a, dst, c.name, n)
                else:
                    msg = []
                    for a in range(world):
                        ids = np.concatenate(
                            [slice_ids(gb[f.name], a * b, (a + 1) * b) for f in feats]
                        )
                        msg.append(len(np.unique(ids)) * (8 + 4 * t.dim))
                    for a, dst, n in rail_allgather_messages(msg, g):
                        add(a, dst, c.name, n)
                continue
            cells = plan.shards_of(tname)
            r_shards = cells[0].row_shards
            if c.kind == "ub" and c.communication == "hierarchical" and len(set(node)) > 1:
                for src, dst, n in hierarchical_ub_messages(plan, gb, tname, world, g):
                    add(src, dst, c.name, n)
                continue
            for a in range(world):
                per_f = [(f, slice_ids(gb[f.name], a * b, (a + 1) * b)) for f in feats]
                for j in range(r_shards):
                    owners = sorted({s.rank for s in cells if s.row_shard == j})
                    in_j = [
                        (f, ids[row_shard_of(ids, t.rows, r_shards, plan.row_partition) == j])
                        for f, ids in per_f
                    ]
                    if c.kind == "rb":
                        n = sum(
                            8 * len(ids) + 4 * b + (4 * len(ids) if f.weighted else 0)
                            for f, ids in in_j
                        )
                    else:
                        n = 8 * len(np.unique(np.concatenate([ids for _, ids in in_j])))
                    for o in owners:
                        add(a, o, c.name, n)
                for s in cells:
                    o, w = s.rank, s.width
                    if c.kind == "ub":
                        ids = np.concatenate([ids for _, ids in per_f])
                        u = len(
                            np.unique(
                                ids[
                                    row_shard_of(ids, t.rows, r_shards, plan.row_partition)
                                    == s.row_shard
                                ]
                            )
                        )
                        add(o, a, c.name, u * 4 * w)
                        add(a, o, c.name, u * 4 * w)
                        continue
                    vec = b * f_units * 4 * w
                    if c.communication == "hierarchical" and node[a] != node[o]:
                        p = node[o] * g + a % g
                        add(o, p, c.name, vec)
                        add(p, o, c.name, vec)
                    else:
                        add(o, a, c.name, vec)
                        add(a, o, c.name, vec)
            if c.kind == "rb" and c.communication == "hierarchical":
                for a in range(world):
                    for n in set(node):
                        if n == node[a]:
                            continue
                        p = n * g + a % g
                        # one vector per (sample, feature) over the union of the node's columns
                        covered = {k for s in cells if node[s.rank] == n for k in range(*s.columns)}
                        add(p, a, c.name, b * f_units * 4 * len(covered))
                        add(a, p, c.name, b * f_units * 4 * len(covered))
    return out


def hierarchical_ub_messages(plan, gb, table: str, world: int, g: int):
    """(src, dst, bytes) of docs/communication.md's hierarchical ub for one table: keys,
    forward vectors and backward gradients, read literally from the doc."""
    t = plan.table(table)
    b = plan.batch_size // world
    feats = [f for f in plan.features if f.table == table]
    cells = plan.shards_of(table)
    r_shards = cells[0].row_shards

    def distinct(ranks: list[int], j: int) -> int:
        """U: the distinct ids of row shard j over the local samples of `ranks`."""
        ids = np.concatenate(
            [slice_ids(gb[f.name], a * b, (a + 1) * b) for a in ranks for f in feats]
        )
        ids = ids[row_shard_of(ids, t.rows, r_shards, plan.row_partition) == j]
        return len(np.unique(ids))

    out = []
    for j in range(r_shards):
        for o in sorted({s.rank for s in cells if s.row_shard == j}):
            m, local = divmod(o, g)
            widths = [s.width for s in cells if s.row_shard == j and s.rank == o]
            for n in range(world // g):
                members = list(range(n * g, (n + 1) * g))
                if n == m:  # o's own node: flat ub
                    for a in members:
                        u = distinct([a], j)
                        out.append((a, o, 8 * u))
                        for w in widths:
                            out.append((o, a, 4 * w * u))
                            out.append((a, o, 4 * w * u))
                    continue
                p = n * g + local  # the aggregator
                union = distinct(members, j)
                out.append((p, o, 8 * union))  # 1. keys, network
                for w in widths:
                    out.append((o, p, 4 * w * union))  # 2. forward, network
                    out.append((p, o, 4 * w * union))  # 3. backward, network
                for a in members:
                    u = distinct([a], j)
                    out.append((a, p, 8 * u))  # 1. keys, NVLink
                    for w in widths:
                        out.append((p, a, 4 * w * u))  # 2. forward, NVLink
                        out.append((a, p, 4 * w * u))  # 3. backward, NVLink
    return out


def hierarchical_allreduce_messages(elements: int, world: int, g: int):
    """(src, dst, bytes) of docs/communication.md's hierarchical all-reduce of `elements`
    fp32 values on `world` ranks, `g` per node, read literally."""
    nodes = world // g
    chunks = [len(c) for c in np.array_split(np.arange(elements), g)]
    out = []
    for a in range(world):
        n, i = divmod(a, g)
        for j in range(g):  # 1. reduce-scatter in the node
            out.append((a, n * g + j, 4 * chunks[j]))
        if nodes > 1:  # 2. ring over the nodes on rail i
            parts = [len(p) for p in np.array_split(np.arange(chunks[i]), nodes)]
            succ = ((n + 1) % nodes) * g + i
            rs = sum(parts[p] for p in range(nodes) if p != (n + 1) % nodes)
            ag = sum(parts[p] for p in range(nodes) if p != (n + 2) % nodes)
            out.append((a, succ, 4 * (rs + ag)))
        for j in range(g):  # 3. all-gather in the node
            out.append((a, n * g + j, 4 * chunks[i]))
    return out


def rail_allgather_messages(msg: list[int], g: int):
    """(src, dst, bytes) of the doc's rail all-gather of message msg[a] from every rank a."""
    world = len(msg)
    out = []
    for a in range(world):
        n, i = divmod(a, g)
        rail = [m * g + i for m in range(world // g)]
        for p in rail:  # 1. across nodes
            out.append((a, p, msg[a]))
        for j in range(g):  # 2. in the node, everything the rank holds
            out.append((a, n * g + j, sum(msg[p] for p in rail)))
    return out


def slice_ids(bag, lo: int, hi: int) -> np.ndarray:
    return np.asarray(bag.ids[int(bag.offsets[lo]) : int(bag.offsets[hi])])


def local_batches(plan, case: Case, world: int):
    gb = [random_global_batch(plan, s, case.seed) for s in range(case.steps)]
    b = plan.batch_size // world
    return gb, [[slice_batch(x, r * b, (r + 1) * b) for r in range(world)] for x in gb]
