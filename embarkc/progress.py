"""Planning with a status line: every command that plans a spec (`plan`, `compile`,
`simulate`, `report SPEC`, `diff SPEC SPEC`) can search for up to its time limit, and a
silent terminal for 30 s reads as a hang. On a terminal, `planned` shows what the planner
is doing (the greedy's starts, its kicks, CP-SAT, the phase pass), how far through its
time limit it is and the best step time so far, through rich's transient status line, which
is erased when the plan is done. Not on a terminal (a pipe, CI, a test) it prints nothing, so
what commands write there is unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

from embark_runtime.formatting import format_ms


def on_terminal() -> bool:
    """Whether standard error is a terminal a person watches."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def status_text(what: str, stage: str, done: float, best: float) -> str:
    """The status line: `planning X: cp-sat 40 %, best step time 1.234 ms`."""
    pct = min(100.0, max(0.0, done * 100))
    return f"planning {what}: {stage} {pct:.0f} %, best step time {format_ms(best)}"


def planned(program: Any, what: str, *, quiet: bool = False, **kwargs: Any) -> Any:
    """`plan_program(program, **kwargs)`, with a status line on a terminal naming `what` (the
    spec's path) unless `quiet`."""
    from embarkc.planner import plan_program

    if quiet or not on_terminal():
        return plan_program(program, **kwargs)
    from rich.console import Console

    # standard error is a terminal here: let rich draw on it whatever it guesses of it
    console = Console(stderr=True, force_terminal=True)
    with console.status(f"planning {what} ...") as status:

        def progress(stage: str, done: float, best: float) -> None:
            status.update(status_text(what, stage, done, best))

        return plan_program(program, progress=progress, **kwargs)
