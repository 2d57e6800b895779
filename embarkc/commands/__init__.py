"""The subcommands of `embarkc` (see embarkc.cli), and what several of them share."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from pathlib import Path

from embarkc.diagnostics import EmbarkError, did_you_mean


def check_planner_options(args: argparse.Namespace, path: str) -> None:
    """Reject a `--time-limit` that is not a positive number of seconds and a `--seed`
    outside [0, MAX_SEED] (where given)."""
    from embarkc.ir import MAX_SEED

    limit = getattr(args, "time_limit", None)
    if limit is not None and not 0 < limit < math.inf:
        raise EmbarkError.at(
            path, f"--time-limit must be a positive number of seconds, got {limit:g}"
        )
    seed = getattr(args, "seed", None)
    if seed is not None and seed < 0:
        raise EmbarkError.at(path, f"--seed must not be negative, got {seed}")
    if seed is not None and seed > MAX_SEED:
        raise EmbarkError.at(
            path, f"--seed must be at most {MAX_SEED} (the solver's seeds are 32-bit), got {seed}"
        )


def refuse_overwriting_inputs(output: str | Path, inputs: Iterable[str | Path], what: str) -> None:
    """Raise an EmbarkError, before any work, when the file a command would write
    (`output`, holding `what`: "the plan", "the report") is one of the files it reads:
    writing it would lose that input (`embarkc plan x.embark -o x.embark`)."""
    from embarkc.emit import same_file

    for path in inputs:
        if same_file(output, path):
            raise EmbarkError.at(
                str(output),
                f"-o names the input {path}: writing {what} there would replace it",
                hint="give -o another path",
            )


def refuse_folder_output(output: str, what: str, example: str) -> None:
    """Raise an EmbarkError, before any work, when `-o output` (a file holding `what`) is
    a folder or is spelt as one (`new/`, `new/.`: the write would otherwise make a file
    named `new`); the hint names `example` inside it."""
    last = os.path.basename(output)
    if Path(output).is_dir():
        why = "it is a folder"
    elif last in ("", ".", ".."):
        why = f"a path ending in `{last or output[-1]}` names a folder"
    else:
        return
    raise EmbarkError.at(
        output,
        f"cannot write {what}: {why}, give a file name",
        hint=f"e.g. -o {os.path.join(os.path.normpath(output), example)}",
    )


def name_hint(word: str, names: Iterable[str]) -> str:
    """A "did you mean" hint for a misspelt name, also when only its case is wrong
    (`ITEM` -> `item`); with no name close to it, the names there are (the first ten)."""
    names = sorted(names)
    same = [n for n in names if n.casefold() == word.casefold()]
    if same:
        return f"did you mean `{same[0]}`? (names are case-sensitive)"
    close = did_you_mean(word, names) or did_you_mean(word.casefold(), names)
    if close:
        return close
    more = f", ... ({len(names)} in all)" if len(names) > 10 else ""
    return "the tables are " + ", ".join(f"`{n}`" for n in names[:10]) + more
