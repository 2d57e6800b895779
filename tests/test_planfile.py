"""The plan-v1 loader: valid plans round-trip byte for byte, broken ones name the rule."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from embark_runtime import keys
from embark_runtime.plan import PlanError, dumps_plan, load_plan, parse_plan


def _plan() -> dict:
    return {
        "format": "embark-plan",
        "version": 1,
        "source": {"spec": "x.embark", "sha256": "0" * 64},
        "topology": {
            "nodes": 2,
            "gpus_per_node": 2,
            "hbm_bytes": 1 << 20,
            "hbm_bandwidth": 1e12,
            "intra_node_bandwidth": 1e11,
            "inter_node_bandwidth": 1e10,
        },
        "batch_size": 16,
        "tables": [
            {"name": "a", "rows": 100, "dim": 8, "dtype": "fp32", "optimizer": "adagrad"},
            {"name": "b", "rows": 10, "dim": 4, "dtype": "fp32", "optimizer": "sgd"},
        ],
        "features": [
            {
                "name": "fa",
                "table": "a",
                "hotness": 2,
                "pooling": "sum",
                "access": {"kind": "uniform"},
            },
            {
                "name": "fb",
                "table": "b",
                "hotness": 1,
                "pooling": "sum",
                "access": {"kind": "uniform"},
            },
        ],
        "row_partition": "mod",
        "clusters": [
            {"name": "rb0", "kind": "rb", "communication": "flat", "tables": ["a"]},
            {"name": "dp0", "kind": "dp", "tables": ["b"]},
        ],
        "shards": [
            {"table": "a", "row_shard": 0, "row_shards": 2, "columns": [0, 4], "rank": 0},
            {"table": "a", "row_shard": 0, "row_shards": 2, "columns": [4, 8], "rank": 1},
            {"table": "a", "row_shard": 1, "row_shards": 2, "columns": [0, 8], "rank": 3},
        ],
        "estimate": {
            "step_time": 0.001,
            "per_rank": [{"rank": r, "memory_bytes": 0, "time": 0.0} for r in range(4)],
        },
        "planner": {
            "strategy": "embark",
            "solver": "greedy",
            "status": "greedy",
            "seed": 0,
            "wall_time": 0.0,
        },
    }


def test_valid_plan_round_trips_byte_identical(tmp_path):
    text = dumps_plan(_plan())
    p = tmp_path / "plan.json"
    p.write_text(text)
    plan = load_plan(p)
    assert dumps_plan(plan) == dumps_plan(parse_plan(dumps_plan(plan)))
    assert plan.world_size == 4
    assert [s.width for s in plan.shards_of("a")] == [4, 4, 8]


def test_memory_by_rank_counts_state_and_replicas():
    plan = parse_plan(json.dumps(_plan()))
    mem = plan.memory_by_rank()
    # dp table b (10 x 4 fp32, sgd) on every rank: 160 bytes
    # a: 50 rows per row shard (mod), adagrad doubles the bytes
    assert mem == [160 + 50 * 4 * 8, 160 + 50 * 4 * 8, 160, 160 + 50 * 8 * 8]


@pytest.mark.parametrize(
    ("mutate", "rule", "needle"),
    [
        (lambda d: d["clusters"][1]["tables"].append("a"), "rule 1", "is in clusters"),
        (lambda d: d["clusters"][1]["tables"].remove("b"), "rule 1", "in no cluster"),
        (lambda d: d["features"][0].update(table="zz"), "rule 1", "unknown table `zz`"),
        (lambda d: d["shards"][2].update(row_shards=3), "rule 2", "disagree on row_shards"),
        (lambda d: d["shards"][1].update(columns=[5, 8]), "rule 2", "do not tile"),
        (lambda d: d["shards"][1].update(columns=[4, 6]), "rule 2", "cover [0, 6)"),
        (lambda d: d["shards"][2].update(rank=4), "rule 3", "outside [0, 4)"),
        (lambda d: d["topology"].update(hbm_bytes=1000), "rule 4", "more than hbm_bytes"),
        (lambda d: d.update(version=2), "version", "not supported"),
        (lambda d: d.update(format="torchrec"), "format", "expected 'embark-plan'"),
        (lambda d: d["tables"][0].update(rows=-1), "schema", "tables.0.rows"),
        (lambda d: d["clusters"][0].pop("communication"), "rule 1", "no `communication`"),
        # what the trainer could not draw batches for or train with
        (
            lambda d: d["features"][0].update(access={"kind": "zipf"}),
            "features",
            "zipf access needs alpha > 0",
        ),
        (
            lambda d: d["features"][0]["access"].update(
                kind="histogram", keys=[1, 200], counts=[1, 1]
            ),
            "features",
            "histogram keys must lie in [0, 100)",
        ),
        (
            lambda d: d["features"][0].update(max_hotness=1),
            "features",
            "max_hotness 1 is below its hotness 2",
        ),
        (
            lambda d: d["tables"][0].update(optimizer_params={"lr": 0}),
            "schema",
            "tables.0.optimizer_params.lr",
        ),
        (
            lambda d: d["tables"][0].update(init={"kind": "normal", "std": -1}),
            "schema",
            "normal(mean, std) needs std > 0",
        ),
        (lambda d: d.update(model={"top_mlp": [0]}), "schema", "model.top_mlp.0"),
        # no coercion: what the contract has as an integer is one in the JSON
        (lambda d: d["shards"][2].update(rank=True), "schema", "shards.2.rank"),
        (lambda d: d["shards"][2].update(rank="3"), "schema", "shards.2.rank"),
        (lambda d: d["shards"][2].update(rank=3.0), "schema", "shards.2.rank"),
        (lambda d: d["tables"][1].update(dim="4"), "schema", "tables.1.dim"),
        (lambda d: d["shards"][0].update(columns=[0, "4"]), "schema", "shards.0.columns.1"),
        (lambda d: d["estimate"].update(critical_rank=True), "schema", "estimate.critical_rank"),
        # what a hand edit makes of the estimate: diff's gate, report and check read it
        (lambda d: d["estimate"].update(step_time=float("nan")), "schema", "estimate.step_time"),
        (lambda d: d["estimate"].update(step_time=float("inf")), "schema", "estimate.step_time"),
        (lambda d: d["estimate"].update(step_time=-1.0), "schema", "estimate.step_time"),
        (
            lambda d: d["estimate"]["per_rank"][0].update(time=float("nan")),
            "schema",
            "estimate.per_rank.0.time",
        ),
        (
            lambda d: d["estimate"]["per_rank"][0].update(memory_bytes=-5),
            "schema",
            "estimate.per_rank.0.memory_bytes",
        ),
        (
            lambda d: d["estimate"]["per_rank"].append({"rank": 0, "memory_bytes": 0, "time": 0}),
            "estimate",
            "rank 0 twice",
        ),
        (
            lambda d: d["estimate"]["per_rank"][0].update(rank=7),
            "estimate",
            "rank 7 outside [0, 4)",
        ),
        (lambda d: d["estimate"].update(critical_rank=99), "estimate", "critical_rank is 99"),
        # a rank the estimate leaves out would read as a rank of no time and no memory
        (
            lambda d: d["estimate"]["per_rank"].pop(1),
            "estimate",
            "lists 3 of the 4 ranks (rank 1 is missing)",
        ),
        (
            lambda d: d["topology"].update(hbm_bandwidth=float("inf")),
            "schema",
            "topology.hbm_bandwidth",
        ),
        # sizes no spec can hold: every count derived from them must stay exact
        (lambda d: d["tables"][0].update(rows=10**30), "schema", "tables.0.rows"),
        (lambda d: d["features"][0].update(hotness=2.0**62), "schema", "features.0.hotness"),
        (lambda d: d.update(batch_size=4 * 10**30), "schema", "batch_size"),
        (
            lambda d: d["shards"][2].update(row_shards=10**15),
            "schema",
            "shards.2.row_shards",
        ),
        (
            lambda d: [s.update(row_shards=5) for s in d["shards"]],
            "rule 2",
            "row_shards 5 but 3 cell(s)",
        ),
        (lambda d: d["shards"][2].update(row_shard=5), "rule 2", "row_shard outside [0, 2)"),
        # numbers beyond what is physically meaningful: the commands compute finite figures
        (lambda d: d["estimate"].update(step_time=1e308), "schema", "estimate.step_time"),
        (
            lambda d: d["estimate"]["per_rank"][2].update(time=1e30),
            "schema",
            "estimate.per_rank.2.time",
        ),
        (
            lambda d: d["estimate"]["per_rank"][0].update(memory_bytes=1 << 64),
            "schema",
            "estimate.per_rank.0.memory_bytes",
        ),
        (
            lambda d: d["estimate"].update(components={"distributor": 1e308}),
            "schema",
            "estimate.components.distributor",
        ),
        (lambda d: d["planner"].update(bound=1e30), "schema", "planner.bound"),
        (lambda d: d["planner"].update(wall_time=1e300), "schema", "planner.wall_time"),
        (lambda d: d["planner"].update(seed=1 << 70), "schema", "planner.seed"),
        (lambda d: d["topology"].update(hbm_bytes=10**30), "schema", "topology.hbm_bytes"),
        (lambda d: d["topology"].update(hbm_bandwidth=1e-300), "schema", "hbm_bandwidth"),
        (lambda d: d["topology"].update(inter_node_bandwidth=1e308), "schema", "inter_node"),
        (lambda d: d["topology"].update(dense_flops=1e-300), "schema", "dense_flops"),
        (lambda d: d.update(model={"bottom_mlp": [10**30]}), "schema", "model.bottom_mlp.0"),
        (lambda d: d.update(model={"top_mlp": [1] * 5000}), "schema", "model.top_mlp"),
        (
            lambda d: d.update(model={"interaction": {"kind": "dcnv2", "low_rank": 1 << 40}}),
            "schema",
            "model.interaction",
        ),
        (lambda d: d.update(seed=1 << 40), "schema", "seed"),
        (
            lambda d: d["features"][0]["access"].update(
                kind="histogram", keys=[1, 2], counts=[1 << 62, 1 << 62]
            ),
            "features",
            "histogram counts sum to more than",
        ),
        # what the trainer and the simulator need of every plan
        (lambda d: d.update(batch_size=18), "batch", "does not split evenly over the 4 ranks"),
        (lambda d: d.pop("row_partition"), "schema", "field `row_partition`"),
    ],
)
def test_broken_plan_names_the_rule(mutate, rule, needle):
    data = copy.deepcopy(_plan())
    mutate(data)
    with pytest.raises(PlanError) as e:
        parse_plan(json.dumps(data), "p.json")
    assert e.value.rule == rule
    assert needle in str(e.value)
    assert str(e.value).startswith("p.json: error: invalid plan")


@pytest.mark.parametrize(
    ("section", "field", "value", "where"),
    [
        ("planner", "bound", "x", "planner.bound"),
        ("planner", "lower_bound", -1, "planner.lower_bound"),
        ("planner", "greedy_step_time", [1], "planner.greedy_step_time"),
        ("planner", "baselines", {"table-wise": "fast"}, "planner.baselines.table-wise"),
        ("planner", "ignored_constraints", "none", "planner.ignored_constraints"),
        ("estimate", "critical_rank", "a", "estimate.critical_rank"),
        ("estimate", "components", 3, "estimate.components"),
        ("estimate", "per_table", [{"time": 1}], "estimate.per_table.0.table"),
        ("estimate", "key_window", "k", "estimate.key_window"),
        ("estimate", "critical_path", -0.5, "estimate.critical_path"),
    ],
)
def test_a_broken_field_of_our_own_is_named(section, field, value, where):
    # diff, report, simulate and check read these; a hand edit that breaks one is a broken
    # plan named by its field, not a crash in the command that reads it
    data = copy.deepcopy(_plan())
    data[section][field] = value
    with pytest.raises(PlanError) as e:
        parse_plan(json.dumps(data), "p.json")
    assert e.value.rule == "schema"
    assert f"field `{where}` (a field of embarkc's own" in str(e.value)
    data[section][field] = None  # absent or null: the commands do without it
    parse_plan(json.dumps(data), "p.json")


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe\x00garbage", b"[1, 2]", b"null"])
def test_corrupt_file_is_a_clear_error(tmp_path, raw):
    p = tmp_path / "bad.json"
    p.write_bytes(raw)
    with pytest.raises(PlanError) as e:
        load_plan(p)
    assert str(p) in str(e.value)


def test_a_key_given_twice_or_a_number_too_long_is_a_clear_error():
    text = dumps_plan(_plan())
    twice = text.replace('"batch_size": 16,', '"batch_size": 16,\n  "batch_size": 16,', 1)
    assert twice != text
    with pytest.raises(PlanError) as e:
        parse_plan(twice, "p.json")
    assert e.value.rule == "json"
    assert "key `batch_size` appears twice" in e.value.message
    long = text.replace('"batch_size": 16', '"batch_size": ' + "1" * 5000, 1)
    with pytest.raises(PlanError) as e:
        parse_plan(long, "p.json")
    assert e.value.rule == "json"


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="no such file"):
        load_plan(tmp_path / "nope.json")


@pytest.mark.parametrize("rows", [1, 2, 7, 1000, 40_000_000, 3_000_000_017])
def test_permutation_is_a_bijection_on_samples(rows):
    n = min(rows, 5000)
    ranks = np.arange(n, dtype=np.int64)
    out = keys.permute(ranks, rows, table_index=3)
    assert out.min() >= 0 and out.max() < rows
    assert len(np.unique(out)) == n
    if rows <= 5000:
        assert sorted(out.tolist()) == list(range(rows))


@pytest.mark.parametrize("partition", ["mod", "range"])
def test_row_shard_and_local_row_invert(partition):
    rows, r = 103, 4
    k = np.arange(rows)
    shard = keys.row_shard_of(k, rows, r, partition)
    local = keys.local_row(k, rows, r, partition)
    pairs = set(zip(shard.tolist(), local.tolist(), strict=True))
    assert len(pairs) == rows
    for j in range(r):
        assert sorted(local[shard == j].tolist()) == list(range(int((shard == j).sum())))


def test_lookups_by_table_follow_the_plans_own_lists():
    """`table`, `cluster_of` and `shards_of` are indexed once per list; a copy of the plan
    with other shards or clusters looks up its own, and the index is no field."""
    plan = parse_plan(json.dumps(_plan()))
    assert [s.rank for s in plan.shards_of("a")] == [0, 1, 3]
    assert plan.cluster_of("b").name == "dp0" and plan.table("b").rows == 10
    fewer = plan.model_copy(update={"shards": plan.shards[:1]})
    assert [s.rank for s in fewer.shards_of("a")] == [0]
    assert [s.rank for s in plan.shards_of("a")] == [0, 1, 3]
    moved = plan.model_copy(
        update={"clusters": [plan.clusters[0].model_copy(update={"tables": ["a", "b"]})]}
    )
    assert moved.cluster_of("b").name == "rb0" and plan.cluster_of("b").name == "dp0"
    assert plan.shards_of("b") == [] and plan.shards_of("zz") == []
    for lookup in (plan.table, plan.cluster_of):
        with pytest.raises(KeyError):
            lookup("zz")
    assert dumps_plan(plan) == dumps_plan(parse_plan(dumps_plan(plan)))
    assert plan == parse_plan(dumps_plan(plan))
