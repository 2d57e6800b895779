"""The planner's host tier (issue 38): the cache model, the tier stage and the cache sizing.

* `cache_model`: Che's approximation of a per-step LRU cache against an LRU replayed on
  sampled steps (zipf, uniform, a row-split permuted table), and its cold start;
* the cost model: a host cell holds its cache in HBM, costs its misses on the host link,
  and the search's share-based costing equals the costing of the written plan;
* the stages: a spec that fits keeps its all-HBM plan, one beyond HBM plans with host
  cells that the checker accepts, skewed tables leave HBM first, caches grow into the
  free HBM within every rank's capacity, and beyond HBM and host memory together the
  refusal names both.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from embark_runtime import keys as keymod
from embark_runtime.plan import dumps_plan, parse_plan
from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program_text
from embarkc.planner import plan_program
from embarkc.planner.cache_model import cell_misses, table_cache
from embarkc.planner.check import validate_plan
from embarkc.planner.cost import CostModel, layout_of_plan
from embarkc.planner.tiers import choose_tiers, grow_caches, materialize

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "specs" / "tiny.embark").read_text()

SMALL = """
hardware { nodes 1 gpus_per_node 2 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s network 10 Gb/s }
defaults { dtype fp32 pooling sum optimizer sgd }
table item { rows 20_000 dim 32 hotness 30 access zipf(1.05) }
table flat { rows 5000 dim 16 hotness 3 access uniform }
model { batch 256 dense_features 13 bottom_mlp [32, 16] interaction dot top_mlp [32, 1] }
"""


def tiny_beyond_hbm(hbm: str = "1 MiB", host: str = "64 MiB") -> str:
    text = TINY.replace("  hbm 4 MiB\n", f"  hbm {hbm}\n  host_memory {host}\n")
    assert text != TINY
    return text


def lru_replay(
    rows: int, probs: np.ndarray, key_of: np.ndarray, n: int, shard: tuple[int, int], cache: int
) -> tuple[float, float]:
    """(distinct rows, misses) per step of row shard `shard` = (j, r) of a table whose
    frequency rank i has key key_of[i], for an LRU of `cache` rows refreshed by each
    step's distinct rows, over 400 steps after 100 of warm-up."""
    rng = np.random.default_rng(0)
    j, r = shard
    lru: OrderedDict[int, None] = OrderedDict()
    looked = missed = 0
    for t in range(500):
        keys = key_of[rng.choice(rows, size=n, p=probs)]
        mine = np.unique(keys[keymod.row_shard_of(keys, rows, r, "mod") == j]).tolist()
        if t >= 100:
            looked += len(mine)
            missed += sum(1 for k in mine if k not in lru)
        for k in mine:
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > cache:
            lru.popitem(last=False)
    return looked / 400, missed / 400


@pytest.mark.parametrize(
    "table, r, caches",
    [("item", 2, (1200, 3000, 8000)), ("item", 1, (2500, 6000)), ("flat", 1, (1000, 3000))],
)
def test_the_cache_model_predicts_an_lru_cache_of_each_size(table, r, caches) -> None:
    """Expected misses per step within 2 % (of the distinct rows read) of an LRU replayed
    on 400 sampled steps, for caches that hold at least one step's rows."""
    prog = load_program_text(SMALL, "small.embark")
    cm = CostModel(prog)
    tf = cm.facts[table]
    tc = table_cache(cm, tf, r)
    rows = tf.rows
    if table == "item":
        w = (np.arange(rows) + 1.0) ** -1.05
        key_of = keymod.permute(np.arange(rows), rows, tf.index) if r > 1 else np.arange(rows)
    else:
        w = np.ones(rows)
        key_of = np.arange(rows)
    n = int(cm.B * tf.ids)
    for c in caches:
        looked, missed = lru_replay(rows, w / w.sum(), key_of, n, (0, r), c)
        assert tc.lookups()[0] == pytest.approx(looked, rel=0.01)
        expected = tc.misses(np.array([0]), np.array([float(c)]))[0]
        assert abs(expected - missed) <= 0.02 * looked, (c, expected, missed)
        # what the cost model uses: a split table's cell as the whole table's cache scaled
        _, derived = cell_misses(cm, tf, r, np.array([0]), np.array([float(c)]))
        assert abs(derived[0] - missed) <= 0.03 * looked, (c, derived, missed)


def test_a_cold_cache_misses_everything_first_and_reaches_the_steady_state() -> None:
    prog = load_program_text(SMALL, "small.embark")
    cm = CostModel(prog)
    tc = table_cache(cm, cm.facts["item"], 1)
    j, c = np.array([0]), np.array([6000.0])
    steady = tc.misses(j, c)[0]
    held = tc.held_steps(0, 6000.0)
    assert 1.0 < held < 100.0
    cold = [tc.misses(j, c, history=float(t))[0] for t in range(0, int(held) + 3)]
    assert cold[0] == pytest.approx(tc.lookups()[0])
    assert all(a > b for a, b in zip(cold, cold[1 : int(held) + 1], strict=False))
    assert cold[-1] == pytest.approx(steady)
    assert tc.misses(j, np.array([0.0]))[0] == pytest.approx(tc.lookups()[0])
    assert tc.misses(j, np.array([float(cm.facts["item"].rows)]))[0] == 0.0


def test_a_host_cell_holds_its_cache_in_hbm_and_pays_its_misses_on_the_host_link() -> None:
    prog = load_program_text(tiny_beyond_hbm("4 MiB"), "tiny.embark")
    plan = plan_program(prog, solver="greedy", baselines=False)
    assert not any(s.on_host for s in plan.shards)  # it fits: no host tier
    cm = CostModel(prog)
    base = cm.evaluate(plan)
    i = next(k for k, s in enumerate(plan.shards) if s.table == "item")
    rank = plan.shards[i].rank
    for cache, dearer in ((0, True), (plan.row_count("item", 0, plan.shards[i].row_shards), False)):
        shards = list(plan.shards)
        shards[i] = shards[i].model_copy(update={"tier": "host", "cache_rows": cache})
        est = cm.evaluate(plan.model_copy(update={"shards": shards}))
        before, after = base["per_rank"][rank], est["per_rank"][rank]
        assert (after["components"]["lookup"] > before["components"]["lookup"]) == dearer
        if cache == 0:
            assert after["memory_bytes"] < before["memory_bytes"]
            assert after["host_memory_bytes"] > 0
            (row,) = est["host_tier"]["tables"]
            assert row["hit_rate"] == 0.0 and row["misses"] == pytest.approx(row["lookups"])


def test_the_search_costs_host_tables_as_the_written_plan_is_costed() -> None:
    prog = load_program_text(tiny_beyond_hbm(), "tiny.embark")
    cm = CostModel(prog)
    tiers = choose_tiers(cm, 0.75)
    assert tiers and all(0.0 <= s < 1.0 for s in tiers.values())
    tcm = CostModel(prog, tiers)
    plan = plan_program(prog, solver="greedy", baselines=False)
    layout = layout_of_plan(plan)
    # the plan's cells as the search would hold them: its caches as the tiers' shares
    searched = {n: p for n, p in layout.items()}
    for name in tiers:
        p = searched[name]
        searched[name] = type(p)(
            p.kind, p.row_shards, p.widths, p.ranks, p.communication, p.exchange,
            p.cells_explicit, None,
        )  # fmt: skip
    written = materialize(tcm, searched)
    assert tcm.step_time(searched) == cm.step_time(written)
    assert np.array_equal(tcm.layout_state(searched).memory(), cm.layout_state(written).memory())


def test_a_spec_beyond_its_hbm_plans_with_host_cells_the_checker_accepts() -> None:
    prog = load_program_text(tiny_beyond_hbm(), "tiny.embark")
    plan = plan_program(prog, solver="greedy", baselines=False)
    host = [s for s in plan.shards if s.on_host]
    assert host
    assert validate_plan(prog, plan) == []
    extra = plan.estimate.model_extra or {}
    summary = extra["host_tier"]
    assert summary["cells"] == len(host)
    assert sum(summary["node_host_bytes"]) == summary["host_bytes"] > 0
    capacity = prog.topology.hbm_bytes - prog.options.memory_headroom
    assert all(r.memory_bytes <= capacity for r in plan.estimate.per_rank)
    assert plan.topology.host_memory_bytes == 64 << 20
    assert "host tier" in (plan.planner.model_extra or {})["message"]
    # the plan file round-trips, and costing it again gives its estimate
    again = parse_plan(dumps_plan(plan), "p.json")
    assert CostModel(prog).evaluate(again)["step_time"] == pytest.approx(plan.estimate.step_time)


def test_skewed_tables_leave_hbm_first_and_uniform_ones_stay() -> None:
    spec = """
hardware { nodes 1 gpus_per_node 2 hbm 40 MiB host_memory 1 GiB hbm_bandwidth 100 GB/s
           nvlink 50 GB/s network 10 Gb/s }
defaults { dtype fp32 pooling sum optimizer sgd dim 64 hotness 4 }
table hot { rows 200_000 access zipf(1.2) }
table flat { rows 200_000 access uniform }
model { batch 1024 dense_features 13 bottom_mlp [32, 16] interaction dot top_mlp [32, 1] }
"""
    prog = load_program_text(spec, "two.embark")
    tiers = choose_tiers(CostModel(prog), 0.9)
    assert set(tiers) == {"hot"}
    plan = plan_program(prog, solver="greedy", baselines=False)
    assert {s.table for s in plan.shards if s.on_host} == {"hot"}


def test_the_caches_grow_into_the_free_hbm_and_stay_within_every_ranks_capacity() -> None:
    prog = load_program_text(tiny_beyond_hbm(), "tiny.embark")
    cm = CostModel(prog)
    tiers = choose_tiers(cm, 0.6)
    tcm = CostModel(prog, tiers)
    plan = plan_program(prog, solver="greedy", baselines=False)
    layout = materialize(tcm, {n: p for n, p in layout_of_plan(plan).items()})
    grown = grow_caches(cm, layout)
    assert cm.step_time(grown) <= cm.step_time(layout)
    held = cm.layout_state(grown).memory()
    assert (held <= cm.capacity).all()
    before = sum(sum(c for c in p.cache if c > 0) for p in layout.values() if p.cache)
    after = sum(sum(c for c in p.cache if c > 0) for p in grown.values() if p.cache)
    assert after >= before


def test_beyond_hbm_and_host_memory_together_the_refusal_names_both() -> None:
    with pytest.raises(EmbarkError) as e:
        load_program_text(tiny_beyond_hbm(host="1 MiB"), "tiny.embark")
    message = e.value.diagnostics[0].message
    assert "HBM" in message and "host memory" in message and "short by" in message


def test_without_host_memory_a_spec_beyond_hbm_is_refused_as_before() -> None:
    with pytest.raises(EmbarkError) as e:
        load_program_text(TINY.replace("  hbm 4 MiB\n", "  hbm 1 MiB\n"), "tiny.embark")
    assert "host memory" not in e.value.diagnostics[0].message


def test_a_node_whose_host_cells_exceed_its_host_memory_is_named() -> None:
    from embarkc.planner.tiers import host_memory_problem

    cm = CostModel(load_program_text(tiny_beyond_hbm(host="3 MiB"), "tiny.embark"))
    within = {"host_tier": {"node_host_bytes": [3 << 20, 1 << 20]}}
    over = {"host_tier": {"node_host_bytes": [1 << 20, (3 << 20) + 1]}}
    assert host_memory_problem(cm, within) is None
    message = host_memory_problem(cm, over)
    assert message is not None and message.startswith("node 1 would keep 3.0 MiB")
    assert "host_memory of 3.0 MiB" in message
