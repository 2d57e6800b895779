"""Plan quality: embarkc's plans against fixed strategies, timed by the simulator.

For every paper spec (specs/paper/*.embark) and topology (16 x 8 GPUs as in the paper,
and 4 x 8, 1 x 8 to show how the plan changes), plan with embarkc (greedy, and greedy
refined by CP-SAT) and with every fixed strategy of embarkc.planner.baselines, check
every plan with the independent checker, and time all of them with `embarkc simulate`'s
counts on the SAME sampled batches (`embarkc.simulate.simulate_many`). Prints a table
per spec and the ratios the issue sets targets for (>= 2x vs table-row-wise, >= 1.3x vs
the best single fixed strategy, CP-SAT >= greedy), and writes bench/results_quality.md.

    python bench/plan_quality.py [--specs dcnv2 t200] [--topologies 16x8 4x8 1x8]
                                 [--batches 1] [--time-limit 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPECS = ("dcnv2", "t180", "t200", "t510")
TOPOLOGIES = ("16x8", "4x8", "1x8")
EMBARK = ("embark cp-sat", "embark greedy")


def plans_for(program: Any, time_limit: float) -> dict[str, Any]:
    """strategy label -> Plan, or the reason it has none (a string)."""
    from embarkc.diagnostics import EmbarkError
    from embarkc.planner import plan_program
    from embarkc.planner.baselines import FIXED

    out: dict[str, Any] = {}
    jobs: list[tuple[str, dict[str, Any]]] = [
        ("embark cp-sat", dict(strategy="embark", solver="cp-sat", time_limit=time_limit)),
        ("embark greedy", dict(strategy="embark", solver="greedy")),
    ] + [(name, dict(strategy=name)) for name in FIXED]
    for label, kw in jobs:
        start = time.perf_counter()
        try:
            out[label] = plan_program(program, baselines=False, **kw)
        except EmbarkError as e:
            out[label] = e.diagnostics[0].message
        print(f"    planned {label:15s} {time.perf_counter() - start:6.1f} s", file=sys.stderr)
    return out


def topology_arg(text: str) -> str:
    """argparse type of a topology `NODESxGPUS` (both positive integers)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"topology {text!r} is not NODESxGPUS with two positive integers (e.g. 16x8)"
        )
    return text


def positive_arg(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type: `kind` (int or float) of a value above 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
        return value

    return parse


def with_topology(program: Any, topo: str) -> Any:
    nodes, gpus = (int(x) for x in topo.split("x"))
    t = program.topology.model_copy(update={"nodes": nodes, "gpus_per_node": gpus})
    return program.model_copy(update={"topology": t})


def run_spec(spec: str, topologies: list[str], batches: int, time_limit: float) -> dict:
    from embarkc.frontend import load_program
    from embarkc.planner.check import validate_plan
    from embarkc.simulate import compare_with_estimate, simulate_many

    base = load_program(ROOT / "specs" / "paper" / f"{spec}.embark")
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    plans: list[Any] = []
    keys: list[tuple[str, str]] = []
    for topo in topologies:
        print(f"  {spec} on {topo}", file=sys.stderr)
        program = with_topology(base, topo)
        for label, plan in plans_for(program, time_limit).items():
            if isinstance(plan, str):
                rows[(topo, label)] = {"error": plan}
                continue
            bad = validate_plan(program, plan)
            rows[(topo, label)] = {
                "estimate": plan.estimate.step_time,
                "violations": [str(v) for v in bad],
                "status": plan.planner.status,
            }
            plans.append(plan)
            keys.append((topo, label))
    start = time.perf_counter()

    def progress(step: int, total: int) -> None:
        print(f"  simulating {len(plans)} plans, batch {step + 1}/{total}", file=sys.stderr)

    results = simulate_many(plans, batches=batches, seed=0, progress=progress)
    sim_wall = time.perf_counter() - start
    for key, plan, res in zip(keys, plans, results, strict=True):
        diff = compare_with_estimate(plan, res)
        rows[key].update(simulated=res.step_time, diff=diff["step_time"])
    return {"rows": rows, "sim_wall": sim_wall, "plans": len(plans)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def summarize(spec: str, topologies: list[str], res: dict) -> list[str]:
    from embarkc.planner.baselines import FIXED

    rows = res["rows"]
    out = [f"### {spec}", ""]
    out.append(
        "| strategy | "
        + " | ".join(f"{t} simulated ms (estimate, diff)" for t in topologies)
        + " |"
    )
    out.append("|---|" + "---|" * len(topologies))
    for label in (*EMBARK, *FIXED):
        cells = []
        for topo in topologies:
            r = rows.get((topo, label), {})
            if "error" in r:
                cells.append("does not fit")
            elif "simulated" in r:
                note = " **checker: " + "; ".join(r["violations"]) + "**" if r["violations"] else ""
                cells.append(
                    f"{_ms(r['simulated'])} ({_ms(r['estimate'])}, {r['diff']:+.2f}%){note}"
                )
            else:
                cells.append("-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("| topology | vs table-row-wise | vs best fixed (which) | cp-sat vs greedy |")
    out.append("|---|---|---|---|")
    for topo in topologies:
        ours = rows.get((topo, "embark cp-sat"), {}).get("simulated")
        greedy = rows.get((topo, "embark greedy"), {}).get("simulated")
        trw = rows.get((topo, "table-row-wise"), {}).get("simulated")
        fixed = [
            (rows[(topo, n)]["simulated"], n)
            for n in FIXED
            if "simulated" in rows.get((topo, n), {})
        ]
        best = min(fixed) if fixed else None
        if ours is None:
            out.append(f"| {topo} | - | - | - |")
            continue
        out.append(f"| {topo} | {trw / ours:.2f}x | " if trw else f"| {topo} | - | ")
        out[-1] += f"{best[0] / ours:.2f}x ({best[1]}) | " if best else "- | "
        out[-1] += f"{greedy / ours:.3f}x |" if greedy else "- |"
    out.append("")
    out.append(
        f"Simulation of the {res['plans']} plans on the same batches: {res['sim_wall']:.0f} s."
    )
    out.append("")
    return out


def report_head(title: str, script: str, argv: list[str] | None, note: str) -> list[str]:
    """The first lines of a results file: title, command, date, commit, machine, `note`."""
    command = f"python bench/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "?"
    return [
        f"# {title} (bench/{script})",
        "",
        f"Command: `{command.strip()}`  ",
        f"Date: {started}, commit {commit or '?'}  ",
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()} (shared with other jobs; timings are wall clock)",
        "",
        note,
        "",
    ]


def write_report(
    out: str, head: list[str], specs: list[str], part_of: Callable[[str], list[str]]
) -> None:
    """Run `part_of(spec)` for every spec, printing each part and rewriting `out` (head and
    the parts so far) after each, so that an interrupted run keeps what it measured."""
    body: list[str] = []
    for spec in specs:
        start = time.perf_counter()
        part = part_of(spec)
        part.insert(1, f"({time.perf_counter() - start:.0f} s in all)")
        print("\n".join(part), flush=True)
        body += part
        Path(out).write_text("\n".join(head + body) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), type=topology_arg)
    ap.add_argument("--batches", type=positive_arg(int), default=1)
    ap.add_argument("--time-limit", type=positive_arg(float), default=10.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_quality.md"))
    args = ap.parse_args(argv)
    head = report_head(
        "Plan quality",
        "plan_quality.py",
        argv,
        "Step times are the simulator's (`embarkc.simulate`: exact counts on "
        f"{args.batches} sampled batch(es) of the spec's batch, seed 0, every plan on the "
        "same batches, converted to time with the planner's hardware constants). "
        "`estimate` is the plan's own analytic figure and `diff` its distance to the "
        f"simulation. CP-SAT time limit {args.time_limit:g} s (deterministic). Every plan "
        "is checked by embarkc.planner.check; violations would be shown in bold.",
    )

    def part_of(spec: str) -> list[str]:
        res = run_spec(spec, args.topologies, args.batches, args.time_limit)
        return summarize(spec, args.topologies, res)

    write_report(args.out, head, args.specs, part_of)
    return 0


if __name__ == "__main__":
    sys.exit(main())
