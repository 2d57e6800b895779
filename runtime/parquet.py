"""Parquet datasets (pyarrow, imported when a Parquet file is opened) as `Batch`es.

The layout NVTabular and the MLPerf DLRM multi-hot preprocessing write: one row per
sample, a `label` column, dense columns (`I1` ... `In` by default, as Criteo names them)
and one column per categorical feature, named as the feature, holding an integer (one id)
or a list of integers (multi-hot). `columns={feature: column}` maps features to other
column names (and `label` or `I3`, when no feature is so named, the label or a dense column). A folder of files is one stream, as for the other readers
(embark_runtime.readers: batches, ranks, epochs and held-out batches work the same).

Values:
* label: an integer, float or boolean column whose values are 0 or 1;
* dense: an integer column is a raw count read as `log(1 + max(x, 0))` (as the Criteo TSV
  reader does); a float column is taken as already preprocessed (NVTabular's output), as
  float32; a null is 0;
* categorical: keys are rows of the feature's table, in [0, rows) (Categorify's output);
  `wrap_keys=True` takes them mod rows. A null id is the reserved "missing" key 0, a null
  list an empty bag; a null inside a list is an error;
* weights: a weighted feature reads its per-id weights from the column `<column>_weights`
  when the file has one (a float, or a list of floats as long as the ids' list), else 1.0.

Errors raise ReaderError naming the file and column (`FILE: error: column `C` ...`), and
for a bad value its row in the file (`FILE: row R: error: ...`, rows from 0). Every file's
schema is checked when the reader is built; values when a batch reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embark_runtime.plan import Plan
from embark_runtime.readers import (
    CRITEO_INTEGER,
    MISSING_KEY,
    ReaderError,
    _Batches,
    _expand,
    _split,
)
from embark_runtime.synthetic import Bag, Batch

__all__ = ["WEIGHTS_SUFFIX", "ParquetReader", "default_dense_columns", "write_parquet"]

WEIGHTS_SUFFIX = "_weights"
"""A weighted feature's per-id weights: column `<its column>_weights`, if present."""
_CACHED_GROUPS = 4
"""Decoded row groups kept: the ranks' slices of consecutive batches share row groups."""


def default_dense_columns(n: int) -> list[str]:
    """Criteo's names of `n` dense columns: I1 ... In."""
    return [f"I{i + 1}" for i in range(n)]


@dataclass
class _Group:
    """One decoded row group: numpy arrays per column."""

    label: np.ndarray
    dense: np.ndarray
    ids: list[np.ndarray]
    offsets: list[np.ndarray | None]  # None: one id per row
    weights: list[np.ndarray | None]  # None: no weights column (weighted: 1.0)


def _kind(t: Any) -> str | None:
    """'int', 'float', 'bool', 'list' (of integers) or None for a column type."""
    import pyarrow as pa

    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if pa.types.is_integer(t.value_type):
            return "list"
        if pa.types.is_floating(t.value_type):
            return "float list"
    return None


class ParquetReader(_Batches):
    """Parquet files, one row per sample; see the module docstring for the layout."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        plan: Plan,
        *,
        columns: Mapping[str, str] | None = None,
        label: str = "label",
        dense_columns: Sequence[str] | None = None,
        dense_features: int = CRITEO_INTEGER,
        wrap_keys: bool = False,
        holdout: int | None = None,
    ):
        import pyarrow.parquet as pq

        self.paths = _expand(paths)
        self.plan = plan
        self.batch_size = plan.batch_size
        self.wrap_keys = wrap_keys
        columns = dict(columns or {})
        features = {f.name for f in plan.features}
        dense = list(dense_columns or default_dense_columns(dense_features))
        if len(dense) != dense_features:
            raise ReaderError(
                f"{self.paths[0]}: error: {len(dense)} dense columns given, the model "
                f"expects {dense_features}"
            )
        # the map also renames the label and the dense columns (by their default names),
        # unless a feature is so named
        for key in sorted(set(columns) - features):
            if key != label and key not in dense:
                raise ReaderError(
                    f"{self.paths[0]}: error: the column map names `{key}`, which is no feature "
                    f"of the plan (features: {', '.join(f.name for f in plan.features)}) nor "
                    f"the label `{label}` or a dense column ({dense[0]} ... {dense[-1]})"
                )
            if key == label:
                label = columns[key]
            else:
                dense[dense.index(key)] = columns[key]
        self.columns = {f.name: columns.get(f.name, f.name) for f in plan.features}
        self.label = label
        self.dense_columns = dense
        self._rows = [plan.table(f.table).rows for f in plan.features]
        self._files: list[Any] = []
        self._group_starts: list[list[int]] = []  # per file: first row of each row group
        self._starts = [0]  # first global sample of each file
        self._kinds: list[dict[str, str]] = []
        for p in self.paths:
            try:
                meta = pq.read_metadata(p)
                schema = pq.read_schema(p)
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
                raise ReaderError(f"{p}: error: not a readable Parquet file ({e})") from None
            self._kinds.append(self._check_schema(p, schema))
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._group_starts.append(list(np.concatenate(([0], np.cumsum(rows))).astype(int)))
            self._starts.append(self._starts[-1] + meta.num_rows)
        self.num_samples = self._starts[-1]
        self.train_batches, self.eval_batches = _split(
            self.num_samples // self.batch_size, holdout, str(self.paths[0])
        )
        self._cache: OrderedDict[tuple[int, int], _Group] = OrderedDict()
        self._open: tuple[int, Any] | None = None

    # ---------------------------------------------------------------- schema

    def _check_schema(self, path: Path, schema: Any) -> dict[str, str]:
        """The kind of every column read; ReaderError for a missing or mistyped one."""
        names = set(schema.names)
        want: list[tuple[str, str, tuple[str, ...]]] = [
            (self.label, "the label", ("int", "float", "bool"))
        ]
        want += [(c, "a dense column", ("int", "float")) for c in self.dense_columns]
        want += [
            (self.columns[f.name], f"feature `{f.name}`", ("int", "list"))
            for f in self.plan.features
        ]
        kinds = {}
        for f in self.plan.features:
            w = self.columns[f.name] + WEIGHTS_SUFFIX
            if f.weighted and w in names:
                want.append((w, f"the weights of feature `{f.name}`", ("float", "float list")))
        for col, what, allowed in want:
            if col not in names:
                feature = what.startswith("feature")
                # for a feature: the columns that are neither the label nor dense ones
                listed = [
                    n
                    for n in schema.names
                    if not feature or (n != self.label and n not in self.dense_columns)
                ]
                shown = ", ".join(listed[:30]) + (", ..." if len(listed) > 30 else "")
                has = (
                    "besides the label and dense columns, the file has"
                    if feature
                    else "the file has"
                )
                hint = (
                    " (the spec's `column` or --column-map FEATURE=COLUMN maps a feature to "
                    "another column)"
                    if feature
                    else ""
                )
                raise ReaderError(
                    f"{path}: error: no column `{col}` for {what}; {has}: {shown}{hint}"
                )
            t = schema.field(col).type
            kind = _kind(t)
            if kind not in allowed:
                expected = {
                    ("int", "float", "bool"): "an integer, float or boolean",
                    ("int", "float"): "an integer or float",
                    ("int", "list"): "an integer (one id) or a list of integers (multi-hot)",
                    ("float", "float list"): "a float (one id) or a list of floats (multi-hot)",
                }[allowed]
                raise ReaderError(
                    f"{path}: error: column `{col}` ({what}) is {t}, expected {expected} column"
                )
            kinds[col] = kind
        return kinds

    # ---------------------------------------------------------------- reading

    def _file(self, i: int) -> Any:
        import pyarrow.parquet as pq

        if self._open is None or self._open[0] != i:
            if self._open is not None:
                self._open[1].close()
            try:
                self._open = (i, pq.ParquetFile(self.paths[i]))
            except Exception as e:  # noqa: BLE001
                raise ReaderError(f"{self.paths[i]}: error: cannot read: {e}") from None
        return self._open[1]

    def _group(self, i: int, g: int) -> _Group:
        key = (i, g)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        want = list(self._kinds[i])
        try:
            table = self._file(i).read_row_group(g, columns=list(dict.fromkeys(want)))
        except ReaderError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged or changed file
            raise ReaderError(f"{self.paths[i]}: error: cannot read row group {g}: {e}") from None
        group = self._decode(i, g, table)
        self._cache[key] = group
        while len(self._cache) > _CACHED_GROUPS:
            self._cache.popitem(last=False)
        return group

    def _fail(self, i: int, g: int, row: int, message: str) -> ReaderError:
        return ReaderError(
            f"{self.paths[i]}: row {self._group_starts[i][g] + row}: error: {message}"
        )

    def _decode(self, i: int, g: int, table: Any) -> _Group:
        """Row group `g` of file `i` (a pyarrow table) as numpy arrays, checked."""
        label = self._labels(i, g, table)
        dense = self._dense(i, table)
        ids: list[np.ndarray] = []
        offsets: list[np.ndarray | None] = []
        weights: list[np.ndarray | None] = []
        for f, rows in zip(self.plan.features, self._rows, strict=True):
            c = self.columns[f.name]
            keys, off = self._ids(i, g, table, f.name, f.table, c, rows)
            ids.append(keys)
            offsets.append(off)
            weights.append(self._weights(i, g, table, f.name, c, off))
        return _Group(
            label=label,
            dense=dense,
            ids=ids,
            offsets=offsets,
            weights=weights,
        )

    def _labels(self, i: int, g: int, table: Any) -> np.ndarray:
        """The label column as float32 0/1; ReaderError at the first other value or null."""
        col = table.column(self.label)
        label = _numpy(col, 0).astype(np.float64)
        bad = np.flatnonzero((label != 0) & (label != 1))
        if col.null_count:
            bad = np.union1d(bad, _nulls(col))
        if len(bad):
            k = int(bad[0])
            value = _value(table, self.label, k)
            raise self._fail(i, g, k, f"column `{self.label}` (the label) is {value}, not 0 or 1")
        return label.astype(np.float32)

    def _dense(self, i: int, table: Any) -> np.ndarray:
        """[n, dense columns] float32: integer columns as log(1 + max(x, 0)), floats as
        they are, nulls 0."""
        dense = np.zeros((table.num_rows, len(self.dense_columns)), dtype=np.float32)
        for j, c in enumerate(self.dense_columns):
            v = _numpy(table.column(c), 0)
            if self._kinds[i][c] == "int":
                dense[:, j] = np.log1p(np.maximum(v.astype(np.int64), 0).astype(np.float64))
            else:
                dense[:, j] = v.astype(np.float32)
        return dense

    def _ids(
        self, i: int, g: int, table: Any, feature: str, tname: str, c: str, rows: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(int64 keys, offsets per row or None for one id per row) of column `c`, in
        [0, rows) (or taken mod rows with wrap_keys)."""
        import pyarrow.compute as pc

        n = table.num_rows
        col = table.column(c)
        off: np.ndarray | None = None
        if self._kinds[i][c] == "list":
            arr = col.combine_chunks()
            lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
            flat = arr.flatten()
            if flat.null_count:
                where = _row_of_null_item(arr)
                raise self._fail(
                    i, g, where, f"column `{c}` (feature `{feature}`) holds a null id in its list"
                )
            keys = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
            row_of = np.repeat(np.arange(n), lengths)
        else:
            keys = _numpy(col, MISSING_KEY).astype(np.int64, copy=False)
            row_of = np.arange(n)
        if self.wrap_keys:
            return keys % rows, off
        out = np.flatnonzero((keys < 0) | (keys >= rows))
        if len(out):
            k = int(out[0])
            raise self._fail(
                i,
                g,
                int(row_of[k]),
                f"column `{c}` (feature `{feature}`) has key {int(keys[k])} outside table "
                f"`{tname}` of {rows} rows (keys are table rows; wrap_keys=True takes them "
                "mod rows)",
            )
        return keys, off

    def _weights(
        self, i: int, g: int, table: Any, feature: str, c: str, off: np.ndarray | None
    ) -> np.ndarray | None:
        """The per-id weights of a feature's column `c` from `c_weights`, if the file has
        them: as many as the ids in every row."""
        import pyarrow.compute as pc

        w = c + WEIGHTS_SUFFIX
        if w not in self._kinds[i]:
            return None
        col = table.column(w)
        if self._kinds[i][w] == "float list":
            arr = col.combine_chunks()
            lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
            flat = arr.flatten()
            values = flat.to_numpy(zero_copy_only=False)
            if flat.null_count:
                return self._bad_weights(i, g, w, feature, _row_of_null_item(arr), "a null")
        else:
            lengths = np.ones(table.num_rows, dtype=np.int64)
            values = _numpy(col, 1.0)
        want = np.diff(off) if off is not None else np.ones(table.num_rows, dtype=np.int64)
        wrong = np.flatnonzero(lengths != want)
        if len(wrong):
            k = int(wrong[0])
            return self._bad_weights(
                i, g, w, feature, k, f"{int(lengths[k])} weights for {int(want[k])} ids"
            )
        return np.asarray(values, dtype=np.float32)

    def _bad_weights(self, i: int, g: int, w: str, feature: str, row: int, what: str) -> Any:
        raise self._fail(
            i, g, row, f"column `{w}` (the weights of feature `{feature}`) holds {what}"
        )

    def _samples(self, first: int, lo: int, hi: int) -> Batch:
        a, b = first + lo, first + hi
        parts: list[tuple[_Group, int, int]] = []
        for i in range(len(self.paths)):
            fa, fb = max(a, self._starts[i]), min(b, self._starts[i + 1])
            if fa >= fb:
                continue
            ra, rb = fa - self._starts[i], fb - self._starts[i]
            gs = self._group_starts[i]
            g = int(np.searchsorted(gs, ra, side="right")) - 1
            while ra < rb:
                end = min(rb, gs[g + 1])
                parts.append((self._group(i, g), ra - gs[g], end - gs[g]))
                ra, g = end, g + 1
        n = b - a
        labels = np.concatenate([p.label[s:e] for p, s, e in parts])
        dense = np.concatenate([p.dense[s:e] for p, s, e in parts])
        sparse: dict[str, Bag] = {}
        for fi, f in enumerate(self.plan.features):
            pieces, lengths, wpieces = [], [], []
            for p, s, e in parts:
                off = p.offsets[fi]
                a, b = (s, e) if off is None else (int(off[s]), int(off[e]))
                pieces.append(p.ids[fi][a:b])
                lengths.append(
                    np.ones(e - s, dtype=np.int64) if off is None else np.diff(off[s : e + 1])
                )
                w = p.weights[fi]
                wpieces.append(np.ones(b - a, dtype=np.float32) if w is None else w[a:b])
            keys = np.concatenate(pieces)
            offsets = np.concatenate(([0], np.cumsum(np.concatenate(lengths)))).astype(np.int64)
            weights = np.concatenate(wpieces) if f.weighted else None
            sparse[f.name] = Bag(ids=keys, offsets=offsets, weights=weights)
        assert len(labels) == n
        return Batch(dense=dense, labels=labels, sparse=sparse)

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
        self._cache.clear()


def _numpy(col: Any, null: float) -> np.ndarray:
    """A chunked column as numpy, nulls as `null` (booleans as 0/1)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_boolean(col.type):
        col = pc.cast(col, pa.int8())
    if col.null_count:
        col = pc.fill_null(col, pa.scalar(null).cast(col.type))
    return np.asarray(col.to_numpy())


def _nulls(col: Any) -> np.ndarray:
    import pyarrow.compute as pc

    return np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))


def _value(table: Any, column: str, row: int) -> str:
    v = table.column(column)[row].as_py()
    return "null" if v is None else repr(v)


def _row_of_null_item(arr: Any) -> int:
    """The first row of a list array with a null inside its list (one that has one)."""
    for r, v in enumerate(arr.to_pylist()):
        if v and any(x is None for x in v):
            return r
    raise AssertionError("no null item")  # pragma: no cover


def write_parquet(
    path: str | Path,
    batches: Iterable[Batch],
    plan: Plan,
    *,
    columns: Mapping[str, str] | None = None,
    multi_hot: bool | None = None,
    dense_integer: bool = False,
    row_group_size: int | None = None,
) -> int:
    """Write batches as one Parquet file; return the sample count.

    Features become `list<int64>` columns (or `int64` when every bag holds one id and
    `multi_hot` is not True), dense values float32 columns I1..In (or, with
    `dense_integer`, int64 counts `rint(expm1(max(d, 0)))`, read back as their log1p).
    Reading the file back gives the batches' keys and labels.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    blist = list(batches)
    cols = {f.name: f.name for f in plan.features} | dict(columns or {})
    if not blist:
        raise ValueError("no batches to write")
    labels = np.concatenate([b.labels for b in blist]).astype(np.int64)
    dense = np.concatenate([b.dense for b in blist]).astype(np.float32)
    data: dict[str, Any] = {"label": pa.array(labels, pa.int64())}
    for j, name in enumerate(default_dense_columns(dense.shape[1])):
        if dense_integer:
            counts = np.rint(np.expm1(np.maximum(dense[:, j].astype(np.float64), 0)))
            data[name] = pa.array(counts.astype(np.int64))
        else:
            data[name] = pa.array(dense[:, j])
    for f in plan.features:
        ids = np.concatenate([np.asarray(b.sparse[f.name].ids, dtype=np.int64) for b in blist])
        lengths = np.concatenate([np.diff(b.sparse[f.name].offsets) for b in blist])
        one = bool(np.all(lengths == 1))
        if one and multi_hot is not True:
            data[cols[f.name]] = pa.array(ids, pa.int64())
        else:
            off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            data[cols[f.name]] = pa.ListArray.from_arrays(pa.array(off), pa.array(ids))
        if f.weighted and blist[0].sparse[f.name].weights is not None:
            w = np.concatenate([np.asarray(b.sparse[f.name].weights) for b in blist])
            w = w.astype(np.float32)
            data[cols[f.name] + WEIGHTS_SUFFIX] = (
                pa.array(w)
                if one and multi_hot is not True
                else pa.ListArray.from_arrays(pa.array(off), pa.array(w))
            )
    pq.write_table(pa.table(data), path, row_group_size=row_group_size)
    return len(labels)
