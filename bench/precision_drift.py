"""How far a mixed-precision run drifts from the fp32 reference (docs/language.md, "Mixed
precision"): compile the SGD copy of tiny.embark with tables pinned to every cluster kind
(as tests/test_e2e_train.py's `sgd_spec`), train it sharded on 4 CPU ranks under
`--precision P`, train `train.py --reference --numerics fp32`, and print per precision
the largest relative loss difference over the steps, the largest table weight difference,
and the mean loss of the first and last ten steps.

    python bench/precision_drift.py [--steps 50] [--precision bf16 ...] [--device cpu|cuda]

fp16 needs CUDA. Results and their commands go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PINS = (
    "  communication hierarchical\n  table country { cluster dp }\n  table item { cluster ub }\n"
    "  table history { cluster rb }\n  table tag { cluster rb }\n"
)


def _spec(work: Path) -> Path:
    text = re.sub(
        r"optimizer (sgd|adagrad|rowwise_adagrad|adam) \{ lr [0-9.]+ \}",
        "optimizer sgd { lr 0.5 }",
        (ROOT / "specs" / "tiny.embark").read_text(),
    )
    spec = work / "tiny_sgd.embark"
    spec.write_text(text.replace("  seed 0\n", "  seed 0\n" + PINS))
    return spec


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-4000:])


def _losses(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if not r.get("eval")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--precision", nargs="+", default=["bf16"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from embark_runtime.trainer import load_exported
    from embarkc.cli import main as embarkc

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = work / "out"
        assert embarkc(["compile", str(_spec(work)), "-o", str(out), "-q"]) == 0
        common = ["--steps", str(a.steps), "--eval-batches", "0", "--device", a.device]
        _run(
            [sys.executable, str(out / "train.py"), "--reference", "--numerics", "fp32"]
            + [*common, "--log-json", str(work / "r.jsonl"), "--export-embeddings"]
            + [str(work / "r.npz")]
        )
        ref_loss, ref_tables = _losses(work / "r.jsonl"), load_exported(work / "r.npz")
        print(
            f"{'precision':<10} {'max rel loss diff':>18} {'max weight diff':>16} "
            f"{'loss first 10':>14} {'loss last 10':>13}"
        )
        for p in a.precision:
            _run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                + ["--nproc-per-node", "4", str(out / "train.py"), "--quiet", "--precision", p]
                + [*common, "--log-json", str(work / f"{p}.jsonl"), "--export-embeddings"]
                + [str(work / f"{p}.npz")]
            )
            loss, tables = _losses(work / f"{p}.jsonl"), load_exported(work / f"{p}.npz")
            rel = max(abs(x - y) / y for x, y in zip(loss, ref_loss, strict=True))
            weight = max(float(np.abs(tables[n] - ref_tables[n]).max()) for n in tables)
            print(
                f"{p:<10} {rel:>18.2e} {weight:>16.2e} {np.mean(loss[:10]):>14.5f} "
                f"{np.mean(loss[-10:]):>13.5f}"
            )
        print(
            f"{'fp32 ref':<10} {'':>18} {'':>16} {np.mean(ref_loss[:10]):>14.5f} "
            f"{np.mean(ref_loss[-10:]):>13.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
