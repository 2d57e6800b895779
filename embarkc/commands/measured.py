"""`embarkc measured PLAN LOG`: the plan's predicted phase times beside a run's measured
ones (a `train.py --measure-phases --log-json LOG` log), for the critical rank and the
mean over ranks, with the phases off by more than `--tolerance` flagged; see
embarkc/measured.py for how the phases pair up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from embarkc.diagnostics import EXIT_OK

HELP = "compare a plan's predicted phase times with a --measure-phases run's log"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN", help="plan.json (or the folder compiled into)")
    p.add_argument("log", metavar="LOG", type=Path, help="the run's --log-json file")
    p.add_argument(
        "--skip", type=int, default=2, metavar="N", help="warm-up steps left out (default 2)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=20.0,
        metavar="PCT",
        help="flag a phase whose error exceeds PCT percent (default 20)",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    from embark_runtime.plan import load_plan
    from embarkc.diagnostics import EmbarkError
    from embarkc.frontend import plan_in_folder
    from embarkc.measured import as_json, compare, read_log, render

    if args.skip < 0:
        raise EmbarkError.at(str(args.log), f"--skip must not be negative, got {args.skip}")
    if args.tolerance <= 0:
        raise EmbarkError.at(str(args.log), f"--tolerance must be positive, got {args.tolerance}")
    path = plan_in_folder(args.plan)
    if not Path(path).is_file():
        raise EmbarkError.at(path, "no such file (give a plan.json or a compiled folder)")
    plan = load_plan(path)
    records = read_log(args.log)
    comparison = compare(plan, records, args.skip)
    print(render(comparison, args.tolerance / 100))
    if args.json is not None:
        # whole or not at all: a failed write leaves an earlier file as it was
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(as_json(comparison), indent=2, sort_keys=True) + "\n")
        tmp.replace(args.json)
    return EXIT_OK
