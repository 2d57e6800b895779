"""The shipped specs: they check, and the paper specs match the workload files exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embarkc.frontend import load_program
from embarkc.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads"
PAPER = ("dcnv2", "t180", "t200", "t510")


def _workload(name: str) -> dict:
    path = WORKLOADS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not available")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", PAPER)
def test_paper_spec_matches_workload_summary(name: str) -> None:
    w = _workload(name)
    p = load_program(ROOT / "specs" / "paper" / f"{name}.embark")
    assert len(p.tables) == w["summary"]["tables"]
    assert p.parameters == w["summary"]["parameters"]
    assert p.lookups_per_sample == w["summary"]["lookups_per_sample"]


@pytest.mark.parametrize("name", PAPER)
def test_paper_spec_matches_workload_groups_and_model(name: str) -> None:
    w = _workload(name)
    p = load_program(ROOT / "specs" / "paper" / f"{name}.embark")
    expected = [
        (g["rows"], g["dim"], float(g["hotness"])) for g in w["groups"] for _ in range(g["tables"])
    ]
    got = [(t.rows, t.dim, p.features_of[t.name][0].hotness) for t in p.tables]
    assert got == expected
    for t in p.tables:
        assert t.optimizer.kind == w["optimizer"] and t.dtype == w["dtype"]
    for f in p.features:
        assert f.pooling == w["pooling"] and f.fixed
        assert (f.access.kind, f.access.alpha, f.access.permuted) == ("zipf", 1.1, True)
    m = p.model
    assert m.batch_size == w["batch_size"] == 65536
    assert m.dense_features == w["dense_features"]
    assert list(m.bottom_mlp) == w["bottom_mlp"] and list(m.top_mlp) == w["top_mlp"]
    assert m.interaction.kind == w["interaction"]["kind"]
    assert m.interaction.layers == w["interaction"]["layers"]
    assert m.interaction.low_rank == w["interaction"]["low_rank"]
    topo = p.topology
    assert (topo.nodes, topo.gpus_per_node, topo.preset) == (16, 8, "dgx_h100")
    assert topo.hbm_bytes == 80 * 2**30 and topo.inter_node_bandwidth == 5e10


def test_t510_stays_short() -> None:
    text = (ROOT / "specs" / "paper" / "t510.embark").read_text()
    assert len(text.splitlines()) < 40


def test_tiny_has_every_kind_of_table_and_feature() -> None:
    p = load_program(ROOT / "specs" / "tiny.embark")
    topo = p.topology
    assert (topo.nodes, topo.gpus_per_node) == (2, 2)
    assert p.batch_size == 256 and p.model.dense_features == 13
    assert p.model.interaction.kind == "dot"
    assert {t.optimizer.kind for t in p.tables} == {"sgd", "adagrad", "rowwise_adagrad", "adam"}
    assert all(100 <= t.rows <= 20_000 and t.dim % 4 == 0 and 8 <= t.dim <= 32 for t in p.tables)
    pools = {f.pooling for f in p.features}
    assert pools == {"sum", "mean", "concat"}
    assert any(f.weighted for f in p.features)
    assert any(not f.fixed for f in p.features)
    assert any(f.access.kind == "zipf" and not f.access.permuted for f in p.features)
    # Planning is not trivial: the largest table does not fit whole on one GPU...
    assert max(t.bytes for t in p.tables) > topo.hbm_bytes
    # ...but everything fits in the cluster.
    assert p.embedding_bytes < topo.hbm_bytes * topo.world_size


def test_criteo_kaggle_has_the_26_dlrm_cardinalities() -> None:
    p = load_program(ROOT / "specs" / "criteo_kaggle.embark")
    assert len(p.tables) == 26
    assert sum(t.rows for t in p.tables) == 33_762_577
    assert {t.dim for t in p.tables} == {16}
    assert p.lookups_per_sample == 26
    assert (p.topology.nodes, p.topology.gpus_per_node) == (1, 8)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_overridable(preset: str) -> None:
    from embarkc.frontend import load_program_text

    text = (
        f"hardware {{ preset {preset} nodes 3 hbm 40 GiB }}\n"
        "table a { rows 10 dim 4 hotness 1 }\nmodel { batch 24 }\n"
    )
    p = load_program_text(text)
    assert p.topology.nodes == 3 and p.topology.hbm_bytes == 40 * 2**30
    assert p.topology.hbm_bandwidth == PRESETS[preset]["hbm_bandwidth"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[1, 2]", "malformed workload: a workload is a JSON object"),
        ("{", "not valid JSON"),
        ('{"groups": [{"tables": "x"}], "batch_size": 8}', "malformed workload"),
        ('{"groups": 3, "batch_size": 8}', "malformed workload"),
        ('{"groups": [], "access": 1, "batch_size": 8}', "malformed workload"),
    ],
)
def test_a_malformed_workload_file_is_a_user_error(tmp_path, text: str, needle: str) -> None:
    from embarkc.diagnostics import EmbarkError
    from embarkc.workload import program_from_workload

    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(EmbarkError, match=needle):
        program_from_workload(path, 1)


def _without_spans(x):
    if hasattr(x, "model_dump"):
        x = x.model_dump()
    if isinstance(x, dict):
        return {k: _without_spans(v) for k, v in x.items() if k != "span"}
    if isinstance(x, list | tuple):
        return [_without_spans(v) for v in x]
    return x


def test_the_generated_spec_is_the_generated_program(tmp_path) -> None:
    """bench/plan_speed.py --command plans `generated_spec` with the plan command: it must
    be the program the greedy's scale benchmark plans (`generated_program`)."""
    from embarkc.workload import generated_program, generated_spec

    path = tmp_path / "g.embark"
    b = generated_program(60, 2, 4, seed=3)
    path.write_text(generated_spec(b))
    a = load_program(path)
    for part in ("tables", "topology", "model"):
        assert _without_spans(getattr(a, part)) == _without_spans(getattr(b, part))
    assert [{**_without_spans(f), "name": None} for f in a.features] == [
        {**_without_spans(f), "name": None} for f in b.features
    ]
    assert len({t.rows for t in a.tables}) > 50  # drawn, not one table repeated
