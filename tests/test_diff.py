"""`embarkc diff` on hand-built plans: verdicts, sections, golden outputs, gates, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embark_runtime.plan import (
    Cluster,
    Estimate,
    Plan,
    PlannerInfo,
    PlanTable,
    PlanTopology,
    RankEstimate,
    Shard,
    Source,
    dumps_plan,
)
from embarkc import diff
from embarkc.cli import main

GOLDEN = Path(__file__).parent / "golden_diff"
GIB = 1 << 30


def build_plan(
    tables: list[tuple[str, int, int, str]],
    placement: dict[str, tuple],
    nodes: int = 2,
    gpus: int = 2,
    batch: int = 1024,
    seconds_per_element: float = 1e-12,
    with_costs: bool = True,
) -> Plan:
    """A valid plan with a toy estimate: a cell costs its rows * width * seconds_per_element.

    placement: name -> ("dp",) or (kind, row_shards, widths, ranks), ranks in cell order
    (row shard major, column shard minor).
    """
    world = nodes * gpus
    ptables = [PlanTable(name=n, rows=r, dim=d, optimizer=o) for n, r, d, o in tables]
    clusters, shards = [], []
    for t in ptables:
        p = placement[t.name]
        if p[0] == "dp":
            clusters.append(Cluster(name=f"dp_{t.name}", kind="dp", tables=[t.name]))
            continue
        kind, r, widths, ranks = p
        extra = {"communication": "flat"} if kind == "rb" else {}
        clusters.append(Cluster(name=f"{kind}_{t.name}", kind=kind, tables=[t.name], **extra))
        i = 0
        for j in range(r):
            lo = 0
            for w in widths:
                shards.append(
                    Shard(
                        table=t.name, row_shard=j, row_shards=r, columns=(lo, lo + w), rank=ranks[i]
                    )
                )
                lo += w
                i += 1
    plan = Plan(
        source=Source(spec="x.embark", sha256="0" * 64),
        topology=PlanTopology(
            nodes=nodes,
            gpus_per_node=gpus,
            hbm_bytes=GIB,
            hbm_bandwidth=2e12,
            intra_node_bandwidth=2e11,
            inter_node_bandwidth=2.5e10,
        ),
        batch_size=batch,
        row_partition="mod",
        tables=ptables,
        features=[
            {"name": f"f_{n}", "table": n, "hotness": 2, "access": {"kind": "uniform"}}
            for n, *_ in tables
        ],
        clusters=clusters,
        shards=shards,
        estimate=Estimate(step_time=0.0, per_rank=[]),
        planner=PlannerInfo(strategy="embark", solver="cp-sat", status="optimal", wall_time=1.5),
    )
    mem = plan.memory_by_rank()
    time = [1e-4] * world
    table_time: dict[str, float] = {}
    for t in ptables:
        if plan.cluster_of(t.name).kind == "dp":
            cost = t.rows * t.dim * seconds_per_element
            time = [x + cost for x in time]
            table_time[t.name] = cost
            continue
        table_time[t.name] = 0.0
        for s in plan.shards_of(t.name):
            cost = plan.row_count(t.name, s.row_shard, s.row_shards) * s.width * seconds_per_element
            time[s.rank] += cost
            table_time[t.name] += cost
    split = {"lookup": 0.4, "distributor": 0.1, "nvlink": 0.2, "network": 0.25, "dp_exchange": 0.05}
    critical = max(range(world), key=lambda r: (time[r], -r))
    per_rank = [
        {
            "rank": r,
            "memory_bytes": mem[r],
            "time": time[r],
            "components": {k: v * time[r] for k, v in split.items()},
            "memory": {"weights": mem[r], "optimizer_state": 0, "buffers": 0},
        }
        for r in range(world)
    ]
    if not with_costs:
        est = {
            "step_time": time[critical],
            "per_rank": [
                RankEstimate(**{k: p[k] for k in ("rank", "memory_bytes", "time")})
                for p in per_rank
            ],
        }
        return plan.model_copy(update={"estimate": Estimate(**est)})
    est = Estimate(
        step_time=time[critical],
        per_rank=per_rank,
        critical_rank=critical,
        components=dict(per_rank[critical]["components"]),
        per_table=[
            {
                "table": t.name,
                "cluster": plan.cluster_of(t.name).name,
                "time": table_time[t.name],
                "memory_bytes": diff._table_memory(plan, t.name),
            }
            for t in ptables
        ],
    )
    planner = plan.planner.model_copy(
        update={
            "bound": 0.9 * time[critical],
            "lower_bound": 0.8 * sum(time) / len(time),
            "baselines": {"table-wise": 1.3 * time[critical]},
        }
    )
    return plan.model_copy(update={"estimate": est, "planner": planner})


TABLES_A = [
    ("user", 1_000_000, 64, "adagrad"),
    ("item", 400_000, 32, "sgd"),
    ("geo", 1000, 16, "sgd"),
    ("old", 5000, 16, "sgd"),
]
PLACE_A = {
    "user": ("rb", 2, (32, 32), (0, 1, 2, 3)),
    "item": ("ub", 1, (32,), (1,)),
    "geo": ("dp",),
    "old": ("rb", 1, (16,), (3,)),
}
TABLES_B = [
    ("user", 1_500_000, 64, "adagrad"),  # grew
    ("item", 400_000, 32, "sgd"),
    ("geo", 1000, 16, "sgd"),
    ("new", 20_000, 8, "rowwise_adagrad"),
]
PLACE_B = {
    "user": ("rb", 4, (64,), (0, 1, 2, 3)),  # regridded
    "item": ("rb", 1, (32,), (2,)),  # cluster and rank changed
    "geo": ("dp",),
    "new": ("ub", 1, (8,), (0,)),
}


def plan_a() -> Plan:
    return build_plan(TABLES_A, PLACE_A)


def plan_b() -> Plan:
    return build_plan(TABLES_B, PLACE_B)


def _write(tmp_path: Path, name: str, plan: Plan) -> str:
    p = tmp_path / name
    p.write_text(dumps_plan(plan))
    return str(p)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("EMBARKC_ACCEPT"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with EMBARKC_ACCEPT=1 to create it"
    assert text == path.read_text(), (
        f"{name} differs from the golden file (EMBARKC_ACCEPT=1 rewrites it)"
    )


def test_plan_with_itself_is_no_changes(tmp_path, capsys):
    a = _write(tmp_path, "a.json", plan_a())
    for fmt in ("md", "json", "terminal"):
        assert main(["diff", a, a, "--format", fmt, "--fail-if-slower", "0"]) == 0
        out = capsys.readouterr().out
        assert "no changes" in out
    d = diff.diff_sides(diff.load_side(a), diff.load_side(a))
    assert d.identical and not d.tables_changed and d.migration.total_bytes == 0


def test_replanning_only_changes_wall_time_is_no_changes(tmp_path):
    a = plan_a()
    b = a.model_copy(update={"planner": a.planner.model_copy(update={"wall_time": 99.0})})
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", b))
    assert d.identical and d.verdict == "no changes"


def test_sections_name_what_changed():
    d = diff.diff_sides(diff.Side("a", plan_a()), diff.Side("b", plan_b()))
    assert d.verdict.startswith("**slower by ")
    changed = {c.table: c for c in d.tables_changed}
    assert set(changed) == {"user", "item"}
    assert changed["user"].changed == ("grid",) and changed["user"].grid_a == "2x2"
    assert changed["user"].grid_b == "4x1"
    assert changed["item"].changed == ("cluster", "placement")
    assert changed["item"].time.a == changed["item"].time.b  # same size, same toy cost
    deltas = {(t.table, t.change) for t in d.tables_delta}
    assert deltas == {("user", "resized"), ("old", "removed"), ("new", "added")}
    assert next(t for t in d.tables_delta if t.table == "user").fields == {
        "rows": ("1000000", "1500000")
    }
    assert d.summary.critical_rank_a is not None and set(d.summary.components) == set(
        diff.COMPONENTS
    )
    assert d.ranks_worse >= 1 and all(r.worse for r in d.ranks_changed[: d.ranks_worse])
    assert d.migration.total_bytes > 0 and d.migration.fresh_tables == ("new",)
    assert {c.name for c in d.spec_changes} == {"f_old", "f_new"}


def test_golden_markdown_and_json(tmp_path, capsys):
    a = _write(tmp_path, "a.json", plan_a())
    b = _write(tmp_path, "b.json", plan_b())
    assert main(["diff", a, b, "--format", "md"]) == 0
    md = capsys.readouterr().out.replace(str(tmp_path), "<tmp>")
    assert main(["diff", a, b, "--format", "json"]) == 0
    js = capsys.readouterr().out.replace(str(tmp_path), "<tmp>")
    _golden("hand_ab.md", md)
    _golden("hand_ab.json", js)
    first = md.splitlines()[0]
    assert first.startswith("**slower by") and "to migrate" in first
    data = json.loads(js)
    assert data["format"] == "embark-diff" and data["migration"]["total_bytes"] > 0


def test_outputs_are_deterministic():
    a, b = diff.Side("a", plan_a()), diff.Side("b", plan_b())
    assert diff.render_json(diff.diff_sides(a, b)) == diff.render_json(diff.diff_sides(a, b))


def test_gates_set_exit_codes(tmp_path, capsys):
    a = _write(tmp_path, "a.json", plan_a())
    b = _write(tmp_path, "b.json", plan_b())
    d = diff.diff_sides(diff.load_side(a), diff.load_side(b))
    slower = d.summary.step_time.pct
    mem = d.summary.peak_memory.pct
    assert slower is not None and slower > 1 and mem is not None and mem > 1
    assert main(["diff", a, b, "--format", "json", "--fail-if-slower", f"{slower - 1}"]) == 1
    assert "gate failed: step time grew" in capsys.readouterr().err
    assert main(["diff", a, b, "--format", "json", "--fail-if-slower", f"{slower + 1}"]) == 0
    assert main(["diff", a, b, "--format", "json", "--fail-if-memory-over", f"{mem - 1}"]) == 1
    assert "gate failed: peak memory grew" in capsys.readouterr().err
    assert main(["diff", a, b, "--format", "json", "--fail-if-memory-over", f"{mem + 1}"]) == 0
    capsys.readouterr()
    # B -> A is faster and smaller: no gate fails even at 0 %
    assert (
        main(
            ["diff", b, a, "--format", "md", "--fail-if-slower", "0", "--fail-if-memory-over", "0"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("**faster by")
    assert main(["diff", a, b, "--fail-if-slower", "-1"]) == 2


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("{not json", "invalid plan (json)"),
        ('{"format": "embark-plan", "version": 2}', "invalid plan (version)"),
        ('{"format": "torchrec-plan", "version": 1}', "invalid plan (format)"),
        ('{"format": "embark-plan", "version": 1, "tables": 3}', "invalid plan (schema)"),
    ],
)
def test_bad_plan_files_are_clear_errors(tmp_path, capsys, text, expect):
    good = _write(tmp_path, "a.json", plan_a())
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["diff", good, str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: error: {expect}" in err and "Traceback" not in err
    assert "hint:" in err


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    good = _write(tmp_path, "a.json", plan_a())
    assert main(["diff", good, str(tmp_path / "nope.json")]) == 2
    assert "nope.json: error: no such file" in capsys.readouterr().err


def test_outside_tool_plan_falls_back_to_contract_fields():
    a = build_plan(TABLES_A, PLACE_A, with_costs=False)
    b = build_plan(TABLES_A, {**PLACE_A, "item": ("ub", 1, (32,), (3,))}, with_costs=False)
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", b))
    assert d.summary.cost_source_a == "contract" and d.summary.components == {}
    assert [c.table for c in d.tables_changed] == ["item"]
    assert d.tables_changed[0].time.a is None and d.tables_changed[0].memory.a == 400_000 * 32 * 4
    md = diff.render_markdown(d)
    assert "carries only the contract's estimate" in md
    assert d.migration.weight_bytes == 400_000 * 32 * 4
    assert d.migration.by_node[0].src == 0 and d.migration.by_node[0].dst == 1


def test_terminal_output_has_no_colour_codes_when_piped(tmp_path, capsys):
    a = _write(tmp_path, "a.json", plan_a())
    b = _write(tmp_path, "b.json", plan_b())
    assert main(["diff", a, b]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert out.splitlines()[0].startswith("slower by")
    assert "Tables placed differently" in out and "Migration from a checkpoint of A" in out


def test_the_rank_heading_counts_the_rows_it_lists(tmp_path, capsys):
    """Ranks only one side has are counted as such, not as worse ranks of B."""
    a = plan_a()
    grown = build_plan(TABLES_A, PLACE_A, gpus=3)  # 2 more ranks, nothing placed on them
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", grown))
    assert [r.rank for r in d.ranks_changed] == [4, 5]
    assert diff.ranks_title(d) == "Ranks: 2 of 6 changed (2 only in B)"
    one = build_plan(TABLES_A, {name: ("dp",) for name in PLACE_A}, nodes=1, gpus=1)
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", one))
    assert len(d.ranks_changed) == 4
    assert diff.ranks_title(d) == "Ranks: 4 of 4 changed (1 worse, 3 only in A)"
    assert main(["diff", _write(tmp_path, "a.json", a), _write(tmp_path, "b.json", one)]) == 0
    assert "Ranks: 4 of 4 changed (1 worse, 3 only in A)" in capsys.readouterr().out
