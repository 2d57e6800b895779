"""Where a file a user named is written (the compiler's -o and the trainer's exports).

A result is written atomically: a temporary file in the same folder, renamed over the old
one. A rename must not land on what is not a regular file: over a device (/dev/null,
/dev/full), a FIFO or a terminal it would put a regular file in its place, and over a
symbolic link it would replace the link. `output_target` says where the rename goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


def output_target(path: Path) -> Path | None:
    """Where a user-named output is written atomically: the file itself or, through a
    symbolic link to a file, the file it names (the link stays a link). None when the
    path is a stream (a device such as /dev/null, a pipe, a terminal, /dev/stdout on one),
    which is written in place."""
    try:
        st = os.stat(path)  # follows links
    except OSError:
        return path  # nothing there yet (or unreadable: the write says why)
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return Path(os.path.realpath(path)) if os.path.islink(path) else path
    return None


# ------------------------------------------------------------------ a run's paths
# A training run writes several things (a log, an export, checkpoints, traces,
# TensorBoard scalars) and reads others (plan.json, the data, the checkpoint it resumes).
# Each is named by the user; two named alike overwrite one another, and a file written
# into a checkpoint replaces a piece of it (--log-json ckpt/step-50/manifest.json). The
# trainer checks them all against each other before its first step (`run_path_clash`).

CHECKPOINT_FORMAT = "embark-checkpoint"
"""The `format` of a checkpoint's manifest.json (embark_runtime.checkpoint.FORMAT; that
module imports torch)."""

_CHECKPOINT_NAME = re.compile(r"^(\.tmp-|\.old-)?step-\d+$")


@dataclass(frozen=True)
class RunPath:
    """One path a run names. `kind`: `file` (written: a log, an export), `folder`
    (written into, names of its writer's own: TensorBoard's events, the profiler's
    traces), `checkpoints` (a folder the trainer owns: step-N folders are added, replaced
    and removed), `input` (read, never written: plan.json, the data, a checkpoint to
    resume), `resumed` (an input the checkpoint folder may be or hold: the checkpoint a
    run resumes from)."""

    flag: str
    path: Path
    kind: Literal["file", "folder", "checkpoints", "input", "resumed"]

    @property
    def resolved(self) -> Path:
        return Path(os.path.realpath(self.path))


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:  # hard links and bind mounts: one file under two names
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(inner: Path, outer: Path) -> bool:
    return outer in inner.parents


def checkpoint_holding(path: Path) -> Path | None:
    """The checkpoint folder (one `step-N`, or a folder whose manifest.json is a
    checkpoint's) that `path` is, or lies in, or None."""
    for q in (path, *path.parents):
        if _CHECKPOINT_NAME.match(q.name) and q.is_dir():
            return q
        manifest = q / "manifest.json"
        try:
            if manifest.is_file() and manifest.stat().st_size < (1 << 20):
                if json.loads(manifest.read_bytes()).get("format") == CHECKPOINT_FORMAT:
                    return q
        except (OSError, ValueError, AttributeError):
            continue
    return None


def run_path_clash(paths: list[RunPath]) -> str | None:
    """What is wrong with the paths of a run, or None: two outputs at one path (a file
    and a folder, or two of either, but for two writer-named folders: TensorBoard and
    the profiler may share one), an output at an input or inside an input folder
    (the data's, the resumed checkpoint), anything written inside the checkpoint folder
    or nested with it, and a file written into an existing checkpoint. Streams
    (/dev/null, a pipe) are never a clash."""
    reads = ("input", "resumed")
    outs = [p for p in paths if p.kind not in reads and output_target(p.path) is not None]
    ins = [p for p in paths if p.kind in reads]
    for i, a in enumerate(outs):
        ra = a.resolved
        for b in outs[i + 1 :]:
            rb = b.resolved
            both_writer_named = a.kind == b.kind == "folder"
            if _same(ra, rb) and not both_writer_named:
                return (
                    f"{a.flag} {a.path} and {b.flag} {b.path} are the same path: one would "
                    f"overwrite the other; give {b.flag} another path"
                )
            if "checkpoints" in (a.kind, b.kind) and (_inside(ra, rb) or _inside(rb, ra)):
                inner, outer = (a, b) if _inside(ra, rb) else (b, a)
                return (
                    f"{inner.flag} {inner.path} lies inside {outer.flag} {outer.path}: the "
                    "trainer adds and removes checkpoints there; give it a path outside"
                )
            if a.kind == "file" and _inside(rb, ra) or b.kind == "file" and _inside(ra, rb):
                f, d = (a, b) if a.kind == "file" and _inside(rb, ra) else (b, a)
                return (
                    f"{d.flag} {d.path} lies inside {f.flag} {f.path}, which is written as a "
                    "file; give one of them another path"
                )
        for b in ins:
            if a.kind == "checkpoints" and b.kind == "resumed":
                continue  # --checkpoint-dir ckpt --resume ckpt/step-50 continues a run
            rb = b.resolved
            if _same(ra, rb) or (_inside(ra, rb) and rb.is_dir()):
                where = "is" if _same(ra, rb) else "lies inside"
                return (
                    f"{a.flag} {a.path} {where} {b.flag} {b.path}, which this run reads: "
                    f"writing it would destroy its input; give {a.flag} another path"
                )
        held = checkpoint_holding(ra)
        if held is not None:
            return (
                f"{a.flag} {a.path} lies inside the checkpoint {held}: writing it would "
                f"damage that checkpoint; give {a.flag} a path outside it"
            )
    return None


# --------------------------------------------------------------------------- durable writes


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that the names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` under a temporary name, fsync, rename to `path`: a reader sees the old
    file or the new one, never a part."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
