"""The one stage that touches disk: write generated files into an output folder.

Contract of `emit(files, out_dir, ...)`:

* Every path is relative, POSIX-style, inside `out_dir`, and appears once; a second file
  for the same path is a bug in a renderer and raises `DuplicateOutputError` before
  anything is written (torchgen's FileManager does the same).
* Every file gets a first line saying it is generated, from which spec and which template,
  and must not be edited, written in the comment syntax of its suffix. Two exceptions keep
  the files usable: a shebang stays the first line (the header is the second), and JSON,
  which has no comments, carries the same sentence in a `"//"` key (sorted first). The
  spec's path is free text (a file name may hold a newline or quotes), so the header shows
  it through `printable`: one line, whatever the name, that no interpreter reads as code.
* A file is written only when its bytes differ from what is on disk, so rebuilding an
  unchanged spec leaves modification times alone.
* A run changes the folder all at once or not at all: every new file is first written to
  a temporary file beside its target (same folder, so same file system; fsync), and only
  when all of them are written are they renamed into place, the manifest last. A failed
  write (a full disk) removes the temporary files and the folders the run created, and
  raises an EmbarkError naming the file: the folder is as it was.
* `manifest.json` lists every output with its sha256 and size, the spec's path and
  sha256 (and those of the files it includes) and the embarkc version. Files that a previous manifest listed and this run no
  longer produces are removed (only those: nothing else in the folder is touched).
* A file in the folder is replaced or removed only when an earlier run wrote it (its
  manifest lists it, or it carries the generated header); any other file at an output's
  path (a user's README.md, say), one of the inputs (the spec, a file it includes, a
  histogram it reads), a file where a folder must go or a folder or link where a file or
  folder of the outputs must go stop the run before anything is written.
* Nothing outside the folder is written or removed. Outputs are written only through real
  folders inside it (a link where an output folder goes stops the run), and an entry of an
  earlier manifest is removed only when it is a normalised relative path whose every
  folder is a real folder (not a link) and which names a regular file with the generated
  header; any other entry (absolute, with `..`, through a link) is ignored and its file
  left alone: a manifest is a file of the folder anyone can edit, not a list of orders.

Output is a pure function of the inputs: no timestamps, no absolute paths, sorted keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from embark_runtime.files import output_target
from embarkc import __version__
from embarkc.diagnostics import Diagnostic, EmbarkError, Span

if TYPE_CHECKING:
    from embarkc.ir import Program

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "embarkc-manifest"
MANIFEST_VERSION = 1

_LINE_COMMENT = {
    ".py": "#",
    ".sh": "#",
    ".cu": "//",
    ".cuh": "//",
    ".h": "//",
    ".cc": "//",
    ".cpp": "//",
    ".toml": "#",
    ".yaml": "#",
    ".yml": "#",
    ".txt": "#",
}


class EmitError(Exception):
    """A renderer produced something that cannot be written (a bug, not a user error)."""


class DuplicateOutputError(EmitError):
    pass


@dataclass(frozen=True)
class GeneratedFile:
    """One output: its path inside the output folder, its text, and where it came from.

    `template` names the template (or the Python function, for files not rendered from a
    template) so that the header tells a reader where to make a change. `executable`
    files get mode 0755.
    """

    path: str
    text: str
    template: str
    executable: bool = False


@dataclass
class EmitResult:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


_SETTING = re.compile(r"(coding|\bvim?|\bex)([:=])")
"""What makes a comment a setting for whoever reads the file: Python's encoding
declaration (`# coding: x` in the first two lines) and vi's modelines (`vim: set ...`)."""


def printable(text: str) -> str:
    """`text` (a path: free text) as generated code may show it in a comment: every
    character that is not printable (newline, tab, escape, a line separator, the surrogate
    of an undecodable byte) and the backslash written as Python's repr writes them (`\\n`,
    `\\x1b`, `\\udcff`, `\\\\`), and the `:` or `=` of a setting marker (`coding:`,
    `vim:`) as `\\x3a` or `\\x3d`. The result is one line of printable characters that
    reads back unambiguously, and is the same text as `text` for ordinary paths."""
    text = "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)
    return _SETTING.sub(lambda m: f"{m[1]}\\x{ord(m[2]):02x}", text)


def header_sentence(spec: str, template: str) -> str:
    return (
        f"Generated by embarkc {__version__} from {printable(spec)} via {printable(template)}."
        " Do not edit."
    )


def with_header(path: str, text: str, spec: str, template: str) -> str:
    """`text` with the generated-file header in the comment syntax of `path`'s suffix."""
    sentence = header_sentence(spec, template)
    suffix = PurePosixPath(path).suffix
    if suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise EmitError(f"{path}: a generated JSON file must be an object")
        data = {"//": sentence, **{k: v for k, v in data.items() if k != "//"}}
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    if suffix == ".md":
        # `--` could end the HTML comment early (`-->`)
        line = "<!-- " + sentence.replace("--", "-\\x2d") + " -->"
    elif suffix in _LINE_COMMENT:
        line = f"{_LINE_COMMENT[suffix]} {sentence}"
    else:
        raise EmitError(f"{path}: no comment syntax known for suffix {suffix!r}")
    if text.startswith("#!"):
        shebang, _, rest = text.partition("\n")
        return f"{shebang}\n{line}\n{rest}"
    return f"{line}\n{text}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_path(path: str) -> None:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or str(p) != path:
        raise EmitError(f"output path {path!r} is not a normalised relative path")
    if path == MANIFEST:
        raise EmitError(f"{MANIFEST} is written by emit itself")


def _write_temporary(target: Path, data: bytes, executable: bool, mode: int | None = None) -> Path:
    """Write `data` to a new temporary file beside `target` (same folder, so a rename
    moves it into place), fsynced and with its final mode (`mode`, else 0755 when
    `executable`, else 0644); return its path. On failure nothing is left behind."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o755 if executable else 0o644)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _fsync_folder(folder: Path) -> None:
    """Make the renames in `folder` durable (a rename is on disk once its folder is)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    target: Path, data: bytes, executable: bool = False, mode: int | None = None
) -> None:
    """Replace `target` with `data` atomically (same-folder temp file, fsync, rename),
    with permissions `mode` (default: 0755 when `executable`, else 0644)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temporary(target, data, executable, mode)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def is_stdout(path: Path) -> bool:
    """Whether `path` is this process's standard output (`-o /dev/stdout`)."""
    try:
        a, b = os.stat(path), os.fstat(1)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _mode_to_keep(target: Path) -> int:
    """The permissions a user-named output gets: those of the file it replaces (a 600
    spec stays 600 after `fmt`), else what creating it would give (0666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


def write_output(path: Path, data: bytes, what: str, hint: str | None = None) -> None:
    """`atomic_write` of a file a user named (`what`: "the plan", "the report"), or a
    plain write to a stream (`output_target`): a file system's refusal is an EmbarkError
    naming the path and why, not an OSError."""
    try:
        target = output_target(path)
        if target is None:
            with open(path, "wb") as f:
                f.write(data)
        else:
            atomic_write(target, data, mode=_mode_to_keep(target))
    except OSError as e:
        raise EmbarkError.at(
            str(path), f"cannot write {what}: {e.strerror or e}", hint=hint
        ) from None


def _previous_outputs(out_dir: Path) -> set[str] | None:
    """The files the manifest of an earlier run in `out_dir` lists; None when there is no
    manifest of ours (none, or a `manifest.json` of something else)."""
    try:
        data = json.loads((out_dir / MANIFEST).read_text())
        if data.get("format") != MANIFEST_FORMAT:
            return None
        files = data.get("files", {})
        return {p for p in files if isinstance(p, str)}
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return None


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether paths `a` and `b` name one file (through links, `..` or another spelling):
    `os.path.samefile` where both exist, else their resolved paths compared."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _is_generated(target: Path) -> bool:
    """Whether the file at `target` opens with the header of a file embarkc generated
    (one a run wrote before it could write the manifest, say). The header is one line
    whatever the spec is called (`printable`), within the first three lines."""
    try:
        with open(target, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace").splitlines()[:3]
    except OSError:
        return False
    return any("Generated by embarkc " in line and "Do not edit." in line for line in head)


def _kind(path: Path) -> str | None:
    """What is at `path`, links not followed: "file", "folder", "link", "special file"
    (a fifo, a socket, a device), or None when nothing is."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "folder"
    return "file" if stat.S_ISREG(mode) else "special file"


def _is_own_file(target: Path) -> bool:
    """Whether `target` is a regular file (not a link) with the generated header."""
    return _kind(target) == "file" and _is_generated(target)


def _shape_conflicts(out: Path, paths: Sequence[str], folders: Iterable[str]) -> list[Diagnostic]:
    """Where writing `paths` (and `folders`) into `out` meets the wrong kind of thing: a
    file, a link or a special file where an output folder goes (a link could lead out of
    `out`), or a real folder where an output file goes."""
    wanted = set(folders) | {
        str(parent) for path in paths for parent in PurePosixPath(path).parents
    }
    wanted.discard(".")
    bad: list[str] = []
    found = []
    # a parent sorts before its children, so the first conflict on a branch is reported
    for folder in sorted(wanted):
        kind = _kind(out / folder)
        if kind in (None, "folder") or any(folder.startswith(f"{b}/") for b in bad):
            continue
        bad.append(folder)
        found.append(
            Diagnostic(
                f"cannot write the generated folder {folder}/ here: it is a {kind}",
                Span.of_file(str(out / folder)),
                "move or remove it (embarkc writes only real folders inside the output "
                "folder, never through a link)",
            )
        )
    for path in paths:
        if _kind(out / path) == "folder" and not any(path.startswith(f"{b}/") for b in bad):
            found.append(
                Diagnostic(
                    f"cannot write the generated file {path} here: it is a folder",
                    Span.of_file(str(out / path)),
                    "move or remove it",
                )
            )
    return found


def check_overwrites(
    out_dir: str | Path,
    paths: Iterable[str],
    inputs: Sequence[str | Path] = (),
    folders: Iterable[str] = (),
) -> None:
    """Raise an EmbarkError when writing `paths` into `out_dir` would replace one of the
    `inputs` (the spec, a file it includes, a histogram it reads: `input_paths`), would
    meet a file or a link where an output folder goes or a folder where an output file
    goes, or would replace a file that no earlier run wrote there: one its manifest does
    not list and that is not a regular file with the generated header (the header of
    every generated file; a run that stopped before its manifest left it). `folders` are
    output folders whose files are not known yet (compile's `kernels`, before planning).
    Writes nothing, so a command can ask before its long work and `emit` asks again
    before writing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EmbarkError.at(
            str(out), "cannot write into it: it is not a folder", hint="give -o a folder"
        )
    paths = sorted(set(paths) | {MANIFEST})
    for path in paths:
        for source in inputs:
            if os.path.lexists(out / path) and same_file(out / path, source):
                raise EmbarkError.at(
                    str(out / path),
                    f"writing the generated {path} here would replace the input {source}",
                    hint="compile into another folder, or rename the input",
                )
    conflicts = _shape_conflicts(out, paths, folders)
    if conflicts:
        raise EmbarkError(conflicts)
    previous = _previous_outputs(out)
    ours = set() if previous is None else previous | {MANIFEST}
    foreign = [
        path
        for path in paths
        if os.path.lexists(out / path) and path not in ours and not _is_own_file(out / path)
    ]
    if foreign:
        shown = ", ".join(foreign[:8]) + (
            f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        )
        raise EmbarkError.at(
            str(out),
            f"would overwrite {len(foreign)} file{'s' if len(foreign) != 1 else ''} that "
            f"embarkc did not write: {shown}",
            hint="choose an empty or new output folder, or move or remove these files "
            f"(a folder embarkc compiled into before is fine: its {MANIFEST} lists its files)",
        )
    if out.is_dir() and (
        out.resolve() == Path(out.resolve().anchor) or out.resolve() == Path.home()
    ):
        raise EmbarkError.at(
            str(out),
            "will not compile into the root or home folder",
            hint="give -o a folder of its own (it is created if missing)",
        )
    if out.is_dir() and previous is None:
        others = sorted(
            e.name
            for e in os.scandir(out)
            if not _generated_tree(Path(e.path))
            and not any(same_file(e.path, source) for source in inputs)
        )
        if others:
            shown = ", ".join(others[:8]) + (
                f" and {len(others) - 8} more" if len(others) > 8 else ""
            )
            raise EmbarkError.at(
                str(out),
                f"is not empty ({shown}) and holds no {MANIFEST} of an earlier compile",
                hint="choose an empty or new output folder (a folder embarkc compiled into "
                f"before is fine: its {MANIFEST} lists its files)",
            )


def input_paths(program: Program) -> list[str]:
    """The files `program` was read from, which no output may replace: the spec, the
    files it includes and the histograms of its features' access distributions (a
    histogram's path is relative to the file that names it, as the lowerer reads it)."""
    paths = [s.path for s in program.sources]
    for feature in program.features:
        access = feature.access
        if access.kind != "histogram" or access.path is None:
            continue
        named_in = access.span.file if access.span is not None else program.sources[0].path
        base = Path.cwd() if named_in.startswith("<") else Path(named_in).parent
        path = str(base / access.path)
        if path not in paths:
            paths.append(path)
    return paths


def build_manifest(
    contents: dict[str, bytes],
    templates: dict[str, str],
    spec: str,
    spec_sha256: str,
    includes: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "embarkc": __version__,
        "spec": {"path": spec, "sha256": spec_sha256},
        "includes": [{"path": path, "sha256": sha} for path, sha in includes],
        "files": {
            path: {
                "sha256": sha256_bytes(data),
                "bytes": len(data),
                "template": templates[path],
            }
            for path, data in sorted(contents.items())
        },
    }


def prepare(
    files: Iterable[GeneratedFile],
    spec: str,
    spec_sha256: str,
    includes: Sequence[tuple[str, str]] = (),
) -> dict[str, bytes]:
    """The exact bytes of every output, manifest included, keyed by path (no disk access).

    Raises DuplicateOutputError for a path produced twice and EmitError for a bad path.
    """
    contents: dict[str, bytes] = {}
    templates: dict[str, str] = {}
    for f in files:
        _check_path(f.path)
        if f.path in contents:
            raise DuplicateOutputError(
                f"{f.path} is produced twice (by {templates[f.path]} and {f.template})"
            )
        contents[f.path] = with_header(f.path, f.text, spec, f.template).encode()
        templates[f.path] = f.template
    manifest = build_manifest(contents, templates, spec, spec_sha256, includes)
    contents[MANIFEST] = with_header(
        MANIFEST, json.dumps(manifest), spec, "embarkc/emit.py"
    ).encode()
    return contents


def emit(
    files: Iterable[GeneratedFile],
    out_dir: str | Path,
    *,
    spec: str,
    spec_sha256: str,
    includes: Sequence[tuple[str, str]] = (),
    inputs: Sequence[str | Path] = (),
) -> EmitResult:
    """Write `files` and their manifest into `out_dir`; see the module docstring.

    `includes` are the (path, sha256) of the files the spec included, recorded in the
    manifest with the spec's own hash. `inputs` are files that must survive whatever the
    outputs are called: the spec, the files it includes, the histograms it reads
    (`input_paths`). An EmbarkError, raised before anything is written, refuses to
    replace one of them or a file of the folder that no earlier run wrote, or to write
    where a folder or a link is in the way. A write that fails (a full disk) raises an
    EmbarkError naming the file, and leaves the folder as it was.
    """
    files = list(files)
    contents = prepare(files, spec, spec_sha256, includes)
    executable = {f.path for f in files if f.executable}
    out = Path(out_dir)
    check_overwrites(out, contents, inputs)
    with _folder_lock(out):
        check_overwrites(out, contents, inputs)  # as it is now that no other run writes
        return _emit_locked(out, contents, executable, inputs)


_STALE_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]{6,}\.tmp")
"""The name of a temporary file `_write_temporary` makes (`.NAME.xxxxxxxx.tmp`): one a
run killed between staging and renaming left behind."""


@contextlib.contextmanager
def _folder_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder `out` (created if missing, and removed again
    if the run fails and leaves it empty) while a run writes into it: a second compile into
    the same folder at the same time stops with a clear error instead of mixing its files
    with the first's."""
    import fcntl

    created: list[Path] = []
    try:
        _make_folders(out, created)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise EmbarkError.at(
            str(out), f"cannot create the output folder: {e.strerror or e}"
        ) from None
    ok = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EmbarkError.at(
                str(out),
                "another embarkc run is writing into this folder now",
                hint="wait for it to end and run again, or compile into another folder",
            ) from None
        yield
        ok = True
    finally:
        os.close(fd)  # releases the lock
        if not ok:
            for folder in reversed(created):
                with contextlib.suppress(OSError):
                    folder.rmdir()


def _generated_tree(path: Path) -> bool:
    """Whether `path` is what a run that stopped before its manifest left: a regular file
    with the generated header, a stale temporary file, or a real folder of only these."""
    if _STALE_TEMPORARY.fullmatch(path.name) and _kind(path) == "file":
        return True
    if _kind(path) == "folder":
        return all(_generated_tree(Path(e.path)) for e in os.scandir(path))
    return _is_own_file(path)


def _remove_stale_temporaries(out: Path, paths: Iterable[str]) -> None:
    """Remove the temporary files an earlier run that was killed left beside the outputs
    `paths` (`.NAME.xxxxxxxx.tmp`, regular files only), with the folder locked so no
    running compile's files are among them."""
    by_folder: dict[Path, set[str]] = {}
    for path in paths:
        target = out / path
        by_folder.setdefault(target.parent, set()).add(target.name)
    for folder, names in by_folder.items():
        if _kind(folder) != "folder":
            continue
        for entry in os.scandir(folder):
            if not _STALE_TEMPORARY.fullmatch(entry.name) or not entry.is_file(
                follow_symlinks=False
            ):
                continue
            if entry.name[1:].rsplit(".", 2)[0] in names:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _emit_locked(
    out: Path, contents: dict[str, bytes], executable: set[str], inputs: Sequence[str | Path]
) -> EmitResult:
    previous = _previous_outputs(out) or set()
    _remove_stale_temporaries(out, set(contents) | previous)
    stale = sorted(previous - set(contents))
    result = EmitResult()
    # the manifest goes last, so a crash while renaming leaves a manifest that still lists
    # everything an earlier run wrote (the next run cleans it up)
    for path in sorted(contents, key=lambda p: (p == MANIFEST, p)):
        same = _kind(out / path) == "file" and (out / path).read_bytes() == contents[path]
        (result.unchanged if same else result.written).append(path)
    staged = _stage(out, {p: contents[p] for p in result.written}, executable)
    _commit(out, staged, result.unchanged, executable)
    for path in stale:
        if not _removable(out, path, inputs):
            continue
        try:
            (out / path).unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise EmbarkError.at(
                str(out / path), f"cannot remove this stale generated file: {e.strerror or e}"
            ) from None
        result.removed.append(path)
    return result


def _stage(out: Path, contents: dict[str, bytes], executable: set[str]) -> list[tuple[Path, Path]]:
    """Write every file of `contents` to a temporary file beside its target in `out`
    (creating the folders it needs); return the (temporary, target) pairs in order. When
    one write fails, remove the temporary files and the folders made so far and raise an
    EmbarkError naming what could not be written: `out` is as it was."""
    created: list[Path] = []
    staged: list[tuple[Path, Path]] = []
    where = out
    try:
        for path, data in contents.items():
            target = out / path
            where = target.parent
            _make_folders(target.parent, created)
            where = target
            staged.append((_write_temporary(target, data, path in executable), target))
    except OSError as e:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise EmbarkError.at(
            str(where),
            f"cannot write: {e.strerror or e}",
            hint=f"nothing was changed: {out} is as it was",
        ) from None
    return staged


def _make_folders(folder: Path, created: list[Path]) -> None:
    """`mkdir -p folder`, appending each folder it makes to `created` (parents first)."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir()
        created.append(f)


def _commit(
    out: Path, staged: list[tuple[Path, Path]], unchanged: list[str], executable: set[str]
) -> None:
    """Rename the staged files into place, the manifest last and only once the others'
    renames are on disk; give the unchanged files their mode."""
    target = out
    try:
        for path in unchanged:
            target = out / path
            mode = 0o755 if path in executable else 0o644
            if stat.S_IMODE(target.stat().st_mode) != mode:
                os.chmod(target, mode)
        folders = sorted({t.parent for _, t in staged})
        for tmp, target in staged:
            if target == out / MANIFEST:
                for folder in folders:
                    _fsync_folder(folder)
            os.replace(tmp, target)
        if staged:
            _fsync_folder(out)
    except OSError as e:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise EmbarkError.at(
            str(target),
            f"cannot write: {e.strerror or e}",
            hint="compile again once the cause is fixed (the files written so far carry the "
            "generated header)",
        ) from None


def _removable(out: Path, path: str, inputs: Sequence[str | Path]) -> bool:
    """Whether the stale entry `path` of an earlier manifest may be removed from `out`:
    a normalised relative path, every folder on the way a real folder (no link, so it
    stays inside `out`), naming a regular file with the generated header that is none of
    the `inputs`. Any other entry is ignored (the manifest is not trusted)."""
    try:
        _check_path(path)
    except EmitError:
        return False
    parts = PurePosixPath(path).parts
    if any(_kind(out.joinpath(*parts[:i])) != "folder" for i in range(1, len(parts))):
        return False
    target = out / path
    return _is_own_file(target) and not any(same_file(target, source) for source in inputs)
