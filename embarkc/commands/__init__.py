"""The subcommands of `embarkc` (see embarkc.cli), and what several of them share."""

from __future__ import annotations

import argparse
import math

from embarkc.diagnostics import EmbarkError


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
