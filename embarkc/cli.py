"""The `embarkc` command line.

Each subcommand lives in `embarkc/commands/<name>.py` and exposes `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`. Command modules import their heavy
dependencies (torch, ortools, matplotlib) inside `run`, so `embarkc --help` and
`embarkc check` start fast.

Every user error is an `EmbarkError` (or a `PlanError` from the plan loader): it is
printed to stderr and the process exits with code 2. Nothing reaches the user as a
traceback unless EMBARKC_DEBUG=1 is set.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from embarkc import __version__
from embarkc.diagnostics import EXIT_USER_ERROR, EmbarkError

COMMANDS = ("check", "fmt", "plan", "simulate", "compile", "diff", "report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embarkc",
        description="Plan embedding sharding for recommendation models and generate the trainer.",
    )
    parser.add_argument("--version", action="version", version=f"embarkc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"embarkc.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"embarkc.commands.{name}":
                raise
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return int(args._run(args) or 0)
    except EmbarkError as e:
        print(e.render_with_files(), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("embarkc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`embarkc check x | head`): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:  # the last line of defence: a bug, reported as one
        from embark_runtime.plan import PlanError

        if isinstance(e, PlanError):
            print(str(e), file=sys.stderr)
            return EXIT_USER_ERROR
        if os.environ.get("EMBARKC_DEBUG"):
            raise
        print(
            f"embarkc: internal error: {type(e).__name__}: {e}\n"
            "  this is a bug in embarkc; rerun with EMBARKC_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
