"""`embarkc import torchrec|hugectr FILE [-o SPEC]`: a TorchRec or HugeCTR model
description as an embark spec (embarkc.interop.spec_import; docs/interop.md).

The spec is written through embarkc's formatter and checked before it is written; every
value the source does not give is on a line ending in `# ASSUMED: ...`. Without `-o` the
spec goes to stdout. An existing `-o` file is replaced atomically (never half-written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embarkc.diagnostics import EXIT_OK

HELP = "import a TorchRec or HugeCTR model description as a spec (assumed values marked)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("system", choices=("torchrec", "hugectr"), help="the source's system")
    p.add_argument(
        "source",
        metavar="FILE",
        help="torchrec: a JSON list of EmbeddingBagConfig fields, or module:attribute; "
        "hugectr: a training JSON or an embedding-collection JSON",
    )
    p.add_argument("-o", "--output", metavar="SPEC", help="write the spec here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    from embarkc.interop.spec_import import read_hugectr, read_torchrec, spec_text

    if args.output is not None:
        from embarkc.commands import refuse_folder_output, refuse_overwriting_inputs
        from embarkc.diagnostics import EmbarkError

        if not args.output:
            raise EmbarkError.at(args.source, "-o is empty", hint="give -o a spec path")
        refuse_folder_output(args.output, "the spec", "model.embark")
        if Path(args.source).exists():
            refuse_overwriting_inputs(args.output, [args.source], "the spec")
    read = read_torchrec if args.system == "torchrec" else read_hugectr
    imported = read(args.source)
    text = spec_text(imported, args.output or "<imported>")
    assumed = text.count("# ASSUMED:")
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    from embarkc.emit import write_output

    write_output(Path(args.output), text.encode("utf-8"), "the spec")
    features = sum(len(t.features) for t in imported.tables)
    print(
        f"wrote {args.output}: {len(imported.tables)} tables, {features} features; "
        f"{assumed} assumed value{'s' if assumed != 1 else ''} marked `# ASSUMED` to review",
        file=sys.stderr,
    )
    return EXIT_OK
