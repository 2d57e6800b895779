"""Checkpoints: round trips, resharding between plans, atomicity, corruption detection.

Ranks are simulated in one process: every rank's save_checkpoint is called in a loop with
cells cut from hand-made global tables, then rank 0 finalizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embark_runtime.checkpoint as ckpt
from embark_runtime.checkpoint import (
    STATE_LAYOUT,
    CellState,
    CheckpointError,
    assemble_tables,
    finalize_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    newest_complete,
    save_checkpoint,
)
from embark_runtime.keys import local_row, row_shard_of
from embark_runtime.plan import Plan, validate_rules

# name -> (rows, dim, optimizer, dtype)
TABLES = {
    "t0": (103, 8, "adagrad", "fp32"),
    "t1": (57, 6, "adam", "fp32"),
    "t2": (40, 4, "rowwise_adagrad", "fp32"),
    "t3": (31, 8, "adam", "fp32"),
    "t4": (10, 3, "sgd", "bf16"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_plan(
    world: int,
    partition: str,
    grids: dict[str, tuple[str, int, list[tuple[int, int]]] | str],
    tables: dict[str, tuple[int, int, str, str]] | None = None,
) -> Plan:
    """grids: table -> "dp" or (kind, R, column cuts); cells placed round-robin on ranks."""
    tables = tables or TABLES
    shards, clusters = [], []
    k = 0
    for name, g in grids.items():
        if g == "dp":
            clusters.append({"name": f"c{name}", "kind": "dp", "tables": [name]})
            continue
        kind, r, cols = g
        c = {"name": f"c{name}", "kind": kind, "tables": [name]}
        if kind == "rb":
            c["communication"] = "flat"
        clusters.append(c)
        for j in range(r):
            for lo, hi in cols:
                shards.append(
                    {
                        "table": name,
                        "row_shard": j,
                        "row_shards": r,
                        "columns": [lo, hi],
                        "rank": k % world,
                    }
                )
                k += 1
    plan = Plan.model_validate(
        {
            "source": {"spec": "test.embark", "sha256": "0" * 64},
            "topology": {
                "nodes": 1,
                "gpus_per_node": world,
                "hbm_bytes": 1 << 40,
                "hbm_bandwidth": 1e12,
                "intra_node_bandwidth": 1e11,
                "inter_node_bandwidth": 1e10,
            },
            "batch_size": 8 * world,
            "tables": [
                {"name": n, "rows": r, "dim": d, "optimizer": o, "dtype": dt}
                for n, (r, d, o, dt) in tables.items()
            ],
            "features": [
                {"name": f"f{n}", "table": n, "hotness": 1, "access": {"kind": "uniform"}}
                for n in tables
            ],
            "row_partition": partition,
            "clusters": clusters,
            "shards": shards,
            "estimate": {"step_time": 0.0, "per_rank": []},
            "planner": {"strategy": "test", "solver": "none", "status": "greedy"},
        }
    )
    validate_rules(plan)
    return plan


PLAN_A = make_plan(
    4,
    "mod",
    {
        "t0": ("rb", 2, [(0, 4), (4, 8)]),
        "t1": ("ub", 4, [(0, 6)]),
        "t2": "dp",
        "t3": ("rb", 1, [(0, 3), (3, 8)]),
        "t4": ("rb", 1, [(0, 3)]),
    },
)
PLAN_B = make_plan(
    2,
    "range",
    {
        "t0": ("ub", 3, [(0, 8)]),
        "t1": "dp",
        "t2": ("rb", 2, [(0, 4)]),
        "t3": ("rb", 2, [(0, 5), (5, 8)]),
        "t4": ("ub", 2, [(0, 1), (1, 3)]),
    },
)
PLAN_C = make_plan(
    8,
    "mod",
    {
        "t0": ("rb", 4, [(0, 3), (3, 8)]),
        "t1": ("rb", 1, [(0, 2), (2, 4), (4, 6)]),
        "t2": ("ub", 5, [(0, 4)]),
        "t3": "dp",
        "t4": ("rb", 3, [(0, 3)]),
    },
)


def global_tables(seed: int = 0, tables=None) -> dict[str, tuple[torch.Tensor, dict]]:
    """Random whole tables and optimizer state (adam step counts are distinct integers)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, dim, opt, dt) in (tables or TABLES).items():
        w = torch.randn(rows, dim, generator=g).to(DTYPES[dt])
        state = {}
        for key, kind in STATE_LAYOUT[opt].items():
            if key == "step":
                state[key] = torch.randint(0, 1000, (rows,), generator=g).to(torch.float32)
            elif kind == "element":
                state[key] = torch.rand(rows, dim, generator=g)
            else:
                state[key] = torch.rand(rows, generator=g)
        out[name] = (w, state)
    return out


def cut(plan: Plan, tables, name: str, j: int, r: int, cols: tuple[int, int]) -> CellState:
    """The cell (name, j of r, cols) of whole tables under plan's row partition."""
    w, state = tables[name]
    rows = w.shape[0]
    keys = np.arange(rows)
    if r == 1:
        g = keys
    else:
        g = keys[row_shard_of(keys, rows, r, plan.row_partition) == j]
        g = g[np.argsort(local_row(g, rows, r, plan.row_partition))]
    gi = torch.from_numpy(g)
    lo, hi = cols
    st_ = {k: (v[gi, lo:hi] if v.dim() == 2 else v[gi]).clone() for k, v in sorted(state.items())}
    return CellState(name, j, r, (lo, hi), w[gi, lo:hi].clone(), st_)


def expected_cells(plan: Plan, tables, rank: int) -> list[CellState]:
    out = []
    for t in plan.tables:
        if plan.cluster_of(t.name).kind == "dp":
            out.append(cut(plan, tables, t.name, 0, 1, (0, t.dim)))
        else:
            for s in plan.shards_of(t.name):
                if s.rank == rank:
                    out.append(cut(plan, tables, t.name, s.row_shard, s.row_shards, s.columns))
    return out


def save_all(root: Path, step: int, plan: Plan, tables, extra=None, **kw) -> Path:
    world = plan.world_size
    for rank in range(world):
        cells = expected_cells(plan, tables, rank)
        save_checkpoint(
            root, step, plan, rank, world, cells, extra if rank == 0 else None, finalize=False
        )
    return finalize_checkpoint(root, step, plan, world, **kw)


def assert_same_cells(got: list[CellState], want: list[CellState]) -> None:
    assert [(c.table, c.row_shard, c.row_shards, tuple(c.columns)) for c in got] == [
        (c.table, c.row_shard, c.row_shards, tuple(c.columns)) for c in want
    ]
    for g, w in zip(got, want, strict=True):
        assert g.weight.dtype == w.weight.dtype
        assert torch.equal(g.weight, w.weight), g.table
        assert sorted(g.state) == sorted(w.state)
        for k in w.state:
            assert torch.equal(g.state[k], w.state[k]), (g.table, k)


def assert_same_tables(got, want) -> None:
    assert sorted(got) == sorted(want)
    for name, (w, state) in want.items():
        assert torch.equal(got[name][0], w), name
        for k in state:
            assert torch.equal(got[name][1][k], state[k]), (name, k)


# --------------------------------------------------------------------------- round trips


def test_roundtrip_same_plan_every_rank(tmp_path):
    tables = global_tables()
    path = save_all(tmp_path, 7, PLAN_A, tables)
    assert path == tmp_path / "step-7"
    for rank in range(4):
        step, cells, extra = load_checkpoint(path, PLAN_A, rank)
        assert step == 7 and extra is None
        assert_same_cells(cells, expected_cells(PLAN_A, tables, rank))


@pytest.mark.parametrize("target", [PLAN_B, PLAN_C], ids=["B-range-2ranks", "C-mod-8ranks"])
def test_reshard_into_another_plan_is_bit_identical(tmp_path, target):
    tables = global_tables(1)
    save_all(tmp_path, 3, PLAN_A, tables)
    for rank in range(target.world_size):
        step, cells, _ = load_checkpoint(tmp_path, target, rank)
        assert step == 3
        assert_same_cells(cells, expected_cells(target, tables, rank))


def test_reshard_chain_a_to_b_to_c_to_a_keeps_every_table(tmp_path):
    tables = global_tables(2)
    prev = save_all(tmp_path / "a", 1, PLAN_A, tables)
    for dst, name in ((PLAN_B, "b"), (PLAN_C, "c"), (PLAN_A, "a2")):
        for rank in range(dst.world_size):
            _, cells, _ = load_checkpoint(prev, dst, rank)
            save_checkpoint(tmp_path / name, 1, dst, rank, dst.world_size, cells)
        prev = finalize_checkpoint(tmp_path / name, 1, dst, dst.world_size)
        assert_same_tables(assemble_tables(prev), tables)


def test_assemble_tables_returns_whole_tables(tmp_path):
    tables = global_tables(3)
    path = save_all(tmp_path, 2, PLAN_C, tables)
    got = assemble_tables(path)
    assert_same_tables(got, tables)
    assert got["t4"][0].dtype == torch.bfloat16


def test_column_split_adam_replicates_step_on_every_column_cell(tmp_path):
    tables = global_tables(4)
    save_all(tmp_path, 1, PLAN_A, tables)  # t1 adam: one column cell per row shard
    # PLAN_C splits t1 in three column cells: each gets the whole per-row step count
    cells = [
        c for r in range(8) for c in load_checkpoint(tmp_path, PLAN_C, r)[1] if c.table == "t1"
    ]
    assert len(cells) == 3
    for c in cells:
        assert torch.equal(c.state["step"], tables["t1"][1]["step"])


def test_chunked_reading_gives_the_same_cells(tmp_path, monkeypatch):
    tables = global_tables(5)
    save_all(tmp_path, 1, PLAN_A, tables)
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 40)  # a few rows per chunk
    for rank in range(2):
        assert_same_cells(
            load_checkpoint(tmp_path, PLAN_B, rank)[1], expected_cells(PLAN_B, tables, rank)
        )


def _grid_strategy(dim: int, kind_choices):
    @st.composite
    def grid(draw):
        kind = draw(st.sampled_from(kind_choices))
        if kind == "dp":
            return "dp"
        r = draw(st.integers(1, 5))
        cuts = sorted(draw(st.sets(st.integers(1, dim - 1), max_size=min(3, dim - 1))))
        bounds = [0, *cuts, dim]
        return (kind, r, list(zip(bounds[:-1], bounds[1:], strict=True)))

    return grid()


@st.composite
def random_plan(draw):
    world = draw(st.integers(1, 6))
    partition = draw(st.sampled_from(["mod", "range"]))
    grids = {n: draw(_grid_strategy(TABLES[n][1], ["dp", "rb", "ub"])) for n in TABLES}
    return make_plan(world, partition, grids)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(a=random_plan(), b=random_plan())
def test_property_any_plan_to_any_plan(tmp_path_factory, a, b):
    root = tmp_path_factory.mktemp("prop")
    tables = global_tables(6)
    save_all(root, 5, a, tables)
    for rank in range(b.world_size):
        assert_same_cells(load_checkpoint(root, b, rank)[1], expected_cells(b, tables, rank))


def test_extra_roundtrip_dense_model_optimizer_and_data_position(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    extra = {"dense": model.state_dict(), "dense_optimizer": opt.state_dict(), "data_step": 42}
    save_all(tmp_path, 9, PLAN_A, global_tables(), extra=extra)
    for rank in (0, 3):
        _, _, got = load_checkpoint(tmp_path, PLAN_A, rank)
        assert got["data_step"] == 42
        for k, v in model.state_dict().items():
            assert torch.equal(got["dense"][k], v)
        model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
        model2.load_state_dict(got["dense"])
        opt2.load_state_dict(got["dense_optimizer"])
        assert torch.equal(
            opt2.state[list(model2.parameters())[0]]["exp_avg"],
            opt.state[list(model.parameters())[0]]["exp_avg"],
        )


def test_dp_replicas_of_other_ranks_are_not_written(tmp_path):
    tables = global_tables()
    for rank in range(4):
        cells = expected_cells(PLAN_A, tables, rank)
        assert any(c.table == "t2" for c in cells)
        save_checkpoint(tmp_path, 1, PLAN_A, rank, 4, cells)
    path = finalize_checkpoint(tmp_path, 1, PLAN_A, 4)
    manifest = json.loads((path / "manifest.json").read_text())
    assert [c["rank"] for c in manifest["cells"] if c["table"] == "t2"] == [0]


def test_world_of_one_finalizes_itself(tmp_path):
    plan = make_plan(
        1, "mod", {"t0": ("rb", 2, [(0, 8)]), "t1": "dp", "t2": "dp", "t3": "dp", "t4": "dp"}
    )
    tables = global_tables()
    path = save_checkpoint(tmp_path, 4, plan, 0, 1, expected_cells(plan, tables, 0))
    assert path == tmp_path / "step-4" and latest_checkpoint(tmp_path) == path


def test_rank_reads_only_the_files_it_needs(tmp_path):
    tables = global_tables()
    path = save_all(tmp_path, 1, PLAN_A, tables)
    # rank 1 of the same plan needs its own file and rank 0's (the dp table), not rank 3's
    victim = path / "rank-00003.safetensors"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    assert_same_cells(load_checkpoint(path, PLAN_A, 1)[1], expected_cells(PLAN_A, tables, 1))
    with pytest.raises(CheckpointError, match="rank-00003.safetensors"):
        load_checkpoint(path, PLAN_A, 3)


# --------------------------------------------------------------------------- atomicity


def test_incomplete_save_leaves_previous_checkpoint_and_is_cleaned(tmp_path):
    tables = global_tables()
    first = save_all(tmp_path, 1, PLAN_A, tables)
    for rank in range(3):  # rank 3 "crashes" before writing
        save_checkpoint(tmp_path, 2, PLAN_A, rank, 4, expected_cells(PLAN_A, tables, rank))
    assert (tmp_path / ".tmp-step-2").is_dir()
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="rank 3 has not saved"):
        finalize_checkpoint(tmp_path, 2, PLAN_A, 4)
    assert latest_checkpoint(tmp_path) == first
    third = save_all(tmp_path, 3, PLAN_A, global_tables(9))
    assert not (tmp_path / ".tmp-step-2").exists()
    assert latest_checkpoint(tmp_path) == third
    assert_same_tables(assemble_tables(first), tables)


def test_crash_during_finalize_rename_keeps_previous(tmp_path, monkeypatch):
    tables = global_tables()
    first = save_all(tmp_path, 1, PLAN_A, tables)
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if Path(dst).name == "step-2":
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_publish)
    with pytest.raises(OSError, match="simulated"):
        save_all(tmp_path, 2, PLAN_A, global_tables(1))
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert latest_checkpoint(tmp_path) == first
    assert_same_tables(assemble_tables(tmp_path), tables)


def test_killed_writer_process_leaves_previous_checkpoint(tmp_path):
    tables = global_tables()
    first = save_all(tmp_path, 1, PLAN_A, tables)
    # a writer killed (SIGKILL) in the middle of writing its tensor file
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import embark_runtime.checkpoint as ckpt
        from test_checkpoint import PLAN_A, global_tables, expected_cells
        real = ckpt._tensor_bytes_chunks
        def dying(t):
            for mv in real(t):
                yield mv
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt._tensor_bytes_chunks = dying
        tables = global_tables(1)
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, PLAN_A, 0, 4, expected_cells(PLAN_A, tables, 0))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert list((tmp_path / ".tmp-step-2").glob("*.partial"))
    assert latest_checkpoint(tmp_path) == first
    assert_same_tables(assemble_tables(tmp_path), tables)
    save_all(tmp_path, 2, PLAN_A, global_tables(2))  # the next writer recovers
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert not list(tmp_path.glob(".tmp-step-*"))


def test_resaving_a_step_replaces_it(tmp_path):
    save_all(tmp_path, 1, PLAN_A, global_tables(0))
    new = global_tables(1)
    save_all(tmp_path, 1, PLAN_B, new)
    assert_same_tables(assemble_tables(tmp_path / "step-1"), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_keep_last_removes_older_checkpoints(tmp_path):
    tables = global_tables()
    for step in (1, 2, 3):
        save_all(tmp_path, step, PLAN_B, tables, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def test_keep_last_keeps_the_new_checkpoints_past_a_damaged_newer_one(tmp_path):
    """A resume from step-5 that passed over a damaged step-10 checkpoints after steps 6,
    7 and 8 with keep_last=1: each new one survives, the damaged one is left alone."""
    tables = global_tables()
    save_all(tmp_path, 5, PLAN_B, tables)
    damaged = save_all(tmp_path, 10, PLAN_B, tables)
    _truncate(damaged / "rank-00001.safetensors")
    assert newest_complete(tmp_path)[0] == tmp_path / "step-5"
    for step in (6, 7, 8):
        path = save_all(tmp_path, step, PLAN_B, global_tables(step), keep_last=1)
        assert _names(tmp_path) == ["step-10", f"step-{step}"]
        assert latest_checkpoint(tmp_path) == path
    assert_same_tables(assemble_tables(tmp_path), global_tables(8))
    assert len((damaged / "rank-00001.safetensors").read_bytes()) == 100


def test_keep_last_leaves_a_newer_checkpoint_of_another_run_alone(tmp_path):
    """An abandoned run's step-10 and a run resumed from step-5 writing step-6..8 with
    keep_last=1: the new ones survive, and so does step-10 (never counted)."""
    tables = global_tables()
    save_all(tmp_path, 5, PLAN_B, tables)
    save_all(tmp_path, 10, PLAN_B, global_tables(10))
    for step in (6, 7, 8):
        save_all(tmp_path, step, PLAN_B, global_tables(step), keep_last=1)
        assert _names(tmp_path) == ["step-10", f"step-{step}"]
    assert_same_tables(assemble_tables(tmp_path / "step-8"), global_tables(8))
    assert_same_tables(assemble_tables(tmp_path / "step-10"), global_tables(10))


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: _truncate(d / "rank-00000.safetensors"),
        lambda d: (d / "rank-00001.json").unlink(),
        lambda d: (d / "manifest.json").unlink(),
        lambda d: (d / "manifest.json").write_text("{not json"),
    ],
    ids=["truncated-file", "missing-file", "missing-manifest", "unreadable-manifest"],
)
def test_keep_last_counts_only_complete_older_checkpoints(tmp_path, damage):
    tables = global_tables()
    for step in (1, 2, 3):
        save_all(tmp_path, step, PLAN_B, tables)
    damage(tmp_path / "step-3")
    save_all(tmp_path, 4, PLAN_B, tables, keep_last=2)
    # step-4 and the newest complete older one (step-2); the damaged step-3 is not
    # counted and not removed
    assert _names(tmp_path) == ["step-2", "step-3", "step-4"]
    save_all(tmp_path, 5, PLAN_B, tables, keep_last=2)
    assert _names(tmp_path) == ["step-3", "step-4", "step-5"]


@pytest.mark.parametrize("keep_last", [0, 1])
def test_keep_last_never_removes_the_checkpoint_just_written(tmp_path, keep_last):
    """Re-saving step 2 below a step-3 keeps the new step-2 (and step-3, above it)."""
    for step in (1, 2, 3):
        save_all(tmp_path, step, PLAN_B, global_tables(step))
    path = save_all(tmp_path, 2, PLAN_B, global_tables(20), keep_last=keep_last)
    assert _names(tmp_path) == ["step-2", "step-3"]
    assert_same_tables(assemble_tables(path), global_tables(20))


def _crash_replacing(root: Path, step: int, tables, monkeypatch) -> None:
    """Re-save `step` over the existing `step-N` and crash between moving the old one
    aside (`.old-step-N`) and renaming the new one in."""
    real_replace = os.replace

    def crash_on_rename_in(src, dst):
        if Path(src).name == f".tmp-step-{step}" and Path(dst).name == f"step-{step}":
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_rename_in)
    with pytest.raises(OSError, match="simulated"):
        save_all(root, step, PLAN_B, tables)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert (root / f".old-step-{step}").is_dir() and not (root / f"step-{step}").exists()


def test_crash_between_replace_renames_is_resumed_from_the_moved_aside_step(tmp_path, monkeypatch):
    save_all(tmp_path, 1, PLAN_B, global_tables(1))
    save_all(tmp_path, 2, PLAN_B, global_tables(2))
    _crash_replacing(tmp_path, 2, global_tables(20), monkeypatch)
    assert _names(tmp_path) == [".old-step-2", ".tmp-step-2", "step-1"]
    moved = tmp_path / ".old-step-2"
    assert newest_complete(tmp_path) == (moved, [])
    assert latest_checkpoint(tmp_path) == moved
    for rank in range(2):
        step, cells, _ = load_checkpoint(tmp_path, PLAN_B, rank)
        assert step == 2
        assert_same_cells(cells, expected_cells(PLAN_B, global_tables(2), rank))
    assert_same_tables(assemble_tables(tmp_path), global_tables(2))


def test_crash_between_replace_renames_is_recovered_by_the_next_finalize(tmp_path, monkeypatch):
    save_all(tmp_path, 1, PLAN_B, global_tables(1))
    save_all(tmp_path, 2, PLAN_B, global_tables(2))
    _crash_replacing(tmp_path, 2, global_tables(20), monkeypatch)
    # a stale .old-step-1 beside its step-1 (a replace that got through) is removed
    (tmp_path / ".old-step-1").mkdir()
    # the recovered step-2 is counted by keep_last, so step-1 goes
    save_all(tmp_path, 3, PLAN_B, global_tables(3), keep_last=2)
    assert _names(tmp_path) == ["step-2", "step-3"]
    assert_same_tables(assemble_tables(tmp_path / "step-2"), global_tables(2))


# --------------------------------------------------------------------------- errors


def test_corrupt_file_is_detected_and_named(tmp_path):
    tables = global_tables()
    first = save_all(tmp_path, 1, PLAN_A, tables)
    second = save_all(tmp_path, 2, PLAN_A, global_tables(1))
    victim = second / "rank-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == first
    # what a resume passes over is named with why (the trainer warns with it)
    got, skipped = newest_complete(tmp_path)
    assert got == first and [p for p, _ in skipped] == [second]
    assert "rank-00001.safetensors: sha256 mismatch" in skipped[0][1]
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors: sha256 mismatch"):
        load_checkpoint(second, PLAN_A, 1)
    victim.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors: 100 bytes"):
        load_checkpoint(second, PLAN_A, 1)
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors: missing"):
        load_checkpoint(second, PLAN_A, 1)


def test_missing_directory_and_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope", PLAN_A, 0)
    path = save_all(tmp_path, 1, PLAN_A, global_tables())
    (path / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        load_checkpoint(path, PLAN_A, 0)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, PLAN_A, 0)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: unreadable"):
        load_checkpoint(path, PLAN_A, 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json and no step"):
        load_checkpoint(empty, PLAN_A, 0)


def _with_table(name, spec):
    tables = dict(TABLES)
    tables[name] = spec
    grids = {n: "dp" for n in tables}
    return make_plan(2, "mod", grids, tables)


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("t9", (5, 2, "sgd", "fp32"), "table `t9` is not in the checkpoint"),
        ("t0", (104, 8, "adagrad", "fp32"), r"`t0` is 103 x 8 in the checkpoint but 104 x 8"),
        ("t0", (103, 16, "adagrad", "fp32"), r"`t0` is 103 x 8 in the checkpoint but 103 x 16"),
        ("t4", (10, 3, "adam", "bf16"), r"`t4` was trained with `sgd` but the plan uses `adam`"),
    ],
)
def test_incompatible_plan_is_refused(tmp_path, name, spec, message):
    save_all(tmp_path, 1, PLAN_A, global_tables())
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path, _with_table(name, spec), 0)


def test_bad_cells_are_refused_at_save(tmp_path):
    tables = global_tables()
    cells = expected_cells(PLAN_A, tables, 0)
    t0 = next(c for c in cells if c.table == "t0")
    with pytest.raises(CheckpointError, match=r"weight has shape \(51, 4\), expected \(52, 4\)"):
        save_checkpoint(
            tmp_path, 1, PLAN_A, 0, 4, [CellState("t0", 0, 2, (0, 4), t0.weight[:51], t0.state)]
        )
    with pytest.raises(CheckpointError, match=r"keeps state \['sum'\], the cell has \[\]"):
        save_checkpoint(tmp_path, 1, PLAN_A, 0, 4, [CellState("t0", 0, 2, (0, 4), t0.weight, {})])
    with pytest.raises(CheckpointError, match="the plan has no such cell"):
        save_checkpoint(
            tmp_path, 1, PLAN_A, 0, 4, [CellState("t0", 0, 2, (0, 3), t0.weight[:, :3], {})]
        )
    with pytest.raises(CheckpointError, match="unknown table `zz`"):
        save_checkpoint(tmp_path, 1, PLAN_A, 0, 4, [CellState("zz", 0, 1, (0, 1), t0.weight, {})])


def test_finalize_refuses_missing_cells(tmp_path):
    tables = global_tables()
    for rank in range(4):
        cells = expected_cells(PLAN_A, tables, rank)
        if rank == 2:
            cells = cells[1:]
        save_checkpoint(tmp_path, 1, PLAN_A, rank, 4, cells)
    with pytest.raises(CheckpointError, match="no rank saved cell"):
        finalize_checkpoint(tmp_path, 1, PLAN_A, 4)
    assert latest_checkpoint(tmp_path) is None


def test_finalize_refuses_ranks_of_another_plan(tmp_path):
    tables = global_tables()
    for rank in range(2):
        save_checkpoint(tmp_path, 1, PLAN_B, rank, 2, expected_cells(PLAN_B, tables, rank))
    other = make_plan(2, "mod", {n: "dp" for n in TABLES})
    with pytest.raises(CheckpointError, match="another plan"):
        finalize_checkpoint(tmp_path, 1, other, 2)


def test_row_overlap_test_is_exact():
    """The file-skipping test agrees with brute force for every pair of row shards."""
    for rows in (1, 7, 31):
        for ra in range(1, 6):
            for rb in range(1, 6):
                for pa in ("mod", "range"):
                    for pb in ("mod", "range"):
                        keys = np.arange(rows)
                        sa = row_shard_of(keys, rows, ra, pa)
                        sb = row_shard_of(keys, rows, rb, pb)
                        for ja in range(ra):
                            for jb in range(rb):
                                want = bool(((sa == ja) & (sb == jb)).any())
                                got = ckpt._rows_overlap(rows, (ja, ra, pa), (jb, rb, pb))
                                assert got == want, (rows, ja, ra, pa, jb, rb, pb)


def test_empty_row_shard_of_a_range_partition_round_trips(tmp_path):
    tables_spec = {"z": (9, 4, "adam", "fp32")}
    a = make_plan(4, "range", {"z": ("rb", 4, [(0, 2), (2, 4)])}, tables_spec)
    assert a.row_count("z", 3, 4) == 0  # blocks of 3 rows: the last shard is empty
    b = make_plan(2, "mod", {"z": ("ub", 3, [(0, 4)])}, tables_spec)
    tables = global_tables(0, tables_spec)
    save_all(tmp_path, 1, a, tables)
    for plan in (a, b):
        for rank in range(plan.world_size):
            got = load_checkpoint(tmp_path, plan, rank)[1]
            assert_same_cells(got, expected_cells(plan, tables, rank))


def _shape_of_first_cell(m, shape):
    m["cells"][0]["weight"]["shape"] = shape


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(cells=5), r"damaged manifest: field `cells`: Input should be"),
        (lambda m: m.update(cells=["x"]), r"field `cells\.0`"),
        (lambda m: m["cells"][0].pop("table"), r"field `cells\.0\.table`: Field required"),
        (lambda m: m["cells"][0].update(columns="ab"), r"field `cells\.0\.columns`"),
        (lambda m: m["cells"][0].update(rank=True), r"field `cells\.0\.rank`"),
        (lambda m: m.update(step="one"), r"field `step`: Input should be a valid integer"),
        (lambda m: m.update(files=None), r"field `files`"),
        (lambda m: m.update(row_partition="hash"), r"field `row_partition`"),
        (lambda m: m["tables"]["t0"].update(dim="8"), r"field `tables\.t0\.dim`"),
        (lambda m: m["tables"]["t0"].update(optimizer="lion"), r"`t0` has optimizer `lion`"),
        (lambda m: m["cells"][0].update(columns=[4, 2]), r"lies outside the table's 8 columns"),
        (lambda m: m["cells"][0].update(row_shard=5), r"row shard 5 of 2"),
        (lambda m: _shape_of_first_cell(m, [51, 4]), r"`weight` tensor .* \[51, 4\], expected"),
        (lambda m: m["cells"][0]["state"].pop("sum"), r"lists no `sum` state tensor"),
    ],
)
def test_a_damaged_manifest_is_named_by_its_field_and_passed_over(tmp_path, mutate, message):
    """A manifest that is valid JSON but not of the manifest's shape (hand-edited, or
    damaged on disk) is a CheckpointError naming the field, not a crash in the loader;
    a resume from the root passes over it to the newest complete checkpoint."""
    first = save_all(tmp_path, 1, PLAN_A, global_tables())
    second = save_all(tmp_path, 2, PLAN_A, global_tables(1))
    manifest = second / "manifest.json"
    m = json.loads(manifest.read_text())
    assert m["cells"][0]["table"] == "t0" and m["cells"][0]["columns"] == [0, 4]
    mutate(m)
    manifest.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(second, PLAN_A, 0)
    assert latest_checkpoint(tmp_path) == first
