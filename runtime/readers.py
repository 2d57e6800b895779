"""Dataset readers: Criteo TSV, HugeCTR raw binary and Parquet files as `Batch`es.

Criteo TSV lines are parsed by pyarrow when it is installed (embark_runtime.criteo_arrow,
the same batches and errors as the Python parser here), Parquet files by
embark_runtime.parquet; both import pyarrow only when a file is read. `open_dataset`
picks the reader; `parse_column_map` reads the trainer's --column-map.

Both readers see a dataset (one file, several files, or a directory of files, in sorted
order) as one stream of samples cut into global batches of `plan.batch_size` samples; a
trailing partial batch is dropped. Step `s` of rank `a` of `W` ranks is samples
`[a*b, (a+1)*b)` of a training batch, `b = batch_size // W`, so the ranks' slices
concatenate to the global batch whatever `W` is, as with embark_runtime.synthetic.

Held-out data: the last `holdout` full global batches (default `max(1, n // 20)`, none
when the dataset has a single batch; then evaluation reuses training data) are evaluation batches
(`eval_batch(i, rank, world)`, cycling); the others are training batches, and step `s`
reads training batch `s mod n_train`, so the data of a step is a pure function of `s`
(epochs wrap around) and a resumed run sees the batches the interrupted one would have.

The mapping from data columns to the plan (docs/datasets.md has the details):
* features in plan order are the data's sparse columns in order: feature i reads
  categorical column i (Criteo, at most 26 features; `columns=` overrides) or slot i
  (HugeCTR raw, as many slots as features);
* Criteo: missing integer -> 0; integers become `log(1 + x)` (negative -> 0);
  a categorical hex value v becomes key `1 + v mod (rows - 1)` of the feature's table and a
  missing one the reserved key 0 (every table keeps row 0 for "missing"); one id per
  sample and feature.
* HugeCTR raw: per sample `label`, `dense`, then `round(hotness)` keys per slot (the plan's
  features must have fixed hotness); keys are table rows in [0, rows) (`wrap_keys=True`
  takes them mod rows instead of refusing them).
* weighted features get per-id weights of 1.0 (neither format stores weights).

Errors in the data raise ReaderError: `file:line: byte offset: error: ...` (Criteo; line
numbers from 1, byte offsets from 0 in the uncompressed text) or `file: byte offset: error:
...` (HugeCTR raw: the offset of the record). Gzip files (`.gz` or gzip magic) are read as
streams: sequential steps are cheap, going back means decompressing from the start.
"""

from __future__ import annotations

import gzip
import io
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from embark_runtime.plan import Plan, PlanFeature
from embark_runtime.synthetic import Bag, Batch

__all__ = [
    "CRITEO_CATEGORICAL",
    "CRITEO_INTEGER",
    "CriteoTSVReader",
    "DatasetReader",
    "HugeCTRRawReader",
    "RawLayout",
    "ReaderError",
    "open_dataset",
    "parse_column_map",
    "write_criteo_tsv",
    "write_hugectr_raw",
]

CRITEO_INTEGER = 13
CRITEO_CATEGORICAL = 26
MISSING_KEY = 0
"""The key of a missing Criteo categorical value, in every table."""
_SCAN_BYTES = 16 << 20
_HOLDOUT_FRACTION = 20


class ReaderError(Exception):
    """Unusable data: the message names the file and the byte offset (and line) at fault."""


class DatasetReader(Protocol):
    """What the trainer needs from a dataset (both readers implement it)."""

    train_batches: int
    eval_batches: int

    def batch(self, step: int, rank: int, world: int) -> Batch: ...

    def eval_batch(self, index: int, rank: int, world: int) -> Batch: ...


# --------------------------------------------------------------------------- shared


def _expand(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    out: list[Path] = []
    for p in map(Path, items):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and not q.name.startswith("."))
            if not found:
                raise ReaderError(f"{p}: error: the directory holds no data files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ReaderError(f"{p}: error: no such file or directory")
    if not out:
        raise ReaderError("error: no dataset files given")
    return out


def _is_gzip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError as e:
        raise _unreadable(path, e) from None


_STREAM_ERRORS = (OSError, EOFError, zlib.error)
"""What reading a damaged file raises: gzip.BadGzipFile is an OSError, a truncated gzip
stream an EOFError, a corrupt one a zlib.error."""


def _unreadable(path: Path, e: BaseException) -> ReaderError:
    """The ReaderError of a file that cannot be read to its end."""
    if isinstance(e, EOFError):
        why = "the compressed stream ends early (a truncated .gz file?)"
    elif isinstance(e, zlib.error | gzip.BadGzipFile):
        why = f"the compressed stream is corrupt ({e})"
    else:
        why = getattr(e, "strerror", None) or str(e)
    return ReaderError(f"{path}: error: cannot read: {why}")


def _split(total_batches: int, holdout: int | None, what: str) -> tuple[int, int]:
    """(training batches, held-out batches) of a dataset with `total_batches` batches."""
    if total_batches < 1:
        raise ReaderError(f"{what}: error: fewer samples than one global batch")
    if holdout is None:
        holdout = max(1, total_batches // _HOLDOUT_FRACTION) if total_batches > 1 else 0
    if not 0 <= holdout < total_batches:
        raise ReaderError(
            f"{what}: error: cannot hold out {holdout} of {total_batches} global batches"
        )
    return total_batches - holdout, holdout


def _rank_range(batch_size: int, rank: int, world: int) -> tuple[int, int]:
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if batch_size % world:
        raise ValueError(f"the global batch {batch_size} does not split evenly over {world} ranks")
    b = batch_size // world
    return rank * b, (rank + 1) * b


class _Batches:
    """Step -> dataset batch index, with the held-out batches at the end."""

    batch_size: int
    train_batches: int
    eval_batches: int

    def _samples(self, first: int, lo: int, hi: int) -> Batch:
        raise NotImplementedError

    def _guard(self) -> threading.Lock:
        """The lock that serialises reads (a reader keeps one open file and a cache): a
        prefetch thread and the main thread's evaluation may read the same reader."""
        lock = self.__dict__.get("_lock")
        if lock is None:
            lock = self.__dict__.setdefault("_lock", threading.Lock())
        return lock

    def batch(self, step: int, rank: int, world: int) -> Batch:
        """Rank `rank`'s slice of training step `step` (epochs wrap around)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        lo, hi = _rank_range(self.batch_size, rank, world)
        first = (step % self.train_batches) * self.batch_size
        with self._guard():
            return self._samples(first, lo, hi)

    def eval_batch(self, index: int, rank: int, world: int) -> Batch:
        """Rank `rank`'s slice of held-out batch `index` (cycling over the held-out ones)."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        lo, hi = _rank_range(self.batch_size, rank, world)
        if self.eval_batches:
            k = self.train_batches + index % self.eval_batches
        else:
            k = index % self.train_batches  # nothing held out: evaluate on training data
        with self._guard():
            return self._samples(k * self.batch_size, lo, hi)

    def batches(
        self, rank: int, world: int, start: int = 0, stop: int | None = None
    ) -> Iterator[Batch]:
        """Training steps [start, stop) of rank `rank` (default: to the end of the epoch)."""
        for step in range(start, self.train_batches if stop is None else stop):
            yield self.batch(step, rank, world)


def _weights(f: PlanFeature, n: int) -> np.ndarray | None:
    return np.ones(n, dtype=np.float32) if f.weighted else None


# --------------------------------------------------------------------------- Criteo TSV

_HEX = np.full(256, -1, dtype=np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_HEX[0] = 16  # numpy's padding of short byte strings


@dataclass(frozen=True)
class _Pos:
    file: int
    offset: int
    line: int  # 1-based, in the file


class CriteoTSVReader(_Batches):
    """Criteo TSV: `label \\t 13 integers \\t 26 hex categorical values` per line.

    `columns` maps a feature name to its categorical column (0..25); by default feature i of
    the plan reads column i. The constructor reads the dataset once to index the first line
    of every global batch (one entry per batch, so any size fits); a batch is then parsed
    from its position. See the module docstring for the mapping and the errors.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        plan: Plan,
        *,
        columns: dict[str, int] | None = None,
        dense_features: int = CRITEO_INTEGER,
        holdout: int | None = None,
        engine: Literal["auto", "arrow", "python"] = "auto",
    ):
        self.paths = _expand(paths)
        if engine not in ("auto", "arrow", "python"):
            raise ValueError(f"engine must be auto, arrow or python, not {engine!r}")
        self.engine = "python" if engine == "auto" and not _has_pyarrow() else engine
        if self.engine == "auto":
            self.engine = "arrow"
        self.plan = plan
        self.batch_size = plan.batch_size
        if dense_features != CRITEO_INTEGER:
            raise ReaderError(
                f"{self.paths[0]}: error: Criteo data has {CRITEO_INTEGER} integer features, "
                f"the model expects {dense_features} dense features"
            )
        if columns is None:
            if len(plan.features) > CRITEO_CATEGORICAL:
                raise ReaderError(
                    f"{self.paths[0]}: error: the plan has {len(plan.features)} features, "
                    f"Criteo data has {CRITEO_CATEGORICAL} categorical columns"
                )
            columns = {f.name: i for i, f in enumerate(plan.features)}
        for f in plan.features:
            c = columns.get(f.name)
            if c is None or not 0 <= c < CRITEO_CATEGORICAL:
                raise ReaderError(
                    f"{self.paths[0]}: error: feature `{f.name}` has no categorical column "
                    f"in [0, {CRITEO_CATEGORICAL})"
                )
        self.columns = dict(columns)
        self._rows = {t.name: t.rows for t in plan.tables}
        self._handle: tuple[int, io.BufferedIOBase] | None = None
        self.index = self._build_index()
        self.train_batches, self.eval_batches = _split(len(self.index), holdout, str(self.paths[0]))

    # ---------------------------------------------------------------- index

    def _open(self, i: int) -> io.BufferedIOBase:
        p = self.paths[i]
        if _is_gzip(p):
            return gzip.open(p, "rb")
        return open(p, "rb")

    def _build_index(self) -> list[_Pos]:
        """The position of the first line of every full global batch."""
        starts: list[_Pos] = []
        seen = 0  # lines of the files before
        for i in range(len(self.paths)):
            try:
                seen = self._index_file(i, seen, starts)
            except _STREAM_ERRORS as e:
                raise _unreadable(self.paths[i], e) from None
        complete = seen // self.batch_size
        return starts[:complete]

    def _index_file(self, i: int, seen: int, starts: list[_Pos]) -> int:
        """Append to `starts` the batch starts in file `i`, after `seen` lines of the files
        before; returns the lines of the files up to this one."""
        with self._open(i) as f:
            offset, line, last = 0, 0, b"\n"
            while chunk := f.read(_SCAN_BYTES):
                ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                # line starts in this chunk: 0 if the previous chunk ended a line, then
                # every newline + 1 that is inside the chunk
                line_starts = ends + 1
                if last == b"\n":
                    line_starts = np.concatenate(([0], line_starts))
                line_starts = line_starts[line_starts < len(chunk)]
                # global line number of each start
                g = seen + np.arange(len(line_starts))
                for k in np.flatnonzero(g % self.batch_size == 0):
                    starts.append(_Pos(i, offset + int(line_starts[k]), line + int(k) + 1))
                seen += len(line_starts)
                line += len(line_starts)
                offset += len(chunk)
                last = chunk[-1:]
        return seen

    @property
    def num_batches(self) -> int:
        """Full global batches in the dataset (training plus held out)."""
        return len(self.index)

    # ---------------------------------------------------------------- reading

    def _handle_at(self, i: int, offset: int) -> io.BufferedIOBase:
        """File `i` positioned at `offset`, reusing the open handle when possible."""
        if self._handle is not None and self._handle[0] != i:
            self._handle[1].close()
            self._handle = None
        if self._handle is None:
            self._handle = (i, self._open(i))
        f = self._handle[1]
        if isinstance(f, gzip.GzipFile) and offset < f.tell():
            f.close()
            f = self._open(i)
            self._handle = (i, f)
        f.seek(offset)
        return f

    def _lines(self, first: int, lo: int, hi: int) -> tuple[list[bytes], list[_Pos]]:
        """Lines [lo, hi) of the global batch starting at sample `first` (and positions)."""
        i = self.index[first // self.batch_size].file
        try:
            return self._read_lines(first, lo, hi)
        except _STREAM_ERRORS as e:
            # the file changed or went away since it was indexed
            if self._handle is not None:
                i = self._handle[0]
                self._handle[1].close()
                self._handle = None
            raise _unreadable(self.paths[i], e) from None

    def _read_lines(self, first: int, lo: int, hi: int) -> tuple[list[bytes], list[_Pos]]:
        pos = self.index[first // self.batch_size]
        i, offset, line = pos.file, pos.offset, pos.line
        f = self._handle_at(i, offset)
        lines: list[bytes] = []
        where: list[_Pos] = []
        k = 0
        while k < hi:
            raw = f.readline()
            if not raw:
                i, offset, line = i + 1, 0, 1
                f = self._handle_at(i, 0)
                continue
            if k >= lo:
                lines.append(raw)
                where.append(_Pos(i, offset, line))
            offset += len(raw)
            line += 1
            k += 1
        return lines, where

    def _fail(self, where: _Pos, message: str) -> ReaderError:
        return ReaderError(
            f"{self.paths[where.file]}:{where.line}: byte {where.offset}: error: {message}"
        )

    def _samples(self, first: int, lo: int, hi: int) -> Batch:
        if self.engine == "arrow":
            from embark_runtime.criteo_arrow import parse_block

            parsed = parse_block(self._block(first, lo, hi), hi - lo)
            if parsed is not None:
                return self._assemble(*parsed)
            # not in canonical form: the Python parser's result, or its error and line
        lines, where = self._lines(first, lo, hi)
        return self.parse(lines, where)

    def _block(self, first: int, lo: int, hi: int) -> bytes:
        """Lines [lo, hi) of the global batch starting at sample `first`, as one block."""
        k = first // self.batch_size
        pos = self.index[k]
        i = pos.file
        try:
            f = self._handle_at(i, pos.offset)
            if k + 1 < len(self.index) and self.index[k + 1].file == i:
                # the batch's lines lie between two indexed offsets of one file: one read
                whole = f.read(self.index[k + 1].offset - pos.offset)
                ends = np.flatnonzero(np.frombuffer(whole, dtype=np.uint8) == 10)
                if len(ends) == self.batch_size:
                    a = 0 if lo == 0 else int(ends[lo - 1]) + 1
                    return whole[a : int(ends[hi - 1]) + 1]
                f = self._handle_at(i, pos.offset)  # the file changed: line by line
            out: list[bytes] = []
            k = 0
            while k < hi:
                raw = f.readline()
                if not raw:
                    i += 1
                    f = self._handle_at(i, 0)
                    continue
                if k >= lo:
                    # a file's last line may lack its newline: the next file's first
                    # line must not run into it
                    out.append(raw if raw.endswith(b"\n") else raw + b"\n")
                k += 1
        except _STREAM_ERRORS as e:
            if self._handle is not None:
                self._handle[1].close()
                self._handle = None
            raise _unreadable(self.paths[i], e) from None
        return b"".join(out)

    def parse(self, lines: list[bytes], where: list[_Pos]) -> Batch:
        """Parse Criteo lines into a Batch; ReaderError names the first bad line."""
        n = len(lines)
        width = 1 + CRITEO_INTEGER + CRITEO_CATEGORICAL
        fields = [ln.rstrip(b"\r\n").split(b"\t") for ln in lines]
        counts = np.fromiter((len(x) for x in fields), dtype=np.int64, count=n)
        bad = np.flatnonzero(counts != width)
        if len(bad):
            k = int(bad[0])
            raise self._fail(where[k], f"{counts[k]} tab-separated columns, expected {width}")
        table = np.array(fields, dtype=np.bytes_).reshape(n, width)

        labels = table[:, 0]
        bad = np.flatnonzero((labels != b"0") & (labels != b"1"))
        if len(bad):
            k = int(bad[0])
            raise self._fail(where[k], f"label {_show(labels[k])} is not 0 or 1")

        ints = table[:, 1 : 1 + CRITEO_INTEGER]
        ints = np.where(ints == b"", b"0", ints)
        try:
            values = ints.astype(np.int64)
        except (ValueError, OverflowError):
            k, c = self._first_bad_integer(ints)
            raise self._fail(
                where[k], f"integer feature {c + 1} is {_show(ints[k, c])}, not an integer"
            ) from None

        cats = table[:, 1 + CRITEO_INTEGER :]
        hexv, ok = _parse_hex(cats)
        if not ok.all():
            k, c = (int(x[0]) for x in np.nonzero(~ok))
            raise self._fail(
                where[k], f"categorical feature {c + 1} is {_show(cats[k, c])}, not a hex value"
            )
        missing = np.char.str_len(cats) == 0
        return self._assemble((labels == b"1").astype(np.float32), values, hexv, missing)

    def _assemble(
        self, labels: np.ndarray, values: np.ndarray, hexv: np.ndarray, missing: np.ndarray
    ) -> Batch:
        """The Batch of parsed lines: labels float32 [n], integers int64 [n, 13], hex
        values uint64 [n, 26] and which of them are missing (both parsers end here)."""
        n = len(labels)
        dense = np.log1p(np.maximum(values, 0).astype(np.float64)).astype(np.float32)
        sparse: dict[str, Bag] = {}
        offsets = np.arange(n + 1, dtype=np.int64)
        for f in self.plan.features:
            c = self.columns[f.name]
            rows = self._rows[f.table]
            v = hexv[:, c]
            if rows <= 1:
                keys = np.zeros(n, dtype=np.int64)
            else:
                keys = (v % np.uint64(rows - 1)).astype(np.int64) + 1
            keys[missing[:, c]] = MISSING_KEY
            sparse[f.name] = Bag(ids=keys, offsets=offsets.copy(), weights=_weights(f, n))
        return Batch(dense=dense, labels=labels, sparse=sparse)

    @staticmethod
    def _first_bad_integer(ints: np.ndarray) -> tuple[int, int]:
        for k in range(ints.shape[0]):
            for c in range(ints.shape[1]):
                try:
                    np.array([ints[k, c]]).astype(np.int64)
                except (ValueError, OverflowError):
                    return k, c
        raise AssertionError("no bad integer found")  # pragma: no cover

    def close(self) -> None:
        if self._handle is not None:
            self._handle[1].close()
            self._handle = None


def _has_pyarrow() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def _show(field: Any) -> str:
    return repr(bytes(field).decode("utf-8", errors="replace"))


def _parse_hex(cats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex strings (bytes array [n, c]) -> (uint64 values, ok mask); empty -> 0, ok."""
    n, c = cats.shape
    lengths = np.char.str_len(cats)
    w = int(min(16, max(1, lengths.max(initial=1))))
    digits = cats.astype(f"S{w}").view(np.uint8).reshape(n, c, w)
    nib = _HEX[digits]
    ok = (lengths <= 16) & ~(nib < 0).any(axis=2)
    # digits are left-aligned (numpy pads with zero bytes): read the w positions as one
    # number, then drop the w - length padding nibbles
    weights = np.array([1 << (4 * (w - 1 - p)) for p in range(w)], dtype=np.uint64)
    clean = np.where((nib >= 0) & (nib < 16), nib, 0).astype(np.uint64)
    full = (clean * weights).sum(axis=2, dtype=np.uint64)
    pad = np.clip(w - lengths, 0, w - 1).astype(np.uint64) * np.uint64(4)
    return np.where(lengths > 0, full >> pad, np.uint64(0)), ok


def write_criteo_tsv(
    path: str | Path, batches: Iterable[Batch], plan: Plan, *, columns: dict[str, int] | None = None
) -> int:
    """Write batches as Criteo TSV (gzip when `path` ends in .gz); return the sample count.

    The inverse of the reader: key 0 becomes an empty field and key k the hex of k - 1, so
    reading back gives the same keys; a dense value d is written as the integer
    `rint(expm1(max(d, 0)))` (reading gives its log1p). Every bag must hold one id.
    """
    cols = columns or {f.name: i for i, f in enumerate(plan.features)}
    p = Path(path)
    out: io.BufferedIOBase = gzip.open(p, "wb") if p.suffix == ".gz" else open(p, "wb")
    total = 0
    with out:
        for b in batches:
            n = len(b.labels)
            if b.dense.shape != (n, CRITEO_INTEGER):
                raise ValueError(f"Criteo rows need {CRITEO_INTEGER} dense values per sample")
            ints = np.rint(np.expm1(np.maximum(b.dense.astype(np.float64), 0))).astype(np.int64)
            text = np.full((n, CRITEO_CATEGORICAL), "", dtype=object)
            for f in plan.features:
                bag = b.sparse[f.name]
                if not np.array_equal(np.diff(bag.offsets), np.ones(n, dtype=np.int64)):
                    raise ValueError(f"feature `{f.name}`: Criteo rows hold one id per sample")
                text[:, cols[f.name]] = [
                    "" if k == MISSING_KEY else format(int(k) - 1, "x") for k in bag.ids
                ]
            for s in range(n):
                row = [str(int(b.labels[s]))]
                row += [str(x) for x in ints[s]]
                row += list(text[s])
                out.write(("\t".join(row) + "\n").encode())
            total += n
    return total


# --------------------------------------------------------------------------- HugeCTR raw

_DTYPES = {"int32": "<i4", "float32": "<f4", "int64": "<i8", "uint32": "<u4"}


@dataclass(frozen=True)
class RawLayout:
    """One record of a HugeCTR raw file: label, dense features, then every slot's keys.

    HugeCTR's raw format (DataReaderType_t.Raw, its data generator's
    `data_generation_for_raw`) has no header: `label_dim` labels, `dense_dim` dense values,
    then `nnz` keys of every slot, little-endian, `num_samples = file size / record size`.
    HugeCTR writes labels and dense values as int32 (dense preprocessed by log(x + 1) on
    reading) or, with `float_label_dense`, both as float32; keys are 32-bit unsigned, or
    int64 with `i64_input_key`. The defaults here: int32 label, float32 dense, 32-bit keys.
    A dense dtype of int32 is read as log(1 + max(x, 0)) like HugeCTR does.
    """

    label_dtype: Literal["int32", "float32"] = "int32"
    dense_dtype: Literal["float32", "int32"] = "float32"
    key_dtype: Literal["uint32", "int64"] = "uint32"
    label_dim: int = 1

    def record(self, dense_dim: int, keys: int) -> np.dtype:
        return np.dtype(
            [
                ("label", _DTYPES[self.label_dtype], (self.label_dim,)),
                ("dense", _DTYPES[self.dense_dtype], (dense_dim,)),
                ("keys", _DTYPES[self.key_dtype], (keys,)),
            ]
        )


def _slot_hotness(plan: Plan, where: str = "HugeCTR raw data") -> list[int]:
    out = []
    for f in plan.features:
        h = int(round(f.hotness))
        if not f.fixed or abs(f.hotness - h) > 1e-9 or h < 1:
            raise ReaderError(
                f"{where}: error: feature `{f.name}`: HugeCTR raw data has a fixed number of "
                f"keys per slot; the plan's hotness {f.hotness:g} "
                f"({'fixed' if f.fixed else 'varying'}) is not one (a Criteo TSV file takes "
                "any bag length: --data-format criteo)"
            )
        out.append(h)
    return out


class HugeCTRRawReader(_Batches):
    """HugeCTR raw binary files, memory-mapped; slot i is the plan's feature i.

    Raises ReaderError at construction for a file whose size is not a whole number of
    records (naming the offset of the partial record), and while reading for a label that
    is not 0 or 1 or a key outside its table (naming the record's offset).
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        plan: Plan,
        *,
        dense_features: int = CRITEO_INTEGER,
        layout: RawLayout | None = None,
        wrap_keys: bool = False,
        holdout: int | None = None,
    ):
        self.paths = _expand(paths)
        self.plan = plan
        self.batch_size = plan.batch_size
        self.layout = layout or RawLayout()
        if self.layout.label_dim != 1:
            raise ReaderError(
                f"{self.paths[0]}: error: only one label per sample is supported (label_dim=1)"
            )
        self.wrap_keys = wrap_keys
        self.hotness = _slot_hotness(plan, f"{self.paths[0]} (read as HugeCTR raw data)")
        self.dense_features = dense_features
        self.dtype = self.layout.record(dense_features, sum(self.hotness))
        size = self.dtype.itemsize
        self._maps: list[np.ndarray] = []
        self._starts = [0]
        for p in self.paths:
            nbytes = p.stat().st_size
            whole, rest = divmod(nbytes, size)
            if rest:
                raise ReaderError(
                    f"{p}: byte {whole * size}: error: truncated record: the file has {nbytes} "
                    f"bytes, not a multiple of the {size}-byte record ({self._describe()})"
                )
            self._maps.append(
                np.memmap(p, dtype=self.dtype, mode="r", shape=(whole,))
                if whole
                else np.zeros(0, dtype=self.dtype)
            )
            self._starts.append(self._starts[-1] + whole)
        self.num_samples = self._starts[-1]
        self.train_batches, self.eval_batches = _split(
            self.num_samples // self.batch_size, holdout, str(self.paths[0])
        )
        self._rows = np.array([plan.table(f.table).rows for f in plan.features], dtype=np.int64)

    def _describe(self) -> str:
        lay = self.layout
        return (
            f"{lay.label_dtype} label, {self.dense_features} {lay.dense_dtype} dense, "
            f"{sum(self.hotness)} {lay.key_dtype} keys over {len(self.hotness)} slots"
        )

    def _records(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Records of global samples [lo, hi) and each one's (file index) ."""
        parts, files = [], []
        for i, m in enumerate(self._maps):
            a, b = max(lo, self._starts[i]), min(hi, self._starts[i + 1])
            if a < b:
                parts.append(np.asarray(m[a - self._starts[i] : b - self._starts[i]]))
                files.append(np.full(b - a, i, dtype=np.int64))
        return np.concatenate(parts), np.concatenate(files)

    def _fail(self, sample: int, message: str) -> ReaderError:
        i = int(np.searchsorted(self._starts, sample, side="right")) - 1
        offset = (sample - self._starts[i]) * self.dtype.itemsize
        return ReaderError(f"{self.paths[i]}: byte {offset}: error: {message}")

    def _samples(self, first: int, lo: int, hi: int) -> Batch:
        rec, _ = self._records(first + lo, first + hi)
        n = len(rec)
        label = rec["label"][:, 0]
        bad = np.flatnonzero((label != 0) & (label != 1))
        if len(bad):
            k = int(bad[0])
            raise self._fail(
                first + lo + k,
                f"label {label[k].item()!r} is not 0 or 1 (is the layout right? {self._describe()})",
            )
        dense = rec["dense"]
        if self.layout.dense_dtype == "int32":
            dense = np.log1p(np.maximum(dense, 0).astype(np.float64))
        keys = rec["keys"].astype(np.int64)
        sparse: dict[str, Bag] = {}
        pos = 0
        for fi, (f, h) in enumerate(zip(self.plan.features, self.hotness, strict=True)):
            ids = keys[:, pos : pos + h]
            rows = int(self._rows[fi])
            if self.wrap_keys:
                ids = ids % rows
            else:
                bad_rows = np.flatnonzero(((ids < 0) | (ids >= rows)).any(axis=1))
                if len(bad_rows):
                    k = int(bad_rows[0])
                    raise self._fail(
                        first + lo + k,
                        f"slot {fi} (feature `{f.name}`) has key {int(ids[k].max())} outside "
                        f"table `{f.table}` of {rows} rows (wrap_keys=True takes keys mod rows)",
                    )
            sparse[f.name] = Bag(
                ids=np.ascontiguousarray(ids).reshape(-1),
                offsets=np.arange(0, n * h + 1, h, dtype=np.int64),
                weights=_weights(f, n * h),
            )
            pos += h
        return Batch(
            dense=np.ascontiguousarray(dense, dtype=np.float32),
            labels=label.astype(np.float32),
            sparse=sparse,
        )


def write_hugectr_raw(
    path: str | Path, batches: Iterable[Batch], plan: Plan, *, layout: RawLayout | None = None
) -> int:
    """Write batches as a HugeCTR raw file; return the sample count.

    Every feature's bags must hold exactly round(hotness) ids. Dense values are written as
    float32, or for an int32 dense layout as `rint(expm1(max(d, 0)))`.
    """
    lay = layout or RawLayout()
    hot = _slot_hotness(plan, f"{path} (HugeCTR raw output)")
    total = 0
    with open(path, "wb") as out:
        for b in batches:
            n = len(b.labels)
            rec = np.zeros(n, dtype=lay.record(b.dense.shape[1], sum(hot)))
            rec["label"][:, 0] = b.labels
            if lay.dense_dtype == "int32":
                rec["dense"] = np.rint(np.expm1(np.maximum(b.dense.astype(np.float64), 0)))
            else:
                rec["dense"] = b.dense
            pos = 0
            for f, h in zip(plan.features, hot, strict=True):
                bag = b.sparse[f.name]
                if not np.array_equal(np.diff(bag.offsets), np.full(n, h)):
                    raise ValueError(f"feature `{f.name}`: every sample needs exactly {h} ids")
                rec["keys"][:, pos : pos + h] = np.asarray(bag.ids).reshape(n, h)
                pos += h
            out.write(rec.tobytes())
            total += n
    return total


# --------------------------------------------------------------------------- entry point


_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")


def _sniff(path: Path) -> str:
    if path.suffix in (".bin", ".raw"):
        return "hugectr"
    if path.suffix in _PARQUET_SUFFIXES:
        return "parquet"
    if _is_gzip(path) or path.suffix in (".tsv", ".txt", ".csv"):
        return "criteo"
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if head.startswith(b"PAR1"):
        return "parquet"
    # Criteo text is printable ASCII with tabs; raw records are mostly zero and control bytes
    printable = sum(1 for c in head if c in (9, 10, 13) or 32 <= c < 127)
    return "criteo" if head and printable == len(head) and b"\t" in head else "hugectr"


def parse_column_map(text: str) -> dict[str, str]:
    """`FEATURE=COLUMN,...` or the path of a JSON object {feature: column} -> a dict.

    ReaderError says what is wrong with the text or the file (the trainer's --column-map).
    """
    import json

    text = text.strip()
    if "=" not in text:
        path = Path(text)
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise ReaderError(
                f"--column-map {text}: cannot read it ({e.strerror or e}); give "
                'FEATURE=COLUMN,... or a JSON file holding {"feature": "column", ...}'
            ) from None
        except ValueError as e:
            raise ReaderError(f"--column-map {text}: not JSON: {e}") from None
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in raw.items()
        ):
            raise ReaderError(
                f"--column-map {text}: expected a JSON object of feature names to column "
                'names, e.g. {"user": "C1"}'
            )
        return dict(raw)
    out: dict[str, str] = {}
    for item in text.split(","):
        feature, eq, column = (x.strip() for x in item.partition("="))
        if not eq or not feature or not column:
            raise ReaderError(
                f"--column-map {text}: `{item}` is not FEATURE=COLUMN (e.g. user=C1,item=C2)"
            )
        if feature in out:
            raise ReaderError(f"--column-map {text}: feature `{feature}` is mapped twice")
        out[feature] = column
    return out


def _criteo_columns(column_map: dict[str, str], plan: Plan, where: Path) -> dict[str, int]:
    """A column map of Criteo column names (C1..C26) as the reader's column indices; the
    features it does not name keep their positional column."""
    names = {f.name for f in plan.features}
    out = {f.name: i for i, f in enumerate(plan.features)}
    for feature, column in column_map.items():
        if feature not in names:
            raise ReaderError(
                f"{where}: error: the column map names feature `{feature}`, which the plan "
                f"does not have (features: {', '.join(f.name for f in plan.features)})"
            )
        c = column.upper()
        if not (c.startswith("C") and c[1:].isdigit() and 1 <= int(c[1:]) <= CRITEO_CATEGORICAL):
            raise ReaderError(
                f"{where}: error: feature `{feature}` is mapped to `{column}`; the columns of "
                f"Criteo TSV data are C1 ... C{CRITEO_CATEGORICAL}"
            )
        out[feature] = int(c[1:]) - 1
    return out


def open_dataset(
    path: str | Path | Sequence[str | Path],
    plan: Plan,
    *,
    fmt: Literal["auto", "criteo", "hugectr", "parquet"] = "auto",
    dense_features: int = CRITEO_INTEGER,
    column_map: dict[str, str] | None = None,
    **options: Any,
) -> Any:
    """A reader for a dataset: `fmt="auto"` looks at the first file (suffix, then content).

    `column_map` maps features to columns: Parquet column names, or Criteo's C1..C26
    (HugeCTR raw has no named columns). `options` go to the reader (columns=, holdout=,
    engine= for Criteo; layout=, wrap_keys= for HugeCTR raw; label=, dense_columns=,
    wrap_keys= for Parquet).
    """
    paths = _expand(path)
    given = [path] if isinstance(path, str | Path) else list(path)
    if len(given) == 1 and Path(given[0]).is_dir() and fmt in ("auto", "parquet"):
        # a Parquet folder (NVTabular's, Spark's) also holds _metadata, schema.pbtxt, ...
        tables = [p for p in paths if p.suffix in _PARQUET_SUFFIXES]
        if tables:
            paths, fmt = tables, "parquet"
    kind = _sniff(paths[0]) if fmt == "auto" else fmt
    if kind == "criteo":
        if column_map:
            options["columns"] = _criteo_columns(column_map, plan, paths[0])
        return CriteoTSVReader(paths, plan, dense_features=dense_features, **options)
    if kind == "hugectr":
        if column_map:
            raise ReaderError(
                f"{paths[0]}: error: HugeCTR raw data has no named columns (slot i is "
                "feature i): drop the column map"
            )
        return HugeCTRRawReader(paths, plan, dense_features=dense_features, **options)
    if kind == "parquet":
        from embark_runtime.parquet import ParquetReader

        return ParquetReader(
            paths, plan, dense_features=dense_features, columns=column_map, **options
        )
    raise ReaderError(
        f"{paths[0]}: error: unknown dataset format {fmt!r} (criteo, hugectr, parquet or auto)"
    )
