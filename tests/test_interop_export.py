"""export_plan: embarkc plans as TorchRec ParameterSharding records and HugeCTR's shard
matrix; what neither can run is refused naming each table; `plan --target` plans only
what they run, and the plan says what that costs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from embark_runtime.plan import plan_to_dict
from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program_text
from embarkc.interop.plan_export import export_plan
from embarkc.planner.baselines import build_baseline

HARDWARE = """
hardware { nodes 2 gpus_per_node 2 hbm 64 MiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
           network 10 Gb/s arch sm_80 }
model { batch 64 }
"""


def spec(partition: str = "range", extra: str = "") -> str:
    return (
        HARDWARE
        + f"""
table a {{ rows 1001 dim 16 hotness 2 }}
table b {{ rows 400 dim 8 hotness 1 pooling mean }}
table c {{ rows 50 dim 8 hotness 3 }}
plan {{ solver greedy row_partition {partition} {extra} }}
"""
    )


def baseline(name: str, partition: str = "range") -> dict:
    return plan_to_dict(build_baseline(load_program_text(spec(partition)), name))


def test_row_wise_shards_are_range_blocks_on_rank_j():
    doc, warnings = export_plan(baseline("row-wise"), "torchrec")
    rec = doc["plan"]["a"]
    assert rec["sharding_type"] == "row_wise"
    assert rec["compute_kernel"] == "fused"
    assert rec["ranks"] == [0, 1, 2, 3]
    # TorchRec's blocks: ceil(1001 / 4) = 251 rows, the last one the rest
    assert [s["shard_offsets"] for s in rec["shards"]] == [[0, 0], [251, 0], [502, 0], [753, 0]]
    assert [s["shard_sizes"] for s in rec["shards"]] == [[251, 16]] * 3 + [[248, 16]]
    assert doc["world_size"] == 4 and doc["local_world_size"] == 2
    assert warnings == []


def test_table_row_wise_keeps_each_table_on_one_node():
    doc, _ = export_plan(baseline("table-row-wise"), "torchrec")
    for name, rec in doc["plan"].items():
        assert rec["sharding_type"] == "table_row_wise", name
        nodes = {r // 2 for r in rec["ranks"]}
        assert len(nodes) == 1
        assert [r % 2 for r in rec["ranks"]] == [0, 1]


def test_data_parallel_and_table_wise():
    doc, _ = export_plan(baseline("data-parallel"), "torchrec")
    assert doc["plan"]["a"] == {
        "sharding_type": "data_parallel",
        "compute_kernel": "dense",
        "ranks": [0, 1, 2, 3],
        "shards": None,
    }
    doc, _ = export_plan(baseline("table-wise"), "torchrec")
    rec = doc["plan"]["b"]
    assert rec["sharding_type"] == "table_wise"
    assert rec["shards"] == [
        {"shard_offsets": [0, 0], "shard_sizes": [400, 8], "rank": rec["ranks"][0]}
    ]


def test_table_configs_carry_rows_dim_features_pooling():
    doc, _ = export_plan(baseline("table-wise"), "torchrec")
    by = {t["name"]: t for t in doc["tables"]}
    assert by["a"]["num_embeddings"] == 1001 and by["a"]["embedding_dim"] == 16
    assert by["b"]["pooling"] == "MEAN" and by["a"]["pooling"] == "SUM"
    assert by["a"]["feature_names"] == ["a"] and by["a"]["data_type"] == "FP32"
    assert by["a"]["weight_init_min"] == -0.05


def _cells(plan: dict, table: str, cells: list[tuple[int, int, tuple[int, int], int]]) -> dict:
    plan = copy.deepcopy(plan)
    plan["shards"] = [s for s in plan["shards"] if s["table"] != table] + [
        {"table": table, "row_shard": j, "row_shards": r, "columns": list(c), "rank": k}
        for j, r, c, k in cells
    ]
    return plan


def test_column_cuts_are_column_wise_or_within_a_node_table_column_wise():
    base = baseline("table-wise")
    plan = _cells(base, "a", [(0, 1, (0, 8), 0), (0, 1, (8, 16), 3)])
    rec = export_plan(plan, "torchrec")[0]["plan"]["a"]
    assert rec["sharding_type"] == "column_wise"
    assert [s["shard_offsets"] for s in rec["shards"]] == [[0, 0], [0, 8]]
    assert rec["ranks"] == [0, 3]
    plan = _cells(base, "a", [(0, 1, (0, 8), 2), (0, 1, (8, 16), 3)])
    assert export_plan(plan, "torchrec")[0]["plan"]["a"]["sharding_type"] == "table_column_wise"


def test_grid_shard_each_column_block_row_sharded_on_one_node():
    plan = _cells(
        baseline("table-wise"),
        "a",
        [(0, 2, (0, 8), 0), (1, 2, (0, 8), 1), (0, 2, (8, 16), 2), (1, 2, (8, 16), 3)],
    )
    rec = export_plan(plan, "torchrec")[0]["plan"]["a"]
    assert rec["sharding_type"] == "grid_shard"
    assert rec["ranks"] == [0, 1, 2, 3]
    assert [s["shard_offsets"] for s in rec["shards"]] == [[0, 0], [501, 0], [0, 8], [501, 8]]


def test_a_permutation_of_row_blocks_is_renumbered_with_a_warning():
    plan = _cells(
        baseline("table-wise"),
        "a",
        [(0, 4, (0, 16), 2), (1, 4, (0, 16), 0), (2, 4, (0, 16), 3), (3, 4, (0, 16), 1)],
    )
    doc, warnings = export_plan(plan, "torchrec")
    assert doc["plan"]["a"]["ranks"] == [0, 1, 2, 3]
    assert any("table `a`" in w and "renumbered" in w for w in warnings)


def test_refusals_name_each_table():
    base = baseline("table-wise")
    plan = _cells(base, "a", [(0, 3, (0, 16), 0), (1, 3, (0, 16), 1), (2, 3, (0, 16), 2)])
    plan = _cells(
        plan, "b", [(0, 4, (0, 8), 0), (1, 4, (0, 8), 0), (2, 4, (0, 8), 1), (3, 4, (0, 8), 2)]
    )
    with pytest.raises(EmbarkError) as e:
        export_plan(plan, "torchrec")
    text = str(e.value)
    assert "table `a`: 3 row shards" in text and "table `b`" in text
    assert "--target torchrec" in text


def test_mod_partition_row_shards_refused_for_torchrec_exported_for_hugectr():
    plan = baseline("row-wise", partition="mod")
    with pytest.raises(EmbarkError, match=r"table `a`: 4 row shards in the `mod` partition"):
        export_plan(plan, "torchrec")
    doc, _ = export_plan(plan, "hugectr")
    assert doc["shard_matrix"] == [["a", "b", "c"]] * 4
    assert doc["shard_strategy"] == [["mp", ["a", "b", "c"]]]
    assert doc["comm_strategy"] == "Uniform"


def test_hugectr_dp_tables_on_every_gpu_and_table_wise_on_one():
    doc, _ = export_plan(baseline("data-parallel", "mod"), "hugectr")
    assert doc["shard_strategy"] == [["dp", ["a", "b", "c"]]]
    doc, _ = export_plan(baseline("table-wise", "mod"), "hugectr")
    held = [t for gpu in doc["shard_matrix"] for t in gpu]
    assert sorted(held) == ["a", "b", "c"]
    by = {t["table_name"]: t for t in doc["tables"]}
    assert by["b"]["ev_size"] == 8 and by["b"]["combiner"] == "mean"
    assert by["a"]["max_vocabulary_size"] == 1001


def test_hugectr_refuses_column_cuts():
    plan = _cells(baseline("table-wise", "mod"), "a", [(0, 1, (0, 8), 0), (0, 1, (8, 16), 1)])
    with pytest.raises(EmbarkError, match=r"table `a`: 2 column shards"):
        export_plan(plan, "hugectr")


def test_ub_is_mapped_with_a_warning():
    plan = baseline("table-wise")
    plan = copy.deepcopy(plan)
    for c in plan["clusters"]:
        c["kind"] = "ub"
        c.pop("gradient_exchange", None)
    doc, warnings = export_plan(plan, "torchrec")
    assert {r["sharding_type"] for r in doc["plan"].values()} == {"table_wise"}
    assert sorted(w.split("`")[1] for w in warnings if "unique-based" in w) == ["a", "b", "c"]


def test_bad_input_is_an_embark_error():
    with pytest.raises(EmbarkError, match="unknown export format `tf`"):
        export_plan(baseline("table-wise"), "tf")
    with pytest.raises(EmbarkError, match="invalid plan"):
        export_plan({"format": "embark-plan"}, "torchrec")
    with pytest.raises(EmbarkError, match="JSON object"):
        export_plan([], "torchrec")  # type: ignore[arg-type]


def test_sharding_plan_helper_imports_without_torchrec():
    code = (
        "import sys; sys.modules['torchrec'] = None; "
        "import embarkc.interop.torchrec_plan as m; "
        "print(m.placement(3, 'cuda', 2), m.placement(1, 'cpu', 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["rank:3/cuda:1", "rank:1/cpu"]


# --------------------------------------------------------------------------- --target


def _embarkc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embarkc.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_plan_target_torchrec_exports_checks_and_says_its_cost(tmp_path):
    # item would go ub (hot, skewed); the target keeps TorchRec's types only
    (tmp_path / "s.embark").write_text(
        HARDWARE.replace("64 MiB", "4 MiB")
        + """
table item { rows 20_000 dim 32 hotness 30 access zipf(1.2) optimizer adagrad }
table user { rows 8000 dim 16 hotness 4 }
table small { rows 100 dim 16 hotness 4 }
plan { solver greedy row_partition range }
"""
    )
    r = _embarkc("plan", "s.embark", "--target", "torchrec", "-o", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "planned for torchrec:" in r.stdout and "the unrestricted plan's step time" in r.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    target = plan["planner"]["target"]
    assert target["system"] == "torchrec" and target["slowdown"] >= 1.0 - 1e-9
    assert {c["kind"] for c in plan["clusters"]} <= {"dp", "rb"}
    assert all(c.get("communication") in (None, "flat") for c in plan["clusters"])
    export_plan(plan, "torchrec")  # no refusal
    r = _embarkc("check", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(unchanged): checked against it" in r.stdout


def test_plan_target_hugectr_has_no_column_cuts(tmp_path):
    (tmp_path / "s.embark").write_text(spec("mod"))
    r = _embarkc("plan", "s.embark", "--target", "hugectr", "-o", "p.json", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert all(
        s["columns"] == [0, t["dim"]]
        for s in plan["shards"]
        for t in plan["tables"]
        if t["name"] == s["table"]
    )
    export_plan(plan, "hugectr")


def test_plan_without_target_writes_no_target_field(tmp_path):
    (tmp_path / "s.embark").write_text(spec())
    r = _embarkc("plan", "s.embark", "-o", "p.json", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "target" not in json.loads((tmp_path / "p.json").read_text())["planner"]


def test_target_torchrec_refuses_a_ub_pin_at_the_constraint(tmp_path):
    (tmp_path / "s.embark").write_text(spec(extra="table a { cluster ub }"))
    r = _embarkc("plan", "s.embark", "--target", "torchrec", cwd=tmp_path)
    assert r.returncode == 2
    assert "s.embark:" in r.stderr and "table `a` is constrained to ub" in r.stderr
    assert "Traceback" not in r.stderr


def test_target_that_cannot_fit_says_which_partition_would(tmp_path, root):
    # tiny under `range` does not fit without row shards, which HugeCTR cuts only by `mod`
    text = (
        (root / "specs" / "tiny.embark")
        .read_text()
        .replace("  seed 0", "  seed 0\n  row_partition range")
    )
    (tmp_path / "s.embark").write_text(text)
    r = _embarkc("plan", "s.embark", "--solver", "greedy", "--target", "hugectr", cwd=tmp_path)
    assert r.returncode == 2
    assert "--target hugectr: no plan within what hugectr runs fits" in r.stderr
    assert "row-shards tables only under `row_partition mod`" in r.stderr
    assert "Traceback" not in r.stderr


def test_target_torchrec_under_mod_refuses_a_row_shard_pin_and_says_range(tmp_path):
    (tmp_path / "s.embark").write_text(spec("mod", extra="table a { row_shards 2 }"))
    r = _embarkc("plan", "s.embark", "--target", "torchrec", cwd=tmp_path)
    assert r.returncode == 2
    assert "table `a` is constrained to at least 2 row shards" in r.stderr
    assert "set `row_partition range`" in r.stderr


def test_plan_json_refuses_explain(tmp_path):
    (tmp_path / "s.embark").write_text(spec())
    r = _embarkc("plan", "s.embark", "--format", "json", "--explain", "a", cwd=tmp_path)
    assert r.returncode == 2 and "--explain prints a table, not JSON" in r.stderr


def _parsed(plan: dict):
    from embark_runtime.plan import parse_plan

    return parse_plan(json.dumps(plan))


def test_torchrec_pins_move_each_table_to_the_nearest_layout_torchrec_runs():
    from embarkc.interop.targets import torchrec_pins

    base = baseline("table-wise")
    ub = copy.deepcopy(base)
    for c in ub["clusters"]:
        c["kind"] = "ub"
        c.pop("gradient_exchange", None)
    assert torchrec_pins(_parsed(ub)) == {t: {"cluster": "rb"} for t in ("a", "b", "c")}
    # 2 row shards over two nodes: table_row_wise needs them on one node
    spread = _cells(base, "a", [(0, 2, (0, 16), 0), (1, 2, (0, 16), 2)])
    assert torchrec_pins(_parsed(spread)) == {
        "a": {"min_row_shards": 2, "max_row_shards": 2, "within_node": True}
    }
    # 3 row shards: neither a node (2) nor the world (4)
    three = _cells(base, "a", [(0, 3, (0, 16), 0), (1, 3, (0, 16), 1), (2, 3, (0, 16), 2)])
    assert torchrec_pins(_parsed(three))["a"] == {
        "min_row_shards": 4,
        "max_row_shards": 4,
        "within_node": False,
    }
    # rows and columns cut across nodes: the columns go first
    grid = _cells(
        base,
        "a",
        [(0, 2, (0, 8), 0), (1, 2, (0, 8), 2), (0, 2, (8, 16), 1), (1, 2, (8, 16), 3)],
    )
    assert torchrec_pins(_parsed(grid)) == {"a": {"min_column_shards": 1, "max_column_shards": 1}}
    # a table already pinned that still fails (two row shards on one GPU) keeps rows whole
    packed = _cells(
        base, "a", [(0, 4, (0, 16), 0), (1, 4, (0, 16), 0), (2, 4, (0, 16), 1), (3, 4, (0, 16), 2)]
    )
    pinned = {"a": {"min_row_shards": 4, "max_row_shards": 4}}
    assert torchrec_pins(_parsed(packed), pinned)["a"] == {
        "min_row_shards": 1,
        "max_row_shards": 1,
        "within_node": False,
    }
    assert torchrec_pins(_parsed(base)) == {}


def test_the_export_command_writes_a_plan_in_torchrec_and_hugectr_terms(tmp_path, capsys):
    """`embarkc export PLAN --format F -o OUT` runs export_plan through the command: the
    file holds what the function returns, written whole; a plan it cannot express leaves
    no file and exits 2 naming the table."""
    from embarkc.cli import main

    for fmt, partition in (("torchrec", "range"), ("hugectr", "mod")):
        plan = tmp_path / f"plan-{partition}.json"
        plan.write_text(json.dumps(baseline("row-wise", partition=partition)))
        out = tmp_path / f"{fmt}.json"
        assert main(["export", str(plan), "--format", fmt, "-o", str(out)]) == 0
        want, _ = export_plan(json.loads(plan.read_text()), fmt)
        assert json.loads(out.read_text()) == json.loads(json.dumps(want))
    mod = tmp_path / "mod.json"
    mod.write_text(json.dumps(baseline("row-wise", partition="mod")))
    out = tmp_path / "refused.json"
    capsys.readouterr()
    assert main(["export", str(mod), "--format", "torchrec", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "`a`" in err or " a " in err or "'a'" in err, err
    assert not out.exists()
