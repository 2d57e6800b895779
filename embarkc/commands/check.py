"""`embarkc check SPEC...`: validate specs and print a one-screen summary of each.

Exit 0 when every spec is valid, 2 when any is not (its diagnostics on stderr; the
other specs are still checked). `--dump ast` prints the parse tree of the root file,
`--dump ir` the lowered `Program` as JSON, instead of the summary.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from embarkc.diagnostics import EXIT_OK, EXIT_USER_ERROR, EmbarkError

HELP = "validate specs and print a summary (tables, parameters, memory, GPUs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.embark)")
    p.add_argument(
        "--dump", choices=("ast", "ir"), help="print the parse tree or the IR (JSON) instead"
    )


def summary_rows(program: Any) -> list[tuple[str, str]]:
    """The summary as (label, value) rows; shared by the plain and the rich output."""
    from embarkc.units import format_bytes, format_count

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
        (
            "memory use",
            f"{100 * total / capacity:.1f}% of {format_bytes(capacity)} "
            f"({format_bytes(capacity - total)} headroom)",
        ),
    ]


def run(args: argparse.Namespace) -> int:
    from embarkc.frontend import dump_ast, dump_ir, load_program

    status = EXIT_OK
    for spec in args.specs:
        try:
            if args.dump == "ast":
                print(dump_ast(spec))
                continue
            program = load_program(spec)
        except EmbarkError as e:
            print(e.render(), file=sys.stderr)
            status = EXIT_USER_ERROR
            continue
        if args.dump == "ir":
            print(dump_ir(program))
            continue
        _print_summary(spec, program)
    return status


def _print_summary(spec: str, program: Any) -> None:
    rows = summary_rows(program)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{spec}: ok", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows:
            table.add_row(label, value)
        Console().print(table)
        return
    width = max(len(label) for label, _ in rows)
    print(f"{spec}: ok")
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
