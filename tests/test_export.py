"""The sharded export, its reassembly and the warm start, on one process.

Plans of several grids (row shards x column cuts, dp, mod and range partitions) are
trained a few steps by the real ShardedEmbeddings, exported cell by cell, reassembled
into whole-table files (safetensors and npz) and loaded into other plans' cells: every
value must come back bit for bit, and the reader must never hold more than one chunk of
rows (counted per read call and by tracemalloc).
"""

from __future__ import annotations

import json
import struct
import sys
import tracemalloc
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from mp_harness import FeatureSpec, TableSpec, make_plan

from embark_runtime import export
from embark_runtime.checkpoint import save_checkpoint
from embark_runtime.embedding import ShardedEmbeddings
from embark_runtime.export import ExportError
from embark_runtime.summary import run_summary, summary_lines
from embark_runtime.synthetic import SyntheticData
from embarkc.cli import main as embarkc

FEATURES = [
    FeatureSpec("f0", "a", 2, "sum"),
    FeatureSpec("f1", "b", 2, "concat", 2),
    FeatureSpec("f2", "c", 2, "sum"),
    FeatureSpec("f3", "d", 3, "mean"),
]
ROWS = {"a": 3001, "b": 1000, "c": 257, "d": 50}


def plan_of(grids: dict[str, tuple[str, tuple[int, int]]], partition: str):
    opts = {"a": "adagrad", "b": "adam", "c": "rowwise_adagrad", "d": "sgd"}
    tables = [TableSpec(n, ROWS[n], 16, kind, grid, opts[n]) for n, (kind, grid) in grids.items()]
    return make_plan(tables, FEATURES, nodes=1, gpus_per_node=1, batch_size=8, partition=partition)


PLAN_A = plan_of(
    {"a": ("rb", (3, 2)), "b": ("ub", (2, 1)), "c": ("dp", (1, 1)), "d": ("rb", (1, 2))}, "mod"
)
PLAN_B = plan_of(
    {"a": ("ub", (2, 1)), "b": ("rb", (4, 2)), "c": ("rb", (3, 1)), "d": ("dp", (1, 1))}, "range"
)


def trained(plan, seed: int = 3, steps: int = 2) -> ShardedEmbeddings:
    emb = ShardedEmbeddings(plan, 0, 1, seed=seed)
    data = SyntheticData(plan, seed=5)
    for step in range(steps):
        out = emb(data.global_batch(step).sparse)
        g = torch.Generator().manual_seed(step)
        sum((out[k] * torch.randn(out[k].shape, generator=g)).sum() for k in sorted(out)).backward()
    return emb


def whole(emb, plan) -> dict[str, np.ndarray]:
    return {t.name: emb.gather_table(t.name).numpy() for t in plan.tables}


def export_of(emb, plan, folder: Path, step: int = 2) -> Path:
    export.check_export_folder(folder)
    export.prepare_export(folder)
    export.save_export_part(folder, step, plan, 0, 1, emb)
    return export.finalize_export(folder, step, plan, 1)


def load_tables(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


def assert_equal_tables(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, k
        assert np.array_equal(got[k], want[k]), k


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    emb = trained(PLAN_A)
    export_of(emb, PLAN_A, folder / "a")
    return folder / "a", whole(emb, PLAN_A), emb


def test_the_export_manifest_says_where_every_row_is(exported):
    folder, tables, _ = exported
    m = json.loads((folder / "manifest.json").read_text())
    assert (m["format"], m["version"], m["step"], m["world_size"]) == ("embark-export", 1, 2, 1)
    assert m["row_partition"] == "mod"
    assert m["features"] == {"f0": "a", "f1": "b", "f2": "c", "f3": "d"}
    assert m["tables"]["a"] == {
        "rows": 3001,
        "dim": 16,
        "dtype": "fp32",
        "kind": "rb",
        "row_shards": 3,
    }
    assert m["tables"]["c"]["kind"] == "dp"
    cells_a = sorted((c["row_shard"], tuple(c["columns"])) for c in m["cells"] if c["table"] == "a")
    assert cells_a == [(j, cols) for j in range(3) for cols in ((0, 8), (8, 16))]
    # no optimizer state in an export: weights only
    assert all(set(c) >= {"weight"} and "state" not in c for c in m["cells"])
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir())


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_reassembly_gives_the_trained_tables_bit_for_bit(exported, tmp_path, suffix):
    folder, tables, _ = exported
    out = tmp_path / f"t{suffix}"
    written = export.write_tables(export.open_source(folder), out)
    assert written == sum(v.nbytes for v in tables.values())
    assert_equal_tables(load_tables(out), tables)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary left


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_reassembly_reads_and_holds_at_most_one_chunk(exported, tmp_path, monkeypatch, suffix):
    """With 1 KiB chunks (16 rows of 16 fp32) the smallest cell (50 x 8, 1600 bytes) and
    each read in pieces of at most one chunk, and the process never holds more than a
    few chunks while writing 0.3 MiB of tables."""
    folder, tables, _ = exported
    chunk = 1024
    monkeypatch.setattr(export, "CHUNK_BYTES", chunk)
    reads: list[int] = []
    real = export.Tensor2D.read

    def counting(self, rows, lo, hi):
        out = real(self, rows, lo, hi)
        reads.append(out.nbytes)
        return out

    monkeypatch.setattr(export.Tensor2D, "read", counting)
    source = export.open_source(folder)
    smallest_cell = min(
        c.tensor.shape[0] * c.tensor.shape[1] * 4 for cs in source.cells.values() for c in cs
    )
    out = tmp_path / f"t{suffix}"
    tracemalloc.start()
    try:
        export.write_tables(source, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(v.nbytes for v in tables.values())
    assert sum(reads) == total  # every value read once
    assert max(reads) <= chunk < smallest_cell
    assert len(reads) > total // chunk
    assert peak < 6 * chunk + 64 * 1024, peak  # chunk, its pieces, row indices; not the tables
    assert_equal_tables(load_tables(out), tables)


def test_a_checkpoint_reassembles_to_the_same_tables(exported, tmp_path):
    _, tables, emb = exported
    save_checkpoint(tmp_path / "ck", 2, PLAN_A, 0, 1, emb.cells())
    for src in (tmp_path / "ck", tmp_path / "ck" / "step-2"):
        out = tmp_path / "c.safetensors"
        source = export.open_source(src)
        assert (source.kind, source.step) == ("checkpoint", 2)
        export.write_tables(source, out)
        assert_equal_tables(load_tables(out), tables)


@pytest.mark.parametrize("via", ["export", "safetensors", "npz", "checkpoint"])
def test_a_warm_start_under_another_plan_holds_the_exported_tables(exported, tmp_path, via):
    folder, tables, emb = exported
    if via == "export":
        src = folder
    elif via == "checkpoint":
        save_checkpoint(tmp_path / "ck", 2, PLAN_A, 0, 1, emb.cells())
        src = tmp_path / "ck"
    else:
        src = tmp_path / f"t.{via}"
        export.write_tables(export.open_source(folder), src)
    source = export.open_source(src)
    assert export.check_against_plan(source, PLAN_B) == []
    b = ShardedEmbeddings(PLAN_B, 0, 1, seed=99)  # other initial values
    before = {t.name: b.gather_state(t.name) for t in PLAN_B.tables}
    assert export.warm_start_sharded(b, source) == len(PLAN_B.shards) + 1  # + the dp table
    assert_equal_tables(whole(b, PLAN_B), tables)
    for t in PLAN_B.tables:  # the optimizer state starts fresh
        for k, v in b.gather_state(t.name).items():
            assert torch.equal(v, before[t.name][k]), (t.name, k)
    # the reference's whole tables
    weights = {t.name: torch.zeros(t.rows, t.dim) for t in PLAN_B.tables}
    export.warm_start_tables(weights, source)
    assert_equal_tables({k: v.numpy() for k, v in weights.items()}, tables)


def test_a_warm_started_plan_trains_as_the_original_continues(exported):
    """B started from A's export and A go on alike (sgd table d, whose update does not
    depend on the optimizer state the export leaves out)."""
    folder, _, _ = exported
    a = trained(PLAN_A, steps=2)
    b = ShardedEmbeddings(PLAN_B, 0, 1, seed=99)
    export.warm_start_sharded(b, export.open_source(folder))
    data = SyntheticData(PLAN_A, seed=5)
    for emb in (a, b):
        out = emb(data.global_batch(7).sparse)
        out["f3"].sum().backward()
    assert np.array_equal(a.gather_table("d").numpy(), b.gather_table("d").numpy())


def test_a_bf16_table_travels_exactly(tmp_path):
    plan = plan_of(
        {"a": ("rb", (2, 2)), "b": ("rb", (1, 1)), "c": ("dp", (1, 1)), "d": ("rb", (1, 1))}, "mod"
    )
    tables = [t.model_copy(update={"dtype": "bf16"}) if t.name == "a" else t for t in plan.tables]
    plan = plan.model_copy(update={"tables": tables})
    emb = trained(plan)
    export_of(emb, plan, tmp_path / "e")
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert {c["weight"]["dtype"] for c in m["cells"] if c["table"] == "a"} == {"BF16"}
    export.write_tables(export.open_source(tmp_path / "e"), tmp_path / "t.npz")
    assert_equal_tables(load_tables(tmp_path / "t.npz"), whole(emb, plan))
    b = ShardedEmbeddings(plan, 0, 1, seed=1)
    source = export.open_source(tmp_path / "t.npz")
    export.check_against_plan(source, plan)  # float32 of bf16 values loads exactly
    export.warm_start_sharded(b, source)
    assert_equal_tables(whole(b, plan), whole(emb, plan))


# --------------------------------------------------------------------------- mistakes


def _write_st(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    save_file(arrays, str(path))
    return path


def _tables_of(plan, dtype=np.float32) -> dict[str, np.ndarray]:
    return {t.name: np.zeros((t.rows, t.dim), dtype) for t in PLAN_B.tables}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("c"), "no table `c` of the plan (1 of 4 missing)"),
        (lambda t: t.update(cc=t.pop("c")), "it has tables the plan lacks (`cc`): renamed?"),
        (
            lambda t: t.update(a=np.zeros((3000, 16), np.float32)),
            "table `a` is 3000 x 16 there but 3001 x 16",
        ),
        (
            lambda t: t.update(b=np.zeros((1000, 8), np.float32)),
            "table `b` is 1000 x 8 there but 1000 x 16",
        ),
        (
            lambda t: t.update(a=np.zeros((3001, 16), np.float64)),
            "table `a` is stored as F64, the plan's table is fp32",
        ),
        (lambda t: t.update(d=np.zeros((50, 16), np.float16)), "table `d` is stored as F16"),
    ],
)
def test_mismatched_tables_are_named(tmp_path, edit, message):
    arrays = _tables_of(PLAN_B)
    edit(arrays)
    for path in (_write_st(tmp_path / "t.safetensors", arrays), tmp_path / "t.npz"):
        if path.suffix == ".npz":
            np.savez(path, **arrays)
        with pytest.raises(ExportError) as e:
            export.check_against_plan(export.open_source(path), PLAN_B)
        assert message in str(e.value) and str(path) in str(e.value)


def test_an_extra_table_is_a_warning(tmp_path):
    arrays = {**_tables_of(PLAN_B), "old": np.zeros((3, 4), np.float32)}
    warnings = export.check_against_plan(
        export.open_source(_write_st(tmp_path / "t.safetensors", arrays)), PLAN_B
    )
    assert warnings == [
        f"--init-embeddings {tmp_path / 't.safetensors'}: table `old` not in the plan: not loaded"
    ]


def test_unreadable_sources_are_named(exported, tmp_path):
    folder, _, _ = exported
    cases = []

    def check(path: Path, message: str) -> None:
        with pytest.raises(ExportError) as e:
            export.open_source(path)
        assert message in str(e.value), (path, str(e.value))

    (tmp_path / "x.txt").write_text("hi")
    cases.append((tmp_path / "x.txt", "not a table file"))
    (tmp_path / "bad.safetensors").write_bytes(b"\x05")
    cases.append((tmp_path / "bad.safetensors", "not a safetensors file (too short)"))
    np.savez(tmp_path / "one.npz", a=np.zeros(3, np.float32))
    cases.append((tmp_path / "one.npz", "array `a` is float32 [3]: a table is a 2-d float array"))
    _write_st(tmp_path / "int.safetensors", {"a": np.zeros((2, 2), np.int64)})
    cases.append((tmp_path / "int.safetensors", "tensor `a` is I64 [2, 2]"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "neither a sharded export, a checkpoint"))
    cases.append((tmp_path / "nothing", "no such file or folder"))
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    with open(cut / "rank-00000.safetensors", "r+b") as f:
        f.truncate(1000)
    cases.append((cut, "rank-00000.safetensors: 1000 bytes, the manifest says"))
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    m = json.loads((damaged / "manifest.json").read_text())
    first_a = next(i for i, c in enumerate(m["cells"]) if c["table"] == "a")
    m["cells"].pop(first_a)
    (damaged / "manifest.json").write_text(json.dumps(m))
    check(damaged, "do not tile its columns")
    m["cells"][0]["table"] = "zz"
    (damaged / "manifest.json").write_text(json.dumps(m))
    check(damaged, "a cell names the table `zz`, which the manifest does not list")
    del m["row_partition"]
    (damaged / "manifest.json").write_text(json.dumps(m))
    check(damaged, "damaged manifest (KeyError: 'row_partition')")
    for path, message in cases:
        check(path, message)


def test_verify_finds_a_flipped_byte_the_sizes_miss(exported, tmp_path, capsys):
    import shutil

    folder = tmp_path / "e"
    shutil.copytree(exported[0], folder)
    with open(folder / "rank-00000.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    export.open_source(folder)  # the sizes hold
    with pytest.raises(ExportError, match="rank-00000.safetensors: sha256 mismatch"):
        export.open_source(folder, verify=True)
    assert embarkc(["export", str(folder), "-o", str(tmp_path / "t.npz"), "--verify"]) == 2
    assert "sha256 mismatch (the file is corrupt)" in capsys.readouterr().err
    assert not (tmp_path / "t.npz").exists()


def test_an_export_never_replaces_a_folder_of_other_files(exported, tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="holding other files than an earlier export"):
        export.check_export_folder(tmp_path / "keep")
    export.check_export_folder(exported[0])  # an earlier export is replaced whole


def test_an_export_replaces_an_earlier_one_whole_or_not_at_all(exported, tmp_path):
    """A second export of the same folder replaces the first; one whose ranks did not all
    write is refused at publishing and leaves the first export as it was."""
    _, tables, emb = exported
    folder = export_of(emb, PLAN_A, tmp_path / "e", step=2)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    export.prepare_export(folder)
    export.save_export_part(folder, 5, PLAN_A, 0, 2, emb)  # rank 1 of 2 never writes
    with pytest.raises(ExportError, match="rank-00001.json: rank 1 has not written its part"):
        export.finalize_export(folder, 5, PLAN_A, 2)
    export.discard_unfinished_export(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]
    emb2 = trained(PLAN_A, steps=3)
    export_of(emb2, PLAN_A, folder, step=3)
    source = export.open_source(folder)
    assert source.step == 3
    export.write_tables(source, tmp_path / "t.npz")
    assert_equal_tables(load_tables(tmp_path / "t.npz"), whole(emb2, PLAN_A))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "t.npz"]


def test_a_full_disk_under_the_export_is_named(exported, tmp_path, monkeypatch):
    from embark_runtime import checkpoint

    _, _, emb = exported

    def full(t):
        raise OSError(28, "No space left on device")
        yield  # a generator, as the real one

    monkeypatch.setattr(checkpoint, "_tensor_bytes_chunks", full)
    folder = tmp_path / "e"
    export.prepare_export(folder)
    with pytest.raises(ExportError) as e:
        export.save_export_part(folder, 2, PLAN_A, 0, 1, emb)
    assert str(e.value) == f"--export-embeddings {folder}: cannot write: No space left on device"
    export.discard_unfinished_export(folder)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_older_file_whole(exported, tmp_path, monkeypatch):
    folder, _, _ = exported
    out = tmp_path / "t.safetensors"
    out.write_bytes(b"older")

    def broken(source, name):
        yield np.zeros((1, 16), np.float32)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "table_chunks", broken)
    with pytest.raises(ExportError, match="cannot write: No space left on device"):
        export.write_tables(export.open_source(folder), out)
    assert out.read_bytes() == b"older"
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


# --------------------------------------------------------------------------- the command


def test_the_export_command_joins_a_folder(exported, tmp_path, capsys):
    folder, tables, _ = exported
    assert embarkc(["export", str(folder), "-o", str(tmp_path / "t.npz")]) == 0
    assert f"wrote {tmp_path / 't.npz'}: 4 tables" in capsys.readouterr().out
    assert_equal_tables(load_tables(tmp_path / "t.npz"), tables)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-o", "{tmp}/t.txt"], "the output must end in .safetensors or .npz"),
        (["-o", "{tmp}"], "cannot write the export: it is a folder"),
        (["-o", "{src}/t.npz"], "-o lies inside the export it reads"),
    ],
)
def test_the_export_command_refuses_mistakes(exported, tmp_path, capsys, args, message):
    folder, _, _ = exported
    argv = [a.format(tmp=tmp_path, src=folder) for a in args]
    assert embarkc(["export", str(folder), *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_export_command_dispatches_plans_to_the_interop_module(tmp_path, capsys, monkeypatch):
    plan_file = tmp_path / "plan.json"
    from embark_runtime.plan import dumps_plan

    plan_file.write_text(dumps_plan(PLAN_A))
    assert embarkc(["export", str(plan_file), "-o", str(tmp_path / "x.npz")]) == 2
    assert "this is a plan, not tables" in capsys.readouterr().err
    seen = []

    def export_plan(plan, fmt):
        seen.append((plan["format"], fmt))
        return {"tables": len(plan["tables"])}, ["column cuts are approximated"]

    interop = types.ModuleType("embarkc.interop")
    module = types.ModuleType("embarkc.interop.plan_export")
    module.export_plan = export_plan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "embarkc.interop", interop)
    monkeypatch.setitem(sys.modules, "embarkc.interop.plan_export", module)
    out = tmp_path / "torchrec.json"
    assert embarkc(["export", str(tmp_path), "-o", str(out), "--format", "torchrec"]) == 0
    captured = capsys.readouterr()
    assert "embarkc: warning: column cuts are approximated" in captured.err
    assert json.loads(out.read_text()) == {"tables": 4} and seen == [("embark-plan", "torchrec")]


# --------------------------------------------------------------------------- summary


def test_the_summary_states_the_run_beside_the_plan():
    estimate = PLAN_A.estimate.model_copy(update={"step_time": 0.002})
    plan = PLAN_A.model_copy(update={"estimate": estimate})
    r = run_summary([0.2, 0.1, 0.3, 0.4], 2.0, 256, 0.5, {"auc": 0.75, "logloss": 0.45}, plan, 6)
    assert r["summary"] is True and r["steps"] == 4 and r["first_step"] == 6
    assert r["samples_per_s"] == pytest.approx(1024 / 1.0)
    assert r["step_s_median"] == pytest.approx(0.25) and r["step_s_mean"] == pytest.approx(0.25)
    assert r["plan_step_s"] == 0.002
    assert r["measured_over_plan"] == pytest.approx(125.0)
    first, second = summary_lines(r)
    assert first == (
        "summary: 4 steps in 1.000 s (wall 2.000 s), mean 1,024 samples/s; final loss 0.50000, "
        "AUC 0.7500, log loss 0.45000"
    )
    assert second == (
        "step time: measured 250.000 ms median, 250.000 ms mean (the whole iteration); the "
        "plan predicts 2.000 ms for the embedding step; measured / predicted 125.0x"
    )
    assert run_summary([0.1], 1.0, 8, 0.5, None, PLAN_A)["measured_over_plan"] is None
    assert summary_lines(run_summary([], 1.5, 8, None, None, PLAN_A)) == [
        "summary: no step trained (wall 1.500 s)"
    ]


def test_safetensors_headers_past_the_end_are_refused(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ExportError, match="beyond the file's end"):
        export.open_source(tmp_path / "x.safetensors")


# --------------------------------------------------------------------------- train.py options


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import load_module

    out = tmp_path_factory.mktemp("tiny")
    spec = Path(__file__).resolve().parent.parent / "specs" / "tiny.embark"
    assert embarkc(["compile", str(spec), "-o", str(out), "-q"]) == 0
    return load_module(out / "train.py", "embark_export_tiny").PROGRAM


def _train(program, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from embark_runtime.trainer import main

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    capsys.readouterr()
    code = main(program, list(args))
    return code, capsys.readouterr().err


def test_train_py_refuses_export_and_init_mistakes_before_training(
    tiny, exported, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    wrong = tmp_path / "wrong.safetensors"
    _write_st(wrong, {"country": np.zeros((100, 8), np.float32)})
    cases = [
        (["--export-embeddings", "tables.bin"], "the name must end in .safetensors or .npz"),
        (["--export-embeddings", "keep"], "keep: a folder holding other files than an earlier"),
        (["--reference", "--export-embeddings", "out"], "--reference writes one whole-table"),
        (["--init-embeddings", "nothing.npz"], "--init-embeddings nothing.npz: no such file"),
        (
            ["--reference", "--init-embeddings", str(wrong)],
            "no table `item`, `category`, `tag`, `history`, `brand` of the plan (5 of 6",
        ),
        (
            ["--reference", "--init-embeddings", str(exported[0])],
            "it has tables the plan lacks (`a`, `b`, `c`, `d`)",
        ),
    ]
    for args, message in cases:
        code, err = _train(tiny, monkeypatch, capsys, "--steps", "1", *args)
        assert code == 2 and message in err, (args, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "wrong.safetensors"]
    assert [p.name for p in (tmp_path / "keep").iterdir()] == ["notes.txt"]


def test_the_reference_starts_from_a_file_and_summarises(tiny, tmp_path, monkeypatch, capsys):
    """--reference --steps 0 --init-embeddings F --export-embeddings G gives G == F."""
    from embark_runtime.plan import load_plan

    plan = load_plan(tiny.plan_path)
    rng = np.random.default_rng(0)
    arrays = {t.name: rng.standard_normal((t.rows, t.dim)).astype(np.float32) for t in plan.tables}
    np.savez(tmp_path / "init.npz", **arrays)
    log = tmp_path / "log.jsonl"
    code, err = _train(
        tiny, monkeypatch, capsys, "--reference", "--steps", "0", "--log-json", str(log),
        "--init-embeddings", str(tmp_path / "init.npz"),
        "--export-embeddings", str(tmp_path / "out.safetensors"),
    )  # fmt: skip
    assert code == 0, err
    assert_equal_tables(load_tables(tmp_path / "out.safetensors"), arrays)
    (record,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert record["summary"] is True and record["steps"] == 0 and record["loss"] is None


def test_the_export_command_does_not_import_torch(exported, tmp_path):
    """Joining tables needs numpy only: the command starts fast."""
    import subprocess

    code = (
        "import sys; from embarkc.cli import main; "
        f"rc = main(['export', {str(exported[0])!r}, '-o', {str(tmp_path / 't.npz')!r}]); "
        "print(rc, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == "0 False", r.stdout + r.stderr
