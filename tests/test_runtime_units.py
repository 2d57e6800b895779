"""Single-process tests of the runtime core: kernels, distributor, init, storage, and the
sharded path on one rank (Comm.local) against the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mp_harness import Bag, FeatureSpec, TableSpec, make_plan, random_global_batch

from embark_runtime.comm import Comm, CommError, Traffic, chunk_bounds
from embark_runtime.distributor import (
    BatchError,
    FeatureInput,
    prepare_batch,
    split_by_row_shard,
    unique_by_row_shard,
)
from embark_runtime.embedding import PlanNotRunnable, ReferenceEmbeddings, ShardedEmbeddings
from embark_runtime.init import initial_values
from embark_runtime.kernels import TorchKernels
from embark_runtime.keys import local_row, row_shard_of
from embark_runtime.optim import new_state
from embark_runtime.plan import InitParams, OptimizerParams
from embark_runtime.storage import global_rows, new_cell

K = TorchKernels()


def naive_pool(weight, rows, offsets, w, mode):
    out = []
    for i in range(len(offsets) - 1):
        acc = torch.zeros(weight.shape[1])
        for p in range(int(offsets[i]), int(offsets[i + 1])):
            acc += weight[rows[p]] * (1.0 if w is None else float(w[p]))
        n = int(offsets[i + 1] - offsets[i])
        out.append(acc / max(n, 1) if mode == "mean" else acc)
    return torch.stack(out)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_forward_matches_a_loop_including_empty_bags(mode, weighted):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(10, 3, generator=g)
    rows = torch.tensor([1, 1, 4, 9, 0, 4], dtype=torch.int64)
    offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int64)
    w = torch.rand(6, generator=g) if weighted else None
    got = K.pooled_forward(weight, rows, offsets, w, mode)
    assert torch.allclose(got, naive_pool(weight, rows, offsets, w, mode), atol=1e-6)
    assert torch.equal(got[1], torch.zeros(3))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooled_backward_is_the_gradient_of_pooled_forward(mode):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 4, generator=g, requires_grad=True)
    rows = torch.tensor([3, 3, 5, 0, 3, 7], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 3, 6], dtype=torch.int64)
    w = torch.rand(6, generator=g)
    grad_out = torch.randn(3, 4, generator=g)
    (naive_pool(weight, rows, offsets, w, mode) * grad_out).sum().backward()
    unique, row_grads = K.pooled_backward(grad_out, rows, offsets, w, mode, 8)
    assert unique.tolist() == [0, 3, 5, 7]
    assert torch.allclose(row_grads, weight.grad[unique], atol=1e-6)


def _params(**kw):
    return OptimizerParams(lr=0.1, eps=1e-6, **kw)


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_sparse_update_follows_the_documented_formulas_on_touched_rows_only(opt):
    p = _params(weight_decay=0.01)
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10
    state = new_state(opt, 4, 3, p, "cpu")
    rows = torch.tensor([2, 0])
    grads = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.0, -1.0]])
    before = weight.clone()
    for _ in range(2):
        K.sparse_update(weight, state, rows, grads, opt, p)
    assert torch.equal(weight[[1, 3]], before[[1, 3]])
    for r, gr in zip(rows.tolist(), grads, strict=True):
        w = before[r].double().numpy().copy()
        s, m, v, step = np.zeros(3), np.zeros(3), np.zeros(3), 0
        for _ in range(2):
            gg = gr.double().numpy() + 0.01 * w
            if opt == "sgd":
                w = w - 0.1 * gg
            elif opt == "adagrad":
                s = s + gg * gg
                w = w - 0.1 * gg / (np.sqrt(s) + 1e-6)
            elif opt == "rowwise_adagrad":
                s = s + np.mean(gg * gg)
                w = w - 0.1 * gg / (np.sqrt(s) + 1e-6)
            else:
                step += 1
                m = 0.9 * m + 0.1 * gg
                v = 0.999 * v + 0.001 * gg * gg
                w = w - 0.1 * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-6)
        assert np.allclose(weight[r].double().numpy(), w, rtol=1e-5, atol=1e-6), opt
    if opt == "adam":
        assert state["step"].tolist() == [2.0, 0.0, 2.0, 0.0]


def test_dedup_and_bucketize_mod_and_range():
    keys = torch.tensor([9, 2, 7, 2, 0, 5, 9], dtype=torch.int64)
    u, inv = K.dedup(keys)
    assert u.tolist() == [0, 2, 5, 7, 9] and torch.equal(u[inv], keys)
    for partition in ("mod", "range"):
        order, counts, local = K.bucketize(keys, 10, 3, partition)
        shard = row_shard_of(keys.numpy(), 10, 3, partition)
        assert counts.tolist() == np.bincount(shard, minlength=3).tolist()
        assert shard[order.numpy()].tolist() == sorted(shard.tolist())
        for j in range(3):  # stable: original order kept inside a shard
            pos = order.numpy()[shard[order.numpy()] == j]
            assert pos.tolist() == sorted(pos.tolist())
        assert local.tolist() == local_row(keys.numpy(), 10, 3, partition).tolist()


def test_gather_and_scatter_add_rows():
    src = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    assert K.gather_rows(src, torch.tensor([3, 3, 0])).tolist() == [[6, 7], [6, 7], [0, 1]]
    dst = torch.zeros(2, 2)
    K.scatter_add_rows(dst, torch.tensor([1, 1, 0]), torch.ones(3, 2))
    assert dst.tolist() == [[1, 1], [2, 2]]


def test_exact_kernels_sum_in_fp64_so_the_order_of_partial_sums_does_not_matter():
    exact = TorchKernels(torch.float64)
    g = torch.Generator().manual_seed(5)
    weight = (torch.rand(100, 8, generator=g) - 0.5) * 0.1
    rows = torch.randint(0, 100, (60,), generator=g)
    w = torch.rand(60, generator=g)
    one_bag = torch.tensor([0, 60])
    for ids_w in (None, w):
        whole = exact.pooled_forward(weight, rows, one_bag, ids_w, "sum")
        assert whole.dtype == torch.float64
        # two "row shards" pooled apart, then summed in either order
        parts = [
            exact.pooled_forward(
                weight,
                rows[m],
                torch.tensor([0, int(m.sum())]),
                None if ids_w is None else ids_w[m],
                "sum",
            )
            for m in (rows % 2 == 0, rows % 2 == 1)
        ]
        for total in (parts[0] + parts[1], parts[1] + parts[0]):
            if ids_w is None:
                # sums of fp32 values of these magnitudes are exact in fp64: the same bits
                assert torch.equal(total, whole)
            else:
                # weighted: within fp64 rounding, and the same fp32 value
                assert torch.allclose(total, whole, rtol=0, atol=1e-15)
                assert torch.equal(total.float(), whole.float())
        # fp32 pooling of the same bag is within fp32 rounding of it
        assert torch.allclose(K.pooled_forward(weight, rows, one_bag, ids_w, "sum"), whole.float())
    rows_u, grads = exact.pooled_backward(
        torch.ones(1, 8, dtype=torch.float64), rows, one_bag, w, "mean", 100
    )
    assert grads.dtype == torch.float64 and torch.equal(rows_u, torch.unique(rows))
    with pytest.raises(ValueError, match="float32 or float64"):
        TorchKernels(torch.float16)


# --------------------------------------------------------------------------- init / storage


def test_initial_values_depend_only_on_coordinates_not_on_the_shard():
    init = InitParams()
    full = initial_values(7, "t", torch.arange(100), 0, 6, init)
    assert full.shape == (100, 6) and full.min() >= -0.05 and full.max() < 0.05
    part = initial_values(7, "t", torch.tensor([42, 3]), 2, 5, init)
    assert torch.equal(part, full[[42, 3], 2:5])
    assert not torch.equal(full, initial_values(8, "t", torch.arange(100), 0, 6, init))
    assert not torch.equal(full, initial_values(7, "u", torch.arange(100), 0, 6, init))
    # neighbouring rows and columns look independent: no visible correlation
    assert abs(float(torch.corrcoef(torch.stack([full[:-1, 0], full[1:, 0]]))[0, 1])) < 0.3
    assert abs(float(full.mean())) < 0.01


def test_initial_values_for_64_bit_rows_and_other_kinds():
    big = torch.tensor([(1 << 40) + 5, 5], dtype=torch.int64)
    v = initial_values(0, "t", big, 0, 4, InitParams())
    assert not torch.equal(v[0], v[1])
    n = initial_values(
        0, "t", torch.arange(20000), 0, 1, InitParams(kind="normal", mean=1.0, std=0.5)
    )
    assert abs(float(n.mean()) - 1.0) < 0.02 and abs(float(n.std()) - 0.5) < 0.02
    c = initial_values(0, "t", torch.arange(3), 0, 2, InitParams(kind="constant", value=0.25))
    assert torch.equal(c, torch.full((3, 2), 0.25))


def test_cells_of_any_grid_reassemble_the_same_table():
    plan = make_plan(
        [TableSpec("t", 23, 5, "rb", (3, 2))],
        [FeatureSpec("f", "t")],
        nodes=1,
        gpus_per_node=1,
        batch_size=2,
    )
    table = plan.table("t")
    whole = initial_values(0, "t", torch.arange(23), 0, 5, table.init)
    for partition in ("mod", "range"):
        out = torch.full((23, 5), float("nan"))
        for j in range(3):
            for lo, hi in ((0, 2), (2, 5)):
                cell = new_cell(table, j, 3, (lo, hi), partition, 0)
                out[global_rows(23, j, 3, partition), lo:hi] = cell.weight
        assert torch.equal(out, whole)


# --------------------------------------------------------------------------- distributor


def _feat(ids, offsets, pooling="sum", hot=0, weights=None):
    return FeatureInput(
        "f",
        "t",
        pooling,
        hot,
        torch.tensor(ids),
        torch.tensor(offsets),
        None if weights is None else torch.tensor(weights),
    )


def test_split_by_row_shard_keeps_bags_weights_and_concat_positions():
    f = _feat([4, 1, 6, 3, 8], [0, 3, 3, 5], "concat", 3, [0.1, 0.2, 0.3, 0.4, 0.5])
    parts = split_by_row_shard(K, f, 10, 2, "mod")
    assert parts[0].keys.tolist() == [4, 6, 8] and parts[1].keys.tolist() == [1, 3]
    assert parts[0].lengths.tolist() == [2, 0, 1] and parts[1].lengths.tolist() == [1, 0, 1]
    assert parts[0].positions.tolist() == [0, 2, 1] and parts[1].positions.tolist() == [1, 0]
    assert parts[1].weights.tolist() == pytest.approx([0.2, 0.4])
    assert parts[0].lengths.dtype == torch.int32


def test_unique_by_row_shard_dedups_per_destination_with_the_reverse_index():
    keys = torch.tensor([5, 2, 5, 8, 2, 3], dtype=torch.int64)
    s = unique_by_row_shard(K, keys, 9, 3, "range")
    assert torch.equal(s.unique[s.inverse], keys)
    assert [s.keys_of_shard(j).tolist() for j in range(3)] == [[2], [3, 5], [8]]


def test_concat_units_place_every_id_at_its_position():
    f = _feat([7, 8, 9], [0, 2, 3], "concat", 3)
    assert f.slot_offsets().tolist() == [0, 1, 2, 2, 3, 3, 3]


def _plan(**kw):
    tables = [TableSpec("t", 10, 4, "rb", (2, 1), kw.get("opt", "sgd"))]
    return make_plan(
        tables,
        [FeatureSpec("f", "t", 2, kw.get("pooling", "sum"), 2, kw.get("weighted", False))],
        nodes=1,
        gpus_per_node=1,
        batch_size=2,
    )


@pytest.mark.parametrize(
    "batch, message",
    [
        ({}, "no bags for feature `f`"),
        (
            {
                "f": Bag(np.array([1]), np.array([0, 1, 1])),
                "g": Bag(np.array([1]), np.array([0, 1])),
            },
            "feature `g` that the plan does not know",
        ),
        ({"f": Bag(np.array([1, 10]), np.array([0, 1, 2]))}, "id 10 is outside table `t` [0, 10)"),
        (
            {"f": Bag(np.array([1, 2]), np.array([0, 1, 1]))},
            "offsets must start at 0 and end at the number of ids",
        ),
        ({"f": Bag(np.array([1, 2]), np.array([0, 2, 1, 2]))}, "offsets must not decrease"),
        (
            {"f": Bag(np.array([1]), np.array([0, 1, 1]), np.array([1.0], dtype=np.float32))},
            "not weighted in the plan",
        ),
        ({"f": Bag(np.array([1.5]), np.array([0, 1, 1]))}, "must hold integers"),
    ],
)
def test_bad_batches_are_refused_with_a_message_naming_the_problem(batch, message):
    with pytest.raises(BatchError) as e:
        prepare_batch(_plan(), batch, "cpu")
    assert message in str(e.value)


def test_concat_bag_longer_than_its_hotness_is_refused():
    plan = _plan(pooling="concat")
    with pytest.raises(BatchError, match="concat of 2 ids but a bag has 3"):
        prepare_batch(plan, {"f": Bag(np.array([1, 2, 3]), np.array([0, 3, 3]))}, "cpu")


def test_rowwise_adagrad_with_split_columns_is_refused():
    plan = make_plan(
        [TableSpec("t", 10, 4, "rb", (1, 2), "rowwise_adagrad")],
        [FeatureSpec("f", "t")],
        nodes=1,
        gpus_per_node=1,
        batch_size=2,
    )
    with pytest.raises(PlanNotRunnable, match="rowwise_adagrad.*splits its columns"):
        ShardedEmbeddings(plan, 0, 1)


def test_world_size_mismatch_is_refused():
    plan = make_plan(
        [TableSpec("t", 10, 4, "ub")],
        [FeatureSpec("f", "t")],
        nodes=1,
        gpus_per_node=2,
        batch_size=2,
    )
    with pytest.raises(PlanNotRunnable, match="plan is for 2 ranks"):
        ShardedEmbeddings(plan, 0, 1, comm=Comm.local())


# --------------------------------------------------------------------------- one rank end to end


def _mixed_plan():
    tables = [
        TableSpec("a", 50, 8, "rb", (2, 2), "adagrad"),
        TableSpec("b", 30, 4, "ub", (2, 1), "adam", weight_decay=0.01),
        TableSpec("c", 20, 6, "dp", optimizer="sgd"),
        TableSpec("d", 40, 4, "dp", optimizer="rowwise_adagrad", exchange="sparse"),
    ]
    feats = [
        FeatureSpec("f0", "a", 2, "sum"),
        FeatureSpec("f1", "a", 2, "mean", weighted=True),
        FeatureSpec("f2", "b", 3, "concat", 3),
        FeatureSpec("f3", "b", 2, "mean"),
        FeatureSpec("f4", "c", 2, "sum"),
        FeatureSpec("f5", "d", 2, "concat", 2),
    ]
    return make_plan(tables, feats, nodes=1, gpus_per_node=1, batch_size=8)


def test_one_rank_training_equals_the_reference_and_moves_no_bytes():
    plan = _mixed_plan()
    emb, ref = ShardedEmbeddings(plan, 0, 1, seed=3), ReferenceEmbeddings(plan, seed=3)
    for step in range(3):
        batch = random_global_batch(plan, step)
        out, rout = emb(batch), ref(batch)
        g = torch.Generator().manual_seed(step)
        weights = {k: torch.randn(v.shape, generator=g) for k, v in rout.items()}
        for k in out:
            assert torch.allclose(out[k], rout[k], atol=1e-6), k
        sum((out[k] * w).sum() for k, w in weights.items()).backward()
        sum((rout[k] * w).sum() for k, w in weights.items()).backward()
        assert emb.bytes_moved() == {c.name: {"intra": 0, "inter": 0} for c in plan.clusters}
    for t in plan.tables:
        assert torch.allclose(
            emb.gather_table(t.name), ref.table_weights(t.name), rtol=1e-5, atol=1e-7
        )
        for name, s in emb.gather_state(t.name).items():
            assert torch.allclose(s, ref.table_state(t.name)[name], rtol=1e-5, atol=1e-7)


def test_one_rank_exact_mode_trains_the_reference_tables_bit_for_bit():
    """rb 2x2, ub, dp dense and sparse exchange, adagrad/adam/rowwise_adagrad, 12 steps."""
    plan = _mixed_plan()
    emb = ShardedEmbeddings(plan, 0, 1, seed=3, kernels=TorchKernels(torch.float64))
    ref = ReferenceEmbeddings(plan, seed=3, accum=torch.float64)
    for step in range(12):
        batch = random_global_batch(plan, step)
        out, rout = emb(batch), ref(batch)
        g = torch.Generator().manual_seed(step)
        weights = {
            k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in rout.items()
        }
        for k in out:
            assert out[k].dtype == rout[k].dtype == torch.float64, k
            assert torch.allclose(out[k], rout[k], rtol=1e-14, atol=1e-15), k
        sum((out[k] * w).sum() for k, w in weights.items()).backward()
        sum((rout[k] * w).sum() for k, w in weights.items()).backward()
    for t in plan.tables:
        assert torch.equal(emb.gather_table(t.name), ref.table_weights(t.name)), t.name
        for name, s in emb.gather_state(t.name).items():
            assert torch.equal(s, ref.table_state(t.name)[name]), (t.name, name)


def test_unused_output_still_updates_the_rows_it_touched_with_zero_gradient():
    plan = _mixed_plan()
    emb, ref = ShardedEmbeddings(plan, 0, 1), ReferenceEmbeddings(plan)
    batch = random_global_batch(plan, 0)
    emb(batch)["f0"].sum().backward()
    ref(batch)["f0"].sum().backward()
    for t in plan.tables:
        assert torch.allclose(
            emb.gather_table(t.name), ref.table_weights(t.name), rtol=1e-5, atol=1e-7
        )
        for name, s in emb.gather_state(t.name).items():
            assert torch.allclose(s, ref.table_state(t.name)[name], rtol=1e-5, atol=1e-7)


def test_cells_round_trip_through_load_cells():
    pytest.importorskip("embark_runtime.checkpoint")
    plan = _mixed_plan()
    a, b = ShardedEmbeddings(plan, 0, 1, seed=1), ShardedEmbeddings(plan, 0, 1, seed=2)
    batch = random_global_batch(plan, 0)
    sum(v.sum() for v in a(batch).values()).backward()
    b.load_cells(a.cells())
    for t in plan.tables:
        assert torch.equal(a.gather_table(t.name), b.gather_table(t.name))
        for name, s in a.gather_state(t.name).items():
            assert torch.equal(s, b.gather_state(t.name)[name])
    with pytest.raises(ValueError, match="no values given for cell"):
        b.load_cells(a.cells()[:1])


def test_traffic_accounting():
    comm = Comm.local()
    t = Traffic()
    comm.all_to_all([torch.ones(3)], [3], traffic=t, cluster="c")
    assert t.as_dict() == {}  # messages to oneself are free
    t.add("c", True, 5)
    t.add("c", False, 7)
    assert t.as_dict() == {"c": {"intra": 5, "inter": 7}}
    assert math.isclose(Comm(1, 4, 2, torch.device("cpu")).node_of(3), 1)
    assert Comm(1, 4, 2, torch.device("cpu")).peers("rail") == [1, 3]


def test_hierarchical_all_reduce_and_rail_all_gather_on_one_rank_and_misuse():
    comm = Comm.local(gpus_per_node=2)
    t = Traffic()
    x = torch.arange(6.0)
    assert comm.hierarchical_all_reduce(x, traffic=t, cluster="c", segments=[4, 2]) is x
    assert torch.equal(x, torch.arange(6.0)) and t.as_dict() == {}
    got = comm.rail_all_gather(torch.arange(3), traffic=t, cluster="c")
    assert [g.tolist() for g in got] == [[0, 1, 2]] and t.as_dict() == {}
    with pytest.raises(CommError, match="do not add up"):
        comm.hierarchical_all_reduce(x, segments=[4, 1])
    with pytest.raises(CommError, match="contiguous"):
        comm.hierarchical_all_reduce(torch.zeros(3, 4).t())
    assert chunk_bounds(7, 3) == [0, 3, 5, 7] and chunk_bounds(2, 4) == [0, 1, 2, 2, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_training_on_cuda_equals_the_cpu_reference():
    plan = _mixed_plan()
    emb, ref = (
        ShardedEmbeddings(plan, 0, 1, seed=3, device="cuda"),
        ReferenceEmbeddings(plan, seed=3),
    )
    for step in range(2):
        batch = random_global_batch(plan, step)
        out, rout = emb(batch), ref(batch)
        sum(v.sum() for v in out.values()).backward()
        sum(v.sum() for v in rout.values()).backward()
    for t in plan.tables:
        assert torch.allclose(
            emb.gather_table(t.name).cpu(), ref.table_weights(t.name), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_tables_train_like_the_reference(dtype):
    """Weights stored in the table's dtype, computed and updated in fp32: equal to the
    reference up to one rounding of the stored dtype."""
    plan = _mixed_plan()
    plan = plan.model_copy(
        update={"tables": [t.model_copy(update={"dtype": dtype}) for t in plan.tables]}
    )
    emb, ref = ShardedEmbeddings(plan, 0, 1), ReferenceEmbeddings(plan)
    for step in range(2):
        batch = random_global_batch(plan, step)
        sum(v.sum() for v in emb(batch).values()).backward()
        sum(v.sum() for v in ref(batch).values()).backward()
    ulp = {"fp16": 2**-10, "bf16": 2**-7}[dtype]
    for t in plan.tables:
        got, want = emb.gather_table(t.name), ref.table_weights(t.name)
        assert emb._cluster_of(t.name).cells and got.dtype == torch.float32
        assert torch.allclose(got, want, rtol=2 * ulp, atol=1e-6), t.name


@pytest.mark.parametrize(
    ("device", "backend"), [("cpu", "gloo"), (None, "nccl"), ("cuda:0", "nccl")]
)
def test_init_distributed_picks_the_backend_from_the_device(monkeypatch, device, backend):
    """On a CUDA machine, `train.py --device cpu` must join with gloo: NCCL moves only
    CUDA tensors."""
    import torch.distributed as dist

    from embark_runtime import comm as comm_mod

    class Joined(Exception):
        pass

    chosen = []

    def fake_init(name, **kw):
        chosen.append(name)
        raise Joined

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "0" if k != "MASTER_ADDR" else "127.0.0.1")
    with pytest.raises(Joined):
        comm_mod.init_distributed(_mixed_plan(), device=device)
    assert chosen == [backend]


def test_row_shard_of_keeps_int32_keys_int32_with_the_int64_answer():
    keys = np.array([0, 5, 17, 2**31 - 2], dtype=np.int64)
    for partition in ("mod", "range"):
        wide = row_shard_of(keys, 2**31 - 1, 3, partition)
        narrow = row_shard_of(keys.astype(np.int32), 2**31 - 1, 3, partition)
        assert wide.dtype == np.int64 and narrow.dtype == np.int32
        assert narrow.tolist() == wide.tolist()
    assert row_shard_of([4, 5], 10, 2, "mod").dtype == np.int64  # lists become int64
