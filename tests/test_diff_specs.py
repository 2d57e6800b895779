"""`embarkc diff` of specs, planned on the fly, after each kind of spec change.

The goldens live in test_diff.py on hand-built plans (they must not move when the planner
improves); here the assertions are about what each spec change must show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embarkc import diff
from embarkc.cli import main
from embarkc.review import compare, render, views

BASE = """\
hardware {
  nodes 2
  gpus_per_node 2
  hbm 4 MiB
  hbm_bandwidth 100 GB/s
  nvlink 50 GB/s
  network 10 Gb/s
}

table country { rows 100 dim 16 hotness 4 optimizer sgd { lr 0.05 } }
table item { rows 20_000 dim 32 optimizer adagrad { lr 0.05 } hotness 30 access zipf(1.2) }
table tag { rows 5000 dim 16 optimizer adam { lr 0.001 } hotness 3 weighted }
table history {
  rows 10_000
  dim 24
  optimizer rowwise_adagrad { lr 0.05 }
  hotness mean 8 max 20
  access zipf(1.05, sorted)
}

model {
  batch 256
  dense_features 13
  bottom_mlp [32, 16]
  interaction dot
  top_mlp [32, 1]
}

plan {
  solver greedy
  seed 0
%s}
"""


def _spec(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / f"{name}.embark"
    p.write_text(text)
    return str(p)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, str, diff.Side]:
    tmp = tmp_path_factory.mktemp("specs")
    path = _spec(tmp, "base", BASE % "")
    return tmp, path, diff.load_side(path)


def _diff_to(base, name: str, text: str) -> tuple[compare.PlanDiff, str]:
    tmp, path, side = base
    other = _spec(tmp, name, text)
    return diff.diff_sides(side, diff.load_side(other)), other


def _spec_change(d: compare.PlanDiff, what: str, name: str) -> compare.SpecChange:
    found = [c for c in d.spec_changes if c.what == what and c.name == name]
    assert found, f"no {what} change of {name} in {d.spec_changes}"
    return found[0]


def test_spec_with_itself_is_no_changes(base, capsys):
    _, path, side = base
    d = diff.diff_sides(side, side)
    assert d.identical and d.verdict == "no changes" and d.spec_changes == ()
    assert main(["diff", path, path, "--format", "md", "--fail-if-slower", "0"]) == 0
    assert capsys.readouterr().out.startswith("no changes")


def test_a_table_grows(base):
    d, _ = _diff_to(base, "grow", BASE.replace("rows 20_000", "rows 30_000") % "")
    assert _spec_change(d, "table", "item").fields == {"rows": ("20000", "30000")}
    item = next(t for t in d.tables_delta if t.table == "item")
    assert item.change == "resized" and item.fields["rows"] == ("20000", "30000")
    assert item.memory.b is not None and item.memory.a is not None and item.memory.b > item.memory.a
    assert d.spec_changes_from == "specs" and len(d.spec_changes) == 1
    assert d.summary.peak_memory.b is not None and d.summary.peak_memory.a is not None
    assert d.summary.peak_memory.b > d.summary.peak_memory.a
    assert d.summary.cost_source_a == d.summary.cost_source_b == "plan"


def test_a_hotness_changes(base):
    d, _ = _diff_to(base, "hot", BASE.replace("hotness 30", "hotness 10") % "")
    hot = [c for c in d.spec_changes if c.what == "feature"]
    assert len(hot) == 1 and hot[0].fields["hotness"] == ("30", "10")
    assert not d.tables_delta  # the table itself is the same
    assert d.summary.step_time.delta is not None and d.summary.step_time.delta < 0
    assert d.verdict.startswith("**faster by ")


def test_nodes_doubled(base, capsys):
    d, other = _diff_to(base, "nodes", BASE.replace("nodes 2", "nodes 4") % "")
    assert _spec_change(d, "topology", "topology").fields["nodes"] == ("2", "4")
    assert (d.world_a, d.world_b) == (4, 8)
    new = [r for r in d.ranks_changed if r.rank >= 4]
    assert len(new) == 4 and all(r.time.a is None and not r.worse for r in new)
    # a rank only B has is counted apart, not as worse
    assert d.ranks_worse == sum(1 for r in d.ranks_changed if r.rank < 4 and r.worse)
    assert "4 only in B" in render.ranks_title(d)
    # every table exists in A: a new rank that holds anything receives it from A's ranks
    received = {r.rank: r.received for r in d.migration.by_rank}
    holding = [r.rank for r in new if r.memory.b]
    assert holding and all(received.get(rank, 0) > 0 for rank in holding)
    assert "- topology changed: nodes 2 -> 4" in render.render_markdown(d)
    assert main(["diff", base[1], other, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_b"] == 8 and data["spec_changes"][0]["what"] == "topology"


def test_a_constraint_added(base):
    a = base[2]
    kind = a.plan.cluster_of("country").kind
    want = "ub" if kind != "ub" else "rb"
    d, _ = _diff_to(base, "constraint", BASE % f"  table country {{ cluster {want} }}\n")
    c = _spec_change(d, "constraint", "country")
    assert c.change == "added" and c.fields["cluster"] == ("-", want)
    moved = [t for t in d.tables_changed if t.table == "country"]
    assert moved and moved[0].kind_b == want and "cluster" in moved[0].changed


def test_plan_file_against_spec_recosts_the_outside_plan(base, tmp_path):
    """A plan without our estimate fields, diffed against its spec, is re-costed."""
    from embark_runtime.plan import Estimate, RankEstimate, dumps_plan

    _, path, side = base
    plan = side.plan
    bare = plan.model_copy(
        update={
            "estimate": Estimate(
                step_time=plan.estimate.step_time,
                per_rank=[
                    RankEstimate(rank=r.rank, memory_bytes=r.memory_bytes, time=r.time)
                    for r in plan.estimate.per_rank
                ],
            )
        }
    )
    f = tmp_path / "outside.json"
    f.write_text(dumps_plan(bare))
    d = diff.diff_sides(diff.load_side(str(f)), side)
    assert d.summary.cost_source_a == "cost model"
    assert d.summary.step_time.pct is not None and abs(d.summary.step_time.pct) < 1e-3
    assert set(d.summary.components) == set(views.COMPONENTS)


def test_report_of_a_spec_shows_work(base, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", base[1], "-o", str(out)]) == 0
    html = out.read_text()
    assert "share of each table&#39;s work" in html and "country" in html


def test_a_spec_with_errors_is_a_user_error(base, tmp_path, capsys):
    bad = _spec(tmp_path, "bad", BASE.replace("hotness 30", "hotnes 30") % "")
    assert main(["diff", base[1], bad]) == 2
    err = capsys.readouterr().err
    assert "bad.embark:" in err and "hotnes" in err and "Traceback" not in err


def _edited(plan_path: Path, out: Path) -> None:
    """A hand edit of a plan file: one cell moves to the next rank, the estimate stays."""
    data = json.loads(plan_path.read_text())
    cell = data["shards"][0]
    cell["rank"] = (cell["rank"] + 1) % data["topology"]["gpus_per_node"]
    out.write_text(json.dumps(data, indent=2))


def test_a_hand_edited_plan_is_recosted_from_its_spec_or_marked_stale(tmp_path, capsys):
    from embark_runtime.plan import load_plan
    from embarkc.frontend import load_program
    from embarkc.planner import estimate_is_stale
    from embarkc.planner.cost import CostModel

    spec = _spec(tmp_path, "s", BASE % "")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", spec, "-o", str(a)]) == 0
    _edited(a, b)
    assert estimate_is_stale(load_plan(a)) is False
    assert estimate_is_stale(load_plan(b)) is True
    truth = CostModel(load_program(spec)).evaluate(load_plan(b))["step_time"]
    assert abs(truth - load_plan(b).estimate.step_time) > 1e-9  # the edit matters

    # the spec the plan names is there, unchanged: B is re-costed, not trusted
    d = diff.diff_sides(diff.load_side(str(a)), diff.load_side(str(b)))
    assert (d.summary.cost_source_a, d.summary.cost_source_b) == ("plan", "cost model")
    assert d.summary.step_time.b == pytest.approx(truth)

    # the spec changed since: B's figures are marked stale, the verdict says it, and a
    # gate on the step time refuses to judge (exit 1) instead of passing by accident
    Path(spec).write_text((BASE % "").replace("seed 0", "seed 1"))
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "--format", "md", "--fail-if-slower", "50"]) == 1
    captured = capsys.readouterr()
    assert "**step time not known**: plan B has a stale estimate" in captured.out
    assert "_Plan B was edited after embarkc costed it" in captured.out
    assert "--fail-if-slower cannot judge it" in captured.err
    d = diff.diff_sides(diff.load_side(str(a)), diff.load_side(str(b)))
    assert d.summary.cost_source_b == "stale"
    assert d.summary.peak_memory.b == max(load_plan(b).memory_by_rank())
    # the memory gate still judges: memory is exact from the cells
    assert main(["diff", str(a), str(b), "--fail-if-memory-over", "50"]) == 0

    page = tmp_path / "r.html"
    assert main(["report", str(b), "-o", str(page)]) == 0
    assert "STALE" in page.read_text()
    assert main(["simulate", str(b), "--batches", "1"]) == 0
    assert "edited after embarkc costed it" in capsys.readouterr().err


def test_a_hand_edited_plan_finds_its_spec_beside_it(tmp_path, monkeypatch):
    """A plan made with a relative spec name is re-costed when the diff runs elsewhere and
    the spec is in the plan's folder (as `embarkc check` finds it)."""
    from embark_runtime.plan import load_plan
    from embarkc.frontend import find_plan_spec, load_program
    from embarkc.planner.cost import CostModel

    work = tmp_path / "work"
    work.mkdir()
    _spec(work, "s", BASE % "")
    monkeypatch.chdir(work)
    assert main(["plan", "s.embark", "-o", "a.json"]) == 0
    _edited(work / "a.json", work / "b.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    b = load_plan(work / "b.json")
    assert b.source.spec == "s.embark"
    assert find_plan_spec(b) == (Path("s.embark"), "missing")
    assert find_plan_spec(b, work / "b.json") == (work / "s.embark", "unchanged")
    truth = CostModel(load_program(str(work / "s.embark"))).evaluate(b)["step_time"]
    d = diff.diff_sides(diff.load_side(str(work / "a.json")), diff.load_side(str(work / "b.json")))
    assert d.summary.cost_source_b == "cost model"
    assert d.summary.step_time.b == pytest.approx(truth)
    # an edited spec beside the plan is "changed", and the diff marks B stale
    (work / "s.embark").write_text((BASE % "").replace("seed 0", "seed 1"))
    assert find_plan_spec(b, work / "b.json") == (work / "s.embark", "changed")
    d = diff.diff_sides(diff.load_side(str(work / "a.json")), diff.load_side(str(work / "b.json")))
    assert d.summary.cost_source_b == "stale"
