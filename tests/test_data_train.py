"""The generated trainer on the fast data path: tiny.embark on Parquet equals the run on
the same samples as synthetic data or Criteo TSV, bit for bit (exact numerics), with the
prefetch thread on; a run resumed from a checkpoint trains the tables of the uninterrupted
one; the log records each step's data wait; bad Parquet files and flags end with
`train.py: error: ...` and exit code 2; SIGTERM ends a prefetching run at once.

The one-process cases call the generated train.py's `main` in this process (`--reference`
or errors found before training); the 4-rank ones run it under torchrun."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import load_module
from test_trainer_failures import TINY, compile_text, criteo_lines, no_traceback, torchrun

from embark_runtime.parquet import write_parquet
from embark_runtime.plan import load_plan
from embark_runtime.readers import CriteoTSVReader
from embark_runtime.synthetic import SyntheticData

BATCH = 256
SEED = 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return compile_text(TINY.read_text(), tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def train(tiny):
    """main(argv) of tiny's train.py, in this process: (exit code, stderr)."""
    from embark_runtime.trainer import main

    mod = load_module(tiny / "train.py", "tiny_train_data")

    def run(capsys, *argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(mod.PROGRAM, ["--quiet", *argv])
        return code, capsys.readouterr().err

    return run


def tables(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_tables(a: Path, b: Path) -> None:
    x, y = tables(a), tables(b)
    assert x.keys() == y.keys()
    for k in x:
        assert np.array_equal(x[k], y[k]), k


def synthetic_parquet(tiny: Path, path: Path, batches: int) -> None:
    """tiny's synthetic data (seed SEED), multi-hot with varying bag lengths and weights,
    as a Parquet file of 100-row groups."""
    plan = load_plan(tiny / "plan.json")
    data = SyntheticData(plan, seed=SEED)
    write_parquet(path, [data.global_batch(s) for s in range(batches)], plan, row_group_size=100)


def test_four_ranks_on_parquet_equal_the_synthetic_run_and_resume_exactly(
    tiny, train, tmp_path, capsys
):
    """12 batches (11 trained, 1 held out) of tiny's synthetic samples as Parquet: the
    4-rank run with the prefetch thread trains the tables of the reference on the
    synthetic data, and so does a run resumed from its step-3 checkpoint."""
    data = tmp_path / "train.parquet"
    synthetic_parquet(tiny, data, 12)
    code, err = train(
        capsys,
        "--reference",
        "--steps",
        "6",
        "--seed",
        str(SEED),
        "--export-embeddings",
        str(tmp_path / "want.npz"),
    )
    assert code == 0, err
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "log.jsonl"
    args = ["--steps", "6", "--seed", str(SEED), "--data", str(data), "--prefetch", "3"]
    r = torchrun(
        tiny,
        *args,
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "3",
        "--log-json",
        str(log),
        "--export-embeddings",
        str(tmp_path / "full.npz"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_tables(tmp_path / "full.npz", tmp_path / "want.npz")
    steps = [
        x
        for x in map(json.loads, log.read_text().splitlines())
        if "loss" in x and "eval" not in x and not x.get("summary")
    ]
    assert [x["step"] for x in steps] == list(range(1, 7))  # steps completed, from 1
    assert all(x["data_wait_s"] >= 0 for x in steps)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (ckpt / "step-3").rename(resumed / "step-3")
    r = torchrun(
        tiny,
        *args,
        "--resume",
        str(resumed / "step-3"),
        "--export-embeddings",
        str(tmp_path / "resumed.npz"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    no_traceback(r)
    assert "terminate called" not in r.stderr
    assert_same_tables(tmp_path / "resumed.npz", tmp_path / "want.npz")


def test_parquet_converted_from_criteo_tsv_trains_the_same_tables(tiny, train, tmp_path, capsys):
    """The Criteo TSV file's batches written as Parquet (integer dense counts, one-hot
    int64 ids): the reference trains the same tables on both, with and without prefetch."""
    tsv = tmp_path / "day.tsv"
    tsv.write_text("\n".join(criteo_lines(BATCH * 5)) + "\n")
    plan = load_plan(tiny / "plan.json")
    reader = CriteoTSVReader(tsv, plan, holdout=0)
    parquet = tmp_path / "day.parquet"
    batches = [reader.batch(s, 0, 1) for s in range(5)]
    write_parquet(parquet, batches, plan, dense_integer=True, row_group_size=300)
    assert pq.read_schema(parquet).field("I1").type == pa.int64()
    for name, data, prefetch in (("tsv", tsv, "0"), ("parquet", parquet, "2")):
        code, err = train(
            capsys,
            "--reference",
            "--steps",
            "4",
            "--data",
            str(data),
            "--prefetch",
            prefetch,
            "--export-embeddings",
            str(tmp_path / f"{name}.npz"),
        )
        assert code == 0, err
    assert_same_tables(tmp_path / "tsv.npz", tmp_path / "parquet.npz")


def _parquet_without(tiny: Path, path: Path, column: str, replace: pa.Array | None = None) -> None:
    synthetic_parquet(tiny, path, 2)
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    t = t.remove_column(i) if replace is None else t.set_column(i, column, replace)
    pq.write_table(t, path)


def test_bad_parquet_and_data_flags_exit_2_with_a_message(tiny, train, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    _parquet_without(tiny, bad, "item")
    code, err = train(capsys, "--reference", "--steps", "1", "--data", str(bad))
    assert code == 2
    assert f"train.py: error: {bad}: error: no column `item` for feature `item`" in err
    assert "--column-map FEATURE=COLUMN" in err and "Traceback" not in err

    _parquet_without(tiny, bad, "category", pa.array([["x"]] * 2 * BATCH))
    code, err = train(capsys, "--reference", "--steps", "1", "--data", str(bad))
    assert code == 2
    assert f"{bad}: error: column `category` (feature `category`) is list<element: string>" in err

    good = tmp_path / "good.parquet"
    synthetic_parquet(tiny, good, 2)
    for argv, message in (
        (["--column-map", "item=x"], "--column-map needs --data"),
        (["--prefetch", "-1"], "--prefetch must not be negative"),
        (["--data", str(good), "--column-map", "item"], "--column-map item: cannot read it"),
        (
            ["--data", str(good), "--column-map", "nope=item"],
            "the column map names `nope`, which is no feature",
        ),
        (["--data", str(good), "--column-map", "item=it"], "no column `it` for feature `item`"),
        (["--data", str(good), "--data-format", "parquet", "--column-map", "item=item"], None),
    ):
        code, err = train(capsys, "--reference", "--steps", "1", *argv)
        if message is None:
            assert code == 0, err
        else:
            assert code == 2 and "train.py: error: " in err and message in err, err


def test_a_bad_record_read_ahead_stops_the_run_at_its_step(tiny, train, tmp_path, capsys):
    """The thread meets line 3 * BATCH + 6's label `7` while step 1 runs; the run stops
    with the Python parser's message when step 4 needs the batch, after 3 logged steps."""
    lines = criteo_lines(BATCH * 6)
    lines[3 * BATCH + 5] = "7" + lines[3 * BATCH + 5][1:]
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    log = tmp_path / "l.jsonl"
    code, err = train(
        capsys,
        "--reference",
        "--steps",
        "5",
        "--data",
        str(data),
        "--prefetch",
        "4",
        "--log-json",
        str(log),
    )
    assert code == 2
    assert f"train.py: error: {data}:{3 * BATCH + 6}: byte " in err
    assert "error: label '7' is not 0 or 1" in err
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3]


def test_sigterm_ends_a_prefetching_run_at_once(tiny, tmp_path):
    """A run whose reader thread is busy (a large TSV file, depth 8) ends within seconds of
    SIGTERM, without "terminate called without an active exception"."""
    data = tmp_path / "big.tsv"
    data.write_text("\n".join(criteo_lines(BATCH * 40)) + "\n")
    log = tmp_path / "l.jsonl"
    cmd = [sys.executable, str(tiny / "train.py"), "--reference", "--quiet", "--steps", "1000"]
    cmd += ["--data", str(data), "--prefetch", "8", "--log-json", str(log)]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM
    assert "terminate called" not in err and "Traceback" not in err


def test_a_spec_column_maps_a_feature_to_a_parquet_column_of_another_name(tiny, tmp_path, capsys):
    """`column "bb"` in a feature: the trainer reads that feature's ids (and weights) from
    column `bb`, training the tables of the run on the file with the feature's own name;
    --column-map still overrides the spec; a column the file lacks is an error naming it
    and the file's columns (exit 2). plan.json carries the column only where it is set."""
    from embark_runtime.trainer import main

    text = TINY.read_text().replace(
        "feature brand_bought {", 'feature brand_bought {\n  column "bb"', 1
    )
    assert 'column "bb"' in text
    mapped = compile_text(text, tmp_path, "mapped")
    plan = load_plan(mapped / "plan.json")
    assert [f.column for f in plan.features if f.column] == ["bb"]
    assert '"column"' not in (tiny / "plan.json").read_text()
    prog = load_module(mapped / "train.py", "mapped_train").PROGRAM
    base = load_module(tiny / "train.py", "tiny_train_columns").PROGRAM

    own = tmp_path / "own.parquet"
    synthetic_parquet(tiny, own, 3)
    t = pq.read_table(own)
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(
        t.rename_columns(["bb" if n == "brand_bought" else n for n in t.schema.names]), renamed
    )

    def run(program, data: Path, out: str, *extra: str) -> tuple[int, str]:
        capsys.readouterr()
        argv = ["--quiet", "--reference", "--steps", "2", "--data", str(data), *extra]
        code = main(program, [*argv, "--export-embeddings", str(tmp_path / out)])
        return code, capsys.readouterr().err

    code, err = run(base, own, "base.npz")
    assert code == 0, err
    code, err = run(prog, renamed, "mapped.npz")
    assert code == 0, err
    assert_same_tables(tmp_path / "base.npz", tmp_path / "mapped.npz")
    code, err = run(prog, own, "flag.npz", "--column-map", "brand_bought=brand_bought")
    assert code == 0, err
    assert_same_tables(tmp_path / "base.npz", tmp_path / "flag.npz")

    code, err = run(prog, own, "bad.npz")
    assert code == 2, err
    assert f"{own}: error: no column `bb` for feature `brand_bought`; besides the label" in err
    assert "brand_viewed" in err and "the spec's `column`" in err and "Traceback" not in err
