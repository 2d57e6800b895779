"""Export an embarkc plan in the sharding formats of TorchRec and HugeCTR.

`export_plan(plan, fmt)` takes a plan file's document (the dict `json.load` gives) and
returns the other system's document and the warnings of the translation. It refuses (an
`EmbarkError` naming each table and what to change) what the other system cannot run, and
maps with a warning what it runs differently but equivalently. `embarkc plan --target
torchrec|hugectr` plans within what each system can run (embarkc.interop.targets), so that
such plans export without refusal.

TorchRec (format `torchrec-sharding-plan`): one ParameterSharding-like record per table,

    dp                                   -> data_parallel   (kernel dense, every rank)
    one cell                             -> table_wise
    column cuts, one row shard           -> column_wise (table_column_wise: all on one node
                                            of several)
    R = world row shards, full width     -> row_wise        (row shard j on rank j)
    R = gpus_per_node, one node          -> table_row_wise  (row shard j on local rank j)
    column cuts x R = gpus_per_node rows -> grid_shard      (each column block on one node)

with explicit shard offsets and sizes. TorchRec cuts rows into contiguous blocks of
ceil(rows / R) (its bucketization, sharding/rw_sharding.py), which is embarkc's `range`
partition; a `mod` partition with row shards is refused. TorchRec puts row shard j on the
j-th rank of the row-wise group: a plan that permutes the blocks over the same ranks is
exported with the blocks renumbered (a warning names the table; memory and work per rank
are those of the same equal-sized blocks). ub clusters (TorchRec has no unique-based
exchange) and hierarchical rb are exported as TorchRec's exchange of the same layout, with
a warning. `embarkc.interop.torchrec_plan.to_sharding_plan` turns the document into a
`torchrec.distributed.types.ShardingPlan`.

HugeCTR (format `hugectr-embedding-collection`): the `shard_matrix` (per GPU, the tables
it holds) and the `shard_strategy` list (`dp` or `mp` with its tables) that
`hugectr.EmbeddingCollectionConfig.shard` takes, and the communication strategy. HugeCTR
row-shards a table over the GPUs that hold it by `key mod n` (n GPUs, key residue j on the
j-th of them in rank order), which is embarkc's `mod` partition; it has no column shards.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

from embarkc.diagnostics import EmbarkError

FORMATS = ("torchrec", "hugectr")
TORCHREC_FORMAT = "torchrec-sharding-plan"
HUGECTR_FORMAT = "hugectr-embedding-collection"
DOCUMENT_VERSION = 1

TORCHREC_DATA_TYPE = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16"}
"""embarkc dtype -> torchrec.types.DataType name."""

WHERE = "<plan>"


def export_plan(plan: dict[str, Any], fmt: str) -> tuple[dict[str, Any], list[str]]:
    """The plan `plan` (a plan file's JSON document) in format `fmt` ("torchrec" or
    "hugectr"), and the warnings of the translation (each names its table).

    Raises EmbarkError when the plan is not a valid plan or when the other system cannot
    run it (every table at fault is named, with what to change)."""
    if fmt not in FORMATS:
        raise EmbarkError.at(
            WHERE,
            f"unknown export format `{fmt}`",
            hint="the formats are " + ", ".join(f"`{f}`" for f in FORMATS),
        )
    parsed = _parse(plan)
    if fmt == "torchrec":
        return _torchrec(parsed)
    return _hugectr(parsed)


def _parse(plan: dict[str, Any]) -> Any:
    """The plan as `embark_runtime.plan.Plan`, held to the plan-v1 contract."""
    from embark_runtime.plan import PlanError, parse_plan

    if not isinstance(plan, dict):
        raise EmbarkError.at(WHERE, f"a plan is a JSON object, got {type(plan).__name__}")
    source = plan.get("source")
    where = source.get("spec", WHERE) if isinstance(source, dict) else WHERE
    try:
        text = json.dumps(plan, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise EmbarkError.at(str(where), f"not a plan document: {e}") from None
    try:
        return parse_plan(text)
    except PlanError as e:
        raise EmbarkError.at(e.path, f"invalid plan ({e.rule}): {e.message}") from None


# --------------------------------------------------------------------------- shared


class _Table:
    """One table's cells as the exporters see them."""

    def __init__(self, name: str, rows: int, dim: int, shards: list[Any]) -> None:
        self.name = name
        self.rows = rows
        self.dim = dim
        self.row_shards = shards[0].row_shards if shards else 1
        self.cuts = sorted({tuple(s.columns) for s in shards})
        # rank of (row shard, column cut)
        self.rank: dict[tuple[int, tuple[int, int]], int] = {
            (s.row_shard, tuple(s.columns)): s.rank for s in shards
        }

    def is_grid(self) -> bool:
        """Every row shard cut at the same columns (a grid of row shards x column blocks)."""
        return len(self.rank) == self.row_shards * len(self.cuts)

    def range_rows(self, j: int) -> tuple[int, int]:
        """Offset and count of row shard j in a range partition (blocks of ceil(rows/R))."""
        block = -(-self.rows // self.row_shards)
        lo = min(self.rows, j * block)
        return lo, min(self.rows, lo + block) - lo


def _tables(plan: Any) -> dict[str, _Table]:
    by_table: dict[str, list[Any]] = defaultdict(list)
    for s in plan.shards:
        by_table[s.table].append(s)
    return {t.name: _Table(t.name, t.rows, t.dim, by_table.get(t.name, [])) for t in plan.tables}


def _refuse(problems: list[str], system: str, hint: str) -> None:
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more tables" if len(problems) > 20 else ""
        raise EmbarkError.at(
            WHERE,
            f"{system} cannot run this plan:\n  " + "\n  ".join(shown) + more,
            hint=hint,
        )


# --------------------------------------------------------------------------- torchrec


def _torchrec(plan: Any) -> tuple[dict[str, Any], list[str]]:
    topo = plan.topology
    world, local = topo.nodes * topo.gpus_per_node, topo.gpus_per_node
    tables = _tables(plan)
    cluster_of = {t: c for c in plan.clusters for t in c.tables}
    warnings: list[str] = []
    problems: list[str] = []
    records: dict[str, Any] = {}
    for t in plan.tables:
        c = cluster_of[t.name]
        if c.kind == "dp":
            records[t.name] = {
                "sharding_type": "data_parallel",
                "compute_kernel": "dense",
                "ranks": list(range(world)),
                "shards": None,
            }
            continue
        try:
            records[t.name] = _torchrec_sharded(
                tables[t.name], world, local, plan.row_partition, warnings
            )
        except _Inexpressible as e:
            problems.append(f"table `{t.name}`: {e}")
            continue
        if c.kind == "ub":
            warnings.append(
                f"table `{t.name}`: TorchRec has no unique-based (ub) exchange; exported as "
                f"{records[t.name]['sharding_type']}, which sends one pooled vector per "
                "sample and feature instead of one vector per distinct id"
            )
        elif c.communication == "hierarchical":
            warnings.append(
                f"table `{t.name}`: hierarchical rb exported as TorchRec's "
                f"{records[t.name]['sharding_type']} exchange of the same cells"
            )
    _refuse(
        problems,
        "TorchRec",
        "re-plan with `embarkc plan SPEC --target torchrec` (it plans only what TorchRec "
        "runs), or constrain these tables in the spec's plan block",
    )
    features: dict[str, list[Any]] = defaultdict(list)
    for f in plan.features:
        features[f.table].append(f)
    configs = []
    for t in plan.tables:
        fs = features[t.name]
        poolings = sorted({f.pooling for f in fs})
        pooling = "MEAN" if poolings == ["mean"] else "SUM"
        if "concat" in poolings or len(poolings) > 1:
            warnings.append(
                f"table `{t.name}`: its features pool by {', '.join(poolings)}; an "
                f"EmbeddingBagConfig has one pooling, written as {pooling} (concat features "
                "need TorchRec's EmbeddingCollection)"
            )
        config: dict[str, Any] = {
            "name": t.name,
            "num_embeddings": t.rows,
            "embedding_dim": t.dim,
            "feature_names": [f.name for f in fs],
            "pooling": pooling,
            "data_type": TORCHREC_DATA_TYPE[t.dtype],
            "optimizer": t.optimizer,
            "optimizer_params": t.optimizer_params.model_dump(exclude_none=True),
        }
        if t.init.kind == "uniform":
            config["weight_init_min"] = t.init.low
            config["weight_init_max"] = t.init.high
        configs.append(config)
    doc = {
        "format": TORCHREC_FORMAT,
        "version": DOCUMENT_VERSION,
        "source": {"spec": plan.source.spec, "sha256": plan.source.sha256},
        "world_size": world,
        "local_world_size": local,
        "batch_size": plan.batch_size,
        "tables": configs,
        "plan": records,
    }
    return doc, warnings


class _Inexpressible(Exception):
    """A table layout the other system has no sharding type for (the message says why)."""


def _torchrec_sharded(
    t: _Table, world: int, local: int, partition: str, warnings: list[str]
) -> dict[str, Any]:
    if not t.is_grid():
        raise _Inexpressible(
            "its row shards are cut at different columns; TorchRec cuts every row shard at "
            "the same columns"
        )
    R, cuts = t.row_shards, t.cuts
    if R > 1 and partition != "range":
        raise _Inexpressible(
            f"{R} row shards in the `mod` partition; TorchRec's row shards are contiguous "
            "blocks (`row_partition range` in the spec's plan block)"
        )
    cells: list[tuple[int, tuple[int, int], int]] = []  # (row shard, cut, rank)
    if R == 1:
        ranks = [t.rank[(0, c)] for c in cuts]
        nodes = {r // local for r in ranks}
        if len(cuts) == 1:
            kind = "table_wise"
        elif len(nodes) == 1 and world > local:
            kind = "table_column_wise"
        else:
            kind = "column_wise"
        cells = [(0, c, r) for c, r in zip(cuts, ranks, strict=True)]
    elif len(cuts) == 1 and R == world:
        kind = "row_wise"
        cells = _in_order(t, cuts[0], list(range(world)), warnings)
    elif R == local and world > local:
        kind = "table_row_wise" if len(cuts) == 1 else "grid_shard"
        for c in cuts:
            node_ranks = {t.rank[(j, c)] // local for j in range(R)}
            if len(node_ranks) != 1:
                raise _Inexpressible(
                    f"the {R} row shards of columns {c[0]}..{c[1]} span several nodes; "
                    f"TorchRec's {kind} keeps them on the {local} GPUs of one node"
                )
            node = node_ranks.pop()
            cells += _in_order(t, c, list(range(node * local, (node + 1) * local)), warnings)
    else:
        shape = f"{R} row shards" + (f" x {len(cuts)} column shards" if len(cuts) > 1 else "")
        raise _Inexpressible(
            f"{shape}; TorchRec row-shards a table over all {world} ranks (row_wise, full "
            f"width) or over the {local} GPUs of one node (table_row_wise, grid_shard)"
        )
    shards = []
    for j, (c0, c1), r in cells:
        r0, n = t.range_rows(j) if R > 1 else (0, t.rows)
        shards.append({"shard_offsets": [r0, c0], "shard_sizes": [n, c1 - c0], "rank": r})
    return {
        "sharding_type": kind,
        "compute_kernel": "fused",
        "ranks": [s["rank"] for s in shards],
        "shards": shards,
    }


def _in_order(
    t: _Table, cut: tuple[int, int], group: list[int], warnings: list[str]
) -> list[tuple[int, tuple[int, int], int]]:
    """The row shards of column block `cut` on `group` with row shard j on group[j], as
    TorchRec places them; a permutation of them over the group is renumbered (a warning)."""
    held = [t.rank[(j, cut)] for j in range(t.row_shards)]
    if sorted(held) != group:
        raise _Inexpressible(
            f"its {t.row_shards} row shards are on ranks {sorted(held)}; TorchRec needs one "
            f"on each of ranks {group[0]}..{group[-1]}"
        )
    if held != group:
        warnings.append(
            f"table `{t.name}`: row blocks renumbered to TorchRec's order (row shard j on "
            f"rank {group[0]} + j); each rank still holds one block of "
            f"{-(-t.rows // t.row_shards)} rows"
        )
    return [(j, cut, group[j]) for j in range(t.row_shards)]


# --------------------------------------------------------------------------- hugectr


def _hugectr(plan: Any) -> tuple[dict[str, Any], list[str]]:
    topo = plan.topology
    world = topo.nodes * topo.gpus_per_node
    tables = _tables(plan)
    warnings: list[str] = []
    problems: list[str] = []
    matrix: list[list[str]] = [[] for _ in range(world)]
    dp: list[str] = []
    mp: list[str] = []
    hierarchical = set()
    for c in plan.clusters:
        if c.kind == "dp":
            dp.extend(c.tables)
            continue
        if c.communication == "hierarchical":
            hierarchical.add(c.name)
        for name in c.tables:
            t = tables[name]
            if len(t.cuts) > 1:
                problems.append(
                    f"table `{name}`: {len(t.cuts)} column shards; HugeCTR's embedding "
                    "collection does not cut columns (`no_column_split`)"
                )
                continue
            ranks = [t.rank[(j, t.cuts[0])] for j in range(t.row_shards)]
            if len(set(ranks)) != len(ranks):
                problems.append(
                    f"table `{name}`: several row shards on one GPU ({ranks}); HugeCTR holds "
                    "one shard of a table per GPU"
                )
                continue
            if t.row_shards > 1 and plan.row_partition != "mod":
                problems.append(
                    f"table `{name}`: {t.row_shards} row shards in the `range` partition; "
                    "HugeCTR row-shards by key mod the number of GPUs (`row_partition mod`)"
                )
                continue
            if ranks != sorted(ranks):
                warnings.append(
                    f"table `{name}`: key residues renumbered to HugeCTR's order (residue j "
                    "on the j-th of its GPUs in rank order); each GPU keeps one residue class"
                )
            mp.append(name)
            for r in ranks:
                matrix[r].append(name)
    _refuse(
        problems,
        "HugeCTR",
        "re-plan with `embarkc plan SPEC --target hugectr` (it plans only what HugeCTR "
        "runs), or constrain these tables in the spec's plan block",
    )
    for name in dp:
        for r in range(world):
            matrix[r].append(name)
    order = {t.name: i for i, t in enumerate(plan.tables)}
    matrix = [sorted(m, key=order.__getitem__) for m in matrix]
    mp_clusters = [c for c in plan.clusters if c.kind != "dp"]
    comm = "Hierarchical" if hierarchical else "Uniform"
    if hierarchical and len(hierarchical) != len(mp_clusters):
        warnings.append(
            "HugeCTR has one communication strategy for the whole collection: Hierarchical "
            f"(the plan's flat clusters {', '.join(sorted({c.name for c in mp_clusters} - hierarchical))} "
            "too)"
        )
    features: dict[str, list[Any]] = defaultdict(list)
    for f in plan.features:
        features[f.table].append(f)
    configs = []
    for t in plan.tables:
        fs = features[t.name]
        poolings = sorted({f.pooling for f in fs})
        combiner = {"sum": "sum", "mean": "mean", "concat": "concat"}[poolings[0]] if fs else "sum"
        if len(poolings) > 1:
            warnings.append(
                f"table `{t.name}`: features pool by {', '.join(poolings)}; HugeCTR's lookup "
                "has its own combiner per feature (each is listed)"
            )
        configs.append(
            {
                "table_name": t.name,
                "max_vocabulary_size": t.rows,
                "ev_size": t.dim,
                "optimizer": t.optimizer,
                "lookups": [
                    {
                        "name": f.name,
                        "combiner": f.pooling,
                        "max_hotness": f.max_hotness or math.ceil(f.hotness),
                    }
                    for f in fs
                ],
                "combiner": combiner,
            }
        )
    strategy: list[list[Any]] = []
    if mp:
        strategy.append(["mp", sorted(mp, key=order.__getitem__)])
    if dp:
        strategy.append(["dp", sorted(dp, key=order.__getitem__)])
    doc = {
        "format": HUGECTR_FORMAT,
        "version": DOCUMENT_VERSION,
        "source": {"spec": plan.source.spec, "sha256": plan.source.sha256},
        "num_gpus": world,
        "num_nodes": topo.nodes,
        "batch_size": plan.batch_size,
        "tables": configs,
        "shard_matrix": matrix,
        "shard_strategy": strategy,
        "comm_strategy": comm,
    }
    return doc, warnings
