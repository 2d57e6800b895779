"""bench/whatif_key_overlap.py: the key phase costs what the dense part's window leaves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embarkc.frontend import load_program
from embarkc.planner import plan_program
from embarkc.planner.cost import CostModel, dense_parameters, layout_of_plan, mlp_parameters
from tests.conftest import load_module

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "whatif_key_overlap.py"


@pytest.fixture
def bench():
    return load_module(BENCH)


def test_the_window_hides_key_time_and_nothing_else(bench, monkeypatch) -> None:
    program = load_program(ROOT / "specs" / "tiny.embark")
    layout = layout_of_plan(plan_program(program, solver="greedy", baselines=False))
    st = CostModel(program).layout_state(layout)
    before = st.components()
    counts = st.counts
    a2a = sum(int(counts[k] > 0) for k in ("rb_flat", "rb_hier", "ub"))
    latency = a2a * st.cm.collective_latency
    links = before["distributor"] - latency
    assert np.all(links > 0)
    # tiny's dense part is small: choose the efficiency that puts the window between the
    # ranks' key times, so that some ranks hide them whole and others in part
    m = program.model
    bottom = mlp_parameters([m.dense_features, *m.bottom_mlp])
    pooled = sum(f.outputs for f in st.cm.facts.values())
    flops = 6.0 * (dense_parameters(program, pooled) - bottom) * st.cm.b
    window = float(links.min() + links.max()) / 2
    bench.install(flops / (67e12 * window), monkeypatch.setattr)
    cm = CostModel(program)
    assert cm.key_window == pytest.approx(window)  # type: ignore[attr-defined]
    after = cm.layout_state(layout).components()
    expected = np.maximum(links - window, 0) + latency
    np.testing.assert_allclose(after["distributor"], expected)
    assert (expected == latency).any() and (expected > latency).any()
    for name in ("lookup", "nvlink", "network", "dp_exchange"):
        np.testing.assert_array_equal(after[name], before[name])
    # undone with the test: a fresh model charges the keys in full again
    monkeypatch.undo()
    np.testing.assert_array_equal(
        CostModel(program).layout_state(layout).components()["distributor"],
        before["distributor"],
    )


def test_an_efficiency_outside_0_to_1_is_refused(bench, capsys) -> None:
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit) as e:
            bench.main(["--efficiency", bad])
        assert e.value.code == 2
        assert "is not a fraction of the peak in (0, 1]" in capsys.readouterr().err
