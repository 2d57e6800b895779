"""Rank 0's peak memory for `train.py --export-embeddings x.safetensors|x.npz`.

    python bench/export_gather.py [--mib 128,384,256,256] [--dim 64]

A sharded run of one rank (ShardedEmbeddings, world 1: its gather is the one every rank
of a real run takes part in) holds tables of the given sizes (fp32, sgd, rb), then writes
its whole-table file two ways, each in a fresh process:

* `all gathered` -- as the trainer did up to commit 64383f8: every table gathered (with
  its optimizer state) into a dict, then `safetensors.numpy.save_file` or `numpy.savez`;
* `streamed` -- `embark_runtime.trainer.export_gathered`: one table gathered, written,
  released before the next (`embark_runtime.export.TableFileWriter`).

The peak is the process's VmHWM after the export, reset to the resident size just
before it (/proc/self/clear_refs), after the memory initialisation freed was returned to
the system (glibc's malloc_trim, else the export reuses it unseen), with glibc's mmap
threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so that a table freed is returned
rather than kept in the heap for the next: "over the run" is what the export holds at
once on top of a process already holding its tables. Checks that both files hold the same tensors. Prints a
markdown table; results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
import numpy as np
from mp_harness import FeatureSpec, TableSpec, make_plan
from embark_runtime.embedding import ShardedEmbeddings

variant, out, sizes = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
dim = int(sys.argv[5])
tables = [TableSpec(f"t{i}", n * 2**20 // (dim * 4), dim, "rb", (1, 1), "sgd")
          for i, n in enumerate(sizes)]
features = [FeatureSpec(f"f{i}", t.name, 1, "sum") for i, t in enumerate(tables)]
plan = make_plan(tables, features, nodes=1, gpus_per_node=1, batch_size=8)
emb = ShardedEmbeddings(plan, 0, 1, seed=0)

def status(key):
    line = [l for l in open("/proc/self/status") if l.startswith(key)][0]
    return int(line.split()[1]) * 1024

import ctypes, gc
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what initialisation freed leaves the process
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
t = time.perf_counter()
if variant == "streamed":
    from embark_runtime.trainer import export_gathered
    export_gathered(out, plan, emb.gather_table, 0)
else:
    got = {}
    for t_ in plan.tables:
        w = emb._gather(t_.name)[0]  # the weights and optimizer state, as gather_table did
        got[t_.name] = w.detach().float().cpu().numpy()
    arrays = {k: np.ascontiguousarray(v) for k, v in got.items()}
    if out.suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file(arrays, str(out))
    else:
        with out.open("wb") as f:
            np.savez(f, **arrays)
seconds = time.perf_counter() - t
print(json.dumps({"before": before, "hwm": status("VmHWM"), "seconds": seconds}))
"""


def _tensors(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


def measure(work: Path, sizes: list[int], dim: int) -> None:
    """Print the table's rows: each way, each format, in a fresh process under `work`."""
    root = Path(__file__).resolve().parent.parent
    # a freed table goes back to the system: glibc's sliding mmap threshold would keep
    # it in the heap, and the next allocation reuse it, hiding what is live at once
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    print("| export | file | wall | peak over the run | peak RSS |")
    print("| --- | --- | ---: | ---: | ---: |")
    for suffix in (".safetensors", ".npz"):
        outs = []
        for variant in ("all gathered", "streamed"):
            out = work / f"{variant.split()[0]}{suffix}"
            cmd = [sys.executable, "-c", _CHILD, variant.split()[0], str(out)]
            cmd += [json.dumps(sizes), str(root / "tests"), str(dim)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(r.stdout + r.stderr)
            m = json.loads(r.stdout.splitlines()[-1])
            over = (m["hwm"] - m["before"]) / 2**20
            print(
                f"| {variant} | {suffix} | {m['seconds']:.2f} s | {over:,.0f} MiB | "
                f"{m['hwm'] / 2**20:,.0f} MiB |"
            )
            outs.append(out)
        a, b = (_tensors(p) for p in outs)
        assert sorted(a) == sorted(b)
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
        del a, b
        for p in outs:
            p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="128,384,256,256", help="table sizes in MiB")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.mib.split(",")]
    print(
        f"{len(sizes)} tables of {', '.join(map(str, sizes))} MiB (fp32, dim {args.dim}): "
        f"{sum(sizes)} MiB in all, the largest {max(sizes)} MiB\n"
    )
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        measure(args.work, sizes, args.dim)
        return
    with tempfile.TemporaryDirectory(prefix="export-gather-") as work:
        measure(Path(work), sizes, args.dim)


if __name__ == "__main__":
    main()
