"""`embarkc plan SPEC`: plan the sharding of a spec and print where everything goes.

Prints the per-rank time and memory (the busiest ranks and a summary when there are many),
the clusters, the solver's status and the baselines; `-o` writes plan.json
(deterministic bytes; `-o -` prints it alone on stdout, the summary on stderr);
`--explain TABLE` prints the cost of every alternative for one table (kind x grid, placed
on the least-loaded ranks of the chosen plan) and why it lost. Progress goes to stderr
during long searches; `-q` prints neither progress nor the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from embark_runtime.formatting import format_bytes, format_ms
from embarkc.dense import iteration_lines
from embarkc.diagnostics import EXIT_OK, Diagnostic, EmbarkError, print_warnings
from embarkc.ir import STRATEGIES

HELP = "plan the sharding of a spec (clusters, 3D shards, ranks) and print its cost"


SHOWN_RANKS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="spec file (.embark)")
    p.add_argument(
        "-o",
        "--output",
        metavar="PLAN",
        help="write the plan (plan.json) to this file; - prints it alone on stdout (the "
        "summary then goes to stderr)",
    )
    p.add_argument("--strategy", choices=STRATEGIES, help="search or fixed baseline strategy")
    p.add_argument("--solver", choices=("greedy", "cp-sat"), help="refinement after greedy")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="S",
        help="time limit of the whole command, seconds: the greedy, then CP-SAT with what "
        "is left; the baselines' step times where they fit (default: the spec's, 30 s)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="solver seed")
    p.add_argument("--explain", metavar="TABLE", help="show every alternative for TABLE")
    p.add_argument(
        "--dump",
        choices=("ast", "ir", "plan"),
        help="print this stage on stdout and stop (not with -o)",
    )
    p.add_argument(
        "--target",
        choices=("torchrec", "hugectr"),
        help="plan only what TorchRec or HugeCTR can run (docs/interop.md); the plan says "
        "how much slower it is than the unrestricted plan",
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="the summary as text (default) or as one JSON object on stdout",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print no summary (warnings, errors and --explain still print)",
    )


def _check_output(args: argparse.Namespace) -> None:
    """Refuse, before any work, an `-o` that cannot name the plan's file: an empty one, one
    with `--dump` (which prints on stdout), a folder or a path spelt as one (`new/`, which
    the write would otherwise turn into a file named `new`)."""
    out = args.output
    if out is None:
        return
    if args.dump is not None:
        raise EmbarkError.at(args.spec, f"--dump {args.dump} prints on stdout; drop -o or --dump")
    if not out:
        raise EmbarkError.at(
            args.spec, "-o is empty", hint="give -o a file path, e.g. plan.json (or - for stdout)"
        )
    if out != "-":
        from embarkc.commands import refuse_folder_output

        refuse_folder_output(out, "the plan", "plan.json")


def _gib(x: float) -> str:
    return format_bytes(int(x))


_clock = time.perf_counter
"""The clock the overrun warning reads (a test replaces it)."""


def run(args: argparse.Namespace) -> int:
    entered = _clock()
    from embarkc.commands import check_planner_options
    from embarkc.frontend import dump_ast, dump_ir, load_program
    from embarkc.planner import plan_program, plan_to_json, warn_ignored_constraints

    check_planner_options(args, args.spec)
    _check_output(args)
    if args.format == "json" and args.explain is not None:
        raise EmbarkError.at(
            args.spec, "--explain prints a table, not JSON: drop --explain or --format json"
        )
    if args.dump == "ast":
        print(dump_ast(args.spec))
        return EXIT_OK
    warnings: list[Diagnostic] = []
    program = load_program(args.spec, warnings)
    print_warnings(warnings)
    if args.dump == "ir":
        print(dump_ir(program))
        return EXIT_OK
    if args.explain is not None and args.explain not in program.table_by_name:
        from embarkc.commands import name_hint

        hint = name_hint(args.explain, program.table_by_name)
        if not args.explain.strip():
            raise EmbarkError.at(args.spec, "--explain needs a table name", hint=hint)
        raise EmbarkError.at(args.spec, f"--explain: no table `{args.explain}`", hint=hint)
    # say what cannot be written before planning (a CP-SAT search can take its whole time
    # limit)
    if args.output and args.output != "-":
        from embarkc.commands import refuse_overwriting_inputs
        from embarkc.emit import input_paths

        # the spec, its includes and the histograms they read
        refuse_overwriting_inputs(args.output, input_paths(program), "the plan")
    start = time.perf_counter()
    kwargs = dict(
        strategy=args.strategy, solver=args.solver, time_limit=args.time_limit, seed=args.seed
    )
    if args.target:
        from embarkc.interop.targets import plan_for_target, with_target

        print(f"planning {args.spec} for {args.target} ...", file=sys.stderr)
        plan, info = plan_for_target(program, args.target, **kwargs)
        plan = with_target(plan, info, plan_program(program, baselines=False, **kwargs))
    else:
        from embarkc.progress import planned

        quiet = args.quiet or args.format != "text"
        plan = planned(program, str(args.spec), quiet=quiet, **kwargs)
    wall = time.perf_counter() - start
    warn_ignored_constraints(program, plan)
    if args.dump == "plan":
        sys.stdout.write(plan_to_json(plan))
        return EXIT_OK
    summary_to = sys.stdout
    if args.output:
        from embarkc.emit import is_stdout, write_output

        text = plan_to_json(plan)
        if args.output == "-" or is_stdout(Path(args.output)):
            # -o - or -o /dev/stdout: the plan alone on standard output (appended where it
            # stands, as any write to it), the summary on standard error
            sys.stdout.write(text)
            sys.stdout.flush()
            summary_to = sys.stderr
        else:
            write_output(
                Path(args.output),
                text.encode(),
                "the plan",
                hint="give -o a file path in a folder you can write to",
            )
    limit = program.options.time_limit if args.time_limit is None else args.time_limit
    with contextlib.redirect_stdout(summary_to):
        if args.format == "json" and not args.quiet:
            from embarkc.interop.summaries import plan_summary

            print(json.dumps(plan_summary(plan, wall, args.output), indent=2))
        elif not args.quiet:
            _print(plan, wall, args.output, limit, program)
        if args.explain:
            _explain(program, plan, args.explain)
    took = _clock() - entered
    if plan.planner.strategy in ("embark", "greedy") and took > limit:
        # the budgets are deterministic counts: what runs whatever the limit, or a machine
        # slower than the one they were measured on, can take longer (informational only:
        # the plan does not depend on the clock)
        print(
            f"warning: planning took {took:.1f} s, more than the {limit:g} s time limit: "
            f"reading the spec, placing each of its {len(program.tables)} tables once and "
            "the bound take that long whatever the limit, and the search's budget is a count "
            "of its work (the same plan on any machine), which takes longer on a busy or "
            "slower machine, or when tables are cut into many cells each",
            file=sys.stderr,
        )
    return EXIT_OK


def _print(plan: Any, wall: float, output: str | None, limit: float, program: Any) -> None:
    est = plan.estimate
    extra = est.model_extra or {}
    topo = plan.topology
    info = plan.planner
    pextra = info.model_extra or {}
    print(
        f"plan: {topo.nodes} x {topo.gpus_per_node} GPUs, step time {format_ms(est.step_time)} "
        f"(critical rank {extra.get('critical_rank', '?')})"
    )
    comp = extra.get("components", {})
    if comp:
        print("  critical rank: " + ", ".join(f"{k} {format_ms(v)}" for k, v in comp.items()))
    for line in iteration_lines(plan):
        print("  " + line)
    window = extra.get("key_window")
    if window:
        print(
            f"  keys: sent during the previous step's dense compute, {format_ms(window)} "
            f"(fp32 at {topo.dense_flops / 1e12:g} TFLOP/s): only key time beyond it counts"
        )
    elif window is not None:
        print("  keys: charged in full (the hardware gives no dense_flops)")
    path = extra.get("critical_path")
    if path and topo.nodes * topo.gpus_per_node > 1:
        print(
            f"  critical path {format_ms(path)} if every phase waited for its slowest rank "
            "(lookups, keys, results, dp exchange)"
        )
    ranks = sorted(est.per_rank, key=lambda r: (-r.time, r.rank))
    shown = ranks if len(ranks) <= 2 * SHOWN_RANKS else ranks[:SHOWN_RANKS]
    print("  rank      time     memory (weights+state)  buffers")
    for r in sorted(shown, key=lambda r: r.rank):
        mem = (r.model_extra or {}).get("memory", {})
        print(
            f"  {r.rank:4d}  {format_ms(r.time):>12}  {_gib(r.memory_bytes):>12}"
            f"  {_gib(mem.get('buffers', 0)):>12}"
        )
    if len(shown) < len(ranks):
        times = [r.time for r in ranks]
        mems = [r.memory_bytes for r in ranks]
        print(
            f"  ... {len(ranks) - len(shown)} more ranks; time min {format_ms(min(times))} "
            f"mean {format_ms(sum(times) / len(times))}; memory max {_gib(max(mems))} "
            f"mean {_gib(sum(mems) / len(mems))}"
        )
    print("clusters:")
    cells_of = Counter(plan.cluster_of(s.table).name for s in plan.shards)
    for c in plan.clusters:
        cells = cells_of[c.name]
        how = c.communication or c.gradient_exchange or ""
        print(f"  {c.name:6s} {c.kind} {how:12s} {len(c.tables):5d} tables {cells:6d} cells")
    if extra.get("host_tier"):
        from embarkc.planner.tiers import summary_lines

        for line in summary_lines(extra["host_tier"], topo.host_memory_bytes):
            print(line)
    # the plan file records CP-SAT's deterministic work, not the wall time (docs/plan.md)
    work = f" (cp-sat deterministic work {info.wall_time:.3g} s)" if info.wall_time else ""
    print(
        f"planner: strategy {info.strategy}, solver {info.solver}, status {info.status}, "
        f"seed {info.seed}, wall time {wall:.2f} s{work}"
    )
    if pextra.get("message"):
        print(f"  {pextra['message']}")
    target = pextra.get("target")
    if target:
        from embarkc.interop.summaries import target_line

        print(f"  {target_line(target)}")
    if "greedy_step_time" in pextra:
        print(f"  greedy step time {format_ms(pextra['greedy_step_time'])}")
    if info.solver == "cp-sat" and info.wall_time and pextra.get("objective") is not None:
        bound = pextra.get("bound")
        print(
            f"  cp-sat objective {format_ms(pextra['objective'])}"
            + (f", bound {format_ms(bound)}" if bound is not None else "")
            + " (of the last model it accepted)"
        )
    low = pextra.get("lower_bound")
    if low:
        print(
            f"  lower bound {format_ms(low)} for any plan (all the work spread evenly): "
            f"this plan is {100 * (est.step_time / low - 1):.1f} % above it"
        )
    if info.strategy in ("embark", "greedy") and "baselines" not in pextra:
        from embarkc.planner import baseline_seconds, baselines_limit
        from embarkc.planner.cost import CommandSize, table_facts

        size = CommandSize.of(table_facts(program))
        print(
            f"  baselines: not costed, they would take about "
            f"{baseline_seconds(size.tables, size.heads):.2g} s of the {limit:g} s time "
            f"limit; a limit of {baselines_limit(*size)} s or more costs them"
        )
    costed = pextra.get("baselines", {})
    ignoring = _ignoring_constraints(program, sorted(costed)) if program.constraints else set()
    for name, t in sorted(costed.items()):
        line = f"  baseline {name:15s} {format_ms(t):>12}  ({t / est.step_time:.2f}x the plan"
        if name in ignoring:
            # the lower bound is of the plans the spec allows; this one it does not
            line += ", ignoring the spec's constraints: not a plan of this spec"
        elif low:
            line += f", at most {t / low:.2f}x any plan"
        print(line + ")")
    if output:
        print(f"wrote {output}")


def _ignoring_constraints(program: Any, names: list[str]) -> set[str]:
    """The fixed strategies of `names` whose layout breaks a placement constraint of the
    spec (a fixed strategy is what its name says, whatever the spec pins)."""
    from embarkc.planner import fixed_plan
    from embarkc.planner.check import constraint_violations
    from embarkc.planner.cost import CostModel

    cm = CostModel(program)
    return {n for n in names if constraint_violations(program, fixed_plan(program, cm, n)[1])}


def _explain(program: Any, plan: Any, table: str) -> None:
    """Cost of each alternative kind x grid for `table`, the rest of the plan fixed."""
    from embarkc.planner.cost import CostModel, layout_of_plan
    from embarkc.planner.explain import alternatives

    cm = CostModel(program)
    layout = layout_of_plan(plan)
    rows = _each_option_once(alternatives(cm, layout, table))
    chosen = min(rows, key=lambda r: (not r["chosen"], r["step_time"]))
    print(f"explain {table}: {len(rows)} alternatives (the rest of the plan unchanged)")
    kinds = {_kind(r) for r in rows}
    if "rb-h" in kinds:
        print("  (rb-h: rb with hierarchical communication, every cell on one node)")
    if "ub-h" in kinds:
        print("  (ub-h: ub with hierarchical communication, each node's ids deduplicated)")
    print("  kind  grid      step time     memory/rank   verdict")
    for r in rows:
        print(
            f"  {_kind(r):4s}  {r['grid']:8s}  {format_ms(r['step_time']):>12}  "
            f"{_gib(r['max_memory']):>12}   {r['verdict']}"
        )
    print(f"  chosen: {_kind(chosen)} {chosen['grid']}")


def _each_option_once(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` without the alternatives that repeat the plan's own option (same kind,
    communication and grid, re-placed on the least-loaded ranks): the chosen row stands
    for that option, so that no option is listed twice."""
    chosen = {_option(r) for r in rows if r["chosen"]}
    return [r for r in rows if r["chosen"] or _option(r) not in chosen]


def _option(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["kind"], row["communication"], row["grid"])


def _kind(row: dict[str, Any]) -> str:
    if row["communication"] == "hierarchical":
        return f"{row['kind']}-h"
    return str(row["kind"])
