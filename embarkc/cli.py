"""The `embarkc` command line.

Each subcommand lives in `embarkc/commands/<name>.py` and exposes `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`. Command modules import their heavy
dependencies (torch, ortools, matplotlib) inside `run`, so `embarkc --help` and
`embarkc check` start fast.

Every user error is an `EmbarkError` (or a `PlanError` from the plan loader): it is
printed to stderr and the process exits with code 2. Nothing reaches the user as a
traceback unless EMBARKC_DEBUG=1 is set.

When the reader of stdout or stderr goes away (`embarkc check *.json | head`), what is
still printed there is dropped and the command carries on: it writes its files and exits
with its own status (a pipeline's `pipefail` still sees an invalid plan).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO, cast

from embarkc import __version__
from embarkc.diagnostics import EXIT_USER_ERROR, EmbarkError

COMMANDS = (
    "check",
    "fmt",
    "plan",
    "simulate",
    "compile",
    "diff",
    "report",
    "measured",
    "calibrate",
    "export",
    "import",
    "profile",
    "schema",
)
MODULES = {"import": "import_"}
"""Command modules not named as their command (`import` is a Python keyword)."""


class _ReaderGone:
    """A text stream (stdout, stderr) that drops what is written once its reader has
    gone (EPIPE) instead of raising BrokenPipeError in whatever was printing.

    Its file descriptor is then pointed at the null device, so that what the stream still
    buffers, a later write through the original stream object and the interpreter's
    flush at exit go nowhere quietly too."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):
            return  # not a file (a test's capture): nothing buffered below us to drop
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _guard_streams() -> tuple[Any, Any]:
    """Wrap sys.stdout and sys.stderr in `_ReaderGone`; returns the streams it replaced."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None and not isinstance(sys.stdout, _ReaderGone):
        sys.stdout = cast(TextIO, _ReaderGone(sys.stdout))
    if sys.stderr is not None and not isinstance(sys.stderr, _ReaderGone):
        sys.stderr = cast(TextIO, _ReaderGone(sys.stderr))
    return saved


def _release_streams(saved: tuple[Any, Any]) -> None:
    """Flush the guarded streams (a reader that went away is found now, not at exit) and
    put back the streams `_guard_streams` replaced."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    sys.stdout, sys.stderr = saved


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embarkc",
        description="Plan embedding sharding for recommendation models and generate the trainer.",
    )
    parser.add_argument("--version", action="version", version=f"embarkc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = f"embarkc.commands.{MODULES.get(name, name)}"
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


GC_THRESHOLDS = (100_000, 50, 1_000)
"""The cyclic collector's thresholds while a command runs. A spec or plan of many tables
is read into hundreds of thousands of small objects that live until the command ends; at
Python's default (700, 10, 10) the collector scans them again and again, which made
reading 100,000 tables take about twice as long as the reading itself. Cycles are still
collected, less often."""


def main(argv: Sequence[str] | None = None) -> int:
    import gc

    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    saved = _guard_streams()
    try:
        return _main(argv)
    finally:
        _release_streams(saved)
        gc.set_threshold(*thresholds)


def _main(argv: Sequence[str] | None) -> int:
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
    except BrokenPipeError as e:
        # not stdout or stderr (their readers going away is absorbed by _ReaderGone): an
        # output the command could not finish, so the command failed
        print(f"embarkc: cannot write: {e.strerror or e}", file=sys.stderr)
        return EXIT_USER_ERROR
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
