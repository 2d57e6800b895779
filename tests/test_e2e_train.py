"""End to end: compile specs/tiny.embark, train it with torchrun on 4 CPU processes (gloo),
and check what the issue promises: the loss falls, the sharded run equals the unsharded
reference, another strategy trains the same model, a SIGKILLed rank is recovered from the
last checkpoint with the same final weights, and a checkpoint of one plan resumes under
another.

Exactness: on the CPU the trainer's default numerics are exact (fp64 sums, fp64 dense
model, gradients rounded to fp32 once: the summation order is out), so the README's
command trains bit for bit the tables of `train.py --reference`: tiny.embark itself, and
a copy that pins a dp table, a ub table and hierarchical rb, also under another strategy
and across a checkpoint of another plan. In fp32 (`--numerics fp32`, CUDA's default) the
runs sum the same numbers in different orders, so they agree to float32 rounding; under
adagrad/adam a rounding difference in a gradient that is nearly zero changes the sign of
a first update (adagrad's first step is lr * sign(g)) and fp32 runs drift apart within
tens of steps, so the fp32 check trains a copy of tiny.embark whose optimizers are all
SGD. Fault recovery replays exactly the same operations and is checked bit for bit.

Every torchrun launch costs process starts on a 2-core machine, so the runs are module
fixtures shared by the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embark_runtime.trainer import load_exported
from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"
STEPS = 50

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBARK_FAULT")}
    env.update({"OMP_NUM_THREADS": "1", **extra})
    return env


def torchrun(out: Path, *args: str, restarts: int = 0, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", str(restarts), str(out / "train.py"), "--quiet", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def reference(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(out / "train.py"), "--reference", "--quiet", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def compile_spec(spec: Path, out: Path, *args: str) -> Path:
    assert embarkc(["compile", str(spec), "-o", str(out), "-q", *args]) == 0
    return out


def _records(path: Path) -> list[dict]:
    """The step and evaluation records of a --log-json file (not the run's last record,
    its summary: tests/test_export_train.py checks that)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[-1].get("summary") is True
    return [r for r in records if not r.get("summary")]


def assert_same_tables(a: Path, b: Path, atol: float) -> None:
    ta, tb = load_exported(a), load_exported(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].shape == tb[name].shape, name
        diff = float(np.abs(ta[name] - tb[name]).max())
        assert diff <= atol, f"table {name}: max difference {diff} > {atol}"


# --------------------------------------------------------------------------- tiny.embark


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return compile_spec(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_run(tiny, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    work = tmp_path_factory.mktemp("tiny_run")
    r = torchrun(
        tiny,
        *("--steps", str(STEPS), "--log-json", str(work / "log.jsonl")),
        *("--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", "10"),
        *("--keep-checkpoints", "2", "--export-embeddings", str(work / "tables.safetensors")),
    )
    return work, r


def test_tiny_trains_on_4_cpu_processes_and_the_loss_falls(tiny, tiny_run):
    work, r = tiny_run
    assert "backend gloo, torch kernels in exact mode (fp64 sums)" in r.stdout
    records = _records(work / "log.jsonl")
    steps = [x for x in records if not x.get("eval")]
    assert [x["step"] for x in steps] == list(range(1, STEPS + 1))  # completed, from 1
    first = np.mean([x["loss"] for x in steps[:10]])
    last = np.mean([x["loss"] for x in steps[-10:]])
    assert last < first - 0.05, (first, last)
    assert all(x["samples_per_s"] > 0 for x in steps)
    # --keep-checkpoints 2: the newest two of the five remain
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == ["step-40", "step-50"]
    plan = json.loads((tiny / "plan.json").read_text())
    # bytes moved, per cluster of the plan and for the dense all-reduce
    assert set(steps[0]["bytes"]) == {c["name"] for c in plan["clusters"]} | {"dense"}
    assert steps[0]["bytes_total"] > 0
    (evaluation,) = [x for x in records if x.get("eval")]
    assert evaluation["auc"] > 0.6
    tables = load_exported(work / "tables.safetensors")
    assert {t["name"]: (t["rows"], t["dim"]) for t in plan["tables"]} == {
        k: v.shape for k, v in tables.items()
    }


def test_a_sigkilled_rank_restarts_from_the_last_checkpoint_with_the_same_result(
    tiny, tiny_run, tmp_path
):
    work, _ = tiny_run
    r = torchrun(
        tiny,
        *("--steps", str(STEPS), "--resume", "--checkpoint-dir", str(tmp_path / "ckpt")),
        *("--checkpoint-every", "10", "--eval-batches", "0"),
        *("--export-embeddings", str(tmp_path / "tables.npz")),
        restarts=1,
        EMBARK_FAULT_AT_STEP="25",
    )
    assert (tmp_path / "ckpt" / ".fault-injected").exists()
    assert re.search(r"resumed from .*step-20 at step 20", r.stdout), r.stdout
    # the restarted group replays steps 20..49 exactly: bit-identical weights
    assert_same_tables(work / "tables.safetensors", tmp_path / "tables.npz", atol=0.0)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        f"step-{n}" for n in (10, 20, 30, 40, 50)
    ]


# --------------------------------------------------------------------------- exactness

PINS = (
    "  communication hierarchical\n  table country { cluster dp }\n  table item { cluster ub }\n"
    "  table history { cluster rb }\n  table tag { cluster rb }\n"
)
"""Pin tables of each kind and hierarchical rb, so that an equality covers every cluster
path of the trainer (the cost model alone puts tiny in one flat rb cluster, and with
hierarchical rb forced it prefers ub for the unpinned tables)."""


def _pinned(text: str) -> str:
    assert text.count("  seed 0\n") == 1
    return text.replace("  seed 0\n", "  seed 0\n" + PINS)


SCHEDULES = (
    (
        "  optimizer adagrad { lr 0.05 }\n}\n\nplan",
        "  optimizer adam { lr 0.01 weight_decay 0.001 }\n"
        "  schedule { warmup 5 decay poly { to 40 power 2 } }\n}\n\nplan",
    ),
    (
        "  init uniform(-0.05, 0.05)\n}",
        "  init uniform(-0.05, 0.05)\n"
        "  schedule { warmup 4 decay step { every 10 factor 0.5 } }\n}",
    ),
    (
        "  hotness 30\n",
        "  hotness 30\n  schedule { decay poly { from 5 to 45 power 2 end 0.001 } }\n",
    ),
)
"""A warm-up then poly decay (MLPerf DLRM's) of an adam dense optimizer, a warm-up then
step decay of every table's rate, and a poly decay with an end rate of table item's: the
exactness runs cover the schedules and the adam dense optimizer, and resuming from a
checkpoint continues the schedules where the checkpoint left them."""


def _scheduled(text: str) -> str:
    for old, new in SCHEDULES:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _losses(path: Path) -> list[float]:
    return [x["loss"] for x in _records(path) if not x.get("eval")]


def test_an_error_every_rank_shares_after_the_ranks_started_is_told_once(tiny, tmp_path):
    """A dataset too small for one batch is found after the process group formed: every
    rank finds it, rank 0 alone says so (the others are quiet about an error they all
    share), and every rank exits 2 (torchrun then reports the failed children)."""
    data = tmp_path / "small.tsv"
    data.write_text("0\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(tiny / "train.py"), "--quiet", "--steps", "1", "--data", str(data)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400)
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if line.startswith("train.py: error:")]
    assert said == [
        f"train.py: error: every rank of 4: {data}: error: fewer samples than one global batch"
    ], r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr or "exit code 2" in r.stderr or "exitcode: 2" in r.stderr


def test_a_checkpoint_damaged_on_one_rank_stops_every_rank_at_once(tiny, tiny_run, tmp_path):
    """Only rank 2 reads the damaged file: it names the file, the other ranks stop at once
    naming rank 2 (rather than waiting in their first collective until the timeout), and
    the job exits 2."""
    work, _ = tiny_run
    ckpt = tmp_path / "step-50"
    shutil.copytree(work / "ckpt" / "step-50", ckpt)
    victim = ckpt / "rank-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(tiny / "train.py"), "--quiet", "--steps", "60", "--resume", str(ckpt)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400)
    assert r.returncode != 0
    own = r"train.py: error: rank 2 of 4: .*rank-00002.safetensors"
    assert re.search(own, r.stderr), r.stderr[-3000:]
    for rank in (0, 1, 3):
        line = f"train.py: error: rank {rank} of 4: stopped: could not resume on rank 2"
        assert line in r.stderr, r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr or "exit code 2" in r.stderr or "exitcode: 2" in r.stderr


def test_the_readme_run_of_tiny_equals_the_reference_bit_for_bit(tiny, tiny_run, tmp_path):
    """The issue's end-to-end promise on tiny.embark as written (adagrad, adam,
    rowwise_adagrad tables and an adagrad dense optimizer), with the default options of
    both runs: `torchrun ... train.py --steps 50` and `train.py --reference --steps 50`."""
    work, _ = tiny_run
    r = reference(
        tiny,
        *("--steps", str(STEPS), "--log-json", str(tmp_path / "r.jsonl")),
        *("--export-embeddings", str(tmp_path / "r.npz")),
    )
    assert "exact (fp64 sums)" in r.stdout
    assert_same_tables(work / "tables.safetensors", tmp_path / "r.npz", atol=0.0)
    ls, lr = _losses(work / "log.jsonl"), _losses(tmp_path / "r.jsonl")
    assert len(ls) == len(lr) == STEPS
    assert max(abs(a - b) for a, b in zip(ls, lr, strict=True)) < 1e-12
    (ev_s,) = [x for x in _records(work / "log.jsonl") if x.get("eval")]
    (ev_r,) = [x for x in _records(tmp_path / "r.jsonl") if x.get("eval")]
    assert abs(ev_s["auc"] - ev_r["auc"]) < 1e-12


def test_fp32_numerics_use_the_production_path_and_half_the_value_bytes(tiny, tiny_run, tmp_path):
    """`--numerics fp32` on the CPU: the fp32 torch kernels; every step moves less than
    the exact run of the same plan and data, but more than half (keys and bag lengths keep
    their size, vectors and gradients halve)."""
    r = torchrun(
        tiny,
        *("--numerics", "fp32", "--steps", "5", "--eval-batches", "0"),
        *("--log-json", str(tmp_path / "s.jsonl")),
    )
    assert "backend gloo, torch kernels (no CUDA)" in r.stdout
    work, _ = tiny_run
    exact = [x["bytes_total"] for x in _records(work / "log.jsonl") if not x.get("eval")]
    fp32 = [x["bytes_total"] for x in _records(tmp_path / "s.jsonl") if not x.get("eval")]
    assert len(fp32) == 5
    assert all(a < b < 2 * a for a, b in zip(fp32, exact, strict=False)), (fp32, exact[:5])


@pytest.fixture(scope="module")
def pinned_spec(tmp_path_factory) -> Path:
    """tiny.embark with its own embedding optimizers, an adam dense optimizer, learning-rate
    schedules (SCHEDULES) and dp, ub and hierarchical rb pinned."""
    spec = tmp_path_factory.mktemp("pinned_spec") / "tiny_pinned.embark"
    spec.write_text(_scheduled(_pinned(TINY.read_text())))
    return spec


@pytest.fixture(scope="module")
def pinned_embark(pinned_spec, tmp_path_factory) -> tuple[Path, Path]:
    out = compile_spec(pinned_spec, tmp_path_factory.mktemp("pinned_embark"))
    work = tmp_path_factory.mktemp("pinned_embark_run")
    torchrun(
        out,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", "20"),
        *("--export-embeddings", str(work / "tables.npz"), "--log-json", str(work / "log.jsonl")),
    )
    return out, work


@pytest.fixture(scope="module")
def pinned_rowwise(pinned_spec, tmp_path_factory) -> Path:
    return compile_spec(
        pinned_spec, tmp_path_factory.mktemp("pinned_rowwise"), "--strategy", "row-wise"
    )


def test_every_cluster_path_trains_the_reference_tables_bit_for_bit_in_exact_mode(
    pinned_embark, tmp_path
):
    out, work = pinned_embark
    plan = json.loads((out / "plan.json").read_text())
    kinds = {c["kind"]: c for c in plan["clusters"]}
    assert set(kinds) == {"dp", "rb", "ub"}
    assert kinds["rb"]["communication"] == "hierarchical"
    assert plan["model"]["optimizer"]["kind"] == "adam"
    assert plan["model"]["optimizer"]["schedule"]["decay"] == "poly"
    assert {t["optimizer_params"]["schedule"]["decay"] for t in plan["tables"]} == {"poly", "step"}
    # the sharded run's rates, step by step, as SCHEDULES says (the log's `lr`)
    # (a record's `step` counts steps completed from 1: step s, counted from 0, is s + 1's)
    rates = {x["step"] - 1: x["lr"] for x in _records(work / "log.jsonl") if not x.get("eval")}
    assert [rates[t]["dense"] for t in (0, 4, 5, 22, 40, 49)] == pytest.approx(
        [0.002, 0.01, 0.01, 0.01 * (1 - 17 / 35) ** 2, 0.0, 0.0], rel=1e-12, abs=1e-15
    )
    assert [rates[t]["tables"]["tag"] for t in (0, 3, 13, 14, 49)] == pytest.approx(
        [0.001 / 4, 0.001, 0.001, 0.0005, 0.001 / 16], rel=1e-12
    )
    item = [rates[t]["tables"]["item"] for t in (0, 4, 5, 25, 45)]
    assert item == pytest.approx([0.05, 0.05, 0.05, 0.001 + 0.049 * 0.25, 0.001], rel=1e-12)
    reference(
        out,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--export-embeddings", str(tmp_path / "ref.npz")),
    )
    assert_same_tables(work / "tables.npz", tmp_path / "ref.npz", atol=0.0)


def test_another_strategy_gives_another_program_and_the_same_model(
    pinned_embark, pinned_rowwise, tmp_path
):
    out, work = pinned_embark
    assert (pinned_rowwise / "train.py").read_text() != (out / "train.py").read_text()
    plan = json.loads((pinned_rowwise / "plan.json").read_text())
    assert max(s["row_shards"] for s in plan["shards"]) > 1
    torchrun(
        pinned_rowwise,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--export-embeddings", str(tmp_path / "tables.npz")),
    )
    assert_same_tables(work / "tables.npz", tmp_path / "tables.npz", atol=0.0)


def test_a_checkpoint_of_one_plan_resumes_under_another(pinned_embark, pinned_rowwise, tmp_path):
    """Resumed from the newest complete checkpoint of a folder, under another plan; a newer
    damaged one is passed over with a warning that names it and what is wrong."""
    _, work = pinned_embark
    ckpt = tmp_path / "ckpt"
    for step in (20, 40):
        shutil.copytree(work / "ckpt" / f"step-{step}", ckpt / f"step-{step}")
    shutil.copytree(ckpt / "step-40", ckpt / "step-45")
    victim = ckpt / "step-45" / "rank-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    r = torchrun(
        pinned_rowwise,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--resume", "--checkpoint-dir", str(ckpt)),
        *("--export-embeddings", str(tmp_path / "tables.npz")),
    )
    assert re.search(r"resumed from .*step-40 at step 40", r.stdout), r.stdout
    assert "warning: passing over the damaged checkpoint" in r.stderr
    assert "step-45/rank-00001.safetensors: 100 bytes" in r.stderr
    assert_same_tables(work / "tables.npz", tmp_path / "tables.npz", atol=0.0)


@pytest.fixture(scope="module")
def sgd_spec(tmp_path_factory) -> Path:
    """The pinned tiny.embark with every optimizer SGD (see the module docstring)."""
    text = re.sub(
        r"optimizer (sgd|adagrad|rowwise_adagrad|adam) \{ lr [0-9.]+ \}",
        "optimizer sgd { lr 0.5 }",
        TINY.read_text(),
    )
    assert text.count("optimizer sgd { lr 0.5 }") == 7
    spec = tmp_path_factory.mktemp("sgd_spec") / "tiny_sgd.embark"
    spec.write_text(_pinned(text))
    return spec


@pytest.fixture(scope="module")
def sgd_embark(sgd_spec, tmp_path_factory) -> Path:
    return compile_spec(sgd_spec, tmp_path_factory.mktemp("sgd_embark"))


@pytest.fixture(scope="module")
def sgd_reference(sgd_embark, tmp_path_factory) -> Path:
    """The fp32 reference run of the SGD copy: its log r.jsonl and tables r.npz."""
    work = tmp_path_factory.mktemp("sgd_reference")
    reference(
        sgd_embark,
        *("--numerics", "fp32", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--log-json", str(work / "r.jsonl"), "--export-embeddings", str(work / "r.npz")),
    )
    return work


def test_fp32_sharded_training_equals_the_reference_to_rounding(
    sgd_embark, sgd_reference, tmp_path
):
    """fp32 numerics (CUDA's default), on every cluster path: fp32 summation order is all
    that differs."""
    out = sgd_embark
    r = torchrun(
        out,
        *("--numerics", "fp32", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--log-json", str(tmp_path / "s.jsonl"), "--export-embeddings", str(tmp_path / "s.npz")),
    )
    assert "exact" not in r.stdout
    assert_same_tables(tmp_path / "s.npz", sgd_reference / "r.npz", atol=2e-6)
    ls, lr = _losses(tmp_path / "s.jsonl"), _losses(sgd_reference / "r.jsonl")
    assert max(abs(a - b) for a, b in zip(ls, lr, strict=True)) < 1e-5


BF16_LOSS_BOUND = 1e-3
BF16_TABLE_BOUND = 2e-3
"""docs/language.md's bound ("Mixed precision") of a bf16 run against the fp32 reference
(SGD, 50 steps of tiny): every step's loss within 0.1 % of the reference's, every table
weight within 2e-3 (measured: 7.8e-5 and 2.4e-4, bench/RESULTS.md)."""


def test_a_bf16_run_trains_and_stays_within_the_documented_bound_of_fp32(
    sgd_embark, sgd_reference, tmp_path
):
    """`--precision bf16` on 4 CPU ranks: autocast computes the dense model in bf16 over
    fp32 weights; the loss falls and the run stays within the documented bound of the
    fp32 reference, step by step."""
    r = torchrun(
        sgd_embark,
        *("--precision", "bf16", "--steps", str(STEPS), "--eval-batches", "2"),
        *("--log-json", str(tmp_path / "s.jsonl"), "--export-embeddings", str(tmp_path / "s.npz")),
    )
    assert "; dense bf16" in r.stdout and "exact" not in r.stdout
    (evaluation,) = [x for x in _records(tmp_path / "s.jsonl") if x.get("eval")]
    assert 0 < evaluation["logloss"] < 1 and evaluation["samples"] == 512
    ls, lr = _losses(tmp_path / "s.jsonl"), _losses(sgd_reference / "r.jsonl")
    assert len(ls) == len(lr) == STEPS
    assert sum(ls[-10:]) / 10 < sum(ls[:10]) / 10 - 1e-3
    assert max(abs(a - b) / b for a, b in zip(ls, lr, strict=True)) < BF16_LOSS_BOUND
    assert ls != lr  # bf16 rounds: the runs are not the same
    assert_same_tables(tmp_path / "s.npz", sgd_reference / "r.npz", atol=BF16_TABLE_BOUND)


def test_reference_trains_from_a_criteo_file(sgd_embark, tmp_path):
    out = sgd_embark
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(256 * 3):
        ints = [str(v) if v >= 0 else "" for v in rng.integers(-1, 50, 13)]
        cats = [format(int(v), "08x") for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]))
    data = tmp_path / "day_0.tsv"
    data.write_text("\n".join(lines) + "\n")
    r = reference(out, "--steps", "3", "--data", str(data), "--log-json", str(tmp_path / "l.jsonl"))
    assert str(data) in r.stdout
    assert len([x for x in _records(tmp_path / "l.jsonl") if not x.get("eval")]) == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--exact", "--precision", "bf16"), "--numerics exact computes the dense model in fp64"),
        (("--precision", "fp16", "--device", "cpu"), "fp16 trains on CUDA only"),
    ],
)
def test_a_precision_that_cannot_run_is_a_user_error(tiny, args, needle):
    cmd = [sys.executable, str(tiny / "train.py"), "--reference", "--steps", "1", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
