"""embarkc import torchrec|hugectr: the written spec is formatted, checks, plans and marks
every assumed value; bad input is a clear error with exit 2. Also `schema plan` and the
`--format json` summaries of check, plan and simulate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embarkc.cli import main
from embarkc.format import format_text
from embarkc.frontend import load_program

TORCHREC = [
    {
        "name": "t_user",
        "num_embeddings": 1_000_000,
        "embedding_dim": 64,
        "feature_names": ["user_id"],
        "pooling": "SUM",
        "data_type": "FP32",
    },
    {
        "name": "item",
        "num_embeddings": 500_000,
        "embedding_dim": 128,
        "feature_names": ["item"],
        "pooling": "PoolingType.MEAN",
        "data_type": "FP16",
        "weight_init_min": -0.01,
        "weight_init_max": 0.01,
    },
    {"name": "cat-x", "num_embeddings": 100, "embedding_dim": 16, "feature_names": ["c1", "c2"]},
]

HUGECTR = {
    "solver": {"gpu": [[0, 1, 2, 3]], "batchsize": 2048},
    "optimizer": {"type": "Adam", "adam_hparam": {"learning_rate": 0.001, "beta1": 0.9}},
    "layers": [
        {
            "name": "data",
            "type": "Data",
            "dense": {"top": "dense", "dense_dim": 13},
            "sparse": [
                {
                    "top": "data1",
                    "type": "DistributedSlot",
                    "max_feature_num_per_sample": 3,
                    "slot_num": 3,
                }
            ],
        },
        {
            "name": "sparse_embedding1",
            "type": "LocalizedSlotSparseEmbeddingHash",
            "bottom": "data1",
            "top": "sparse_embedding1",
            "sparse_embedding_hparam": {
                "embedding_vec_size": 16,
                "combiner": 1,
                "slot_size_array": [1000, 20000, 300],
            },
        },
    ],
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_torchrec_import_writes_a_formatted_spec_that_checks(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tr.json").write_text(json.dumps(TORCHREC))
    code, _, err = run(capsys, "import", "torchrec", "tr.json", "-o", "m.embark")
    assert code == 0, err
    text = Path("m.embark").read_text()
    assert format_text(text, "m.embark") == text
    program = load_program("m.embark")
    by = program.table_by_name
    assert by["t_user"].rows == 1_000_000 and by["t_user"].dim == 64
    assert by["item"].dtype == "fp16" and by["item"].init.low == -0.01
    assert by["cat_x"].rows == 100  # `cat-x` is no identifier: renamed, and said so
    assert "# cat_x: `cat-x` in the source" in text
    feats = program.feature_by_name
    assert feats["user_id"].table == "t_user" and feats["item"].pooling == "mean"
    assert feats["c1"].table == feats["c2"].table == "cat_x"
    # every value TorchRec's configs do not give is marked on its own line
    for assumed in (
        "preset dgx_h100",
        "nodes 1",
        "optimizer sgd",
        "access zipf",
        "hotness 1",
        "batch 8192",
    ):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(assumed))
        assert "# ASSUMED:" in line, line
    assert "6 assumed values" in err
    code, _, err = run(capsys, "plan", "m.embark", "--solver", "greedy", "--time-limit", "5", "-q")
    assert code == 0, err


def test_torchrec_import_sizes_nodes_to_hold_the_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    big = [{"name": "huge", "num_embeddings": 4_000_000_000, "embedding_dim": 128}]
    Path("big.json").write_text(json.dumps(big))
    code, out, err = run(capsys, "import", "torchrec", "big.json")
    assert code == 0, err
    # 2 TB of fp32 weights over 8 x 80 GiB GPUs with room to plan: 5 nodes
    assert "nodes 5  # ASSUMED" in out
    Path("m.embark").write_text(out)
    assert load_program("m.embark").topology.nodes == 5


def test_torchrec_from_a_python_module_of_dicts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("my_model.py").write_text(f"TABLES = {TORCHREC!r}\n")
    code, out, err = run(capsys, "import", "torchrec", "my_model:TABLES")
    assert code == 0, err
    assert "table t_user { rows 1000000 dim 64 }" in out


def test_hugectr_training_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("hc.json").write_text(json.dumps(HUGECTR))
    code, _, err = run(capsys, "import", "hugectr", "hc.json", "-o", "h.embark")
    assert code == 0, err
    program = load_program("h.embark")
    assert [t.rows for t in program.tables] == [1000, 20000, 300]
    assert {t.dim for t in program.tables} == {16}
    assert {t.optimizer.kind for t in program.tables} == {"adam"}
    assert program.tables[0].optimizer.lr == 0.001
    assert {f.pooling for f in program.features} == {"mean"}
    # 3 ids over 3 slots: one per slot, given, not assumed
    assert {f.hotness for f in program.features} == {1}
    assert program.batch_size == 2048 and program.model.dense_features == 13
    assert program.topology.gpus_per_node == 4
    text = Path("h.embark").read_text()
    assert "batch 2048\n" in text and "hotness 1  # ASSUMED" in text  # the default line


def test_hugectr_embedding_collection(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = {
        "batch_size": 4096,
        "num_gpus": 2,
        "tables": [
            {"table_name": "user", "max_vocabulary_size": 100000, "ev_size": 32, "hotness": 2},
            {"table_name": "item", "vocabulary_size": 5000, "dim": 16, "combiner": "mean"},
        ],
    }
    Path("c.json").write_text(json.dumps(doc))
    code, out, err = run(capsys, "import", "hugectr", "c.json", "-o", "c.embark")
    assert code == 0, err
    program = load_program("c.embark")
    assert program.feature_by_name["user"].hotness == 2
    assert program.feature_by_name["item"].pooling == "mean"
    assert program.topology.world_size == 2 and program.batch_size == 4096


@pytest.mark.parametrize(
    ("system", "content", "message"),
    [
        ("torchrec", "[{", "c.json:1:3: error: invalid JSON"),
        ("torchrec", "[]", "expected a non-empty list"),
        (
            "torchrec",
            '[{"name": "a", "num_embeddings": 0, "embedding_dim": 4}]',
            "tables[0] (`a`): num_embeddings must be an integer of at least 1, got 0",
        ),
        (
            "torchrec",
            '[{"name": "a", "num_embeddings": 5, "embedding_dim": 4, "hotness": 3}]',
            "unknown field `hotness`",
        ),
        (
            "torchrec",
            '[{"name": "a", "num_embeddings": 5, "embedding_dim": 4, "data_type": "INT8"}]',
            "embarkc's tables are FP32, FP16 or BF16",
        ),
        ("torchrec", '[{"name": "a", "num_embeddings": 5}]', "tables[0]: missing `embedding_dim`"),
        ("hugectr", "[]", "expected a JSON object"),
        ("hugectr", '{"layers": []}', "no embedding layer"),
        (
            "hugectr",
            '{"layers": [{"type": "DistributedSlotSparseEmbeddingHash", "sparse_embedding_hparam": {"embedding_vec_size": 4}}]}',
            "`slot_size_array` missing or empty",
        ),
        (
            "hugectr",
            '{"tables": [{"name": "x", "vocabulary_size": 10, "ev_size": 4, "combiner": "max"}]}',
            "combiner 'max'",
        ),
        (
            "hugectr",
            '{"optimizer": {"type": "Ftrl"}, "tables": [{"name": "x", "vocabulary_size": 10, "ev_size": 4}]}',
            "embarkc trains SGD, Adam or AdaGrad",
        ),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, monkeypatch, system, content, message):
    monkeypatch.chdir(tmp_path)
    Path("c.json").write_text(content)
    Path("out.embark").write_text("# mine\n")
    code, _, err = run(capsys, "import", system, "c.json", "-o", "out.embark")
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert Path("out.embark").read_text() == "# mine\n"  # nothing overwritten


def test_import_refuses_to_overwrite_its_input_and_names_missing_modules(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("tr.json").write_text(json.dumps(TORCHREC))
    code, _, err = run(capsys, "import", "torchrec", "tr.json", "-o", "tr.json")
    assert code == 2 and "-o names the input" in err
    code, _, err = run(capsys, "import", "torchrec", "no_such_module:TABLES")
    assert code == 2 and "cannot import `no_such_module`" in err


# --------------------------------------------------------------------------- schema, json


def test_schema_plan_validates_a_real_plan(tmp_path, capsys, monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "schema", "plan")
    assert code == 0
    schema = json.loads(out)
    assert schema["$schema"].endswith("2020-12/schema")
    assert {"format", "version", "topology", "tables", "clusters", "shards"} <= set(
        schema["required"]
    )
    assert schema["properties"]["row_partition"]["enum"] == ["mod", "range"]
    code, _, err = run(
        capsys, "plan", str(root / "specs/tiny.embark"), "--solver", "greedy", "-o", "p.json", "-q"
    )
    assert code == 0, err
    plan = json.loads(Path("p.json").read_text())
    assert set(plan) <= set(schema["properties"])
    shard = schema["$defs"]["Shard"]
    assert {"table", "row_shard", "row_shards", "columns", "rank"} == set(shard["required"])
    jsonschema = pytest.importorskip("jsonschema")  # not a dependency: validate where present
    jsonschema.validate(plan, schema)
    plan["row_partition"] = "diagonal"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(plan, schema)


def test_format_json_summaries(tmp_path, capsys, monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    spec = str(root / "specs/tiny.embark")
    code, out, _ = run(capsys, "check", spec, "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["kind"] == "spec" and d["ok"] and d["tables"] == 6 and d["gpus"] == 4
    code, out, err = run(
        capsys, "plan", spec, "--solver", "greedy", "-o", "p.json", "--format", "json"
    )
    assert code == 0, err
    d = json.loads(out)
    plan = json.loads(Path("p.json").read_text())
    assert d["kind"] == "plan" and d["step_time"] == plan["estimate"]["step_time"]
    assert len(d["per_rank"]) == 4 and d["output"] == "p.json"
    code, out, _ = run(capsys, "check", "p.json", "nope.embark", "--format", "json")
    d = json.loads(out)
    assert code == 2
    assert [(x["file"], x["ok"]) for x in d] == [("p.json", True), ("nope.embark", False)]
    assert d[0]["kind"] == "plan_file" and d[0]["max_memory_bytes"] > 0
    code, out, _ = run(capsys, "simulate", "p.json", "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["kind"] == "simulation" and len(d["per_rank"]) == 4
    assert d["estimate_step_time"] == plan["estimate"]["step_time"]
    assert d["step_time"] > 0 and "step_time" in d["difference_percent"]
