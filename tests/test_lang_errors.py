"""Golden diagnostics: every tests/golden_errors/*.embark fails with exactly its .err text.

Each case is one mistake a person can make; the expected output (message, source line,
caret, hint) sits next to it. `EMBARKC_ACCEPT=1 pytest tests/test_lang_errors.py`
rewrites the .err files; review their diff like code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from embarkc.cli import main
from embarkc.diagnostics import EXIT_USER_ERROR, EmbarkError
from embarkc.frontend import load_program

CASES = Path(__file__).resolve().parent / "golden_errors"
SPECS = sorted(p.name for p in CASES.glob("*.embark"))
ACCEPT = os.environ.get("EMBARKC_ACCEPT") == "1"


def test_there_are_at_least_40_cases() -> None:
    assert len(SPECS) >= 40


@pytest.mark.parametrize("name", SPECS)
def test_golden_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CASES)
    with pytest.raises(EmbarkError) as info:
        load_program(name)
    got = info.value.render() + "\n"
    expected_path = CASES / (name.removesuffix(".embark") + ".err")
    if ACCEPT:
        expected_path.write_text(got)
    assert expected_path.exists(), f"no {expected_path.name}; run with EMBARKC_ACCEPT=1"
    assert got == expected_path.read_text()


@pytest.mark.parametrize("name", ["field_misspelt.embark", "several_errors.embark"])
def test_cli_prints_diagnostics_and_exits_2(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(CASES)
    assert main(["check", name]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err == (CASES / name.replace(".embark", ".err")).read_text()
    assert "Traceback" not in err
