"""Checkpoints of sharded embedding tables: per-rank files, a manifest, resharding on load.

THE LAYOUT ON DISK (docs/checkpoint.md has the full description)
================================================================
A checkpoint of step N lives in `<root>/step-N/`:

    rank-00003.safetensors   the cells rank 3 saved: `cell{i}.weight`, `cell{i}.state.{key}`
    rank-00003.json          that rank's sidecar: its cells' global coordinates, the tensor
                             names, dtypes and shapes, and the sha256 of its tensor file
    extra.pt                 rank 0's `extra` (dense model and optimizer state, data
                             position), torch.save'd, loaded with weights_only=True
    plan.json                the plan that wrote the checkpoint (for people and tools)
    manifest.json            written last: format, version, step, world size, plan digest,
                             row partition, the tables (rows, dim, dtype, optimizer), every
                             cell, and the sha256 and size of every other file

A cell is `(table, row_shard j of R, columns [lo, hi))` under the writer's row partition;
its weight holds the rows of row shard j in local order (`embark_runtime.keys.local_row`).
Row-wise optimizer state (rowwise_adagrad's `sum`, adam's `step`) is a [local_rows] tensor,
replicated on every column cell of a row shard; element-wise state is [local_rows, width].

ATOMICITY
=========
Every rank writes into `<root>/.tmp-step-N/` (its tensor file, then its sidecar, each
written under a temporary name, fsync'ed and renamed). After a barrier that the caller
provides, rank 0 calls `finalize_checkpoint`, which checks that the ranks' cells are exactly
the plan's cells, writes `manifest.json` (fsync), renames the directory to `step-N` and
fsyncs the root. A crash at any point before that rename leaves only a `.tmp-step-*`
directory that `latest_checkpoint` never returns and the next `finalize_checkpoint`
removes; the previous `step-*` is never touched. Replacing an existing `step-N` moves it
aside to `.old-step-N` first: a crash before the new one is renamed in leaves a
`.old-step-N` without a `step-N`, which the readers take for step N and the next
`finalize_checkpoint` renames back.

RESHARDING
==========
`load_checkpoint(directory, plan, rank)` builds the cells of `plan` on `rank` from the
cells of whatever plan wrote the checkpoint: every target row is located in the old cells
through `row_shard_of`/`local_row` under the old partition and row-shard count, columns are
cut from whichever old column cells overlap. Only the files holding an overlapping old cell
are hashed and read, and those in row chunks of CHUNK_BYTES (safetensors slices of a
memory-mapped file), so a rank never holds more than its own cells plus one chunk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from embark_runtime.files import fsync_dir, sha256_file, write_atomic
from embark_runtime.keys import local_row, row_shard_of, shard_global_rows, shard_row_count
from embark_runtime.optimizers import OPTIMIZERS
from embark_runtime.plan import Plan, dumps_plan, plan_digest

__all__ = [
    "CellState",
    "CheckpointError",
    "STATE_LAYOUT",
    "assemble_tables",
    "discard_unfinished",
    "finalize_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "step_dirs",
]

FORMAT = "embark-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
EXTRA = "extra.pt"
PLAN_FILE = "plan.json"
CHUNK_BYTES = 64 << 20
"""Upper bound of the bytes of one row chunk read or written at a time."""

STATE_LAYOUT: dict[str, dict[str, str]] = {n: dict(o.layout) for n, o in OPTIMIZERS.items()}
"""Optimizer state of a cell: key -> "element" ([rows, width]) or "row" ([rows])."""

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}
_PLAN_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d+)$")
_OLD_DIR = re.compile(r"^\.old-step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message names the file and why."""


@dataclass
class CellState:
    """One cell of a table with its optimizer state, in global coordinates.

    `weight` is [local_rows, width]: the rows of row shard `row_shard` of `row_shards` in
    local order (embark_runtime.keys.local_row under the plan's row partition), columns
    `[columns[0], columns[1])`. `state` follows STATE_LAYOUT for the table's optimizer.
    A dp table is one CellState(row_shard=0, row_shards=1, columns=(0, dim)).
    """

    table: str
    row_shard: int
    row_shards: int
    columns: tuple[int, int]
    weight: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)


# --------------------------------------------------------------------------- small helpers


def _rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step}"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def _row_interval(rows: int, row_shard: int, row_shards: int) -> tuple[int, int]:
    block = -(-rows // row_shards)
    return min(rows, row_shard * block), min(rows, (row_shard + 1) * block)


def _rows_overlap(rows: int, a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    """Whether row shards a = (j, R, partition) and b share at least one row of the table."""
    (ja, ra, pa), (jb, rb, pb) = a, b
    if ra == 1:
        pa = "range"
    if rb == 1:
        pb = "range"
    if pa == "range" and pb == "range":
        lo_a, hi_a = _row_interval(rows, ja, ra)
        lo_b, hi_b = _row_interval(rows, jb, rb)
        return max(lo_a, lo_b) < min(hi_a, hi_b)
    if pa == "mod" and pb == "mod":
        # rows r = ja + ra*t; r % rb repeats with period rb / gcd, so rb values suffice
        for t in range(rb // math.gcd(ra, rb)):
            r = ja + ra * t
            if r >= rows:
                return False
            if r % rb == jb:
                return True
        return False
    (jm, rm), (jr, rr) = ((ja, ra), (jb, rb)) if pa == "mod" else ((jb, rb), (ja, ra))
    lo, hi = _row_interval(rows, jr, rr)
    first = lo + (jm - lo) % rm
    return first < hi


# --------------------------------------------------------------------------- writing


def _tensor_bytes_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of `t` (row-major), in row chunks of about CHUNK_BYTES, on the CPU."""
    t = t.detach()
    n = t.shape[0] if t.dim() > 0 else 1
    row_bytes = max(1, t.numel() // max(1, n) * t.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    flat = t.reshape(1) if t.dim() == 0 else t
    for lo in range(0, n, step):
        chunk = flat[lo : lo + step].to("cpu").contiguous()
        if chunk.numel():
            yield chunk.reshape(-1).view(torch.uint8).numpy().data


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, int]:
    """Write tensors in the safetensors format, streaming; return (sha256, bytes).

    Writing the format here rather than through safetensors.save_file avoids a host copy
    of every tensor and hashes the bytes as they are written; reading uses safetensors.
    """
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor `{name}` has unsupported dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    h = hashlib.sha256()
    total = 0
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        for piece in (struct.pack("<Q", len(text)), text):
            f.write(piece)
            h.update(piece)
            total += len(piece)
        for _, t in tensors:
            for mv in _tensor_bytes_chunks(t):
                f.write(mv)
                h.update(mv)
                total += len(mv)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return h.hexdigest(), total


def _check_cell(plan: Plan, cell: CellState, rank: int) -> None:
    """Raise CheckpointError unless `cell` is a cell of `plan` with consistent shapes."""
    try:
        table = plan.table(cell.table)
    except KeyError:
        raise CheckpointError(
            f"rank {rank}: cell of unknown table `{cell.table}` (not in the plan)"
        ) from None
    lo, hi = (int(c) for c in cell.columns)
    kind = plan.cluster_of(cell.table).kind
    where = f"rank {rank}: cell ({cell.table}, row shard {cell.row_shard}/{cell.row_shards}, columns [{lo}, {hi}))"
    if kind == "dp":
        if (cell.row_shard, cell.row_shards, lo, hi) != (0, 1, 0, table.dim):
            raise CheckpointError(f"{where}: a dp table is one cell (0, 1, [0, {table.dim}))")
    elif not any(
        s.row_shard == cell.row_shard and s.row_shards == cell.row_shards and s.columns == (lo, hi)
        for s in plan.shards_of(cell.table)
    ):
        raise CheckpointError(f"{where}: the plan has no such cell")
    n = plan.row_count(cell.table, cell.row_shard, cell.row_shards)
    if tuple(cell.weight.shape) != (n, hi - lo):
        raise CheckpointError(
            f"{where}: weight has shape {tuple(cell.weight.shape)}, expected ({n}, {hi - lo})"
        )
    layout = STATE_LAYOUT[table.optimizer]
    if set(cell.state) != set(layout):
        raise CheckpointError(
            f"{where}: optimizer `{table.optimizer}` keeps state {sorted(layout)}, "
            f"the cell has {sorted(cell.state)}"
        )
    for key, kind_ in layout.items():
        shape = (n, hi - lo) if kind_ == "element" else (n,)
        if tuple(cell.state[key].shape) != shape:
            raise CheckpointError(
                f"{where}: state `{key}` has shape {tuple(cell.state[key].shape)}, expected {shape}"
            )


def _tensor_meta(name: str, t: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "dtype": _ST_DTYPES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}


def save_checkpoint(
    directory: str | Path,
    step: int,
    plan: Plan,
    rank: int,
    world: int,
    cells: list[CellState],
    extra: dict[str, Any] | None = None,
    *,
    finalize: bool | None = None,
) -> Path:
    """Write rank `rank`'s cells of step `step` under the checkpoint root `directory`.

    Collective-free: each rank writes only its own files into `<directory>/.tmp-step-N/`.
    The checkpoint becomes visible when rank 0 calls `finalize_checkpoint` after a barrier
    (the caller's). With `finalize=None` that happens here when `world == 1`.
    dp cells are written by rank 0 only (other ranks' replicas are skipped); `extra` is
    written by rank 0 only (ignored elsewhere). Returns the temporary directory, or the
    final one when finalized here. Raises CheckpointError for a cell that is not a cell
    of `plan` or has inconsistent shapes or optimizer state.
    """
    if not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} is not in [0, {world})")
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    root = Path(directory)
    tmp = _tmp_dir(root, step)
    tmp.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[str, int, int, int, int]] = set()
    tensors: list[tuple[str, torch.Tensor]] = []
    metas: list[dict[str, Any]] = []
    dp_tables = {name for c in plan.clusters if c.kind == "dp" for name in c.tables}
    for cell in cells:
        if rank != 0 and cell.table in dp_tables:
            continue  # a replica: rank 0 writes the one copy
        _check_cell(plan, cell, rank)
        key = (cell.table, cell.row_shard, cell.row_shards, *cell.columns)
        if key in seen:
            raise CheckpointError(f"rank {rank}: cell {key} is given twice")
        seen.add(key)
        i = len(metas)
        wname = f"cell{i}.weight"
        tensors.append((wname, cell.weight))
        state_meta = {}
        for k in sorted(cell.state):
            sname = f"cell{i}.state.{k}"
            tensors.append((sname, cell.state[k]))
            state_meta[k] = _tensor_meta(sname, cell.state[k])
        metas.append(
            {
                "table": cell.table,
                "row_shard": int(cell.row_shard),
                "row_shards": int(cell.row_shards),
                "columns": [int(cell.columns[0]), int(cell.columns[1])],
                "rank": rank,
                "weight": _tensor_meta(wname, cell.weight),
                "state": state_meta,
            }
        )
    stem = _rank_stem(rank)
    sidecar: dict[str, Any] = {
        "step": step,
        "world": world,
        "rank": rank,
        "plan_digest": plan_digest(plan),
        "cells": metas,
        "file": None,
    }
    if tensors:
        fname = f"{stem}.safetensors"
        sha, size = _write_safetensors(tmp / fname, tensors)
        sidecar["file"] = {"name": fname, "sha256": sha, "bytes": size}
    if rank == 0 and extra is not None:
        part = tmp / (EXTRA + ".partial")
        with open(part, "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / EXTRA)
        sidecar["extra"] = {
            "name": EXTRA,
            "sha256": sha256_file(tmp / EXTRA),
            "bytes": (tmp / EXTRA).stat().st_size,
        }
    write_atomic(tmp / f"{stem}.json", json.dumps(sidecar, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    if world == 1 if finalize is None else finalize:
        return finalize_checkpoint(root, step, plan, world)
    return tmp


def finalize_checkpoint(
    directory: str | Path, step: int, plan: Plan, world: int, *, keep_last: int | None = None
) -> Path:
    """Rank 0, after every rank's save_checkpoint and a barrier: publish step `step`.

    Checks that the ranks' sidecars are all there, for this step, world and plan, and that
    their cells are exactly the plan's cells (every rb/ub cell once, every dp table once);
    writes the manifest last, renames `.tmp-step-N` to `step-N` (an existing `step-N` is
    moved aside to `.old-step-N`, then removed), then tidies the root:

    * a `.old-step-M` without a `step-M` (a crash between the two renames of replacing
      step M) is the only copy of step M: it is renamed back to `step-M`; a `.old-step-M`
      beside its `step-M` is stale and removed, as are the `.tmp-step-*` of crashed writes;
    * with `keep_last=k` (k < 1 counts as 1): `step-N` is kept; of the other checkpoints
      only the complete ones with a step below N are candidates, the newest k - 1 of them
      are kept and the rest removed. A checkpoint with a step above N (another run's, or
      one a resume passed over) and a damaged one are never removed and never counted,
      so neither can push a good checkpoint out.

    "Complete" for pruning is cheap, because it runs after every checkpoint of a model
    that may be hundreds of GB: the manifest reads and every file it lists exists with
    its listed size. The sha256 is not recomputed; a same-size corruption counts as
    complete here and is still caught by `latest_checkpoint` and `load_checkpoint`.
    Returns `<directory>/step-N`.
    """
    root = Path(directory)
    tmp = _tmp_dir(root, step)
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp}: no such directory (did every rank call save_checkpoint?)")
    digest = plan_digest(plan)
    files: dict[str, dict[str, Any]] = {}
    cells: list[dict[str, Any]] = []
    for rank in range(world):
        side_path = tmp / f"{_rank_stem(rank)}.json"
        try:
            side = json.loads(side_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{side_path}: missing; rank {rank} has not saved") from None
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{side_path}: unreadable ({e})") from None
        if (side.get("step"), side.get("world"), side.get("plan_digest")) != (step, world, digest):
            raise CheckpointError(
                f"{side_path}: written for step {side.get('step')}, world {side.get('world')} "
                f"and another plan or run; expected step {step}, world {world} and this plan"
            )
        for entry in (side.get("file"), side.get("extra")):
            if entry:
                files[entry["name"]] = {"sha256": entry["sha256"], "bytes": entry["bytes"]}
        for c in side["cells"]:
            cells.append({**c, "file": side["file"]["name"]})
        files[side_path.name] = {
            "sha256": sha256_file(side_path),
            "bytes": side_path.stat().st_size,
        }
    _check_complete(plan, cells, tmp)
    plan_text = dumps_plan(plan).encode()
    write_atomic(tmp / PLAN_FILE, plan_text)
    files[PLAN_FILE] = {"sha256": hashlib.sha256(plan_text).hexdigest(), "bytes": len(plan_text)}
    keep = set(files) | {MANIFEST}
    for p in tmp.iterdir():
        if p.name not in keep:
            # leftovers of a crashed earlier attempt at this step (another world size)
            _remove(p)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": world,
        "plan_digest": digest,
        "row_partition": plan.row_partition,
        "tables": {
            t.name: {
                "rows": t.rows,
                "dim": t.dim,
                "dtype": t.dtype,
                "optimizer": t.optimizer,
                "kind": plan.cluster_of(t.name).kind,
            }
            for t in plan.tables
        },
        "cells": cells,
        "files": dict(sorted(files.items())),
    }
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    final = _step_dir(root, step)
    if final.exists():
        old = root / f".old-step-{step}"
        _remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    _recover_moved_aside(root)
    for p in root.iterdir():
        if _TMP_DIR.match(p.name) or _OLD_DIR.match(p.name):
            _remove(p)
    if keep_last is not None:
        older = [(n, p) for n, p in _step_dirs(root) if n < step and _is_complete(p)]
        for _, p in sorted(older, reverse=True)[max(1, keep_last) - 1 :]:
            _remove(p)
    return final


def _recover_moved_aside(root: Path) -> None:
    """Rename every `.old-step-N` without a `step-N` back to `step-N`."""
    recovered = False
    for n, p in _step_dirs(root):
        if _OLD_DIR.match(p.name):
            os.replace(p, _step_dir(root, n))
            recovered = True
    if recovered:
        fsync_dir(root)


def _is_complete(directory: Path) -> bool:
    """Whether the manifest reads and every file it lists is there with its size (no
    sha256: cheap enough to run on every checkpoint after each save)."""
    try:
        m = read_manifest(directory)
        _verify_files(directory, m, list(m["files"]), sha256=False)
    except CheckpointError:
        return False
    return True


def discard_unfinished(directory: str | Path, step: int) -> None:
    """Remove what a failed save of step `step` left (`.tmp-step-N`), once no rank writes
    to it any more (a full disk wants the space back; the next finalize would remove it)."""
    _remove(_tmp_dir(Path(directory), step))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)


def _check_complete(plan: Plan, cells: list[dict[str, Any]], where: Path) -> None:
    have: dict[tuple[str, int, int, int, int], int] = {}
    for c in cells:
        key = (c["table"], c["row_shard"], c["row_shards"], c["columns"][0], c["columns"][1])
        if key in have:
            raise CheckpointError(
                f"{where}: cell {key} was saved by ranks {have[key]} and {c['rank']}"
            )
        have[key] = c["rank"]
    want = set()
    for t in plan.tables:
        if plan.cluster_of(t.name).kind == "dp":
            want.add((t.name, 0, 1, 0, t.dim))
        for s in plan.shards_of(t.name):
            want.add((t.name, s.row_shard, s.row_shards, s.columns[0], s.columns[1]))
    missing = sorted(want - set(have))
    if missing:
        t, j, r, lo, hi = missing[0]
        raise CheckpointError(
            f"{where}: no rank saved cell ({t}, row shard {j}/{r}, columns [{lo}, {hi})) "
            f"({len(missing)} cells missing)"
        )


# --------------------------------------------------------------------------- reading


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(N, directory) of every checkpoint under `root`: each `step-N`, and each
    `.old-step-N` without a `step-N` (a replace of step N that crashed between its two
    renames left the only copy there)."""
    steps: list[tuple[int, Path]] = []
    moved_aside: list[tuple[int, Path]] = []
    if root.is_dir():
        for p in root.iterdir():
            if not p.is_dir():
                continue
            if m := _STEP_DIR.match(p.name):
                steps.append((int(m.group(1)), p))
            elif m := _OLD_DIR.match(p.name):
                moved_aside.append((int(m.group(1)), p))
    published = {n for n, _ in steps}
    return steps + [(n, p) for n, p in moved_aside if n not in published]


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(N, directory) of every checkpoint under `root`, complete or not (`_step_dirs`)."""
    return sorted(_step_dirs(Path(root)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _ManTensor(_Strict):
    name: str
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]


class _ManCell(_Strict):
    table: str
    file: str
    rank: int = Field(ge=0)
    row_shard: int = Field(ge=0)
    row_shards: int = Field(gt=0)
    columns: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]
    weight: _ManTensor
    state: dict[str, _ManTensor] = {}


class _ManTable(_Strict):
    rows: int = Field(gt=0)
    dim: int = Field(gt=0)
    optimizer: str


class _ManFile(_Strict):
    bytes: int = Field(ge=0)
    sha256: str


class _Manifest(_Strict):
    """The shape of a manifest (what the loader reads of it): a damaged or hand-edited one
    is named by its field, not a crash in the loader."""

    step: int = Field(ge=0)
    world_size: int = Field(gt=0)
    row_partition: Literal["mod", "range"]
    tables: dict[str, _ManTable]
    cells: list[_ManCell]
    files: dict[str, _ManFile]


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of one checkpoint directory, checked for format, shape and consistency."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    try:
        text = path.read_text()
        m = json.loads(text)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing (an incomplete checkpoint, or not a checkpoint directory)"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an {FORMAT} manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {m.get('version')!r}, this runtime reads {VERSION}"
        )
    try:
        _Manifest.model_validate_json(text)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise CheckpointError(
            f"{path}: damaged manifest: field `{where}`: {err['msg']} (resume from another "
            "step-N, or from the checkpoint's plan.json and a fresh start)"
        ) from None
    for c in m["cells"]:
        _check_manifest_cell(path, m, c)
    for name, t in m["tables"].items():
        own = [c for c in m["cells"] if c["table"] == name]
        shards = {c["row_shards"] for c in own}
        if len(shards) != 1:
            raise CheckpointError(f"{path}: the cells of `{name}` disagree on row_shards")
        r = shards.pop()
        for j in range(r):
            pos = 0
            for lo, hi in sorted(tuple(c["columns"]) for c in own if c["row_shard"] == j):
                if lo != pos:
                    break
                pos = hi
            if pos != t["dim"]:
                raise CheckpointError(
                    f"{path}: the cells of `{name}` row shard {j} do not tile its columns"
                )
    return m


def _check_manifest_cell(path: Path, m: dict[str, Any], c: dict[str, Any]) -> None:
    """A cell of manifest `m` names a known table and file, lies inside its table, and
    lists tensors of the shapes and dtypes the loader reads (weights, optimizer state)."""
    name = c["table"]
    if name not in m["tables"] or c["file"] not in m["files"]:
        raise CheckpointError(f"{path}: cell of `{name}` names an unknown table or file")
    t = m["tables"][name]
    layout = STATE_LAYOUT.get(t["optimizer"])
    if layout is None:
        raise CheckpointError(
            f"{path}: table `{name}` has optimizer `{t['optimizer']}`; this runtime knows "
            f"{', '.join(sorted(STATE_LAYOUT))}"
        )
    lo, hi = c["columns"]
    j, r = c["row_shard"], c["row_shards"]
    if not (lo < hi <= t["dim"] and j < r):
        raise CheckpointError(
            f"{path}: a cell of `{name}` (row shard {j} of {r}, columns [{lo}, {hi})) lies "
            f"outside the table's {t['dim']} columns or its row shards"
        )
    n = shard_row_count(t["rows"], j, r, m["row_partition"])
    want = {"weight": [n, hi - lo]}
    for key, kind in layout.items():
        want[key] = [n, hi - lo] if kind == "element" else [n]
    for key, shape in want.items():
        meta = c["weight"] if key == "weight" else c["state"].get(key)
        if meta is None:
            raise CheckpointError(f"{path}: a cell of `{name}` lists no `{key}` state tensor")
        if meta["shape"] != shape or meta["dtype"] not in _TORCH_DTYPES:
            raise CheckpointError(
                f"{path}: the `{key}` tensor of a cell of `{name}` is {meta['dtype']} "
                f"{meta['shape']}, expected {shape} of a known dtype"
            )


def _verify_files(
    directory: Path, manifest: dict[str, Any], names: list[str], *, sha256: bool = True
) -> None:
    for name in names:
        entry = manifest["files"][name]
        p = directory / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in the manifest)")
        if p.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{p}: {p.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        if sha256 and sha256_file(p) != entry["sha256"]:
            raise CheckpointError(f"{p}: sha256 mismatch (the file is corrupt)")


def latest_checkpoint(root: str | Path, *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint `<root>/step-N` (manifest readable and, with
    `verify`, every file present with its manifest's sha256), or None. A `.old-step-N`
    without a `step-N` (a replace that crashed between its renames) counts as step N."""
    return newest_complete(root, verify=verify)[0]


def newest_complete(
    root: str | Path, *, verify: bool = True
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`latest_checkpoint`, and the newer `step-N` passed over, each with why (so that a
    resume can say which steps it lost)."""
    skipped: list[tuple[Path, str]] = []
    for _, p in sorted(_step_dirs(Path(root)), reverse=True):
        try:
            m = read_manifest(p)
            if verify:
                _verify_files(p, m, list(m["files"]))
        except CheckpointError as e:
            skipped.append((p, str(e)))
            continue
        return p, skipped
    return None, skipped


def _resolve(directory: str | Path, verify: bool) -> tuple[Path, bool]:
    """(checkpoint directory, whether its files were just verified) for a checkpoint
    directory, or for a root: its newest complete checkpoint."""
    d = Path(directory)
    if not d.exists():
        raise CheckpointError(f"{d}: no such checkpoint directory")
    if (d / MANIFEST).exists() or _STEP_DIR.match(d.name):
        return d, False
    if _step_dirs(d):
        latest = latest_checkpoint(d, verify=verify)
        if latest is None:
            raise CheckpointError(f"{d}: no complete checkpoint (every step-* is damaged)")
        return latest, verify
    raise CheckpointError(f"{d}: no {MANIFEST} and no step-* checkpoints inside")


@dataclass(frozen=True)
class _Target:
    table: str
    row_shard: int
    row_shards: int
    columns: tuple[int, int]
    partition: str
    weight_dtype: torch.dtype


def _gather(
    directory: Path, manifest: dict[str, Any], targets: list[_Target], verify: bool
) -> list[CellState]:
    """Build every target cell from the checkpoint's cells, reading file by file."""
    from safetensors import safe_open

    tables = manifest["tables"]
    old_partition = manifest["row_partition"]
    outs: list[CellState] = []
    for tg in targets:
        t = tables[tg.table]
        n = shard_row_count(t["rows"], tg.row_shard, tg.row_shards, tg.partition)
        w = tg.columns[1] - tg.columns[0]
        first = next(c for c in manifest["cells"] if c["table"] == tg.table)
        state = {}
        for key, kind in STATE_LAYOUT[t["optimizer"]].items():
            meta = first["state"][key]
            shape = (n, w) if kind == "element" else (n,)
            state[key] = torch.zeros(shape, dtype=_TORCH_DTYPES[meta["dtype"]])
        outs.append(
            CellState(
                tg.table,
                tg.row_shard,
                tg.row_shards,
                tg.columns,
                torch.zeros((n, w), dtype=tg.weight_dtype),
                state,
            )
        )

    # (old cell, [target indices]) pairs, grouped by file
    by_file: dict[str, list[tuple[dict[str, Any], list[int]]]] = {}
    for c in manifest["cells"]:
        rows = tables[c["table"]]["rows"]
        lo0, hi0 = c["columns"]
        old_key = (c["row_shard"], c["row_shards"], old_partition)
        # the first column cell of a row shard also supplies the row-wise state of every
        # target column cell, whatever its columns
        row_state = lo0 == 0 and "row" in STATE_LAYOUT[tables[c["table"]]["optimizer"]].values()
        hits = [
            i
            for i, tg in enumerate(targets)
            if tg.table == c["table"]
            and (max(lo0, tg.columns[0]) < min(hi0, tg.columns[1]) or row_state)
            and _rows_overlap(rows, old_key, (tg.row_shard, tg.row_shards, tg.partition))
        ]
        if hits:
            by_file.setdefault(c["file"], []).append((c, hits))
    if verify:
        _verify_files(directory, manifest, sorted(by_file))

    for fname in sorted(by_file):
        path = directory / fname
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        with handle as f:
            for c, hits in by_file[fname]:
                _copy_cell(f, c, old_partition, tables[c["table"]], hits, targets, outs, path)
    return outs


def _copy_cell(
    f: Any,
    c: dict[str, Any],
    old_partition: str,
    table: dict[str, Any],
    hits: list[int],
    targets: list[_Target],
    outs: list[CellState],
    path: Path,
) -> None:
    """Copy the parts of old cell `c` (open file `f`) that the targets `hits` need."""
    rows = table["rows"]
    j0, r0 = c["row_shard"], c["row_shards"]
    lo0, hi0 = c["columns"]
    layout = STATE_LAYOUT[table["optimizer"]]
    n0 = c["weight"]["shape"][0]
    try:
        wslice = f.get_slice(c["weight"]["name"])
        sslices = {k: f.get_slice(c["state"][k]["name"]) for k in layout}
    except Exception as e:
        raise CheckpointError(f"{path}: a tensor of `{c['table']}` is missing ({e})") from None
    step = max(1, CHUNK_BYTES // max(1, (hi0 - lo0) * 4 * (1 + len(layout))))
    for a in range(0, n0, step):
        b = min(n0, a + step)
        g = shard_global_rows(rows, j0, r0, old_partition, a, b)
        weight = wslice[a:b]
        state = {k: s[a:b] for k, s in sslices.items()}
        for i in hits:
            tg, out = targets[i], outs[i]
            if tg.row_shards == 1:
                sel = np.arange(len(g))
                dst = g
            else:
                sel = np.nonzero(
                    row_shard_of(g, rows, tg.row_shards, tg.partition) == tg.row_shard
                )[0]
                if not len(sel):
                    continue
                dst = local_row(g[sel], rows, tg.row_shards, tg.partition)
            src_t, dst_t = _rows_index(sel), _rows_index(dst)
            lo, hi = max(lo0, tg.columns[0]), min(hi0, tg.columns[1])
            so, do = slice(lo - lo0, hi - lo0), slice(lo - tg.columns[0], hi - tg.columns[0])
            if lo < hi:
                out.weight[dst_t, do] = weight[src_t, so].to(out.weight.dtype)
            for k, kind in layout.items():
                if kind == "element":
                    if lo < hi:
                        out.state[k][dst_t, do] = state[k][src_t, so].to(out.state[k].dtype)
                elif lo0 == 0:
                    # row-wise state is replicated on every column cell: take it once,
                    # from the first column cell of the old row shard
                    out.state[k][dst_t] = state[k][src_t].to(out.state[k].dtype)


def _rows_index(rows: np.ndarray) -> slice | torch.Tensor:
    """A row selection as a slice when it is an increasing arithmetic progression (always
    the case for whole chunks under mod/range partitions: a strided copy, no index
    tensor), else as an index tensor."""
    if len(rows) == 1:
        return slice(int(rows[0]), int(rows[0]) + 1)
    step = int(rows[1] - rows[0])
    if step > 0 and np.array_equal(np.diff(rows), np.full(len(rows) - 1, step)):
        return slice(int(rows[0]), int(rows[-1]) + 1, step)
    return torch.from_numpy(np.ascontiguousarray(rows))


def _check_table(
    manifest: dict[str, Any], path: Path, name: str, rows: int, dim: int, opt: str
) -> None:
    t = manifest["tables"].get(name)
    if t is None:
        raise CheckpointError(f"{path / MANIFEST}: table `{name}` is not in the checkpoint")
    if (t["rows"], t["dim"]) != (rows, dim):
        raise CheckpointError(
            f"{path / MANIFEST}: table `{name}` is {t['rows']} x {t['dim']} in the checkpoint "
            f"but {rows} x {dim} in the plan"
        )
    if t["optimizer"] != opt:
        raise CheckpointError(
            f"{path / MANIFEST}: table `{name}` was trained with `{t['optimizer']}` but the "
            f"plan uses `{opt}`: its optimizer state "
            f"{sorted(STATE_LAYOUT[opt]) or '(none)'} is not in the checkpoint"
        )


def _load_extra(path: Path, manifest: dict[str, Any], verify: bool) -> Any:
    if EXTRA not in manifest["files"]:
        return None
    if verify:
        _verify_files(path, manifest, [EXTRA])
    try:
        return torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path / EXTRA}: cannot be loaded ({e})") from None


def load_checkpoint(
    directory: str | Path, plan: Plan, rank: int, *, verify: bool = True
) -> tuple[int, list[CellState], Any]:
    """(step, cells, extra) for `plan`'s cells on `rank`, whatever plan wrote the checkpoint.

    `directory` is a checkpoint (`.../step-N`) or a root (its newest complete checkpoint).
    The cells come in plan.tables order: a dp table's single cell (every rank has it), then
    the rank's cells of each rb/ub table in plan.shards order; tensors are on the CPU, the
    weight in the plan's table dtype, the state in the dtype it was saved in. With `verify`
    the files read are checked against the manifest's sha256. `extra` is rank 0's extra
    dict, or None. Raises CheckpointError naming the file for a missing, corrupt or
    incompatible checkpoint (a table missing, its rows or dim changed, another optimizer).
    """
    if not 0 <= rank < plan.world_size:
        raise CheckpointError(f"rank {rank} is not in [0, {plan.world_size}) of the plan")
    path, verified = _resolve(directory, verify)
    verify = verify and not verified
    manifest = read_manifest(path)
    targets: list[_Target] = []
    for t in plan.tables:
        _check_table(manifest, path, t.name, t.rows, t.dim, t.optimizer)
        dtype = _PLAN_DTYPES[t.dtype]
        if plan.cluster_of(t.name).kind == "dp":
            targets.append(_Target(t.name, 0, 1, (0, t.dim), plan.row_partition, dtype))
            continue
        for s in plan.shards_of(t.name):
            if s.rank == rank:
                targets.append(
                    _Target(t.name, s.row_shard, s.row_shards, s.columns, plan.row_partition, dtype)
                )
    cells = _gather(path, manifest, targets, verify)
    return int(manifest["step"]), cells, _load_extra(path, manifest, verify)


def assemble_tables(
    directory: str | Path, *, verify: bool = True
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Every table of a checkpoint, whole: name -> (weight [rows, dim], state).

    State tensors are [rows, dim] (element-wise) or [rows] (row-wise). For tests and for
    exporting embeddings; it holds the whole model in memory.
    """
    path, verified = _resolve(directory, verify)
    verify = verify and not verified
    manifest = read_manifest(path)
    targets = [
        _Target(name, 0, 1, (0, t["dim"]), "range", _PLAN_DTYPES[t["dtype"]])
        for name, t in manifest["tables"].items()
    ]
    cells = _gather(path, manifest, targets, verify)
    return {c.table: (c.weight, c.state) for c in cells}
