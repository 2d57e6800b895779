"""End to end on random specs: plan -> check -> simulate -> compile -> train -> compare.

Four seeded specs of `spec_gen.random_spec` (2x2 and 1x4 GPUs; dp, flat and hierarchical
rb and ub clusters, row and column splits under both row partitions, every optimizer,
pooling and dtype, shared and weighted features) are compiled by `embarkc compile`; their
plans must pass `embarkc check` (the independent checker against the spec) and `embarkc
simulate`. All four train in ONE torchrun launch of 4 gloo processes (tests/multi_train.py
runs one generated trainer after another), and their references unsharded in this process;
in the CPU's exact numerics every table must equal the reference's bit for bit and the
losses agree to 1e-12. The seeds were picked so that together they cover every cluster
path; `test_the_seeds_cover_every_cluster_path` says when a planner change loses one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from multi_train import run as multi_train
from spec_gen import random_spec
from test_e2e_train import _env, _losses, assert_same_tables, compile_spec

from embarkc.cli import main as embarkc

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
SEEDS = (118, 122, 152, 173)
STEPS = 3
ARGS = ("--quiet", "--steps", str(STEPS), "--eval-batches", "1")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("fuzz")
    outs = []
    for seed in SEEDS:
        spec = root / f"random_{seed}.embark"
        spec.write_text(random_spec(seed))
        outs.append(compile_spec(spec, root / f"random_{seed}"))
    return outs


@pytest.fixture(scope="module")
def trained(compiled, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("fuzz_runs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(TESTS / "multi_train.py"), str(work), *map(str, compiled), "--", *ARGS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert multi_train([str(work), *map(str, compiled), "--", "--reference", *ARGS]) == 0
    return work


def test_the_seeds_cover_every_cluster_path(compiled):
    paths, splits, partitions = set(), set(), set()
    for out in compiled:
        plan = json.loads((out / "plan.json").read_text())
        partitions.add(plan["row_partition"])
        dims = {t["name"]: t["dim"] for t in plan["tables"]}
        for c in plan["clusters"]:
            paths.add((c["kind"], c.get("communication") if c["kind"] != "dp" else None))
        for s in plan["shards"]:
            if s["row_shards"] > 1:
                splits.add("rows")
            if s["columns"][1] - s["columns"][0] < dims[s["table"]]:
                splits.add("columns")
    want = {("dp", None), ("rb", "flat"), ("rb", "hierarchical"), ("ub", None)}
    want.add(("ub", "hierarchical"))
    assert paths >= want, f"pick other seeds: the plans lost {want - paths}"
    assert splits == {"rows", "columns"} and partitions == {"mod", "range"}


@pytest.mark.parametrize("index", range(len(SEEDS)), ids=[f"seed{s}" for s in SEEDS])
def test_a_random_spec_plans_checks_and_simulates(compiled, index):
    plan = str(compiled[index] / "plan.json")
    assert embarkc(["check", plan]) == 0
    assert embarkc(["simulate", plan, "--batches", "2"]) == 0


@pytest.mark.parametrize("index", range(len(SEEDS)), ids=[f"seed{s}" for s in SEEDS])
def test_a_random_spec_trains_the_reference_bit_for_bit(trained, index):
    run = trained / f"{index}.sharded"
    ref = trained / f"{index}.reference"
    assert_same_tables(Path(f"{run}.npz"), Path(f"{ref}.npz"), atol=0.0)
    ls, lr = _losses(Path(f"{run}.jsonl")), _losses(Path(f"{ref}.jsonl"))
    assert len(ls) == len(lr) == STEPS
    assert max(abs(a - b) for a, b in zip(ls, lr, strict=True)) < 1e-12
