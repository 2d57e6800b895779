"""Host-tier cells (issue 38, runtime and plan file): the HBM cache's policy and counters
on known id sequences, its exactness against an all-HBM cell, the plan fields and their
rules, the hardware keys, and `embarkc check`'s tier-aware memory rules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from embark_runtime.cache import RowCache, cache_text, stats_flat, stats_record
from embark_runtime.kernels import TorchKernels
from embark_runtime.optim import apply_update, new_state
from embark_runtime.plan import PlanError, dumps_plan, parse_plan
from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"

KERNELS = TorchKernels(torch.float64)
SGD = SimpleNamespace(
    optimizer="sgd",
    optimizer_params=SimpleNamespace(lr=0.5, eps=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0),
)


def _cache(rows: int, capacity: int, optimizer: str = "sgd") -> RowCache:
    weight = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    params = SimpleNamespace(initial_accumulator=0.1)
    return RowCache(weight, new_state(optimizer, rows, 2, params, "cpu"), capacity, "cpu")


def _step(cache: RowCache, rows: list[int], grad: float = 1.0) -> torch.Tensor:
    """One step of the protocol: admit, read, update every row with gradient `grad`."""
    r = torch.tensor(rows, dtype=torch.int64)
    slots = cache.admit(r)
    cache.read(r, slots)
    cache.update(KERNELS, r, torch.full((len(rows), 2), grad, dtype=torch.float64), SGD)
    return slots


def test_lru_hits_misses_evictions_and_write_backs_on_a_known_sequence():
    c = _cache(10, 2)
    assert _step(c, [1, 2]).tolist() == [0, 1]  # two misses fill the free slots
    assert _step(c, [1]).tolist() == [0]  # a hit; row 2 is now least recently used
    assert _step(c, [3]).tolist() == [1]  # evicts row 2 (dirty: written back)
    s = c.take_stats()
    assert (s.lookups, s.hits, s.misses, s.fetches, s.evictions, s.writebacks) == (
        4, 1, 3, 3, 1, 1
    )  # fmt: skip
    assert s.host_reads == 0 and s.hit_rate == 0.25
    # three rows in one step, two slots: the most-read misses get the slots (row 5 is
    # read three times, row 4 twice), the other is served from host
    r = torch.tensor([4, 5, 6])
    slots = c.admit(r, counts=torch.tensor([2, 3, 1]))
    assert slots.tolist() == [1, 0, -1]
    s = c.take_stats()
    assert (s.hits, s.fetches, s.evictions, s.writebacks, s.host_reads) == (0, 2, 2, 2, 1)
    # rows pinned by the step are never evicted by it: a step's rows all stay resident
    assert c.row_in.tolist() == [5, 4]


def test_a_clean_row_is_evicted_without_a_write_back():
    c = _cache(10, 1)
    c.admit(torch.tensor([7]))  # read only (no update): clean
    c.admit(torch.tensor([8]))
    s = c.take_stats()
    assert (s.evictions, s.writebacks) == (1, 0)


def test_uncached_host_tier_serves_every_row_from_host_and_updates_it_there():
    c = _cache(4, 0)
    slots = _step(c, [0, 3, 3], grad=1.0)  # rows may repeat: their gradients are summed
    assert slots.tolist() == [-1, -1, -1]
    assert c.host_weight[3].tolist() == [6 - 1.0, 7 - 1.0]  # lr 0.5 x (1 + 1)
    s = c.take_stats()
    assert (s.lookups, s.host_reads, s.fetches) == (3, 3, 0)


def test_flush_writes_dirty_rows_back_and_keeps_them_cached():
    c = _cache(6, 3, "adagrad")
    adagrad = SimpleNamespace(optimizer="adagrad", optimizer_params=SGD.optimizer_params)
    r = torch.tensor([2, 4])
    c.admit(r)
    c.update(KERNELS, r, torch.ones(2, 2, dtype=torch.float64), adagrad)
    before = c.host_weight[2].clone()
    c.flush()
    assert not torch.equal(c.host_weight[2], before)
    assert c.host_state["sum"][2].tolist() == pytest.approx([1.1, 1.1])  # state written back too
    assert c.take_stats().writebacks == 2
    assert c.admit(r).tolist() == c.slot_of[r].tolist()  # still cached: hits
    c.invalidate()
    assert c.admit(torch.tensor([2])).tolist() == [0]  # refetched after invalidation


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("capacity", [0, 1, 2, 5, 12])
def test_any_cache_size_trains_the_same_rows_as_an_hbm_cell(optimizer, capacity):
    """Random steps (rows repeat within a step) against the same updates applied to an
    all-HBM copy: weights and optimizer state equal bit for bit after a flush."""
    gen = torch.Generator().manual_seed(capacity * 7 + len(optimizer))
    rows = 12
    table = SimpleNamespace(optimizer=optimizer, optimizer_params=SGD.optimizer_params)
    params = SimpleNamespace(initial_accumulator=0.1)
    c = _cache(rows, capacity, optimizer)
    hbm_w = c.host_weight.clone()
    hbm_s = new_state(optimizer, rows, 2, params, "cpu")
    for _ in range(30):
        ids = torch.randint(
            0, rows, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen
        )
        unique, inverse = KERNELS.dedup(ids)
        slots = c.admit(unique, torch.bincount(inverse))
        assert torch.equal(c.read(unique, slots), hbm_w[unique])
        g = torch.randn(ids.numel(), 2, dtype=torch.float64, generator=gen)
        c.update(KERNELS, ids, g, table)
        apply_update(KERNELS, hbm_w, hbm_s, ids, g, table)
    c.flush()
    assert torch.equal(c.host_weight, hbm_w)
    for k, v in hbm_s.items():
        assert torch.equal(c.host_state[k], v), k


def test_a_cache_larger_than_its_cell_is_refused():
    with pytest.raises(ValueError, match="a cache of 5 rows for a cell of 4 rows"):
        _cache(4, 5)


def test_the_log_record_sums_the_ranks_counters_per_cluster():
    c = _cache(10, 2)
    _step(c, [1, 2])
    _step(c, [1, 3])
    flat = stats_flat({"rb0": c.take_stats()}, ["rb0", "ub0"])
    record = stats_record([2 * v for v in flat], ["rb0", "ub0"])
    assert record["rb0"]["lookups"] == 8 and record["rb0"]["hits"] == 2
    assert record["rb0"]["hit_rate"] == 0.25
    assert record["ub0"]["hit_rate"] is None
    assert cache_text(record) == "; cache hits rb0 25.0%, ub0 -"


# --------------------------------------------------------------------------- the plan


@pytest.fixture(scope="module")
def tiny_host(tmp_path_factory) -> tuple[Path, dict]:
    """tiny.embark with 64 MiB of host memory per node, and its plan."""
    d = tmp_path_factory.mktemp("tiny_host")
    spec = d / "tiny.embark"
    spec.write_text(
        TINY.read_text().replace("  arch sm_80\n", "  arch sm_80\n  host_memory 64 MiB\n")
    )
    assert embarkc(["compile", str(spec), "-o", str(d / "out"), "-q"]) == 0
    return spec, json.loads((d / "out" / "plan.json").read_text())


def _with_tiers(plan: dict, caches: dict[int, int | None]) -> dict:
    """`plan` with shards[i] in host memory, caching caches[i] rows (None: field absent)."""
    plan = json.loads(json.dumps(plan))
    for i, c in caches.items():
        plan["shards"][i]["tier"] = "host"
        if c is not None:
            plan["shards"][i]["cache_rows"] = c
    return plan


def test_an_hbm_plan_has_no_tier_fields_and_round_trips_byte_for_byte(tiny_host):
    _, plan = tiny_host
    assert all("tier" not in s and "cache_rows" not in s for s in plan["shards"])
    text = dumps_plan(plan)
    assert dumps_plan(parse_plan(text)) == text


def test_the_layout_digest_sees_tiers_and_caches_and_not_an_hbm_plan(tiny_host):
    """An edit that only moves a cell to host memory, or resizes its cache, changes the
    layout the estimate was made for (so `check` says the estimate is stale); a plan all
    in HBM digests as it did before tiers existed."""
    from embarkc.planner.build import layout_digest

    _, plan = tiny_host
    base = layout_digest(parse_plan(dumps_plan(plan)))
    assert plan["estimate"]["layout_sha256"] == base
    host = layout_digest(parse_plan(dumps_plan(_with_tiers(plan, {0: 4}))))
    bigger = layout_digest(parse_plan(dumps_plan(_with_tiers(plan, {0: 8}))))
    assert len({base, host, bigger}) == 3


def test_host_tier_fields_are_written_only_where_set_and_count_their_cache_in_hbm(tiny_host):
    _, plan = tiny_host
    edited = parse_plan(json.dumps(_with_tiers(plan, {0: 3, 1: None})))
    out = json.loads(dumps_plan(edited))
    assert out["shards"][0]["tier"] == "host" and out["shards"][0]["cache_rows"] == 3
    assert "cache_rows" not in out["shards"][1]
    assert all("tier" not in s for s in out["shards"][2:])
    base = parse_plan(json.dumps(plan))
    s0 = base.shards[0]
    t = base.table(s0.table)
    rows = base.row_count(s0.table, s0.row_shard, s0.row_shards)
    freed = t.bytes_for(rows, s0.width) - t.bytes_for(3, s0.width)
    s1 = base.shards[1]
    freed1 = base.table(s1.table).bytes_for(
        base.row_count(s1.table, s1.row_shard, s1.row_shards), s1.width
    )
    before, after = base.memory_by_rank(), edited.memory_by_rank()
    expect = list(before)
    expect[s0.rank] -= freed
    expect[s1.rank] -= freed1
    assert after == expect
    host = edited.host_memory_by_rank()
    assert host[s0.rank] >= t.bytes_for(rows, s0.width) and sum(host) > 0


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"cache_rows": 2}, "cache_rows 2 is given but the cell is in HBM"),
        ({"tier": "host", "cache_rows": 10**6}, "is more than the cell's"),
        ({"tier": "host", "cache_rows": -1}, "cache_rows"),
        ({"tier": "disk"}, "tier"),
    ],
)
def test_a_bad_tier_or_cache_is_refused_by_the_loader(tiny_host, edit, needle):
    _, plan = tiny_host
    plan = json.loads(json.dumps(plan))
    plan["shards"][0].update(edit)
    with pytest.raises(PlanError, match=needle):
        parse_plan(json.dumps(plan))


def test_diff_shows_a_table_moved_to_host_memory_and_its_hbm_falling(tiny_host, tmp_path, capsys):
    """`embarkc diff` of a plan and its host-tier edit: the table's layout reads
    "... host K/N, cache C rows" on the edited side, and its HBM memory is its caches."""
    _, plan = tiny_host
    table = plan["shards"][0]["table"]
    cells = [i for i, s in enumerate(plan["shards"]) if s["table"] == table]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(dumps_plan(plan))
    b.write_text(dumps_plan(_with_tiers(plan, {i: 4 for i in cells})))
    capsys.readouterr()
    assert embarkc(["diff", str(a), str(b), "--format", "json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    change = next(c for c in data["tables_changed"] if c["table"] == table)
    assert "grid" in change["changed"]
    assert "host" not in change["grid_a"]
    assert change["grid_b"] == f"{change['grid_a']} host {len(cells)}/{len(cells)}, cache 4 rows"
    assert change["memory"]["b"] < change["memory"]["a"]


def test_check_and_compile_accept_a_hand_edited_host_tier_plan(tiny_host, tmp_path, capsys):
    spec, plan = tiny_host
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_with_tiers(plan, {0: 2, 1: 0})))
    capsys.readouterr()
    assert embarkc(["check", str(spec), str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host tier +2 cells in host memory, 2 rows cached in HBM; at most", out)
    assert (
        embarkc(["compile", str(spec), "--plan", str(path), "-o", str(tmp_path / "o"), "-q"]) == 0
    )
    written = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert written["shards"][0]["tier"] == "host" and written["shards"][0]["cache_rows"] == 2


def test_check_refuses_host_cells_beyond_the_nodes_host_memory(tiny_host, tmp_path, capsys):
    spec, plan = tiny_host
    small = tmp_path / "small.embark"
    small.write_text(spec.read_text().replace("host_memory 64 MiB", "host_memory 1 KiB"))
    path = tmp_path / "plan.json"
    edited = _with_tiers(plan, {0: 2})
    edited["source"]["sha256"] = __import__("hashlib").sha256(small.read_bytes()).hexdigest()
    edited["source"]["spec"] = str(small)
    path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert embarkc(["check", str(small), str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "invalid plan (host-memory): node" in err
        and "keeps 6400 bytes of host-tier weights and optimizer state, more than its host_memory 1024"
        in err
    )


def test_check_refuses_a_host_tier_without_host_memory(tmp_path, capsys):
    out = tmp_path / "o"
    assert embarkc(["compile", str(TINY), "-o", str(out), "-q"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_with_tiers(plan, {0: 1})))
    capsys.readouterr()
    assert embarkc(["check", str(TINY), str(path)]) == 2
    err = capsys.readouterr().err
    assert "gives no `host_memory`: add e.g. `host_memory 512 GiB`" in err
    assert "Traceback" not in err


def test_hardware_host_keys_and_presets(tmp_path, capsys):
    base = (
        "table t {{ rows 1000 dim 16 }}\nfeature f {{ table t hotness 2 }}\n"
        "model {{ batch 64 dense_features 4 bottom_mlp [8] top_mlp [8, 1] }}\n"
        "hardware {{ preset dgx_h100 {} }}\n"
    )
    spec = tmp_path / "s.embark"

    def ir(extra: str) -> dict:
        spec.write_text(base.format(extra))
        capsys.readouterr()
        assert embarkc(["compile", str(spec), "--dump", "ir"]) == 0
        return json.loads(capsys.readouterr().out)["topology"]

    topo = ir("")
    assert (topo["host_memory"], topo["host_bandwidth"]) == (2 << 40, 55e9)
    topo = ir("host_memory 480 GB host_bandwidth 450 GB/s")
    assert (topo["host_memory"], topo["host_bandwidth"]) == (480 * 10**9, 450e9)
    spec.write_text(base.format("host_memory 0 GiB host_bandwidth 3"))
    capsys.readouterr()
    assert embarkc(["compile", str(spec), "--dump", "ir"]) == 2
    err = capsys.readouterr().err
    assert "host_memory must be" in err and "host_bandwidth: missing unit" in err


# --------------------------------------------------------------------------- read ahead


def _one_rank(overlap: bool, steps: int = 6):
    """Train a one-rank plan (an rb and a ub table, every cell in host memory with a cache
    of 3 rows) for `steps` steps; returns (tables, state, staged counts per step)."""
    from mp_harness import FeatureSpec, TableSpec, make_plan, random_global_batch

    from embark_runtime.embedding import ShardedEmbeddings

    plan = make_plan(
        [TableSpec("a", 40, 4, "rb", (2, 1), "adagrad"), TableSpec("b", 30, 4, "ub", (1, 2))],
        [FeatureSpec("fa", "a", 3.0, "sum", 5), FeatureSpec("fb", "b", 2.0, "mean", 4)],
        nodes=1,
        gpus_per_node=1,
        batch_size=8,
    )
    shards = [s.model_copy(update={"tier": "host", "cache_rows": 3}) for s in plan.shards]
    plan = plan.model_copy(update={"shards": shards})
    emb = ShardedEmbeddings(plan, 0, 1, kernels=KERNELS, overlap=overlap)
    batches = [random_global_batch(plan, s, 5) for s in range(steps + 1)]
    gen = torch.Generator().manual_seed(1)
    staged = []
    for s in range(steps):
        out = emb(batches[s])
        emb.prefetch(batches[s + 1])
        loss = sum(
            (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out.values()
        )
        loss.backward()
        emb.finish_backward()
        staged.append(sum(len(c.staged) for c in emb.clusters))
    return (
        {t.name: emb.gather_table(t.name) for t in plan.tables},
        {t.name: emb.gather_state(t.name) for t in plan.tables},
        staged,
    )


def test_the_next_steps_rows_are_fetched_ahead_and_train_the_same_tables():
    """With the next batch prefetched, the host-tier cells admit and read its rows once
    the step's updates are applied (before its forward): the same tables and state as
    reading them at the lookup, bit for bit."""
    ahead_t, ahead_s, staged = _one_rank(overlap=True)
    plain_t, plain_s, none = _one_rank(overlap=False)
    assert staged == [4] * 6  # a's two row shards and b's two column cells, every step
    assert none == [0] * 6
    for name in ahead_t:
        assert torch.equal(ahead_t[name], plain_t[name]), name
        for k in ahead_s[name]:
            assert torch.equal(ahead_s[name][k], plain_s[name][k]), (name, k)


def test_the_plans_topology_may_carry_the_host_tier_hardware(tiny_host):
    _, plan = tiny_host
    topo = plan["topology"]
    assert "host_memory_bytes" not in topo and "host_bandwidth" not in topo
    plan = json.loads(json.dumps(plan))
    plan["topology"].update(host_memory_bytes=64 << 20, host_bandwidth=55e9)
    loaded = parse_plan(json.dumps(plan))
    assert (loaded.topology.host_memory_bytes, loaded.topology.host_bandwidth) == (64 << 20, 55e9)
    plan["topology"]["host_bandwidth"] = 0
    with pytest.raises(PlanError, match="host_bandwidth"):
        parse_plan(json.dumps(plan))


def test_the_plan_schema_has_the_tier_fields_as_optional(capsys):
    assert embarkc(["schema", "plan"]) == 0
    shard = json.loads(capsys.readouterr().out)["$defs"]["Shard"]
    assert {"tier", "cache_rows"} <= set(shard["properties"])
    assert not {"tier", "cache_rows"} & set(shard.get("required", []))


def test_tensorboard_gets_each_clusters_hit_rate(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from embark_runtime.phases import Scalars

    s = Scalars(tmp_path)
    base = {"loss": 1.0, "samples_per_s": 1.0, "bytes_total": 0, "step_s": 0.1}
    for n, rate in enumerate([0.25, None, 0.5]):
        s.step({**base, "step": n, "cache": {"ub0": {"hit_rate": rate}}})
    s.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("cache_hit_rate/ub0")]
    assert got == [(0, 0.25), (2, 0.5)]
