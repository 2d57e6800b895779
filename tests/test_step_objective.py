"""Which of the plan's two step times a run follows: `embarkc measured` picks one only
where the predictions differ, and bench/step_objective.py's fit over plans."""

from __future__ import annotations

import sys

import pytest

from embarkc.measured import SEPARATION, Comparison
from tests.conftest import ROOT


def _comparison(step_time: float, critical_path: float, wall: float) -> Comparison:
    # the run's largest per-rank sum sits at the wall by construction: no evidence
    return Comparison(
        critical_rank=0,
        steps=5,
        rows=[],
        predicted_step_time=step_time,
        predicted_critical_path=critical_path,
        measured_rank_sum=wall,
        measured_critical_path=wall * 1.2,
        measured_embedding_wall=wall,
        measured_step=wall * 2,
    )


def test_follows_needs_predictions_that_differ() -> None:
    assert _comparison(1.0, 1.0 + SEPARATION / 2, 1.0).follows == "undetermined"
    assert _comparison(1.0, 2.0, 1.9).follows == "critical_path"
    assert _comparison(1.0, 2.0, 1.1).follows == "step_time"


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import step_objective

    return step_objective


def test_the_fit_over_plans_prefers_the_prediction_that_explains_the_walls() -> None:
    bench = _bench()
    crit = [1.0, 2.0, 3.0, 4.0]
    step = [1.0, 1.1, 0.9, 1.0]
    walls = [10 + 5 * c for c in crit]
    assert bench.r_squared(crit, walls) == pytest.approx(1.0)
    assert bench.r_squared(step, walls) < 0.2
    assert bench.rank_agreement(crit, walls) == 1.0
    assert bench.rank_agreement([1, 2], [2, 1]) == 0.0
