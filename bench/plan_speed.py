"""Planner speed and quality: `python bench/plan_speed.py [--scale] [--quality] [--cpsat S]`.

* speed: greedy for T510 on 16 x 8 GPUs; with --scale also 5,000 generated tables on
  128 x 8 GPUs (wall time and peak RSS of this process);
* quality: for every paper workload at 1 x 8, 4 x 8 and 16 x 8 GPUs, the step time of the
  greedy plan and the CP-SAT plan (time limit --cpsat seconds) by embarkc's cost model,
  against every fixed baseline, and the CPU and wall time of the whole CP-SAT plan
  command (greedy + refinement; the machine may be shared, so CPU time is the figure),
  and the planner's lower bound on any plan (`planner.lower_bound`) with the largest
  speed-up over the best fixed strategy that it leaves possible, and the CP-SAT plan's
  critical path (`estimate.critical_path`: every phase at its slowest rank).
Prints markdown tables (what bench/results_planner.md records).
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from embarkc.planner import plan_program
from embarkc.planner.cost import CostModel
from embarkc.planner.greedy import greedy
from embarkc.workload import generated_program, program_from_workload

WORKLOADS = Path(__file__).resolve().parent.parent.parent / "shared" / "workloads"
NAMES = ("dcnv2", "t180", "t200", "t510")


def speed(scale: bool) -> None:
    print("| case | greedy wall (s) | greedy CPU (s) | step time (ms) | peak RSS (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    cases = [("T510, 16 x 8", lambda: program_from_workload(WORKLOADS / "t510.json", 16))]
    if scale:
        cases.append(("5000 tables, 128 x 8", lambda: generated_program(5000, 128, 8)))
    for name, make in cases:
        prog = make()
        t = time.perf_counter()
        c = time.process_time()
        g = greedy(CostModel(prog))
        wall = time.perf_counter() - t
        cpu = time.process_time() - c
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"| {name} | {wall:.2f} | {cpu:.2f} | {g.step_time * 1e3:.3f} | {rss:.0f} |",
            flush=True,
        )


def quality(cpsat: float) -> None:
    print(
        "| workload | GPUs | greedy (ms) | cp-sat (ms) | mean rank (ms) | status | table-wise "
        "| row-wise | column-wise | table-row-wise | data-parallel | vs TRW | vs best fixed "
        "| lower bound (ms) | best fixed / bound | critical path (ms) | plan CPU (s) "
        "| plan wall (s) |"
    )
    print("| --- " * 19 + "|")
    for name in NAMES:
        for nodes in (1, 4, 16):
            prog = program_from_workload(WORKLOADS / f"{name}.json", nodes)
            g = plan_program(prog, solver="greedy")
            cpu, wall = time.process_time(), time.perf_counter()
            c = plan_program(prog, solver="cp-sat", time_limit=cpsat, baselines=False)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best = c.estimate.step_time
            mean = sum(r.time for r in c.estimate.per_rank) / len(c.estimate.per_rank)
            base = (g.planner.model_extra or {}).get("baselines", {})
            cols = []
            for b in ("table-wise", "row-wise", "column-wise", "table-row-wise", "data-parallel"):
                cols.append(f"{base[b] * 1e3:.3f}" if b in base else "does not fit")
            trw = base.get("table-row-wise", float("nan"))
            fixed = min(base.values()) if base else float("nan")
            low = float((c.planner.model_extra or {})["lower_bound"])
            path = float((c.estimate.model_extra or {})["critical_path"])
            print(
                f"| {name} | {nodes * 8} | {g.estimate.step_time * 1e3:.3f} | {best * 1e3:.3f} "
                f"| {mean * 1e3:.3f} | {c.planner.status} | "
                + " | ".join(cols)
                + f" | {_ratio(trw, best)} "
                f"| {_ratio(fixed, best)} | {low * 1e3:.3f} | {_ratio(fixed, low)} "
                f"| {path * 1e3:.3f} | {cpu:.1f} | {wall:.1f} |",
                flush=True,
            )


def _ratio(baseline: float, best: float) -> str:
    """`baseline / best` as `2.02x`, or n/a when the baseline does not fit."""
    return "n/a" if baseline != baseline else f"{baseline / best:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", action="store_true", help="also the 5,000-table case")
    ap.add_argument("--quality", action="store_true", help="plan quality tables")
    ap.add_argument("--cpsat", type=float, default=2.0, help="CP-SAT time limit (s)")
    a = ap.parse_args()
    speed(a.scale)
    if a.quality:
        quality(a.cpsat)


if __name__ == "__main__":
    main()
