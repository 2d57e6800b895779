"""The canonical formatter: exact output, idempotence, comments kept, same IR, CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embarkc.cli import main
from embarkc.diagnostics import EXIT_FAILURE, EXIT_OK, EXIT_USER_ERROR, EmbarkError
from embarkc.format import format_text
from embarkc.frontend import load_program_text

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").rglob("*.embark"))
GOLDEN = sorted((ROOT / "tests" / "golden_errors").glob("*.embark"))

MESSY = """\
# head comment

include "hw.embark"   # trailing on include
defaults {
    dim 16     # trailing on dim


    # standalone in block
  pooling sum
}
tables t[0..99] {rows 1000   hotness 1 access zipf( 1.1 , sorted ) optimizer adam{lr 0.001} }
table a { rows 40M
  hotness mean 2 max 10 }
model {batch 64 bottom_mlp [ 1, 2, ] interaction dcnv2 {}}
plan { table a { row_shards 2 .. column_shards .. 4 } colocate a , t0
  # before end
}
# end comment
"""

CANONICAL = """\
# head comment

include "hw.embark"  # trailing on include

defaults {
  dim 16  # trailing on dim

  # standalone in block
  pooling sum
}

tables t[0..99] { rows 1000 hotness 1 access zipf(1.1, sorted) optimizer adam { lr 0.001 } }

table a {
  rows 40M
  hotness mean 2 max 10
}

model { batch 64 bottom_mlp [1, 2] interaction dcnv2 {} }

plan {
  table a { row_shards 2.. column_shards ..4 }
  colocate a, t0
  # before end
}
# end comment
"""


def _semantic(text: str, folder: Path) -> dict:
    """The lowered IR without spans and source hashes (what formatting must not change);
    includes resolve in `folder`."""
    program = load_program_text(text, str(folder / "spec.embark"))
    dump = program.model_dump(mode="json")
    dump.pop("sources")

    def strip(v: object) -> object:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k != "span"}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    return strip(dump)  # type: ignore[return-value]


def _comments(text: str) -> list[str]:
    return [line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line]


def test_messy_spec_formats_to_the_canonical_text() -> None:
    assert format_text(MESSY) == CANONICAL


def test_formatting_keeps_every_comment_in_order() -> None:
    assert _comments(format_text(MESSY)) == _comments(MESSY)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_are_canonical(path: Path) -> None:
    text = path.read_text()
    assert format_text(text) == text


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_formatting_is_idempotent(path: Path) -> None:
    try:
        text = path.read_text()
        once = format_text(text)
    except (EmbarkError, UnicodeDecodeError):
        return
    assert format_text(once) == once
    assert _comments(once) == _comments(text)


def test_formatting_does_not_change_the_ir(tmp_path: Path) -> None:
    fixed = MESSY.replace("dcnv2 {}", "dcnv2 {}").replace("plan {", "plan {\n  seed 1")
    fixed = fixed.replace("{rows 1000", "{rows 1000 dim 8")
    (tmp_path / "hw.embark").write_text("hardware { preset dgx_h100 nodes 2 }\n")
    assert _semantic(format_text(fixed), tmp_path) == _semantic(fixed, tmp_path)
    for path in SPECS:
        if path.parent.name == "hardware":  # an include, not a whole spec
            continue
        text = path.read_text()
        messy = re.sub(r"\n", "\n\n   ", text).replace("{", " {\n")
        assert _semantic(format_text(messy), path.parent) == _semantic(text, path.parent)


_WS = st.sampled_from([" ", "  ", "\n", " \n  ", "\t"])
_TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z0-9_.-]+(?:/s)?|\S')


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(_WS, min_size=50, max_size=50))
def test_whitespace_does_not_matter(spaces: list[str]) -> None:
    text = (ROOT / "specs" / "tiny.embark").read_text()
    bare = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    tokens = _TOKEN.findall(bare)
    respaced = "".join(t + spaces[i % len(spaces)] for i, t in enumerate(tokens))
    out = format_text(respaced)
    assert format_text(out) == out
    specs = ROOT / "specs"
    assert _semantic(out, specs) == _semantic(text, specs)


def test_fmt_check_reports_files_that_would_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.embark"
    bad = tmp_path / "bad.embark"
    good.write_text(CANONICAL)
    bad.write_text(MESSY)
    assert main(["fmt", "--check", str(good), str(bad)]) == EXIT_FAILURE
    assert capsys.readouterr().out == f"would reformat {bad}\n"
    assert bad.read_text() == MESSY
    assert main(["fmt", "--check", str(good)]) == EXIT_OK


def test_fmt_rewrites_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.embark"
    bad.write_text(MESSY)
    assert main(["fmt", str(bad)]) == EXIT_OK
    assert bad.read_text() == CANONICAL
    assert main(["fmt", "--check", str(bad)]) == EXIT_OK


def test_fmt_refuses_a_spec_that_does_not_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "broken.embark"
    bad.write_text("table a { rows 10\n")
    assert main(["fmt", str(bad)]) == EXIT_USER_ERROR
    assert "never closed" in capsys.readouterr().err
    assert bad.read_text() == "table a { rows 10\n"


def test_fmt_keeps_the_permissions_of_the_spec(tmp_path: Path) -> None:
    import os
    import stat

    spec = tmp_path / "private.embark"
    for mode in (0o600, 0o640, 0o664):
        spec.write_text(MESSY)
        os.chmod(spec, mode)
        assert main(["fmt", str(spec)]) == EXIT_OK
        assert spec.read_text() == CANONICAL
        assert stat.S_IMODE(spec.stat().st_mode) == mode


def test_fmt_keeps_a_byte_order_mark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An editor that writes a BOM writes it again at its next save: fmt keeps it, so a
    canonical file with one passes --check."""
    bom = b"\xef\xbb\xbf"
    spec = tmp_path / "bom.embark"
    spec.write_bytes(bom + MESSY.encode())
    assert main(["fmt", str(spec)]) == EXIT_OK
    assert spec.read_bytes() == bom + CANONICAL.encode()
    capsys.readouterr()
    assert main(["fmt", "--check", str(spec)]) == EXIT_OK
    assert capsys.readouterr().out == ""
    # and none is added where there was none
    spec.write_bytes(MESSY.encode())
    assert main(["fmt", str(spec)]) == EXIT_OK
    assert spec.read_bytes() == CANONICAL.encode()


def test_fmt_keeps_crlf_line_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The line ends of the first line are the file's: CRLF stays CRLF, in every line."""
    spec = tmp_path / "crlf.embark"
    spec.write_bytes(MESSY.replace("\n", "\r\n").encode())
    assert main(["fmt", str(spec)]) == EXIT_OK
    assert spec.read_bytes() == CANONICAL.replace("\n", "\r\n").encode()
    capsys.readouterr()
    assert main(["fmt", "--check", str(spec)]) == EXIT_OK
    assert capsys.readouterr().out == ""
    # mixed: a first line in LF makes every line LF
    spec.write_bytes(MESSY.replace("\n", "\r\n").replace("\r\n", "\n", 1).encode())
    assert main(["fmt", str(spec)]) == EXIT_OK
    assert spec.read_bytes() == CANONICAL.encode()


def test_fmt_refuses_special_files_and_oversized_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO (which would block the read forever), a device and a folder are refused as
    `check` refuses them, and so is a file above the largest spec read; each is named, the
    exit code is 2, and the other files named are still formatted."""
    import os

    from embarkc.syntax import MAX_SOURCE_BYTES

    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.embark"
    big.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    good = tmp_path / "good.embark"
    good.write_text("table a { rows 10   dim 4 }\nmodel { batch 8 }\n")
    code = main(["fmt", str(fifo), "/dev/zero", str(tmp_path), str(big), str(good)])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    assert f"{fifo}: error: is not a regular file" in err
    assert "/dev/zero: error: is not a regular file" in err
    assert f"{tmp_path}: error: is a directory" in err
    assert f"{big}: error: file is {MAX_SOURCE_BYTES + 1:,} bytes" in err
    assert big.read_bytes() == b"#" * (MAX_SOURCE_BYTES + 1)
    assert good.read_text() == format_text(good.read_text(), "good.embark")
    assert "rows 10   dim" not in good.read_text()


def test_fmt_keeps_a_hard_linked_spec_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec with a second hard link is rewritten in place: both names show the formatted
    text and stay one file (an atomic rename would split them), and no backup is left."""
    import os

    spec = tmp_path / "a.embark"
    spec.write_text("table a { rows 10   dim 4 }\nmodel { batch 8 }\n")
    other = tmp_path / "b.embark"
    os.link(spec, other)
    inode = os.stat(spec).st_ino
    assert main(["fmt", str(spec)]) == EXIT_OK
    assert os.stat(spec).st_ino == inode and os.path.samefile(spec, other)
    assert other.read_text() == spec.read_text() == format_text(spec.read_text(), "a.embark")
    assert "rows 10   dim" not in other.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.embark", "b.embark"]
