"""The dense part's arithmetic (embarkc.dense) and the key phase it hides: the count of
FLOPs against torch's own FLOP counter, hand-computed cases, and the same window in the
cost model, the simulator and the plan file."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embark_runtime.dense import DenseConfig, DLRMDense
from embarkc.dense import DenseShape, prefetch_window
from embarkc.frontend import load_program
from embarkc.planner import constants as K
from embarkc.planner import plan_program
from embarkc.planner.cost import CostModel, dense_shape, layout_of_plan
from embarkc.planner.search.place import unit_cells
from embarkc.planner.search.starts import column_start
from embarkc.planner.search.tuning import COLUMN_SHARES
from embarkc.simulate import dense_parameters, key_window, simulate, step_time_of
from tests.conftest import ROOT, keys_in_full

SHAPES = [
    # dot with a projected feature, no bottom MLP, dcnv2 (the paper's two interactions)
    DenseShape(13, (512, 256, 64), "dot", (512, 256, 1), (64, 64, 32, 64)),
    DenseShape(0, (), "dot", (512, 256, 1), (64,) * 8),
    DenseShape(13, (512, 256, 128), "dcnv2", (1024, 512, 256, 1), (128,) * 6, 3, 256),
]


def _torch_model(s: DenseShape) -> DLRMDense:
    return DLRMDense(
        DenseConfig(
            dense_features=s.dense_features,
            bottom_mlp=s.bottom_mlp,
            interaction=s.interaction,
            top_mlp=s.top_mlp,
            feature_widths=s.feature_widths,
            cross_layers=s.cross_layers,
            low_rank=s.low_rank,
        )
    )


def test_a_small_model_by_hand() -> None:
    """Bottom 2 -> 4, features of width 4 and 2 (projected to 4), dot, top 7 -> 3 -> 1."""
    s = DenseShape(2, (4,), "dot", (3, 1), (4, 2))
    bottom = 2 * 2 * 4 + 2 * 4  # multiply-adds, then bias and ReLU per output
    rest = (
        2 * 2 * 4  # the bias-free projection of the width-2 feature
        + 2 * 3 * 3 * 4  # the 3 x 3 Gram matrix of width-4 vectors
        + (2 * 7 * 3 + 2 * 3)  # top: 4 + 3 pairs in, 3 out
        + (2 * 3 * 1 + 2 * 1)  # the logit
    )
    assert s.forward_flops() == (bottom, rest)
    assert s.parameters() == (2 * 4 + 4) + 2 * 4 + (7 * 3 + 3) + (3 + 1)
    assert s.parameters() == sum(p.numel() for p in _torch_model(s).parameters())
    # the window: the rest's forward and everything's backward, at the efficiency
    w = prefetch_window(s, 1000, 1e9, K.DENSE_EFFICIENCY)
    want = (rest + K.BACKWARD_FLOPS_FACTOR * (bottom + rest)) * 1000 / (1e9 * K.DENSE_EFFICIENCY)
    assert w == pytest.approx(want)
    assert prefetch_window(s, 1000, 0.0, K.DENSE_EFFICIENCY) == 0.0  # no dense rate: nothing hides


@pytest.mark.parametrize("shape", SHAPES, ids=["dot", "dot-no-bottom", "dcnv2"])
def test_flops_match_torchs_flop_counter(shape: DenseShape) -> None:
    """torch's FlopCounterMode counts the matmuls of the real model, forward and backward:
    ours adds bias, ReLU and elementwise terms (under 2 % here) and takes the backward
    as twice the forward (the first layer's missing input gradient makes it a little
    less)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = _torch_model(shape)
    b = 64
    dense = torch.randn(b, shape.dense_features)
    embedded = [torch.randn(b, w, requires_grad=True) for w in shape.feature_widths]
    with FlopCounterMode(display=False) as fc:
        bottom = model.bottom_forward(dense)
    bottom_flops = fc.get_total_flops() / b
    with FlopCounterMode(display=False) as fc:
        out = model(dense, embedded, bottom=bottom)
    rest_flops = fc.get_total_flops() / b
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    backward = fc.get_total_flops() / b
    ours_bottom, ours_rest = shape.forward_flops()
    assert bottom_flops <= ours_bottom <= 1.02 * bottom_flops + 1
    assert rest_flops <= ours_rest <= 1.02 * rest_flops
    forward = bottom_flops + rest_flops
    assert 0.9 * K.BACKWARD_FLOPS_FACTOR * forward <= backward
    assert backward <= K.BACKWARD_FLOPS_FACTOR * forward


@pytest.mark.parametrize("spec", ["dcnv2", "t180", "t200", "t510"])
def test_planner_and_simulator_share_the_dense_model(spec: str) -> None:
    """One description of the dense part: the planner's all-reduce and window and the
    simulator's are the same numbers, from the spec and from the plan file."""
    program = load_program(ROOT / "specs" / "paper" / f"{spec}.embark")
    cm = CostModel(program)
    plan = plan_program(program, solver="greedy", strategy="table-wise")
    assert plan.topology.dense_flops == 67e12  # dgx_h100's fp32 rate
    assert dense_shape(program).parameters() == dense_parameters(plan)
    assert cm.key_window == pytest.approx(key_window(plan), rel=1e-12)
    assert cm.key_window > 1e-3  # fp32 DLRMs: milliseconds of dense compute


def test_the_cost_model_hides_keys_within_the_window_only() -> None:
    """With a window of the median rank's key time, ranks below it pay only the key
    phase's latencies and ranks above pay the excess; nothing else changes."""
    program = load_program(ROOT / "specs" / "paper" / "dcnv2.embark")
    full = CostModel(keys_in_full(program))
    layout = layout_of_plan(plan_program(program, solver="greedy", strategy="column-wise"))
    before = full.layout_state(layout).components()
    latency = full.collective_latency  # one rb all-to-all in a column-wise plan
    keys = before["distributor"] - latency
    assert keys.min() > 0
    hidden = CostModel(keys_in_full(program))
    hidden.key_window = float(np.median(keys))
    after = hidden.layout_state(layout).components()
    want = np.maximum(keys - hidden.key_window, 0.0) + latency
    np.testing.assert_allclose(after["distributor"], want, rtol=1e-12, atol=1e-15)
    assert np.isclose(after["distributor"], latency, rtol=1e-9).sum() >= len(keys) // 2
    assert (after["distributor"] > latency * 1.01).any()
    for k in before:
        if k != "distributor":
            np.testing.assert_array_equal(after[k], before[k])


def test_the_simulator_hides_the_same_key_time() -> None:
    from tests.test_simulate import make_plan

    plan = make_plan()  # no dense rate in the plan: the window is 0
    assert key_window(plan) == 0.0
    sent = {"distributor": {"intra": 3e9, "inter": 1e9}}
    recv = {"distributor": {"intra": 1e9, "inter": 2e9}}
    nv, net = 3e11 * K.NVLINK_EFFICIENCY, 2.5e10 * K.NETWORK_EFFICIENCY
    call = K.COLLECTIVE_LATENCY_SECONDS + K.INTER_NODE_LATENCY_SECONDS
    links = 3e9 / nv + 2e9 / net
    for window, want in ((0.0, links), (0.5 * links, 0.5 * links), (2 * links, 0.0)):
        got = step_time_of(plan, 0.0, sent, recv, window=window)
        assert got["distributor"] == pytest.approx(want + 3 * call)


def test_a_plan_without_a_dense_rate_charges_the_keys_in_full() -> None:
    """Plans written before `topology.dense_flops` load with 0 (no overlap): simulating
    one gives the key phase in full; the same plan with the rate hides it."""
    import json

    from embark_runtime.plan import Plan

    program = load_program(ROOT / "specs" / "paper" / "dcnv2.embark")
    plan = plan_program(program, solver="greedy", strategy="column-wise")
    data = json.loads(plan.model_dump_json())
    del data["topology"]["dense_flops"]
    old = Plan.model_validate(data)
    assert old.topology.dense_flops == 0.0
    a = simulate(plan, batches=1)
    b = simulate(old, batches=1)
    crit = b.per_rank[b.critical_rank]
    assert crit.components["distributor"] > a.per_rank[b.critical_rank].components["distributor"]
    assert b.step_time > a.step_time


@pytest.mark.parametrize("share", COLUMN_SHARES)
def test_the_column_start_cuts_heavy_units_into_cells_of_the_share(share: float) -> None:
    program = load_program(ROOT / "specs" / "paper" / "t200.embark")
    cm = CostModel(program)
    from embarkc.planner.clusters import initial_grid, units_of
    from embarkc.planner.search.place import Decision

    units = units_of(cm)
    start = {u.name: Decision("rb", *initial_grid(cm, u)) for u in units}
    out = column_start(cm, units, start, share)
    loads = {u.name: float(unit_cells(cm, u, start[u.name])[0].sum()) for u in units}
    piece = share * sum(loads.values()) / cm.W
    cut = [u for u in units if out[u.name] != start[u.name]]
    assert cut  # the hot 50M-row tables
    for u in units:
        d, e = start[u.name], out[u.name]
        assert (e.kind, e.r, e.comm) == (d.kind, d.r, d.comm)
        cells = unit_cells(cm, u, e)[0]
        if e.c < u.max_c:
            # per-id costs do not shrink with the width: a little over the piece
            assert cells.max() <= piece * 1.25 or e == d
            if e != d:
                assert unit_cells(cm, u, replace(e, c=e.c - 1))[0].max() > piece
        if loads[u.name] <= piece:
            assert e == d
