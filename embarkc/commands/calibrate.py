"""`embarkc calibrate -o hardware/NAME.embark`: measure this machine (memory copy rate,
pooled lookups, per-call overhead, dense FLOP/s; the all-to-all under torchrun) and write
a `hardware` block a spec can include, every value with a comment saying what was
measured, how and when. torch is imported here only (embarkc/calibrate.py says what is
measured and how)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from embarkc.diagnostics import EXIT_OK, EmbarkError

HELP = "measure this machine and write a hardware block for specs to include"

SHAPE_FIELDS = ("nodes", "gpus_per_node", "hbm", "arch")
"""The hardware fields `--spec` gives (the topology's shape: not measured)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the file to write"
    )
    p.add_argument(
        "--spec",
        metavar="SPEC",
        help="take the topology's shape (nodes, gpus_per_node, hbm, arch) and the dense "
        "model from this spec; the file then replaces its hardware block",
    )
    p.add_argument("--quick", action="store_true", help="small grids and sizes (seconds; tests)")


def _shape_of(spec: str) -> tuple[dict[str, str], object, int, int]:
    """From a spec: the shape fields as the file writes them, the dense model's
    `DenseShape`, its samples per GPU and its GPUs per node."""
    from embarkc.calibrate import size_text
    from embarkc.frontend import load_program
    from embarkc.planner.cost import dense_shape

    program = load_program(spec)
    topo = program.topology
    shape = {
        "nodes": str(topo.nodes),
        "gpus_per_node": str(topo.gpus_per_node),
        "hbm": size_text(topo.hbm_bytes),
        "arch": topo.arch,
    }
    samples = program.batch_size // topo.world_size
    return shape, dense_shape(program), samples, topo.gpus_per_node


def run(args: argparse.Namespace) -> int:
    from embarkc.calibrate import Options, measure, render

    out: Path = args.output
    if out.exists() and out.is_dir():
        raise EmbarkError.at(
            str(out), "is a folder: give the file to write (-o hardware/NAME.embark)"
        )
    if not out.parent.is_dir() and str(out.parent) not in ("", "."):
        raise EmbarkError.at(str(out), f"no folder {out.parent}: create it first")
    opts = Options(quick=args.quick, spec=args.spec)
    if args.spec is not None:
        opts.shape, opts.model, opts.samples, opts.gpus_per_node = _shape_of(args.spec)
    cal = measure(opts)
    if int(os.environ.get("RANK", "0")) == 0:
        text = render(cal)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
        print(f"wrote {out} ({cal.where})")
        for key, v in cal.fields.items():
            print(f"  {key:<20} {v.text}")
    return EXIT_OK
