"""simulate, diff and report of a host-tier plan (docs/host_tier.md, "Simulate",
"Diff", "Report"): tiny.embark with HBM cut to 1 MiB, planned into host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embark_runtime.plan import dumps_plan, load_plan
from embarkc.cli import main as embarkc
from embarkc.frontend import load_program
from embarkc.simulate import HIT_RATE_TOLERANCE, host_tier_comparison, simulate

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"


@pytest.fixture(scope="module")
def host_plan(tmp_path_factory) -> tuple[Path, Path]:
    """(spec, plan.json): tiny with 1 MiB of HBM and 64 MiB of host memory, planned."""
    d = tmp_path_factory.mktemp("tiny_host")
    spec = d / "tiny_host.embark"
    spec.write_text(
        TINY.read_text().replace(
            "  hbm 4 MiB\n", "  hbm 1 MiB\n  host_memory 64 MiB\n  host_bandwidth 5 GB/s\n"
        )
    )
    plan = d / "plan.json"
    assert embarkc(["plan", str(spec), "--solver", "greedy", "-o", str(plan), "-q"]) == 0
    assert any(s.tier == "host" for s in load_plan(plan).shards)
    return spec, plan


def test_simulate_counts_hit_rates_near_the_cold_start_expectation(host_plan):
    spec, path = host_plan
    plan, program = load_plan(path), load_program(str(spec))
    result = simulate(plan, batches=30)
    rows = host_tier_comparison(plan, result, program)
    assert {r.table for r in rows} == {s.table for s in plan.shards if s.tier == "host"}
    for r in rows:
        c = r.counted
        assert c.hits + c.misses == c.lookups and c.fetches + c.host_reads == c.misses
        assert c.writebacks <= c.evictions
        assert abs(c.hit_rate - r.cold_hit_rate) <= HIT_RATE_TOLERANCE, r
        # thirty steps from cold have not reached the steady state the estimate gives
        assert c.hit_rate < r.steady_hit_rate
        assert abs(c.lookups - r.cold_lookups) <= 0.05 * r.cold_lookups
        assert not r.flagged
    # the host link is in the lookup time: the owners of host-tier cells move bytes
    owners = {s.rank for s in plan.shards if s.tier == "host"}
    assert {rc.rank for rc in result.per_rank if rc.host_in > 0} == owners


def test_more_batches_warm_the_caches(host_plan):
    _, path = host_plan
    plan = load_plan(path)
    few, many = simulate(plan, batches=2), simulate(plan, batches=20)
    for name, c in few.host_tier.items():
        assert c.hit_rate < many.host_tier[name].hit_rate


def test_simulate_prints_and_writes_the_host_tier(host_plan, capsys):
    _, path = host_plan
    capsys.readouterr()
    assert embarkc(["simulate", str(path), "--batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "host tier: caches replayed from cold over the 3 batches" in out
    assert "expected (cold)" in out and "caches start cold" in out
    assert embarkc(["simulate", str(path), "--batches", "3", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tables = data["host_tier"]["tables"]
    assert tables and all(t["expected_cold_hit_rate"] is not None for t in tables)
    assert all(t["beyond_tolerance"] is False for t in tables)
    assert data["host_tier"]["tolerance"] == HIT_RATE_TOLERANCE


def test_without_its_spec_a_plan_file_is_compared_with_the_steady_state_only(
    host_plan, tmp_path, capsys
):
    _, path = host_plan
    data = json.loads(path.read_text())
    data["source"]["spec"] = str(tmp_path / "gone.embark")
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps(data))
    capsys.readouterr()
    assert embarkc(["simulate", str(lone), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "expected (cold): needs the spec" in out


def test_an_hbm_plan_prints_no_host_tier(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert embarkc(["plan", str(TINY), "--solver", "greedy", "-o", str(plan), "-q"]) == 0
    capsys.readouterr()
    assert embarkc(["simulate", str(plan), "--batches", "1", "--format", "json"]) == 0
    assert "host_tier" not in json.loads(capsys.readouterr().out)
    assert simulate(load_plan(plan), batches=1).host_tier == {}
    assert all(rc.host_in == rc.host_out == 0 for rc in simulate(load_plan(plan)).per_rank)


def test_a_plan_round_trip_keeps_its_tiers(host_plan):
    _, path = host_plan
    assert dumps_plan(load_plan(path)) == path.read_text()
