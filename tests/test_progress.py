"""Commands that plan a spec show what the planner is doing on a terminal (embarkc.progress)
and nothing elsewhere; watching never changes the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from embarkc import progress
from embarkc.cli import main
from embarkc.frontend import load_program
from embarkc.planner import plan_program, plan_to_json

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"


def test_status_text_names_the_spec_the_stage_and_the_best_step_time():
    assert progress.status_text("tiny.embark", "cp-sat", 0.404, 0.0012345) == (
        "planning tiny.embark: cp-sat 40 %, best step time 1.234 ms"
    )
    assert progress.status_text("x", "greedy", 1.7, 0.001).startswith("planning x: greedy 100 %")


def test_on_a_terminal_the_stages_are_shown_and_the_plan_is_the_same(monkeypatch, capsys):
    program = load_program(str(TINY))
    want = plan_to_json(plan_program(program, solver="cp-sat", time_limit=3))
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    capsys.readouterr()
    got = progress.planned(program, "tiny.embark", solver="cp-sat", time_limit=3)
    err = capsys.readouterr().err
    assert plan_to_json(got) == want
    assert "planning tiny.embark" in err


def test_quiet_or_off_a_terminal_nothing_is_drawn(monkeypatch, capsys):
    program = load_program(str(TINY))
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    capsys.readouterr()
    progress.planned(program, "tiny.embark", quiet=True, solver="greedy")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    progress.planned(program, "tiny.embark", solver="greedy")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["compile", "report", "diff"])
def test_compile_report_and_diff_of_a_spec_show_the_planning(
    command, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    args = {
        "compile": ["compile", str(TINY), "-o", str(tmp_path / "out"), "--solver", "greedy"],
        "report": ["report", str(TINY), "-o", str(tmp_path / "r.html")],
        "diff": ["diff", str(TINY), str(TINY)],
    }[command]
    capsys.readouterr()
    assert main(args) in (0, 1)
    assert "planning " in capsys.readouterr().err
