"""`train.py --export-embeddings x.safetensors|x.npz` streams table by table.

The whole-table file of a sharded run is gathered one table at a time and written before
the next is gathered, so a rank holds the largest table, never the model. The file reads
as the one `safetensors.numpy.save_file` and `numpy.savez` wrote before, tensor for
tensor; a failed write still takes part in every rank's gathers (no hang) and leaves an
older file whole.
"""

from __future__ import annotations

import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from mp_harness import FeatureSpec, TableSpec, make_plan
from safetensors.numpy import load_file, save_file

from embark_runtime import export
from embark_runtime.embedding import ShardedEmbeddings
from embark_runtime.trainer import TrainerError, export_gathered, write_table_file

PLAN = make_plan(
    [
        TableSpec("a", 3001, 16, "rb", (3, 2), "adagrad"),
        TableSpec("b", 1000, 16, "ub", (2, 1), "adam"),
        TableSpec("c", 257, 16, "dp", (1, 1), "rowwise_adagrad"),
    ],
    [FeatureSpec("f0", "a", 2, "sum"), FeatureSpec("f1", "b", 2, "sum"), FeatureSpec("f2", "c", 2)],
    nodes=1,
    gpus_per_node=1,
    batch_size=8,
)
MIB = 1 << 20


def _tables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"small": (3, 5), "wide": (17, 64), "empty": (0, 8), "tall": (1000, 4)}
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


def _old_file(path: Path, tables: dict[str, np.ndarray]) -> None:
    """The whole-table file as the trainer wrote it before it streamed."""
    if path.suffix == ".safetensors":
        save_file(tables, str(path))
    else:
        np.savez(path, **tables)  # type: ignore[arg-type]


def _read(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        return dict(load_file(str(path)))
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_the_streamed_file_holds_the_old_files_tensors(tmp_path, suffix):
    tables = _tables()
    old, new = tmp_path / f"old{suffix}", tmp_path / f"new{suffix}"
    _old_file(old, tables)
    shapes = {k: v.shape for k, v in tables.items()}
    write_table_file(new, shapes, (torch.from_numpy(v) for v in tables.values()))
    before, after = _read(old), _read(new)
    assert list(after) == list(tables)  # the plan's order
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype == np.float32 and after[k].shape == v.shape, k
        assert np.array_equal(after[k], v), k
    # our own reader (the warm start's, `embarkc export`'s) reads it in place
    source = export.open_source(new)
    assert {k: (t.rows, t.dim) for k, t in source.tables.items()} == shapes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old.name, new.name])


def test_a_table_of_another_dtype_is_written_as_float32(tmp_path):
    path = tmp_path / "t.safetensors"
    t = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    write_table_file(path, {"t": (4, 3)}, iter([t]))
    back = load_file(str(path))["t"]
    assert back.dtype == np.float32 and np.array_equal(back, t.float().numpy())


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_peak_memory_is_the_largest_table_not_all_of_them(tmp_path, suffix):
    """tracemalloc sees numpy's allocations: tables made on demand (as a gather makes
    them) and written one at a time peak at the largest, not at their sum (10 MiB)."""
    sizes = {"t1": 1, "t4": 4, "t2": 2, "t3": 3}  # MiB
    dim = 64
    shapes = {k: (n * MIB // (dim * 4), dim) for k, n in sizes.items()}

    def made():
        for i, (rows, d) in enumerate(shapes.values()):
            yield torch.from_numpy(np.full((rows, d), i, np.float32))

    tracemalloc.start()
    try:
        write_table_file(tmp_path / f"t{suffix}", shapes, made())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB + 256 * 1024, peak
    back = _read(tmp_path / f"t{suffix}")
    assert [float(v[0, 0]) for v in back.values()] == [0.0, 1.0, 2.0, 3.0]


def test_a_sharded_run_holds_one_gathered_table_at_a_time(tmp_path):
    """export_gathered (the trainer's export of a whole-table file): before each gather
    every table gathered before it was released, and the file holds the tables."""
    emb = ShardedEmbeddings(PLAN, 0, 1, seed=3)
    want = {t.name: emb.gather_table(t.name).numpy().copy() for t in PLAN.tables}
    alive: list[weakref.ref] = []
    held_at_gather: list[int] = []

    def gather(name: str) -> torch.Tensor:
        held_at_gather.append(sum(r() is not None for r in alive))
        w = emb.gather_table(name)
        alive.append(weakref.ref(w))
        return w

    path = tmp_path / "t.npz"
    export_gathered(path, PLAN, gather, 0)
    assert held_at_gather == [0, 0, 0]
    got = _read(path)
    assert list(got) == ["a", "b", "c"]
    assert all(np.array_equal(got[k], v) for k, v in want.items())


def test_other_ranks_gather_every_table_and_write_nothing(tmp_path):
    called: list[str] = []

    def gather(name: str) -> torch.Tensor:
        called.append(name)
        return torch.zeros(PLAN.table(name).rows, PLAN.table(name).dim)

    export_gathered(tmp_path / "t.safetensors", PLAN, gather, 1)
    assert called == ["a", "b", "c"] and list(tmp_path.iterdir()) == []


def test_a_write_that_fails_mid_file_still_gathers_every_table(tmp_path, monkeypatch):
    """Rank 0's full disk at the second table: it takes part in the remaining gathers
    (the other ranks would hang in them otherwise), then says why; the older file and
    no temporary one are left."""
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"older")
    called: list[str] = []

    def gather(name: str) -> torch.Tensor:
        called.append(name)
        return torch.ones(PLAN.table(name).rows, PLAN.table(name).dim)

    real = export.TableFileWriter._write_rows

    def full(self, out, name, chunks):
        if name == "b":
            raise OSError(28, "No space left on device")
        return real(self, out, name, chunks)

    monkeypatch.setattr(export.TableFileWriter, "_write_rows", full)
    with pytest.raises(TrainerError, match="cannot write: No space left on device"):
        export_gathered(path, PLAN, gather, 0)
    assert called == ["a", "b", "c"]
    assert path.read_bytes() == b"older"
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_the_writer_refuses_tables_out_of_order_or_short(tmp_path):
    shapes = {"a": (2, 4), "b": (3, 4)}
    with pytest.raises(ValueError, match="out of order"):
        with export.TableFileWriter(tmp_path / "t.npz", shapes) as out:
            out.write("b", [np.zeros((3, 4), np.float32)])
    with pytest.raises(ValueError, match="1 rows written"):
        with export.TableFileWriter(tmp_path / "t.npz", shapes) as out:
            out.write("a", [np.zeros((1, 4), np.float32)])
    with pytest.raises(ValueError, match="not written"):
        with export.TableFileWriter(tmp_path / "t.npz", shapes) as out:
            out.write("a", [np.zeros((2, 4), np.float32)])
    assert list(tmp_path.iterdir()) == []
