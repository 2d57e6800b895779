"""embark_runtime.synthetic: determinism, rank slicing and the documented distributions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from embark_runtime.keys import permute
from embark_runtime.plan import Plan
from embark_runtime.synthetic import SyntheticData, ZipfSampler, length_cdf, uniforms


def make_plan(features: list[dict[str, Any]], tables: list[dict[str, Any]], batch: int = 64):
    return Plan.model_validate(
        dict(
            source=dict(spec="t", sha256="0"),
            topology=dict(
                nodes=1,
                gpus_per_node=4,
                hbm_bytes=1 << 40,
                hbm_bandwidth=1e12,
                intra_node_bandwidth=1e11,
                inter_node_bandwidth=1e10,
            ),
            batch_size=batch,
            tables=tables,
            features=features,
            clusters=[dict(name="dp0", kind="dp", tables=[t["name"] for t in tables])],
            shards=[],
            estimate=dict(step_time=0.0, per_rank=[]),
            planner=dict(strategy="t", solver="t", status="greedy"),
        )
    )


ZIPF = {"kind": "zipf", "alpha": 1.1, "permuted": True}


@pytest.fixture
def mixed_plan() -> Plan:
    tables = [
        dict(name="a", rows=1000, dim=8),
        dict(name="b", rows=50, dim=8),
        dict(name="c", rows=300, dim=4),
    ]
    features = [
        dict(name="fa", table="a", hotness=3, max_hotness=3, access=ZIPF),
        dict(
            name="fb",
            table="b",
            hotness=2.5,
            max_hotness=6,
            fixed=False,
            weighted=True,
            access={"kind": "uniform"},
        ),
        dict(
            name="fc",
            table="c",
            hotness=1,
            access={"kind": "histogram", "keys": [5, 7, 299], "counts": [1, 3, 6]},
        ),
        dict(
            name="fa2",
            table="a",
            hotness=2,
            pooling="mean",
            access={"kind": "zipf", "alpha": 0.8, "permuted": False},
        ),
    ]
    return make_plan(features, tables, batch=64)


def test_rank_slices_concatenate_to_the_global_batch_for_any_world(mixed_plan: Plan) -> None:
    data = SyntheticData(mixed_plan, seed=3)
    g = data.global_batch(5)
    for world in (1, 2, 4, 8):
        parts = [data.batch(5, r, world) for r in range(world)]
        np.testing.assert_array_equal(np.concatenate([p.dense for p in parts]), g.dense)
        np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), g.labels)
        for name, bag in g.sparse.items():
            np.testing.assert_array_equal(
                np.concatenate([p.sparse[name].ids for p in parts]), bag.ids
            )
            lengths = np.concatenate([p.sparse[name].lengths for p in parts])
            np.testing.assert_array_equal(lengths, bag.lengths)
            if bag.weights is not None:
                np.testing.assert_array_equal(
                    np.concatenate([p.sparse[name].weights for p in parts]), bag.weights
                )


def test_same_seed_same_data_other_seed_or_step_other_data(mixed_plan: Plan) -> None:
    a = SyntheticData(mixed_plan, seed=1).global_batch(0)
    b = SyntheticData(mixed_plan, seed=1).global_batch(0)
    c = SyntheticData(mixed_plan, seed=2).global_batch(0)
    d = SyntheticData(mixed_plan, seed=1).global_batch(1)
    np.testing.assert_array_equal(a.sparse["fa"].ids, b.sparse["fa"].ids)
    np.testing.assert_array_equal(a.dense, b.dense)
    assert not np.array_equal(a.sparse["fa"].ids, c.sparse["fa"].ids)
    assert not np.array_equal(a.sparse["fa"].ids, d.sparse["fa"].ids)
    assert not np.array_equal(a.dense, d.dense)


def test_shapes_dtypes_and_ranges(mixed_plan: Plan) -> None:
    g = SyntheticData(mixed_plan, dense_features=5).batch(0, 1, 2)
    assert g.dense.shape == (32, 5) and g.dense.dtype == np.float32
    assert ((g.dense >= 0) & (g.dense < 1)).all()
    assert g.labels.dtype == np.float32 and set(np.unique(g.labels)) <= {0.0, 1.0}
    for name, rows in (("fa", 1000), ("fb", 50), ("fc", 300), ("fa2", 1000)):
        bag = g.sparse[name]
        assert bag.ids.dtype == np.int64 and bag.offsets.dtype == np.int64
        assert bag.offsets[0] == 0 and bag.offsets[-1] == len(bag.ids) and len(bag.offsets) == 33
        assert ((bag.ids >= 0) & (bag.ids < rows)).all()
    assert g.sparse["fa"].weights is None
    w = g.sparse["fb"].weights
    assert w is not None and w.dtype == np.float32 and ((w >= 0.5) & (w < 1.5)).all()
    assert (g.sparse["fa"].lengths == 3).all() and (g.sparse["fa2"].lengths == 2).all()
    assert set(np.unique(g.sparse["fc"].ids)) <= {5, 7, 299}


def test_variable_bag_lengths_lie_in_range_with_the_stated_mean() -> None:
    cdf = length_cdf(2.5, 6)
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    assert np.dot(np.arange(1, 7), pmf) == pytest.approx(2.5, rel=1e-12)
    tables = [dict(name="a", rows=100, dim=4)]
    features = [
        dict(
            name="f", table="a", hotness=2.5, max_hotness=6, fixed=False, access={"kind": "uniform"}
        )
    ]
    bag = SyntheticData(make_plan(features, tables, batch=20000)).global_batch(0).sparse["f"]
    assert bag.lengths.min() == 1 and bag.lengths.max() <= 6
    assert bag.lengths.mean() == pytest.approx(2.5, abs=0.03)


@pytest.mark.parametrize("alpha", [1.1, 1.0, 0.7])
def test_zipf_sampler_matches_its_documented_probabilities(alpha: float) -> None:
    z = ZipfSampler(200_000, alpha)
    assert z.probability(np.arange(200_000)).sum() == pytest.approx(1.0, abs=1e-12)
    u = uniforms(99, np.arange(400_000))
    r = z.sample(u)
    assert r.min() >= 0 and r.max() < 200_000
    for lo, hi in ((0, 1), (1, 10), (10, 1000), (1000, 65536), (65536, 200_000)):
        expect = z.probability(np.arange(lo, hi)).sum()
        got = np.mean((r >= lo) & (r < hi))
        assert got == pytest.approx(expect, abs=4 * np.sqrt(expect / len(u)) + 1e-4)


def test_zipf_on_a_500m_row_table_is_light_and_in_range() -> None:
    z = ZipfSampler(500_000_000, 1.05)
    r = z.sample(uniforms(1, np.arange(100_000)))
    assert r.min() >= 0 and r.max() < 500_000_000 and r.max() > 1_000_000
    assert z.head_cum.nbytes <= 1 << 20


def test_permuted_zipf_puts_rank_zero_at_the_permuted_key() -> None:
    tables = [dict(name="x", rows=10, dim=4), dict(name="y", rows=5000, dim=4)]
    features = [
        dict(name="fy", table="y", hotness=4, access=ZIPF),
        dict(
            name="fs",
            table="y",
            hotness=4,
            access={"kind": "zipf", "alpha": 1.1, "permuted": False},
        ),
    ]
    g = SyntheticData(make_plan(features, tables, batch=4096)).global_batch(0)
    top = np.bincount(g.sparse["fy"].ids, minlength=5000).argmax()
    assert top == permute(np.array([0]), 5000, 1)[0]
    assert np.bincount(g.sparse["fs"].ids, minlength=5000).argmax() == 0


def test_histogram_frequencies_follow_counts(mixed_plan: Plan) -> None:
    plan = mixed_plan.model_copy(update={"batch_size": 6000})
    ids = SyntheticData(plan).global_batch(0).sparse["fc"].ids
    freq = [np.mean(ids == k) for k in (5, 7, 299)]
    np.testing.assert_allclose(freq, [0.1, 0.3, 0.6], atol=0.02)


def test_labels_depend_on_the_sparse_features() -> None:
    tables = [dict(name="a", rows=200, dim=4)]
    features = [dict(name="f", table="a", hotness=1, access={"kind": "uniform"})]
    data = SyntheticData(make_plan(features, tables, batch=8000), dense_features=0)
    g = data.global_batch(0)
    score = data.key_scores("a", g.sparse["f"].ids)
    assert 0.2 < g.labels.mean() < 0.8
    assert np.corrcoef(score, g.labels)[0, 1] > 0.5


def test_uneven_split_and_bad_histogram_are_clear_errors(mixed_plan: Plan) -> None:
    data = SyntheticData(mixed_plan)
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        data.batch(0, 0, 3)
    with pytest.raises(ValueError, match="rank 4 is not in"):
        data.batch(0, 4, 4)
    tables = [dict(name="a", rows=10, dim=4)]
    features = [
        dict(
            name="f",
            table="a",
            hotness=1,
            access={"kind": "histogram", "keys": [3, 10], "counts": [1, 1]},
        )
    ]
    with pytest.raises(ValueError, match=r"histogram keys must lie in \[0, 10\)"):
        SyntheticData(make_plan(features, tables))
