"""End to end on 4 gloo processes, one torchrun launch (tests/jobs_train.py): plan A
(tiny.embark with a dp, a ub and a hierarchical rb cluster pinned) trains, checkpoints
and writes a sharded export; plan B (tiny.embark column-wise: other cells, other row
shards, a column cut) starts from A's export and from A's checkpoint. Then:

* `embarkc export` joins A's export and A's checkpoint into the same tables, and they are
  bit for bit those of A's unsharded `--reference` run (exact numerics);
* B's tables at step 0 are A's exported tables;
* B trained 3 steps from A's checkpoint equals B's reference started from A's joined file;
* a file whose table has the wrong shape stops B before training with exit code 2;
* rank 0 prints the summary and writes it as the last --log-json record;
* a run that resumes takes its tables from the checkpoint and says --init-embeddings is
  ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"
PINS = (
    "  communication hierarchical\n  table country { cluster dp }\n  table item { cluster ub }\n"
    "  table history { cluster rb }\n  table tag { cluster rb }\n"
)

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBARK_FAULT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _tables(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from safetensors.numpy import load_file

    return dict(load_file(str(path)))


def _same(a: Path, b: Path) -> None:
    ta, tb = _tables(a), _tables(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].shape == tb[k].shape and np.array_equal(ta[k], tb[k]), (a, b, k)


def _reference(folder: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(folder / "train.py"), "--reference", "--quiet", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("export_train")
    spec = work / "pinned.embark"
    spec.write_text(TINY.read_text().replace("  seed 0\n", "  seed 0\n" + PINS))
    a, b = work / "a", work / "b"
    assert embarkc(["compile", str(spec), "-o", str(a), "-q"]) == 0
    assert embarkc(["compile", str(TINY), "-o", str(b), "-q", "--strategy", "column-wise"]) == 0
    bad = {"country": np.zeros((100, 16), np.float32)}  # the other tables missing
    np.savez(work / "bad.npz", **bad, item=np.zeros((20_000, 31), np.float32))
    w = str(work)
    jobs = [
        (a, "--steps 3 --eval-batches 1 --checkpoint-dir {w}/ckA --checkpoint-every 3 "
            "--export-embeddings {w}/ea --log-json {w}/a.jsonl"),
        (b, "--steps 0 --init-embeddings {w}/ea --export-embeddings {w}/b0.safetensors"),
        (b, "--steps 3 --eval-batches 1 --init-embeddings {w}/ckA --export-embeddings {w}/eb"),
        (b, "--steps 1 --init-embeddings {w}/bad.npz --export-embeddings {w}/never"),
        (b, "--steps 4 --eval-batches 0 --resume {w}/ckA --init-embeddings {w}/ea"),
    ]  # fmt: skip
    spec_jobs = [{"folder": str(f), "args": args.format(w=w).split()} for f, args in jobs]
    (work / "jobs.json").write_text(json.dumps(spec_jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests" / "jobs_train.py"), str(work / "jobs.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    codes = json.loads((work / "jobs.json.codes").read_text())
    return work, a, b, r, codes


def test_the_sharded_export_joins_to_the_reference_tables_bit_for_bit(runs):
    work, a, _, _, codes = runs
    assert codes[:3] == [0, 0, 0]
    assert sorted(p.name for p in (work / "ea").iterdir()) == [
        "manifest.json", "plan.json",
        *(f"rank-0000{r}.{x}" for r in range(4) for x in ("json", "safetensors")),
    ]  # fmt: skip
    assert embarkc(["export", str(work / "ea"), "-o", str(work / "a.safetensors")]) == 0
    assert embarkc(["export", str(work / "ckA"), "-o", str(work / "ck.npz")]) == 0
    _same(work / "a.safetensors", work / "ck.npz")
    _reference(
        a, "--steps", "3", "--eval-batches", "1", "--export-embeddings", str(work / "ar.npz")
    )
    _same(work / "a.safetensors", work / "ar.npz")


def test_another_plan_starts_from_the_export_and_trains_as_its_reference(runs):
    work, _, b, r, _ = runs
    assert embarkc(["export", str(work / "ea"), "-o", str(work / "a.npz")]) == 0
    # B's tables at step 0 are A's exported tables
    _same(work / "b0.safetensors", work / "a.npz")
    assert f"tables initialised from {work / 'ea'} (export)" in r.stdout
    assert f"tables initialised from {work / 'ckA'} (checkpoint)" in r.stdout
    # B sharded (from A's checkpoint) == B reference (from A's joined file), bit for bit
    _reference(
        b, *("--steps", "3", "--eval-batches", "1"),
        *("--init-embeddings", str(work / "a.npz"), "--export-embeddings", str(work / "br.npz")),
    )  # fmt: skip
    assert embarkc(["export", str(work / "eb"), "-o", str(work / "eb.npz")]) == 0
    _same(work / "eb.npz", work / "br.npz")


def test_a_mismatched_init_file_stops_before_training(runs):
    work, _, _, r, codes = runs
    assert codes[3] == 2
    assert "train.py: error: --init-embeddings " in r.stderr
    assert "bad.npz: no table `category`" in r.stderr
    assert not (work / "never").exists()
    assert "Traceback" not in r.stderr


def test_rank_0_summarises_the_run(runs):
    work, a, _, r, _ = runs
    records = [json.loads(x) for x in (work / "a.jsonl").read_text().splitlines()]
    steps = [x for x in records if "loss" in x and not x.get("eval") and not x.get("summary")]
    (evaluation,) = [x for x in records if x.get("eval")]
    summary = records[-1]
    assert summary["summary"] is True and summary["steps"] == 3
    assert summary["loss"] == steps[-1]["loss"] and summary["auc"] == evaluation["auc"]
    assert summary["train_s"] == pytest.approx(sum(x["step_s"] for x in steps))
    assert summary["samples_per_s"] == pytest.approx(3 * 256 / summary["train_s"])
    assert summary["wall_s"] >= summary["train_s"]
    plan = json.loads((a / "plan.json").read_text())
    assert summary["plan_step_s"] == plan["estimate"]["step_time"]
    assert summary["step_s_median"] == sorted(x["step_s"] for x in steps)[1]
    assert r.stdout.count("summary: 3 steps in ") == 2  # A and B's 3-step run
    assert "summary: no step trained" in r.stdout
    assert "step time: measured " in r.stdout and "the plan predicts " in r.stdout


def test_a_resumed_run_ignores_init_embeddings_and_says_so(runs):
    work, _, _, r, codes = runs
    assert codes[4] == 0
    assert f"--init-embeddings {work / 'ea'} ignored: resumed from {work / 'ckA'}" in r.stderr
    assert "summary: 1 step in " in r.stdout
