"""The front end: spec file(s) -> `Program` (parse, resolve includes, lower).

`load_program(path)` and `load_program_text(text, filename)` are what every later stage
and command calls. Both raise `EmbarkError` carrying every diagnostic found (syntax
errors of every file, then semantic errors) and never another exception for any input.

Includes: `include "file"` at the top level of any file; the path is relative to the
including file. Each file is included once (a second include of the same file is
ignored, so shared hardware files can be included from several places); a cycle is an
error pointing at the include that closes it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import Diagnostic, EmbarkError, Span
from embarkc.lower import SourceFile, lower
from embarkc.syntax import (
    JSON_HEAD_BYTES,
    check_text,
    looks_like_json,
    parse,
    parts,
    read_source,
    span_of,
)

MAX_INCLUDED_FILES = 256


def load_program(path: str | Path, warnings: list[Diagnostic] | None = None) -> ir.Program:
    """Parse, include and lower the spec at `path`; its warnings (things it says that do
    nothing) are appended to `warnings` when it is given."""
    shown = str(path)
    try:
        data = read_source(Path(path), shown)
    except OSError as e:
        raise EmbarkError.at(shown, f"cannot read spec: {e.strerror or e}") from None
    text = check_text(data, shown)
    return _load(text, shown, Path(path).parent, _stem(shown), warnings)


def plan_in_folder(path: str) -> str:
    """`path`, or the plan.json in it when it names a folder (one `embarkc compile` wrote):
    `embarkc check build/model` reads build/model/plan.json. EmbarkError for a folder
    without one."""
    p = Path(path)
    if not p.is_dir():
        return path
    if (p / "plan.json").is_file():
        return str(p / "plan.json")
    raise EmbarkError.at(
        path,
        "a folder with no plan.json in it",
        hint="give a spec (.embark), a plan (.json) or a folder `embarkc compile` wrote",
    )


def is_plan_file(path: str | Path) -> bool:
    """Whether a command's input is a plan (a .json file, or one whose text starts with
    `{`, which no spec does) rather than a spec."""
    p = Path(path)
    if p.suffix == ".json":
        return True
    try:
        with p.open("rb") as f:
            return looks_like_json(f.read(JSON_HEAD_BYTES))
    except OSError:
        return False


def find_plan_spec(plan: Any, plan_path: str | Path | None = None) -> tuple[Path, str]:
    """Where the spec a plan was made from (`source.spec`, relative to where it was
    planned) is, and in what state: `"unchanged"` (same sha256 as the plan records),
    `"changed"` or `"missing"`. It is looked for from the current folder, then from the
    plan file's folder; the first regular file found decides. What is not a regular file
    (a folder, a device such as /dev/zero, a FIFO) is not a spec and is passed over;
    a file larger than any spec (`MAX_SOURCE_BYTES`) is not the plan's spec: "changed"."""
    named = Path(plan.source.spec)
    candidates = [named]
    if plan_path is not None and not named.is_absolute():
        candidates.append(Path(plan_path).parent / named)
    for candidate in dict.fromkeys(candidates):
        try:
            data = read_source(candidate, str(candidate))
        except OSError:
            continue
        except EmbarkError:
            if candidate.is_file():
                return candidate, "changed"
            continue
        same = hashlib.sha256(data).hexdigest() == plan.source.sha256
        return candidate, "unchanged" if same else "changed"
    return named, "missing"


def load_program_text(
    text: str, filename: str = "<spec>", warnings: list[Diagnostic] | None = None
) -> ir.Program:
    """Parse, include and lower spec text; includes resolve relative to `filename`'s folder
    (the current directory for a name like `<spec>`); warnings as for `load_program`."""
    base = Path.cwd() if filename.startswith("<") else Path(filename).parent
    return _load(text, filename, base, _stem(filename), warnings)


def _stem(filename: str) -> str:
    stem = Path(filename).stem if not filename.startswith("<") else "spec"
    return re.sub(r"[^A-Za-z0-9_]", "_", stem) or "spec"


def load_files(
    text: str, filename: str, base: Path
) -> tuple[list[SourceFile], list[Diagnostic], dict[str, str]]:
    """Parse the root text and, depth first, every file it includes.

    Returns the files that parsed (root first), the diagnostics of those that did not, and
    the text of every file read (for carets).
    """
    files: list[SourceFile] = []
    diags: list[Diagnostic] = []
    sources: dict[str, str] = {}
    done: set[Path] = set()

    def visit(text: str, shown: str, real: Path | None, stack: tuple[Path, ...]) -> None:
        sources[shown] = text
        try:
            tree = parse(text, shown)
        except EmbarkError as e:
            diags.extend(e.diagnostics)
            return
        files.append(SourceFile(shown, text, tree))
        here = real.parent if real is not None else base
        for item in parts(tree):
            if not (isinstance(item, Tree) and item.data == "include"):
                continue
            tok = parts(item)[0]
            assert isinstance(tok, Token)
            rel = re.sub(r"\\(.)", r"\1", str(tok)[1:-1])
            span = span_of(tok, shown)
            target = (here / rel).resolve() if rel else None
            if target is None or not rel:
                diags.append(Diagnostic("`include` needs a file name", span))
                continue
            if target in stack:
                chain = " -> ".join(p.name for p in (*stack, target) if p is not None)
                diags.append(
                    Diagnostic(f"include cycle: {chain}", span, "remove one of these includes")
                )
                continue
            if target in done:
                continue
            if len(done) >= MAX_INCLUDED_FILES:
                diags.append(Diagnostic(f"more than {MAX_INCLUDED_FILES} included files", span))
                return
            done.add(target)
            shown_inc = _display(here / rel)
            try:
                data = read_source(target, shown_inc)
            except EmbarkError as e:
                why = e.diagnostics[0].message
                diags.append(Diagnostic(f"cannot include `{rel}`: it {why}", span))
                continue
            except OSError as e:
                diags.append(
                    Diagnostic(f"cannot include `{rel}`: {e.strerror or e}", span, _near(here, rel))
                )
                continue
            try:
                inc_text = check_text(data, shown_inc)
            except EmbarkError as e:
                diags.extend(e.diagnostics)
                continue
            visit(inc_text, shown_inc, target, (*stack, target))

    root_real = None if filename.startswith("<") else Path(filename).resolve()
    if root_real is not None:
        done.add(root_real)
    visit(text, filename, root_real, (root_real,) if root_real is not None else ())
    return files, diags, sources


def _display(p: Path) -> str:
    """A readable path: relative to the current directory when below it."""
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _near(here: Path, rel: str) -> str | None:
    from embarkc.diagnostics import did_you_mean

    try:
        names = [p.name for p in (here / rel).parent.iterdir()]
    except OSError:
        return None
    return did_you_mean(Path(rel).name, names)


def _load(
    text: str, filename: str, base: Path, name: str, warnings: list[Diagnostic] | None
) -> ir.Program:
    files, diags, sources = load_files(text, filename, base)
    if diags:
        raise EmbarkError(diags, sources)
    if not files:
        raise EmbarkError(Diagnostic("nothing to compile", Span.of_file(filename)), sources)
    srcs = tuple(
        ir.Source(path=f.path, sha256=hashlib.sha256(f.text.encode("utf-8")).hexdigest())
        for f in files
    )
    try:
        return lower(files, name, srcs, warnings)
    except EmbarkError as e:
        merged = dict(sources)
        merged.update(e.sources)
        raise EmbarkError(e.diagnostics, merged) from None


def dump_ast(spec: str | Path) -> str:
    """The parse tree of the root spec file (`--dump ast` of every command that parses)."""
    try:
        data = Path(spec).read_bytes()
    except OSError as e:
        raise EmbarkError.at(str(spec), f"cannot read spec: {e.strerror or e}") from None
    return str(parse(check_text(data, str(spec)), str(spec)).pretty())


def dump_ir(program: ir.Program) -> str:
    """The IR as JSON (`--dump ir` of every command that parses)."""
    import json

    return json.dumps(program.model_dump(mode="json", exclude_none=True), indent=2)
