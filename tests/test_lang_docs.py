"""Every ```embark example in docs/language.md parses, and the presets table is true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embarkc.presets import PRESETS
from embarkc.syntax import parse

DOC = Path(__file__).resolve().parent.parent / "docs" / "language.md"
EXAMPLES = re.findall(r"```embark\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_examples() -> None:
    assert len(EXAMPLES) >= 8


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.split()[0])
def test_doc_example_parses(example: str) -> None:
    parse(example, "docs/language.md")


def test_doc_lists_every_preset() -> None:
    text = DOC.read_text()
    for name in PRESETS:
        assert f"| `{name}` |" in text
