"""`embarkc compile SPEC -o DIR`: spec -> IR -> plan -> generated trainer, kernels, launcher.

Writes into DIR (through embarkc.emit, the only stage that touches disk): plan.json,
kernels/*.cu, train.py, launch.sh, README.md and manifest.json. Files whose bytes did not
change are left alone. A file of DIR that no earlier compile wrote (a user's README.md),
the spec, a file it includes or a histogram it reads is never replaced, and nothing is
written through a link or outside DIR: the command stops before writing anything. A
compile that fails while writing (a full disk) leaves DIR as it was.
`--dump ast|ir|plan` prints that stage's value on stdout and stops (no output folder
needed).

`--plan PLAN` compiles a given plan of the spec (one reviewed with `embarkc diff`, edited
by hand, or written by another tool) instead of planning: it must pass every rule of the
independent checker against the spec (`embarkc check`), and is written as it is, its
`source` naming the spec; an estimate that no longer costs its layout (an edit, another
tool) is re-costed, with a warning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from embark_runtime.formatting import format_ms
from embarkc.commands import check_planner_options
from embarkc.diagnostics import Diagnostic, EmbarkError, print_warnings
from embarkc.ir import STRATEGIES

HELP = (
    "plan a spec (or take a plan of it, --plan) and generate its trainer (train.py, "
    "launch.sh, CUDA kernels) into a folder"
)

SOLVERS = ("greedy", "cp-sat")

TOP_LEVEL_OUTPUTS = ("plan.json", "train.py", "launch.sh", "README.md")
"""The outputs whose names do not depend on the plan (the kernels' do)."""

KERNELS = "kernels"
"""The folder of the kernels (every plan has some: each table needs its pack kernels)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="the .embark spec to compile")
    p.add_argument("-o", "--output", metavar="DIR", help="output folder (created if missing)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="planning strategy (default: the spec's, else embark)",
    )
    p.add_argument("--solver", choices=SOLVERS, help="solver (default: the spec's, else cp-sat)")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="S",
        help="time limit of the planning, seconds (default: the spec's, 30 s)",
    )
    p.add_argument("--seed", type=int, help="planner seed (default: the spec's)")
    p.add_argument(
        "--plan",
        metavar="PLAN",
        help="compile this plan of the spec (a plan.json, e.g. one reviewed with `embarkc "
        "diff`, or a folder compiled into) instead of planning; it is checked against the "
        "spec first",
    )
    p.add_argument(
        "--dump", choices=("ast", "ir", "plan"), help="print this stage on stdout and stop"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    from embarkc.frontend import dump_ast, dump_ir, load_program

    spec = args.spec
    if args.dump is None and not args.output:
        raise EmbarkError.at(spec, "no output folder", hint="pass -o DIR (or --dump ast|ir|plan)")
    if args.dump is not None and args.output is not None:
        raise EmbarkError.at(spec, f"--dump {args.dump} prints on stdout; drop -o or --dump")
    if args.output == "-":
        raise EmbarkError.at(
            spec, "-o names the output folder; `-` (stdout) holds no folder", hint="e.g. -o out"
        )
    check_planner_options(args, spec)
    if args.plan is not None:
        from embarkc.frontend import plan_in_folder

        args.plan = plan_in_folder(args.plan)  # a folder compiled into: its plan.json
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("strategy", "solver", "time_limit", "seed")
            if getattr(args, name) is not None
        ]
        if given:
            raise EmbarkError.at(
                args.plan,
                f"--plan gives the plan, so {', '.join(given)} would change nothing",
                hint=f"drop {' and '.join(given)}, or drop --plan to plan the spec anew",
            )
    if args.dump == "ast":
        print(dump_ast(spec))
        return 0

    warnings: list[Diagnostic] = []
    program = load_program(spec, warnings)
    print_warnings(warnings)
    if args.dump == "ir":
        print(dump_ir(program))
        return 0

    from embarkc.emit import check_overwrites, input_paths, same_file

    inputs = input_paths(program)
    if args.plan is not None and not (
        args.output is not None and same_file(Path(args.output) / "plan.json", args.plan)
    ):
        # the plan is an input too, unless it is the folder's own plan.json (compiled
        # again after an edit): the plan written there is that plan, checked
        inputs.append(args.plan)
    if args.dump is None:
        # before planning, which can take the whole time limit; emit checks every output
        check_overwrites(args.output, TOP_LEVEL_OUTPUTS, inputs, folders=(KERNELS,))

    from embark_runtime.plan import dumps_plan
    from embarkc.planner import warn_ignored_constraints

    if args.plan is not None:
        plan = _given_plan(program, args.plan)
    else:
        from embarkc.progress import planned

        plan = planned(
            program,
            str(args.spec),
            quiet=args.quiet,
            strategy=args.strategy,
            solver=args.solver,
            time_limit=args.time_limit,
            seed=args.seed,
        )
        warn_ignored_constraints(program, plan)
    if args.dump == "plan":
        sys.stdout.write(dumps_plan(plan))
        return 0

    from embarkc.codegen import render
    from embarkc.emit import emit

    source = program.sources[0]
    files = render(program, plan, source.path)
    try:
        result = emit(
            files,
            args.output,
            spec=source.path,
            spec_sha256=source.sha256,
            includes=[(s.path, s.sha256) for s in program.sources[1:]],
            inputs=inputs,
        )
    except OSError as e:
        where = e.filename if isinstance(e.filename, str) else args.output
        raise EmbarkError.at(where, f"cannot write: {e.strerror or e}") from None
    if not args.quiet:
        print(
            f"{args.output}: {len(result.written)} written, {len(result.unchanged)} unchanged"
            + (f", {len(result.removed)} removed" if result.removed else "")
            + f" (plan {plan.planner.strategy}"
            + (f" from {args.plan}" if args.plan is not None else "")
            + f", {plan.world_size} ranks, "
            f"estimated step {format_ms(plan.estimate.step_time)})"
        )
    return 0


def _given_plan(program: Any, path: str) -> Any:
    """The plan at `path`, held to the plan-v1 contract and to every rule of the checker
    against `program` (an EmbarkError or PlanError names the broken ones), as the plan of
    `program`'s spec; its estimate re-costed when it no longer costs the layout."""
    from embark_runtime.plan import load_plan
    from embarkc.planner import adopt_plan, check_against_spec, layout_is_stale, stale_reason
    from embarkc.syntax import JSON_HEAD_BYTES, looks_like_json

    if not Path(path).is_file():
        what = "is not a file" if Path(path).exists() else "does not exist"
        raise EmbarkError.at(path, f"--plan: {path} {what}", hint="give the path of a plan.json")
    try:
        with open(path, "rb") as f:
            head = f.read(JSON_HEAD_BYTES)
    except OSError as e:
        raise EmbarkError.at(path, f"--plan: cannot read {path}: {e.strerror or e}") from None
    if not looks_like_json(head):
        raise EmbarkError.at(
            path,
            f"--plan: {path} is not a plan file (a plan.json holds one JSON object)",
            hint="give a plan.json that `embarkc plan -o` or `compile` wrote; the spec comes "
            "first: `embarkc compile SPEC --plan PLAN -o DIR`",
        )
    plan = load_plan(path)
    try:
        check_against_spec(program, plan, path, estimate=False)
    except EmbarkError as e:
        raise _of_another_spec(program, plan, path, e) from None
    why = stale_reason(plan)
    if why is None and layout_is_stale(plan) is None:
        why = "its estimate does not say which layout it costs (another tool's plan)"
    if why is not None:
        print(
            f"{path}: warning: {why}: the compiled plan.json carries the cost model's "
            "estimate of its layout instead",
            file=sys.stderr,
        )
    return adopt_plan(program, plan, recost=why is not None)


def _of_another_spec(program: Any, plan: Any, path: str, error: EmbarkError) -> EmbarkError:
    """`error` (the checker's), led by a line saying so when the plan names another spec
    than the one compiled: then every difference it lists follows from that."""
    from embarkc.diagnostics import Span
    from embarkc.emit import same_file
    from embarkc.frontend import find_plan_spec

    spec = program.sources[0].path
    named, state = find_plan_spec(plan, path)
    if state == "missing" and Path(plan.source.spec).name == Path(spec).name:
        return error
    if state != "missing" and same_file(named, spec):
        return error
    lead = Diagnostic(
        f"--plan: {path} was made from {plan.source.spec}, not from {spec}",
        Span.of_file(path),
        f"plan {spec} (`embarkc plan {spec} -o plan.json`), or compile the spec the plan "
        "was made from",
    )
    return EmbarkError([lead, *error.diagnostics], error.sources)
