"""The cost model against the generated trainer on this machine, phase by phase.

For tiny and a criteo_kaggle-like spec (criteo_kaggle's 26 one-hot tables with their rows
divided by --rows-divisor, its dense model, a batch of --batch, laid out as 2 nodes x 2
GPUs), on 4 gloo processes:

1. `embarkc calibrate --spec SPEC` under torchrun writes a hardware file for the spec's
   shape (the memory, lookup, dense and all-to-all rates of this machine);
2. the spec with its hardware block replaced by an include of that file is compiled
   (plan and trainer);
3. the trainer runs --steps steps with --measure-phases and no phase barriers;
4. `embarkc.measured.compare` sets the plan's prediction beside the run per phase
   (critical rank and mean over ranks), and the step's wall time beside the plan's two
   step times (the largest per-rank sum and the critical path).

    python bench/model_vs_run.py                      # writes bench/results_model_vs_run.md
    python bench/model_vs_run.py --steps 10 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results_model_vs_run.md"
BIN = Path(sys.executable).parent

SHAPE = (
    "hardware {\n  nodes 2\n  gpus_per_node 2\n  hbm 32 MiB\n  hbm_bandwidth 100 GB/s\n"
    "  nvlink 50 GB/s\n  network 10 Gb/s\n  dense_flops 1 TFLOP/s\n  arch sm_80\n}"
)


def criteo_like(rows_divisor: int, batch: int) -> str:
    """criteo_kaggle.embark scaled to this machine: rows / divisor (at least 3), the batch
    given, 2 x 2 ranks of 32 MiB (the dense reserve takes 13.4 MiB of each) (so the large tables must be split)."""
    text = (ROOT / "specs" / "criteo_kaggle.embark").read_text()
    text = re.sub(r"(?s)hardware\s*\{[^}]*\}", SHAPE, text, count=1)
    text = re.sub(
        r"rows ([0-9_]+)",
        lambda m: f"rows {max(3, int(m.group(1).replace('_', '')) // rows_divisor)}",
        text,
    )
    text = re.sub(r"batch [0-9_]+", f"batch {batch}", text, count=1)
    return text + "\nplan {\n  solver greedy\n  seed 0\n}\n"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stamp() -> tuple[str, str]:
    """Now (UTC) and the tree's commit, for a results file's heading."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return when, commit


def _torchrun(args: list[str], cwd: Path) -> None:
    cmd = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "4",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_port()),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def run_one(name: str, spec_text: str, work: Path, steps: int, quick: bool) -> dict:
    from embark_runtime.plan import load_plan
    from embarkc.calibrate import with_hardware
    from embarkc.measured import as_json, compare, read_log, render

    d = work / name
    d.mkdir(parents=True)
    base = d / f"{name}.embark"
    base.write_text(spec_text)
    hw = d / f"cpu_{name}.embark"
    cal = ["-m", "embarkc.cli", "calibrate", "--spec", str(base), "-o", str(hw)]
    _torchrun(cal + (["--quick"] if quick else []), d)
    spec = d / f"{name}_calibrated.embark"
    spec.write_text(with_hardware(spec_text, hw.name))
    out = d / "build"
    r = subprocess.run(
        [str(BIN / "embarkc"), "compile", str(spec), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(f"compile {spec} failed:\n{r.stderr}")
    log = d / "log.jsonl"
    _torchrun(
        [
            str(out / "train.py"),
            "--steps",
            str(steps),
            "--measure-phases",
            "--log-json",
            str(log),
            "--quiet",
        ],
        d,
    )
    plan = load_plan(out / "plan.json")
    c = compare(plan, read_log(log), skip=min(3, steps - 1))
    return {
        "name": name,
        "hardware": hw.read_text(),
        "table": render(c, 0.2),
        "json": as_json(c),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows-divisor", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="calibrate --quick")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    specs = {
        "tiny": (ROOT / "specs" / "tiny.embark").read_text(),
        "criteo_like": criteo_like(args.rows_divisor, args.batch),
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in specs.items():
            res = run_one(name, text, Path(tmp), args.steps, args.quick)
            print(f"== {name}\n{res['table']}\n")
            results.append(res)
    if args.no_write:
        return 0
    when, commit = stamp()
    argv = " ".join(sys.argv[1:])
    lines = [
        f"# Cost model against the run (`python bench/model_vs_run.py {argv}`".rstrip()
        + f", {when}, commit {commit})",
        "",
        f"4 gloo processes on this machine ({os.cpu_count()} cores), {args.steps} steps, "
        "--measure-phases without phase barriers; each spec planned with a hardware file "
        "that `embarkc calibrate --spec` measured just before.",
        "",
    ]
    for res in results:
        j = res["json"]
        lines += [
            f"## {res['name']}",
            "",
            "```",
            res["table"],
            "```",
            "",
            f"follows: {j['follows']}",
            "",
            "<details><summary>calibrated hardware file</summary>",
            "",
            "```",
            res["hardware"].rstrip(),
            "```",
            "</details>",
            "",
        ]
    RESULTS.write_text("\n".join(lines))
    (RESULTS.with_suffix(".json")).write_text(
        json.dumps([r["json"] | {"name": r["name"]} for r in results], indent=2) + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
