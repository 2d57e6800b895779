"""The subcommands of `embarkc` (see embarkc.cli), and what several of them share."""

from __future__ import annotations

import argparse

from embarkc.diagnostics import EmbarkError


def check_planner_options(args: argparse.Namespace, path: str) -> None:
    """Reject a non-positive `--time-limit` and a negative `--seed` (where given)."""
    limit = getattr(args, "time_limit", None)
    if limit is not None and not limit > 0:
        raise EmbarkError.at(path, f"--time-limit must be positive, got {limit:g}")
    seed = getattr(args, "seed", None)
    if seed is not None and seed < 0:
        raise EmbarkError.at(path, f"--seed must not be negative, got {seed}")
