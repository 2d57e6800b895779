"""Plan goldens: sha256 of the plan files the planner writes for a fixed set of specs, so
that a refactor of the planner can show it writes byte-identical files.

    python scripts/plan_goldens.py --check      compare with tests/snapshots/plan_goldens.json
    python scripts/plan_goldens.py --write      record them again (after a deliberate change)
    python scripts/plan_goldens.py --check --only fuzz --jobs 2
    python scripts/plan_goldens.py --check --only fuzz --seeds 40   the first 40 fuzz specs

The cases (each `plan_program` + `plan_to_json`, as `embarkc plan` writes them):

* `paper16/NAME`: the four paper workloads at 16 x 8 GPUs, the spec's own options
  (the search, cp-sat, 30 s);
* `paper4/NAME/greedy`: the same at 4 x 8 GPUs, greedy (what tests/test_plan_goldens.py
  plans, with the first fuzz specs);
* `quality/NAME/N/greedy|cp-sat`: the 12 cases of `bench/plan_speed.py --quality` (4
  workloads at 1, 4 and 16 nodes), greedy at the default limit and cp-sat at 2 s without
  baselines, as that bench plans them;
* `fuzz/SEED/greedy|cp-sat`: 200 random specs of `bench/plan_time_fuzz.py` (seeds 0-199)
  at FUZZ_LIMIT seconds; a spec the front end or the planner refuses records the
  refusal's message instead of a plan.

Every budget of the planner is a deterministic count of work (CP-SAT runs one worker to a
deterministic time), so the plans are reproducible: the digest covers the whole file.
The one field named after the clock, `planner.wall_time`, holds CP-SAT's deterministic
time (0 for the greedy), so it is hashed as written. The one thing set aside is where the
paper workloads lie: their programs name their source `workloads/NAME.json`, so a clone
in another folder writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "snapshots" / "plan_goldens.json"
WORKLOADS = ROOT.parent / "shared" / "workloads"
NAMES = ("dcnv2", "t180", "t200", "t510")
FUZZ_SEEDS = 200
FUZZ_LIMIT = 3.0
"""The fuzz specs' time limit (s), `bench/plan_time_fuzz.py`'s default: 400 plans take
minutes, and most specs get past the greedy's first start."""
QUALITY_CPSAT = 2.0
"""`bench/plan_speed.py --quality`'s default CP-SAT limit."""


def _workloads() -> Path:
    """The paper workloads' folder, its links resolved: a plan records its spec's path
    (`source.spec`), so a checkout that reaches the same folder through a link (a
    worktree's `shared`) writes the same bytes."""
    for root in (WORKLOADS, Path("/work/shared/workloads")):
        if (root / "t510.json").exists():
            return root.resolve()
    raise SystemExit(f"plan_goldens: the paper workloads are not in {WORKLOADS}")


GROUPS = ("paper16", "paper4", "quality", "fuzz")


def case_names(groups: Iterable[str] = GROUPS, seeds: int = FUZZ_SEEDS) -> list[str]:
    """Every case's name, in the goldens' order; of the fuzz specs, the first `seeds`."""
    out: list[str] = []
    for g in groups:
        if g == "paper16":
            out += [f"paper16/{n}" for n in NAMES]
        elif g == "paper4":
            out += [f"paper4/{n}/greedy" for n in NAMES]
        elif g == "quality":
            out += [
                f"quality/{n}/{nodes}/{s}"
                for n in NAMES
                for nodes in (1, 4, 16)
                for s in ("greedy", "cp-sat")
            ]
        elif g == "fuzz":
            out += [f"fuzz/{i}/{s}" for i in range(seeds) for s in ("greedy", "cp-sat")]
        else:
            raise SystemExit(f"plan_goldens: unknown group {g!r} (one of {', '.join(GROUPS)})")
    return out


def _workload(name: str, nodes: int) -> Any:
    """The program of paper workload `name` on `nodes` nodes, its source named
    `workloads/NAME.json` whatever folder holds it: a plan file records its spec's path,
    and a clone elsewhere (CI's) must write the same bytes."""
    from embarkc.workload import program_from_workload

    prog = program_from_workload(_workloads() / f"{name}.json", nodes)
    sources = tuple(s.model_copy(update={"path": f"workloads/{name}.json"}) for s in prog.sources)
    return prog.model_copy(update={"sources": sources})


def _planner(name: str) -> Callable[[], str]:
    """A function writing the plan file's text of the case `name` (or the refusal)."""
    from embarkc.diagnostics import EmbarkError
    from embarkc.planner import plan_program, plan_to_json

    parts = name.split("/")
    if parts[0] in ("paper16", "paper4"):
        nodes = 16 if parts[0] == "paper16" else 4
        solver = parts[2] if len(parts) > 2 else None
        prog = _workload(parts[1], nodes)
        return lambda: plan_to_json(plan_program(prog, solver=solver))
    if parts[0] == "quality":
        prog = _workload(parts[1], int(parts[2]))
        if parts[3] == "greedy":
            return lambda: plan_to_json(plan_program(prog, solver="greedy"))
        return lambda: plan_to_json(
            plan_program(prog, solver="cp-sat", time_limit=QUALITY_CPSAT, baselines=False)
        )
    if parts[0] == "fuzz":
        sys.path.insert(0, str(ROOT / "bench"))
        from plan_time_fuzz import random_spec

        from embarkc.frontend import load_program_text

        seed, solver = int(parts[1]), parts[2]
        text, _ = random_spec(seed)

        def run() -> str:
            try:
                prog = load_program_text(text, f"random{seed}.embark")
                return plan_to_json(plan_program(prog, solver=solver, time_limit=FUZZ_LIMIT))
            except EmbarkError as e:
                return "refused: " + "; ".join(d.message for d in e.diagnostics)

        return run
    raise SystemExit(f"plan_goldens: unknown case {name!r}")


def digest(name: str) -> tuple[str, str, float]:
    """(name, sha256 of its plan file's text, CPU seconds it took)."""
    run = _planner(name)
    t = time.process_time()
    text = run()
    return name, hashlib.sha256(text.encode()).hexdigest(), time.process_time() - t


def compute(names: list[str], jobs: int, verbose: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    if jobs <= 1:
        results: Iterable[tuple[str, str, float]] = map(digest, names)
    else:
        pool = ProcessPoolExecutor(jobs)
        results = pool.map(digest, names, chunksize=1)
    for name, sha, cpu in results:
        out[name] = sha
        if verbose:
            print(f"{name}: {sha[:16]} ({cpu:.1f} s)", flush=True)
    return out


def load() -> dict[str, str]:
    if not GOLDENS.exists():
        return {}
    data: dict[str, str] = json.loads(GOLDENS.read_text())["plans"]
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare with the goldens")
    mode.add_argument("--write", action="store_true", help="record the goldens again")
    ap.add_argument("--only", nargs="+", default=GROUPS, help="groups of cases")
    ap.add_argument("--jobs", type=int, default=1, help="processes planning at once")
    ap.add_argument(
        "--seeds",
        type=int,
        default=FUZZ_SEEDS,
        help=f"only the first SEEDS fuzz specs (of {FUZZ_SEEDS}; a quicker check on a busy machine)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case")
    a = ap.parse_args()
    names = case_names(a.only, min(a.seeds, FUZZ_SEEDS))
    t = time.perf_counter()
    got = compute(names, a.jobs, a.verbose)
    wall = time.perf_counter() - t
    if a.write:
        plans = {**load(), **got}
        order = case_names()
        plans = {k: plans[k] for k in order if k in plans}
        GOLDENS.parent.mkdir(parents=True, exist_ok=True)
        GOLDENS.write_text(
            json.dumps(
                {"fuzz_limit": FUZZ_LIMIT, "quality_cpsat": QUALITY_CPSAT, "plans": plans},
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {len(got)} digests to {GOLDENS} in {wall:.0f} s")
        return 0
    want = load()
    missing = [n for n in names if n not in want]
    differ = [n for n in names if n in want and want[n] != got[n]]
    for n in missing:
        print(f"no golden: {n} (record it with --write)")
    for n in differ:
        print(f"DIFFERS: {n}")
    same = len(names) - len(missing) - len(differ)
    print(f"{same}/{len(names)} plan files byte-identical to the goldens ({wall:.0f} s)")
    return 1 if missing or differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
