"""The fast data path: Parquet files (one-hot, multi-hot, weights, folders, row groups),
the column map, Criteo TSV through pyarrow (the same batches and errors as the Python
parser on every field form), and the prefetch thread (order, errors at their step,
shutdown)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_readers import PLAN, PLAN_MULTI, make_plan, synthetic

from embark_runtime.criteo_arrow import parse_block
from embark_runtime.parquet import ParquetReader, write_parquet
from embark_runtime.prefetch import Prefetcher
from embark_runtime.readers import (
    CriteoTSVReader,
    ReaderError,
    open_dataset,
    parse_column_map,
    write_criteo_tsv,
)
from embark_runtime.synthetic import Batch, SyntheticData

B = 8


def same(x: Batch, y: Batch) -> None:
    assert np.array_equal(x.labels, y.labels)
    assert x.dense.dtype == y.dense.dtype == np.float32
    assert np.array_equal(x.dense, y.dense)
    assert x.sparse.keys() == y.sparse.keys()
    for k in x.sparse:
        a, b = x.sparse[k], y.sparse[k]
        assert np.array_equal(a.ids, b.ids), k
        assert np.array_equal(a.offsets, b.offsets), k
        assert (a.weights is None) == (b.weights is None), k
        if a.weights is not None:
            assert np.array_equal(a.weights, b.weights), k


# --------------------------------------------------------------------------- Parquet


@pytest.mark.parametrize("plan", [PLAN, PLAN_MULTI], ids=["one-hot", "multi-hot"])
def test_parquet_gives_the_written_batches_on_every_rank(tmp_path, plan):
    """Row groups of 5 rows cut across batches and ranks' slices; weights round-trip."""
    data = SyntheticData(plan, seed=2)
    batches = [data.global_batch(s) for s in range(6)]
    path = tmp_path / "d.parquet"
    assert write_parquet(path, batches, plan, row_group_size=5) == 6 * B
    schema = pq.read_schema(path)
    for f in plan.features:
        want = pa.int64() if f.hotness == 1 else pa.list_(pa.int64())
        assert schema.field(f.name).type == want
    reader = open_dataset(path, plan)
    assert isinstance(reader, ParquetReader)
    assert (reader.train_batches, reader.eval_batches) == (5, 1)
    for step in range(reader.train_batches):
        for world in (1, 2, 4):
            for rank in range(world):
                same(reader.batch(step, rank, world), data.batch(step, rank, world))
    same(reader.eval_batch(0, 0, 1), batches[5])
    same(reader.batch(5, 0, 1), batches[0])  # epochs wrap


def test_a_parquet_folder_is_one_stream_and_its_other_files_are_passed_over(tmp_path):
    """NVTabular's output folder also holds _metadata and schema.pbtxt."""
    batches = synthetic(PLAN_MULTI, 5)
    folder = tmp_path / "train"
    folder.mkdir()
    samples = [
        Batch(dense=b.dense[lo:hi], labels=b.labels[lo:hi], sparse=_slice(b, lo, hi))
        for b in batches
        for lo, hi in ((0, 3), (3, B))
    ]
    # 10 part files of 3 and 5 samples: batches span files
    for k, part in enumerate(samples):
        write_parquet(folder / f"part_{k:02d}.parquet", [part], PLAN_MULTI, multi_hot=True)
    (folder / "_metadata").write_bytes(b"not a table")
    (folder / "schema.pbtxt").write_text("feature {}")
    reader = open_dataset(folder, PLAN_MULTI)
    assert isinstance(reader, ParquetReader) and len(reader.paths) == 10
    for step in range(reader.train_batches):
        for rank in range(4):
            want = SyntheticData(PLAN_MULTI, seed=1).batch(step, rank, 4)
            same(reader.batch(step, rank, 4), want)


def _slice(b: Batch, lo: int, hi: int) -> dict:
    from embark_runtime.synthetic import Bag

    out = {}
    for k, bag in b.sparse.items():
        a, e = int(bag.offsets[lo]), int(bag.offsets[hi])
        out[k] = Bag(
            ids=bag.ids[a:e],
            offsets=bag.offsets[lo : hi + 1] - a,
            weights=None if bag.weights is None else bag.weights[a:e],
        )
    return out


def test_parquet_integer_dense_columns_are_counts_and_nulls_have_meanings(tmp_path):
    """Integer dense columns are read as log(1 + max(x, 0)) (as Criteo TSV), float ones as
    they are; a null id is key 0, a null list an empty bag, a null dense value 0; a
    weighted feature without a weights column gets 1.0; a boolean label works."""
    n = B
    table = pa.table(
        {
            "label": pa.array([True, False] * (n // 2)),
            **{f"I{j + 1}": pa.array([-3, 0, 1, None, 7, 2, 3, 4], pa.int32()) for j in range(13)},
            "f0": pa.array([1, None, 2, 3, 4, 5, 6, 7], pa.int64()),
            "f1": pa.array([[1, 2], None, [], [6], [0], [1], [2], [3]], pa.list_(pa.int32())),
            "f2": pa.array(list(range(n)), pa.int16()),
            "f3": pa.array(list(range(n)), pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    b = ParquetReader(tmp_path / "d.parquet", PLAN, holdout=0).batch(0, 0, 1)
    assert b.labels.tolist() == [1, 0] * (n // 2)
    want = np.log1p(np.array([0, 0, 1, 0, 7, 2, 3, 4], dtype=np.float64)).astype(np.float32)
    assert np.array_equal(b.dense[:, 5], want)
    assert b.sparse["f0"].ids.tolist() == [1, 0, 2, 3, 4, 5, 6, 7]
    assert b.sparse["f1"].ids.tolist() == [1, 2, 6, 0, 1, 2, 3]
    assert b.sparse["f1"].offsets.tolist() == [0, 2, 2, 2, 3, 4, 5, 6, 7]
    assert b.sparse["f3"].weights.tolist() == [1.0] * n


def _table(n: int = B, **override) -> pa.Table:
    cols = {"label": pa.array([0, 1] * (n // 2)), "extra": pa.array(["x"] * n)}
    cols |= {f"I{j + 1}": pa.array(np.arange(n, dtype=np.float32)) for j in range(13)}
    cols |= {f"f{i}": pa.array(np.arange(n) % 7) for i in range(4)}
    cols |= override
    return pa.table({k: v for k, v in cols.items() if v is not None})


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"f2": None},
            "error: no column `f2` for feature `f2`; besides the label and dense columns, the "
            "file has: extra, f0, f1, f3",
        ),
        ({"I4": None}, "error: no column `I4` for a dense column"),
        ({"label": None}, "error: no column `label` for the label"),
        (
            {"f1": pa.array(["a"] * B)},
            "error: column `f1` (feature `f1`) is string, expected an integer (one id) or a "
            "list of integers (multi-hot) column",
        ),
        (
            {"I2": pa.array(["1"] * B)},
            "error: column `I2` (a dense column) is string, expected an integer or float column",
        ),
        (
            {"f3_weights": pa.array(["1"] * B)},
            "error: column `f3_weights` (the weights of feature `f3`) is string",
        ),
        (
            {"label": pa.array([0, 1, 2, 0, 0, 0, 0, 0])},
            "row 2: error: column `label` (the label) is 2, not 0 or 1",
        ),
        (
            {"label": pa.array([0, 1, 0, None, 0, 0, 0, 0])},
            "row 3: error: column `label` (the label) is null",
        ),
        (
            {"f1": pa.array([0, 1, 2, 3, 4, 7, 0, 0])},
            "row 5: error: column `f1` (feature `f1`) has key 7 outside table `tb` of 7 rows",
        ),
        (
            {"f0": pa.array([[0], [1], [-1, 2], [], [], [], [], []])},
            "row 2: error: column `f0` (feature `f0`) has key -1 outside table `ta`",
        ),
        (
            {"f0": pa.array([[0], [1], [], [2, None], [], [], [], []])},
            "row 3: error: column `f0` (feature `f0`) holds a null id in its list",
        ),
        (
            {"f3_weights": pa.array([[1.0]] * 4 + [[1.0, 2.0]] + [[1.0]] * 3)},
            "row 4: error: column `f3_weights` (the weights of feature `f3`) holds 2 weights for 1 ids",
        ),
    ],
)
def test_a_parquet_column_missing_mistyped_or_out_of_range_is_named(tmp_path, override, message):
    path = tmp_path / "bad.parquet"
    pq.write_table(_table(**override), path)
    with pytest.raises(ReaderError) as e:
        reader = open_dataset(path, PLAN, holdout=0)
        reader.batch(0, 0, 1)
    assert str(e.value).startswith(f"{path}: "), e.value
    assert message in str(e.value), e.value


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 but not really")
    with pytest.raises(ReaderError, match=r"d\.parquet: error: not a readable Parquet file"):
        open_dataset(path, PLAN)


# --------------------------------------------------------------------------- column map


def test_the_column_map_reads_features_from_other_columns(tmp_path):
    batches = synthetic(PLAN_MULTI, 3)
    names = {"f0": "C7", "f3": "clicks"}
    path = tmp_path / "d.parquet"
    write_parquet(path, batches, PLAN_MULTI, columns=names)
    assert {"C7", "clicks", "clicks_weights", "f1", "f2"} <= set(pq.read_schema(path).names)
    with pytest.raises(ReaderError, match="no column `f0` for feature `f0`.*--column-map"):
        open_dataset(path, PLAN_MULTI)
    reader = open_dataset(path, PLAN_MULTI, column_map=parse_column_map("f0=C7, f3=clicks"))
    same(reader.batch(1, 1, 2), SyntheticData(PLAN_MULTI, seed=1).batch(1, 1, 2))
    # the label and dense columns too, by their default names
    t = pq.read_table(path).rename_columns(
        [
            "click" if c == "label" else "count2" if c == "I2" else c
            for c in pq.read_schema(path).names
        ]
    )
    pq.write_table(t, path)
    mapped = open_dataset(path, PLAN_MULTI, column_map={**names, "label": "click", "I2": "count2"})
    assert (mapped.label, mapped.dense_columns[:3]) == ("click", ["I1", "count2", "I3"])
    same(mapped.batch(1, 1, 2), SyntheticData(PLAN_MULTI, seed=1).batch(1, 1, 2))
    with pytest.raises(ReaderError, match="no column `label` for the label"):
        open_dataset(path, PLAN_MULTI, column_map=names)
    with pytest.raises(ReaderError, match=r"names `I14`, which is no feature .* \(I1 ... I13\)"):
        open_dataset(path, PLAN_MULTI, column_map={"I14": "x"})
    as_json = tmp_path / "map.json"
    as_json.write_text(json.dumps(names))
    assert parse_column_map(str(as_json)) == names


def test_the_column_map_of_criteo_data_names_c1_to_c26(tmp_path):
    batches = synthetic(PLAN, 3)
    path = tmp_path / "d.tsv"
    write_criteo_tsv(path, batches, PLAN, columns={"f0": 20, "f1": 1, "f2": 2, "f3": 3})
    reader = open_dataset(path, PLAN, column_map={"f0": "C21"})
    assert reader.columns == {"f0": 20, "f1": 1, "f2": 2, "f3": 3}
    assert np.array_equal(reader.batch(0, 0, 1).sparse["f0"].ids, batches[0].sparse["f0"].ids)
    with pytest.raises(ReaderError, match="the columns of Criteo TSV data are C1 ... C26"):
        open_dataset(path, PLAN, column_map={"f0": "C27"})
    with pytest.raises(ReaderError, match=r"names feature `nope`.*\(features: f0, f1, f2, f3\)"):
        open_dataset(path, PLAN, column_map={"nope": "C1"})


@pytest.mark.parametrize(
    "text, message",
    [
        ("f0=C1,f1", "`f1` is not FEATURE=COLUMN"),
        ("f0=", "`f0=` is not FEATURE=COLUMN"),
        ("f0=a,f0=b", "feature `f0` is mapped twice"),
        ("missing.json", "missing.json: cannot read it"),
    ],
)
def test_a_bad_column_map_says_what_is_wrong(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReaderError, match=message):
        parse_column_map(text)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ReaderError, match="expected a JSON object of feature names"):
        parse_column_map("list.json")


# --------------------------------------------------------------------------- Criteo via pyarrow


def _field_forms(rng: np.random.Generator, kind: str) -> str:
    """A field of a Criteo line: mostly canonical, sometimes an odd but valid form, now
    and then a malformed one."""
    r = rng.random()
    if kind == "label":
        return "1" if r < 0.5 else "0" if r < 0.995 else str(rng.choice(["2", " 1", "", "1.0"]))
    if kind == "int":
        if r < 0.2:
            return ""
        if r < 0.9:
            return str(int(rng.integers(-5, 10 ** int(rng.integers(1, 18)))))
        return str(rng.choice(["007", "-0", "+5", " 5", "1_0", "99999999999999999999", "x", "-"]))
    if r < 0.2:
        return ""
    if r < 0.9:
        digits = int(rng.integers(1, 17))
        return "".join(rng.choice(list("0123456789abcdefABCDEF"), digits))
    return str(rng.choice(["0" * 16, "F" * 16, "1" * 17, "g1", "0x1", " a"]))


def _criteo_file(path: Path, rng: np.random.Generator, lines: int, odd: float) -> None:
    out = []
    for _ in range(lines):
        if rng.random() < odd:
            fields = [_field_forms(rng, "label")]
            fields += [_field_forms(rng, "int") for _ in range(13)]
            fields += [_field_forms(rng, "hex") for _ in range(26)]
        else:
            fields = ["1", *map(str, rng.integers(0, 100, 13)), *["00000007"] * 26]
        out.append("\t".join(fields))
    end = str(rng.choice(["\n", "\r\n"], p=[0.9, 0.1]))
    path.write_bytes((end.join(out) + ("" if rng.random() < 0.3 else end)).encode())


def test_criteo_through_pyarrow_equals_the_python_parser_on_every_field_form(tmp_path):
    """200 random files of 3 batches, a few odd fields each (leading zeros, `+5`, ` 5`,
    `1_0`, 20 digits, 17 hex digits, uppercase, `\\r\\n`, no final newline, a bad label):
    the arrow engine gives the batches, or the error, of the Python parser."""
    rng = np.random.default_rng(7)
    plan = make_plan(n_features=4)
    outcomes = {"same batches": 0, "same error": 0}
    for k in range(200):
        path = tmp_path / f"{k}.tsv"
        _criteo_file(path, rng, 3 * B, odd=float(rng.choice([0.0, 0.05, 0.3])))
        py = CriteoTSVReader(path, plan, engine="python", holdout=0)
        ar = CriteoTSVReader(path, plan, engine="arrow", holdout=0)
        for step in range(3):
            for rank, world in ((0, 1), (1, 2)):
                try:
                    want = py.batch(step, rank, world)
                except ReaderError as e:
                    with pytest.raises(ReaderError) as got:
                        ar.batch(step, rank, world)
                    assert str(got.value) == str(e)
                    outcomes["same error"] += 1
                    continue
                same(ar.batch(step, rank, world), want)
                outcomes["same batches"] += 1
    assert min(outcomes.values()) > 100, outcomes


def test_the_arrow_fast_path_takes_canonical_lines_and_hands_the_rest_back():
    line = "\t".join(["1", "-12", "007", *["3"] * 11, "", "00ff", "FFFFFFFFFFFFFFFF", *["a"] * 23])
    parsed = parse_block(((line + "\n") * 2).encode(), 2)
    assert parsed is not None
    labels, ints, hexv, missing = parsed
    assert labels.tolist() == [1.0, 1.0]
    assert ints[0, :3].tolist() == [-12, 7, 3]
    assert hexv[0, :3].tolist() == [0, 255, 2**64 - 1] and missing[0, :2].tolist() == [True, False]
    for odd in ("+5", " 5", "1_0", "-"):
        assert parse_block((line.replace("-12", odd) + "\n").encode(), 1) is None
    assert parse_block((line + "\r\n").encode(), 1) is None
    assert parse_block((line + "\n\n").encode(), 2) is None
    assert parse_block(b"1\t2\n", 1) is None


# --------------------------------------------------------------------------- prefetch


def test_the_prefetcher_gives_every_step_in_order_and_measures_the_wait():
    seen: list[int] = []

    def fetch(step: int) -> int:
        seen.append(step)
        time.sleep(0.01 if step == 7 else 0)
        return step * 10

    with Prefetcher(fetch, 3, 9, depth=2) as feed:
        time.sleep(0.05)  # the thread reads ahead, at most `depth` + 1 batches
        assert 3 <= len(seen) <= 4
        got = [feed.get(s) for s in range(3, 9)]
    assert [v for v, _ in got] == [30, 40, 50, 60, 70, 80]
    assert all(w >= 0 for _, w in got)
    with pytest.raises(ValueError, match="next step is 9"):
        feed.get(3)
    sync = Prefetcher(fetch, 0, 2, depth=0)
    assert sync._thread is None and sync.get(0)[0] == 0


def test_a_read_error_is_raised_at_its_step_and_the_thread_stops():
    def fetch(step: int) -> int:
        if step == 4:
            raise ReaderError(f"bad record in step {step}")
        return step

    feed = Prefetcher(fetch, 2, 100, depth=3)
    assert feed.get(2)[0] == 2 and feed.get(3)[0] == 3
    with pytest.raises(ReaderError, match="bad record in step 4"):
        feed.get(4)
    feed.close()
    assert not any(t.name == "embark-prefetch" for t in threading.enumerate())


def test_close_stops_a_thread_blocked_on_a_full_queue_and_one_mid_read():
    started = threading.Event()

    def slow(step: int) -> int:
        if step == 2:
            started.set()
            time.sleep(0.3)
        return step

    for depth in (1, 4):
        feed = Prefetcher(slow, 0, 10**9, depth=depth)
        started.wait(5)
        t0 = time.perf_counter()
        feed.close()
        assert time.perf_counter() - t0 < 2
        assert not any(t.name == "embark-prefetch" for t in threading.enumerate())
