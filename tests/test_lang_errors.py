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
from embarkc.syntax import MAX_SYNTAX_ERRORS, parse

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


@pytest.mark.parametrize(
    "name", ["field_misspelt.embark", "several_errors.embark", "syntax_errors_in_two_blocks.embark"]
)
def test_cli_prints_diagnostics_and_exits_2(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(CASES)
    assert main(["check", name]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err == (CASES / name.replace(".embark", ".err")).read_text()
    assert "Traceback" not in err


def _syntax_errors(text: str) -> list[tuple[int, str]]:
    with pytest.raises(EmbarkError) as info:
        parse(text, "t.embark")
    return [(d.span.line, d.message.split(";")[0]) for d in info.value.diagnostics]


def test_one_syntax_error_per_top_level_item_in_source_order() -> None:
    text = (
        "table a { rows x }\n"
        "include\n"  # incomplete: the error is at the next item's keyword
        "table b { rows 1 }\n"
        "table model { rowz 1 }  model { batch 1 dimm 3 dimm 4 }\n"  # `model` names a table
    )
    assert _syntax_errors(text) == [
        (1, "unexpected `x`"),
        (3, "unexpected `table`"),
        (4, "unexpected `rowz`"),
        (4, "unexpected `dimm`"),
    ]


def test_syntax_errors_stop_where_item_boundaries_are_guesses() -> None:
    after = "\nmodel { batchh 1 }\n"
    assert len(_syntax_errors('include "abc' + after)) == 1  # unterminated string
    assert len(_syntax_errors("table a { rowz 1 } }" + after)) == 1  # extra `}`
    assert len(_syntax_errors("table a { rowz 1 " + after)) == 1  # missing `}`


def test_syntax_errors_are_capped() -> None:
    text = "".join(f"table t{i} {{ rowz 1 }}\n" for i in range(MAX_SYNTAX_ERRORS + 5))
    errors = _syntax_errors(text)
    assert len(errors) == MAX_SYNTAX_ERRORS
    assert [line for line, _ in errors] == list(range(1, MAX_SYNTAX_ERRORS + 1))


def test_spans_are_what_lark_positions_would_give() -> None:
    """The parser keeps no positions on subtrees (a third of the parse on 5,000 tables):
    `span_of` takes a subtree's span from its first and last tokens. Every subtree of the
    shipped and golden specs gets exactly the span lark's `propagate_positions` gives; an
    off-by-one in the token walk, or a subtree that ends in an empty rule, fails here."""
    from lark import Lark

    from embarkc import syntax
    from embarkc.diagnostics import Span

    positioned = Lark(
        syntax._grammar_text(),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        keep_all_tokens=True,
        maybe_placeholders=False,
        lexer_callbacks={"COMMENT": lambda t: None},
    )
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "specs").rglob("*.embark")) + sorted(CASES.glob("*.embark"))
    compared = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            want_tree = positioned.parse(text)
        except Exception:  # golden cases with syntax errors or bad bytes: nothing to compare
            continue
        got_tree = syntax._parser().parse(text)
        syntax._COMMENTS.clear()
        want = list(want_tree.iter_subtrees())
        got = list(got_tree.iter_subtrees())
        assert len(want) == len(got), path
        for w, g in zip(want, got, strict=True):
            m = w.meta
            expected = (
                Span("f")
                if getattr(m, "empty", True)
                else Span("f", m.line, m.column, m.end_line, m.end_column)
            )
            assert syntax.span_of(g, "f") == expected, (path, g.data)
            compared += 1
    assert compared > 1000


def test_many_diagnostics_render_capped_with_a_count() -> None:
    """A spec with a mistake on each of thousands of lines prints the first MAX_SHOWN
    diagnostics, each with its caret line, and counts the rest (no wall of text; the
    source is split into lines once, not once per diagnostic)."""
    from embarkc.diagnostics import MAX_SHOWN, Diagnostic, EmbarkError, Span

    n = 5000
    text = "".join(f"table t{i} {{ rows 10 hotnes 1 }}\n" for i in range(n))
    diags = [
        Diagnostic("unknown field `hotnes`", Span("big.embark", i + 1, 18, i + 1, 24))
        for i in range(n)
    ]
    out = EmbarkError(diags, {"big.embark": text}).render()
    assert out.count(": error: unknown field") == MAX_SHOWN
    assert out.count("^^^^^^") == MAX_SHOWN
    assert f"  {MAX_SHOWN} | table t{MAX_SHOWN - 1} " in out
    assert out.endswith(
        f"{n:,} errors; the first {MAX_SHOWN} diagnostics are shown and "
        f"{n - MAX_SHOWN:,} more are not: fix these and run again"
    )
