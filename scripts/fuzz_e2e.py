"""The end-to-end fuzz of tests/test_e2e_fuzz.py over many more seeds (not run in CI):

    python scripts/fuzz_e2e.py A B WORK

Every seed in [A, B) writes `tests/spec_gen.random_spec(seed)` (a spec the planner
refuses, one that cannot fit, is passed over); those of 4 GPUs (2x2 or 1x4) are compiled with the greedy planner, checked (`embarkc check`, the independent
checker) and simulated; all of them then train 3 steps in ONE torchrun launch of 4 gloo
processes (tests/multi_train.py) and unsharded in this process, in the CPU's exact
numerics. Prints one line per seed: the largest difference of any trained table (must be
0) and of the losses (below 1e-12). Exit 1 when any seed differs, 2 when a step fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

STEPS = 3
ARGS = ("--quiet", "--steps", str(STEPS), "--eval-batches", "1")


def main(argv: list[str]) -> int:
    import numpy as np
    from multi_train import run as multi_train
    from spec_gen import random_spec
    from test_e2e_train import _env, _losses

    from embark_runtime.trainer import load_exported
    from embarkc.cli import main as embarkc

    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    first, last, work = int(argv[0]), int(argv[1]), Path(argv[2])
    work.mkdir(parents=True, exist_ok=True)
    compiled: list[tuple[int, Path]] = []
    for seed in range(first, last):
        spec = work / f"random_{seed}.embark"
        spec.write_text(random_spec(seed))
        out = work / f"random_{seed}"
        if embarkc(["compile", str(spec), "-o", str(out), "-q", "--solver", "greedy"]) != 0:
            print(f"seed {seed}: refused (its error above): passed over")
            continue
        topo = json.loads((out / "plan.json").read_text())["topology"]
        if topo["nodes"] * topo["gpus_per_node"] != 4:
            continue
        plan = str(out / "plan.json")
        if embarkc(["check", plan]) != 0 or embarkc(["simulate", plan, "--batches", "1"]) != 0:
            print(f"seed {seed}: check or simulate failed")
            return 2
        compiled.append((seed, out))
    runs = work / "runs"
    runs.mkdir(exist_ok=True)
    folders = [str(out) for _, out in compiled]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests" / "multi_train.py"), str(runs), *folders, "--", *ARGS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-6000:])
        return 2
    if multi_train([str(runs), *folders, "--", "--reference", *ARGS]) != 0:
        return 2
    bad = 0
    for i, (seed, _) in enumerate(compiled):
        ta = load_exported(runs / f"{i}.sharded.npz")
        tb = load_exported(runs / f"{i}.reference.npz")
        tables = max(float(np.abs(ta[n] - tb[n]).max()) for n in ta)
        ls, lr = _losses(runs / f"{i}.sharded.jsonl"), _losses(runs / f"{i}.reference.jsonl")
        losses = max(abs(x - y) for x, y in zip(ls, lr, strict=True))
        ok = sorted(ta) == sorted(tb) and tables == 0.0 and losses < 1e-12 and len(ls) == STEPS
        bad += not ok
        verdict = "ok" if ok else "DIFFERS"
        print(f"seed {seed}: tables differ by {tables:.3g}, losses by {losses:.3g}: {verdict}")
    print(f"{len(compiled)} specs of 4 GPUs among seeds {first}-{last - 1}, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
