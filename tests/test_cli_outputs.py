"""The CLI when the reader of its stdout or stderr goes away (`embarkc check *.json | head`):
what is printed there is dropped, and the command still writes its files and exits with
its own status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embarkc.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"

WARNS = (
    "hardware { preset dgx_h100 nodes 1 }\n"
    "table a { rows 1000 dim 16 hotness 1 }\n"
    "plan { communication hierarchical }\n"
    "model { batch 64 }\n"
)
"""A spec that plans, with a warning printed on stderr before anything is written."""


def _embarkc_into_a_closed_pipe(
    argv: list[str], cwd: Path, *, stderr_too: bool, buffered: bool
) -> subprocess.CompletedProcess[str]:
    """Run `embarkc argv` with stdout (and stderr, when `stderr_too`) on a pipe whose
    reader is gone before it starts, as `embarkc ... | true` is once `true` has exited
    (closed first, so that no write can come before it)."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONUNBUFFERED": "" if buffered else "1"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "embarkc.cli", *argv],
            stdout=write,
            stderr=write if stderr_too else subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            timeout=300,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_check_keeps_its_exit_code_when_its_reader_goes_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffered: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY, "tiny.embark")
    assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "good.json"]) == 0
    Path("bad.embark").write_text("table a { rows -1 }\n")
    r = _embarkc_into_a_closed_pipe(
        ["check", "good.json", "bad.embark"], tmp_path, stderr_too=False, buffered=buffered
    )
    assert r.returncode == 2, r.stderr
    assert "bad.embark:1:16: error: rows must be positive, got -1" in r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    r = _embarkc_into_a_closed_pipe(
        ["check", "good.json"], tmp_path, stderr_too=False, buffered=buffered
    )
    assert (r.returncode, r.stderr) == (0, "")


def test_plan_writes_its_file_when_the_reader_of_both_streams_goes_away(tmp_path: Path) -> None:
    (tmp_path / "warns.embark").write_text(WARNS)
    r = _embarkc_into_a_closed_pipe(
        ["plan", "warns.embark", "--solver", "greedy", "-o", "p.json"],
        tmp_path,
        stderr_too=True,
        buffered=True,
    )
    assert r.returncode == 0
    assert json.loads((tmp_path / "p.json").read_text())["format"] == "embark-plan"


def test_compile_writes_its_folder_when_the_reader_of_both_streams_goes_away(
    tmp_path: Path,
) -> None:
    (tmp_path / "warns.embark").write_text(WARNS)
    r = _embarkc_into_a_closed_pipe(
        ["compile", "warns.embark", "--solver", "greedy", "-o", "out"],
        tmp_path,
        stderr_too=True,
        buffered=False,
    )
    assert r.returncode == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert all((tmp_path / "out" / path).is_file() for path in manifest["files"])
    assert "plan.json" in manifest["files"]


def test_the_cli_starts_without_the_heavy_imports() -> None:
    code = "import sys, embarkc.cli; print(sorted({'torch', 'ortools'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_a_report_path_that_names_no_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o new.html/` used to write a file named `new.html`, `-o ''` to name no file."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY, "tiny.embark")
    assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "plan.json"]) == 0
    Path("folder.html").mkdir()
    cases = {
        "": "plan.json: error: -o is empty",
        "new.html/": "a path ending in `/` names a folder, give a file name",
        "new.html/.": "a path ending in `.` names a folder, give a file name",
        "folder.html": "cannot write the report: it is a folder, give a file name",
    }
    capsys.readouterr()
    for output, message in cases.items():
        assert main(["report", "plan.json", "-o", output]) == 2, output
        err = capsys.readouterr().err
        assert message in err and "internal error" not in err, (output, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.html", "plan.json", "tiny.embark"]
