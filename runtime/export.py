"""Embedding tables leaving and entering a run: the sharded export, whole-table files,
reassembly, and the warm start (`--init-embeddings`). docs/export.md has the user's view.

THE SHARDED EXPORT ON DISK
==========================
`train.py --export-embeddings DIR` (a path not ending in .safetensors or .npz) writes

    DIR/rank-00003.safetensors   the weights of the cells rank 3 holds: `cell{i}.weight`,
                                 [local rows, width] in the table's dtype, streamed in row
                                 chunks (no host copy of a shard, no gather of a table)
    DIR/rank-00003.json          that rank's sidecar (its cells, its file's sha256)
    DIR/plan.json                the plan that wrote it
    DIR/manifest.json            written last: format `embark-export`, version, step, world
                                 size, plan digest, row partition, the tables (rows, dim,
                                 dtype, kind, row shards), the feature -> table map, every
                                 cell (table, row shard j of R, columns [lo, hi), rank,
                                 file, tensor) and the sha256 and size of every file

Row k of a table (the row of id k) is in row shard `k % R` at local row `k // R` under
the `mod` partition, in row shard `k // ceil(rows / R)` at local row `k % ceil(rows / R)`
under `range` (embark_runtime.keys). A dp table is one cell written by rank 0.
The ranks write into `.DIR.tmp-export/` beside DIR; after a barrier rank 0 checks the
cells are exactly the plan's, writes the manifest and renames the folder into place
(an earlier export at DIR is moved aside first and removed after), so DIR is always a
whole export or what it was before.

READING
=======
A `Source` is any of: a whole-table file (safetensors or npz, a table by name with shape
[rows, dim]), a sharded export folder, a checkpoint (`step-N`, or a folder of them: the
newest). Every source is a set of cells, a whole table being the one cell (0 of 1, all
columns); `Source.fill` builds any rows and columns of a table from the cells holding
them, reading only those rows through memory maps. Reassembly (`write_tables`, the
`embarkc export` command) and the warm start (`warm_start_sharded`,
`warm_start_tables`) go through it in row chunks of at most CHUNK_BYTES, so memory stays
bounded by one chunk whatever the size of the tables. This part imports numpy only, so
`embarkc export` starts without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embark_runtime.files import fsync_dir, output_target, sha256_file, write_atomic
from embark_runtime.keys import local_row, row_shard_of, shard_global_rows, shard_row_count

FORMAT = "embark-export"
VERSION = 1
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
TABLE_SUFFIXES = (".safetensors", ".npz")
CHUNK_BYTES = 64 << 20
"""Upper bound of the bytes of one chunk of rows built or read at a time."""

_NP_STORAGE = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
"""How each float dtype of the safetensors format is held by numpy (bf16 as its bits)."""
_NP_TO_ST = {"float32": "F32", "float16": "F16", "float64": "F64"}
PLAN_TO_ST = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
_CKPT_STEP = re.compile(r"^(?:\.old-)?step-(\d+)$")


class ExportError(Exception):
    """A table file, export or checkpoint that cannot be written, read or used; the
    message names the file and what to do."""


# --------------------------------------------------------------------------- tensors


def _to_float32(a: np.ndarray, st: str) -> np.ndarray:
    """Values of storage dtype `st` as float32 (bf16 bits shifted into place: exact)."""
    if st == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


@dataclass(frozen=True)
class Tensor2D:
    """A [rows, cols] tensor in a file, read through a memory map: `read` copies only the
    rows and columns asked for. `offset` is where its bytes start in `path`, or -1 for an
    array already in memory (`array`, a compressed npz member)."""

    path: Path
    st_dtype: str
    shape: tuple[int, int]
    offset: int
    array: np.ndarray | None = None

    def _map(self) -> np.ndarray:
        if self.array is not None:
            return self.array
        if self.shape[0] * self.shape[1] == 0:
            return np.zeros(self.shape, dtype=_NP_STORAGE[self.st_dtype])
        return np.memmap(
            self.path, dtype=_NP_STORAGE[self.st_dtype], mode="r", offset=self.offset,
            shape=self.shape,
        )  # fmt: skip

    def read(self, rows: slice | np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Rows `rows` (a slice or increasing indices), columns [lo, hi), as float32."""
        try:
            part = np.array(self._map()[rows, lo:hi])
        except OSError as e:
            raise ExportError(f"{self.path}: cannot read: {e.strerror or e}") from None
        return _to_float32(part, self.st_dtype)


def read_safetensors_header(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, first byte, end byte) of a safetensors file, absolute
    offsets, checked against the file's size (ExportError for anything else)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ExportError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ExportError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ExportError(f"{path}: cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: not a safetensors file (its header is no object)")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(meta["dtype"]), [int(x) for x in meta["shape"]]
            a, b = (int(x) + 8 + n for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{path}: damaged safetensors header at tensor `{name}`") from None
        if not (8 + n <= a <= b <= size):
            raise ExportError(f"{path}: tensor `{name}` lies beyond the file's end (truncated?)")
        out[name] = (dtype, shape, a, b)
    return out


def _npz_members(path: Path) -> dict[str, Tensor2D | tuple[str, list[int]]]:
    """name -> Tensor2D of each 2-d float member of an npz (stored members memory-mapped
    in place; compressed ones loaded), or (dtype, shape) for any other member."""
    out: dict[str, Tensor2D | tuple[str, list[int]]] = {}
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as raw:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[:-4]
                with z.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
                    else:
                        shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
                    header_len = member.tell()
                st = _NP_TO_ST.get(np.dtype(dtype).name)
                if len(shape) != 2 or st is None or fortran:
                    out[name] = (np.dtype(dtype).name, list(shape))
                    continue
                if info.compress_type == zipfile.ZIP_STORED:
                    raw.seek(info.header_offset + 26)
                    name_len, extra_len = struct.unpack("<HH", raw.read(4))
                    start = info.header_offset + 30 + name_len + extra_len + header_len
                    out[name] = Tensor2D(path, st, (shape[0], shape[1]), start)
                else:
                    with np.load(path) as zz:
                        arr = np.ascontiguousarray(zz[name])
                    out[name] = Tensor2D(path, st, (shape[0], shape[1]), -1, arr)
    except OSError as e:
        raise ExportError(f"{path}: cannot read: {e.strerror or e}") from None
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise ExportError(f"{path}: not an npz file ({e})") from None
    return out


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourceTable:
    rows: int
    dim: int
    st_dtype: str
    """How its values are stored (F32, F16, BF16, F64)."""


@dataclass(frozen=True)
class SourceCell:
    """Rows of row shard `row_shard` of `row_shards` (under `partition`), columns
    [lo, hi) of `table`: `tensor` is [local rows, hi - lo]."""

    table: str
    row_shard: int
    row_shards: int
    partition: str
    lo: int
    hi: int
    tensor: Tensor2D


@dataclass
class Source:
    """Tables as cells in files: a whole-table file, a sharded export or a checkpoint."""

    path: Path
    kind: str
    """"file", "export" or "checkpoint" (where it says which step-N it took)."""
    tables: dict[str, SourceTable]
    cells: dict[str, list[SourceCell]]
    features: dict[str, str] | None = None
    step: int | None = None

    def fill(self, table: str, rows: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
        """out[i] = columns [lo, hi) of global row rows[i] of `table` (rows increasing)."""
        for c in self.cells[table]:
            a, b = max(lo, c.lo), min(hi, c.hi)
            if a >= b:
                continue
            t = self.tables[table]
            if c.row_shards == 1:
                sel: np.ndarray | None = None
                src = rows
            else:
                mask = row_shard_of(rows, t.rows, c.row_shards, c.partition) == c.row_shard
                sel = np.nonzero(mask)[0]
                if not len(sel):
                    continue
                src = local_row(rows[sel], t.rows, c.row_shards, c.partition)
            block = c.tensor.read(_as_index(src), a - c.lo, b - c.lo)
            dst = slice(None) if sel is None else _as_index(sel)
            out[dst, a - lo : b - lo] = block


def _as_index(rows: np.ndarray) -> slice | np.ndarray:
    """Increasing rows as a slice when they step evenly (a strided read, no gather)."""
    if len(rows) == 1:
        return slice(int(rows[0]), int(rows[0]) + 1)
    step = int(rows[1] - rows[0])
    if step > 0 and bool(np.all(np.diff(rows) == step)):
        return slice(int(rows[0]), int(rows[-1]) + 1, step)
    return rows


def open_source(path: str | Path, *, verify: bool = False) -> Source:
    """The tables at `path`: a .safetensors or .npz file of whole tables, a sharded
    export folder, a checkpoint folder (`step-N`) or a folder of checkpoints (its newest
    whose files are all there). The sizes of a folder's files are checked against its
    manifest; with `verify` their sha256 too (every byte read once more). Raises
    ExportError naming the file and why."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such file or folder")
    if p.is_file():
        if p.suffix == ".safetensors":
            return _open_safetensors(p)
        if p.suffix == ".npz":
            return _open_npz(p)
        raise ExportError(
            f"{p}: not a table file: give a .safetensors or .npz file of whole tables, a "
            "sharded export folder or a checkpoint folder"
        )
    if (p / MANIFEST).is_file():
        return _open_manifest(p, verify)
    steps = sorted(
        ((int(m.group(1)), not d.name.startswith("."), d) for d in p.iterdir()
         if (m := _CKPT_STEP.match(d.name)) and d.is_dir()),
        reverse=True,
    )  # fmt: skip
    why = []
    for _, _, d in steps:
        try:
            return _open_manifest(d, verify)
        except ExportError as e:
            why.append(str(e))
    if why:
        raise ExportError(f"{p}: no complete checkpoint inside; the newest: {why[0]}")
    raise ExportError(
        f"{p}: no {MANIFEST}: neither a sharded export, a checkpoint nor a folder of checkpoints"
    )


def _open_safetensors(p: Path) -> Source:
    tables, cells = {}, {}
    for name, (dtype, shape, a, _) in read_safetensors_header(p).items():
        if len(shape) != 2 or dtype not in _NP_STORAGE:
            raise ExportError(
                f"{p}: tensor `{name}` is {dtype} {shape}: a table is a 2-d float tensor "
                "[rows, dim]"
            )
        tensor = Tensor2D(p, dtype, (shape[0], shape[1]), a)
        tables[name] = SourceTable(shape[0], shape[1], dtype)
        cells[name] = [SourceCell(name, 0, 1, "range", 0, shape[1], tensor)]
    return Source(p, "file", tables, cells)


def _open_npz(p: Path) -> Source:
    tables, cells = {}, {}
    for name, member in _npz_members(p).items():
        if not isinstance(member, Tensor2D):
            dtype, shape = member
            raise ExportError(
                f"{p}: array `{name}` is {dtype} {shape}: a table is a 2-d float array "
                "[rows, dim] (C order)"
            )
        tables[name] = SourceTable(member.shape[0], member.shape[1], member.st_dtype)
        cells[name] = [SourceCell(name, 0, 1, "range", 0, member.shape[1], member)]
    return Source(p, "file", tables, cells)


def _open_manifest(d: Path, verify: bool = False) -> Source:
    """A sharded export or a checkpoint: its manifest's cells, each file's tensors."""
    mpath = d / MANIFEST
    try:
        m = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ExportError(f"{mpath}: missing (an unfinished export or checkpoint)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{mpath}: unreadable ({e})") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt not in (FORMAT, "embark-checkpoint"):
        raise ExportError(f"{mpath}: neither an {FORMAT} nor an embark-checkpoint manifest")
    if m.get("version") != 1:
        raise ExportError(f"{mpath}: format version {m.get('version')!r}, this runtime reads 1")
    try:
        return _source_of_manifest(d, m, fmt, verify)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ExportError(f"{mpath}: damaged manifest ({type(e).__name__}: {e})") from None


def _source_of_manifest(d: Path, m: dict[str, Any], fmt: str, verify: bool) -> Source:
    mpath = d / MANIFEST
    partition = m["row_partition"]
    if partition not in ("mod", "range"):
        raise ValueError(f"row_partition {partition!r}")
    tables: dict[str, SourceTable] = {}
    for name, t in m["tables"].items():
        rows, dim = int(t["rows"]), int(t["dim"])
        if rows <= 0 or dim <= 0:
            raise ValueError(f"table `{name}` of {rows} x {dim}")
        tables[name] = SourceTable(rows, dim, PLAN_TO_ST.get(t.get("dtype", "fp32"), "F32"))
    headers: dict[str, dict[str, tuple[str, list[int], int, int]]] = {}
    for fname, entry in m["files"].items():
        f = d / fname
        if not f.is_file():
            raise ExportError(f"{f}: missing (listed in {mpath})")
        if f.stat().st_size != int(entry["bytes"]):
            raise ExportError(
                f"{f}: {f.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        if verify and sha256_file(f) != entry["sha256"]:
            raise ExportError(f"{f}: sha256 mismatch (the file is corrupt)")
        if fname.endswith(".safetensors"):
            headers[fname] = read_safetensors_header(f)
    cells: dict[str, list[SourceCell]] = {name: [] for name in tables}
    for c in m["cells"]:
        name, j, r = c["table"], int(c["row_shard"]), int(c["row_shards"])
        if name not in tables or c["file"] not in headers:
            raise ExportError(
                f"{mpath}: a cell names the table `{name}`, which the manifest does not "
                f"list, or the file `{c['file']}`, which is no listed tensor file"
            )
        lo, hi = (int(x) for x in c["columns"])
        t = tables[name]
        if not (0 <= j < r and 0 <= lo < hi <= t.dim):
            raise ExportError(
                f"{mpath}: a cell of `{name}` (row shard {j} of {r}, columns [{lo}, {hi})) "
                f"lies outside the table"
            )
        tname = c["weight"]["name"]
        header = headers.get(c["file"], {})
        if tname not in header:
            raise ExportError(f"{d / c['file']}: no tensor `{tname}` (listed in {mpath})")
        dtype, shape, a, _ = header[tname]
        want = [shard_row_count(t.rows, j, r, partition), hi - lo]
        if shape != want or dtype not in _NP_STORAGE:
            raise ExportError(
                f"{d / c['file']}: tensor `{tname}` of `{name}` is {dtype} {shape}, the "
                f"manifest's cell needs a float tensor {want}"
            )
        if dtype != tables[name].st_dtype:
            tables[name] = SourceTable(t.rows, t.dim, dtype)
        tensor = Tensor2D(d / c["file"], dtype, (want[0], want[1]), a)
        cells[name].append(SourceCell(name, j, r, partition, lo, hi, tensor))
    for name, own in cells.items():
        _check_tiling(mpath, name, tables[name].dim, own)
    features = {str(k): str(v) for k, v in m["features"].items()} if "features" in m else None
    kind = "export" if fmt == FORMAT else "checkpoint"
    return Source(d, kind, tables, cells, features, int(m["step"]))


def _check_tiling(mpath: Path, name: str, dim: int, cells: list[SourceCell]) -> None:
    """Every row shard of a table's cells covers its columns exactly once."""
    shards = {c.row_shards for c in cells}
    if not shards:
        raise ExportError(f"{mpath}: table `{name}` has no cells")
    if len(shards) != 1:
        raise ExportError(f"{mpath}: the cells of `{name}` disagree on its row shards")
    r = shards.pop()
    for j in range(r):
        pos = 0
        for lo, hi in sorted((c.lo, c.hi) for c in cells if c.row_shard == j):
            if lo != pos:
                break
            pos = hi
        if pos != dim:
            raise ExportError(
                f"{mpath}: the cells of `{name}` row shard {j} do not tile its columns"
            )


# --------------------------------------------------------------------------- reassembly


def _chunk_rows(width: int) -> int:
    return max(1, CHUNK_BYTES // max(1, width * 4))


def table_chunks(source: Source, name: str) -> Iterator[np.ndarray]:
    """Table `name` of `source` as float32 row chunks [k, dim], in row order."""
    t = source.tables[name]
    step = _chunk_rows(t.dim)
    for a in range(0, t.rows, step):
        b = min(t.rows, a + step)
        out = np.empty((b - a, t.dim), dtype=np.float32)
        source.fill(name, np.arange(a, b, dtype=np.int64), 0, t.dim, out)
        yield out


def write_tables(source: Source, path: Path, flag: str = "-o") -> int:
    """Write every table of `source` whole, float32, to `path` (.safetensors or .npz by
    its suffix), streaming chunk by chunk through a `TableFileWriter` (atomic; a stream
    is written in place). Returns the bytes of table data written."""
    shapes = {name: (t.rows, t.dim) for name, t in source.tables.items()}
    with TableFileWriter(path, shapes, flag) as out:
        for name in shapes:
            out.write(name, table_chunks(source, name))
    return out.written


class TableFileWriter:
    """One .safetensors or .npz file (by `path`'s suffix) of whole float32 tables
    [rows, dim], written one table at a time in the order of `shapes` (name -> (rows,
    dim)) from row chunks, so that whoever writes it holds one chunk, never the file's
    tables: a safetensors file's header is written first from the shapes (the format: an
    8-byte little-endian header length, the JSON header with each tensor's dtype, shape
    and data offsets, padded with spaces to 8 bytes, then the raw bytes in header order),
    an npz is a stored zip with one `.npy` member a table. Both read as
    `safetensors.numpy.load_file` and `numpy.load` read the files they write.

    Used as a context manager: a temporary file in the target's folder, fsynced and
    renamed over `path` when every table was written and the block ends without an
    exception; removed otherwise, so a failure leaves any older file whole. A link has
    the file it names replaced; a stream (/dev/null, a pipe) is written in place. The
    file system's refusals raise ExportError naming `flag` and `path`.

    `held_bytes` is the most bytes of table data handed to `write` at once (one chunk):
    the writer copies nothing and buffers only the file object's few KiB."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, int]], flag: str = "-o"):
        if path.suffix not in TABLE_SUFFIXES:
            raise ExportError(f"{flag} {path}: the name must end in .safetensors or .npz")
        self.path, self.shapes, self.flag = path, dict(shapes), flag
        self.written = 0
        """bytes of table data written"""
        self.held_bytes = 0
        self._target = output_target(path)
        self._dest = (
            path
            if self._target is None
            else self._target.with_name(f".{self._target.name}.tmp{os.getpid()}")
        )
        self._done: list[str] = []
        self._file: Any = None
        self._zip: zipfile.ZipFile | None = None

    def __enter__(self) -> TableFileWriter:
        with self._refusals():
            if self._target is not None:
                self._target.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._dest, "wb")  # noqa: SIM115 (closed by __exit__)
            if self.path.suffix == ".safetensors":
                self._file.write(safetensors_header(self.shapes))
            else:
                self._zip = zipfile.ZipFile(
                    self._file, "w", compression=zipfile.ZIP_STORED, allowZip64=True
                )
        return self

    def write(self, name: str, chunks: Iterable[np.ndarray]) -> None:
        """Table `name` (the next of `shapes`) from its rows in order, as float32 chunks
        [k, dim] that together hold its rows exactly."""
        order = list(self.shapes)
        if len(self._done) >= len(order) or order[len(self._done)] != name:
            raise ValueError(f"table `{name}` out of order (expected the order {order})")
        rows, dim = self.shapes[name]
        with self._refusals():
            if self._zip is None:
                got = self._write_rows(self._file, name, chunks)
            else:
                with self._zip.open(f"{name}.npy", "w", force_zip64=True) as member:
                    header = {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)}
                    np.lib.format.write_array_header_2_0(member, header)
                    got = self._write_rows(member, name, chunks)
        if got != rows:
            raise ValueError(f"table `{name}`: {got} rows written, its shape says {rows}")
        self._done.append(name)
        self.written += rows * dim * 4

    def _write_rows(self, out: Any, name: str, chunks: Iterable[np.ndarray]) -> int:
        dim = self.shapes[name][1]
        got = 0
        for chunk in chunks:
            if chunk.dtype != np.float32 or chunk.ndim != 2 or chunk.shape[1] != dim:
                raise ValueError(f"table `{name}`: a chunk of {chunk.dtype} {chunk.shape}")
            self.held_bytes = max(self.held_bytes, chunk.nbytes)
            out.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            got += chunk.shape[0]
        return got

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        try:
            if kind is None:
                with self._refusals():
                    self._publish()
            else:  # the error that ended the block is the one to report
                with contextlib.suppress(OSError, ValueError):
                    if self._zip is not None:
                        self._zip.close()
                if self._file is not None:
                    with contextlib.suppress(OSError):
                        self._file.close()
        finally:
            if self._target is not None:
                with contextlib.suppress(OSError):  # its folder may not be there either
                    self._dest.unlink(missing_ok=True)

    def _publish(self) -> None:
        missing = [n for n in self.shapes if n not in self._done]
        if missing:
            raise ValueError(f"tables {missing} were not written")
        if self._zip is not None:
            self._zip.close()
        self._file.flush()
        if self._target is not None:
            os.fsync(self._file.fileno())
        self._file.close()
        if self._target is not None:
            os.replace(self._dest, self._target)

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise ExportError(f"{self.flag} {self.path}: cannot write: {e.strerror or e}") from None


def safetensors_header(shapes: dict[str, tuple[int, int]]) -> bytes:
    """The length prefix and JSON header of a safetensors file of float32 tensors of
    `shapes`, their bytes following in that order."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, (rows, dim) in shapes.items():
        size = rows * dim * 4
        header[name] = {
            "dtype": "F32",
            "shape": [rows, dim],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# --------------------------------------------------------------------------- warm start


def check_against_plan(source: Source, plan: Any, flag: str = "--init-embeddings") -> list[str]:
    """Raise ExportError unless every table of `plan` is in `source` with the plan's
    [rows, dim] and a dtype that loads without loss (float32, or the table's own);
    returns warnings (tables of the source the plan does not have)."""
    where = f"{flag} {source.path}"
    have = source.tables
    missing = [t.name for t in plan.tables if t.name not in have]
    extra = sorted(set(have) - {t.name for t in plan.tables})
    if missing:
        listed = ", ".join(f"`{n}`" for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
        also = (
            f"; it has tables the plan lacks ({', '.join(f'`{n}`' for n in extra[:5])}): renamed?"
            if extra
            else ""
        )
        raise ExportError(
            f"{where}: no table {listed} of the plan ({len(missing)} of {len(plan.tables)} "
            f"missing){also}. Give a file holding every table by its name in the spec"
        )
    for t in plan.tables:
        s = have[t.name]
        if (s.rows, s.dim) != (t.rows, t.dim):
            raise ExportError(
                f"{where}: table `{t.name}` is {s.rows} x {s.dim} there but {t.rows} x "
                f"{t.dim} in the plan: the spec's rows or dim changed since it was written"
            )
        own = PLAN_TO_ST[t.dtype]
        if s.st_dtype not in ("F32", own):
            raise ExportError(
                f"{where}: table `{t.name}` is stored as {s.st_dtype}, the plan's table is "
                f"{t.dtype}: store it as float32 (or {t.dtype}) to load it without loss"
            )
    return [
        f"{where}: table{'s' if len(extra) > 1 else ''} "
        + ", ".join(f"`{n}`" for n in extra)
        + " not in the plan: not loaded"
    ] if extra else []  # fmt: skip


def fill_cell(
    source: Source,
    table: str,
    rows: int,
    row_shard: int,
    row_shards: int,
    partition: str,
    lo: int,
    hi: int,
    weight: Any,
) -> None:
    """Copy the source's values into `weight` (a torch [local rows, hi - lo] tensor of
    row shard `row_shard` of `row_shards` under `partition`), in row chunks."""
    import torch

    n = int(weight.shape[0])
    step = _chunk_rows(hi - lo)
    with torch.no_grad():
        for a in range(0, n, step):
            b = min(n, a + step)
            buf = np.empty((b - a, hi - lo), dtype=np.float32)
            g = shard_global_rows(rows, row_shard, row_shards, partition, a, b)
            source.fill(table, g, lo, hi, buf)
            weight[a:b].copy_(torch.from_numpy(buf))


def warm_start_sharded(embeddings: Any, source: Source) -> int:
    """Load `source` into every cell `embeddings` (ShardedEmbeddings) holds on this rank,
    dp replicas included; the optimizer state keeps its initial values. Returns cells."""
    embeddings.flush()
    plan = embeddings.plan
    n = 0
    for cluster in embeddings.clusters:
        for key, cell in cluster.cells.items():
            t = plan.table(key.table)
            fill_cell(
                source, key.table, t.rows, key.row_shard, cell.row_shards,
                plan.row_partition, key.lo, key.hi, cell.weight,
            )  # fmt: skip
            n += 1
    embeddings.invalidate_caches()
    return n


def warm_start_tables(weights: dict[str, Any], source: Source) -> None:
    """Load `source` into whole tables (the reference's `weights`, name -> [rows, dim])."""
    for name, w in weights.items():
        fill_cell(source, name, int(w.shape[0]), 0, 1, "range", 0, int(w.shape[1]), w)


# --------------------------------------------------------------------------- sharded writer


def _tmp_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.tmp-export"


def _old_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.old-export"


def check_export_folder(directory: Path, flag: str = "--export-embeddings") -> None:
    """ExportError unless `directory` may receive a sharded export: absent, an empty
    folder, or an earlier export (which the new one replaces whole)."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ExportError(f"{flag} {directory}: exists and is not a folder")
    if (directory / MANIFEST).is_file():
        try:
            fmt = json.loads((directory / MANIFEST).read_text()).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None
        if fmt == FORMAT:
            return
    if any(directory.iterdir()):
        raise ExportError(
            f"{flag} {directory}: a folder holding other files than an earlier export; "
            "give a new or empty folder (or a .safetensors/.npz file for one whole-table file)"
        )


@contextlib.contextmanager
def _writing(directory: Path, what: str = "write") -> Iterator[None]:
    """Turn the file system's refusal (a full disk) into an ExportError naming the flag."""
    try:
        yield
    except OSError as e:
        raise ExportError(
            f"--export-embeddings {directory}: cannot {what}: {e.strerror or e}"
        ) from None


def prepare_export(directory: Path) -> None:
    """Rank 0, before a barrier and every rank's `save_export_part`: an empty temporary
    folder beside `directory` (what a killed export left there is removed)."""
    tmp = _tmp_dir(directory)
    with _writing(directory):
        _remove(tmp)
        tmp.mkdir(parents=True)


def save_export_part(
    directory: Path, step: int, plan: Any, rank: int, world: int, embeddings: Any
) -> None:
    """Rank `rank`'s part of a sharded export: the weights of the cells it holds (dp
    tables on rank 0 only), streamed into `.DIR.tmp-export/rank-R.safetensors`, then
    its sidecar. Collective-free; `finalize_export` on rank 0 follows a barrier."""

    with _writing(directory):
        _save_part(directory, step, plan, rank, world, embeddings)


def _save_part(
    directory: Path, step: int, plan: Any, rank: int, world: int, embeddings: Any
) -> None:
    from embark_runtime.checkpoint import _write_safetensors, plan_digest

    tmp = _tmp_dir(directory)
    tmp.mkdir(parents=True, exist_ok=True)
    embeddings.flush()
    dp = {name for c in plan.clusters if c.kind == "dp" for name in c.tables}
    tensors, metas = [], []
    for cluster in embeddings.clusters:
        for key, cell in cluster.cells.items():
            if rank != 0 and key.table in dp:
                continue
            name = f"cell{len(metas)}.weight"
            w = cell.weight.detach()
            tensors.append((name, w))
            metas.append(
                {
                    "table": key.table,
                    "row_shard": int(key.row_shard),
                    "row_shards": int(cell.row_shards),
                    "columns": [int(key.lo), int(key.hi)],
                    "rank": rank,
                    "weight": {"name": name, "dtype": _st_of(w), "shape": list(w.shape)},
                }
            )
    stem = f"rank-{rank:05d}"
    side: dict[str, Any] = {
        "step": step, "world": world, "rank": rank, "plan_digest": plan_digest(plan),
        "cells": metas, "file": None,
    }  # fmt: skip
    if tensors:
        sha, size = _write_safetensors(tmp / f"{stem}.safetensors", tensors)
        side["file"] = {"name": f"{stem}.safetensors", "sha256": sha, "bytes": size}
    write_atomic(tmp / f"{stem}.json", json.dumps(side, indent=1, sort_keys=True).encode())


def _st_of(w: Any) -> str:
    from embark_runtime.checkpoint import _ST_DTYPES

    return _ST_DTYPES[w.dtype]


def finalize_export(directory: Path, step: int, plan: Any, world: int) -> Path:
    """Rank 0, after every rank's `save_export_part` and a barrier: check the cells are
    exactly the plan's, write plan.json and the manifest, move the folder into place."""
    with _writing(directory, "publish"):
        return _finalize(directory, step, plan, world)


def _finalize(directory: Path, step: int, plan: Any, world: int) -> Path:
    from embark_runtime.checkpoint import CheckpointError, _check_complete, plan_digest
    from embark_runtime.plan import dumps_plan

    tmp = _tmp_dir(directory)
    digest = plan_digest(plan)
    files: dict[str, dict[str, Any]] = {}
    cells: list[dict[str, Any]] = []
    for rank in range(world):
        sp = tmp / f"rank-{rank:05d}.json"
        try:
            side = json.loads(sp.read_text())
        except (OSError, ValueError) as e:
            raise ExportError(f"{sp}: rank {rank} has not written its part ({e})") from None
        if (side["step"], side["world"], side["plan_digest"]) != (step, world, digest):
            raise ExportError(f"{sp}: written by another run (step, world or plan differ)")
        if side["file"]:
            files[side["file"]["name"]] = {k: side["file"][k] for k in ("sha256", "bytes")}
            cells += [{**c, "file": side["file"]["name"]} for c in side["cells"]]
        files[sp.name] = {"sha256": sha256_file(sp), "bytes": sp.stat().st_size}
    try:
        _check_complete(plan, cells, tmp)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    plan_text = dumps_plan(plan).encode()
    write_atomic(tmp / PLAN_FILE, plan_text)
    files[PLAN_FILE] = {"sha256": hashlib.sha256(plan_text).hexdigest(), "bytes": len(plan_text)}
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
                "kind": plan.cluster_of(t.name).kind,
                "row_shards": next((c["row_shards"] for c in cells if c["table"] == t.name), 1),
            }
            for t in plan.tables
        },
        "features": {f.name: f.table for f in plan.features},
        "cells": cells,
        "files": dict(sorted(files.items())),
    }
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    old = _old_dir(directory)
    _remove(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_dir(directory.parent)
    _remove(old)
    return directory


def discard_unfinished_export(directory: Path) -> None:
    """Remove what a failed export left beside DIR (its temporary folder)."""
    _remove(_tmp_dir(directory))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)


__all__ = [
    "CHUNK_BYTES",
    "ExportError",
    "Source",
    "TableFileWriter",
    "check_against_plan",
    "check_export_folder",
    "discard_unfinished_export",
    "finalize_export",
    "open_source",
    "prepare_export",
    "save_export_part",
    "table_chunks",
    "warm_start_sharded",
    "warm_start_tables",
    "write_tables",
]
