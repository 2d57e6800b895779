"""`embarkc diff` on hand-built plans: verdicts, sections, golden outputs, gates, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from embarkc.review import compare, render, text, views

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
                "memory_bytes": views._table_memory(plan, t.name),
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
        views.COMPONENTS
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
    assert render.render_json(diff.diff_sides(a, b)) == render.render_json(diff.diff_sides(a, b))


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
    md = render.render_markdown(d)
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
    assert render.ranks_title(d) == "Ranks: 2 of 6 changed (2 only in B)"
    one = build_plan(TABLES_A, {name: ("dp",) for name in PLACE_A}, nodes=1, gpus=1)
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", one))
    assert len(d.ranks_changed) == 4
    assert render.ranks_title(d) == "Ranks: 4 of 4 changed (1 worse, 3 only in A)"
    assert main(["diff", _write(tmp_path, "a.json", a), _write(tmp_path, "b.json", one)]) == 0
    assert "Ranks: 4 of 4 changed (1 worse, 3 only in A)" in capsys.readouterr().out


@pytest.fixture
def tiny_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """specs/tiny.embark copied into tmp_path (the current folder) and its greedy plan."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(Path(__file__).resolve().parent.parent / "specs" / "tiny.embark", tmp_path)
    assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "p1.json"]) == 0
    return tmp_path / "p1.json"


def _contract_only(data: dict) -> dict:
    """A plan as another tool writes it: the contract's fields (plan-v1.md) alone."""

    def keep(obj: dict, keys: tuple[str, ...]) -> dict:
        return {k: obj[k] for k in keys if k in obj}

    out = keep(data, ("format", "version", "source", "batch_size", "row_partition", "shards"))
    out["topology"] = keep(
        data["topology"],
        (
            "nodes",
            "gpus_per_node",
            "hbm_bytes",
            "hbm_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ),
    )
    out["tables"] = [keep(t, ("name", "rows", "dim", "dtype", "optimizer")) for t in data["tables"]]
    out["features"] = [
        {**keep(f, ("name", "table", "hotness", "pooling")), "access": f["access"]}
        for f in data["features"]
    ]
    out["clusters"] = [
        keep(c, ("name", "kind", "communication", "tables")) for c in data["clusters"]
    ]
    out["estimate"] = {
        "step_time": data["estimate"]["step_time"],
        "per_rank": [
            keep(r, ("rank", "memory_bytes", "time")) for r in data["estimate"]["per_rank"]
        ],
    }
    out["planner"] = keep(data["planner"], ("strategy", "solver", "status", "seed", "wall_time"))
    return out


def test_a_plan_of_another_tool_differs_only_where_both_record_a_value(tiny_plan, capsys):
    """B lacks embarkc's own fields: the loader's defaults for them (arch sm_90, fixed
    bags, no weights) are no change, and B re-costed from the spec differs from A's
    rounded estimate by no rank."""
    data = json.loads(tiny_plan.read_text())
    (tiny_plan.parent / "contract.json").write_text(json.dumps(_contract_only(data)))
    capsys.readouterr()
    assert main(["diff", "p1.json", "contract.json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("same step time")
    assert "topology changed" not in out and "feature" not in out.replace("feature.", "").replace(
        "Plan B does not record", ""
    )
    assert "Ranks:" not in out and "Input changes" not in out
    assert (
        "Plan B does not record feature.fixed, feature.max_hotness, feature.weighted, "
        "topology.arch, topology.dense_flops" in out
    )
    d = diff.diff_sides(diff.load_side("p1.json"), diff.load_side("contract.json"))
    assert d.summary.cost_source_b == "cost model" and not d.ranks_changed
    assert not d.spec_changes and d.not_compared == {
        "B": (
            "feature.fixed",
            "feature.max_hotness",
            "feature.weighted",
            "topology.arch",
            "topology.dense_flops",
        )
    }
    assert json.loads(render.render_json(d))["not_compared"]["B"][0] == "feature.fixed"
    # a value both record still differs
    data2 = _contract_only(data)
    data2["features"][0]["pooling"] = "mean"
    (tiny_plan.parent / "contract2.json").write_text(json.dumps(data2))
    d = diff.diff_sides(diff.load_side("p1.json"), diff.load_side("contract2.json"))
    assert [(c.name, c.fields) for c in d.spec_changes] == [
        ("country", {"pooling": ("sum", "mean")})
    ]


def test_memory_is_counted_from_the_cells_whatever_the_estimate_says(tiny_plan, capsys):
    data = json.loads(tiny_plan.read_text())
    data["estimate"]["per_rank"][0]["memory_bytes"] = 10**15
    (tiny_plan.parent / "edited.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["diff", "p1.json", "edited.json", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "peak memory unchanged" in out.splitlines()[0]
    assert "Ranks:" not in out


def test_huge_changes_and_numbers_print_compactly_and_as_finite_json():
    a = plan_a()
    tiny = a.estimate.model_copy(update={"step_time": 5e-324})
    huge = a.estimate.model_copy(update={"step_time": 1e6})
    topo = a.topology.model_copy(update={"hbm_bytes": (1 << 63) - 1})
    b = a.model_copy(update={"estimate": huge, "topology": topo})
    d = diff.diff_sides(diff.Side("a", a.model_copy(update={"estimate": tiny})), diff.Side("b", b))
    assert d.summary.step_time.pct == compare.MAX_PCT
    assert "slower by 1.00e+12 %" in d.verdict
    json.loads(render.render_json(d))  # no inf or nan: it would not be written at all
    assert [c.fields for c in d.spec_changes if c.what == "topology"] == [
        {"hbm_bytes": (str(GIB), "9.223372e+18")}
    ]
    assert text.fmt_bytes((1 << 63) - 1) == "8.0 EiB"


def test_a_plan_without_per_rank_figures_has_unknown_rank_times():
    """The loader lets estimate.per_rank list every rank or none; none is no 0 s rank."""
    a = plan_a()
    bare = a.model_copy(update={"estimate": Estimate(step_time=a.estimate.step_time, per_rank=[])})
    view = views.view_of(bare)
    assert [r.time for r in view.per_rank] == [None] * 4
    assert [r.memory_bytes for r in view.per_rank] == a.memory_by_rank()
    d = diff.diff_sides(diff.Side("a", a), diff.Side("b", bare))
    assert not d.ranks_changed


def test_the_review_model_and_renderers_need_neither_torch_nor_the_checker():
    """A reviewer's view of a plan is plain data: importing the views, the comparison and
    the renderers (as `embarkc diff` does) loads neither torch nor `planner.check`."""
    code = (
        "import sys; import embarkc.diff, embarkc.review.views, embarkc.review.compare, "
        "embarkc.review.render, embarkc.review.terminal; "
        "print(sorted({'torch', 'embarkc.planner.check'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
