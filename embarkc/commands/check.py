"""`embarkc check SPEC|PLAN...`: validate specs and plans, print a one-screen summary of each.

A spec is parsed and lowered. A plan (a plan.json) is held to the plan-v1 contract
(`embark_runtime.plan.load_plan`) and, when the spec it names (`source.spec`, relative
to the current folder or to the plan's) is found unchanged (same sha256), to every rule
of the independent checker `embarkc.planner.check` against that spec: the plan matches
the program, memory fits with the spec's headroom, the spec's placement constraints
hold (a fixed strategy's ignored constraints are warnings). Without that spec only the
contract is checked, and the summary says so.

Exit 0 when every file is valid, 2 when any is not (its diagnostics on stderr; the
other files are still checked). `--dump ast` prints the parse tree of a spec's root
file (one spec only), `--dump ir` the lowered `Program` as JSON, instead of the summary;
with several specs `--dump ir` prints one JSON object mapping each path, as given, to its
IR, and only when every spec lowers (stdout holds all of them or nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from embarkc.diagnostics import EXIT_OK, EXIT_USER_ERROR, Diagnostic, EmbarkError, print_warnings

HELP = "validate specs or plans and print a summary (tables, parameters, memory, GPUs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "specs",
        nargs="+",
        metavar="SPEC|PLAN",
        help="spec files (.embark) or plans (.json, or folders compiled into)",
    )
    p.add_argument(
        "--dump",
        choices=("ast", "ir"),
        help="print the parse tree (of one spec) or the IR (JSON) instead; with several "
        "specs, ir is one JSON object mapping each path to its IR",
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="summaries as text (default) or JSON on stdout: one object, a list of them "
        "for several files (a file that fails is {file, ok: false}, its errors on stderr)",
    )


def summary_rows(program: Any) -> list[tuple[str, str]]:
    """The summary as (label, value) rows; shared by the plain and the rich output."""
    from embark_runtime.formatting import format_bytes, format_count

    topo = program.topology
    gpus = topo.world_size
    total = program.embedding_bytes
    weights = sum(t.rows * t.row_weight_bytes for t in program.tables)
    per_gpu = topo.hbm_bytes - program.options.memory_headroom
    capacity = per_gpu * gpus
    preset = f" ({topo.preset})" if topo.preset else ""
    kinds: dict[str, int] = {}
    for t in program.tables:
        kinds[t.optimizer.kind] = kinds.get(t.optimizer.kind, 0) + 1
    opts = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    headroom = (
        f", {format_bytes(program.options.memory_headroom)} kept free"
        if program.options.memory_headroom
        else ""
    )
    # a table pinned to dp has a copy on every GPU
    dp = [
        t
        for t in program.tables
        if (c := program.constraint_of.get(t.name)) is not None and c.cluster == "dp"
    ]
    used = total + (gpus - 1) * sum(t.bytes for t in dp)
    copies = (
        f"; the {len(dp)} table{'s' if len(dp) != 1 else ''} pinned to dp counted on every GPU"
        if dp and gpus > 1
        else ""
    )
    # only for specs that set them: the summary of every other spec reads as before
    training: list[tuple[str, str]] = []
    scheduled = [t for t in program.tables if t.optimizer.schedule is not None]
    if scheduled:
        training.append(("scheduled rates", f"{len(scheduled)} of {len(program.tables)} tables"))
    dense = program.model.optimizer
    if dense.schedule is not None:
        training.append(
            ("dense rate", f"{dense.kind} lr {dense.lr:g}, {dense.schedule.runtime().describe()}")
        )
    if program.model.precision != "fp32":
        training.append(("dense precision", program.model.precision))
    return [
        (
            "GPUs",
            f"{gpus} = {topo.nodes} node{'s' if topo.nodes != 1 else ''} x {topo.gpus_per_node}{preset}, {topo.arch}",
        ),
        ("HBM per GPU", f"{format_bytes(topo.hbm_bytes)}{headroom}"),
        ("tables", f"{len(program.tables)} ({opts})"),
        ("features", f"{len(program.features)}"),
        ("parameters", f"{program.parameters:,} ({format_count(program.parameters)})"),
        ("weights", format_bytes(weights)),
        ("with optimizer state", format_bytes(total)),
        ("lookups per sample", f"{program.lookups_per_sample:g}"),
        ("batch", f"{program.batch_size:,} ({program.batch_size // gpus:,} per GPU)"),
        _memory_row(topo, used, capacity, copies),
        *training,
    ]


def _memory_row(topo: Any, used: float, capacity: float, copies: str) -> tuple[str, str]:
    """The summary's memory line: HBM's share taken, or, for tables beyond HBM on a
    cluster with host memory, that the planner puts some of them there."""
    from embark_runtime.formatting import format_bytes

    host = (topo.host_memory or 0) * topo.nodes
    if used > capacity and host:
        return (
            "memory use",
            f"{100 * used / capacity:.1f}% of {format_bytes(capacity)} of HBM: the planner "
            f"keeps tables in host memory ({format_bytes(host)}) behind HBM caches "
            "(docs/host_tier.md)",
        )
    return (
        "memory use",
        f"{100 * used / capacity:.1f}% of {format_bytes(capacity)} "
        f"({format_bytes(capacity - used)} headroom{copies})",
    )


def run(args: argparse.Namespace) -> int:
    from embark_runtime.plan import PlanError
    from embarkc.frontend import dump_ast, dump_ir, is_plan_file, load_program, plan_in_folder

    several = len(args.specs) > 1
    if args.dump == "ast" and several:
        raise EmbarkError.at(
            args.specs[1],
            "--dump ast takes one spec (parse trees are text: several would run together)",
            hint="run it once per spec, or use --dump ir (one JSON object for all specs)",
        )
    irs: dict[str, Any] = {}
    status = EXIT_OK
    as_json = getattr(args, "format", "text") == "json" and not args.dump
    results: list[dict[str, Any]] = []
    for given in args.specs:
        before = len(results)
        try:
            try:
                spec = plan_in_folder(given)
            except EmbarkError as e:
                print(e.render(), file=sys.stderr)
                status = EXIT_USER_ERROR
                continue
            if not Path(spec).exists():
                what = {".json": "plan file", ".embark": "spec file"}.get(Path(spec).suffix, "file")
                print(EmbarkError.at(spec, f"no such {what}").render(), file=sys.stderr)
                status = EXIT_USER_ERROR
                continue
            if Path(spec).suffix != ".embark" and is_plan_file(spec) and Path(spec).is_file():
                try:
                    if args.dump:
                        raise EmbarkError.at(
                            spec, f"--dump {args.dump} is for specs; this is a plan file"
                        )
                    _check_plan_file(spec, results if as_json else None)
                except EmbarkError as e:
                    print(e.render_with_files(), file=sys.stderr)
                    status = EXIT_USER_ERROR
                except PlanError as e:
                    print(str(e), file=sys.stderr)
                    status = EXIT_USER_ERROR
                continue
            try:
                if args.dump == "ast":
                    print(dump_ast(spec))
                    continue
                warnings: list[Diagnostic] = []
                program = load_program(spec, warnings)
                print_warnings(warnings)
            except EmbarkError as e:
                print(e.render(), file=sys.stderr)
                status = EXIT_USER_ERROR
                continue
            if args.dump == "ir":
                if several:
                    irs[spec] = json.loads(dump_ir(program))
                else:
                    print(dump_ir(program))
                continue
            if as_json:
                from embarkc.interop.summaries import spec_summary

                results.append(spec_summary(spec, program))
            else:
                _print_summary(spec, program)
        finally:
            if as_json and len(results) == before:
                results.append({"file": given, "ok": False})
    if args.dump == "ir" and several and status == EXIT_OK:
        print(json.dumps(irs, indent=2))
    if as_json:
        print(json.dumps(results if several else results[0], indent=2))
    return status


def _spec_of_plan(plan: Any, path: str) -> tuple[Any, str]:
    """The program of the spec `plan` names when it is found unchanged, and a line that
    says what the plan was checked against."""
    from embarkc.frontend import find_plan_spec, load_program

    spec, state = find_plan_spec(plan, path)
    if state == "changed":
        return None, (
            f"{spec} changed since this plan was made: checked against the contract "
            "only (re-plan the spec to check everything)"
        )
    if state == "missing":
        return None, f"{spec} not found: checked against the contract only"
    return load_program(str(spec)), f"{spec} (unchanged): checked against it"


def _check_plan_file(path: str, results: list[dict[str, Any]] | None = None) -> None:
    """Validate the plan at `path` (EmbarkError or PlanError naming the broken rule) and
    print its summary (with `results`, append its JSON summary there instead)."""
    from embark_runtime.plan import load_plan
    from embarkc.planner import check_against_spec, layout_is_stale, stale_reason

    plan = load_plan(path)
    program, against = _spec_of_plan(plan, path)
    if program is not None:
        check_against_spec(program, plan, path)
    # (edited figures of an unchanged layout: check_plan's estimate warning names each)
    if layout_is_stale(plan):
        why = stale_reason(plan)
        print(
            f"{path}: warning: {why}: its estimate is not embarkc's for this plan "
            "(`embarkc diff` and `report` re-cost it from the spec, `embarkc simulate` "
            "counts it)",
            file=sys.stderr,
        )
    if results is not None:
        from embarkc.interop.summaries import plan_file_summary

        results.append(plan_file_summary(path, plan, against))
        return
    _print_rows(f"{path}: ok", plan_summary_rows(plan, against))


def plan_summary_rows(plan: Any, against: str) -> list[tuple[str, str]]:
    """A plan's summary as (label, value) rows."""
    from embark_runtime.formatting import format_bytes, format_ms
    from embarkc.planner import fixed_strategy_note

    topo = plan.topology
    kinds: dict[str, int] = {}
    for c in plan.clusters:
        label = c.kind + (f" {c.communication}" if c.communication else "")
        label += f" {c.gradient_exchange}" if c.gradient_exchange else ""
        kinds[label] = kinds.get(label, 0) + len(c.tables)
    clusters = ", ".join(f"{k} {n} table{'s' if n != 1 else ''}" for k, n in kinds.items())
    mem = plan.memory_by_rank()
    worst = max(range(len(mem)), key=lambda r: (mem[r], -r))
    est = plan.estimate
    slow = max(est.per_rank, key=lambda r: (r.time, -r.rank), default=None)
    critical = f" (critical rank {slow.rank})" if slow is not None else ""
    info = plan.planner
    rows = [
        ("spec", against),
        (
            "GPUs",
            f"{topo.world_size} = {topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
            f"{topo.gpus_per_node}, {topo.arch}",
        ),
        (
            "tables",
            f"{len(plan.tables)} in {len(plan.clusters)} cluster"
            f"{'s' if len(plan.clusters) != 1 else ''} ({clusters})",
        ),
        ("shards", f"{len(plan.shards)}"),
        ("batch", f"{plan.batch_size:,} ({plan.batch_size // topo.world_size:,} per GPU)"),
        ("step time", f"{format_ms(est.step_time)} estimated{critical}"),
        (
            "memory",
            f"at most {format_bytes(mem[worst])} of weights and state on a GPU (rank "
            f"{worst}) of {format_bytes(topo.hbm_bytes)}",
        ),
        (
            "planner",
            f"strategy {info.strategy}, solver {info.solver}, status {info.status}"
            + (f"; {note}" if (note := fixed_strategy_note(info)) else ""),
        ),
    ]
    host = [s for s in plan.shards if s.tier == "host"]
    if host:
        per_node = [0] * topo.nodes
        for rank, b in enumerate(plan.host_memory_by_rank()):
            per_node[rank // topo.gpus_per_node] += b
        node = max(range(topo.nodes), key=lambda n: (per_node[n], -n))
        cached = sum(s.cache_rows or 0 for s in host)
        rows.insert(
            -1,
            (
                "host tier",
                f"{len(host)} cell{'s' if len(host) != 1 else ''} in host memory, "
                f"{cached:,} rows cached in HBM; at most {format_bytes(per_node[node])} on a "
                f"node (node {node})",
            ),
        )
    return rows


def _print_summary(spec: str, program: Any) -> None:
    _print_rows(f"{spec}: ok", summary_rows(program))


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows:
            table.add_row(label, value)
        Console().print(table)
        return
    width = max(len(label) for label, _ in rows)
    print(title)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
