"""Planner speed and quality:
`python bench/plan_speed.py [--scale] [--quality] [--cpsat S] [--command] [--mid]`.

* speed: greedy for T510 on 16 x 8 GPUs; with --scale also 5,000 generated tables on
  128 x 8 GPUs (wall time and peak RSS of this process);
* quality: for every paper workload at 1 x 8, 4 x 8 and 16 x 8 GPUs, the step time of the
  greedy plan and the CP-SAT plan (time limit --cpsat seconds) by embarkc's cost model,
  against every fixed baseline, and the CPU and wall time of the whole CP-SAT plan
  command (greedy + refinement; the machine may be shared, so CPU time is the figure),
  and the planner's lower bound on any plan (`planner.lower_bound`) with the largest
  speed-up over the best fixed strategy that it leaves possible, and the CP-SAT plan's
  critical path (`estimate.critical_path`: every phase at its slowest rank);
* command (--command): the whole `embarkc plan` command as a user runs it, a process of its
  own from Python's start to its exit, on the paper specs at 16 x 8 GPUs with
  `--time-limit` 2, 5, 10 and 30, and on 5,000 generated tables on 128 x 8 GPUs
  (`embarkc.workload.generated_spec`) at the default 30 s: the plan's step time, the
  planner's own wall time as printed, and the process's wall and CPU seconds and peak RSS
  (against the limit: the whole command must end within it).
* mid (--mid): generated programs of 350 to 1,000 tables on 256 to 1,024 GPUs planned as
  `embarkc plan` does at the default 30 s (`plan_program`, deterministic work counts),
  with and without the start on the column-wise strategy's grids
  (`search.starts.fine_column_start`), against the column-wise and table-wise strategies.
Prints markdown tables (what bench/results_planner.md records).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embarkc.planner import plan_program
from embarkc.planner.cost import CostModel
from embarkc.planner.search.runs import greedy
from embarkc.workload import generated_program, generated_spec, program_from_workload

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads"
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


def timed_process(cmd: list[str]) -> tuple[str, float, resource.struct_rusage]:
    """`cmd` run as a process of its own: its output (stdout and stderr), its wall seconds
    and its resource usage (CPU seconds, peak RSS); a failure exits with its output."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text}")
    return text, wall, usage


def _plan_command(spec: Path, limit: float | None, out: Path) -> str:
    """One `embarkc plan` process: a markdown cell of what it planned and took."""
    cmd = [sys.executable, "-m", "embarkc.cli", "plan", str(spec), "-o", str(out)]
    if limit is not None:
        cmd += ["--time-limit", f"{limit:g}"]
    text, wall, usage = timed_process(cmd)
    step = re.search(r"step time ([0-9.]+) ms", text)
    planner = re.search(r"wall time ([0-9.]+) s", text)
    notes = [
        n
        for n, said in (
            ("cut", "cut short"),
            ("cut in its first start", "in its first start"),
            ("a fixed strategy", "the fixed strategy"),
            ("no baselines", "not costed"),
        )
        if said in text
    ]
    return (
        f"{step.group(1) if step else '?'} ms{' (' + ', '.join(notes) + ')' if notes else ''}, "
        f"{planner.group(1) if planner else '?'} s; {wall:.2f} / "
        f"{usage.ru_utime + usage.ru_stime:.2f} s, {usage.ru_maxrss / 1024:.0f} MiB"
    )


def command() -> None:
    limits = (2.0, 5.0, 10.0, 30.0)
    print(
        "Each cell: step time, the planner's wall time as printed; the process's wall / CPU "
        "seconds and peak RSS.\n"
    )
    print("| spec | " + " | ".join(f"--time-limit {L:g}" for L in limits) + " |")
    print("| --- " * (len(limits) + 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        for name in NAMES:
            spec = ROOT / "specs" / "paper" / f"{name}.embark"
            cells = [_plan_command(spec, L, out) for L in limits]
            print(f"| {name} (16 x 8) | " + " | ".join(cells) + " |", flush=True)
        gen = Path(tmp) / "generated5000.embark"
        gen.write_text(generated_spec(generated_program(5000, 128, 8)))
        cell = _plan_command(gen, None, out)
        blanks = " | ".join("" for _ in limits[:-1])
        print(f"| 5,000 generated tables (128 x 8), default limit | {blanks} | {cell} |")


MID = ((350, 32), (350, 128), (600, 64), (800, 64), (1000, 32), (1000, 64), (1000, 128))


def mid() -> None:
    import embarkc.planner.search.runs as search_runs
    from embarkc.planner import baselines as bl

    real = search_runs.fine_column_start
    print(
        "| tables | GPUs | plan at 30 s (ms) | wall (s) | without the column-wise start (ms) "
        "| wall (s) | column-wise (ms) | table-wise (ms) | lower bound (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tables, nodes in MID:
        prog = generated_program(tables, nodes, 8)
        cells = []
        for fine in (real, lambda cm, units, start: dict(start)):
            search_runs.fine_column_start = fine
            t = time.perf_counter()
            plan = plan_program(prog, time_limit=30.0)
            wall = time.perf_counter() - t
            got = f"{plan.estimate.step_time * 1e3:.3f}"
            fixed = (plan.planner.model_extra or {}).get("fixed_strategy")
            cells += [got + (f" ({fixed})" if fixed else ""), f"{wall:.1f}"]
        search_runs.fine_column_start = real
        cm = CostModel(prog)
        fixed_times = [
            cm.step_time(bl.build_layout(cm, s)) * 1e3 for s in ("column-wise", "table-wise")
        ]
        bound = (plan.planner.model_extra or {}).get("lower_bound", 0.0) * 1e3
        print(
            f"| {tables} | {nodes * 8} | {' | '.join(cells)} | {fixed_times[0]:.3f} "
            f"| {fixed_times[1]:.3f} | {bound:.3f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", action="store_true", help="also the 5,000-table case")
    ap.add_argument("--quality", action="store_true", help="plan quality tables")
    ap.add_argument("--cpsat", type=float, default=2.0, help="CP-SAT time limit (s)")
    ap.add_argument(
        "--command", action="store_true", help="the whole plan command at several limits"
    )
    ap.add_argument("--mid", action="store_true", help="mid-sized generated programs at 30 s")
    a = ap.parse_args()
    if a.mid:
        mid()
        return
    if a.command:
        command()
        return
    speed(a.scale)
    if a.quality:
        quality(a.cpsat)


if __name__ == "__main__":
    main()
