"""The host tier's CPU path: the cost of tiny.embark's embedding step by cache size.

tiny.embark's tables on one rank (its hardware set to 1 node x 1 GPU with 64 MiB of HBM
and host memory, so that the planner shards nothing and every table is one cell of an rb
or ub cluster) are planned once; every cell is then put in host memory with a cache of
each --caches size (rows, capped at the cell's rows; `all`: the whole cell; `hbm`: the
plan as planned, the baseline). For each size, `ShardedEmbeddings` (exact numerics,
world 1) trains --steps steps of tiny's synthetic batches (256 samples): the lookup,
`loss.backward()` (the fused sparse update) and the next batch's prefetch, as the
trainer runs them. Printed per size: the median over steps (first step left out) of the
step's CPU time of this process (single-threaded: robust to other jobs on the machine),
its ratio to HBM, and the cache's hit rate, evictions and host reads per step.

On the CPU "host" and "device" are the same memory, so this measures the cache's own
bookkeeping and copies (admission, the step's rows gathered into a buffer, staged updates
of the rows served from host, write-backs), not a PCIe transfer. --rounds repeats the
sizes, alternating, and keeps each size's median of the rounds.

    python bench/host_tier.py                            # prints the table
    python bench/host_tier.py --steps 40 --rounds 3 --caches hbm,0,8,64,512,4096,all
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
SPEC_EDITS = (
    ("  nodes 2\n  gpus_per_node 2\n  hbm 4 MiB\n", "  nodes 1\n  gpus_per_node 1\n  hbm 64 MiB\n"),
    ("  arch sm_80\n", "  arch sm_80\n  host_memory 64 MiB\n"),
)


def one_rank_plan(tmp: Path) -> dict:
    """The plan of tiny.embark's tables on one GPU (the bench's baseline)."""
    from embarkc.cli import main as embarkc

    text = (ROOT / "specs" / "tiny.embark").read_text()
    for old, new in SPEC_EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    spec = tmp / "tiny1.embark"
    spec.write_text(text)
    assert embarkc(["plan", str(spec), "-o", str(tmp / "plan.json"), "-q"]) == 0
    return json.loads((tmp / "plan.json").read_text())


def host_plan(plan: dict, cache: str) -> dict:
    """`plan` with every cell in host memory caching `cache` rows (or all of them)."""
    from embark_runtime.plan import parse_plan

    model = parse_plan(json.dumps(plan))
    out = json.loads(json.dumps(plan))
    for s in out["shards"]:
        rows = model.row_count(s["table"], s["row_shard"], s["row_shards"])
        s["tier"] = "host"
        s["cache_rows"] = rows if cache == "all" else min(rows, int(cache))
    return out


def measure(plan_data: dict, steps: int) -> tuple[list[float], list[dict]]:
    """CPU seconds of every step and the cache counters of every step (world 1)."""
    import torch

    from embark_runtime.embedding import ShardedEmbeddings
    from embark_runtime.kernels import TorchKernels
    from embark_runtime.plan import parse_plan
    from embark_runtime.synthetic import SyntheticData

    plan = parse_plan(json.dumps(plan_data))
    emb = ShardedEmbeddings(plan, 0, 1, kernels=TorchKernels(torch.float64))
    data = SyntheticData(plan, seed=0)
    batches = [data.global_batch(s).sparse for s in range(steps + 1)]
    gen = torch.Generator().manual_seed(0)
    times, stats = [], []
    for s in range(steps):
        t0 = time.process_time()
        out = emb(batches[s])
        emb.prefetch(batches[s + 1])
        loss = sum(
            (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out.values()
        )
        loss.backward()
        emb.finish_backward()
        times.append(time.process_time() - t0)
        stats.append({k: v.as_list() for k, v in emb.cache_stats().items()})
    return times, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--caches", default="hbm,0,8,64,512,4096,all")
    a = ap.parse_args(argv)
    import torch

    from embark_runtime.cache import STAT_NAMES

    torch.set_num_threads(1)
    sizes = a.caches.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        base_plan = one_rank_plan(Path(tmp))
    plans = {s: base_plan if s == "hbm" else host_plan(base_plan, s) for s in sizes}
    medians: dict[str, list[float]] = {s: [] for s in sizes}
    counters: dict[str, list[dict]] = {s: [] for s in sizes}
    for _ in range(a.rounds):
        for size in sizes:
            times, stats = measure(plans[size], a.steps)
            medians[size].append(statistics.median(times[1:]))
            counters[size] += stats[1:]
    kinds = sorted({c["kind"] for c in base_plan["clusters"]})
    print(
        f"# host tier, tiny.embark's tables on 1 rank ({', '.join(kinds)}), {a.steps} steps x "
        f"{a.rounds} rounds, CPU time; {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {datetime.date.today()}"
    )
    print(
        "| cache rows per cell | CPU per step | vs HBM | hit rate | evictions/step | host reads/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median(medians["hbm"]) if "hbm" in medians else None
    for size in sizes:
        t = statistics.median(medians[size])
        ratio = f"{t / base:.2f}x" if base else "-"
        steps = counters[size]
        if any(steps):
            tot = {
                name: sum(v[i] for step in steps for v in step.values())
                for i, name in enumerate(STAT_NAMES)
            }
            hit = f"{100 * tot['hits'] / max(1, tot['lookups']):.1f}%"
            ev = f"{tot['evictions'] / len(steps):,.0f}"
            hr = f"{tot['host_reads'] / len(steps):,.0f}"
        else:
            hit = ev = hr = "-"
        label = "HBM (as planned)" if size == "hbm" else size
        print(f"| {label} | {1000 * t:.1f} ms | {ratio} | {hit} | {ev} | {hr} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
