"""The critical path (every phase waits for its slowest rank) and the planner's last
pass, which lowers it without raising the step time (`greedy.balanced_phases`)."""

from __future__ import annotations

import numpy as np
import pytest

import embarkc.planner.search.finish as search_finish
import embarkc.planner.search.place as search_place
from embarkc.frontend import load_program
from embarkc.planner import plan_program
from embarkc.planner.cost import COMPONENTS, PHASE_GROUPS, CostModel, RankState
from embarkc.planner.search.finish import balanced_phases
from embarkc.planner.search.runs import greedy
from embarkc.workload import program_from_workload
from tests.conftest import ROOT, SHARED


def test_the_critical_path_takes_each_phase_at_its_slowest_rank():
    """Rank 0 is busy in HBM, rank 1 on the network: each rank's sum is at most 4.2 ms,
    but a step whose phases wait for every rank takes 3 + 0.5 + 2.5 + 0.2 = 6.2 ms."""
    cm = CostModel(load_program(ROOT / "specs" / "tiny.embark"))
    ms = 1e-3
    comp = {
        "lookup": np.array([3.0, 1.0, 0.5, 0.5]) * ms,
        "distributor": np.array([0.5, 0.1, 0.1, 0.1]) * ms,
        "nvlink": np.array([0.0, 0.5, 0.0, 0.0]) * ms,
        "network": np.array([0.5, 2.0, 0.1, 0.1]) * ms,
        "dp_exchange": np.full(4, 0.2 * ms),
    }
    assert set(comp) == set(COMPONENTS) == {c for g in PHASE_GROUPS for c in g}
    st = RankState(cm)
    # the results phase counts NVLink and network together: rank 1's 2.5 ms
    assert st.critical_path(comp) == pytest.approx((3.0 + 0.5 + 2.5 + 0.2) * ms)
    assert float(sum(comp.values()).max()) == pytest.approx(4.2 * ms)


def test_on_one_gpu_the_critical_path_is_the_step_time():
    text = (ROOT / "specs" / "tiny.embark").read_text()
    text = text.replace("nodes 2", "nodes 1").replace("gpus_per_node 2", "gpus_per_node 1")
    text = text.replace("hbm 4 MiB", "hbm 1 GiB")
    from embarkc.frontend import load_program_text

    plan = plan_program(load_program_text(text, "<one>"), solver="greedy", baselines=False)
    extra = plan.estimate.model_extra or {}
    assert extra["critical_path"] == pytest.approx(plan.estimate.step_time, rel=1e-12)


def test_the_pass_lowers_t180s_critical_path_and_not_its_step_time(monkeypatch):
    """T180 on 16 x 8 GPUs: the search ends at 4.184 ms with a critical path of 5.026 ms
    (its network-heavy ranks hold whole wide tables, its HBM-heavy ones the hot
    tables); the pass trades their cells to 4.581 ms at a step time of 4.178 ms."""
    cm = CostModel(program_from_workload(SHARED / "workloads" / "t180.json", 16))
    monkeypatch.setattr(search_finish, "PHASE_PASSES", 0)
    g = greedy(cm)
    before = cm.layout_state(g.layout)
    assert round(before.step_time() * 1e3, 3) == 4.184
    assert round(before.critical_path() * 1e3, 3) == 5.026
    monkeypatch.undo()
    out = balanced_phases(cm, g.units, g.layout)
    after = cm.layout_state(out)
    assert after.step_time() <= before.step_time()
    assert round(after.step_time() * 1e3, 3) == 4.178
    assert round(after.critical_path() * 1e3, 3) == 4.581
    assert float(after.memory().max()) <= cm.capacity
    # deterministic, and the greedy ends there
    assert balanced_phases(cm, g.units, g.layout) == out
    assert greedy(cm).layout == out
    # a second call finds nothing more: a layout the pass cannot improve comes back as is
    assert balanced_phases(cm, g.units, out) is out


@pytest.mark.parametrize("name,nodes", [("dcnv2", 2), ("t200", 2), ("t510", 4)])
def test_the_pass_never_raises_the_step_time_or_the_critical_path(monkeypatch, name, nodes):
    cm = CostModel(program_from_workload(SHARED / "workloads" / f"{name}.json", nodes))
    monkeypatch.setattr(search_finish, "PHASE_PASSES", 0)
    g = greedy(cm)
    monkeypatch.undo()
    before = cm.layout_state(g.layout)
    out = balanced_phases(cm, g.units, g.layout)
    after = cm.layout_state(out)
    assert after.step_time() <= before.step_time()
    assert after.critical_path() <= before.critical_path()
    assert (out is g.layout) == (after.critical_path() == before.critical_path())
    for u in g.units:  # one-node units stay on one node
        if search_place.one_node(u, search_finish.decision_of(out[u.tables[0]])):
            ranks = out[u.tables[0]].rank_list()
            assert len({r // cm.G for r in ranks}) == 1


def test_diff_reads_the_critical_path_or_sums_it_from_older_plans_components():
    """A plan written before `estimate.critical_path` has its ranks' components: the diff
    sums the phases' slowest ranks itself; a plan that records it is read as it is."""
    from embark_runtime.plan import Estimate
    from embarkc.review.views import view_of
    from tests.test_diff import plan_a

    plan = plan_a()
    est = plan.estimate.model_dump()
    ms = 1e-3
    trade = [  # rank 0 busy in HBM, rank 1 on the network, ranks 2 and 3 idle
        {"lookup": 3.0, "distributor": 0.5, "nvlink": 0.0, "network": 0.5, "dp_exchange": 0.2},
        {"lookup": 1.0, "distributor": 0.1, "nvlink": 0.5, "network": 2.0, "dp_exchange": 0.2},
        {"lookup": 0.5, "distributor": 0.1, "nvlink": 0.0, "network": 0.1, "dp_exchange": 0.2},
        {"lookup": 0.5, "distributor": 0.1, "nvlink": 0.0, "network": 0.1, "dp_exchange": 0.2},
    ]
    for r, comp in zip(est["per_rank"], trade, strict=True):
        r["components"] = {k: v * ms for k, v in comp.items()}
        r["time"] = sum(comp.values()) * ms
    est["step_time"] = 4.2 * ms
    est.pop("critical_path", None)
    old = plan.model_copy(update={"estimate": Estimate(**est)})
    assert view_of(old).critical_path == pytest.approx(6.2 * ms)
    est["critical_path"] = 5.0 * ms
    recorded = plan.model_copy(update={"estimate": Estimate(**est)})
    assert view_of(recorded).critical_path == pytest.approx(5.0 * ms)
