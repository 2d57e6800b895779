"""The data path: samples/s of each reader on one core, with and without the prefetch
thread, and the generated trainer's wait for data on tiny.embark with a real file.

1. Readers. A Criteo-like plan (26 one-hot features, 13 dense, global batch --batch) and
   --samples samples of random Criteo data written as: Criteo TSV (read by the Python
   parser and by pyarrow), HugeCTR raw, and Parquet (one-hot int64 ids, float dense; and a
   multi-hot copy with 3 ids per feature). Each reader reads every training batch once
   (rank 0 of 1), single-threaded (pyarrow's use_threads off, OMP_NUM_THREADS=1); the rate
   is samples per CPU second of this process (per core, robust to a busy machine) and
   per wall second. The index or metadata read of the constructor is timed apart.
2. Prefetch. A consumer that "trains" for --step-ms per batch (a float64 matmul loop,
   which releases the GIL as the dense compute does) reads every batch from each reader
   with the prefetch thread off (depth 0) and on (depth 2): wall samples/s and the mean
   wait for a batch.
3. Trainer. tiny.embark compiled to a temporary folder, a Criteo TSV file of --tiny-batches
   global batches (256 samples), `train.py --reference --steps --tiny-steps` (or under
   torchrun on --ranks 4) with `--prefetch 0` and `--prefetch 2`, alternating, --rounds
   times each: the median over runs of the mean `data_wait_s` and step time of the
   --log-json records (rank 0's; the first step left out).

    python bench/data_path.py                     # prints the tables
    python bench/data_path.py --samples 65536 --tiny-steps 20
    python bench/data_path.py --parts trainer --ranks 4 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def criteo_plan(batch: int, hotness: int = 1):  # type: ignore[no-untyped-def]
    from embark_runtime.plan import Plan, validate_rules

    tables = [{"name": f"t{i}", "rows": 100_000, "dim": 16} for i in range(26)]
    feats = [
        {"name": f"C{i + 1}", "table": f"t{i}", "hotness": hotness, "access": {"kind": "uniform"}}
        for i in range(26)
    ]
    plan = Plan.model_validate(
        {
            "source": {"spec": "bench.embark", "sha256": "0" * 64},
            "topology": {
                "nodes": 1,
                "gpus_per_node": 1,
                "hbm_bytes": 1 << 40,
                "hbm_bandwidth": 1e12,
                "intra_node_bandwidth": 1e11,
                "inter_node_bandwidth": 1e10,
            },
            "batch_size": batch,
            "tables": tables,
            "features": feats,
            "clusters": [{"name": "d", "kind": "dp", "tables": [t["name"] for t in tables]}],
            "shards": [],
            "estimate": {"step_time": 0.0, "per_rank": []},
            "planner": {"strategy": "t", "solver": "none", "status": "greedy"},
        }
    )
    validate_rules(plan)
    return plan


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """Random Criteo lines: counts, 8-digit hex ids, ~10% of the fields empty."""
    rng = np.random.default_rng(seed)
    ints = rng.integers(0, 1000, (n, 13)).astype(str)
    ints[rng.random((n, 13)) < 0.1] = ""
    cats = np.char.mod("%08x", rng.integers(0, 2**32, (n, 26)))
    cats[rng.random((n, 26)) < 0.1] = ""
    labels = rng.integers(0, 2, n).astype(str)
    return ["\t".join([labels[i], *ints[i], *cats[i]]) for i in range(n)]


def make_files(folder: Path, samples: int, batch: int) -> dict[str, tuple[Path, object]]:
    """{reader name: (path, plan)} of the same samples in every format."""
    from embark_runtime.parquet import write_parquet
    from embark_runtime.readers import CriteoTSVReader, write_hugectr_raw

    plan = criteo_plan(batch)
    multi = criteo_plan(batch, hotness=3)
    tsv = folder / "day.tsv"
    tsv.write_text("\n".join(criteo_lines(samples)) + "\n")
    reader = CriteoTSVReader(tsv, plan, holdout=0)
    batches = [reader.batch(s, 0, 1) for s in range(reader.train_batches)]
    raw = folder / "day.bin"
    write_hugectr_raw(raw, batches, plan)
    pq1 = folder / "day.parquet"
    write_parquet(pq1, batches, plan, row_group_size=64 * 1024)
    from embark_runtime.synthetic import SyntheticData

    data = SyntheticData(multi, seed=0)
    pq3 = folder / "multi.parquet"
    write_parquet(
        pq3, [data.global_batch(s) for s in range(len(batches))], multi, row_group_size=64 * 1024
    )
    return {
        "criteo tsv, python": (tsv, plan),
        "criteo tsv, pyarrow": (tsv, plan),
        "hugectr raw": (raw, plan),
        "parquet one-hot": (pq1, plan),
        "parquet 3-hot": (pq3, multi),
    }


def open_reader(name: str, path: Path, plan: object):  # type: ignore[no-untyped-def]
    from embark_runtime.readers import open_dataset

    options = {"engine": "python" if "python" in name else "arrow"} if "tsv" in name else {}
    return open_dataset(path, plan, holdout=0, **options)  # type: ignore[arg-type]


def read_rates(files: dict, repeat: int) -> list[dict]:
    rows = []
    for name, (path, plan) in files.items():
        best = None
        for _ in range(repeat):
            w0 = time.perf_counter()
            reader = open_reader(name, path, plan)
            c1, w1 = time.process_time(), time.perf_counter()
            for s in range(reader.train_batches):
                reader.batch(s, 0, 1)
            c2, w2 = time.process_time(), time.perf_counter()
            n = reader.train_batches * reader.batch_size
            row = {
                "reader": name,
                "samples": n,
                "open_s": w1 - w0,
                "per_cpu_s": n / max(c2 - c1, 1e-9),
                "per_wall_s": n / max(w2 - w1, 1e-9),
            }
            if best is None or row["per_cpu_s"] > best["per_cpu_s"]:
                best = row
        assert best is not None
        rows.append(best)
    return rows


def _train_step(ms: float) -> None:
    """About `ms` of float64 matmuls (they release the GIL, as the dense compute does)."""
    a = np.random.default_rng(0).random((192, 192))
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a = np.tanh(a @ a * 1e-3)


def prefetch_rates(files: dict, step_ms: float) -> list[dict]:
    from embark_runtime.prefetch import Prefetcher

    rows = []
    for name, (path, plan) in files.items():
        reader = open_reader(name, path, plan)
        n = reader.train_batches
        row: dict = {"reader": name}
        for depth in (0, 2):
            waits = []
            t0 = time.perf_counter()
            with Prefetcher(lambda s, r=reader: r.batch(s, 0, 1), 0, n, depth) as feed:
                for s in range(n):
                    _, w = feed.get(s)
                    waits.append(w)
                    _train_step(step_ms)
            wall = time.perf_counter() - t0
            row[f"d{depth}_per_s"] = n * reader.batch_size / wall
            row[f"d{depth}_wait_ms"] = 1e3 * float(np.mean(waits[1:] or waits))
        rows.append(row)
    return rows


def trainer_wait(folder: Path, batches: int, steps: int, rounds: int, ranks: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from embarkc.cli import main as embarkc

    out = folder / "tiny"
    assert embarkc(["compile", str(ROOT / "specs" / "tiny.embark"), "-o", str(out), "-q",
                    "--solver", "greedy"]) == 0  # fmt: skip
    data = folder / "tiny.tsv"
    data.write_text("\n".join(criteo_lines(256 * batches, seed=1)) + "\n")
    runs: dict[int, list[tuple[float, float]]] = {0: [], 2: []}
    for depth in [d for _ in range(rounds) for d in (0, 2)]:  # alternating: the load drifts
        log = folder / f"log{depth}.jsonl"
        cmd = [sys.executable, str(out / "train.py"), "--quiet", "--steps",
               str(steps), "--data", str(data), "--prefetch", str(depth), "--log-json", str(log),
               "--eval-batches", "1"]  # fmt: skip
        if ranks == 1:
            cmd.insert(2, "--reference")
        else:
            launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
            cmd[1:1] = [*launch, str(ranks)]
        for attempt in (1, 2):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                break
            # say why, and try once more (a port torchrun picked may be taken meanwhile)
            print(f"(run {attempt} failed: {r.stderr[-2000:]})", file=sys.stderr)
        r.check_returncode()
        recs = [r for r in map(json.loads, log.read_text().splitlines()) if "data_wait_s" in r]
        recs = recs[1:]
        wait = 1e3 * float(np.mean([r["data_wait_s"] for r in recs]))
        step = 1e3 * float(np.mean([256 / r["samples_per_s"] for r in recs]))
        runs[depth].append((wait, step))
    return [
        {
            "prefetch": depth,
            "wait_ms": float(np.median([w for w, _ in got])),
            "step_ms": float(np.median([s for _, s in got])),
        }
        for depth, got in runs.items()
    ]


def print_readers(files: dict, args: argparse.Namespace) -> None:
    print(f"\n## readers, one core ({args.samples} samples, batch {args.batch})\n")
    print("| reader | samples/s per core | samples/s wall | open (index) s |")
    print("|---|---:|---:|---:|")
    for r in read_rates(files, args.repeat):
        print(
            f"| {r['reader']} | {r['per_cpu_s']:,.0f} | {r['per_wall_s']:,.0f} "
            f"| {r['open_s']:.2f} |"
        )


def print_prefetch(files: dict, args: argparse.Namespace) -> None:
    print(f"\n## with and without the prefetch thread (a {args.step_ms:g} ms step)\n")
    print("| reader | samples/s, no prefetch | wait/step ms | samples/s, depth 2 | wait/step ms |")
    print("|---|---:|---:|---:|---:|")
    for r in prefetch_rates(files, args.step_ms):
        print(
            f"| {r['reader']} | {r['d0_per_s']:,.0f} | {r['d0_wait_ms']:.1f} "
            f"| {r['d2_per_s']:,.0f} | {r['d2_wait_ms']:.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=131072, help="samples per file")
    ap.add_argument("--batch", type=int, default=4096, help="global batch of the reader plan")
    ap.add_argument("--repeat", type=int, default=2, help="best of N reads per reader")
    ap.add_argument("--step-ms", type=float, default=40.0, help="the consumer's step")
    ap.add_argument("--tiny-batches", type=int, default=40, help="global batches in tiny's file")
    ap.add_argument("--tiny-steps", type=int, default=30, help="steps of each tiny run")
    ap.add_argument("--rounds", type=int, default=3, help="tiny runs per --prefetch (median)")
    ap.add_argument(
        "--ranks", type=int, default=1, help="tiny on 1 (--reference) or 4 ranks (torchrun)"
    )
    ap.add_argument(
        "--parts", default="readers,prefetch,trainer", help="which tables (comma-separated)"
    )
    args = ap.parse_args(argv)
    import pyarrow

    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, python {platform.python_version()}, pyarrow {pyarrow.__version__}"
    )
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if parts & {"readers", "prefetch"}:
            files = make_files(folder, args.samples, args.batch)
        if "readers" in parts:
            print_readers(files, args)
        if "prefetch" in parts:
            print_prefetch(files, args)
        if "trainer" in parts:
            print(
                f"\n## tiny.embark, "
                f"{'--reference' if args.ranks == 1 else f'{args.ranks} ranks (rank 0)'}, "
                f"Criteo TSV, {args.tiny_steps} steps, median of {args.rounds} runs each\n"
            )
            print("| --prefetch | data wait per step ms | step ms |")
            print("|---:|---:|---:|")
            got = trainer_wait(folder, args.tiny_batches, args.tiny_steps, args.rounds, args.ranks)
            for r in got:
                print(f"| {r['prefetch']} | {r['wait_ms']:.2f} | {r['step_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
