"""`embarkc report PLAN|SPEC -o FILE`: a self-contained HTML page, or one PNG/SVG figure."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "draw a plan (or a spec, planned on the fly) as an HTML page or a PNG/SVG figure"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "input",
        metavar="PLAN|SPEC",
        help="a plan file (plan.json, or a folder compiled into) or a spec",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="FILE.html: a self-contained page; FILE.png or FILE.svg: one composite figure",
    )


def run(args: argparse.Namespace) -> int:
    from embark_runtime.plan import PlanError
    from embarkc import diff, report
    from embarkc.commands import refuse_folder_output, refuse_overwriting_inputs
    from embarkc.diagnostics import EXIT_OK, EmbarkError
    from embarkc.emit import input_paths

    out = Path(args.output)
    if not args.output:
        raise EmbarkError.at(args.input, "-o is empty", hint="give -o a file, e.g. plan.html")
    # Path() drops a trailing `/`: `-o new.html/` would write a file `new.html`
    refuse_folder_output(args.output, "the report", "plan.html")
    if out.suffix.lower() not in (".html", ".htm", ".png", ".svg"):
        raise EmbarkError.at(args.output, "the output must end in .html, .png or .svg")
    refuse_overwriting_inputs(out, [args.input], "the report")
    try:
        side = diff.load_side(args.input)
    except PlanError as e:
        raise diff.plan_error_to_embark(e) from None
    program = side.program or diff.program_of_plan(side.plan, side.label)
    if program is not None:
        refuse_overwriting_inputs(out, input_paths(program), "the report")
    data = report.report_data(side.plan, program, label=args.input)
    report.write_report(data, out)
    print(f"wrote {out}")
    return EXIT_OK
