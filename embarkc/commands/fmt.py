"""`embarkc fmt SPEC...`: rewrite specs in canonical form (`--check`: only report).

Files already canonical are not touched; a byte-order mark at the start stays, and so
do CRLF line ends when the first line ends so. With `--check` nothing is written: each file
that would change is named on stdout and the exit code is 1. A spec that does not parse
is an error (exit 2); the other files are still processed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from embarkc.diagnostics import EXIT_FAILURE, EXIT_OK, EXIT_USER_ERROR, EmbarkError

HELP = "format specs canonically (--check: exit 1 if a file would change)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.embark)")
    p.add_argument(
        "--check", action="store_true", help="write nothing; list files that would change"
    )


def run(args: argparse.Namespace) -> int:
    from embarkc.emit import write_output
    from embarkc.format import format_text
    from embarkc.syntax import BOM, check_text, read_source

    status = EXIT_OK
    for spec in args.specs:
        path = Path(spec)
        try:
            try:
                # a FIFO, device or folder is refused, as by `check`, never read (a FIFO
                # would block); so is a spec above the size a spec can sensibly have
                data = read_source(path, spec)
            except OSError as e:
                raise EmbarkError.at(spec, f"cannot read spec: {e.strerror or e}") from None
            text = check_text(data, spec)
            # a byte-order mark and CRLF line ends, which some editors write, stay (as the
            # first line ends): dropping them would make the editor's next save a change
            # again, and `fmt --check` fail on every one
            new = (BOM if text.startswith(BOM) else "") + format_text(text, spec)
            first = text.find("\n")
            if first > 0 and text[first - 1] == "\r":
                new = new.replace("\n", "\r\n")
            if new == text:
                continue
            if args.check:
                print(f"would reformat {spec}")
                if status == EXIT_OK:
                    status = EXIT_FAILURE
                continue
            if os.stat(path).st_nlink > 1:
                _write_in_place(path, new.encode("utf-8"), data)
            else:
                # atomic, and through a link to the file it names (the link stays a link)
                write_output(path, new.encode("utf-8"), "the formatted spec")
        except EmbarkError as e:
            print(e.render(), file=sys.stderr)
            status = EXIT_USER_ERROR
            continue
        print(f"reformatted {spec}")
    return status


def _write_in_place(path: Path, new: bytes, old: bytes) -> None:
    """Rewrite a hard-linked spec in place, so every name of it sees the formatted text
    (an atomic rename would give `path` a new file and leave the other names with the old
    one). Safely: the old text is first saved beside it (atomically, `.NAME.fmt-backup`),
    then the file is overwritten, truncated and synced, then the copy is removed; a failure
    in between leaves the copy and says where it is."""
    from embarkc.emit import atomic_write

    backup = path.with_name(f".{path.name}.fmt-backup")
    try:
        atomic_write(backup, old, mode=0o600)
    except OSError as e:
        raise EmbarkError.at(
            str(path), f"cannot write the formatted spec: {e.strerror or e}"
        ) from None
    try:
        with open(path, "r+b") as f:
            f.write(new)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise EmbarkError.at(
            str(path),
            f"cannot write the formatted spec: {e.strerror or e}",
            hint=f"its text before formatting is kept in {backup}",
        ) from None
    backup.unlink(missing_ok=True)
