"""Small random but valid .embark specs, for end-to-end fuzzing of plan -> compile -> train.

`random_spec(seed)` returns the text of a spec small enough to train on a few CPU
processes: 2 to 8 tables (some with fewer rows than GPUs, rows not divisible by the shard
count, dims that are and are not multiples of 4, every dtype and optimizer), features with
one-hot and multi-hot, fixed and variable bags, every pooling, weighted ids and tables
read by several features; a topology of 1x2, 1x4 or 2x2 (nodes x GPUs); pins and
constraints that ask for each cluster kind (dp, rb, ub), flat or hierarchical
communication, row and column splits, `within_node` and `colocate`; sometimes an HBM so
small that tables must split. Every choice comes from `random.Random(seed)`, so a seed
names its spec forever.
"""

from __future__ import annotations

import random
from typing import get_args

from embarkc.ir import STRATEGIES, OptimizerKind

TOPOLOGIES = ((1, 2), (1, 4), (2, 2))
OPTIMIZERS = get_args(OptimizerKind)
STATE_PER_ROW = {"sgd": lambda d: 0, "adagrad": lambda d: d, "rowwise_adagrad": lambda d: 1}
STATE_PER_ROW["adam"] = lambda d: 2 * d + 1
ROW_CHOICES = (1, 2, 3, 5, 7, 10, 33, 100, 257, 1000, 3001)
DIM_CHOICES = (1, 3, 4, 6, 8, 12, 16, 20, 24, 32)


def _optimizer(rng: random.Random, kind: str) -> str:
    lr = rng.choice(("0.01", "0.05", "0.1"))
    params = [f"lr {lr}"]
    if kind != "sgd" and rng.random() < 0.3:
        params.append("eps 1e-6")
    if kind in ("adagrad", "rowwise_adagrad") and rng.random() < 0.3:
        params.append("initial_accumulator 0.1")
    if kind == "adam" and rng.random() < 0.4:
        params.append("beta1 0.8 beta2 0.99")
    if rng.random() < 0.2:
        params.append("weight_decay 0.01")
    return f"optimizer {kind} {{ {' '.join(params)} }}"


def _feature_fields(rng: random.Random) -> tuple[list[str], bool]:
    """Feature fields (hotness, pooling, weighted, access) and whether the hotness is fixed."""
    fields = []
    fixed = rng.random() < 0.6
    if fixed:
        fields.append(f"hotness {rng.choice((1, 1, 2, 3, 5))}")
    else:
        top = rng.choice((2, 4, 7))
        mean = rng.choice(("1", "1.5", str(top)))
        if float(mean) > top:
            mean = str(top)
        fields.append(f"hotness mean {mean} max {top}")
    pooling = rng.choice(("sum", "sum", "mean", "concat") if fixed else ("sum", "mean"))
    fields.append(f"pooling {pooling}")
    if rng.random() < 0.25:
        fields.append("weighted")
    fields.append(rng.choice(("access uniform", "access zipf(1.2)", "access zipf(1.05, sorted)")))
    return fields, fixed


def random_spec(seed: int) -> str:
    """The text of a valid random spec (see the module docstring)."""
    rng = random.Random(seed)
    nodes, gpus = rng.choice(TOPOLOGIES)
    world = nodes * gpus
    n_tables = rng.randint(2, 8)
    lines = [f"# random spec, seed {seed}: {nodes}x{gpus}"]
    tables = []
    for i in range(n_tables):
        rows = rng.choice(ROW_CHOICES)
        dim = rng.choice(DIM_CHOICES)
        opt = rng.choice(OPTIMIZERS)
        dtype = rng.choice(("fp32",) * 6 + ("fp16", "bf16"))
        tables.append((f"t{i}", rows, dim, opt, dtype))
    # some tables read by several features (and then by no feature of their own)
    shared = {t[0] for t in tables if rng.random() < 0.25}
    body_bytes = 0
    biggest = 0
    for name, rows, dim, opt, dtype in tables:
        fields = [f"rows {rows}", f"dim {dim}"]
        if dtype != "fp32":
            fields.append(f"dtype {dtype}")
        fields.append(_optimizer(rng, opt))
        if rng.random() < 0.3:
            fields.append(rng.choice(("init normal(0, 0.02)", "init uniform(-0.1, 0.1)")))
        if name not in shared:
            fields += _feature_fields(rng)[0]
        lines.append(f"table {name} {{ {' '.join(fields)} }}")
        width = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
        size = rows * (dim * width + 4 * STATE_PER_ROW[opt](dim))
        body_bytes += size
        biggest = max(biggest, size)
    for name in sorted(shared):
        for k in range(rng.randint(2, 3)):
            fields, _ = _feature_fields(rng)
            lines.append(f"feature {name}_f{k} {{ table {name} {' '.join(fields)} }}")

    # HBM: roomy, or so small that the largest table does not fit on one GPU
    if rng.random() < 0.3 and biggest > 4096:
        hbm_kib = max(4, (body_bytes // world) * 3 // 2 // 1024 + 4)
        hbm = f"{hbm_kib} KiB"
    else:
        hbm = "64 MiB"
    lines.insert(
        1,
        f"hardware {{ nodes {nodes} gpus_per_node {gpus} hbm {hbm} hbm_bandwidth 100 GB/s "
        "nvlink 50 GB/s network 10 Gb/s arch sm_80 }",
    )

    batch = world * rng.choice((1, 2, 4, 8))
    dense_features = rng.choice((0, 3, 13))
    bottom = rng.choice(("[]", "[8]", "[16, 8]")) if dense_features else "[]"
    interaction = rng.choice(("dot", "dcnv2 { layers 1 low_rank 4 }"))
    top = rng.choice(("[1]", "[8, 1]"))
    dense_opt = rng.choice(("sgd { lr 0.1 }", "adagrad { lr 0.05 }", "adam { lr 0.01 }"))
    lines.append(
        f"model {{ batch {batch} dense_features {dense_features} bottom_mlp {bottom} "
        f"interaction {interaction} top_mlp {top} optimizer {dense_opt} }}"
    )

    plan = [f"solver {rng.choice(('greedy', 'greedy', 'cp-sat'))}", "time_limit 2 s"]
    plan.append(f"seed {rng.randint(0, 9)}")
    if rng.random() < 0.3:
        plan.append("row_partition range")
    plan.append(f"communication {rng.choice(('auto', 'flat', 'hierarchical'))}")
    if rng.random() < 0.15:
        plan.append(f"strategy {rng.choice(STRATEGIES[1:])}")
    if rng.random() < 0.1:
        plan.append("objective memory")
    if rng.random() < 0.1:
        plan.append("memory_headroom 1 KiB")
    pinned: dict[str, str] = {}
    for name, rows, dim, opt, _ in tables:
        if rng.random() < 0.45:
            continue
        kind = rng.choice(("dp", "rb", "ub", ""))
        fields = [f"cluster {kind}"] if kind else []
        if kind != "dp":
            r = rng.choice((1, 2, 3, 4))
            if 1 < r <= min(rows, world) and rng.random() < 0.6:
                fields.append(f"row_shards {r}")
            else:
                r = 1
            can_split = dim % 4 == 0 and opt != "rowwise_adagrad"
            c = rng.choice((2, 4))
            if can_split and dim // c >= 4 and r * c <= world and rng.random() < 0.6:
                fields.append(f"column_shards {c}")
            if nodes > 1 and rng.random() < 0.2:
                # every cell on one node: at most gpus cells
                fields.append("within_node")
        if fields:
            pinned[name] = kind
            plan.append(f"table {name} {{ {' '.join(fields)} }}")
    free = [t[0] for t in tables if pinned.get(t[0]) != "dp"]
    if len(free) >= 2 and rng.random() < 0.2:
        pair = rng.sample(free, 2)
        if not any(f"table {p} " in line and "within_node" in line for p in pair for line in plan):
            plan.append(f"colocate {pair[0]}, {pair[1]}")
    lines.append("plan {\n  " + "\n  ".join(plan) + "\n}")
    return "\n".join(lines) + "\n"
