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


def _edit(path: Path, out: Path, edit) -> Path:
    data = json.loads(path.read_text())
    for s in data["shards"]:
        edit(s)
    out.write_text(json.dumps(data))
    return out


def test_migration_counts_a_tier_change_on_its_rank_as_host_hbm_bytes(host_plan, tmp_path):
    from embark_runtime.keys import shard_row_count
    from embarkc.migration import migration_cost

    _, path = host_plan
    a = load_plan(path)
    cell = next(s for s in a.shards if s.tier != "host" and s.table != "country")
    t = a.table(cell.table)

    def to_host(s):
        if (s["table"], s["rank"], s["columns"]) == (cell.table, cell.rank, list(cell.columns)):
            s["tier"], s["cache_rows"] = "host", 3

    b = load_plan(_edit(path, tmp_path / "b.json", to_host))
    rows = shard_row_count(t.rows, cell.row_shard, cell.row_shards, a.row_partition)
    whole = t.bytes_for(rows, cell.width)
    m = migration_cost(a, b)
    assert m.total_bytes == 0  # nothing changes rank
    assert m.host_hbm is not None
    assert (m.host_hbm.to_host_bytes, m.host_hbm.to_hbm_bytes) == (whole, 0)
    assert [x.table for x in m.host_hbm.by_table] == [cell.table]
    back = migration_cost(b, a).host_hbm
    assert back is not None and (back.to_hbm_bytes, back.to_host_bytes) == (whole, 0)


def test_a_cache_size_change_moves_no_bytes(host_plan, tmp_path):
    from embarkc.migration import migration_cost

    _, path = host_plan

    def smaller(s):
        if s.get("tier") == "host":
            s["cache_rows"] = 1

    m = migration_cost(load_plan(path), load_plan(_edit(path, tmp_path / "b.json", smaller)))
    assert m.total_bytes == 0 and m.host_hbm is not None and m.host_hbm.total_bytes == 0


def test_an_all_hbm_diff_has_no_host_hbm_entry(tmp_path):
    from embarkc.migration import migration_cost

    plan = tmp_path / "plan.json"
    assert embarkc(["plan", str(TINY), "--solver", "greedy", "-o", str(plan), "-q"]) == 0
    p = load_plan(plan)
    assert migration_cost(p, p).host_hbm is None


def test_diff_shows_host_hbm_bytes_and_the_cache_change(host_plan, tmp_path, capsys):
    _, path = host_plan
    a = load_plan(path)
    cell = next(s for s in a.shards if s.tier != "host" and s.table != "country")
    cached = next(s for s in a.shards if s.tier == "host")

    def edit(s):
        if (s["table"], s["rank"], s["columns"]) == (cell.table, cell.rank, list(cell.columns)):
            s["tier"], s["cache_rows"] = "host", 3
        if (s["table"], s["rank"], s["columns"]) == (
            cached.table,
            cached.rank,
            list(cached.columns),
        ):
            s["cache_rows"] = 1

    b = _edit(path, tmp_path / "b.json", edit)
    capsys.readouterr()
    embarkc(["diff", str(path), str(b), "--format", "md"])
    md = capsys.readouterr().out
    assert "host <-> HBM bytes copied on their ranks" in md and f"`{cell.table}`" in md
    assert "host <-> HBM" in md.splitlines()[0]  # the verdict says it
    embarkc(["diff", str(path), str(b), "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    host = data["migration"]["host_hbm"]
    assert host["to_host_bytes"] > 0 and host["total_bytes"] == host["to_host_bytes"]
    changed = {c["table"]: c for c in data["tables_changed"]}
    assert "host 1/" in changed[cell.table]["grid_b"]
    assert (
        "1-" in changed[cached.table]["grid_b"] or "cache 1 rows" in changed[cached.table]["grid_b"]
    )
    embarkc(["diff", str(path), str(b)])
    assert "host <-> HBM bytes" in capsys.readouterr().out


def test_report_draws_the_host_tier(host_plan, tmp_path):
    from embarkc import report

    _, path = host_plan
    plan = load_plan(path)
    d = report.report_data(plan)
    host = {s.table for s in plan.shards if s.tier == "host"}
    assert {t.table for t in d.tiers} == host
    expected = {t["table"]: t for t in plan.estimate.model_extra["host_tier"]["tables"]}
    for t in d.tiers:
        e = expected[t.table]
        assert (t.host_cells, t.rows, t.cache_rows) == (e["cells"], e["rows"], e["cache_rows"])
        assert t.host_bytes == e["host_bytes"] and t.hit_rate == e["hit_rate"]
        assert 0 < t.cache_share < 1
    assert d.node_host_bytes == plan.estimate.model_extra["host_tier"]["node_host_bytes"]
    assert any(k == "host tier" for k, _ in d.facts)
    html = report.render_html(d)
    assert "<h2>Host tier</h2>" in html and 'id="fig-host"' in html
    assert "expected hit rate" in html
    report.render_image(d, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_an_all_hbm_report_has_no_host_tier(tmp_path):
    from embarkc import report

    plan = tmp_path / "plan.json"
    assert embarkc(["plan", str(TINY), "--solver", "greedy", "-o", str(plan), "-q"]) == 0
    d = report.report_data(load_plan(plan))
    assert d.tiers == [] and d.node_host_bytes == []
    assert "Host tier" not in report.render_html(d)


def test_ub_host_cells_see_the_same_rows_flat_or_hierarchical():
    """A ub owner admits the union of its requests: the lookups are the row shard's
    distinct rows whatever the communication, and a cache of the whole cell misses each
    row once (its first read)."""
    from test_simulate import make_hub_plan

    from embark_runtime.plan import Plan

    counted = {}
    for communication in ("flat", "hierarchical"):
        hbm = make_hub_plan(communication)
        d = hbm.model_dump()
        for s in d["shards"]:
            if s["table"] == "c":
                s["tier"], s["cache_rows"] = "host", hbm.row_count("c", s["row_shard"], 3)
        plan = Plan.model_validate(d)
        counted[communication] = simulate(plan, batches=4, seed=2).host_tier["c"]
    flat, hier = counted["flat"], counted["hierarchical"]
    assert flat.lookups == hier.lookups > 0
    assert flat.as_dict() == hier.as_dict()  # a cache of every row: no eviction, same misses
    assert flat.evictions == 0 and flat.host_reads == 0 and flat.hits > 0
