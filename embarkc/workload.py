"""Programs built in Python: the paper's workloads and generated specs for benchmarks.

`program_from_workload` turns one of `shared/workloads/*.json` (the EMBark paper's
DLRM-DCNv2, T180, T200 and T510 table groups, as HugeCTR's benchmark configs list them)
into an IR `Program` on a named hardware preset; `generated_program` builds a large random
but reproducible spec for the planner's scale benchmark. Both produce Programs whose
nodes carry no source spans (they were not parsed from a file).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from embarkc.diagnostics import EmbarkError
from embarkc.ir import (
    Access,
    DenseModel,
    Feature,
    Interaction,
    Optimizer,
    PlanOptions,
    Program,
    Source,
    Table,
    Topology,
)
from embarkc.presets import PRESETS


def topology(nodes: int, gpus_per_node: int, preset: str = "dgx_h100") -> Topology:
    """A `Topology` of `nodes` x `gpus_per_node` GPUs with a preset's hardware numbers."""
    if preset not in PRESETS:
        raise EmbarkError.at(
            "<workload>",
            f"unknown hardware preset `{preset}`",
            hint=f"known presets: {', '.join(sorted(PRESETS))}",
        )
    hw = {k: v for k, v in PRESETS[preset].items() if k not in ("nodes", "gpus_per_node")}
    return Topology(nodes=nodes, gpus_per_node=gpus_per_node, preset=preset, **hw)  # type: ignore[arg-type]


def program_from_workload(
    path_or_dict: str | Path | dict[str, Any],
    nodes: int = 16,
    gpus_per_node: int = 8,
    preset: str = "dgx_h100",
    options: PlanOptions | None = None,
) -> Program:
    """The IR of a workload description (`shared/workloads/*.json`).

    Every group of the workload becomes `tables` tables `t<i>` read by one feature `f<i>`
    each, with the workload's dtype, optimizer, pooling and access distribution; the
    hotness is fixed (multi-hot bags of exactly `hotness` ids). The source is the JSON
    file (or the canonical JSON text of the dict) with its sha256.
    """
    if isinstance(path_or_dict, dict):
        data = path_or_dict
        text = json.dumps(data, sort_keys=True)
        src = f"<workload {data.get('name', '?')}>"
    else:
        p = Path(path_or_dict)
        try:
            text = p.read_text()
        except OSError as e:
            raise EmbarkError.at(str(p), f"cannot read workload ({e.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EmbarkError.at(str(p), f"not valid JSON ({e})") from None
        src = str(p)
    if not isinstance(data, dict):
        raise EmbarkError.at(src, "malformed workload: a workload is a JSON object")
    try:
        acc = data.get("access", {"kind": "uniform"})
        access = Access(**acc)
        opt = Optimizer(kind=data.get("optimizer", "sgd"))
        tables: list[Table] = []
        features: list[Feature] = []
        for g in data["groups"]:
            for _ in range(int(g["tables"])):
                i = len(tables)
                h = int(g["hotness"])
                tables.append(
                    Table(
                        name=f"t{i}",
                        rows=int(g["rows"]),
                        dim=int(g["dim"]),
                        dtype=data.get("dtype", "fp32"),
                        optimizer=opt,
                    )
                )
                features.append(
                    Feature(
                        name=f"f{i}",
                        table=f"t{i}",
                        hotness=h,
                        max_hotness=h,
                        fixed=True,
                        pooling=data.get("pooling", "sum"),
                        access=access,
                    )
                )
        inter = data.get("interaction", {})
        model = DenseModel(
            batch_size=int(data["batch_size"]),
            dense_features=int(data.get("dense_features", 0)),
            bottom_mlp=tuple(data.get("bottom_mlp", ())),
            interaction=Interaction(**inter) if inter else Interaction(),
            top_mlp=tuple(data.get("top_mlp", (1,))),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise EmbarkError.at(src, f"malformed workload: {e}") from None
    return Program(
        name=str(data.get("name", "workload")),
        sources=(Source(path=src, sha256=hashlib.sha256(text.encode()).hexdigest()),),
        topology=topology(nodes, gpus_per_node, preset),
        tables=tuple(tables),
        features=tuple(features),
        model=model,
        options=options or PlanOptions(),
    )


def generated_program(
    tables: int = 5000,
    nodes: int = 128,
    gpus_per_node: int = 8,
    seed: int = 0,
    preset: str = "dgx_h100",
    options: PlanOptions | None = None,
) -> Program:
    """A reproducible random spec of `tables` tables for scale benchmarks.

    Rows are log-uniform in [1e3, 2e7], dims in {16, 32, 64, 128}, hotness log-uniform in
    [1, 100], zipf(1.05..1.2) permuted access, sgd or adagrad; global batch 65536.
    `generated_spec` writes it as spec text (for the plan command).
    """
    rng = random.Random(seed)
    ts: list[Table] = []
    fs: list[Feature] = []
    for i in range(tables):
        rows = int(10 ** rng.uniform(3, 7.3))
        dim = rng.choice((16, 32, 64, 128))
        h = max(1, int(round(10 ** rng.uniform(0, 2))))
        ts.append(
            Table(
                name=f"t{i}",
                rows=rows,
                dim=dim,
                optimizer=Optimizer(kind=rng.choice(("sgd", "adagrad"))),
            )
        )
        fs.append(
            Feature(
                name=f"f{i}",
                table=f"t{i}",
                hotness=h,
                max_hotness=h,
                access=Access(kind="zipf", alpha=round(rng.uniform(1.05, 1.2), 3), permuted=True),
            )
        )
    text = f"generated tables={tables} nodes={nodes} gpus_per_node={gpus_per_node} seed={seed}"
    return Program(
        name=f"generated{tables}",
        sources=(Source(path="<generated>", sha256=hashlib.sha256(text.encode()).hexdigest()),),
        topology=topology(nodes, gpus_per_node, preset),
        tables=tuple(ts),
        features=tuple(fs),
        model=DenseModel(batch_size=65536, dense_features=13, bottom_mlp=(512, 256, 128)),
        options=options or PlanOptions(),
    )


def generated_spec(program: Program) -> str:
    """A program of `generated_program` as spec text: the same tables, features (named
    after their tables), hardware and dense model."""
    topo, m = program.topology, program.model
    lines = [
        f"# {program.name}: a scale benchmark (embarkc.workload.generated_program)",
        f"hardware {{ preset {topo.preset} nodes {topo.nodes} "
        f"gpus_per_node {topo.gpus_per_node} }}",
        f"model {{ batch {m.batch_size} dense_features {m.dense_features} "
        f"bottom_mlp [{', '.join(map(str, m.bottom_mlp))}] }}",
    ]
    for t, f in zip(program.tables, program.features, strict=True):
        lines.append(
            f"table {t.name} {{ rows {t.rows} dim {t.dim} hotness {f.max_hotness} "
            f"optimizer {t.optimizer.kind} access zipf({f.access.alpha}) }}"
        )
    return "\n".join(lines) + "\n"
