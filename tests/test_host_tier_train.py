"""Host-tier cells train the unsharded reference's tables bit for bit (exact numerics).

Two levels, as the issue asks:
* in-process (one spawn of 4 gloo processes): random small plans of every cluster kind,
  grid, optimizer and communication with random cells in host memory and caches of 0, 1,
  2, 3 rows, half the cell or all of it, trained several steps against the reference;
* end to end: tiny.embark with dp, ub and hierarchical rb pinned, and tiny.embark as
  planned (one flat rb cluster), compiled from hand-edited plans with host-tier cells and
  caches of 0 to 8 rows (they evict on every step), trained with torchrun on 4 CPU
  processes; the log's `cache` field counts the evictions; a checkpoint of the host-tier
  plan resumes under the all-HBM plan and back, and a killed rank of a host-tier run
  restarts from the last checkpoint with the same result. dp tables stay in HBM (a dp
  table has no shards, so no tier).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mp_harness import spawn
from runtime_cases import Case, exact_cases, worker
from test_e2e_train import PINS, assert_same_tables, compile_spec, reference, torchrun

from embark_runtime.plan import validate_rules

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"
STEPS = 20
CACHES = (2, 0, 5, 8, 3, 1)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- in process


@dataclass
class HostCase(Case):
    """A Case whose cells are put in host memory at random (seeded by the case), with
    caches from none to the whole cell."""

    def plan(self):
        plan = super().plan()
        rng = np.random.default_rng(self.seed + 17)
        shards = []
        for s in plan.shards:
            rows = plan.row_count(s.table, s.row_shard, s.row_shards)
            choice = int(rng.integers(0, 7))
            if choice == 6:
                shards.append(s)
                continue
            cache = [0, 1, 2, 3, rows // 2, rows][choice]
            shards.append(s.model_copy(update={"tier": "host", "cache_rows": min(cache, rows)}))
        plan = plan.model_copy(update={"shards": shards})
        validate_rules(plan)
        return plan


HOST = [
    HostCase(**{**c.__dict__, "name": f"host-{c.name}", "steps": 6})
    for c in exact_cases(24, seed=38)
]


@pytest.fixture(scope="module")
def host_results() -> dict[str, list[dict]]:
    by_case: dict[str, list[dict]] = {}
    for rank_results in spawn(worker, 4, HOST):
        for r in rank_results:
            by_case.setdefault(r["name"], []).append(r)
    return by_case


def test_the_random_cases_put_cells_of_every_kind_in_host_memory():
    kinds = set()
    for case in HOST:
        plan = case.plan()
        for s in plan.shards:
            if s.tier == "host":
                kinds.add((plan.cluster_of(s.table).kind, s.cache_rows == 0))
    assert kinds == {("rb", True), ("rb", False), ("ub", True), ("ub", False)}


@pytest.mark.parametrize("case", HOST, ids=[c.name for c in HOST])
def test_host_tier_cells_train_the_reference_bit_for_bit(host_results, case):
    runs = host_results[case.name]
    assert len(runs) == case.world
    for rank, run in enumerate(runs):
        assert run["errors"] == dict.fromkeys(run["errors"], 0.0), f"{case.name} rank {rank}"
        for step, (got, want) in enumerate(run["losses"]):
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), f"{case.name} step {step}"


# --------------------------------------------------------------------------- end to end


def _host_spec(text: str) -> str:
    assert text.count("  arch sm_80\n") == 1
    return text.replace("  arch sm_80\n", "  arch sm_80\n  host_memory 64 MiB\n")


def _host_plan(plan_path: Path, out: Path) -> Path:
    """Every other cell of the plan in host memory with a cache of CACHES rows."""
    plan = json.loads(plan_path.read_text())
    for i, s in enumerate(plan["shards"][::2]):
        s["tier"] = "host"
        s["cache_rows"] = CACHES[i % len(CACHES)]
    out.write_text(json.dumps(plan, indent=1))
    return out


def _records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if not r.get("summary") and not r.get("eval")]


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(all-HBM program, host-tier program, reference tables) of pinned tiny.embark."""
    d = tmp_path_factory.mktemp("host_pinned")
    spec = d / "tiny_pinned.embark"
    spec.write_text(_host_spec(TINY.read_text()).replace("  seed 0\n", "  seed 0\n" + PINS))
    hbm = compile_spec(spec, d / "hbm")
    plan = _host_plan(hbm / "plan.json", d / "host_plan.json")
    host = compile_spec(spec, d / "host", "--plan", str(plan))
    reference(
        hbm,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--export-embeddings", str(d / "ref.npz")),
    )
    return hbm, host, d / "ref.npz"


@pytest.fixture(scope="module")
def pinned_run(pinned, tmp_path_factory) -> Path:
    _, host, _ = pinned
    work = tmp_path_factory.mktemp("host_pinned_run")
    torchrun(
        host,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0", "--log-json"),
        *(str(work / "log.jsonl"), "--export-embeddings", str(work / "tables.npz")),
        *("--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", "10"),
    )
    return work


def test_tiny_with_host_tier_cells_trains_the_reference_bit_for_bit(pinned, pinned_run):
    _, host, ref = pinned
    plan = json.loads((host / "plan.json").read_text())
    tiers = {
        c["kind"]
        for c in plan["clusters"]
        for s in plan["shards"]
        if s.get("tier") == "host" and s["table"] in c["tables"]
    }
    assert tiers == {"rb", "ub"}
    assert {c["kind"] for c in plan["clusters"]} == {"dp", "rb", "ub"}
    assert_same_tables(pinned_run / "tables.npz", ref, atol=0.0)


def test_the_log_counts_each_clusters_cache_hits_and_constant_evictions(pinned, pinned_run):
    records = _records(pinned_run / "log.jsonl")
    assert len(records) == STEPS
    for r in records:
        assert set(r["cache"]) == {"rb0", "ub0"}
        for v in r["cache"].values():
            assert v["lookups"] == v["hits"] + v["misses"]
            assert v["misses"] == v["fetches"] + v["host_reads"]
            assert v["hit_rate"] == pytest.approx(v["hits"] / v["lookups"])
    # caches of a few rows against hundreds of distinct rows a step: some rows are read
    # from host on every step, rows are evicted all along, and at the end every slot is
    # full (each fetch beyond the first fill evicted a row)
    plan = json.loads((pinned[1] / "plan.json").read_text())
    for cluster in ("rb0", "ub0"):
        tables = next(c["tables"] for c in plan["clusters"] if c["name"] == cluster)
        slots = sum(s.get("cache_rows", 0) for s in plan["shards"] if s["table"] in tables)
        steps = [r["cache"][cluster] for r in records]
        assert all(v["host_reads"] > 0 for v in steps), cluster
        fetches = sum(v["fetches"] for v in steps)
        evictions = sum(v["evictions"] for v in steps)
        assert evictions > 0 and fetches - evictions == slots, (cluster, steps)
        # dirty evicted rows, plus the flush of the checkpoint at step 10 (counted in the
        # next step's record; the one at step 20 comes after the last record)
        assert 0 < sum(v["writebacks"] for v in steps) <= evictions + slots


def test_a_host_tier_checkpoint_resumes_under_the_all_hbm_plan(pinned, pinned_run, tmp_path):
    hbm, _, ref = pinned
    r = torchrun(
        hbm,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0", "--resume"),
        *("--checkpoint-dir", str(_only(pinned_run / "ckpt", 10, tmp_path))),
        *("--export-embeddings", str(tmp_path / "tables.npz")),
    )
    assert re.search(r"resumed from .*step-10 at step 10", r.stdout), r.stdout
    assert_same_tables(tmp_path / "tables.npz", ref, atol=0.0)


def _only(ckpt: Path, step: int, tmp_path: Path) -> Path:
    """A checkpoint folder holding only `ckpt`'s step `step`."""
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(ckpt / f"step-{step}", out / f"step-{step}")
    return out


def test_an_hbm_checkpoint_resumes_under_the_host_tier_plan_and_survives_a_kill(pinned, tmp_path):
    """All-HBM steps 0-10, then the host-tier plan resumes at 10, checkpoints at 15, a
    rank is killed at step 17 and the group restarts from step 15: same tables."""
    hbm, host, ref = pinned
    ckpt = tmp_path / "ckpt"
    torchrun(hbm, "--exact", "--steps", "10", "--eval-batches", "0", "--checkpoint-dir", str(ckpt))
    r = torchrun(
        host,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0", "--resume"),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"),
        *("--export-embeddings", str(tmp_path / "tables.npz")),
        restarts=1,
        EMBARK_FAULT_AT_STEP="17",
    )
    assert re.search(r"resumed from .*step-10 at step 10", r.stdout), r.stdout
    assert re.search(r"resumed from .*step-15 at step 15", r.stdout), r.stdout
    assert (ckpt / ".fault-injected").exists()
    assert_same_tables(tmp_path / "tables.npz", ref, atol=0.0)


def test_flat_rb_with_host_tier_cells_trains_the_reference_bit_for_bit(tmp_path):
    spec = tmp_path / "tiny.embark"
    spec.write_text(_host_spec(TINY.read_text()))
    hbm = compile_spec(spec, tmp_path / "hbm")
    plan = json.loads((hbm / "plan.json").read_text())
    assert [(c["kind"], c.get("communication")) for c in plan["clusters"]] == [("rb", "flat")]
    host = compile_spec(
        spec, tmp_path / "host", "--plan", str(_host_plan(hbm / "plan.json", tmp_path / "p.json"))
    )
    args = ("--exact", "--steps", str(STEPS), "--eval-batches", "0", "--export-embeddings")
    torchrun(host, *args, str(tmp_path / "tables.npz"))
    reference(hbm, *args, str(tmp_path / "ref.npz"))
    assert_same_tables(tmp_path / "tables.npz", tmp_path / "ref.npz", atol=0.0)


def test_tiny_beyond_its_hbm_is_planned_into_host_memory_and_trains_the_reference(tmp_path):
    """tiny.embark with 1 MiB of HBM a GPU (its tables need 7.8 MiB of the 4 GPUs' 4 MiB):
    the planner puts tables in host memory behind caches it sizes, and the compiled
    program trains on 4 processes to the reference's tables bit for bit, through a rank
    killed at step 17 and the restart from step 15's checkpoint."""
    spec = tmp_path / "tiny_small_hbm.embark"
    text = _host_spec(TINY.read_text())
    assert text.count("  hbm 4 MiB\n") == 1
    spec.write_text(text.replace("  hbm 4 MiB\n", "  hbm 1 MiB\n"))
    out = compile_spec(spec, tmp_path / "out")
    plan = json.loads((out / "plan.json").read_text())
    host = [s for s in plan["shards"] if s.get("tier") == "host"]
    assert host and all(0 < s.get("cache_rows", 0) for s in host)
    assert plan["topology"]["host_memory_bytes"] == 64 << 20
    assert plan["estimate"]["host_tier"]["cells"] == len(host)
    ckpt = tmp_path / "ckpt"
    r = torchrun(
        out,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0", "--log-json"),
        *(str(tmp_path / "log.jsonl"), "--export-embeddings", str(tmp_path / "tables.npz")),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--resume"),
        restarts=1,
        EMBARK_FAULT_AT_STEP="17",
    )
    assert re.search(r"resumed from .*step-15 at step 15", r.stdout), r.stdout
    assert (ckpt / ".fault-injected").exists()
    reference(
        out,
        *("--exact", "--steps", str(STEPS), "--eval-batches", "0"),
        *("--export-embeddings", str(tmp_path / "ref.npz")),
    )
    assert_same_tables(tmp_path / "tables.npz", tmp_path / "ref.npz", atol=0.0)
    # the caches warm up from cold (at the start, and again after the restart) towards
    # the hit rate the planner expects of them (LRU, Che's approximation)
    records = _records(tmp_path / "log.jsonl")
    rates = [rec["cache"]["rb0"]["hit_rate"] for rec in records]
    assert len(rates) == 17 + 5 and rates[0] < rates[8] < rates[16] and rates[17] == 0.0
    tables = plan["estimate"]["host_tier"]["tables"]
    expected = 1 - sum(t["misses"] for t in tables) / sum(t["lookups"] for t in tables)
    assert rates[16] == pytest.approx(expected, abs=0.05), (rates, expected)
