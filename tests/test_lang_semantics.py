"""What the language means: units, groups, defaults, features, access, constraints, includes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embarkc.cli import main
from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program, load_program_text
from embarkc.units import UnitError, quantity

HW = "hardware { preset dgx_h100 nodes 2 }\n"
M = "model { batch 64 }\n"


def lower(body: str, hw: str = HW, model: str = M):
    return load_program_text(hw + body + model)


@pytest.mark.parametrize(
    ("number", "unit", "kind", "integer", "value"),
    [
        ("80", "GiB", "bytes", True, 80 * 2**30),
        ("141", "GB", "bytes", True, 141 * 10**9),
        ("64", "MiB", "bytes", True, 64 * 2**20),
        ("3.35", "TB/s", "bandwidth", False, 3.35e12),
        ("400", "Gb/s", "bandwidth", False, 5e10),
        ("450", "GB/s", "bandwidth", False, 4.5e11),
        ("40M", None, "count", True, 40_000_000),
        ("40_000_000", None, "count", True, 40_000_000),
        ("2B", None, "count", True, 2 * 10**9),
        ("1.5K", None, "count", True, 1500),
        ("1e15", None, "count", True, 10**15),
        ("2", "min", "time", False, 120.0),
        ("30", None, "time", False, 30.0),
        ("500", "ms", "time", False, 0.5),
        ("67", "TFLOP/s", "compute", False, 6.7e13),
        ("19.5", "TFLOP/s", "compute", False, 1.95e13),
        ("2", "GFLOP/s", "compute", False, 2e9),
        ("1", "FLOP/s", "compute", False, 1.0),
    ],
)
def test_units_normalise(number, unit, kind, integer, value) -> None:
    assert quantity(number, unit, kind, integer=integer) == value


@pytest.mark.parametrize(
    ("number", "unit", "kind"),
    [
        ("80", None, "bytes"),
        ("1", "GiB", "count"),
        ("1", "GB", "bandwidth"),
        ("1.5", "B", "bytes"),
        ("67", None, "compute"),
        ("67", "TB/s", "compute"),
        ("67", "TFLOP/s", "bandwidth"),
    ],
)
def test_units_reject(number, unit, kind) -> None:
    with pytest.raises(UnitError):
        quantity(number, unit, kind, integer=True)


def test_dense_flops_comes_from_the_preset_and_may_be_overridden_or_turned_off() -> None:
    body = "table a { rows 1000 dim 16 hotness 1 }\n"
    assert lower(body).topology.dense_flops == 67e12
    a100 = "hardware { preset dgx_a100_80gb }\n"
    assert lower(body, hw=a100).topology.dense_flops == 19.5e12
    tf32 = "hardware { preset dgx_h100 dense_flops 495 TFLOP/s }\n"
    assert lower(body, hw=tf32).topology.dense_flops == 495e12
    off = "hardware { preset dgx_h100 dense_flops 0 }\n"
    assert lower(body, hw=off).topology.dense_flops == 0.0
    bare = (
        "hardware { gpus_per_node 2 hbm 1 GiB hbm_bandwidth 1 TB/s nvlink 100 GB/s "
        "network 10 GB/s }\n"
    )
    assert lower(body, hw=bare).topology.dense_flops == 0.0  # unknown: nothing hides


def test_attached_units_and_suffixes_lex_apart() -> None:
    p = lower(
        "table a { rows 4M dim 16 hotness 1 }\n", hw="hardware { preset dgx_h100 hbm 40GiB }\n"
    )
    assert p.topology.hbm_bytes == 40 * 2**30 and p.tables[0].rows == 4_000_000


def test_group_declares_tables_and_features_with_inclusive_range() -> None:
    p = lower("tables t[3..5] { rows 10 dim 8 hotness 2 }\n")
    assert [t.name for t in p.tables] == ["t3", "t4", "t5"]
    assert [(f.name, f.table, f.hotness) for f in p.features] == [
        ("t3", "t3", 2),
        ("t4", "t4", 2),
        ("t5", "t5", 2),
    ]


def test_block_fields_override_defaults_which_override_ir_defaults() -> None:
    p = lower(
        "defaults { dim 32 dtype fp16 optimizer adagrad { lr 0.1 } pooling mean access zipf(1.2) }\n"
        "table a { rows 10 hotness 1 }\n"
        "table b { rows 10 dim 8 dtype bf16 optimizer sgd hotness 1 pooling sum access uniform }\n"
    )
    a, b = p.tables
    assert (a.dim, a.dtype, a.optimizer.kind, a.optimizer.lr) == (32, "fp16", "adagrad", 0.1)
    assert (b.dim, b.dtype, b.optimizer.kind, b.optimizer.lr) == (8, "bf16", "sgd", 0.01)
    fa, fb = p.features
    assert (fa.pooling, fa.access.kind, fa.access.alpha, fa.access.permuted) == (
        "mean",
        "zipf",
        1.2,
        True,
    )
    assert (fb.pooling, fb.access.kind) == ("sum", "uniform")
    assert a.init.kind == "uniform" and a.init.high == 0.05


def test_weighted_false_undoes_a_weighted_default() -> None:
    p = lower(
        "defaults { dim 8 hotness 2 weighted }\n"
        "table a { rows 100 }\n"
        "table b { rows 100 weighted false }\n"
        "table c { rows 100 weighted true }\n"
        "feature f { table a weighted false }\n"
    )
    weighted = {f.name: f.weighted for f in p.features}
    assert weighted == {"b": False, "c": True, "f": False}
    with pytest.raises(
        EmbarkError, match="unexpected `maybe`; expected one of .*`true` or `false`"
    ):
        lower("table x { rows 10 dim 4 hotness 1 weighted maybe }\n")


def test_explicit_features_replace_the_tables_own_feature() -> None:
    p = lower(
        "table items { rows 100 dim 8 }\n"
        "table other { rows 100 dim 8 hotness 1 }\n"
        "feature viewed { table items hotness mean 5 max 20 weighted }\n"
        "feature bought { table items hotness 2 pooling concat access zipf(1.1, sorted) }\n"
    )
    assert [f.name for f in p.features] == ["other", "viewed", "bought"]
    viewed, bought = p.feature_by_name["viewed"], p.feature_by_name["bought"]
    assert (viewed.hotness, viewed.max_hotness, viewed.fixed, viewed.weighted) == (
        5,
        20,
        False,
        True,
    )
    assert (bought.hotness, bought.max_hotness, bought.fixed, bought.pooling) == (
        2,
        2,
        True,
        "concat",
    )
    assert bought.access.permuted is False
    assert [f.name for f in p.features_of["items"]] == ["viewed", "bought"]


def test_histogram_access_reads_key_count_lines(tmp_path: Path) -> None:
    (tmp_path / "h.txt").write_text("# measured\n3 100\n\n0 7  # rare\n")
    spec = tmp_path / "s.embark"
    spec.write_text(HW + 'table a { rows 10 dim 8 hotness 1 access histogram "h.txt" }\n' + M)
    f = load_program(spec).features[0]
    assert (f.access.kind, f.access.keys, f.access.counts, f.access.path) == (
        "histogram",
        (3, 0),
        (100, 7),
        "h.txt",
    )


def test_optimizers_and_dense_model_lower_with_their_parameters() -> None:
    p = lower(
        "table a { rows 10 dim 8 hotness 1 optimizer adam { lr 0.001 beta1 0.8 beta2 0.99 eps 1e-6 } }\n"
        "table b { rows 10 dim 8 hotness 1 optimizer rowwise_adagrad { initial_accumulator 0.1 } }\n",
        model="model { batch 64 dense_features 13 bottom_mlp [64, 8] interaction dcnv2 "
        "{ layers 2 low_rank 32 } top_mlp [16, 1] optimizer adam { lr 0.002 } }\n",
    )
    a, b = p.tables
    assert (a.optimizer.beta1, a.optimizer.beta2, a.optimizer.eps) == (0.8, 0.99, 1e-6)
    assert b.optimizer.initial_accumulator == 0.1 and b.row_state_bytes == 4
    m = p.model
    assert (m.dense_features, m.bottom_mlp, m.top_mlp) == (13, (64, 8), (16, 1))
    assert (m.interaction.kind, m.interaction.layers, m.interaction.low_rank) == ("dcnv2", 2, 32)
    assert (m.optimizer.kind, m.optimizer.lr) == ("adam", 0.002)


def test_plan_options_and_constraints() -> None:
    p = lower(
        "tables t[0..3] { rows 1M dim 64 hotness 1 }\n",
        model=M + "plan {\n  objective memory\n  strategy table-row-wise\n  solver greedy\n"
        "  time_limit 2 min\n  seed 7\n  row_partition range\n  communication flat\n"
        "  memory_headroom 2 GiB\n"
        "  table t[0..1] { cluster rb row_shards 2..4 column_shards ..2 within_node }\n"
        "  table t2 { cluster dp }\n  table t3 { no_column_split row_shards 2.. }\n"
        "  colocate t0, t1\n}\n",
    )
    o = p.options
    assert (o.objective, o.strategy, o.solver, o.time_limit, o.seed) == (
        "memory",
        "table-row-wise",
        "greedy",
        120.0,
        7,
    )
    assert (o.row_partition, o.communication, o.memory_headroom) == ("range", "flat", 2 * 2**30)
    c0 = p.constraint_of["t0"]
    assert (c0.cluster, c0.min_row_shards, c0.max_row_shards) == ("rb", 2, 4)
    assert (c0.min_column_shards, c0.max_column_shards, c0.within_node) == (1, 2, True)
    assert p.constraint_of["t1"].cluster == "rb" and p.constraint_of["t2"].cluster == "dp"
    c3 = p.constraint_of["t3"]
    assert (c3.max_column_shards, c3.min_row_shards, c3.max_row_shards) == (1, 2, None)
    assert [c.tables for c in p.colocate] == [("t0", "t1")]


def test_includes_resolve_relative_to_the_including_file_and_once(tmp_path: Path) -> None:
    (tmp_path / "hw").mkdir()
    (tmp_path / "hw" / "cluster.embark").write_text(
        'include "dims.embark"\nhardware { preset dgx_a100_80gb nodes 4 }\n'
    )
    (tmp_path / "hw" / "dims.embark").write_text("defaults { dim 16 }\n")
    spec = tmp_path / "s.embark"
    spec.write_text(
        'include "hw/cluster.embark"\ninclude "hw/dims.embark"\ntable a { rows 10 hotness 1 }\n' + M
    )
    p = load_program(spec)
    assert p.topology.world_size == 32 and p.topology.arch == "sm_80"
    assert p.tables[0].dim == 16
    assert [Path(s.path).name for s in p.sources] == ["s.embark", "cluster.embark", "dims.embark"]
    assert all(len(s.sha256) == 64 for s in p.sources)


def test_spans_point_at_the_source() -> None:
    p = lower("table a {\n  rows 10 dim 8 hotness 1\n}\n")
    t = p.tables[0]
    assert t.span is not None and (t.span.line, t.span.col) == (2, 7)
    assert p.topology.span is not None and p.topology.span.line == 1


def test_all_errors_are_collected() -> None:
    with pytest.raises(EmbarkError) as info:
        lower("table a { rows 0 dim 3 hotness 1 dtype fp8 }\ntable b { rows 1 dim 0 hotness 0 }\n")
    messages = [d.message for d in info.value.diagnostics]
    assert messages == [
        "rows must be positive, got 0",
        "unknown dtype `fp8`",
        "dim must be positive, got 0",
        "hotness must be positive, got 0",
    ]


def test_ten_to_the_fourteen_rows_is_valid_but_does_not_fit() -> None:
    with pytest.raises(EmbarkError) as info:
        lower("table a { rows 1e13 dim 128 hotness 1 }\n")
    (d,) = info.value.diagnostics
    assert "short by" in d.message and d.hint and "nodes" in d.hint
    # more nodes than a spec may have: the hint does not suggest them
    with pytest.raises(EmbarkError) as info:
        lower("table a { rows 1e14 dim 128 hotness 1 }\n")
    (d,) = info.value.diagnostics
    assert "short by" in d.message and d.hint and "is its `rows` a typo?" in d.hint
    with pytest.raises(EmbarkError) as info:
        lower("table a { rows 1e15 dim 128 hotness 1 }\n")
    (d,) = info.value.diagnostics
    assert d.message.startswith("rows must be at most 281,474,976,710,656 (2^48)")


def test_check_dump_ir_is_the_program_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    assert main(["check", "--dump", "ir", str(root / "specs" / "tiny.embark")]) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert dumped["name"] == "tiny" and len(dumped["tables"]) == 6


def test_check_dump_ast_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    assert main(["check", "--dump", "ast", str(root / "specs" / "tiny.embark")]) == 0
    assert "hotness_variable" in capsys.readouterr().out
    assert main(["check", str(root / "specs" / "paper" / "t510.embark")]) == 0
    out = capsys.readouterr().out
    assert "510 (sgd 510)" in out and "114,572,800,000" in out and "2670" in out


def test_hierarchical_on_one_node_is_a_warning_at_its_word(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = "table a { rows 1000 dim 16 hotness 1 }\nplan { communication hierarchical }\n"
    one = "hardware { preset dgx_h100 nodes 1 }\n"
    warnings: list = []
    program = load_program_text(one + body + M, "<spec>", warnings)
    assert program.options.communication == "hierarchical"  # the plan keeps the word
    (w,) = warnings
    assert w.severity == "warning" and "does nothing on a cluster of one node" in w.message
    assert (w.span.line, w.span.col) == (3, 22) and w.hint and "nodes" in w.hint
    # on two nodes it means something; a spec that does not lower still shows it
    quiet: list = []
    load_program_text(HW + body + M, "<spec>", quiet)
    assert quiet == []
    with pytest.raises(EmbarkError) as info:
        load_program_text(one + body.replace("1000", "-1") + M, "<spec>", warnings)
    assert [d.severity for d in info.value.diagnostics] == ["error", "warning"]
    assert "2 errors" not in info.value.render()  # a warning is not counted as one
    # every command that reads the spec prints it on stderr, and still succeeds
    spec = tmp_path / "one.embark"
    spec.write_text(one + body + M)
    capsys.readouterr()
    for argv in (
        ["check", str(spec)],
        ["plan", str(spec), "--solver", "greedy", "-o", str(tmp_path / "p.json")],
        ["simulate", str(spec), "--solver", "greedy", "--batches", "1"],
        ["compile", str(spec), "--solver", "greedy", "--dump", "plan"],
        ["diff", str(spec), str(tmp_path / "p.json")],
    ):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert f"{spec}:3:22: warning: `communication hierarchical` does nothing" in err, argv
        assert "  3 | plan { communication hierarchical }" in err
