"""The host tier's CPU path: tiny.embark's step time by cache size.

tiny.embark (with `host_memory 64 MiB` added to its hardware) is planned once; every cell
of the plan is then put in host memory with a cache of each --caches size (a number of
rows, capped at the cell's rows; `all`: the whole cell; `hbm`: the plan as planned, the
baseline), compiled with `embarkc compile --plan`, and trained under torchrun on --ranks
CPU processes for --steps steps, --rounds times alternating the sizes. Printed per size:
the median over runs of the median step time (rank 0's `step_s`, first step left out),
its ratio to HBM, and the hit rate and per-step evictions and host reads summed over the
clusters and ranks (the log's `cache` field).

On the CPU "host" and "device" are the same memory, so this measures the cache's own
bookkeeping and copies (admission, gather of the step's rows, staged updates of rows
served from host, write-backs), not a PCIe transfer.

    python bench/host_tier.py                            # prints the table
    python bench/host_tier.py --steps 30 --rounds 2 --caches hbm,0,8,64,512,all
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent


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


def run(program: Path, ranks: int, steps: int, log: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(ranks), str(program / "train.py"), "--quiet"]
    cmd += ["--steps", str(steps), "--eval-batches", "0", "--log-json", str(log)]
    for attempt in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            break
        # a torchrun launch can lose its rendezvous on a busy machine: retry once
        print(f"torchrun failed (attempt {attempt + 1}): {r.stderr[-500:]}", file=sys.stderr)
    else:
        raise SystemExit(f"torchrun failed twice for {program}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [x for x in records if "step_s" in x and not x.get("eval") and not x.get("summary")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--caches", default="hbm,0,8,64,512,all")
    a = ap.parse_args(argv)
    from embarkc.cli import main as embarkc

    sizes = a.caches.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        spec = d / "tiny.embark"
        text = (ROOT / "specs" / "tiny.embark").read_text()
        spec.write_text(text.replace("  arch sm_80\n", "  arch sm_80\n  host_memory 64 MiB\n"))
        assert embarkc(["compile", str(spec), "-o", str(d / "hbm"), "-q"]) == 0
        plan = json.loads((d / "hbm" / "plan.json").read_text())
        programs = {"hbm": d / "hbm"}
        for size in sizes:
            if size == "hbm":
                continue
            p = d / f"plan-{size}.json"
            p.write_text(json.dumps(host_plan(plan, size)))
            out = d / f"host-{size}"
            assert embarkc(["compile", str(spec), "--plan", str(p), "-o", str(out), "-q"]) == 0
            programs[size] = out
        medians: dict[str, list[float]] = {s: [] for s in sizes}
        caches: dict[str, list[dict]] = {s: [] for s in sizes}
        for rnd in range(a.rounds):
            for size in sizes:
                recs = run(programs[size], a.ranks, a.steps, d / f"log-{size}-{rnd}.jsonl")
                medians[size].append(statistics.median(x["step_s"] for x in recs[1:]))
                caches[size] += [x["cache"] for x in recs[1:] if "cache" in x]
    base = statistics.median(medians["hbm"]) if "hbm" in medians else None
    print(
        f"# host tier, tiny.embark on {a.ranks} CPU ranks, {a.steps} steps x {a.rounds} "
        f"round(s); {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {datetime.date.today()}"
    )
    print(
        "| cache rows per cell | step (median) | vs HBM | hit rate | evictions/step | host reads/step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        t = statistics.median(medians[size])
        ratio = f"{t / base:.2f}x" if base else "-"
        c = caches[size]
        if c:
            tot = {
                k: sum(v[k] for step in c for v in step.values())
                for k in ("hits", "lookups", "evictions", "host_reads")
            }
            hit = f"{100 * tot['hits'] / tot['lookups']:.1f}%"
            ev, hr = f"{tot['evictions'] / len(c):,.0f}", f"{tot['host_reads'] / len(c):,.0f}"
        else:
            hit = ev = hr = "-"
        label = "HBM (as planned)" if size == "hbm" else size
        print(f"| {label} | {1000 * t:.1f} ms | {ratio} | {hit} | {ev} | {hr} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
