"""`embarkc compile SPEC --plan PLAN`: the trainer of a given plan (one reviewed with
`embarkc diff`, edited by hand, or written by another tool), held to the checker against
the spec first; what it writes and every way the plan can be wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embark_runtime.plan import load_plan
from embarkc.cli import main
from embarkc.frontend import load_program
from embarkc.planner import estimate_is_stale
from embarkc.planner.cost import CostModel

ROOT = Path(__file__).resolve().parent.parent
TINY = "specs/tiny.embark"


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    # spec paths are recorded as given: run from the repository root, like a user
    monkeypatch.chdir(ROOT)


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("given") / "plan.json"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["plan", TINY, "--solver", "greedy", "-q", "-o", str(out)]) == 0
    finally:
        os.chdir(cwd)
    return out


def _edit(src: Path, dst: Path, change) -> Path:
    data = json.loads(src.read_text())
    change(data)
    dst.write_text(json.dumps(data, indent=2))
    return dst


def _moved(data: dict) -> None:
    """Move the first cell to the next rank (a hand edit of the layout)."""
    data["shards"][0]["rank"] = (data["shards"][0]["rank"] + 1) % 4


def test_a_given_plan_compiles_to_what_planning_writes(planned, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["compile", TINY, "--solver", "greedy", "-q", "-o", str(a)]) == 0
    assert main(["compile", TINY, "--plan", str(planned), "-o", str(b)]) == 0
    out = capsys.readouterr()
    assert f"(plan embark from {planned}, 4 ranks" in out.out and out.err == ""
    assert _tree(a) == _tree(b)
    # the plan file given is an input: read, never written
    assert json.loads(planned.read_text())["shards"]


def test_an_edited_plan_is_compiled_as_edited_and_recosted(planned, tmp_path, capsys):
    edited = _edit(planned, tmp_path / "edited.json", _moved)
    out = tmp_path / "out"
    assert main(["compile", TINY, "--plan", str(edited), "-o", str(out), "-q"]) == 0
    err = capsys.readouterr().err
    assert f"{edited}: warning: the layout was edited after embarkc costed it" in err
    assert "carries the cost model's estimate of its layout instead" in err
    plan = load_plan(out / "plan.json")
    want = json.loads(edited.read_text())
    assert [s.rank for s in plan.shards] == [s["rank"] for s in want["shards"]]
    assert estimate_is_stale(plan) is False
    program = load_program(TINY)
    assert plan.estimate.step_time == pytest.approx(
        CostModel(program).evaluate(plan)["step_time"], rel=1e-8
    )
    # the written plan passes the checker against the spec, with no estimate warning
    assert main(["check", str(out / "plan.json")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_folders_own_plan_compiles_again_after_an_edit(planned, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", TINY, "--plan", str(planned), "-o", str(out), "-q"]) == 0
    before = _tree(out)
    _edit(out / "plan.json", out / "plan.json", _moved)
    assert main(["compile", TINY, "--plan", str(out / "plan.json"), "-o", str(out), "-q"]) == 0
    after = _tree(out)
    assert after["plan.json"] != before["plan.json"] and after["train.py"] != before["train.py"]
    assert main(["check", str(out / "plan.json")]) == 0


def test_another_tools_plan_gets_embarkcs_estimate(planned, tmp_path, capsys):
    def strip(data: dict) -> None:
        est = data["estimate"]
        data["estimate"] = {"step_time": est["step_time"], "per_rank": est["per_rank"]}
        for r in data["estimate"]["per_rank"]:
            for k in list(r):
                if k not in ("rank", "time", "memory_bytes"):
                    del r[k]

    outside = _edit(planned, tmp_path / "outside.json", strip)
    out = tmp_path / "out"
    assert main(["compile", TINY, "--plan", str(outside), "-o", str(out), "-q"]) == 0
    assert "another tool's plan" in capsys.readouterr().err
    assert estimate_is_stale(load_plan(out / "plan.json")) is False


def test_a_copy_of_the_spec_compiles_the_plan_and_is_named_in_it(planned, tmp_path):
    spec = tmp_path / "copy.embark"
    spec.write_text((ROOT / TINY).read_text())
    out = tmp_path / "out"
    assert main(["compile", str(spec), "--plan", str(planned), "-o", str(out), "-q"]) == 0
    assert load_plan(out / "plan.json").source.spec == str(spec)


def _refused(args: list[str], capsys) -> str:
    assert main(["compile", *args]) == 2
    return capsys.readouterr().err


def test_a_plan_that_does_not_fit_the_spec_is_refused_naming_the_rule(planned, tmp_path, capsys):
    out = tmp_path / "out"

    def batch(data: dict) -> None:
        data["batch_size"] = 512

    plan = _edit(planned, tmp_path / "batch.json", batch)
    err = _refused([TINY, "--plan", str(plan), "-o", str(out)], capsys)
    assert "invalid plan (matches-program): batch_size is 512, the spec says 256" in err

    def dropped(data: dict) -> None:
        data["shards"] = [s for s in data["shards"] if s["table"] != "country"]

    plan = _edit(planned, tmp_path / "dropped.json", dropped)
    err = _refused([TINY, "--plan", str(plan), "-o", str(out)], capsys)
    assert "rb table `country` has no shards" in err

    def crowded(data: dict) -> None:
        for s in data["shards"]:
            s["rank"] = 0

    plan = _edit(planned, tmp_path / "crowded.json", crowded)
    err = _refused([TINY, "--plan", str(plan), "-o", str(out)], capsys)
    assert "invalid plan (rule 4): rank 0 holds" in err and "more than hbm_bytes" in err
    assert "Traceback" not in err and not out.exists()


def test_a_plan_of_another_spec_says_so_first(tmp_path, capsys):
    other = tmp_path / "wide.embark"
    other.write_text((ROOT / TINY).read_text().replace("batch 256", "batch 512"))
    plan = tmp_path / "wide.json"
    assert main(["plan", str(other), "--solver", "greedy", "-q", "-o", str(plan)]) == 0
    out = tmp_path / "out"
    err = _refused([TINY, "--plan", str(plan), "-o", str(out)], capsys)
    first = err.splitlines()[0]
    assert first == f"{plan}: error: --plan: {plan} was made from {other}, not from {TINY}"
    assert "batch_size is 512, the spec says 256" in err and not out.exists()


def test_bad_plan_arguments_are_named_before_any_work(planned, tmp_path, capsys):
    out = tmp_path / "out"
    err = _refused([TINY, "--plan", str(planned), "--solver", "greedy", "-o", str(out)], capsys)
    assert "--plan gives the plan, so --solver would change nothing" in err
    err = _refused(
        [TINY, "--plan", str(planned), "--strategy", "row-wise", "--seed", "3", "-o", str(out)],
        capsys,
    )
    assert "so --strategy, --seed would change nothing" in err
    err = _refused([TINY, "--plan", str(tmp_path / "none.json"), "-o", str(out)], capsys)
    assert "--plan: " in err and "does not exist" in err
    err = _refused([TINY, "--plan", TINY, "-o", str(out)], capsys)
    assert f"--plan: {TINY} is not a plan file" in err and "the spec comes first" in err
    broken = tmp_path / "broken.json"
    broken.write_text(planned.read_text()[:200])
    err = _refused([TINY, "--plan", str(broken), "-o", str(out)], capsys)
    assert "not valid JSON" in err and "Traceback" not in err
    assert not out.exists()


def test_a_plan_is_never_replaced_by_an_output_of_its_own_compile(planned, tmp_path, capsys):
    """A plan given under the name of an output other than plan.json (a copy named
    launch.sh in the output folder) is an input: the compile stops before writing."""
    out = tmp_path / "out"
    out.mkdir()
    trap = out / "launch.sh"
    trap.write_text(planned.read_text())
    err = _refused([TINY, "--plan", str(trap), "-o", str(out)], capsys)
    assert "would replace the input" in err
    assert trap.read_text() == planned.read_text()
