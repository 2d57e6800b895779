"""`embarkc export SRC -o OUT`: whole tables from a sharded export or a checkpoint, or a
plan in another framework's format.

* SRC a sharded export folder (`train.py --export-embeddings DIR`), a checkpoint
  (`step-N`) or a folder of checkpoints (its newest complete one): every table is
  reassembled whole into OUT (.safetensors or .npz, float32), each chunk of rows built
  from the cells holding it and streamed into its place, so memory stays bounded by one
  chunk (embark_runtime.export) however large the tables. Written atomically.
* SRC a plan (plan.json, or a folder compiled into) with `--format torchrec|hugectr`:
  the plan in that framework's terms (`embarkc.interop.plan_export.export_plan`), as
  JSON, with its warnings printed.

Torch is not imported: numpy reads and writes the tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HELP = "join a sharded export or a checkpoint into one table file, or export a plan"

PLAN_FORMATS = ("torchrec", "hugectr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        metavar="SRC",
        help="a sharded export folder, a checkpoint (step-N) or a folder of checkpoints; "
        "or with --format a plan file (plan.json, or a folder compiled into)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="tables.safetensors or tables.npz (whole float32 tables by name); with "
        "--format a JSON file",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file of SRC against its manifest's sha256 first (reads it twice)",
    )
    p.add_argument(
        "--format",
        choices=PLAN_FORMATS,
        help="export the plan SRC to this framework's sharding format instead of tables",
    )


def run(args: argparse.Namespace) -> int:
    from embarkc.commands import refuse_folder_output, refuse_overwriting_inputs
    from embarkc.diagnostics import EXIT_OK, EmbarkError

    if not args.output:
        raise EmbarkError.at(args.source, "-o is empty", hint="give -o a file")
    refuse_folder_output(args.output, "the export", "tables.safetensors")
    out = Path(args.output)
    src = Path(args.source)
    if args.format is not None:
        return _export_plan(src, out, args.format)
    plan_file = _plan_file(src)
    if plan_file is not None:
        raise EmbarkError.at(
            args.source,
            "this is a plan, not tables",
            hint="add --format torchrec or --format hugectr to export the plan; tables come "
            "from a sharded export folder or a checkpoint",
        )
    if out.suffix not in (".safetensors", ".npz"):
        raise EmbarkError.at(
            args.output,
            "the output must end in .safetensors or .npz",
            hint="e.g. -o tables.safetensors",
        )
    from embark_runtime.export import ExportError, open_source, write_tables
    from embark_runtime.formatting import format_bytes

    try:
        source = open_source(src, verify=args.verify)
        if source.kind == "file":
            refuse_overwriting_inputs(out, [src], "the tables")
        elif out.resolve().parent == source.path.resolve():
            raise EmbarkError.at(
                args.output,
                f"-o lies inside the {source.kind} it reads ({source.path})",
                hint="write the tables outside it",
            )
        written = write_tables(source, out)
    except ExportError as e:
        raise EmbarkError.at(args.source, str(e)) from None
    what = (
        f"{source.kind} of step {source.step} in {source.path}"
        if source.step is not None
        else str(source.path)
    )
    print(
        f"wrote {out}: {len(source.tables)} tables, {format_bytes(written)} (float32), "
        f"from the {what}"
    )
    return EXIT_OK


def _plan_file(src: Path) -> Path | None:
    """The plan SRC names: a .json file other than a manifest, or a folder holding a
    plan.json that is not an export or a checkpoint (those hold one too)."""
    if src.is_file():
        return src if src.suffix == ".json" and src.name != "manifest.json" else None
    if src.is_dir() and (src / "plan.json").is_file():
        try:
            fmt = json.loads((src / "manifest.json").read_text()).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None  # a compiled folder's manifest is of another kind, or there is none
        if fmt not in ("embark-export", "embark-checkpoint"):
            return src / "plan.json"
    return None


def _export_plan(src: Path, out: Path, fmt: str) -> int:
    from embark_runtime.plan import PlanError, load_plan
    from embarkc.diagnostics import EXIT_OK, EmbarkError
    from embarkc.emit import write_output

    path = _plan_file(src) or (src / "plan.json" if src.is_dir() else src)
    if not path.is_file():
        raise EmbarkError.at(
            str(src), "no plan here", hint="give plan.json or a folder compiled into"
        )
    try:
        module = importlib.import_module("embarkc.interop.plan_export")
    except ModuleNotFoundError as e:
        if e.name not in ("embarkc.interop", "embarkc.interop.plan_export"):
            raise
        raise EmbarkError.at(
            str(src),
            f"exporting plans to {fmt} is not available in this embarkc "
            "(embarkc.interop.plan_export is missing)",
            hint="update embarkc; tables export without --format",
        ) from None
    try:
        load_plan(path)  # a broken plan is refused with the loader's message
    except PlanError as e:
        raise EmbarkError.at(str(path), str(e)) from None
    doc, warnings = module.export_plan(json.loads(path.read_text()), fmt)
    for w in warnings:
        print(f"embarkc: warning: {w}", file=sys.stderr)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    write_output(out, text.encode(), f"the {fmt} plan")
    print(f"wrote {out} ({fmt})")
    return EXIT_OK
