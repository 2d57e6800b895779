"""`embarkc plan`: output, deterministic plan files, --explain, user errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from embark_runtime.plan import load_plan
from embarkc.cli import main
from tests.conftest import small_hardware

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny.embark")


def test_plan_writes_the_same_bytes_twice_and_prints_the_summary(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", TINY, "-o", str(a), "--solver", "cp-sat", "--time-limit", "1.5"]) == 0
    out = capsys.readouterr().out
    assert main(["plan", TINY, "-o", str(b), "--solver", "cp-sat", "--time-limit", "1.5"]) == 0
    assert a.read_bytes() == b.read_bytes()
    plan = load_plan(a)
    assert plan.planner.solver == "cp-sat"
    for text in ("step time", "critical rank", "clusters:", "planner:", "baseline table-row-wise"):
        assert text in out
    pextra = plan.planner.model_extra or {}
    assert (
        f"cp-sat objective {pextra['objective'] * 1e3:.3f} ms, "
        f"bound {pextra['bound'] * 1e3:.3f} ms (of the last model it accepted)"
    ) in out
    extra = plan.estimate.model_extra or {}
    assert set(extra["components"]) == {"lookup", "distributor", "nvlink", "network", "dp_exchange"}
    assert len(extra["per_table"]) == len(plan.tables)
    # the work CP-SAT counted, as the file records it; none is shown for the greedy alone
    assert f"(cp-sat deterministic work {plan.planner.wall_time:.3g} s)" in out
    capsys.readouterr()
    assert main(["plan", TINY, "--solver", "greedy"]) == 0
    assert "deterministic work" not in capsys.readouterr().out


def test_a_quiet_plan_prints_nothing_but_writes_the_same_plan(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", TINY, "-o", str(a), "--solver", "greedy"]) == 0
    assert "step time" in capsys.readouterr().out
    assert main(["plan", TINY, "-o", str(b), "--solver", "greedy", "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    assert a.read_bytes() == b.read_bytes()
    # what was asked for explicitly still prints
    assert main(["plan", TINY, "--solver", "greedy", "--quiet", "--explain", "item"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("explain item:") and "planner:" not in out


def test_a_limit_the_greedy_uses_up_is_said_and_a_longer_one_refines(tmp_path, capsys):
    """The greedy's work is charged against the limit: one it uses up (here in its first
    start: the rest of the command alone takes longer) skips CP-SAT and says so; a longer
    one refines."""
    import re

    a = tmp_path / "a.json"
    assert main(["plan", TINY, "-o", str(a), "--solver", "cp-sat", "--time-limit", "0.2"]) == 0
    out = capsys.readouterr().out
    said = (
        r"the 0.2 s time limit cut the search in its first start \(the rest of the command "
        r"takes about 0.4[0-9] s for [0-9]+ tables\): the plan is barely searched; a longer "
        r"limit searches it"
    )
    assert re.search(said, out), out
    assert "status greedy" in out and "cp-sat objective" not in out
    # the rest of the command alone takes more than 0.2 s: no time for the baselines
    assert (
        "baselines: not costed, they would take about 0.021 s of the 0.2 s time limit; "
        "a limit of 1 s or more costs them"
    ) in out
    assert "baseline table-wise" not in out
    assert load_plan(a).planner.wall_time == 0
    assert main(["plan", TINY, "-o", str(a), "--solver", "cp-sat", "--time-limit", "3"]) == 0
    assert "cp-sat objective" in capsys.readouterr().out
    assert load_plan(a).planner.wall_time > 0


def test_plan_says_how_much_key_time_hides(tmp_path, capsys):
    """tiny's hardware has no dense rate: keys in full; with `dense_flops` the plan says
    the window, which the estimate records."""
    assert main(["plan", TINY, "--solver", "greedy"]) == 0
    assert "keys: charged in full (the hardware gives no dense_flops)" in capsys.readouterr().out
    spec = tmp_path / "rated.embark"
    text = Path(TINY).read_text()
    assert "hardware {" in text
    spec.write_text(text.replace("hardware {", "hardware {\n  dense_flops 2 GFLOP/s", 1))
    out_json = tmp_path / "p.json"
    assert main(["plan", str(spec), "--solver", "greedy", "-o", str(out_json)]) == 0
    out = capsys.readouterr().out
    plan = load_plan(out_json)
    assert plan.topology.dense_flops == 2e9
    window = (plan.estimate.model_extra or {})["key_window"]
    assert window > 0
    assert (
        f"keys: sent during the previous step's dense compute, {window * 1e3:.3f} ms "
        "(fp32 at 0.002 TFLOP/s): only key time beyond it counts"
    ) in out


def test_fixed_strategy_is_reported_as_a_baseline(capsys):
    assert main(["plan", TINY, "--strategy", "table-row-wise"]) == 0
    out = capsys.readouterr().out
    assert "strategy table-row-wise" in out and "status baseline" in out


def _constrained(tmp_path) -> str:
    text = Path(TINY).read_text()
    pins = "  table item { cluster ub }\n  table tag { within_node }\n"
    spec = tmp_path / "constrained.embark"
    spec.write_text(text.replace("  seed 0\n", "  seed 0\n" + pins))
    return str(spec)


def test_a_fixed_strategy_warns_at_each_constraint_it_ignores_and_records_them(tmp_path, capsys):
    spec = _constrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", spec, "--strategy", "row-wise", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    lines = Path(spec).read_text().splitlines()
    item_line = 1 + next(i for i, x in enumerate(lines) if "table item { cluster ub }" in x)
    assert (
        f"constrained.embark:{item_line}:9: warning: the fixed strategy row-wise ignores this "
        "constraint: `item` is pinned to ub but the plan puts it in a rb cluster"
    ) in err
    assert f"{item_line + 1}:9: warning:" in err and "must stay within one node" in err
    assert "--strategy embark" in err
    ignored = (load_plan(out).planner.model_extra or {})["ignored_constraints"]
    assert [(v["rule"], v["table"]) for v in ignored] == [
        ("cluster-kind", "item"),
        ("within-node", "tag"),
    ]
    # the report of that plan lists them among its facts
    page = tmp_path / "report.html"
    assert main(["report", str(out), "-o", str(page)]) == 0
    assert "constraint ignored" in page.read_text() and "(within-node)" in page.read_text()
    # simulating it is no error either: the same warnings, exit 0
    assert main(["simulate", spec, "--strategy", "row-wise", "--batches", "1"]) == 0
    assert "ignores this constraint" in capsys.readouterr().err
    # the search honours them: no warning, nothing recorded
    assert main(["plan", spec, "--solver", "greedy", "-o", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "ignored_constraints" not in (load_plan(out).planner.model_extra or {})


def test_explain_lists_every_alternative_with_a_verdict(capsys):
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "item"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("explain item") :]
    assert "chosen" in section
    assert "ub" in section and "rb" in section
    assert "slower by" in section or "does not fit" in section


def test_explain_lists_both_communications_of_rb_on_several_nodes(tmp_path, capsys):
    """tiny has 2 nodes: every rb grid appears flat and hierarchical (`rb-h`, its cells on
    one node); with the communication fixed by the spec, only that one."""
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "tag"]) == 0
    section = capsys.readouterr().out.split("explain tag")[1].splitlines()
    kinds = [line.split()[0] for line in section[3:] if line.startswith("  ") and "x" in line]
    assert "rb-h" in kinds and "rb" in kinds
    assert any("hierarchical communication" in line for line in section)
    text = Path(TINY).read_text().replace("  seed 0\n", "  seed 0\n  communication flat\n")
    spec = tmp_path / "flat.embark"
    spec.write_text(text)
    assert main(["plan", str(spec), "--solver", "greedy", "--explain", "tag"]) == 0
    assert "rb-h" not in capsys.readouterr().out.split("explain tag")[1]


def test_explain_names_the_chosen_grid_of_a_row_split_table(tmp_path, capsys):
    """The plan's own row comes first with its real grid (R row shards x C column cells),
    also for a table split by rows only."""
    text = (
        Path(TINY)
        .read_text()
        .replace("  seed 0\n", "  seed 0\n  table item { row_shards 2 column_shards 1 }\n")
    )
    spec = tmp_path / "split.embark"
    spec.write_text(text)
    assert main(["plan", str(spec), "--solver", "greedy", "--explain", "item"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("explain item") :].splitlines()
    chosen = next(line for line in section if line.rstrip().endswith("chosen"))
    assert chosen.split()[:2] == ["rb", "2x1"] or chosen.split()[:2] == ["ub", "2x1"], chosen


def test_explain_of_an_unknown_table_is_a_user_error(capsys):
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "itme"]) == 2
    err = capsys.readouterr().err
    assert "no table `itme`" in err and "did you mean `item`" in err


def _explain_rows(out: str, table: str) -> list[list[str]]:
    section = out[out.index(f"explain {table}") :].splitlines()
    start = next(i for i, line in enumerate(section) if line.split()[:2] == ["kind", "grid"])
    return [line.split() for line in section[start + 1 :] if not line.startswith("  chosen:")]


def test_explain_lists_each_option_once(tmp_path, capsys):
    """The plan's own option is its `chosen` row, not also an alternative slower by
    0.000 ms; the same for a dp table."""
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "country"]) == 0
    out = capsys.readouterr().out
    rows = _explain_rows(out, "country")
    options = [tuple(r[:2]) for r in rows]
    assert len(options) == len(set(options)) and "slower by 0.000 ms" not in out
    assert f"explain country: {len(rows)} alternatives" in out
    assert sum(r[-1] == "chosen" for r in rows) == 1
    text = (
        Path(TINY).read_text().replace("  seed 0\n", "  seed 0\n  table country { cluster dp }\n")
    )
    spec = tmp_path / "dp.embark"
    spec.write_text(text)
    assert main(["plan", str(spec), "--solver", "greedy", "--explain", "country"]) == 0
    rows = _explain_rows(capsys.readouterr().out, "country")
    assert [r[:2] for r in rows if r[0] == "dp"] == [["dp", "-"]] and rows[0][-1] == "chosen"


def test_explain_of_an_empty_name_is_a_user_error(capsys):
    assert main(["plan", TINY, "--solver", "greedy", "--explain", ""]) == 2
    err = capsys.readouterr().err
    assert (
        "--explain needs a table name" in err
        and "the tables are `brand`, `category`, `country`" in err
    )


def test_explain_of_a_name_like_no_table_lists_the_tables(capsys):
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "no table `nosuch`" in err and "the tables are `brand`, `category`, `country`" in err


def test_explain_in_the_wrong_case_hints_at_the_table(capsys):
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "ITEM"]) == 2
    assert "did you mean `item`?" in capsys.readouterr().err
    assert main(["plan", TINY, "--solver", "greedy", "--explain", "ITME"]) == 2
    assert "did you mean `item`?" in capsys.readouterr().err


def test_spec_that_cannot_fit_says_what_would(tmp_path, capsys):
    text = (ROOT / "specs" / "tiny.embark").read_text().replace("hbm 4 MiB", "hbm 1 MiB")
    spec = tmp_path / "small.embark"
    spec.write_text(text)
    assert main(["plan", str(spec), "--solver", "greedy"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("GPUs" in err or "fit" in err)


def test_dump_prints_each_stage_and_stops(tmp_path, capsys):
    import json

    from embark_runtime.plan import parse_plan

    assert main(["plan", TINY, "--dump", "ast"]) == 0
    assert capsys.readouterr().out.startswith("start\n")
    assert main(["plan", TINY, "--dump", "ir"]) == 0
    ir = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in ir["tables"]][:2] == ["country", "item"]
    assert main(["plan", TINY, "--dump", "plan", "--solver", "greedy"]) == 0
    assert parse_plan(capsys.readouterr().out).planner.solver == "greedy"


def test_dump_with_an_output_file_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "plan.json"
    for stage in ("ast", "ir", "plan"):
        assert main(["plan", TINY, "--dump", stage, "--solver", "greedy", "-o", str(out)]) == 2
        captured = capsys.readouterr()
        assert f"error: --dump {stage} prints on stdout; drop -o or --dump" in captured.err
        assert captured.out == ""
    assert not out.exists()


def test_an_output_path_that_names_no_file_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
):
    """An empty -o, and a path that is (or is spelt as) a folder: refused, nothing written
    (`-o new/` used to write a file named `new`, `-o ''` nothing at all, with exit 0)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    folder = "a path ending in `{}` names a folder, give a file name"
    cases = {
        "": ("-o is empty", "e.g. plan.json (or - for stdout)"),
        "new/": (folder.format("/"), "e.g. -o new/plan.json"),
        "new/.": (folder.format("."), "e.g. -o new/plan.json"),
        "plans": ("it is a folder, give a file name", "e.g. -o plans/plan.json"),
        "plans/": ("it is a folder, give a file name", "e.g. -o plans/plan.json"),
    }
    for output, (message, hint) in cases.items():
        assert main(["plan", TINY, "--solver", "greedy", "-o", output]) == 2, output
        err = capsys.readouterr().err
        assert message in err and hint in err and "internal error" not in err, (output, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans"]
    assert list((tmp_path / "plans").iterdir()) == []


def test_an_existing_plan_keeps_its_permissions(tmp_path):
    import os
    import stat

    out = tmp_path / "plan.json"
    for mode in (0o600, 0o640):
        out.write_text("old")
        os.chmod(out, mode)
        assert main(["plan", TINY, "--solver", "greedy", "-o", str(out)]) == 0
        assert load_plan(out).planner.solver == "greedy"
        assert stat.S_IMODE(out.stat().st_mode) == mode


def test_bad_solver_options_are_named_before_any_work(capsys):
    for command in ("plan", "simulate", "compile"):
        extra = ["-o", "never"] if command == "compile" else []
        for limit in ("-1", "nan", "inf"):
            assert main([command, TINY, "--time-limit", limit, *extra]) == 2
            err = capsys.readouterr().err
            assert f"--time-limit must be a positive number of seconds, got {limit}" in err
        assert main([command, TINY, "--seed", "-2", *extra]) == 2
        assert "--seed must not be negative, got -2" in capsys.readouterr().err
        assert main([command, TINY, "--seed", str(2**31), *extra]) == 2
        err = capsys.readouterr().err
        assert "--seed must be at most 2147483647" in err and "internal error" not in err
    assert not Path("never").exists()


def test_an_output_that_cannot_be_written_is_a_user_error(tmp_path, capsys):
    """-o naming a folder is refused before planning; a path that cannot be written says
    so (exit 2, no traceback) and leaves the old plan and no temporary file behind."""
    folder = tmp_path / "plans"
    folder.mkdir()
    assert main(["plan", TINY, "--solver", "greedy", "-o", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "cannot write the plan: it is a folder" in err and "plan.json" in err
    assert "internal error" not in err
    assert list(folder.iterdir()) == []
    # a file where a folder of the path should be: the write fails after planning
    (tmp_path / "file").write_text("keep")
    assert main(["plan", TINY, "--solver", "greedy", "-o", str(tmp_path / "file" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the plan:" in err and "internal error" not in err
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "plans"]


def test_an_output_through_a_link_or_into_a_stream_keeps_what_is_there(tmp_path, capsys):
    """-o through a symbolic link writes the file it names (the link stays); -o to a FIFO
    (or a device, /dev/stdout) writes into it instead of replacing it with a file."""
    import os
    import threading

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    assert main(["plan", TINY, "--solver", "greedy", "-o", str(link)]) == 0
    assert link.is_symlink() and load_plan(real).planner.strategy == "embark"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert main(["plan", TINY, "--solver", "greedy", "-o", str(fifo)]) == 0
    reader.join(timeout=30)
    assert got and got[0] == real.read_bytes()
    assert fifo.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "real.json"]


@pytest.mark.parametrize("target", ["-", "/dev/stdout"])
def test_an_output_on_standard_output_is_the_plan_alone(tmp_path, target):
    """-o - and -o /dev/stdout: standard output carries the plan only, the summary goes to
    stderr, and no file is written."""
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "embarkc.cli", "plan", TINY, "--solver", "greedy", "-o", target],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "embark-plan"
    assert "step time" in r.stderr and f"wrote {target}" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_plan_command_that_took_longer_than_its_limit_warns(tmp_path, capsys, monkeypatch):
    """The budgets are deterministic counts, so what runs whatever the limit (or a slower
    machine) can make the command overrun it: it says so on stderr, and the plan is the
    same. A fixed strategy, which searches nothing, never warns."""
    import embarkc.commands.plan as plan_cmd

    def clock(*ticks: float) -> None:
        it = iter(ticks)
        monkeypatch.setattr(plan_cmd, "_clock", lambda: next(it))

    out = tmp_path / "p.json"
    args = ["plan", TINY, "--solver", "greedy", "--time-limit", "5", "-o", str(out)]
    clock(100.0, 107.5)
    assert main(args) == 0
    warned = capsys.readouterr().err
    assert "warning: planning took 7.5 s, more than the 5 s time limit" in warned
    first = out.read_bytes()
    clock(100.0, 101.0)
    assert main(args) == 0
    assert "warning" not in capsys.readouterr().err
    assert out.read_bytes() == first
    clock(100.0, 107.5)
    assert main(["plan", TINY, "--strategy", "row-wise", "--time-limit", "5"]) == 0
    assert "warning: planning took" not in capsys.readouterr().err


def test_contradicting_bounds_of_a_colocate_group_say_which_table_set_each(tmp_path, capsys):
    """Each table's bounds are fine alone; joined they leave no grid. The error, found by
    the lowering (so `check` reports it too), shows the colocate line with its caret."""
    spec = tmp_path / "colo.embark"
    spec.write_text(
        small_hardware(8, "1 GiB") + "defaults { hotness 1 }\n"
        "table t1 { rows 1000 dim 32 }\n"
        "table t2 { rows 2 dim 8 optimizer rowwise_adagrad }\n"
        "model { batch 16 }\n"
        "plan { table t1 { row_shards 3 column_shards 2 } colocate t1, t2 }\n"
    )
    for command in ("check", "plan"):
        assert main([command, str(spec)]) == 2
        err = capsys.readouterr().err
        assert f"{spec}:6:50: error: the tables of this `colocate` share one grid, and " in err
        assert "`t1` asks for at least 3 row shards, `t2` (2 rows) allows at most 2" in err
        assert "`t1` asks for at least 2 column shards, `t2` (rowwise_adagrad) allows at" in err
        assert "  6 | plan { table t1 { row_shards 3 column_shards 2 } colocate t1, t2 }" in err
        assert "hint: relax the bounds, or drop the colocate" in err


def test_a_baseline_that_ignores_the_spec_constraints_is_not_compared_with_any_plan(
    tmp_path, capsys
):
    """With `history` pinned to ub, column-wise (all rb) is no plan of the spec: its time
    is below the lower bound on the spec's plans, and the line says why rather than
    printing "at most 0.75x any plan"."""
    spec = tmp_path / "pinned.embark"
    spec.write_text(
        Path(TINY).read_text().replace("  seed 0", "  seed 0\n  table history { cluster ub }")
    )
    assert main(["plan", str(spec), "--solver", "greedy", "--time-limit", "3"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "baseline column-wise" in ln]
    assert len(lines) == 1
    assert "ignoring the spec's constraints: not a plan of this spec" in lines[0]
    assert "any plan" not in lines[0]
