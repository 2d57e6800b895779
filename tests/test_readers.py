"""Dataset readers: Criteo TSV and HugeCTR raw, round trips through the writers, rank
slicing, held-out batches, and errors that name the file, line and byte offset."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from embark_runtime.plan import Plan, validate_rules
from embark_runtime.readers import (
    CriteoTSVReader,
    HugeCTRRawReader,
    RawLayout,
    ReaderError,
    open_dataset,
    write_criteo_tsv,
    write_hugectr_raw,
)
from embark_runtime.synthetic import Batch, SyntheticData

B = 8  # global batch


def make_plan(hotness: dict[str, float] | None = None, n_features: int = 4) -> Plan:
    hot = hotness or {}
    tables = [("ta", 1000), ("tb", 7), ("tc", 50)]
    feats = [
        {
            "name": f"f{i}",
            "table": ["ta", "tb", "ta", "tc"][i % 4],
            "hotness": hot.get(f"f{i}", 1),
            "weighted": i % 4 == 3,
            "access": {"kind": "uniform"},
        }
        for i in range(n_features)
    ]
    plan = Plan.model_validate(
        {
            "source": {"spec": "t.embark", "sha256": "0" * 64},
            "topology": {
                "nodes": 1,
                "gpus_per_node": 4,
                "hbm_bytes": 1 << 40,
                "hbm_bandwidth": 1e12,
                "intra_node_bandwidth": 1e11,
                "inter_node_bandwidth": 1e10,
            },
            "batch_size": B,
            "tables": [{"name": n, "rows": r, "dim": 4} for n, r in tables],
            "features": feats,
            "clusters": [{"name": "d", "kind": "dp", "tables": [n for n, _ in tables]}],
            "shards": [],
            "estimate": {"step_time": 0.0, "per_rank": []},
            "planner": {"strategy": "t", "solver": "none", "status": "greedy"},
        }
    )
    validate_rules(plan)
    return plan


PLAN = make_plan()
PLAN_MULTI = make_plan({"f0": 3, "f3": 2})


def synthetic(plan: Plan, steps: int, seed: int = 1) -> list[Batch]:
    data = SyntheticData(plan, seed=seed)
    return [data.global_batch(s) for s in range(steps)]


def criteo_dense(d: np.ndarray) -> np.ndarray:
    """What the Criteo reader returns for dense values written by write_criteo_tsv."""
    ints = np.rint(np.expm1(np.maximum(d.astype(np.float64), 0)))
    return np.log1p(ints).astype(np.float32)


def assert_slice(got: Batch, want: Batch, lo: int, hi: int, dense=None) -> None:
    np.testing.assert_array_equal(got.labels, want.labels[lo:hi])
    np.testing.assert_array_equal(got.dense, (dense if dense is not None else want.dense)[lo:hi])
    assert sorted(got.sparse) == sorted(want.sparse)
    for name, bag in want.sparse.items():
        a, b = bag.offsets[lo], bag.offsets[hi]
        np.testing.assert_array_equal(got.sparse[name].ids, bag.ids[a:b])
        np.testing.assert_array_equal(got.sparse[name].offsets, bag.offsets[lo : hi + 1] - a)
        assert got.sparse[name].ids.dtype == np.int64
        if bag.weights is None:
            assert got.sparse[name].weights is None
        else:
            np.testing.assert_array_equal(got.sparse[name].weights, np.ones(b - a, np.float32))


# --------------------------------------------------------------------------- Criteo


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_criteo_roundtrip_every_rank_of_every_world(tmp_path, suffix):
    batches = synthetic(PLAN, 5)
    path = tmp_path / f"day{suffix}"
    assert write_criteo_tsv(path, batches, PLAN) == 5 * B
    reader = CriteoTSVReader(path, PLAN, holdout=0)
    assert reader.num_batches == reader.train_batches == 5
    for world in (1, 2, 4):
        b = B // world
        for step in (0, 3, 4, 1):  # out of order: the reader seeks (and rewinds a gzip)
            for rank in range(world):
                got = reader.batch(step, rank, world)
                want = batches[step]
                assert_slice(got, want, rank * b, (rank + 1) * b, criteo_dense(want.dense))


def test_criteo_files_directory_and_partial_last_batch(tmp_path):
    batches = synthetic(PLAN, 3)
    whole = tmp_path / "whole.tsv"
    write_criteo_tsv(whole, batches, PLAN)
    lines = whole.read_bytes().splitlines(keepends=True)
    d = tmp_path / "days"
    d.mkdir()
    # split inside a batch, the first file without a final newline, plus 3 stray samples
    (d / "a.tsv").write_bytes(b"".join(lines[:11]).rstrip(b"\n"))
    (d / "b.tsv").write_bytes(b"".join(lines[11:]) + b"".join(lines[:3]))
    reader = open_dataset(d, PLAN, holdout=0)
    assert isinstance(reader, CriteoTSVReader) and reader.num_batches == 3
    for step in range(3):
        for rank in range(2):
            lo, hi = rank * 4, rank * 4 + 4
            assert_slice(
                reader.batch(step, rank, 2),
                batches[step],
                lo,
                hi,
                criteo_dense(batches[step].dense),
            )


def test_criteo_steps_wrap_and_last_batches_are_held_out(tmp_path):
    batches = synthetic(PLAN, 21)
    path = tmp_path / "d.tsv"
    write_criteo_tsv(path, batches, PLAN)
    reader = CriteoTSVReader(path, PLAN)
    assert (reader.train_batches, reader.eval_batches) == (20, 1)
    for step in (0, 19, 20, 41):
        assert_slice(
            reader.batch(step, 1, 2),
            batches[step % 20],
            4,
            8,
            criteo_dense(batches[step % 20].dense),
        )
    for index in (0, 1, 5):
        assert_slice(
            reader.eval_batch(index, 0, 4), batches[20], 0, 2, criteo_dense(batches[20].dense)
        )
    assert [len(b.labels) for b in reader.batches(0, 2, start=18)] == [4, 4]


def test_criteo_missing_values_negative_integers_and_hex_hashing(tmp_path):
    rows = {"ta": 1000, "tb": 7, "tc": 50}
    fields = (
        ["1", "5", "", "-3", "0"]
        + ["2"] * 9
        + ["68fd1e64", "", "FFFFFFFFFFFFFFFF", "0"]
        + [""] * 22
    )
    line = "\t".join(fields) + "\n"
    path = tmp_path / "h.tsv"
    path.write_text(line * B)
    got = CriteoTSVReader(path, PLAN, holdout=0).batch(0, 0, 1)
    np.testing.assert_array_equal(got.labels, np.ones(B, np.float32))
    want_dense = np.log1p(np.array([5, 0, 0, 0] + [2] * 9, dtype=np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got.dense, np.tile(want_dense, (B, 1)))
    assert got.sparse["f0"].ids[0] == 1 + 0x68FD1E64 % (rows["ta"] - 1)
    assert got.sparse["f1"].ids[0] == 0  # missing -> the reserved key
    assert got.sparse["f2"].ids[0] == 1 + 0xFFFFFFFFFFFFFFFF % (rows["ta"] - 1)
    assert got.sparse["f3"].ids[0] == 1  # hex 0 -> key 1
    np.testing.assert_array_equal(got.sparse["f1"].offsets, np.arange(B + 1))


def _good_line() -> str:
    return "\t".join(["0"] + ["1"] * 13 + ["a1"] * 26) + "\n"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            "\t".join(["0"] + ["1"] * 13 + ["a1"] * 25) + "\n",
            "39 tab-separated columns, expected 40",
        ),
        (
            "\t".join(["0", "1", "2.5"] + ["1"] * 11 + ["a1"] * 26) + "\n",
            "integer feature 2 is '2.5'",
        ),
        (
            "\t".join(["0"] + ["1"] * 13 + ["a1", "zz"] + ["a1"] * 24) + "\n",
            "categorical feature 2 is 'zz'",
        ),
        (
            "\t".join(["0"] + ["1"] * 13 + ["a" * 17] + ["a1"] * 25) + "\n",
            "categorical feature 1 is",
        ),
        ("\t".join(["2"] + ["1"] * 13 + ["a1"] * 26) + "\n", "label '2' is not 0 or 1"),
        ("\n", "1 tab-separated columns"),
    ],
)
def test_criteo_malformed_record_names_file_line_and_offset(tmp_path, bad, message):
    good = _good_line()
    path = tmp_path / "bad.tsv"
    path.write_text(good * 6 + bad + good * 9)
    reader = CriteoTSVReader(path, PLAN, holdout=0)
    reader.batch(1, 0, 1)  # the second batch is fine
    offset = 6 * len(good.encode())
    with pytest.raises(ReaderError) as e:
        reader.batch(0, 1, 2)  # samples 4..7 include line 7
    assert str(e.value).startswith(f"{path}:7: byte {offset}: error: ")
    assert message in str(e.value)


def test_a_damaged_gzip_file_is_named_not_a_traceback(tmp_path):
    """A truncated .gz ends its stream early, flipped bytes corrupt it: either is a
    ReaderError naming the file, at the index (start-up) or, for a file damaged after it,
    when a batch is read."""
    whole = gzip.compress((_good_line() * 64).encode(), mtime=0)
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ReaderError, match=r"cut.tsv.gz: error: cannot read: the compressed "):
        open_dataset(cut, PLAN)
    flipped = bytearray(whole)
    for k in range(40, 60):
        flipped[k] ^= 0xFF
    bad = tmp_path / "flipped.tsv.gz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ReaderError, match=r"flipped.tsv.gz: error: cannot read: "):
        CriteoTSVReader(bad, PLAN)
    later = tmp_path / "later.tsv.gz"
    later.write_bytes(whole)
    reader = CriteoTSVReader(later, PLAN, holdout=0)
    later.write_bytes(whole[:40])  # replaced by a truncated copy after the index
    with pytest.raises(ReaderError, match=r"later.tsv.gz: error: cannot read: "):
        reader.batch(5, 0, 1)


def test_criteo_refuses_plans_it_cannot_feed(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text(_good_line() * B)
    with pytest.raises(ReaderError, match="27 features, Criteo data has 26"):
        CriteoTSVReader(path, make_plan(n_features=27))
    with pytest.raises(ReaderError, match="13 integer features, the model expects 4"):
        CriteoTSVReader(path, PLAN, dense_features=4)
    short = tmp_path / "short.tsv"
    short.write_text(_good_line() * (B - 1))
    with pytest.raises(ReaderError, match="short.tsv: error: fewer samples than one global batch"):
        CriteoTSVReader(short, PLAN).batch(0, 0, 1)
    with pytest.raises(ReaderError, match="no such file"):
        open_dataset(tmp_path / "nope.tsv", PLAN)


# --------------------------------------------------------------------------- HugeCTR raw


@pytest.mark.parametrize("dense_dtype", ["float32", "int32"])
def test_raw_roundtrip_multi_hot_every_rank(tmp_path, dense_dtype):
    batches = synthetic(PLAN_MULTI, 4)
    layout = RawLayout(dense_dtype=dense_dtype)
    path = tmp_path / "train.bin"
    assert write_hugectr_raw(path, batches, PLAN_MULTI, layout=layout) == 4 * B
    reader = HugeCTRRawReader(path, PLAN_MULTI, layout=layout, holdout=1)
    assert (reader.num_samples, reader.train_batches, reader.eval_batches) == (4 * B, 3, 1)
    for world in (1, 2, 4):
        b = B // world
        for step in range(3):
            for rank in range(world):
                want = batches[step]
                dense = want.dense if dense_dtype == "float32" else criteo_dense(want.dense)
                assert_slice(reader.batch(step, rank, world), want, rank * b, (rank + 1) * b, dense)
    held = batches[3]
    dense = held.dense if dense_dtype == "float32" else criteo_dense(held.dense)
    assert_slice(reader.eval_batch(7, 1, 2), held, 4, 8, dense)


def test_raw_record_layout_is_hugectrs(tmp_path):
    """int32 label, dense_dim float32, then every slot's keys as 32-bit ints, no header."""
    plan = make_plan({"f0": 2}, n_features=2)
    dense = np.arange(13, dtype=np.float32) / 4
    rec = struct.pack("<i13f3I", 1, *dense, 5, 999, 6)
    path = tmp_path / "one"
    path.write_bytes(rec * B)
    reader = open_dataset(path, plan)  # no suffix: sniffed as binary
    assert isinstance(reader, HugeCTRRawReader)
    got = reader.batch(0, 0, 1)
    np.testing.assert_array_equal(got.labels, np.ones(B, np.float32))
    np.testing.assert_array_equal(got.dense[3], dense)
    np.testing.assert_array_equal(got.sparse["f0"].ids[:4], [5, 999, 5, 999])
    np.testing.assert_array_equal(got.sparse["f1"].ids, np.full(B, 6))
    np.testing.assert_array_equal(got.sparse["f0"].offsets, np.arange(0, 2 * B + 1, 2))


def test_raw_truncated_file_names_offset_of_partial_record(tmp_path):
    batches = synthetic(PLAN_MULTI, 2)
    path = tmp_path / "t.bin"
    write_hugectr_raw(path, batches, PLAN_MULTI)
    size = 4 + 13 * 4 + (3 + 1 + 1 + 2) * 4
    path.write_bytes(path.read_bytes()[: 13 * size + 10])
    with pytest.raises(ReaderError) as e:
        HugeCTRRawReader(path, PLAN_MULTI)
    assert str(e.value).startswith(f"{path}: byte {13 * size}: error: truncated record")


def test_raw_key_outside_table_and_wrong_layout_name_the_record(tmp_path):
    plan = make_plan(n_features=2)
    good = struct.pack("<i13f2I", 0, *([0.5] * 13), 3, 2)
    bad = struct.pack("<i13f2I", 1, *([0.5] * 13), 3, 7)  # table tb has 7 rows
    path = tmp_path / "k.bin"
    path.write_bytes(good * 5 + bad + good * 2)
    with pytest.raises(ReaderError) as e:
        HugeCTRRawReader(path, plan).batch(0, 0, 1)
    assert str(e.value).startswith(f"{path}: byte {5 * len(good)}: error: slot 1 (feature `f1`)")
    assert "key 7 outside table `tb` of 7 rows" in str(e.value)
    wrapped = HugeCTRRawReader(path, plan, wrap_keys=True).batch(0, 0, 1)
    assert wrapped.sparse["f1"].ids[5] == 0
    # float labels read with the int32 layout: 1.0f is 1065353216 as an int
    path.write_bytes(struct.pack("<f13f2I", 1.0, *([0.5] * 13), 3, 2) * B)
    with pytest.raises(ReaderError, match="byte 0: error: label 1065353216 is not 0 or 1"):
        HugeCTRRawReader(path, plan).batch(0, 0, 1)
    got = HugeCTRRawReader(path, plan, layout=RawLayout(label_dtype="float32")).batch(0, 0, 1)
    np.testing.assert_array_equal(got.labels, np.ones(B, np.float32))


def test_raw_needs_fixed_integer_hotness(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"")
    with pytest.raises(ReaderError, match="fixed number of keys per slot") as e:
        HugeCTRRawReader(path, make_plan({"f0": 2.5}))
    # the file named once, and the way out: Criteo TSV takes any bag length
    assert str(e.value).startswith(f"{path} (read as HugeCTR raw data): error: feature `f0`")
    assert "--data-format criteo" in str(e.value)


def test_open_dataset_sniffs_the_format(tmp_path):
    batches = synthetic(PLAN, 2)
    write_criteo_tsv(tmp_path / "a.gz", batches, PLAN)
    write_criteo_tsv(tmp_path / "day_0", batches, PLAN)
    write_hugectr_raw(tmp_path / "r.bin", batches, PLAN)
    assert isinstance(open_dataset(tmp_path / "a.gz", PLAN), CriteoTSVReader)
    assert isinstance(open_dataset(tmp_path / "day_0", PLAN), CriteoTSVReader)
    assert isinstance(open_dataset(tmp_path / "r.bin", PLAN), HugeCTRRawReader)
    assert isinstance(open_dataset(tmp_path / "r.bin", PLAN, fmt="hugectr"), HugeCTRRawReader)
    with gzip.open(tmp_path / "a.gz") as f:
        assert f.read(2) in (b"0\t", b"1\t")
    assert Path(tmp_path / "a.gz").read_bytes()[:2] == b"\x1f\x8b"
