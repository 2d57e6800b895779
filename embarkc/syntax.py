"""Parse embark source text into an AST with spans.

`parse(text, filename)` returns a lark `Tree` for `grammar/embark.lark`. The tree keeps
every token (keywords and punctuation included, so that the formatter can reprint it);
`parts(tree)` gives the meaningful children (subtrees and NAME/NUMBER/UNIT/STRING
tokens). Every tree has `meta` positions and every token its line and column.

Syntax errors become an `EmbarkError`: the unexpected token, the tokens that were
expected in readable form ("expected one of `dim`, `rows`, `}`") and a did-you-mean hint
when a misspelt keyword is close to an expected one. After the first error, each later
top-level item (`table`, `model`, ... at brace depth 0) is parsed on its own and its first
error reported too, at most `MAX_SYNTAX_ERRORS` in all; when the braces do not balance or
the first error is the end of the file, only the first error is reported. Text that is not
a spec at all (binary, NUL bytes, larger than `MAX_SOURCE_BYTES`) is rejected before
parsing with a diagnostic too; nothing here raises anything but `EmbarkError`.
"""

from __future__ import annotations

import re
import stat
from bisect import bisect_left
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from embarkc.diagnostics import Diagnostic, EmbarkError, Span, did_you_mean

MAX_SOURCE_BYTES = 32 * 1024 * 1024
"""Specs are hand-written or generated: 32 MiB holds about 400,000 tables, so anything
bigger is a mistake (a data file passed as a spec, or /dev/zero)."""

MAX_SYNTAX_ERRORS = 20
"""Syntax errors reported for one file (one per top-level item); more would only scroll."""

MAX_EXPECTED_SHOWN = 16
"""Longer "expected one of" lists (after a number, LALR merges states) help nobody."""

VALUE_TOKENS = frozenset({"NAME", "NUMBER", "UNIT", "STRING", "BOOL"})

_READABLE = {
    "NAME": "a name",
    "NUMBER": "a number",
    "UNIT": "a unit",
    "STRING": 'a "string"',
    "BOOL": "`true` or `false`",
    "$END": "end of file",
}


@dataclass(frozen=True)
class Comment:
    """A `#` comment: its text (with the `#`), position, and whether code precedes it."""

    text: str
    line: int
    col: int
    trailing: bool


def _grammar_text() -> str:
    try:
        return resources.files("embarkc.grammar").joinpath("embark.lark").read_text()
    except (ModuleNotFoundError, FileNotFoundError):  # running from a source tree
        return (Path(__file__).resolve().parent.parent / "grammar" / "embark.lark").read_text()


_COMMENTS: list[Token] = []
"""Filled by the lexer during one `_parser().parse` call (parsing is not re-entrant)."""


@cache
def _parser() -> Lark:
    return Lark(
        _grammar_text(),
        parser="lalr",
        lexer="contextual",
        # spans come from a subtree's first and last tokens (`span_of`), not from lark's
        # positions on every subtree: a third of the parse on 5,000 tables (2.1 -> 1.4 s)
        propagate_positions=False,
        keep_all_tokens=True,
        maybe_placeholders=False,
        lexer_callbacks={"COMMENT": _COMMENTS.append},
    )


@cache
def _terminal_names() -> dict[str, str]:
    """Terminal name -> how to show it to a person (`rows`, `{`, a number, ...)."""
    out = dict(_READABLE)
    for term in _parser().terminals:
        if isinstance(term.pattern, PatternStr):
            out[term.name] = f"`{term.pattern.value}`"
    return out


def _keywords() -> dict[str, str]:
    """Terminal name -> keyword text, for keywords that look like names (for hints)."""
    return {
        t.name: t.pattern.value
        for t in _parser().terminals
        if isinstance(t.pattern, PatternStr) and t.pattern.value.replace("_", "a").isalpha()
    }


def readable_expected(names: set[str] | frozenset[str]) -> str:
    shown = sorted({_terminal_names().get(n, n) for n in names}, key=lambda s: (s[0] != "`", s))
    if len(shown) == 1:
        return f"expected {shown[0]}"
    return "expected one of " + ", ".join(shown)


def read_source(path: Path, shown: str, limit: int = MAX_SOURCE_BYTES) -> bytes:
    """Read a file the user named, refusing what is not a regular file or is too big
    (so `include "/dev/zero"` fails instead of hanging). Raises OSError or EmbarkError."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise EmbarkError(Diagnostic(f"is {kind}", Span.of_file(shown)))
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        if limit == MAX_SOURCE_BYTES:
            reject_json(data, shown)
        raise EmbarkError(
            Diagnostic(
                f"file is {st.st_size:,} bytes; at most {limit:,} are read",
                Span.of_file(shown),
                'is this a data file? histograms are read with `access histogram "file"`'
                if limit == MAX_SOURCE_BYTES
                else None,
            )
        )
    return data


JSON_HEAD_BYTES = 4096
"""How much of a file `looks_like_json` reads."""


def looks_like_json(head: bytes) -> bool:
    """Whether a file's first bytes open a JSON object (after a BOM and white space): no
    spec starts with `{`, so such a file is a plan (or other JSON), never a spec."""
    return head[:JSON_HEAD_BYTES].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def reject_json(data: bytes, filename: str) -> None:
    """Raise a clear EmbarkError when a spec's place holds JSON (a plan file, most often),
    where the grammar's own message would only list keywords."""
    if not looks_like_json(data):
        return
    text = data.decode("utf-8", "replace")  # keys are sorted: `format` is not at the top
    if re.search(r'"format"\s*:\s*"embark-plan"', text):
        spec = re.search(r'"source"\s*:\s*\{[^{}]*"spec"\s*:\s*"((?:[^"\\]|\\.)*)"', text)
        named = f" (this one was planned from `{spec.group(1)}`)" if spec else ""
        raise EmbarkError(
            Diagnostic(
                "this is an embark plan file (JSON), not a spec",
                Span.of_file(filename),
                "`embarkc check`, `simulate`, `diff` and `report` read plans; `plan` and "
                f"`compile` take the .embark spec a plan was made from{named} "
                "(`embarkc compile SPEC --plan PLAN` compiles a given plan of it)",
            )
        )
    raise EmbarkError(
        Diagnostic(
            "this is a JSON file, not an embark spec",
            Span.of_file(filename),
            "a spec is written in the embark language (docs/language.md); pass the .embark file",
        )
    )


def check_text(data: bytes, filename: str, limit: int = MAX_SOURCE_BYTES) -> str:
    """Decode a spec file, rejecting what cannot be a spec (too big, binary, not UTF-8,
    JSON)."""
    reject_json(data, filename)
    if len(data) > limit:
        raise EmbarkError(
            Diagnostic(
                f"file is {len(data):,} bytes; a spec may be at most {limit:,} bytes",
                Span.of_file(filename),
                'is this a data file? histograms are read with `access histogram "file"`',
            )
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise EmbarkError(
            Diagnostic(
                f"file is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                Span(filename, line, col, line, col + 1),
                "is this a binary file?",
            )
        ) from None
    cr = re.search("\r(?!\n)", text)
    if cr is not None:
        # the parser ends lines at `\n` only: a lone CR would hide the rest of a comment's
        # line, and with it whatever the file's author saw on the next lines
        raise EmbarkError(
            Diagnostic(
                "a lone carriage return (CR) ends a line here: spec lines end in LF or CRLF",
                _char_span(filename, text, cr.start()),
                "convert the file's line ends (classic Mac CR to LF), e.g. `tr '\\r' '\\n'`",
            ),
            {filename: text},
        )
    nul = text.find("\0")
    if nul >= 0:
        raise EmbarkError(
            Diagnostic("file contains a NUL byte", _char_span(filename, text, nul)),
            {filename: text},
        )
    return text


def _char_span(filename: str, text: str, at: int) -> Span:
    """The span of the one character at offset `at` of `text` (lines end at `\n`)."""
    line = text.count("\n", 0, at) + 1
    col = at - (text.rfind("\n", 0, at) + 1) + 1
    return Span(filename, line, col, line, col + 1)


BOM = "\ufeff"


def parse(text: str, filename: str = "<spec>") -> Tree:
    """Parse a spec's text; raise `EmbarkError` (with the source attached) on a syntax error."""
    return parse_with_comments(text, filename)[0]


def parse_with_comments(text: str, filename: str = "<spec>") -> tuple[Tree, list[Comment]]:
    """Parse, also returning the comments in source order (for the formatter)."""
    if "\0" in text:
        check_text(text.encode("utf-8", "surrogatepass"), filename)
    if text.startswith(BOM):
        # a byte-order mark that some editors write: parsed as the space it stands for,
        # so that columns stay right and the text (and its sha256) stays the file's
        text = " " + text[1:]
    _COMMENTS.clear()
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        first = _diagnostic(e, text, filename)
        raise EmbarkError([first, *_later_errors(e, text, filename)], {filename: text}) from None
    except RecursionError:
        raise EmbarkError(
            Diagnostic("spec is nested too deeply to parse", Span.of_file(filename)),
            {filename: text},
        ) from None
    glued = _glued_keyword(tree, text, filename)
    if glued is not None:
        raise EmbarkError(glued, {filename: text})
    code_lines: dict[int, int] = {}
    for tok in tree.scan_values(lambda v: isinstance(v, Token)):
        if tok.line is not None and tok.column is not None:
            code_lines[tok.line] = min(code_lines.get(tok.line, tok.column), tok.column)
    comments = [
        Comment(
            text=str(t).rstrip(),
            line=t.line or 0,
            col=t.column or 0,
            trailing=code_lines.get(t.line or 0, 1 << 30) < (t.column or 0),
        )
        for t in _COMMENTS
    ]
    _COMMENTS.clear()
    return tree, comments


_SCAN = re.compile(r'"([^"\\\n]|\\.)*"|#[^\n]*|\w+(-\w+)*|\s+|.')
"""Strings, comments, words (names, keywords, numbers), spaces, any other character."""


def _items(text: str) -> list[int] | None:
    """Start offsets of the top-level items: an `_item` keyword at brace depth 0 that is
    not a name after `table`, `tables` or `feature`, and any word where an item must
    begin (the file's first, the first after a block's closing `}` or an include's
    string), so that a misspelt item keyword starts an item of its own. None when the
    braces do not balance or a string is unterminated (the boundaries would be guesses)."""
    starts: list[int] = []
    depth = 0
    prev = ""
    item_due = True
    for m in _SCAN.finditer(text):
        tok = m.group()
        if tok == '"':
            return None
        if tok.isspace() or tok.startswith("#"):
            continue
        depth += (tok == "{") - (tok == "}")
        if depth < 0:
            return None
        if depth == 0:
            keyword = tok in _TOP_LEVEL and prev not in ("table", "tables", "feature")
            if keyword or (item_due and (tok[0].isalpha() or tok[0] == "_")):
                starts.append(m.start())
            item_due = tok == "}" or (prev == "include" and tok.startswith('"'))
        prev = tok
    return starts if depth == 0 else None


def _error_pos(e: UnexpectedInput) -> int | None:
    """Offset of the unexpected token or character; None at the end of the file."""
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        return e.token.start_pos or 0
    if isinstance(e, UnexpectedCharacters):
        return e.pos_in_stream or 0
    return None


def _later_errors(first: UnexpectedInput, text: str, filename: str) -> list[Diagnostic]:
    """The first syntax error of each top-level item after the one holding `first`.

    The items are independent (`start: _item*`), so parsing the text from the next item's
    keyword finds the first error of the first faulty item after it, exactly as if that
    item were alone (an error at an item's keyword belongs to the item before; an error
    at a word that starts an item but is no item keyword, a misspelt `tabel`, is that
    item's own). Parsing resumes at the item after each error; positions are shifted back
    to the whole file. At most `MAX_SYNTAX_ERRORS - 1` are returned; when an item after
    the last of them has an error too, that last one is marked `more_follow`."""
    pos = _error_pos(first)
    starts = _items(text) if pos is not None else None
    out: list[Diagnostic] = []
    while starts and pos is not None:
        i = bisect_left(starts, pos)
        if i < len(starts) and starts[i] == pos:
            word = re.match(r"\w+", text[pos:])
            if word is None or word.group() not in _TOP_LEVEL:
                i += 1
        if i == len(starts):
            break
        start = starts[i]
        rest = text[start:]
        _COMMENTS.clear()
        try:
            _parser().parse(rest)
            break
        except UnexpectedInput as e:
            if len(out) == MAX_SYNTAX_ERRORS - 1:
                # parsed only to know that the cap hid something
                out[-1] = replace(out[-1], more_follow=True)
                break
            out.append(_shifted(_diagnostic(e, rest, filename), text, start))
            at = _error_pos(e)
            pos = None if at is None else start + max(at, 1)
        except RecursionError:
            break
    _COMMENTS.clear()
    return out


def _shifted(d: Diagnostic, text: str, start: int) -> Diagnostic:
    """`d`, found in `text[start:]`, with its span moved to its place in `text`."""
    lines = text.count("\n", 0, start)
    cols = start - (text.rfind("\n", 0, start) + 1)
    s = d.span
    if s.line <= 0:
        return d
    span = Span(
        s.file,
        s.line + lines,
        s.col + (cols if s.line == 1 else 0),
        s.end_line + lines,
        s.end_col + (cols if s.end_line == 1 else 0),
    )
    return replace(d, span=span)


_IDENT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def _word_diagnostic(text: str, start: int, filename: str) -> Diagnostic:
    """`unknown keyword` for the word starting at `start` (a keyword glued to more text)."""
    end = start
    while end < len(text) and (text[end] in _IDENT_CHARS or text[end] == "-"):
        end += 1
    word = text[start:end]
    line = text.count("\n", 0, start) + 1
    col = start - (text.rfind("\n", 0, start) + 1) + 1
    keywords = set(_keywords().values())
    hint = None
    for kw in sorted(keywords, key=len, reverse=True):
        if word.startswith(kw) and word[len(kw) :].isdigit():
            hint = f"put a space between `{kw}` and `{word[len(kw) :]}`"
            break
    return Diagnostic(
        f"unknown keyword `{word}`",
        Span(filename, line, col, line, col + len(word)),
        hint or did_you_mean(word, keywords),
    )


def _glued_keyword(tree: Tree, text: str, filename: str) -> Diagnostic | None:
    """The contextual lexer matches a keyword as a prefix (`nodes2` as `nodes` `2`); a
    keyword must end where the word ends."""
    kw_types = _keywords()
    for tok in tree.scan_values(lambda v: isinstance(v, Token)):
        end = tok.end_pos
        if tok.type in kw_types and end is not None and end < len(text):
            if text[end] in _IDENT_CHARS:
                return _word_diagnostic(text, tok.start_pos or 0, filename)
    return None


def _diagnostic(e: UnexpectedInput, text: str, filename: str) -> Diagnostic:
    line = getattr(e, "line", 0) or 0
    col = getattr(e, "column", 0) or 0
    pos = getattr(e, "pos_in_stream", None)
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        pos = e.token.start_pos
    if pos is not None and 0 < pos <= len(text) and text[pos - 1] in _IDENT_CHARS:
        # The error is inside a word: a keyword matched a prefix of it.
        start = pos
        while start > 0 and text[start - 1] in _IDENT_CHARS:
            start -= 1
        if text[start] not in "0123456789-":
            return _word_diagnostic(text, start, filename)
    if isinstance(e, UnexpectedToken) and e.token.type == "$END" or isinstance(e, UnexpectedEOF):
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
        expected = (
            _accepted(e)
            if isinstance(e, UnexpectedToken)
            else {str(x) for x in getattr(e, "expected", ()) or ()}
        )
        open_brace = _unclosed_brace(text)
        msg = "unexpected end of file"
        if open_brace is not None:
            bline, bcol = open_brace
            return Diagnostic(
                f"{msg}: the `{{` at line {bline} is never closed",
                Span(filename, bline, bcol, bline, bcol + 1),
                "add the missing `}`",
            )
        if len(expected) <= MAX_EXPECTED_SHOWN:
            msg += f"; {readable_expected(expected)}"
        return Diagnostic(msg, Span(filename, line, col, line, col + 1))
    if isinstance(e, UnexpectedToken):
        tok = e.token
        width = max(len(str(tok)), 1)
        span = Span(filename, line, col, tok.end_line or line, (tok.end_column or col + width))
        if tok.end_line != line:
            span = Span(filename, line, col, line, col + width)
        expected = _accepted(e)
        shown = _terminal_names().get(tok.type, "")
        what = f"`{tok}`" if tok.type in VALUE_TOKENS or not shown else shown
        hint = None
        if tok.type == "NAME" or tok.type in _keywords():
            kws = {v for k, v in _keywords().items() if k in expected}
            hint = did_you_mean(str(tok), kws)
        if hint is None and str(tok) in _TOP_LEVEL and "RBRACE" in expected:
            hint = f"is a `}}` missing before `{tok}`?"
        msg = f"unexpected {what}"
        if len(expected) <= MAX_EXPECTED_SHOWN:
            msg += f"; {readable_expected(expected)}"
        elif tok.type in VALUE_TOKENS and str(tok)[:1].isdigit():
            msg += "; a field takes one value (is a name or keyword missing before it?)"
        return Diagnostic(msg, span, hint)
    if isinstance(e, UnexpectedCharacters):
        pos = e.pos_in_stream or 0
        ch = text[pos] if 0 <= pos < len(text) else "?"
        shown_ch = ch if ch.isprintable() else repr(ch)[1:-1]
        allowed = set(e.allowed or ())
        word = _word_at(text, pos)
        hint = None
        if word and allowed:
            kws = {v for k, v in _keywords().items() if k in allowed}
            hint = did_you_mean(word, kws)
        msg = f"unexpected character `{shown_ch}`"
        if word and len(word) > 1:
            msg = f"unexpected `{word}`"
        if allowed and len(allowed) <= 4:
            msg += f"; {readable_expected(allowed)}"
        if ch == ";":
            hint = "fields are separated by spaces or new lines, without `;`"
        if ch == "'":
            hint = 'strings use double quotes: "file"'
        if ch == BOM:
            hint = "a byte-order mark (U+FEFF) belongs only at the very start of a file: delete it"
        width = max(len(word), 1) if word else 1
        return Diagnostic(msg, Span(filename, line, col, line, col + width), hint)
    return Diagnostic(str(e).splitlines()[0], Span(filename, line, col, line, col + 1))


_TOP_LEVEL = frozenset(
    {"hardware", "defaults", "table", "tables", "feature", "model", "plan", "include"}
)


def _accepted(e: UnexpectedToken) -> set[str]:
    """The terminals the parser accepts at the error, after the reductions that LALR's
    merged states postpone (so `rows 10 10` lists the table's fields, not every follower
    of a number anywhere in the grammar)."""
    try:
        if e.interactive_parser is not None:
            return set(e.interactive_parser.accepts())
    except Exception:  # noqa: BLE001 - a better message is optional; the error is not
        pass
    return set(e.expected)


def _unclosed_brace(text: str) -> tuple[int, int] | None:
    """Line and column of the innermost `{` left open at the end of `text`, if any."""
    stack: list[tuple[int, int]] = []
    line, col = 1, 0
    in_string = in_comment = False
    prev = ""
    for ch in text:
        col += 1
        if ch == "\n":
            line, col = line + 1, 0
            in_comment = False
            in_string = False
        elif in_comment:
            pass
        elif in_string:
            if ch == '"' and prev != "\\":
                in_string = False
        elif ch == "#":
            in_comment = True
        elif ch == '"':
            in_string = True
        elif ch == "{":
            stack.append((line, col))
        elif ch == "}" and stack:
            stack.pop()
        prev = ch
    return stack[-1] if stack else None


def _word_at(text: str, pos: int) -> str:
    end = pos
    while end < len(text) and (text[end].isalnum() or text[end] in "_-./"):
        end += 1
    return text[pos:end]


def parts(tree: Tree) -> list[Tree | Token]:
    """The meaningful children of a node: subtrees and value tokens, no punctuation."""
    return [
        c
        for c in tree.children
        if isinstance(c, Tree) or (isinstance(c, Token) and c.type in VALUE_TOKENS)
    ]


def span_of(node: Tree | Token, filename: str) -> Span:
    """The source span of a subtree or token (1-based, end exclusive)."""
    if isinstance(node, Token):
        line = node.line or 0
        col = node.column or 0
        return Span(filename, line, col, node.end_line or line, node.end_column or col + 1)
    first = edge_token(node)
    if first is None:
        return Span(filename)
    last = edge_token(node, last=True)
    assert last is not None
    line = first.line or 0
    end_line = last.end_line or line
    return Span(filename, line, first.column or 0, end_line, last.end_column or 1)


def edge_token(node: Tree, last: bool = False) -> Token | None:
    """The first (or `last`) token of a subtree, None when it holds none (the parser
    keeps every token, punctuation included, so these are where the subtree starts and
    ends in the source)."""
    kids = reversed(node.children) if last else node.children
    for c in kids:
        if isinstance(c, Token):
            return c
        if isinstance(c, Tree):
            t = edge_token(c, last)
            if t is not None:
                return t
    return None
