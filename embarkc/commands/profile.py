"""`embarkc profile DATA... --spec SPEC [-o DIR] [--write] [--samples N]`: measure each
feature's ids in a dataset (embarkc.interop.profile; docs/interop.md).

Reads the data through the runtime's readers as the trainer would (the spec's features in
order are the data's sparse columns or slots), counts ids per feature and prints, per
feature, the samples, ids, distinct keys, mean and max hotness and a fitted Zipf
exponent. `-o DIR` (default: `profile/` beside the spec) receives one histogram file per
feature, `FEATURE.hist`, in the format `access histogram "file"` reads. `--write` then
points the spec's access lines at them and sets the measured hotness, in place:
formatted as `embarkc fmt` would, checked before it is written, replaced atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embarkc.diagnostics import EXIT_OK, EmbarkError

HELP = "measure ids per feature in a dataset: histograms, hotness, zipf (--write: into the spec)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", nargs="+", metavar="DATA", help="dataset files or folders")
    p.add_argument("--spec", required=True, metavar="SPEC", help="the spec whose features to count")
    p.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="folder for the histogram files (default: profile/ beside the spec)",
    )
    p.add_argument(
        "--data-format",
        default="auto",
        metavar="FORMAT",
        help="the dataset's format as the runtime's readers name it (criteo, hugectr, ...; "
        "default auto: from the first file)",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="read about N samples, spread evenly (whole batches)",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="set the spec's access and hotness lines to what was measured (in place)",
    )


def run(args: argparse.Namespace) -> int:
    from embarkc.emit import atomic_write, write_output
    from embarkc.frontend import load_program, load_program_text
    from embarkc.interop.profile import histogram_text, profile, rewrite_spec, spec_fields

    spec = Path(args.spec)
    if args.samples is not None and args.samples < 1:
        raise EmbarkError.at(args.spec, f"--samples must be at least 1, got {args.samples}")
    for d in args.data:
        if not Path(d).exists():
            raise EmbarkError.at(d, "no such dataset file or folder")
    program = load_program(args.spec)
    out = Path(args.output) if args.output else spec.parent / "profile"
    if out.exists() and not out.is_dir():
        raise EmbarkError.at(str(out), "-o names a file: give a folder for the histograms")
    print(
        f"counting ids of {len(program.features)} features in {', '.join(args.data)} ...",
        file=sys.stderr,
    )
    profiles, read = profile(args.data, program, fmt=args.data_format, samples=args.samples)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EmbarkError.at(str(out), f"cannot make the folder: {e.strerror or e}") from None
    paths = {}
    for p in profiles:
        paths[p.name] = out / f"{p.name}.hist"
        try:
            atomic_write(paths[p.name], histogram_text(p, ", ".join(args.data)).encode())
        except OSError as e:
            raise EmbarkError.at(str(paths[p.name]), f"cannot write: {e.strerror or e}") from None
    print(f"{read:,} samples read; histograms in {out}/")
    print("  feature              samples          ids   distinct  mean hot  max hot  zipf")
    for p in profiles:
        alpha = f"{p.alpha:.3f}" if p.alpha is not None else "  n/a"
        print(
            f"  {p.name:18s} {p.samples:10,} {p.ids:12,} {p.distinct:10,} "
            f"{p.mean_hotness:9.3f} {p.max_hotness:8d}  {alpha}"
        )
    if not args.write:
        return EXIT_OK
    text = spec.read_text(encoding="utf-8")
    new, missed = rewrite_spec(text, args.spec, spec_fields(profiles, paths, spec))
    for m in missed:
        print(f"{args.spec}: warning: {m}", file=sys.stderr)
    try:
        load_program_text(new, args.spec)
    except EmbarkError as e:
        raise EmbarkError.at(
            args.spec,
            "the measured values do not make a valid spec; nothing written:\n" + e.render(),
        ) from None
    if new != text:
        write_output(spec, new.encode("utf-8"), "the spec")
        print(f"updated {args.spec}: access and hotness of {len(profiles) - len(missed)} features")
    return EXIT_OK
