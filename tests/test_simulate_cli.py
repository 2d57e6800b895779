"""`embarkc simulate`: a spec, a plan file, and user mistakes (exit 2, no traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_simulate import make_hub_plan, make_plan

from embark_runtime.plan import dumps_plan
from embarkc.cli import main
from embarkc.simulate import key_window

ROOT = Path(__file__).resolve().parent.parent


def test_simulate_a_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(dumps_plan(make_plan()))
    assert main(["simulate", str(path), "--batches", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "simulated 2 batches of 16 samples on 2 x 2 GPUs (seed 1" in out
    for name in ("rb_flat", "rb_hier", "ub0", "dp_dense", "dp_sparse"):
        assert f"  {name} " in out
    assert "estimate vs simulated" in out and "step time" in out
    assert "keys: charged in full (the plan's topology gives no dense_flops)" in out
    # with a dense rate the window is said, in the units of the step time
    rated = make_plan()
    rated = rated.model_copy(
        update={"topology": rated.topology.model_copy(update={"dense_flops": 1e9})}
    )
    path.write_text(dumps_plan(rated))
    assert main(["simulate", str(path), "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert (
        f"keys: sent during the previous step's dense compute, {key_window(rated) * 1e3:.3f} ms"
        in out
    )


def test_simulate_a_plan_file_with_hierarchical_ub(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file's `communication` of a ub cluster reaches the counts: the owners serve
    fewer ids (one union per other node)."""
    ids = {}
    for communication in ("flat", "hierarchical"):
        path = tmp_path / f"{communication}.json"
        path.write_text(dumps_plan(make_hub_plan(communication)))
        assert main(["simulate", str(path), "--batches", "1", "--seed", "3"]) == 0
        out = capsys.readouterr().out.splitlines()
        head = next(i for i, line in enumerate(out) if line.split()[:3] == ["rank", "node", "ids"])
        ids[communication] = [float(line.split()[2]) for line in out[head + 1 : head + 5]]
    assert sum(ids["hierarchical"]) < sum(ids["flat"])


def test_simulate_a_spec_plans_it_first(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("embarkc.frontend")
    pytest.importorskip("embarkc.planner")
    spec = ROOT / "specs" / "tiny.embark"
    assert main(["simulate", str(spec), "--batches", "1", "--solver", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "on 2 x 2 GPUs" in out and "mean |difference| of the per-rank times" in out


def test_a_corrupt_plan_is_rejected_naming_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(dumps_plan(make_plan()))
    data["shards"][0]["rank"] = 99
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid plan (rule 3)" in err and "Traceback" not in err


def test_user_mistakes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uneven = tmp_path / "uneven.json"
    uneven.write_text(dumps_plan(make_plan(batch=18)))
    assert main(["simulate", str(uneven)]) == 2
    err = capsys.readouterr().err
    assert "invalid plan (batch)" in err and "does not split evenly over the 4 ranks" in err
    assert main(["simulate", str(uneven), "--batches", "0"]) == 2
    assert "--batches must be at least 1" in capsys.readouterr().err
    assert main(["simulate", str(uneven), "--batches", "1000000000"]) == 2
    assert "--batches 1,000,000,000: at most 10,000" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_dense_model_too_large_to_count_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every width within the loader's bounds, their products beyond 64-bit counts."""
    plan = make_plan()
    wide = {
        "dense_features": 13,
        "interaction": {"kind": "dcnv2", "layers": 1024, "low_rank": 65536},
        "top_mlp": [65536] * 1000 + [1],
    }
    data = json.loads(dumps_plan(plan))
    data["model"] = wide
    path = tmp_path / "wide.json"
    path.write_text(json.dumps(data))
    assert main(["simulate", str(path), "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "the dense model's gradients would be all-reduced as" in err
    assert "internal error" not in err


def test_many_batches_print_their_spread_not_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(dumps_plan(make_plan()))
    assert main(["simulate", str(path), "--batches", "13"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"per batch: min [0-9.]+ ms, median [0-9.]+ ms, max [0-9.]+ ms", out), out
    assert main(["simulate", str(path), "--batches", "3"]) == 0
    assert re.search(r"per batch: [0-9.]+ ms, [0-9.]+ ms, [0-9.]+ ms\n", capsys.readouterr().out)
