"""embarkc profile: ids per feature counted through the runtime's readers, histogram files
the language reads, measured hotness and a fitted zipf exponent; --write updates the spec
in place and keeps everything else of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embark_runtime.readers import write_criteo_tsv, write_hugectr_raw
from embark_runtime.synthetic import SyntheticData
from embarkc.cli import main
from embarkc.format import format_text
from embarkc.frontend import load_program
from embarkc.interop import profile as prof

SPEC = """\
hardware { nodes 1 gpus_per_node 2 hbm 64 MiB hbm_bandwidth 100 GB/s nvlink 50 GB/s network 10 Gb/s }

# the item table: hot, sorted ids
table item {
  rows 5000
  dim 16
  hotness 3
  access zipf(1.2, sorted)
}
table user { rows 2000 dim 8 hotness 1 }  # uniform
feature brand_a { table brand hotness 2 }
table brand { rows 300 dim 8 }
model { batch 512 dense_features 13 }
"""
BATCHES = 20


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("s.embark").write_text(SPEC)
    plan = prof.reader_plan(load_program("s.embark"))
    data = SyntheticData(plan, seed=0)
    batches = [data.global_batch(s) for s in range(BATCHES)]
    write_hugectr_raw("d.bin", batches, plan)
    return plan, batches


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_counts_match_the_data_and_histograms_are_the_language_format(dataset, capsys):
    plan, batches = dataset
    code, out, err = run(capsys, "profile", "d.bin", "--spec", "s.embark", "-o", "h")
    assert code == 0, err
    assert f"{BATCHES * 512:,} samples read" in out
    for f in plan.features:
        ids = np.concatenate([b.sparse[f.name].ids for b in batches])
        want_keys, want_counts = np.unique(ids, return_counts=True)
        lines = [
            ln for ln in Path(f"h/{f.name}.hist").read_text().splitlines() if not ln.startswith("#")
        ]
        got = np.array([[int(x) for x in ln.split()] for ln in lines])
        assert (got[:, 0] == want_keys).all() and (got[:, 1] == want_counts).all()
    assert Path("s.embark").read_text() == SPEC  # without --write the spec is untouched


def test_hotness_and_zipf_are_measured(dataset):
    profiles, read = prof.profile(["d.bin"], load_program("s.embark"))
    by = {p.name: p for p in profiles}
    assert read == BATCHES * 512
    assert (by["item"].mean_hotness, by["item"].max_hotness) == (3.0, 3)
    assert prof.hotness_field(by["brand_a"]) == "hotness 2"
    # drawn with zipf(1.2): the fit of the measured head is close; uniform ids are flat
    assert 1.0 < by["item"].alpha < 1.4
    assert by["user"].alpha < 0.5


def test_write_updates_access_and_hotness_and_keeps_the_rest(dataset, capsys):
    code, out, err = run(capsys, "profile", "d.bin", "--spec", "s.embark", "--write")
    assert code == 0, err
    text = Path("s.embark").read_text()
    assert format_text(text, "s.embark") == text
    assert "# the item table: hot, sorted ids" in text and "# uniform" in text
    assert 'access histogram "profile/item.hist"' in text
    assert "zipf(1.2, sorted)" not in text
    program = load_program("s.embark")
    item = program.feature_by_name["item"]
    assert item.access.kind == "histogram" and sum(item.access.counts) == BATCHES * 512 * 3
    assert program.feature_by_name["brand_a"].access.kind == "histogram"
    assert program.table_by_name["item"].rows == 5000  # the rest is as it was
    assert "updated s.embark" in out


def test_variable_bags_give_mean_and_max(tmp_path):
    p = prof.FeatureProfile("f", "t", 10, 4, 10, 5, 1, np.array([1]), np.array([10]), None)
    assert prof.hotness_field(p) == "hotness mean 2.5 max 5"


def test_samples_reads_evenly_spread_whole_batches(dataset):
    _, read = prof.profile(["d.bin"], load_program("s.embark"), samples=1500)
    assert read == 3 * 512


def test_counter_merges_in_bounded_chunks(monkeypatch):
    monkeypatch.setattr(prof, "MERGE_IDS", 7)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 50, size=int(rng.integers(1, 9))) for _ in range(40)]
    c = prof._Counter()
    for ids in chunks:
        c.add(ids)
        assert c.size < 7 + 9
    c.merge()
    keys, counts = np.unique(np.concatenate(chunks), return_counts=True)
    assert (c.keys == keys).all() and (c.counts == counts).all()


def test_criteo_tsv(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("c.embark").write_text(
        SPEC.replace("hotness 3", "hotness 1").replace("hotness 2", "hotness 1")
    )
    plan = prof.reader_plan(load_program("c.embark"))
    data = SyntheticData(plan, seed=1)
    write_criteo_tsv("d.tsv", (data.global_batch(s) for s in range(4)), plan)
    code, out, err = run(capsys, "profile", "d.tsv", "--spec", "c.embark")
    assert code == 0, err
    assert "2,048 samples read" in out
    assert Path("profile/user.hist").exists()


def test_tables_groups_are_reported_not_rewritten(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = SPEC.replace(
        "table user { rows 2000 dim 8 hotness 1 }",
        "tables user[0..0] { rows 2000 dim 8 hotness 1 }",
    )
    Path("s.embark").write_text(spec)
    plan = prof.reader_plan(load_program("s.embark"))
    data = SyntheticData(plan, seed=0)
    write_hugectr_raw("d.bin", (data.global_batch(s) for s in range(4)), plan)
    code, _, err = run(capsys, "profile", "d.bin", "--spec", "s.embark", "--write")
    assert code == 0, err
    assert "user0: not declared by a `table` or `feature` block" in err
    text = Path("s.embark").read_text()
    assert "tables user[0..0] { rows 2000 dim 8 hotness 1 }" in text
    assert 'access histogram "profile/item.hist"' in text


def test_bad_input_is_a_clear_error_and_leaves_the_spec(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("s.embark").write_text(SPEC)
    code, _, err = run(capsys, "profile", "missing.bin", "--spec", "s.embark", "--write")
    assert code == 2 and "missing.bin: error: no such dataset file" in err
    Path("d.bin").write_bytes(b"\x01\x02\x03")
    code, _, err = run(capsys, "profile", "d.bin", "--spec", "s.embark", "--write")
    assert code == 2 and "d.bin" in err and "Traceback" not in err
    code, _, err = run(capsys, "profile", "d.bin", "--spec", "s.embark", "--samples", "0")
    assert code == 2 and "--samples must be at least 1" in err
    assert Path("s.embark").read_text() == SPEC
