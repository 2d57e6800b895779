"""`embarkc simulate SPEC|PLAN`: count a plan's traffic and work on sampled batches.

Draws `--batches` real batches from the synthetic generator the trainer uses, counts per
rank the ids looked up, distinct rows, HBM bytes and the bytes over NVLink and the
network per cluster (docs/communication.md), turns them into a step time with the same
hardware numbers as the planner (`embarkc.simulate.step_time_of`), and reports how far
the plan's own estimate is from the counted figures. A SPEC is planned first (with the
spec's options, or `--strategy` / `--solver`); a PLAN (a plan.json) is used as it is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from embark_runtime.formatting import format_bytes, format_ms
from embarkc.diagnostics import EXIT_OK, Diagnostic, print_warnings

HELP = "count a plan's traffic and work on sampled batches and estimate its step time"

MAX_BATCHES = 10_000
"""The most batches one simulation draws."""

SHOWN_BATCHES = 12
"""Up to this many batches, each one's step time is printed; beyond, min, median, max."""

SHOWN_RANKS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        metavar="SPEC|PLAN",
        help="a spec (.embark) or a plan (.json, or a folder compiled into)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=2,
        metavar="K",
        help=f"batches to draw (2, at most {MAX_BATCHES:,}); consecutive steps, so more "
        "batches warm a host-tier plan's caches",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="data seed (0)")
    p.add_argument("--strategy", help="planning strategy for a SPEC (default: the spec's)")
    p.add_argument("--solver", choices=("greedy", "cp-sat"), help="solver for a SPEC")
    p.add_argument("--time-limit", type=float, metavar="S", help="solver time limit for a SPEC")
    p.add_argument("--all-ranks", action="store_true", help="print every rank")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="the result as text (default) or as one JSON object on stdout (every rank)",
    )


def load_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """(plan, program): the plan to simulate, loaded from a plan file or planned from a
    spec, and the program behind it (a plan file's only when its spec is found unchanged,
    `embarkc.diff.program_of_plan`; else None)."""
    from embarkc.diagnostics import EmbarkError
    from embarkc.frontend import is_plan_file, plan_in_folder

    args.target = plan_in_folder(args.target)
    if not Path(args.target).exists():
        raise EmbarkError.at(args.target, "no such file")

    if is_plan_file(args.target):
        from embark_runtime.plan import load_plan

        given = [
            flag
            for flag, value in (
                ("--strategy", args.strategy),
                ("--solver", args.solver),
                ("--time-limit", args.time_limit),
            )
            if value is not None
        ]
        if given:
            print(
                f"{args.target}: warning: {', '.join(given)} ha{'ve' if len(given) > 1 else 's'} "
                "no effect on a plan file, which is simulated as it is (they plan a spec: "
                "give the spec, or re-plan it with `embarkc plan SPEC -o PLAN`)",
                file=sys.stderr,
            )
        plan = load_plan(args.target)
        program = None
        if any(s.on_host for s in plan.shards):
            # only the host tier's cold-start expectation needs the program
            from embarkc.diff import program_of_plan

            program = program_of_plan(plan, str(args.target))
        return plan, program
    from embarkc.frontend import load_program
    from embarkc.planner import warn_ignored_constraints
    from embarkc.planner.check import check_plan
    from embarkc.progress import planned

    warnings: list[Diagnostic] = []
    program = load_program(args.target, warnings)
    print_warnings(warnings)
    print(f"planning {args.target} ...", file=sys.stderr)
    plan = planned(
        program,
        str(args.target),
        strategy=args.strategy,
        solver=args.solver,
        time_limit=args.time_limit,
    )
    # a fixed strategy's ignored constraints are warnings, not a broken plan
    warn_ignored_constraints(program, plan)
    check_plan(program, plan, args.target, constraints=False, estimate=False)
    return plan, program


def run(args: argparse.Namespace) -> int:
    from embarkc.commands import check_planner_options
    from embarkc.diagnostics import EmbarkError
    from embarkc.simulate import compare_with_estimate, host_tier_comparison, simulate

    if args.batches < 1:
        raise EmbarkError.at(args.target, f"--batches must be at least 1, got {args.batches}")
    if args.batches > MAX_BATCHES:
        raise EmbarkError.at(
            args.target,
            f"--batches {args.batches:,}: at most {MAX_BATCHES:,} (each batch is drawn and "
            "counted in full; the average settles within a few)",
        )
    check_planner_options(args, args.target)
    plan, program = load_target(args)

    def progress(step: int, total: int) -> None:
        print(f"simulating batch {step + 1}/{total} ...", file=sys.stderr)

    start = time.perf_counter()
    try:
        result = simulate(plan, batches=args.batches, seed=args.seed, progress=progress)
    except ValueError as e:
        raise EmbarkError.at(args.target, str(e)) from None
    wall = time.perf_counter() - start
    tiers = host_tier_comparison(plan, result, program)
    if args.format == "json":
        import json

        from embarkc.interop.summaries import simulation_summary

        diff = compare_with_estimate(plan, result)
        out = simulation_summary(plan, result, diff, wall)
        if tiers:
            out["host_tier"] = host_tier_json(result, tiers)
        print(json.dumps(out, indent=2))
    else:
        print_result(plan, result, compare_with_estimate(plan, result), wall, args.all_ranks)
        if tiers:
            print_host_tier(plan, result, tiers)
    flagged = [t.table for t in tiers if t.flagged]
    if flagged:
        from embarkc.simulate import HIT_RATE_TOLERANCE

        print(
            f"{args.target}: warning: the counted hit rate of {', '.join(flagged)} is more "
            f"than {100 * HIT_RATE_TOLERANCE:.0f} points from the cache model's expectation "
            "for the same steps from cold caches: the planner's cache sizes rest on it "
            '(docs/host_tier.md, "Simulate")',
            file=sys.stderr,
        )
    from embarkc.planner import stale_reason

    why = stale_reason(plan)
    if why is not None:
        print(
            f"{args.target}: warning: {why}: the estimate compared above is not embarkc's "
            "for this plan (`embarkc plan` writes it anew)",
            file=sys.stderr,
        )
    return EXIT_OK


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def _pct(x: float | None) -> str:
    return "     n/a" if x is None else f"{x:+7.2f}%"


def print_result(plan: Any, result: Any, diff: dict[str, Any], wall: float, all_ranks: bool):
    topo = plan.topology
    g = topo.gpus_per_node
    print(
        f"simulated {result.batches} batch{'es' if result.batches != 1 else ''} of "
        f"{plan.batch_size:,} samples on {topo.nodes} x {g} GPUs (seed {result.seed}, "
        f"{wall:.1f} s)"
    )
    ranks = sorted(result.per_rank, key=lambda r: (-r.time, r.rank))
    many = len(ranks) > 2 * SHOWN_RANKS and not all_ranks
    shown = ranks[:SHOWN_RANKS] if many else ranks
    print(
        "  rank node        ids   distinct   HBM MB  NVLink MB  network MB"
        "      time  (sent; busiest ranks first)"
        if many
        else "  rank node        ids   distinct   HBM MB  NVLink MB  network MB      time"
    )
    for r in shown if many else sorted(shown, key=lambda r: r.rank):
        nv = sum(v["intra"] for v in r.sent.values())
        net = sum(v["inter"] for v in r.sent.values())
        print(
            f"  {r.rank:4d} {r.rank // g:4d} {r.ids:10,.0f} {r.distinct:10,.0f} "
            f"{_mb(r.hbm_bytes):>8} {_mb(nv):>10} {_mb(net):>11} {format_ms(r.time):>12}"
        )
    if many:
        times = [r.time for r in ranks]
        print(
            f"  ... {len(ranks) - len(shown)} more ranks; time min {format_ms(min(times))}, "
            f"mean {format_ms(sum(times) / len(times))}, max {format_ms(max(times))}"
        )
    print("bytes per step by cluster (MB):      intra-node   inter-node")
    for name, v in result.clusters.items():
        if v["intra"] or v["inter"] or name != "dense":
            print(f"  {name:28s} {_mb(v['intra']):>14} {_mb(v['inter']):>12}")
    print(
        f"step time {format_ms(result.step_time)} (critical rank {result.critical_rank}); "
        f"dense all-reduce {format_ms(result.dense_allreduce_time)} (apart, as in the estimate)"
    )
    if 1 < result.batches <= SHOWN_BATCHES:
        print("  per batch: " + ", ".join(format_ms(t) for t in result.step_times))
    elif result.batches > SHOWN_BATCHES:
        times = sorted(result.step_times)
        print(
            f"  per batch: min {format_ms(times[0])}, median {format_ms(times[len(times) // 2])}, "
            f"max {format_ms(times[-1])}"
        )
    from embarkc.simulate import key_window

    window = key_window(plan)
    print(
        f"  keys: sent during the previous step's dense compute, {format_ms(window)}: "
        "only key time beyond it counts"
        if window
        else "  keys: charged in full (the plan's topology gives no dense_flops)"
    )
    est = plan.estimate
    comps = (est.model_extra or {}).get("components") or {}
    crit = (est.model_extra or {}).get("critical_rank")
    by_rank = {r.rank: r for r in result.per_rank}
    sim_c = by_rank[crit].components if crit in by_rank else result.components
    where = f"rank {crit}" if crit in by_rank else "the critical rank"
    print(f"estimate vs simulated ({where}):   estimate    simulated   difference")
    for name, sim in sim_c.items():
        e = comps.get(name)
        e_txt = format_ms(e) if e is not None else "n/a"
        print(f"  {name:22s} {e_txt:>14} {format_ms(sim):>12}   {_pct(diff.get(name))}")
    print(
        f"  {'step time':22s} {format_ms(est.step_time):>14} {format_ms(result.step_time):>12}   "
        f"{_pct(diff.get('step_time'))}"
    )
    if plan.world_size > 1:
        path = (est.model_extra or {}).get("critical_path")
        print(
            f"  {'critical path':22s} {format_ms(path) if path is not None else 'n/a':>14} "
            f"{format_ms(result.critical_path):>12}   {_pct(diff.get('critical_path'))}"
        )
    if diff.get("mean_rank_time") is not None:
        print(f"  mean |difference| of the per-rank times: {diff['mean_rank_time']:.2f}%")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def host_tier_json(result: Any, tiers: list[Any]) -> dict[str, Any]:
    """`simulate --format json`'s `host_tier`: per table the counted caches against the
    expectations, and per rank the host link's bytes per step (means over the steps)."""
    from embarkc.simulate import HIT_RATE_TOLERANCE

    return {
        "tolerance": HIT_RATE_TOLERANCE,
        "tables": [t.as_dict() for t in tiers],
        "per_rank": [
            {"rank": r.rank, "host_in_bytes": r.host_in, "host_out_bytes": r.host_out}
            for r in sorted(result.per_rank, key=lambda r: r.rank)
        ],
    }


def print_host_tier(plan: Any, result: Any, tiers: list[Any]) -> None:
    n = result.batches
    print(
        f"host tier: caches replayed from cold over the {n} batch{'es' if n != 1 else ''} "
        "as the runtime runs them (LRU; rows summed over a table's host-tier cells)"
    )
    print(
        "  table              lookups       hits  evictions  host reads   hit rate"
        "  expected (cold)  steady"
    )
    for t in tiers:
        c = t.counted
        print(
            f"  {t.table:14s} {c.lookups:11,d} {c.hits:10,d} {c.evictions:10,d} "
            f"{c.host_reads:11,d} {_rate(c.hit_rate):>10} {_rate(t.cold_hit_rate):>16} "
            f"{_rate(t.steady_hit_rate):>7}" + ("  (!)" if t.flagged else "")
        )
    if any(t.cold_hit_rate is None for t in tiers):
        print(
            "  expected (cold): needs the spec (a plan file's spec, unchanged, next to it "
            "or in the current folder)"
        )
    busiest = max(result.per_rank, key=lambda r: (max(r.host_in, r.host_out), -r.rank))
    bw = plan.topology.host_bandwidth
    print(
        f"  host link per step: busiest rank {busiest.rank} {format_bytes(busiest.host_in)} "
        f"in, {format_bytes(busiest.host_out)} out (in its lookup time at "
        + (f"{bw / 1e9:g} GB/s)" if bw else "the default host bandwidth)")
    )
    if any(
        t.steady_hit_rate is not None
        and t.counted.hit_rate is not None
        and t.counted.hit_rate < t.steady_hit_rate
        for t in tiers
    ):
        print(
            "  caches start cold: hit rates of few batches are below the steady state the "
            "plan's estimate assumes (`--batches` warms them; so is the simulated lookup time "
            "above the estimate's)"
        )
