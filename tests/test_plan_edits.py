"""Hand edits of a plan file: every command either uses the edited plan or rejects it
naming the field (exit 0 or 2), never fails inside (exit 3); check compares what the
spec determines; diff compares only what both plans record."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from embarkc.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"

EXTREMES: list[Any] = [
    0,
    -1,
    0.5,
    1e-300,
    1e6,
    1e30,
    1e308,
    (1 << 63) - 1,
    10**30,
    "nan",
    float("nan"),
]
"""Values a fuzzed numeric field is set to: the loader's bounds (1e6 s, 2^63 - 1 bytes)
and beyond, tiny positives, a string, and NaN (written as the JSON token `NaN`)."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny spec and its greedy plan `p.json` (source.spec relative)."""
    here = tmp_path_factory.mktemp("edits")
    shutil.copy(TINY, here / "tiny.embark")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(here)
        assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "p.json"]) == 0
    return here


@pytest.fixture
def folder(planned: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> Path:
    monkeypatch.chdir(planned)
    capsys.readouterr()
    return planned


def _numeric_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for k in sorted(value) for p in _numeric_paths(value[k], (*prefix, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _numeric_paths(v, (*prefix, i))]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [prefix]
    return []


def _edited(folder: Path, path: tuple, value: Any, name: str = "edited.json") -> str:
    data = json.loads((folder / "p.json").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    out = folder / name
    out.write_text(json.dumps(data, indent=1))  # NaN is written as the token NaN
    return name


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `embarkc ARGS`."""
    rc = main(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _commands(plan: str, report: bool) -> list[list[str]]:
    out = [
        ["check", plan],
        ["diff", "p.json", plan, "--format", "json"],
        ["diff", plan, "p.json"],
        ["simulate", plan, "--batches", "1"],
    ]
    if report:
        out.append(["report", plan, "-o", "q.svg"])
    return out


BEYOND = [
    (("estimate", "components", "distributor"), 1e308),
    (("estimate", "step_time"), 1e308),
    (("model", "bottom_mlp", 0), 10**30),
    (("topology", "hbm_bandwidth"), 1e-300),
    (("topology", "dense_flops"), 1e-300),
]
"""Edits beyond the loader's bounds: a tester found the first three crashing commands
that check accepted."""
NAMED = [*BEYOND, (("estimate", "per_rank", 0, "memory_bytes"), 10**15)]


def test_extreme_numbers_never_crash_a_command(folder: Path, capsys) -> None:
    data = json.loads((folder / "p.json").read_text())
    paths = _numeric_paths(data)
    rng = random.Random(0)
    edits = NAMED + [(rng.choice(paths), rng.choice(EXTREMES)) for _ in range(40)]
    reports = 0
    for path, value in edits:
        plan = _edited(folder, path, value)
        admitted = main(["check", plan]) == 0
        capsys.readouterr()
        # the report draws with matplotlib (0.4 s): only for a few admitted edits
        draw = admitted and reports < 4 and value not in (0, -1)
        reports += draw
        for args in _commands(plan, draw):
            rc, _, err = _run(args, capsys)
            assert rc in (0, 2), f"{' '.join(args)} with {path} = {value!r}: exit {rc}\n{err}"
            assert "internal error" not in err
            if rc == 2 and not admitted:
                # the loader names the field it rejects (or the rule it breaks)
                assert "invalid plan" in err
    assert reports >= 1


@pytest.mark.parametrize(("path", "value"), BEYOND)
def test_an_edit_beyond_the_bounds_is_named_by_every_command(
    folder: Path, capsys, path: tuple, value: Any
) -> None:
    plan = _edited(folder, path, value)
    field = next(p for p in reversed(path) if isinstance(p, str))
    for args in _commands(plan, report=True):
        rc, _, err = _run(args, capsys)
        assert rc == 2, f"{' '.join(args)}: exit {rc}\n{err}"
        assert "invalid plan (schema)" in err and field in err


def test_diff_json_is_finite_for_the_largest_admitted_times(folder: Path, capsys) -> None:
    """Times at the loader's bound over a time near 0: the relative change is capped. (The
    plans lack `figures_sha256`, as an older embarkc's do, so that diff takes their own
    figures rather than re-costing the edit away.)"""
    data = json.loads((folder / "p.json").read_text())
    del data["estimate"]["figures_sha256"]
    data["estimate"]["step_time"] = 5e-324
    (folder / "tiny_time.json").write_text(json.dumps(data))
    data["estimate"]["step_time"] = 1e6
    data["estimate"]["components"]["distributor"] = 1e6
    (folder / "huge_time.json").write_text(json.dumps(data))
    rc, out, err = _run(["diff", "tiny_time.json", "huge_time.json", "--format", "json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["summary"]["step_time"]["pct"] == 1e12


def test_a_spec_that_is_no_regular_file_is_passed_over(folder: Path, capsys) -> None:
    """`source.spec` naming /dev/zero or a FIFO hung check reading it to the end (the FIFO
    first: should this break again, it hangs without filling the memory)."""
    fifo = folder / "spec.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    for spec in ("spec.fifo", "/dev/zero", "."):
        data = json.loads((folder / "p.json").read_text())
        data["source"]["spec"] = spec
        (folder / "odd.json").write_text(json.dumps(data))
        rc, out, err = _run(["check", "odd.json"], capsys)
        assert rc == 0, err
        assert f"{spec} not found: checked against the contract only" in out


def test_a_file_larger_than_any_spec_is_not_the_plans_spec(folder: Path) -> None:
    """Only the first MAX_SOURCE_BYTES + 1 bytes are read: no spec is larger."""
    from embark_runtime.plan import load_plan
    from embarkc.frontend import find_plan_spec
    from embarkc.syntax import MAX_SOURCE_BYTES

    big = folder / "big.embark"
    big.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    data = json.loads((folder / "p.json").read_text())
    data["source"]["spec"] = "big.embark"
    (folder / "big.json").write_text(json.dumps(data))
    assert find_plan_spec(load_plan(folder / "big.json"), folder / "big.json")[1] == "changed"
    plan = load_plan(folder / "p.json")
    assert find_plan_spec(plan, folder / "p.json")[1] == "unchanged"


def test_an_edited_estimate_cannot_hide_a_slower_plan(folder: Path, capsys) -> None:
    """B is the row-wise plan, slower than A, with its step and rank times edited down to
    A's: `estimate.figures_sha256` no longer matches, so diff re-costs B from the spec and
    --fail-if-slower still fails; report and simulate say the estimate was edited."""
    assert main(["plan", "tiny.embark", "--strategy", "row-wise", "-o", "b.json"]) == 0
    a, b = json.loads((folder / "p.json").read_text()), json.loads((folder / "b.json").read_text())
    slower = b["estimate"]["step_time"]
    assert slower > a["estimate"]["step_time"] * 1.05
    b["estimate"]["step_time"] = a["estimate"]["step_time"]
    for r in b["estimate"]["per_rank"]:
        r["time"] = min(r["time"], a["estimate"]["step_time"])
    (folder / "edited.json").write_text(json.dumps(b, indent=2))
    capsys.readouterr()
    assert main(["diff", "p.json", "edited.json", "--fail-if-slower", "1"]) == 1
    out = capsys.readouterr().out
    assert f"{slower * 1e6:.1f} us" in out  # the re-costed, true step time
    assert main(["check", "edited.json"]) == 0
    assert "warning: the plan's estimate is not what embarkc computes" in capsys.readouterr().err
    assert main(["simulate", "edited.json", "--batches", "1"]) == 0
    assert "the estimate's figures were edited after embarkc wrote them" in capsys.readouterr().err
    assert main(["report", "edited.json", "-o", "edited.svg"]) == 0
    # an untouched plan is not stale
    assert main(["check", "b.json"]) == 0
    assert "edited" not in capsys.readouterr().err


def test_a_step_time_from_zero_is_not_called_the_same(folder: Path, capsys) -> None:
    """A (an older embarkc's plan, without `figures_sha256`) says its step takes 0 s: no
    percentage exists, and the verdict said "same step time" while the gate failed."""
    data = json.loads((folder / "p.json").read_text())
    del data["estimate"]["figures_sha256"]
    data["estimate"]["step_time"] = 0.0
    (folder / "zero.json").write_text(json.dumps(data))
    rc, out, err = _run(["diff", "zero.json", "p.json", "--fail-if-slower", "0"], capsys)
    assert rc == 1, err
    assert out.startswith("slower (0.0 us -> ") and "from nothing" in out.splitlines()[0]
