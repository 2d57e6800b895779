"""Measure access statistics of a dataset: ids per feature, for the spec's `access` and
`hotness` lines.

`profile(data, program)` reads the dataset through the runtime's readers
(`embark_runtime.readers.open_dataset`: Criteo TSV, HugeCTR raw, and whatever format it
learns to read, Parquet included) as the trainer would, one global batch at a time, and
counts every id of every feature. Memory is bounded by the distinct ids seen (a sorted
key/count pair per feature, merged every MERGE_IDS pending ids), not by the dataset.
`samples` reads that many samples, spread evenly over the dataset as whole batches.

`FeatureProfile.alpha` is a Zipf exponent fitted by least squares on the log-log
rank-frequency curve of the keys seen at least twice (the head, where counts are
measured rather than noise); None when fewer than MIN_FIT_KEYS keys qualify.

`write_histograms` writes each feature's counts in the histogram format of
docs/language.md (`key count` lines); `rewrite_spec` points the spec's access lines at
them and sets the measured hotness, leaving everything else of the file as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embarkc.diagnostics import EmbarkError

MERGE_IDS = 1 << 22
MIN_FIT_KEYS = 8


@dataclass
class FeatureProfile:
    name: str
    table: str
    rows: int
    samples: int
    ids: int
    max_hotness: int
    min_hotness: int
    keys: np.ndarray
    """Distinct keys seen, ascending."""
    counts: np.ndarray
    """How often each of `keys` was seen."""
    alpha: float | None

    @property
    def mean_hotness(self) -> float:
        return self.ids / self.samples if self.samples else 0.0

    @property
    def distinct(self) -> int:
        return int(self.keys.size)


class _Counter:
    """Key counts of one feature, merged in bounded chunks."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.size = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.size += ids.size
        if self.size >= MERGE_IDS:
            self.merge()

    def merge(self) -> None:
        if not self.pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self.pending), return_counts=True)
        keys = np.concatenate([self.keys, new_keys])
        counts = np.concatenate([self.counts, new_counts])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts).astype(np.int64)
        self.pending, self.size = [], 0


def reader_plan(program: Any) -> Any:
    """A plan of `program` for the readers, which need its tables, features and batch only:
    the first fixed strategy that fits (its layout is not used)."""
    from embarkc.planner.baselines import build_baseline

    last: EmbarkError | None = None
    for strategy in ("row-wise", "table-wise", "data-parallel"):
        try:
            return build_baseline(program, strategy)
        except EmbarkError as e:
            last = e
    assert last is not None
    raise last


def profile(
    data: list[str], program: Any, *, fmt: str = "auto", samples: int | None = None
) -> tuple[list[FeatureProfile], int]:
    """Per feature of `program`, its measured statistics over `data`, and the samples
    read. Raises EmbarkError for data the readers refuse (their message names the file and
    byte offset)."""
    from embark_runtime.readers import ReaderError, open_dataset

    plan = reader_plan(program)
    try:
        reader = open_dataset(
            data, plan, fmt=fmt, dense_features=program.model.dense_features, holdout=0
        )
        total = reader.train_batches + reader.eval_batches
        if total == 0:
            raise EmbarkError.at(
                data[0],
                f"fewer samples than one batch ({plan.batch_size:,}): nothing to count",
                hint="give more data, or a smaller `batch` in the spec's model block",
            )
        steps = list(range(total))
        if samples is not None:
            want = max(1, math.ceil(samples / plan.batch_size))
            if want < total:
                steps = sorted({(i * total) // want for i in range(want)})
        counters = {f.name: _Counter() for f in plan.features}
        lengths: dict[str, tuple[int, int, int]] = {f.name: (0, 0, 1 << 62) for f in plan.features}
        read = 0
        for step in steps:
            batch = reader.batch(step, 0, 1)
            read += plan.batch_size
            for name, bag in batch.sparse.items():
                counters[name].add(bag.ids)
                n = bag.lengths
                ids, most, least = lengths[name]
                lengths[name] = (
                    ids + int(n.sum()),
                    max(most, int(n.max())),
                    min(least, int(n.min())),
                )
    except ReaderError as e:
        raise EmbarkError.at(data[0], str(e).split(": error: ", 1)[-1]) from None
    out = []
    for f in plan.features:
        c = counters[f.name]
        c.merge()
        ids, most, least = lengths[f.name]
        out.append(
            FeatureProfile(
                name=f.name,
                table=f.table,
                rows=plan.table(f.table).rows,
                samples=read,
                ids=ids,
                max_hotness=most,
                min_hotness=least,
                keys=c.keys,
                counts=c.counts,
                alpha=fit_zipf(c.counts),
            )
        )
    return out, read


def fit_zipf(counts: np.ndarray) -> float | None:
    """The exponent a of count(rank r) ~ C / r^a (ranks from 1, most frequent first),
    fitted on the keys seen at least twice; None when there are too few of them."""
    head = np.sort(counts[counts >= 2])[::-1].astype(np.float64)
    if head.size < MIN_FIT_KEYS:
        return None
    x = np.log(np.arange(1, head.size + 1, dtype=np.float64))
    y = np.log(head)
    slope = np.polyfit(x, y, 1)[0]
    return round(max(float(-slope), 0.01), 3)


def histogram_text(p: FeatureProfile, source: str) -> str:
    lines = [
        f"# ids of feature {p.name} (table {p.table}, {p.rows:,} rows), measured by "
        "`embarkc profile`",
        f"# from {source}: {p.samples:,} samples, {p.ids:,} ids, {p.distinct:,} distinct keys",
    ]
    lines += [f"{k} {c}" for k, c in zip(p.keys.tolist(), p.counts.tolist(), strict=True)]
    return "\n".join(lines) + "\n"


def hotness_field(p: FeatureProfile) -> str:
    """The spec's hotness field for the measured bags: fixed when every bag had the same
    length, else `mean M max N` (mean rounded to 3 decimals, at least 1)."""
    if p.min_hotness == p.max_hotness:
        return f"hotness {max(1, p.max_hotness)}"
    mean = max(1.0, round(p.mean_hotness, 3))
    return f"hotness mean {mean:g} max {max(1, p.max_hotness)}"


# --------------------------------------------------------------------------- --write


def rewrite_spec(
    text: str, filename: str, fields: dict[str, dict[str, str]]
) -> tuple[str, list[str]]:
    """`text` with, for each feature of `fields` ({feature: {"access": "access ...",
    "hotness": "hotness ..."}}), those fields replaced in the block that declares the
    feature (`feature NAME` or `table NAME`), or added at its end; then formatted as `fmt`
    does. Returns the new text and the features it could not rewrite (declared by a
    `tables` group or in another file), each with why."""
    from embarkc.format import format_text
    from embarkc.syntax import edge_token, parse

    tree = parse(text, filename)
    edits: list[tuple[int, int, str]] = []
    found: set[str] = set()
    for block in tree.children:
        if not hasattr(block, "data") or block.data not in ("table", "feature"):
            continue
        name_tok = next((c for c in block.children if getattr(c, "type", None) == "NAME"), None)
        if name_tok is None or str(name_tok) not in fields:
            continue
        name = str(name_tok)
        if block.data == "table" and any(
            getattr(c, "data", None) == "reads" for c in block.children
        ):
            continue
        want = fields[name]
        found.add(name)
        close = edge_token(block, last=True)
        assert close is not None
        for kind, value in want.items():
            rules = (
                ("hotness_fixed", "hotness_variable")
                if kind == "hotness"
                else ("access", "access_histogram")
            )
            node = next((c for c in block.children if getattr(c, "data", None) in rules), None)
            if node is not None:
                first, last = edge_token(node), edge_token(node, last=True)
                assert first is not None and last is not None
                edits.append((first.start_pos, last.end_pos, value))  # type: ignore[arg-type]
            else:
                at = close.start_pos
                edits.append((at, at, f" {value} "))  # type: ignore[arg-type]
    for start, end, value in sorted(edits, reverse=True):
        text = text[:start] + value + text[end:]
    missed = [
        f"{name}: not declared by a `table` or `feature` block of {filename} (a `tables` "
        "group, or an included file): add its lines by hand"
        for name in fields
        if name not in found
    ]
    return format_text(text, filename), missed


def _rel(path: Path, spec: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), spec.resolve().parent).replace(os.sep, "/")


def spec_fields(
    profiles: list[FeatureProfile], paths: dict[str, Path], spec: Path
) -> dict[str, dict[str, str]]:
    """The access and hotness fields `--write` gives each profiled feature."""
    out = {}
    for p in profiles:
        if p.ids == 0:
            continue
        out[p.name] = {
            "access": f'access histogram "{_rel(paths[p.name], spec)}"',
            "hotness": hotness_field(p),
        }
    return out
