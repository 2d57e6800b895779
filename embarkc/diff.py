"""`embarkc diff`: what plan B does differently from plan A, and what it costs.

Stages, each a plain function:

    load_side(path) -> Side               a plan file, or a spec planned on the fly
    view_of(plan, program) -> PlanView    the costs the diff needs (embarkc.review.views)
    diff_sides(a, b) -> PlanDiff          the comparison (embarkc.review.compare)
    render_markdown / render_json         (embarkc.review.render)
    render_terminal                       (embarkc.review.terminal)

This module holds the first stage and finds the program behind each side: a plan whose
own estimate does not cost its layout (another tool's, or edited after embarkc wrote it)
is re-costed with the program of the other side when it has the same inputs, else with
the spec the plan names when it is found unchanged; see `embarkc.review.views`.

Everything here is deterministic: the same inputs give byte-identical output.
"""

from __future__ import annotations

from pathlib import Path

from embark_runtime.plan import Plan, PlanError, load_plan
from embarkc.diagnostics import Diagnostic, EmbarkError, print_warnings
from embarkc.ir import Program
from embarkc.review.compare import PlanDiff, diff_views
from embarkc.review.views import needs_costing, view_of

# --------------------------------------------------------------------------- inputs


class Side:
    """One side of a diff: a plan and, when it came from a spec, the program behind it."""

    def __init__(self, label: str, plan: Plan, program: Program | None = None):
        self.label = label
        self.plan = plan
        self.program = program


def load_side(path: str) -> Side:
    """Load a plan file (or the plan.json of a folder `embarkc compile` wrote), or compile
    and plan a spec with its own options.

    Raises EmbarkError for a missing file or a bad spec and PlanError for a plan file
    that is corrupt, of another format or of another version.
    """
    from embarkc.frontend import is_plan_file, plan_in_folder

    path = plan_in_folder(path)
    p = Path(path)
    if not p.is_file():
        raise EmbarkError.at(path, "no such file" if not p.exists() else "not a file")

    if is_plan_file(p):
        return Side(path, load_plan(p))
    from embarkc.frontend import load_program
    from embarkc.planner import warn_ignored_constraints
    from embarkc.progress import planned

    warnings: list[Diagnostic] = []
    program = load_program(path, warnings)
    print_warnings(warnings)
    plan = planned(program, path)
    warn_ignored_constraints(program, plan)
    return Side(path, plan, program)


# --------------------------------------------------------------------------- the comparison


def diff_sides(a: Side, b: Side) -> PlanDiff:
    """Compare two sides; see the module docstring for where the costs come from.

    A plan file without our estimate fields is re-costed with the other side's program
    when that program has the same tables, features and cluster as the plan records.
    """
    prog_a = a.program
    prog_b = b.program
    if prog_a is None and prog_b is not None and _same_tables(a.plan, prog_b):
        prog_a = prog_b
    if prog_b is None and prog_a is not None and _same_tables(b.plan, prog_a):
        prog_b = prog_a
    if prog_a is None and needs_costing(a.plan):
        prog_a = program_of_plan(a.plan, a.label)
    if prog_b is None and needs_costing(b.plan):
        prog_b = program_of_plan(b.plan, b.label)
    va, vb = view_of(a.plan, prog_a), view_of(b.plan, prog_b)
    return diff_views(a.label, a.plan, va, b.label, b.plan, vb, a.program, b.program)


def program_of_plan(plan: Plan, plan_path: str | None = None) -> Program | None:
    """The program behind `plan` when the spec it names is there, unchanged (same
    sha256; looked for from the current folder, then from `plan_path`'s folder, as
    `embarkc check` does) and describes the inputs the plan records; None otherwise.
    Never raises: a spec that no longer loads is as good as a missing one."""
    from embarkc.frontend import find_plan_spec, load_program

    spec, state = find_plan_spec(plan, plan_path)
    if state != "unchanged":
        return None
    try:
        program = load_program(str(spec))
    except (OSError, EmbarkError):
        return None
    return program if _same_tables(plan, program) else None


def _same_tables(plan: Plan, program: Program) -> bool:
    """Whether `program` describes the inputs `plan` records (so it may re-cost it)."""
    topo = plan.topology
    return (
        [(t.name, t.rows, t.dim) for t in plan.tables]
        == [(t.name, t.rows, t.dim) for t in program.tables]
        and [(f.name, f.table, f.hotness) for f in plan.features]
        == [(f.name, f.table, f.hotness) for f in program.features]
        and (topo.nodes, topo.gpus_per_node, plan.batch_size)
        == (program.topology.nodes, program.topology.gpus_per_node, program.batch_size)
    )


def plan_error_to_embark(e: PlanError) -> EmbarkError:
    """A PlanError as the user-facing error type, hinting at what to do."""
    hint = None
    if e.rule == "version":
        hint = "re-plan the spec with this embarkc (`embarkc plan SPEC -o plan.json`)"
    elif e.rule in ("json", "format", "schema"):
        hint = "is this an embark plan file (`embarkc plan` writes one)?"
    return EmbarkError.at(e.path, f"invalid plan ({e.rule}): {e.message}", hint)
