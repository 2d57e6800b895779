"""`embarkc export` on a large sharded export: wall time and peak memory.

    python bench/export_tables.py [--gib 1.0] [--ranks 8] [--work DIR]

Writes a synthetic sharded export (the format of docs/export.md) of one table of
`--gib` GiB (dim 64, fp32, mod partition, `--ranks` row shards cut into two column cells,
one cell per rank and column half) plus a small dp table, then joins it with
`embarkc export` into .safetensors and .npz, each in a fresh process, and reports wall
time, throughput and the process's peak resident memory (VmHWM: this
process's own, not the forking parent's as ru_maxrss after exec). For comparison the
same join done the simple way (every cell loaded, the table assembled in memory, as a
rank-0 gather holds it) is timed and measured too. Checks that every output equals the
table. Prints a markdown table; results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DIM = 64

_JOIN = """
import sys, time
from embarkc.cli import main
t = time.perf_counter()
rc = main(["export", sys.argv[1], "-o", sys.argv[2]])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(rc, time.perf_counter() - t, int(hwm) * 1024)
"""

_SIMPLE = """
import json, sys, time
import numpy as np
from safetensors.numpy import load_file, save_file
t = time.perf_counter()
src = sys.argv[1]
m = json.load(open(src + "/manifest.json"))
out = {}
for name, tab in m["tables"].items():
    out[name] = np.empty((tab["rows"], tab["dim"]), np.float32)
files = {}
for c in m["cells"]:
    f = files.setdefault(c["file"], load_file(src + "/" + c["file"]))
    j, r = c["row_shard"], c["row_shards"]
    lo, hi = c["columns"]
    out[c["table"]][j::r, lo:hi] = f[c["weight"]["name"]]
save_file(out, sys.argv[2])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(0, time.perf_counter() - t, int(hwm) * 1024)
"""


def write_export(folder: Path, rows: int, ranks: int) -> np.ndarray:
    """A sharded export of table `big` ([rows, DIM], mod over `ranks` row shards, two
    column cells each) and dp table `small`; returns `big` (for the checks)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    big = rng.standard_normal((rows, DIM), dtype=np.float32)
    small = rng.standard_normal((100, 16), dtype=np.float32)
    cells, files = [], {}
    half = DIM // 2
    for rank in range(ranks):
        tensors = {}
        metas = []
        for j in (rank,):
            for lo, hi in ((0, half), (half, DIM)):
                name = f"cell{len(metas)}.weight"
                tensors[name] = np.ascontiguousarray(big[j::ranks, lo:hi])
                metas.append((j, lo, hi, name, list(tensors[name].shape)))
        if rank == 0:
            tensors["dp.weight"] = small
        fname = f"rank-{rank:05d}.safetensors"
        save_file(tensors, str(folder / fname))
        files[fname] = {"sha256": "", "bytes": (folder / fname).stat().st_size}
        for j, lo, hi, name, shape in metas:
            cells.append(
                {"table": "big", "row_shard": j, "row_shards": ranks, "columns": [lo, hi],
                 "rank": rank, "file": fname,
                 "weight": {"name": name, "dtype": "F32", "shape": shape}}
            )  # fmt: skip
    cells.append(
        {"table": "small", "row_shard": 0, "row_shards": 1, "columns": [0, 16], "rank": 0,
         "file": "rank-00000.safetensors",
         "weight": {"name": "dp.weight", "dtype": "F32", "shape": [100, 16]}}
    )  # fmt: skip
    manifest = {
        "format": "embark-export", "version": 1, "step": 0, "world_size": ranks,
        "plan_digest": "", "row_partition": "mod",
        "tables": {
            "big": {"rows": rows, "dim": DIM, "dtype": "fp32", "kind": "rb", "row_shards": ranks},
            "small": {"rows": 100, "dim": 16, "dtype": "fp32", "kind": "dp", "row_shards": 1},
        },
        "features": {"f": "big", "g": "small"}, "cells": cells, "files": files,
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return big


def run(code: str, src: Path, out: Path) -> tuple[float, int]:
    r = subprocess.run(
        [sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(r.stdout + r.stderr)
    rc, seconds, rss = r.stdout.split()[-3:]
    assert rc == "0", r.stdout + r.stderr
    return float(seconds), int(rss)


def same(path: Path, big: np.ndarray) -> bool:
    if path.suffix == ".npz":
        with np.load(path, mmap_mode="r") as z:
            return bool(np.array_equal(z["big"], big))
    from safetensors.numpy import load_file

    return bool(np.array_equal(load_file(str(path))["big"], big))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the big table (GiB)")
    ap.add_argument("--ranks", type=int, default=8, help="row shards (one per rank)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="export-bench-"))
    rows = int(args.gib * 2**30 / (DIM * 4))
    try:
        big = write_export(work / "export", rows, args.ranks)
        gib = big.nbytes / 2**30
        print(f"table `big`: {rows:,} x {DIM} fp32 = {gib:.2f} GiB in {2 * args.ranks} cells\n")
        print("| join | output | wall | GiB/s | peak RSS |")
        print("| --- | --- | ---: | ---: | ---: |")
        for label, code, suffix in (
            ("embarkc export", _JOIN, ".safetensors"),
            ("embarkc export", _JOIN, ".npz"),
            ("whole table in memory", _SIMPLE, ".safetensors"),
        ):
            out = work / f"out{suffix}"
            seconds, rss = run(code, work / "export", out)
            assert same(out, big), (label, suffix)
            print(
                f"| {label} | {suffix} | {seconds:.2f} s | {gib / seconds:.2f} | "
                f"{rss / 2**20:,.0f} MiB |"
            )
            out.unlink()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
