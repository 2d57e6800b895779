"""The planner writes byte-identical plan files for a fixed set of specs: a subset of
scripts/plan_goldens.py's goldens (the four paper workloads at 4 x 8 GPUs and the first
20 random specs of bench/plan_time_fuzz.py, greedy), fast enough for the suite; the
whole set is `python scripts/plan_goldens.py --check`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("plan_goldens", ROOT / "scripts" / "plan_goldens.py")
assert _spec and _spec.loader
goldens = importlib.util.module_from_spec(_spec)
sys.modules["plan_goldens"] = goldens
_spec.loader.exec_module(goldens)

CASES = [f"paper4/{n}/greedy" for n in goldens.NAMES] + [f"fuzz/{i}/greedy" for i in range(20)]


def test_goldens_cover_every_case() -> None:
    recorded = goldens.load()
    assert list(recorded) == goldens.case_names()
    assert len(recorded) == 4 + 4 + 24 + 400


@pytest.mark.parametrize("name", CASES)
def test_plan_file_is_byte_identical(name: str) -> None:
    try:
        goldens._workloads()
    except SystemExit:
        if name.startswith("paper"):
            pytest.skip("the paper workloads are not here")
    _, sha, _ = goldens.digest(name)
    assert sha == goldens.load()[name], f"{name}: the plan file differs from its golden"


def test_paper_goldens_do_not_depend_on_where_the_workloads_lie(tmp_path, monkeypatch) -> None:
    """A clone in another folder (CI's) plans the paper workloads from another path: the
    plan file, which records its spec's path, must still be byte-identical."""
    try:
        src = goldens._workloads()
    except SystemExit:
        pytest.skip("the paper workloads are not here")
    elsewhere = tmp_path / "elsewhere" / "workloads"
    elsewhere.mkdir(parents=True)
    for f in src.glob("*.json"):
        (elsewhere / f.name).write_text(f.read_text())
    monkeypatch.setattr(goldens, "WORKLOADS", elsewhere)
    assert goldens._workloads() == elsewhere
    name = "paper4/dcnv2/greedy"
    _, sha, _ = goldens.digest(name)
    assert sha == goldens.load()[name]
