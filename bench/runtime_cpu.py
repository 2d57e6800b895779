"""CPU benchmark of the runtime: the embarkc plan against table-wise and row-wise plans.

A DLRM-DCNv2-like embedding workload (shared/workloads/dcnv2.json: 26 tables, dim 128,
multi-hot, adagrad) with every table's rows divided by --rows-divisor, a global batch of
--batch samples, on 4 gloo processes laid out as 2 nodes x 2 GPUs, so that flat and
hierarchical traffic is intra- and inter-node as on a real cluster. Each plan is trained
through the same runtime (ShardedEmbeddings, torch kernels, prefetch on) with a fixed
linear loss on the embedding outputs (the dense MLP is the same for every plan and is
left out so that the numbers show what the plan changes). Reported per plan: steps per
second (rank 0, after --warmup steps, between barriers), and bytes per step per cluster
kind, summed over ranks, measured by the runtime's collectives and checked against
`embarkc.simulate.count_bytes` for the same batches (must be equal, byte for byte).

    python bench/runtime_cpu.py                 # prints the table, writes bench/results_runtime.md
    python bench/runtime_cpu.py --steps 5 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT.parent / "shared" / "workloads" / "dcnv2.json"
RESULTS = ROOT / "bench" / "results_runtime.md"


def scaled_workload(rows_divisor: int, batch: int) -> dict:
    data = json.loads(WORKLOAD.read_text())
    data["batch_size"] = batch
    for g in data["groups"]:
        g["rows"] = max(64, int(g["rows"]) // rows_divisor)
    return data


def make_plans(workload: dict, time_limit: float) -> dict:
    from embarkc.planner import plan_program
    from embarkc.planner.baselines import build_baseline
    from embarkc.workload import program_from_workload

    program = program_from_workload(workload, nodes=2, gpus_per_node=2)
    return {
        "embarkc": plan_program(program, strategy="embark", time_limit=time_limit),
        "table-wise": build_baseline(program, "table-wise"),
        "row-wise": build_baseline(program, "row-wise"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, plan_text: str, steps: int, warmup: int, outdir: str
) -> None:
    import torch
    import torch.distributed as dist

    from embark_runtime.comm import Comm
    from embark_runtime.embedding import ShardedEmbeddings
    from embark_runtime.plan import parse_plan
    from embark_runtime.synthetic import SyntheticData

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    plan = parse_plan(plan_text)
    comm = Comm.create(plan.topology.gpus_per_node)
    emb = ShardedEmbeddings(plan, rank, world, comm=comm, seed=0, overlap=True)
    data = SyntheticData(plan, seed=0)
    total = warmup + steps
    batches = [data.batch(s, rank, world) for s in range(total)]
    gen = torch.Generator().manual_seed(rank)
    b = plan.batch_size // world
    proj = {
        f.name: torch.randn(
            b, plan.table(f.table).dim * (f.bag_max if f.pooling == "concat" else 1), generator=gen
        )
        for f in plan.features
    }
    moved, start = [], 0.0
    for s in range(total):
        if s == warmup:
            comm.barrier()
            start = time.perf_counter()
        out = emb(batches[s].sparse)
        if s + 1 < total:
            emb.prefetch(batches[s + 1].sparse)
        sum((out[k] * w).sum() for k, w in proj.items()).backward()
        moved.append(emb.bytes_moved())
    comm.barrier()
    elapsed = time.perf_counter() - start
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump({"elapsed": elapsed, "moved": moved}, f)
    dist.destroy_process_group()


def run_plan(plan, steps: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    from embark_runtime.plan import dumps_plan

    world = plan.world_size
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _worker,
            args=(world, _free_port(), dumps_plan(plan), steps, warmup, outdir),
            nprocs=world,
            start_method="fork",
        )
        runs = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                runs.append(pickle.load(f))
    per_step = []
    for s in range(warmup + steps):
        per_step.append(
            {
                c.name: {
                    k: sum(run["moved"][s][c.name][k] for run in runs) for k in ("intra", "inter")
                }
                for c in plan.clusters
            }
        )
    return {"steps_per_s": steps / runs[0]["elapsed"], "per_step": per_step}


def simulator_matches(plan, per_step) -> bool:
    from embark_runtime.synthetic import SyntheticData
    from embarkc.simulate import count_bytes

    data = SyntheticData(plan, seed=0)
    for s, got in enumerate(per_step):
        want = count_bytes(
            plan, [data.batch(s, r, plan.world_size) for r in range(plan.world_size)]
        )
        if got != want:
            print(f"  step {s}: runtime {got} != simulator {want}", file=sys.stderr)
            return False
    return True


def summarise(plan, result, warmup: int) -> dict:
    kinds = {c.name: c.kind for c in plan.clusters}
    timed = result["per_step"][warmup:]
    by_kind: dict[str, dict[str, float]] = {}
    for step in timed:
        for name, v in step.items():
            e = by_kind.setdefault(kinds[name], {"intra": 0.0, "inter": 0.0})
            e["intra"] += v["intra"] / len(timed)
            e["inter"] += v["inter"] / len(timed)
    clusters = ", ".join(
        f"{c.kind}{'/' + c.communication if c.communication else ''}:{len(c.tables)}"
        for c in plan.clusters
    )
    return {
        "clusters": clusters,
        "cells": len(plan.shards),
        "steps_per_s": result["steps_per_s"],
        "by_kind": by_kind,
    }


def table(rows: dict[str, dict], sim: dict[str, bool]) -> str:
    lines = [
        "| plan | clusters (kind:tables) | cells | steps/s | kind | intra MB/step | inter MB/step | = simulator |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for name, r in rows.items():
        first = True
        for kind, v in sorted(r["by_kind"].items()):
            head = (
                f"| {name} | {r['clusters']} | {r['cells']} | {r['steps_per_s']:.2f} |"
                if first
                else "| | | | |"
            )
            tail = ("yes" if sim[name] else "**NO**") if first else ""
            lines.append(
                f"{head} {kind} | {v['intra'] / 1e6:.3f} | {v['inter'] / 1e6:.3f} | {tail} |"
            )
            first = False
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-divisor", type=int, default=1000)
    p.add_argument("--batch", type=int, default=2048, help="global batch (4 ranks)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=10.0, help="planner CP-SAT seconds")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    workload = scaled_workload(a.rows_divisor, a.batch)
    plans = make_plans(workload, a.time_limit)
    rows, sim = {}, {}
    for name, plan in plans.items():
        print(f"{name}: training {a.warmup} + {a.steps} steps on 4 processes ...", flush=True)
        result = run_plan(plan, a.steps, a.warmup)
        sim[name] = simulator_matches(plan, result["per_step"])
        rows[name] = summarise(plan, result, a.warmup)
    text = table(rows, sim)
    print(text)
    if not a.no_write:
        load = os.getloadavg()
        import torch

        RESULTS.write_text(
            "# Runtime CPU benchmark (bench/runtime_cpu.py)\n\n"
            f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. Machine: {platform.machine()}, "
            f"{os.cpu_count()} cores shared with other jobs (load average {load[0]:.1f} at the end), "
            f"Python {platform.python_version()}, torch {torch.__version__}, gloo, 4 processes as "
            "2 nodes x 2 GPUs.\n\n"
            f"Workload: dcnv2 (26 tables, dim 128, multi-hot, adagrad), rows / {a.rows_divisor} "
            f"(at least 64), global batch {a.batch}; {a.steps} timed steps after {a.warmup} warm-up "
            "steps, prefetch on; embeddings only (forward, backward with the fused adagrad update, "
            "all traffic), the dense MLP left out.\n\n"
            "Bytes are per step, summed over the 4 ranks, counted at the sender as "
            "docs/communication.md defines; `= simulator` says whether every step's count equals "
            "`embarkc.simulate.count_bytes` on the same batches.\n\n"
            f"Command: `python bench/runtime_cpu.py --rows-divisor {a.rows_divisor} --batch {a.batch} "
            f"--steps {a.steps}`\n\n" + text + "\n"
        )
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(sim.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
