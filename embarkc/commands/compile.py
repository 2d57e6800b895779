"""`embarkc compile SPEC -o DIR`: spec -> IR -> plan -> generated trainer, kernels, launcher.

Writes into DIR (through embarkc.emit, the only stage that touches disk): plan.json,
kernels/*.cu, train.py, launch.sh, README.md and manifest.json. Files whose bytes did not
change are left alone. A file of DIR that no earlier compile wrote (a user's README.md),
the spec, a file it includes or a histogram it reads is never replaced, and nothing is
written through a link or outside DIR: the command stops before writing anything. A
compile that fails while writing (a full disk) leaves DIR as it was.
`--dump ast|ir|plan` prints that stage's value on stdout and stops (no output folder
needed).
"""

from __future__ import annotations

import argparse
import sys

from embarkc.commands import check_planner_options
from embarkc.diagnostics import Diagnostic, EmbarkError, print_warnings
from embarkc.ir import STRATEGIES

HELP = "plan a spec and generate its trainer (train.py, launch.sh, CUDA kernels) into a folder"

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
    if args.dump == "ast":
        print(dump_ast(spec))
        return 0

    warnings: list[Diagnostic] = []
    program = load_program(spec, warnings)
    print_warnings(warnings)
    if args.dump == "ir":
        print(dump_ir(program))
        return 0

    from embarkc.emit import check_overwrites, input_paths

    inputs = input_paths(program)
    if args.dump is None:
        # before planning, which can take the whole time limit; emit checks every output
        check_overwrites(args.output, TOP_LEVEL_OUTPUTS, inputs, folders=(KERNELS,))

    from embark_runtime.plan import dumps_plan
    from embarkc.planner import plan_program, warn_ignored_constraints

    plan = plan_program(
        program,
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
            + f" (plan {plan.planner.strategy}, {plan.world_size} ranks, "
            f"estimated step {plan.estimate.step_time * 1e3:.3f} ms)"
        )
    return 0
