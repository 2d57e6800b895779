"""The peer: the same embedding workload as bench/runtime_cpu.py under TorchRec's
DistributedModelParallel on 4 gloo processes (CPU, fbgemm-gpu-cpu kernels).

TorchRec is not a dependency of embarkc; install it in a separate environment that
reuses the system torch 2.13 (a combination known to load on Python 3.11):

    python3 -m venv --system-site-packages /tmp/trec
    /tmp/trec/bin/pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 \
        tensordict==0.15.3 torchmetrics==1.0.3
    /tmp/trec/bin/pip install pyre-extensions tqdm iopath lightning-utilities cloudpickle orjson pyvers
    /tmp/trec/bin/python bench/torchrec_peer.py

Without TorchRec the script says so and exits 0. Same tables, batches (SyntheticData of
the table-wise plan, seed 0), fixed linear loss and exact adagrad as the runtime bench;
each sharding type that TorchRec offers on CPU is forced on every table in turn.
Prints steps per second (rank 0, after warm-up, between barriers) and, with --append,
adds its table to bench/results_runtime.md.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_cpu import RESULTS, _free_port, make_plans, scaled_workload  # noqa: E402

SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise")
"""What TorchRec 1.8 offers for an EmbeddingBagCollection on CPU (besides data_parallel);
row_wise and table_row_wise are GPU-only there ("allowed sharding types: data_parallel,
table_wise, column_wise, table_column_wise")."""


def _worker(rank, world, port, plan_text, sharding, steps, warmup, outdir):
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from embark_runtime.plan import parse_plan
    from embark_runtime.synthetic import SyntheticData

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    plan = parse_plan(plan_text)
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[f.name for f in plan.features if f.table == t.name],
        )
        for t in plan.tables
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    lr = plan.tables[0].optimizer_params.lr
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": lr, "eps": 1e-8})
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding]) for t in plan.tables}
    topo = Topology(
        world_size=world, compute_device="cpu", local_world_size=plan.topology.gpus_per_node
    )
    planner = EmbeddingShardingPlanner(topology=topo, constraints=constraints)
    pg = dist.GroupMember.WORLD
    sharding_plan = planner.collective_plan(ebc, None, pg)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=sharding_plan)
    data = SyntheticData(plan, seed=0)
    names = [f.name for f in plan.features]
    total = warmup + steps
    kjts = []
    for s in range(total):
        bags = data.batch(s, rank, world).sparse
        kjts.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=names,
                values=torch.cat([torch.as_tensor(bags[n].ids) for n in names]),
                lengths=torch.cat([torch.as_tensor(bags[n].offsets).diff() for n in names]).int(),
            )
        )
    gen = torch.Generator().manual_seed(rank)
    b = plan.batch_size // world
    proj = {f.name: torch.randn(b, plan.table(f.table).dim, generator=gen) for f in plan.features}
    start = 0.0
    for s in range(total):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
        out = model(kjts[s]).to_dict()
        sum((out[k] * w).sum() for k, w in proj.items()).backward()
    dist.barrier()
    elapsed = time.perf_counter() - start
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump({"elapsed": elapsed}, f)
    dist.destroy_process_group()


def run(plan, sharding: str, steps: int, warmup: int) -> float:
    import torch.multiprocessing as mp

    from embark_runtime.plan import dumps_plan

    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _worker,
            args=(plan.world_size, _free_port(), dumps_plan(plan), sharding, steps, warmup, outdir),
            nprocs=plan.world_size,
            start_method="spawn",
        )
        with open(os.path.join(outdir, "0.pkl"), "rb") as f:
            return steps / pickle.load(f)["elapsed"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-divisor", type=int, default=1000)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--append", action="store_true", help="append the table to bench/results_runtime.md"
    )
    a = p.parse_args(argv)
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no peer here"
        print(
            f"torchrec peer skipped: TorchRec is not importable here ({type(e).__name__}: {e}); see the module docstring to install it"
        )
        return 0
    plan = make_plans(scaled_workload(a.rows_divisor, a.batch), time_limit=1.0)["table-wise"]
    lines = ["| TorchRec sharding (all tables) | steps/s |", "| --- | ---: |"]
    for sharding in SHARDING_TYPES:
        print(f"torchrec {sharding}: {a.warmup} + {a.steps} steps on 4 processes ...", flush=True)
        try:
            sps = f"{run(plan, sharding, a.steps, a.warmup):.2f}"
        except Exception as e:  # noqa: BLE001 - a sharding type TorchRec refuses on CPU
            sps = f"not available on CPU ({type(e).__name__})"
        lines.append(f"| {sharding} | {sps} |")
    text = "\n".join(lines)
    print(text)
    if a.append:
        with RESULTS.open("a") as f:
            f.write(
                "\nPeer: TorchRec 1.8.0 DistributedModelParallel (fbgemm-gpu-cpu 1.8.0, fused exact "
                "adagrad applied in backward), same tables, batches and loss, 4 gloo processes. "
                "TorchRec offers no row_wise / table_row_wise sharding on CPU, so the row-wise "
                "baseline has no peer; its column_wise and table_column_wise are shown instead; "
                f"`/tmp/trec/bin/python bench/torchrec_peer.py --steps {a.steps} --append`:\n\n"
                + text
                + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
