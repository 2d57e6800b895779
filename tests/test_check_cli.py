"""`embarkc check PLAN`: a plan held to the contract and, when its spec is there unchanged,
to every rule of the independent checker; a plan given where a spec belongs is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from embark_runtime.plan import load_plan
from embarkc.cli import main
from tests.conftest import small_hardware

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"


@pytest.fixture
def planned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """tiny.embark copied into tmp_path (the current folder) and its greedy plan."""
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "tiny.embark"
    shutil.copy(TINY, spec)
    assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "plan.json"]) == 0
    return spec, tmp_path / "plan.json"


def test_a_plan_is_checked_against_its_spec_and_summarised(planned, capsys) -> None:
    spec, path = planned
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    plan = load_plan(path)
    assert f"{path}: ok" in out
    assert "tiny.embark (unchanged): checked against it" in out
    assert f"{plan.estimate.step_time * 1e3:.3f} ms estimated" in out
    assert f"{len(plan.tables)} in {len(plan.clusters)} cluster" in out
    assert f"shards     {len(plan.shards)}" in out
    assert "4 = 2 nodes x 2, sm_80" in out


def test_a_hand_edit_that_breaks_the_spec_is_named(planned, capsys) -> None:
    _, path = planned
    data = json.loads(path.read_text())
    data["features"][0]["hotness"] += 1
    data["features"][0]["max_hotness"] += 1  # a consistent bag, but not the spec's
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid plan (matches-program)" in err and "hotness" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["check"], ["diff", "plan.json"], ["simulate"], ["report"]])
def test_a_broken_field_of_our_own_stops_every_command_cleanly(planned, capsys, command) -> None:
    _, path = planned
    data = json.loads(path.read_text())
    data["planner"]["lower_bound"] = "soon"
    bad = path.with_name("bad.json")
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    args = command + [str(bad)] + (["-o", "r.html"] if command == ["report"] else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "field `planner.lower_bound` (a field of embarkc's own" in err
    assert "internal error" not in err and "Traceback" not in err


def test_without_its_spec_only_the_contract_is_checked(planned, capsys) -> None:
    spec, path = planned
    spec.write_text(spec.read_text() + "\n# edited\n")
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    assert "changed since this plan was made: checked against the contract only" in (
        capsys.readouterr().out
    )
    spec.unlink()
    assert main(["check", str(path)]) == 0
    assert "tiny.embark not found: checked against the contract only" in capsys.readouterr().out


def test_a_stale_estimate_is_a_warning(planned, capsys) -> None:
    _, path = planned
    data = json.loads(path.read_text())
    # swap the ranks of two equal cells of one table: still valid, the estimate now stale
    by_table: dict[str, list[dict]] = {}
    for shard in data["shards"]:
        by_table.setdefault(shard["table"], []).append(shard)
    a, b = next(cells for cells in by_table.values() if len(cells) == 2)
    assert a["rank"] != b["rank"]
    a["rank"], b["rank"] = b["rank"], a["rank"]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning: the layout was edited after embarkc costed it: its estimate is not" in (
        captured.err
    )
    assert f"{path}: ok" in captured.out


def test_a_corrupt_plan_is_named_and_the_other_files_still_checked(planned, capsys) -> None:
    spec, path = planned
    bad = path.with_name("bad.json")
    text = path.read_text()
    assert text.count('"clusters": [') == 1
    bad.write_text(text.replace('"clusters": [', '"clusters": [}'))
    capsys.readouterr()
    assert main(["check", str(bad), str(path), str(spec)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}: error: invalid plan (json): not valid JSON" in captured.err
    assert f"{path}: ok" in captured.out and f"{spec}: ok" in captured.out
    assert main(["check", "--dump", "ir", str(path)]) == 2
    assert "--dump ir is for specs; this is a plan file" in capsys.readouterr().err


def test_a_fixed_strategy_plan_warns_at_the_constraints_it_ignores(tmp_path, capsys) -> None:
    spec = tmp_path / "pinned.embark"
    text = TINY.read_text()
    assert text.count("plan {\n") == 1
    spec.write_text(text.replace("plan {\n", "plan {\n  table item { within_node }\n"))
    path = tmp_path / "rw.json"
    assert main(["plan", str(spec), "--strategy", "row-wise", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert "the fixed strategy row-wise ignores this constraint" in captured.err
    assert f"{path}: ok" in captured.out


@pytest.mark.parametrize("command", ["plan", "compile", "fmt"])
def test_a_plan_where_a_spec_belongs_is_named(planned, capsys, command) -> None:
    _, path = planned
    capsys.readouterr()
    extra = ["-o", "out"] if command == "compile" else []
    assert main([command, str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert "this is an embark plan file (JSON), not a spec" in err
    assert "(this one was planned from `tiny.embark`)" in err
    assert "expected one of" not in err and "Traceback" not in err
    assert not Path("out").exists()


def test_json_that_is_no_plan_is_not_parsed_as_a_spec(tmp_path, capsys) -> None:
    other = tmp_path / "x.embark"
    other.write_text('{"rows": 10}\n')
    assert main(["check", str(other)]) == 2
    err = capsys.readouterr().err
    assert "this is a JSON file, not an embark spec" in err


def test_a_missing_plan_file_is_named_as_one(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check", "nosuch.json", "nosuch.embark"]) == 2
    err = capsys.readouterr().err
    assert "nosuch.json: error: no such plan file" in err
    assert "nosuch.embark: error: no such spec file" in err
    assert "cannot read spec" not in err


def test_memory_use_counts_a_dp_pinned_table_on_every_gpu(tmp_path, capsys) -> None:
    """A table pinned to dp has a copy on each GPU: 2 GPUs of 300 KiB, a 125 KiB dp table
    and a 37.1 KiB sharded one use 287.1 KiB, not the 162.1 KiB of one copy of each."""
    spec = tmp_path / "dp.embark"
    spec.write_text(
        small_hardware(2, "300 KiB")
        + "table t0 { rows 1000 dim 32 optimizer sgd { lr 0.05 } hotness 1 }\n"
        "table t1 { rows 257 dim 12 optimizer adam { lr 0.1 } hotness 2 }\n"
        "model { batch 16 dense_features 0 bottom_mlp [] interaction dot top_mlp [1] }\n"
        "plan { table t0 { cluster dp } }\n"
    )
    assert main(["check", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "with optimizer state  162.1 KiB" in out
    assert (
        "memory use            47.9% of 600.0 KiB (312.9 KiB headroom; the 1 table pinned "
        "to dp counted on every GPU)" in out
    )


def test_dump_ir_of_several_specs_is_one_json_object_by_path(tmp_path, capsys) -> None:
    """Not one JSON document after another (which no JSON reader takes): one object, each
    path as given mapped to its IR; nothing on stdout when a spec does not lower."""
    other = tmp_path / "other.embark"
    other.write_text(
        small_hardware(2, "300 KiB") + "table t { rows 10 dim 4 hotness 1 }\nmodel { batch 16 }\n"
    )
    assert main(["check", "--dump", "ir", str(TINY), str(other)]) == 0
    both = json.loads(capsys.readouterr().out)
    assert list(both) == [str(TINY), str(other)]
    assert main(["check", "--dump", "ir", str(TINY)]) == 0
    assert both[str(TINY)] == json.loads(capsys.readouterr().out)
    assert [t["name"] for t in both[str(other)]["tables"]] == ["t"]
    bad = tmp_path / "bad.embark"
    bad.write_text("table a { rows -1 }\n")
    assert main(["check", "--dump", "ir", str(TINY), str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "rows must be positive" in captured.err


def test_dump_ast_takes_one_spec(tmp_path, capsys) -> None:
    assert main(["check", "--dump", "ast", str(TINY), str(TINY)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: --dump ast takes one spec" in captured.err
    assert "use --dump ir (one JSON object for all specs)" in captured.err
    assert main(["check", "--dump", "ast", str(TINY)]) == 0
    assert capsys.readouterr().out.startswith("start\n")


def test_the_error_count_is_not_the_cap_of_syntax_errors_shown(tmp_path, capsys) -> None:
    spec = tmp_path / "many.embark"
    spec.write_text("".join(f"table t{i} {{ rows 10 dim 4 hotness 1 bogus }}\n" for i in range(25)))
    assert main(["check", str(spec)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "20 errors shown, and more after them: fix these and run again", last


def _rewrite(path: Path, edit) -> None:
    """Apply `edit` to the plan's JSON at `path`, as a hand edit would."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda d: d["estimate"]["per_rank"][0].update(memory_bytes=10**15),
            "estimate.per_rank (rank 0) memory_bytes is 1.0e+15, its cells hold",
        ),
        (lambda d: d["estimate"].update(step_time=0), "estimate.step_time is 0.0 s"),
        (
            lambda d: d["estimate"]["per_rank"][3].update(time=0.5),
            "estimate.per_rank (rank 3) time is 500 ms",
        ),
    ],
)
def test_an_edited_estimate_of_an_unchanged_layout_is_a_warning(
    planned, capsys, edit, needle
) -> None:
    """The estimate is embarkc's by definition: check counts memory from the cells and
    times with the cost model, as it warns of a stale one."""
    _, path = planned
    _rewrite(path, edit)
    capsys.readouterr()
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning: the plan's estimate is not what embarkc computes" in captured.err
    assert needle in captured.err
    assert f"{path}: ok" in captured.out


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["model"].update(bottom_mlp=[64, 16]), "model.bottom_mlp is [64, 16]"),
        (
            lambda d: d["tables"][0]["optimizer_params"].update(lr=5),
            "table `country` optimizer_params.lr is 5.0, the spec says 0.05",
        ),
        (lambda d: d["tables"][1]["init"].update(high=0.5), "table `item` init.high is 0.5"),
        (lambda d: d["features"][3].update(weighted=False), "feature `tag` weighted is False"),
        (lambda d: d["topology"].update(arch="sm_90"), "topology.arch is sm_90"),
        (lambda d: d.update(seed=7), "seed is 7, the spec says 0"),
    ],
)
def test_a_field_of_our_own_that_the_spec_determines_is_compared(
    planned, capsys, edit, needle
) -> None:
    _, path = planned
    _rewrite(path, edit)
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid plan (matches-program)" in err and needle in err


def test_a_plan_without_the_fields_its_spec_determines_is_refused(planned, capsys) -> None:
    """Without fields of our own, a reader would take the loader's defaults (arch sm_90,
    fixed bags, lr 0.01) for the spec's: against its spec such a plan is refused naming
    them (issue 35); without the spec only the contract is checked."""
    spec, path = planned
    data = json.loads(path.read_text())
    del data["topology"]["arch"], data["model"], data["seed"]
    for f in data["features"]:
        del f["max_hotness"], f["fixed"], f["weighted"]
    for t in data["tables"]:
        del t["optimizer_params"], t["init"]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid plan (complete)" in err and "`topology.arch`" in err
    spec.unlink()
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


def test_an_estimate_without_some_ranks_is_rejected(planned, capsys) -> None:
    _, path = planned
    data = json.loads(path.read_text())
    del data["estimate"]["per_rank"][2:]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    assert "estimate.per_rank lists 2 of the 4 ranks" in capsys.readouterr().err


def test_a_compiled_folder_stands_for_its_plan_in_every_command(planned, capsys) -> None:
    """check, simulate, diff, report and compile --plan take the folder `embarkc compile`
    wrote for its plan.json; a folder without one is named, with what to give instead."""
    spec, _ = planned
    assert main(["compile", "tiny.embark", "--solver", "greedy", "-q", "-o", "out"]) == 0
    capsys.readouterr()
    assert main(["check", "out"]) == 0
    assert capsys.readouterr().out.startswith("out/plan.json: ok\n")
    assert main(["simulate", "out", "--batches", "1"]) == 0
    capsys.readouterr()
    assert main(["diff", "out", "plan.json"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "A: out/plan.json"
    assert main(["report", "out", "-o", "r.html"]) == 0
    assert main(["compile", "tiny.embark", "--plan", "out", "-o", "out", "-q"]) == 0
    Path("empty").mkdir()
    capsys.readouterr()
    for command in (
        ["check", "empty"],
        ["simulate", "empty"],
        ["diff", "empty", "out"],
        ["report", "empty", "-o", "r.html"],
        ["compile", "tiny.embark", "--plan", "empty", "-o", "x"],
    ):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("empty: error: a folder with no plan.json in it"), (command, err)
        assert "a folder `embarkc compile` wrote" in err
    assert not Path("x").exists()


def test_a_spec_of_100000_tables_is_not_refused_for_its_size(tmp_path: Path, capsys) -> None:
    """A generated spec of 100,000 tables is about 8 MB: the language accepts it, so the
    size guard (meant for data files passed as specs) lets it through."""
    from embarkc.syntax import MAX_SOURCE_BYTES

    line = "# " + "x" * 77 + "\n"  # the size of a table line of the scale benchmark
    spec = tmp_path / "big.embark"
    spec.write_text(TINY.read_text() + line * 100_000)
    assert 8_000_000 <= spec.stat().st_size < MAX_SOURCE_BYTES
    assert main(["check", str(spec)]) == 0
    assert f"{spec}: ok" in capsys.readouterr().out


def test_the_command_leaves_the_collector_as_it_found_it() -> None:
    """`main` raises the cyclic collector's thresholds while a command reads many objects
    and puts them back when it returns (tests and embedders call it in-process)."""
    import gc

    from embarkc.cli import GC_THRESHOLDS

    before = gc.get_threshold()
    assert before != GC_THRESHOLDS
    assert main(["check", str(TINY)]) == 0
    assert gc.get_threshold() == before
