"""The cost model against the run on one GPU (issue 37's GPU check), in one command.

1. `embarkc calibrate --spec bench/gpu/tiny1.embark` on this device: the lookups through
   the generated kernels (CUDA events), the dense part, the copy rate; written as a
   hardware file for tiny1's one-GPU shape;
2. tiny1 with its hardware block replaced by an include of that file, compiled (plan and
   trainer: its plan pins one table of each cluster kind, so only the estimate changes);
3. its train.py on the device, --measure-phases without phase barriers;
4. `embarkc measured` of the plan against the log: per phase, prediction and run; the
   lookup and dense phases within --tolerance (20 %) is the aim, and said.

    python bench/gpu/calibrate_check.py [--device cuda|cpu] [--quick] [--steps 30] [--out DIR]

It needs embarkc to import (lark, jinja2, numpy, pydantic; bench/gpu/prepare.sh downloads
the wheels the GPU machine lacks and bench/gpu/calibrate.sh installs them). `--device cpu`
runs the same steps on the CPU with the GPU hidden (the tests do: it proves the harness,
not the GPU). --out keeps the hardware file, the plan, the log and the comparison (DIR/
gpu.embark, plan.json, log.jsonl, measured.txt, measured.json). Exit code: 0 every step
ran (whatever the errors: they are the measurement), 2 it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny1.embark"
AIMED = ("lookup", "dense")
"""The phases whose prediction the GPU check aims to have within the tolerance."""


def _run(cmd: list[str], env: dict[str, str], what: str, timeout: float) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{what} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="calibrate --quick (rough figures)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tolerance", type=float, default=20.0, help="percent")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    try:
        import torch
        from trainer_check import runtime_path

        from embarkc.calibrate import with_hardware
    except ImportError as e:
        print(f"cannot run: {e} (run bench/gpu/prepare.sh and bench/gpu/calibrate.sh)")
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        print("cannot run: no CUDA device (give --device cpu for the CPU dry run)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), runtime_path(work)])
        embarkc = [sys.executable, "-m", "embarkc.cli"]
        hw = work / "gpu.embark"
        cal = [*embarkc, "calibrate", "--spec", str(SPEC), "-o", str(hw)]
        print(_run(cal + (["--quick"] if args.quick else []), env, "calibrate", 600))
        spec = work / "tiny1_calibrated.embark"
        spec.write_text(with_hardware(SPEC.read_text(), hw.name))
        build = work / "build"
        _run([*embarkc, "compile", str(spec), "-o", str(build), "-q"], env, "compile", 300)
        log = work / "log.jsonl"
        # fp32 numerics: the generated kernels on CUDA (the exact mode runs torch's, in fp64)
        train = [sys.executable, str(build / "train.py"), "--device", args.device, "--quiet"]
        train += ["--numerics", "fp32"]
        train += ["--steps", str(args.steps), "--measure-phases", "--log-json", str(log)]
        print(_run(train, env, "train.py", 600).strip().splitlines()[0])
        mjson = work / "measured.json"
        measured = [*embarkc, "measured", str(build), str(log), "--json", str(mjson)]
        measured += ["--tolerance", str(args.tolerance)]
        table = _run(measured, env, "embarkc measured", 120)
        print(table)
        m = json.loads(mjson.read_text())
        for phase in AIMED:
            err = m["phases"][phase]["error_critical"]
            ok = err is not None and abs(err) * 100 <= args.tolerance
            said = "no prediction" if err is None else f"{err * 100:+.0f}%"
            print(f"aim: {phase} within {args.tolerance:g}%: {'yes' if ok else 'no'} ({said})")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            for src in (hw, build / "plan.json", log, mjson):
                shutil.copy(src, args.out / src.name)
            (args.out / "measured.txt").write_text(table)
            print(f"kept in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
