"""`embarkc diff A B`: what plan B does differently from plan A, and what it costs."""

from __future__ import annotations

import argparse
import sys

HELP = "compare two plans (or specs, planned on the fly): step time, memory, placement, migration"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "a",
        metavar="A",
        help="the old plan file (plan.json, or a folder compiled into) or spec",
    )
    p.add_argument("b", metavar="B", help="the new plan file (or folder) or spec")
    p.add_argument(
        "--format",
        choices=("terminal", "md", "json"),
        default="terminal",
        help="terminal tables (default), a markdown pull-request comment, or JSON for tools",
    )
    p.add_argument(
        "--fail-if-slower",
        type=float,
        metavar="PCT",
        help="exit 1 when B's predicted step time exceeds A's by more than PCT percent",
    )
    p.add_argument(
        "--fail-if-memory-over",
        type=float,
        metavar="PCT",
        help="exit 1 when B's peak memory per GPU exceeds A's by more than PCT percent",
    )


def run(args: argparse.Namespace) -> int:
    from embark_runtime.plan import PlanError
    from embarkc import diff
    from embarkc.diagnostics import EXIT_FAILURE, EXIT_OK, EmbarkError
    from embarkc.review import compare, render, terminal

    for name in ("fail_if_slower", "fail_if_memory_over"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            flag = "--" + name.replace("_", "-")
            raise EmbarkError.at(flag, f"{flag} takes a percentage >= 0, got {value:g}")
    try:
        a = diff.load_side(args.a)
        b = diff.load_side(args.b)
    except PlanError as e:
        raise diff.plan_error_to_embark(e) from None
    d = diff.diff_sides(a, b)
    if args.format == "json":
        sys.stdout.write(render.render_json(d))
    elif args.format == "md":
        sys.stdout.write(render.render_markdown(d))
    else:
        from rich.console import Console

        # colour and the terminal's width only on a terminal; a fixed width otherwise
        tty = sys.stdout.isatty()
        console = Console(highlight=False, width=None if tty else 120, soft_wrap=not tty)
        terminal.render_terminal(d, console)
    failures = compare.gate_failures(d, args.fail_if_slower, args.fail_if_memory_over)
    for f in failures:
        print(f"embarkc diff: gate failed: {f}", file=sys.stderr)
    return EXIT_FAILURE if failures else EXIT_OK
