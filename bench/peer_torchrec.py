"""TorchRec peer benchmark: bench/runtime_cpu.py's workload under DistributedModelParallel.

Three parts, each skipped with a message when it cannot run:

* **train**: the workload of bench/runtime_cpu.py (shared/workloads/dcnv2.json, every
  table's rows divided by --rows-divisor, global batch --batch, adagrad, sum pooling) as a
  TorchRec EmbeddingBagCollection sharded by DistributedModelParallel on 4 gloo
  processes (127.0.0.1, --nodes x --gpus-per-node), one run per TorchRec sharding type,
  every table of the run given that type. The batches are
  embark_runtime.synthetic.SyntheticData's, bit for bit those runtime_cpu.py feeds to
  embarkc's runtime, and the loss is the same fixed linear
  projection of the pooled embeddings (embeddings only, no dense MLP). The sparse
  optimizer is fused into the backward as in TorchRec's normal use (fbgemm's CPU kernels);
  a data-parallel table is a dense replica updated by a dense optimizer after DDP's
  all-reduce. TorchRec's gradient division (pooled gradients divided by the world size)
  is turned off and DDP's average multiplied back, so that every type trains the model
  embarkc's runtime trains: gradients summed over the global batch. Steps/s: rank 0,
  after --warmup steps, `steps / elapsed` between two barriers (runtime_cpu.py's
  measure) and the median over windows of --window steps.
  --with-embarkc runs runtime_cpu.py's three plans (embarkc, table-wise, row-wise) through
  embarkc's runtime in the same invocation, so both sides see the same machine load.
* **check** (--check-steps K, instead of timing): every TorchRec cell starts from
  embark_runtime.init's values, trains K steps, and is compared with
  embark_runtime.reference.ReferenceEmbeddings trained on the same global batches and
  loss (--check-optimizer swaps the optimizer, e.g. sgd, whose update is not invariant
  to a gradient scale as adagrad's is).
* **planner**: TorchRec's EmbeddingShardingPlanner on T510's 510 tables (specs/paper/
  t510.embark: 16 DGX H100 nodes = 128 GPUs, compute device "cuda"; planning needs no GPU)
  against embarkc's greedy planner (`embarkc plan specs/paper/t510.embark --solver
  greedy`) in the same interpreter; wall and CPU seconds. TorchRec's planner runs in a
  child process under its own `timeout_seconds=--planner-cap` (it then returns the best
  plan found so far) and is killed at twice the cap.

Run it with the interpreter of the environment bench/peer_torchrec_setup.sh makes:

    bash bench/peer_torchrec_setup.sh                      # once, about 5 minutes
    /tmp/embark-torchrec-venv/bin/python bench/peer_torchrec.py --with-embarkc

Without TorchRec the script says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pickle
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads"
T510_SPEC = ROOT / "specs" / "paper" / "t510.embark"
SETUP = "bench/peer_torchrec_setup.sh"

PLANNER_TYPES = ("table_wise", "column_wise", "table_column_wise", "data_parallel")
"""Sharding types TorchRec's EmbeddingBagCollectionSharder offers for compute device cpu."""
MANUAL_TYPES = ("row_wise", "table_row_wise", "grid_shard")
"""Types it offers only for cuda (and mtia); tried here through a hand-built plan."""
ALL_TYPES = PLANNER_TYPES + MANUAL_TYPES

H100_HBM = 80 * 1024**3
"""Bytes of HBM per GPU of a DGX H100 (the hardware of specs/paper/t510.embark)."""


def torchrec_missing() -> str | None:
    """None when TorchRec and fbgemm-gpu(-cpu) are importable, else what to do."""
    for mod in ("torchrec", "fbgemm_gpu"):
        if importlib.util.find_spec(mod) is None:
            return (
                f"TorchRec not installed ({mod} not found in {sys.executable}): "
                f"run {SETUP} and run this script with that environment's python "
                "(default /tmp/embark-torchrec-venv/bin/python)"
            )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- workload
def _runtime_cpu() -> Any:
    """bench/runtime_cpu.py as a module: its workload and its runs are the reference."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import runtime_cpu
    finally:
        sys.path.pop(0)
    return runtime_cpu


def data_plan(rows_divisor: int, batch: int, nodes: int, gpus_per_node: int) -> Any:
    """A plan of runtime_cpu.py's scaled workload; only its tables, features and batch
    matter here (they decide SyntheticData's batches), so the table-wise baseline does."""
    from embarkc.planner.baselines import build_baseline
    from embarkc.workload import program_from_workload

    workload = _runtime_cpu().scaled_workload(rows_divisor, batch)
    program = program_from_workload(workload, nodes=nodes, gpus_per_node=gpus_per_node)
    return build_baseline(program, "table-wise")


def with_optimizer(plan: Any, optimizer: str) -> Any:
    """`plan` with every table's optimizer replaced (same hyper-parameters)."""
    import json

    from embark_runtime.plan import parse_plan, plan_to_dict

    data = plan_to_dict(plan)
    for t in data["tables"]:
        t["optimizer"] = optimizer
    return parse_plan(json.dumps(data))


def _fused_params(plan: Any) -> dict[str, Any]:
    """fbgemm's fused optimizer with the plan's optimizer and hyper-parameters."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kinds = {t.optimizer for t in plan.tables}
    if len(kinds) != 1:
        raise ValueError(f"the tables use several optimizers {sorted(kinds)}; one is needed")
    table = plan.tables[0]
    p = table.optimizer_params
    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adam": EmbOptimType.ADAM,
    }[table.optimizer]
    fused: dict[str, Any] = {"optimizer": kind, "learning_rate": p.lr, "eps": p.eps}
    if p.weight_decay:
        fused["weight_decay"] = p.weight_decay
    if table.optimizer == "adam":
        fused.update(beta1=p.beta1, beta2=p.beta2)
    return fused


def _dense_optimizer(plan: Any, params: list[Any]) -> Any:
    """The same optimizer as a torch one, for data-parallel replicas (not fused)."""
    import torch

    table = plan.tables[0]
    p = table.optimizer_params
    if table.optimizer == "sgd":
        return torch.optim.SGD(params, lr=p.lr, weight_decay=p.weight_decay)
    if table.optimizer == "adam":
        return torch.optim.Adam(
            params, lr=p.lr, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay
        )
    if table.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=p.lr, eps=p.eps, weight_decay=p.weight_decay)
    raise ValueError(f"no dense torch optimizer for {table.optimizer} (data_parallel tables)")


def embedding_bag_collection(plan: Any, device: str) -> Any:
    """One TorchRec table per plan table, pooled as its features say (sum or mean)."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    configs = []
    for t in plan.tables:
        feats = [f for f in plan.features if f.table == t.name]
        poolings = {f.pooling for f in feats}
        if poolings - {"sum", "mean"} or len(poolings) > 1 or any(f.weighted for f in feats):
            raise ValueError(
                f"table {t.name}: TorchRec's EmbeddingBagCollection needs one sum or mean "
                f"pooling and unweighted features (got {sorted(poolings)})"
            )
        configs.append(
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.dim,
                num_embeddings=t.rows,
                feature_names=[f.name for f in feats],
                pooling=PoolingType.SUM if poolings == {"sum"} else PoolingType.MEAN,
            )
        )
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


def keyed_jagged(plan: Any, sparse: dict[str, Any]) -> Any:
    """A SyntheticData batch's bags as one KeyedJaggedTensor (keys in plan order)."""
    import numpy as np
    import torch
    from torchrec import KeyedJaggedTensor

    keys = [f.name for f in plan.features]
    values = np.concatenate([sparse[k].ids for k in keys])
    lengths = np.concatenate([np.diff(sparse[k].offsets) for k in keys])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
    )


# --------------------------------------------------------------------------- train
def sharding_plan(
    sharding: str, ebc: Any, sharder: Any, plan: Any, world: int, local: int, pg: Any
) -> Any:
    """TorchRec's plan giving every table `sharding`: its own planner for the types it
    offers on cpu (it places tables and cells), else a hand-built one. Column cuts are
    dim / world wide (TorchRec's default block of 128 columns would leave a 128-wide table
    whole, i.e. table-wise)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TRTopology
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    if sharding in PLANNER_TYPES:
        planner = EmbeddingShardingPlanner(
            topology=TRTopology(world_size=world, local_world_size=local, compute_device="cpu"),
            batch_size=plan.batch_size // world,
            constraints={
                t.name: ParameterConstraints(
                    sharding_types=[sharding], min_partition=max(1, t.dim // world)
                )
                for t in plan.tables
            },
            debug=False,
        )
        return planner.collective_plan(ebc, [sharder], pg)
    hosts = world // local
    gens = {
        "row_wise": lambda i: row_wise(),
        "table_row_wise": lambda i: table_row_wise(host_index=i % hosts),
        "grid_shard": lambda i: _grid(hosts),
    }[sharding]
    module_plan = construct_module_sharding_plan(
        ebc,
        {t.name: gens(i) for i, t in enumerate(plan.tables)},
        sharder=sharder,
        local_size=local,
        world_size=world,
        device_type="cpu",
    )
    # construct_module_sharding_plan picks the dense kernel (autograd gradients, a separate
    # optimizer) unless a table carries an in-backward optimizer; the planner's cpu plans
    # use fbgemm's fused kernel, so these do too: one kernel for every sharded type.
    for ps in module_plan.values():
        ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
    return ShardingPlan({"": module_plan})


def _grid(hosts: int) -> Any:
    """grid_shard over every host, each host holding a block of columns cut in row shards.

    TorchRec's own `grid_shard` generator cuts columns in blocks of MIN_CW_DIM = 128 and
    then takes one block per host, which fails (IndexError) for a 128-wide table on two
    hosts; this is the same generator with the block width set to dim / hosts."""
    from torchrec.distributed.sharding_plan import (
        _get_parameter_sharding,
        _get_parameter_size_offsets,
    )
    from torchrec.distributed.types import ShardingType

    def generate(
        param: Any, local_size: int, world_size: int, device_type: str, sharder: Any
    ) -> Any:
        cells = _get_parameter_size_offsets(
            param,
            ShardingType.GRID_SHARD,
            local_size,
            world_size,
            col_wise_shard_dim=param.shape[1] // hosts,
        )
        placed = [
            (size, offset, host * local_size + rank)
            for host in range(hosts)
            for rank, (size, offset) in enumerate(
                cells[host * local_size : (host + 1) * local_size]
            )
        ]
        return _get_parameter_sharding(
            param, ShardingType.GRID_SHARD.value, placed, local_size, device_type, sharder
        )

    return generate


def describe(tr_plan: Any) -> str:
    """`kernel, N shards` of a TorchRec plan; data-parallel tables are counted apart."""
    shards, replicated, kernels = 0, 0, Counter()
    for params in tr_plan.plan.values():
        for ps in params.values():
            kernels[ps.compute_kernel] += 1
            if ps.sharding_spec is None:
                replicated += 1
            else:
                shards += len(ps.sharding_spec.shards)
    parts = [f"{shards} shards"] * bool(shards) + [f"{replicated} tables replicated"] * bool(
        replicated
    )
    return f"{'/'.join(sorted(kernels))} kernel, {', '.join(parts)}"


def _train_worker(
    rank: int,
    world: int,
    port: int,
    plan_text: str,
    sharding: str,
    steps: int,
    warmup: int,
    window: int,
    local: int,
    outdir: str,
    check: bool = False,
) -> None:
    import datetime as dt
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    # TorchRec warns about planner heuristics and fx tracing on every rank; a failure is
    # reported in the result instead.
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    # What torchrun sets for `--nnodes W/local --nproc-per-node local`: TorchRec's
    # hierarchical types (table_row_wise, grid_shard) build their node groups from it.
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    os.environ["LOCAL_RANK"] = str(rank % local)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=dt.timedelta(seconds=600),
    )
    try:
        result = _train(rank, world, plan_text, sharding, steps, warmup, window, local, check)
    except Exception as e:  # reported in the table: which types TorchRec runs on cpu
        where = traceback.extract_tb(e.__traceback__)[-1]
        message = (str(e).strip().splitlines() or [""])[0][:300]
        result = {
            "error": f"{type(e).__name__}: {message}",
            "where": f"{Path(where.filename).name}:{where.lineno} ({where.name})",
        }
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def _train(
    rank: int,
    world: int,
    plan_text: str,
    sharding: str,
    steps: int,
    warmup: int,
    window: int,
    local: int,
    check: bool = False,
) -> dict[str, Any]:
    """Train warmup + steps steps; rank's timings, or with `check` its cells after
    training from embark_runtime's initial values (see `check_torchrec`)."""
    import fbgemm_gpu  # noqa: F401  (registers the CPU operators TorchRec calls)
    import torch
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.comm_ops import set_gradient_division
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    from embark_runtime.plan import parse_plan
    from embark_runtime.synthetic import SyntheticData

    plan = parse_plan(plan_text)
    pg = dist.group.WORLD
    # TorchRec divides the pooled embeddings' gradient by the world size in the backward
    # all-to-all (DDP's averaging); embarkc's runtime and its reference sum over the
    # global batch. Same model: sum here too.
    set_gradient_division(False)
    ebc = embedding_bag_collection(plan, "meta")
    sharder = EmbeddingBagCollectionSharder(fused_params=_fused_params(plan))
    tr_plan = sharding_plan(sharding, ebc, sharder, plan, world, local, pg)
    model = DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(pg),
        device=torch.device("cpu"),
        plan=tr_plan,
        sharders=[sharder],
    )
    if check:
        _load_initial_values(plan, model)
    # Fused tables update themselves in the backward and leave .grad None; what is left
    # with a gradient (data-parallel replicas, after DDP's all-reduce) needs an optimizer.
    dense = None
    data = SyntheticData(plan, seed=0)
    total = warmup + steps
    kjts = [keyed_jagged(plan, data.batch(s, rank, world).sparse) for s in range(total)]
    # The same projection as runtime_cpu.py: same generator, same order, same shapes.
    gen = torch.Generator().manual_seed(rank)
    b = plan.batch_size // world
    proj = {
        f.name: torch.randn(
            b, plan.table(f.table).dim * (f.bag_max if f.pooling == "concat" else 1), generator=gen
        )
        for f in plan.features
    }
    marks: list[float] = []
    start = 0.0
    for s in range(total):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
            marks.append(start)
        out = model(kjts[s]).to_dict()
        sum((out[k] * w).sum() for k, w in proj.items()).backward()
        if s == 0:
            with_grad = [p for p in model.parameters() if p.grad is not None]
            dense = _dense_optimizer(plan, with_grad) if with_grad else None
        if dense is not None:
            # DDP averages the replicas' gradients; the fused tables (and embarkc's
            # runtime) sum them over the global batch: the same model needs the sum.
            for q in with_grad:
                q.grad.mul_(world)
            dense.step()
            dense.zero_grad(set_to_none=True)
        if s >= warmup and (s + 1 - warmup) % window == 0:
            marks.append(time.perf_counter())
    dist.barrier()
    elapsed = time.perf_counter() - start
    if check:
        return {"cells": _local_cells(model, rank)}
    return {
        "elapsed": elapsed,
        "marks": marks,
        "plan": describe(tr_plan),
        "dense_params": 0 if dense is None else sum(len(g["params"]) for g in dense.param_groups),
    }


def _embedding_tensors(model: Any) -> list[tuple[str, int, int, Any]]:
    """(table, first row, first column, tensor) of every table cell held by this rank,
    as views of TorchRec's storage (a data-parallel table is one replica)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    cells = []
    for key, v in model.state_dict().items():
        if not key.endswith(".weight") or "embedding_bags." not in key:
            continue
        table = key.split(".")[-2]
        if isinstance(v, ShardedTensor):
            for sh in v.local_shards():
                r0, c0 = sh.metadata.shard_offsets
                cells.append((table, int(r0), int(c0), sh.tensor))
        else:
            cells.append((table, 0, 0, v))
    return cells


def _load_initial_values(plan: Any, model: Any) -> None:
    """Every cell from embark_runtime.init.initial_values (seed 0): the same starting
    model as embarkc's runtime and its unsharded reference."""
    import torch

    from embark_runtime.init import initial_values

    with torch.no_grad():
        for table, r0, c0, t in _embedding_tensors(model):
            rows = torch.arange(r0, r0 + t.shape[0], dtype=torch.int64)
            t.copy_(initial_values(0, table, rows, c0, c0 + t.shape[1], plan.table(table).init))


def _local_cells(model: Any, rank: int) -> list[tuple[str, int, int, Any]]:
    cells = [(table, r0, c0, t.detach().clone()) for table, r0, c0, t in _embedding_tensors(model)]
    # Replicas are equal on every rank: rank 0 reports them.
    return [c for c in cells if rank == 0 or c[0] not in _replicated(model)]


def _replicated(model: Any) -> set[str]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return {
        key.split(".")[-2]
        for key, v in model.state_dict().items()
        if key.endswith(".weight") and not isinstance(v, ShardedTensor)
    }


def check_torchrec(plan: Any, sharding: str, steps: int, local: int) -> dict[str, Any]:
    """Does TorchRec train the same model? From embark_runtime's initial values, `steps`
    steps of TorchRec with `sharding` against embark_runtime.reference.ReferenceEmbeddings
    (unsharded, one process) on the same global batches and loss: the largest difference
    of any weight, next to the largest change training made (so that a check of an
    untouched model cannot pass)."""
    import torch
    import torch.multiprocessing as mp

    from embark_runtime.init import initial_values
    from embark_runtime.plan import dumps_plan
    from embark_runtime.reference import ReferenceEmbeddings
    from embark_runtime.synthetic import SyntheticData

    world = plan.world_size
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _train_worker,
            args=(
                world,
                _free_port(),
                dumps_plan(plan),
                sharding,
                steps,
                0,
                steps,
                local,
                outdir,
                True,
            ),
            nprocs=world,
            start_method="fork",
        )
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    errors = [x for x in results if "error" in x]
    if errors:
        causes = [x for x in errors if "gloo" not in x["error"]]
        return (causes or errors)[0]
    ref = ReferenceEmbeddings(plan, seed=0)
    data = SyntheticData(plan, seed=0)
    b = plan.batch_size // world
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    parts = [
        {f.name: torch.randn(b, plan.table(f.table).dim, generator=g) for f in plan.features}
        for g in gens
    ]
    proj = {f.name: torch.cat([p[f.name] for p in parts]) for f in plan.features}
    for s in range(steps):
        out = ref(data.global_batch(s).sparse)
        sum((out[k] * w).sum() for k, w in proj.items()).backward()
    diff = change = 0.0
    off = 0
    covered = {t.name: 0 for t in plan.tables}
    for r in results:
        for table, r0, c0, t in r["cells"]:
            want = ref.table_weights(table)[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]]
            rows = torch.arange(r0, r0 + t.shape[0], dtype=torch.int64)
            init = initial_values(0, table, rows, c0, c0 + t.shape[1], plan.table(table).init)
            diff = max(diff, float((t - want).abs().max()))
            off += int(((t - want).abs() > 1e-5 * (1 + want.abs())).sum())
            change = max(change, float((want - init).abs().max()))
            covered[table] += t.numel()
    missing = [t.name for t in plan.tables if covered[t.name] != t.rows * t.dim]
    return {
        "max_diff": diff,
        "max_change": change,
        "off": off,
        "elements": sum(covered.values()),
        "tables_not_covered": missing,
    }


def run_torchrec(
    plan: Any, sharding: str, steps: int, warmup: int, window: int, local: int
) -> dict[str, Any]:
    """One sharding type on plan.world_size processes; rank 0's result."""
    import torch.multiprocessing as mp

    from embark_runtime.plan import dumps_plan

    world = plan.world_size
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _train_worker,
            args=(
                world,
                _free_port(),
                dumps_plan(plan),
                sharding,
                steps,
                warmup,
                window,
                local,
                outdir,
            ),
            nprocs=world,
            start_method="fork",
        )
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    errors = [x for x in results if "error" in x]
    if errors:
        # A rank that fails first makes the others fail in gloo ("connection reset"):
        # report the cause, not the echo.
        causes = [x for x in errors if "gloo" not in x["error"]]
        return (causes or errors)[0]
    r: dict[str, Any] = results[0]
    marks = r["marks"]
    durations = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    r["steps_per_s"] = steps / r["elapsed"]
    r["median_window"] = window / statistics.median(durations) if durations else float("nan")
    return r


# --------------------------------------------------------------------------- planner
def t510_module(device: str = "meta") -> Any:
    """T510's 510 tables (shared/workloads/t510.json) as an EmbeddingBagCollection."""
    import json

    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    data = json.loads((WORKLOADS / "t510.json").read_text())
    configs = []
    for g in data["groups"]:
        for _ in range(int(g["tables"])):
            i = len(configs)
            configs.append(
                EmbeddingBagConfig(
                    name=f"t{i}",
                    embedding_dim=int(g["dim"]),
                    num_embeddings=int(g["rows"]),
                    feature_names=[f"f{i}"],
                )
            )
    return EmbeddingBagCollection(tables=configs, device=torch.device(device)), data


def _torchrec_planner_child(
    cap: int, nodes: int, gpus_per_node: int, outfile: str, progress: Any
) -> None:
    """Plan T510 with TorchRec's defaults (every proposer, every sharding type and kernel
    it offers for cuda); `progress` = [CPU s when enumeration ended, partitioned proposals],
    kept up to date so that a killed run still says how far it got."""
    import logging

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner import Topology as TRTopology

    logging.disable(logging.WARNING)
    cpu0 = time.process_time()
    ebc, data = t510_module()
    world = nodes * gpus_per_node
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
    )
    planner = EmbeddingShardingPlanner(
        topology=TRTopology(
            world_size=world,
            local_world_size=gpus_per_node,
            compute_device="cuda",
            hbm_cap=H100_HBM,
        ),
        batch_size=int(data["batch_size"]) // world,
        debug=False,
        timeout_seconds=cap,
    )
    enumerate_, partition = planner._enumerator.enumerate, planner._partitioner.partition

    def enumerated(*a: Any, **k: Any) -> Any:
        out = enumerate_(*a, **k)
        progress[0] = time.process_time() - cpu0
        return out

    def partitioned(*a: Any, **k: Any) -> Any:
        progress[1] += 1
        return partition(*a, **k)

    planner._enumerator.enumerate = enumerated  # type: ignore[method-assign]
    planner._partitioner.partition = partitioned  # type: ignore[method-assign]
    wall = time.perf_counter()
    tr_plan = planner.plan(ebc, [sharder])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu0
    types = Counter(ps.sharding_type for p in tr_plan.plan.values() for ps in p.values())
    with open(outfile, "wb") as f:
        pickle.dump(
            {
                "wall": wall,
                "cpu": cpu,
                "enumerate_cpu": progress[0],
                "proposals": planner._num_proposals,
                "plans": planner._num_plans,
                "types": dict(types),
                "timed_out": wall >= cap,
            },
            f,
        )


def torchrec_planner(cap: int, nodes: int = 16, gpus_per_node: int = 8) -> dict[str, Any]:
    """TorchRec's planner on T510 in a child process; killed at 2 x cap wall seconds.

    A killed run reports its wall time, its CPU time (the child's rusage) and its progress.
    """
    import multiprocessing as mp
    import resource

    ctx = mp.get_context("spawn")
    progress = ctx.Array("d", [float("nan"), 0.0])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pkl")
        p = ctx.Process(
            target=_torchrec_planner_child, args=(cap, nodes, gpus_per_node, out, progress)
        )
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        p.start()
        p.join(2 * cap)
        if p.is_alive():
            p.terminate()
            p.join()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            return {
                "killed": True,
                "wall": time.perf_counter() - start,
                "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
                "enumerate_cpu": progress[0],
                "partitioned": int(progress[1]),
            }
        if not os.path.exists(out):
            return {"error": f"planner process exited with code {p.exitcode}"}
        with open(out, "rb") as f:
            r: dict[str, Any] = pickle.load(f)
        return r


def embarkc_planner() -> dict[str, Any]:
    """`embarkc plan specs/paper/t510.embark --solver greedy`, timed in this process
    (parse + lower included, baselines costed as the command does)."""
    from embarkc.frontend import load_program
    from embarkc.planner import plan_program

    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_program(load_program(T510_SPEC), solver="greedy")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    kinds = Counter(c.kind for c in plan.clusters for _ in c.tables)
    return {"wall": wall, "cpu": cpu, "kinds": dict(kinds), "cells": len(plan.shards)}


# --------------------------------------------------------------------------- main
def _train_table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| system | sharding | plan | steps/s (overall) | steps/s (median window) | rounds |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for name, r in rows.items():
        system, sharding = name.split(":", 1)
        if "error" in r:
            lines.append(f"| {system} | {sharding} | not run on cpu: {r['error']} | - | - | - |")
            continue
        med = r.get("median_window")
        med_s = f"{med:.2f}" if med is not None else "-"
        each = ", ".join(f"{x:.2f}" for x in r.get("rounds", []))
        lines.append(
            f"| {system} | {sharding} | {r['plan']} | {r['steps_per_s']:.2f} | {med_s} | {each} |"
        )
    return "\n".join(lines)


def _run_embarkc(rc: Any, eplan: Any, steps: int, warmup: int) -> dict[str, Any]:
    """One plan through embarkc's runtime with runtime_cpu.py's own harness."""
    res = rc.run_plan(eplan, steps, warmup)
    s = rc.summarise(eplan, res, warmup)
    return {"steps_per_s": s["steps_per_s"], "plan": f"{s['clusters']}, {s['cells']} cells"}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one job as one row: medians, and every round's steps/s."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    out = dict(runs[0])
    out["steps_per_s"] = statistics.median(r["steps_per_s"] for r in runs)
    if "median_window" in out:
        out["median_window"] = statistics.median(r["median_window"] for r in runs)
    out["rounds"] = [r["steps_per_s"] for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows-divisor", type=int, default=1000)
    p.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=8, help="steps per timing window")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the 4-process layout")
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--sharding", nargs="+", choices=ALL_TYPES, default=list(ALL_TYPES))
    p.add_argument("--rounds", type=int, default=1, help="repeat every run, order alternating")
    p.add_argument("--with-embarkc", action="store_true", help="also run runtime_cpu.py's plans")
    p.add_argument("--embarkc-time-limit", type=float, default=10.0, help="CP-SAT seconds")
    p.add_argument("--planner-cap", type=int, default=300, help="TorchRec planner seconds")
    p.add_argument(
        "--check-steps",
        type=int,
        default=0,
        metavar="K",
        help="instead of timing, train K steps per type and compare with the unsharded reference",
    )
    p.add_argument(
        "--check-optimizer",
        choices=("sgd", "adagrad", "rowwise_adagrad", "adam"),
        help="with --check-steps: every table uses this optimizer instead of the workload's",
    )
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-planner", action="store_true")
    a = p.parse_args(argv)

    missing = torchrec_missing()
    if missing:
        print(missing)
        return 0
    load = os.getloadavg()
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f}, Python {platform.python_version()}",
        flush=True,
    )
    if not a.no_train:
        # Imported once here so that the forked workers share them (spawn would import
        # torchrec four times per run, minutes on a loaded machine).
        import fbgemm_gpu  # noqa: F401
        import torchrec.distributed  # noqa: F401

        plan = data_plan(a.rows_divisor, a.batch, a.nodes, a.gpus_per_node)
        if a.check_steps:
            if a.check_optimizer:
                plan = with_optimizer(plan, a.check_optimizer)
            print(
                f"| sharding | optimizer | max abs difference after {a.check_steps} steps "
                "| elements off by > 1e-5 relative | max abs change |"
            )
            print("| --- | --- | ---: | ---: | ---: |")
            for sharding in a.sharding:
                c = check_torchrec(plan, sharding, a.check_steps, a.gpus_per_node)
                opt = plan.tables[0].optimizer
                if "error" in c:
                    print(f"| {sharding} | {opt} | {c['error']} | - | - |", flush=True)
                    continue
                gaps = f" (tables not covered: {c['tables_not_covered']})" * bool(
                    c["tables_not_covered"]
                )
                print(
                    f"| {sharding} | {opt} | {c['max_diff']:.3g}{gaps} | "
                    f"{c['off']} of {c['elements']} | {c['max_change']:.3g} |",
                    flush=True,
                )
            return 0
        jobs: dict[str, Any] = {
            f"torchrec:{sh}": (
                lambda sh=sh: run_torchrec(plan, sh, a.steps, a.warmup, a.window, a.gpus_per_node)
            )
            for sh in a.sharding
        }
        if a.with_embarkc:
            rc = _runtime_cpu()
            workload = rc.scaled_workload(a.rows_divisor, a.batch)
            for name, eplan in rc.make_plans(workload, a.embarkc_time_limit).items():
                jobs[f"embarkc runtime:{name}"] = lambda eplan=eplan: _run_embarkc(
                    rc, eplan, a.steps, a.warmup
                )
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
        # The machine's load drifts over minutes: odd rounds run the jobs in reverse order
        # so that neither system always runs first.
        for r in range(a.rounds):
            for name in list(jobs) if r % 2 == 0 else list(reversed(jobs)):
                print(f"round {r + 1}: {name}, {a.warmup} + {a.steps} steps ...", flush=True)
                t = time.perf_counter()
                runs[name].append(jobs[name]())
                print(f"  {runs[name][-1]}  ({time.perf_counter() - t:.0f} s)", flush=True)
        rows = {name: _median_run(rs) for name, rs in runs.items()}
        print(_train_table(rows), flush=True)
    if not a.no_planner:
        print(f"embarkc greedy planner on {T510_SPEC.relative_to(ROOT)} ...", flush=True)
        e = embarkc_planner()
        print(f"torchrec EmbeddingShardingPlanner on T510, cap {a.planner_cap} s ...", flush=True)
        tr = torchrec_planner(a.planner_cap)
        print("| planner | T510 on 16 x 8 GPUs | wall (s) | CPU (s) | result |")
        print("| --- | --- | ---: | ---: | --- |")
        print(
            f"| embarkc greedy | 510 tables | {e['wall']:.1f} | {e['cpu']:.1f} | "
            f"{e['cells']} cells, clusters {e['kinds']} |"
        )
        if "killed" in tr:
            print(
                f"| torchrec | 510 tables | > {tr['wall']:.0f} (killed) | {tr['cpu']:.1f} | "
                f"no plan; enumeration done after {tr['enumerate_cpu']:.1f} CPU s, "
                f"{tr['partitioned']} proposals partitioned |"
            )
        elif "error" in tr:
            print(f"| torchrec | 510 tables | - | - | {tr['error']} |")
        else:
            capped = " (stopped by its timeout: best so far)" if tr["timed_out"] else ""
            print(
                f"| torchrec | 510 tables | {tr['wall']:.1f}{capped} | {tr['cpu']:.1f} | "
                f"enumeration {tr['enumerate_cpu']:.1f} CPU s, {tr['proposals']} proposals, "
                f"{tr['plans']} partitioned, types {tr['types']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
