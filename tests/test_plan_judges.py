"""bench/plan_judges.py's judges: ours reproduces the simulator, the others convert the
same counts by their own rules (checked on hand-made counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_simulate import make_hub_plan, make_plan

from embarkc.planner import constants as C
from embarkc.simulate import RankCounts, dense_shape, key_window, simulate
from tests.conftest import load_module

BENCH = Path(__file__).resolve().parent.parent / "bench" / "plan_judges.py"


@pytest.fixture(scope="module")
def bench():
    return load_module(BENCH)


def _with_window(plan, seconds: float):  # type: ignore[no-untyped-def]
    """`plan` with the dense rate that makes its key window `seconds` long."""
    shape = dense_shape(plan)
    assert shape is not None
    bottom, rest = shape.forward_flops()
    flops = (rest + C.BACKWARD_FLOPS_FACTOR * (bottom + rest)) * plan.batch_size / plan.world_size
    rate = flops / (C.DENSE_EFFICIENCY * seconds)
    out = plan.model_copy(
        update={"topology": plan.topology.model_copy(update={"dense_flops": rate})}
    )
    assert key_window(out) == pytest.approx(seconds)
    return out


@pytest.mark.parametrize("window", [0.0, 2e-6])
def test_the_embarkc_judge_is_the_simulators_step_time(bench, window: float) -> None:
    plans = [make_plan(nodes=n, gpus=g) for n, g in ((2, 2), (1, 4))]
    plans += [make_hub_plan("hierarchical", n, g) for n, g in ((2, 2), (1, 4))]
    for plan in plans:
        if window:
            plan = _with_window(plan, window)
        res = simulate(plan, batches=2, seed=3)
        ours = bench.step_seconds(plan, res, bench.Judge("embarkc"))
        assert ours == pytest.approx(res.step_time, rel=1e-12)
        by = {j.name: bench.step_seconds(plan, res, j) for j in bench.JUDGES}
        # overlapping links can only shorten a step, slower hardware only lengthen it
        assert by["pipelined"] <= by["concurrent links"] <= by["embarkc"]
        assert by["pipelined"] < by["embarkc"]
        assert by["keys hidden"] <= by["embarkc"]
        # waiting for every rank at the forward all-to-all, then at every phase, can only
        # lengthen a step
        assert by["embarkc"] <= by["forward waits"] <= by["phases wait"]
        # a shorter window hides less
        assert by["embarkc"] <= by["dense x8 faster"] <= by["keys in full"]
        assert (by["embarkc"] < by["keys in full"]) == (window > 0)
        for slower in ("network x0.5", "hbm x0.5", "nvlink x0.5", "latency x5"):
            assert by[slower] >= by["embarkc"]
        assert by["hbm x0.5"] > by["embarkc"]


def test_judges_convert_hand_made_counts(bench) -> None:
    plan = make_plan(nodes=2, gpus=2)  # five clusters: 3 all-to-all (1 hierarchical), 2 dp
    topo = plan.topology
    bw_h = topo.hbm_bandwidth * C.HBM_EFFICIENCY
    bw_i = topo.intra_node_bandwidth * C.NVLINK_EFFICIENCY
    bw_n = topo.inter_node_bandwidth * C.NETWORK_EFFICIENCY
    rc = RankCounts(
        rank=0,
        hbm_bytes=bw_h * 1e-3,  # 1 ms of HBM
        sent={
            "distributor": {"intra": bw_i * 2e-4, "inter": bw_n * 1e-4},
            "forward": {"intra": bw_i * 1e-4, "inter": bw_n * 3e-4},
        },
        received={
            "distributor": {"intra": bw_i * 1e-4, "inter": bw_n * 4e-4},
            "backward": {"intra": bw_i * 1e-4, "inter": bw_n * 3e-4},
        },
    )
    ring = (5e-5, 6e-5)
    call = C.COLLECTIVE_LATENCY_SECONDS + C.INTER_NODE_LATENCY_SECONDS
    launches = (3 * (3 + 1) + 2 * 1) * C.KERNEL_LAUNCH_SECONDS
    fixed = launches + (3 + 2 * 3 + 2 * 1 + 1) * call
    # links per phase (NVLink, NIC): distributor (2, 4), forward (1, 3), backward (1, 3)
    serial = 1e-3 + (2 + 4 + 1 + 3 + 1 + 3) * 1e-4 + sum(ring) + fixed
    concurrent = 1e-3 + (4 + 3 + 3) * 1e-4 + sum(ring) + fixed
    pipelined = max(1e-3, (2 + 1 + 1) * 1e-4 + ring[0], (4 + 3 + 3) * 1e-4 + ring[1]) + fixed
    J = bench.Judge
    assert bench.rank_seconds(plan, rc, ring, J("embarkc")) == pytest.approx(serial)
    assert bench.rank_seconds(plan, rc, ring, J("c", links="concurrent")) == pytest.approx(
        concurrent
    )
    assert bench.rank_seconds(plan, rc, ring, J("p", links="pipelined")) == pytest.approx(pipelined)
    slow_net = serial + (4 + 3 + 3) * 1e-4  # the NIC terms double; the ring is given
    assert bench.rank_seconds(plan, rc, ring, J("n", network=0.5)) == pytest.approx(slow_net)
    assert bench.rank_seconds(plan, rc, ring, J("h", hbm=0.5)) == pytest.approx(serial + 1e-3)
    assert bench.rank_seconds(plan, rc, ring, J("l", latency=5.0)) == pytest.approx(
        serial + 4 * fixed
    )
    # keys hidden: the chain without the key phase (1 + 0.8 ms) beats the NIC's total
    chain = 1e-3 + (1 + 3 + 1 + 3) * 1e-4 + sum(ring)
    assert bench.rank_seconds(plan, rc, ring, J("k", keys_hidden=True)) == pytest.approx(
        max(chain, (4 + 3 + 3) * 1e-4 + ring[1]) + fixed - 3 * call
    )
    # a dense compute window of 0.4 ms: the serial key phase (0.6 ms) hides but 0.2 ms,
    # the concurrent one (0.4 ms) whole; a window an eighth as long hides 0.05 ms
    wplan = _with_window(plan, 4e-4)
    assert bench.rank_seconds(wplan, rc, ring, J("embarkc")) == pytest.approx(serial - 4e-4)
    assert bench.rank_seconds(wplan, rc, ring, J("c", links="concurrent")) == pytest.approx(
        concurrent - 4e-4
    )
    assert bench.rank_seconds(wplan, rc, ring, J("f", window=0.0)) == pytest.approx(serial)
    assert bench.rank_seconds(wplan, rc, ring, J("x", window=0.125)) == pytest.approx(
        serial - 0.5e-4
    )
    # pipelined: each link's total less the keys it carries in the window (NVLink's
    # 0.2 ms whole, the NIC's 0.4 ms up to the window): HBM decides
    assert bench.rank_seconds(wplan, rc, ring, J("p", links="pipelined")) == pytest.approx(
        1e-3 + fixed
    )
    # keys hidden: the links' totals less the window (NIC 1.06 - 0.4 ms) stay below the
    # chain without the key phase
    assert bench.rank_seconds(wplan, rc, ring, J("k", keys_hidden=True)) == pytest.approx(
        chain + fixed - 3 * call
    )
    # a hierarchical ub cluster: one more key call, two more result calls, three launches
    # (and nothing more on one node, where it is flat ub)
    hub = make_hub_plan("hierarchical")
    more = 3 * C.KERNEL_LAUNCH_SECONDS + (1 + 2) * call
    assert bench.rank_seconds(hub, rc, ring, J("embarkc")) == pytest.approx(serial + more)
    assert bench.rank_seconds(hub, rc, ring, J("k", keys_hidden=True)) == pytest.approx(
        max(chain, (4 + 3 + 3) * 1e-4 + ring[1]) + fixed + more - 4 * call
    )
    one, one_flat = make_hub_plan("hierarchical", 1, 4), make_hub_plan("flat", 1, 4)
    assert bench.rank_seconds(one, rc, ring, J("embarkc")) == bench.rank_seconds(
        one_flat, rc, ring, J("embarkc")
    )
    busy = RankCounts(
        rank=0,
        hbm_bytes=0.0,
        sent={"distributor": {"intra": 0.0, "inter": bw_n * 2e-3}},
        received={"forward": {"intra": 0.0, "inter": bw_n * 1e-3}},
    )
    # ... and here the NIC's total, keys included, decides
    assert bench.rank_seconds(plan, busy, (0.0, 0.0), J("k", keys_hidden=True)) == pytest.approx(
        3e-3 + fixed - 3 * call
    )
    # ... less the window, in which the NIC carries only keys
    assert bench.rank_seconds(wplan, busy, (0.0, 0.0), J("k", keys_hidden=True)) == pytest.approx(
        3e-3 - 4e-4 + fixed - 3 * call
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--topologies", "3x"], "topology '3x' is not NODESxGPUS"),
        (["--topologies", "0x8"], "topology '0x8' is not NODESxGPUS"),
        (["--batches", "0"], "'0' is not a positive int"),
        (["--time-limit", "soon"], "'soon' is not a positive float"),
    ],
)
def test_bad_arguments_are_refused_before_any_planning(bench, capsys, args, says) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_synchronising_judges_wait_for_the_slowest_rank_of_each_phase(bench) -> None:
    """Two ranks that trade HBM work against the NIC: ours adds each rank's phases, the
    synchronising judges take the slowest rank of each phase (hand-computed)."""
    plan = make_plan(nodes=2, gpus=2)
    topo = plan.topology
    bw_h = topo.hbm_bandwidth * C.HBM_EFFICIENCY
    bw_n = topo.inter_node_bandwidth * C.NETWORK_EFFICIENCY
    ms = 1e-3

    def counts(rank: int, hbm: float, keys: float, fwd: float, bwd: float) -> RankCounts:
        return RankCounts(
            rank=rank,
            hbm_bytes=bw_h * hbm * ms,
            sent={
                "distributor": {"inter": bw_n * keys * ms},
                "forward": {"inter": bw_n * fwd * ms},
            },
            received={"backward": {"inter": bw_n * bwd * ms}},
        )

    heavy_hbm = counts(0, hbm=3.0, keys=0.5, fwd=0.25, bwd=0.25)
    heavy_net = counts(1, hbm=1.0, keys=0.1, fwd=1.0, bwd=1.5)
    res = type("R", (), {"per_rank": [heavy_hbm, heavy_net]})()
    J = bench.Judge
    fixed = bench._parts(plan, heavy_hbm, J("embarkc"), 0.0).fixed
    by = {
        sync: bench.synchronized_seconds(plan, res.per_rank, (0.0, 0.0), J(sync, sync=sync), 0.0)
        for sync in ("forward", "phases")
    }
    # ours: the slowest rank's sum, rank 0: 3 + 0.5 + 0.25 + 0.25 = 4.0 ms (rank 1: 3.6 ms)
    ours = max(bench.rank_seconds(plan, rc, (0.0, 0.0), J("embarkc"), 0.0) for rc in res.per_rank)
    assert ours == pytest.approx(4.0 * ms + fixed)
    # forward waits: the slowest chain of backward + HBM (rank 0: 3.25, rank 1: 2.5 ms),
    # then the slowest forward (rank 1, 1 ms) and the slowest key phase (rank 0, 0.5 ms)
    assert by["forward"] == pytest.approx((3.25 + 1.0 + 0.5) * ms + fixed)
    # phases wait: 3 (HBM) + 0.5 (keys) + 1 (forward) + 1.5 (backward)
    assert by["phases"] == pytest.approx((3.0 + 0.5 + 1.0 + 1.5) * ms + fixed)
    # a dense compute window of 0.4 ms hides that much of the slowest key phase
    plan4 = _with_window(plan, 4e-4)
    w = bench.synchronized_seconds(plan4, res.per_rank, (0.0, 0.0), J("f", sync="forward"), 4e-4)
    assert w == pytest.approx((3.25 + 1.0 + 0.1) * ms + fixed)
