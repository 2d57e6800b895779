"""The planner: IR `Program` -> `embark_runtime.plan.Plan`.

    plan_program(program, strategy=, solver=, time_limit=, seed=, progress=) -> Plan
    ignored_constraints(program, plan) -> warnings for what a fixed strategy left out
    warn_ignored_constraints(program, plan): print them (commands that plan a spec)

`pipeline.py` runs the stages (fit check, fixed strategies, greedy starts and descents,
kicks, CP-SAT, fixed-strategy fallback, bound, build, checker), each a function in its
own module; `budget.py` shares the time limit between them; `build.py` turns a layout
into the plan file. This module is the planner's public face for the commands: it
imports the heavy stages only when a plan is made, so that the CLI starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embarkc.planner.budget import (
    baseline_seconds,
    baselines_fit,
    baselines_limit,
    command_reserve,
    greedy_budget,
    refine_budget,
)
from embarkc.planner.build import (
    adopt_plan,
    build_plan,
    estimate_is_stale,
    figures_digest,
    fixed_strategy_note,
    layout_digest,
    layout_is_stale,
    plan_to_json,
    round9,
    stale_reason,
)

if TYPE_CHECKING:
    from embark_runtime.plan import Plan
    from embarkc.diagnostics import Diagnostic
    from embarkc.ir import Program
    from embarkc.planner.cost import CostModel
    from embarkc.planner.search.runs import GreedyResult
    from embarkc.planner.types import Layout

__all__ = [
    "plan_program",
    "build_plan",
    "adopt_plan",
    "plan_to_json",
    "round9",
    "ignored_constraints",
    "warn_ignored_constraints",
    "check_against_spec",
    "layout_digest",
    "estimate_is_stale",
    "layout_is_stale",
    "figures_digest",
    "stale_reason",
    "fixed_plan",
    "fixed_strategy_note",
    "no_refine_message",
    "baseline_seconds",
    "baselines_fit",
    "baselines_limit",
    "command_reserve",
    "greedy_budget",
    "refine_budget",
]


def plan_program(program: Program, **kwargs: Any) -> Plan:
    """Plan `program` (`pipeline.plan_program`)."""
    from embarkc.planner.pipeline import plan_program as run

    return run(program, **kwargs)


def fixed_plan(
    program: Program, cm: CostModel, name: str, layout: Layout | None = None
) -> tuple[Layout, Plan]:
    """The fixed strategy `name`'s layout and plan file (`fixed.fixed_plan`)."""
    from embarkc.planner.fixed import fixed_plan as build

    return build(program, cm, name, layout)


def no_refine_message(g: GreedyResult, time_limit: float, budget: float) -> str:
    """What a plan says when the greedy left CP-SAT nothing (`pipeline.no_refine_message`)."""
    from embarkc.planner.pipeline import no_refine_message as message

    return message(g, time_limit, budget)


def ignored_constraints(program: Program, plan: Plan) -> list[Diagnostic]:
    """The constraints a fixed strategy's plan ignores (`check.ignored_constraints`)."""
    from embarkc.planner.check import ignored_constraints as ignored

    return ignored(program, plan)


def warn_ignored_constraints(program: Program, plan: Plan) -> None:
    """Print `ignored_constraints` on stderr (`check.warn_ignored_constraints`)."""
    from embarkc.planner.check import warn_ignored_constraints as warn

    warn(program, plan)


def check_against_spec(program: Program, plan: Plan, path: str, *, estimate: bool = True) -> None:
    """Hold `plan` to every rule of the checker against `program` (`check.check_against_spec`)."""
    from embarkc.planner.check import check_against_spec as check

    check(program, plan, path, estimate=estimate)
