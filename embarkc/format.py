"""The canonical formatter for embark specs (`embarkc fmt`).

`format_text(text, filename)` returns the canonical form of a spec; it raises
`EmbarkError` if the text does not parse (a formatter never guesses). The result parses
to the same tree (up to whitespace, comments and trailing commas in lists), so it lowers
to the same IR, and formatting it again changes nothing.

The canonical form:

* two-space indentation, one field per line inside a block, `}` on its own line;
* a block written on one line (`tables t[0..9] { rows 1000 hotness 1 }`) stays on one
  line if it fits in `LINE_WIDTH` columns, so compact table groups stay compact;
* one space between tokens, none inside `(...)`, `[...]`, before `,` or around `..`;
  a number and its unit are separated by one space (`80 GiB`); trailing commas dropped;
* comments are kept: a comment on its own line stays before what follows it, a comment
  after code stays at the end of that code's line; at most one blank line is kept
  between two elements where the source had any, and top-level multi-line blocks are
  always separated by one.
"""

from __future__ import annotations

from lark import Token, Tree

from embarkc.syntax import Comment, parse_with_comments, span_of

LINE_WIDTH = 100
INDENT = "  "
BLOCKS = frozenset(
    {"hardware", "defaults", "table", "tables", "feature", "model", "plan", "constrain"}
)


def format_text(text: str, filename: str = "<spec>") -> str:
    """The canonical text of a spec; raises `EmbarkError` when it does not parse."""
    tree, comments = parse_with_comments(text, filename)
    return _Formatter(text, comments).file(tree)


def _tokens(node: Tree | Token) -> list[Token]:
    if isinstance(node, Token):
        return [node]
    return list(node.scan_values(lambda v: isinstance(v, Token)))


def _first_line(node: Tree | Token) -> int:
    if isinstance(node, Token):
        return node.line or 0
    return span_of(node, "").line


def _last_line(node: Tree | Token) -> int:
    if isinstance(node, Token):
        return node.end_line or node.line or 0
    return span_of(node, "").end_line


def join_tokens(tokens: list[Token]) -> str:
    """Tokens of one line with canonical spacing (see the module docstring)."""
    out: list[str] = []
    prev: Token | None = None
    for i, tok in enumerate(tokens):
        value = str(tok)
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.type == "COMMA" and nxt is not None and nxt.type == "RSQB":
            continue  # trailing comma in a list
        if prev is not None:
            p = str(prev)
            glued = (
                value in (",", ")", "]")
                or p in ("(", "[")
                or (value == ".." and prev.type == "NUMBER")
                or (p == ".." and tok.type == "NUMBER")
                or (value in ("(", "[") and prev.type == "NAME")
                or (p == "{" and value == "}")
            )
            if not glued:
                out.append(" ")
        out.append(value)
        prev = tok
    return "".join(out)


class _Formatter:
    def __init__(self, text: str, comments: list[Comment]):
        self.lines = text.splitlines()
        self.pending = sorted(comments, key=lambda c: (c.line, c.col))
        self.out: list[str] = []
        self.last_source_line = 0

    def _blank_between(self, a: int, b: int) -> bool:
        """Whether the source has an empty line strictly between lines a and b."""
        return any(
            not self.lines[i - 1].strip() for i in range(max(a + 1, 1), min(b, len(self.lines) + 1))
        )

    def _emit(self, depth: int, text: str, first: int, last: int, *, blank_ok: bool) -> None:
        if (
            blank_ok
            and self.out
            and self.out[-1] != ""
            and self._blank_between(self.last_source_line, first)
        ):
            self.out.append("")
        trailing = [c for c in self.pending if c.trailing and first <= c.line <= last]
        for c in trailing:
            self.pending.remove(c)
        line = INDENT * depth + text
        if trailing:
            line += "  " + " ".join(c.text for c in trailing)
        self.out.append(line)
        self.last_source_line = max(self.last_source_line, last)

    def _leading(self, depth: int, before: int, *, blank_ok: bool) -> None:
        """Emit the comments that stand before source line `before`."""
        while self.pending and self.pending[0].line < before:
            c = self.pending.pop(0)
            self._emit(depth, c.text, c.line, c.line, blank_ok=blank_ok)
            blank_ok = True

    def file(self, tree: Tree) -> str:
        prev_multi = False
        for item in tree.children:
            if not isinstance(item, Tree):
                continue
            start = len(self.out)
            if prev_multi and self.out and self.out[-1] != "":
                self.out.append("")
            self._leading(0, _first_line(item), blank_ok=True)
            if item.data in BLOCKS:
                self.block(item, 0, blank_ok=True)
            else:
                self._emit(
                    0,
                    join_tokens(_tokens(item)),
                    _first_line(item),
                    _last_line(item),
                    blank_ok=True,
                )
            multi = len(self.out) - start > 1 and any(
                line.startswith(INDENT) for line in self.out[start:]
            )
            if multi and start > 0 and self.out[start] != "" and self.out[start - 1] != "":
                self.out.insert(start, "")
            prev_multi = multi
        self._leading(0, 1 << 30, blank_ok=True)
        while self.out and self.out[-1] == "":
            self.out.pop()
        return "\n".join(self.out) + "\n" if self.out else ""

    def block(self, tree: Tree, depth: int, *, blank_ok: bool) -> None:
        children = tree.children
        lb = next(i for i, c in enumerate(children) if isinstance(c, Token) and c.type == "LBRACE")
        header = [t for c in children[:lb] for t in _tokens(c)]
        lbrace = children[lb]
        rbrace = children[-1]
        assert isinstance(lbrace, Token) and isinstance(rbrace, Token)
        fields = [c for c in children[lb + 1 : -1] if isinstance(c, Tree)]
        first, last = _first_line(tree), _last_line(tree)
        inner_comments = any(first <= c.line < last for c in self.pending)
        if lbrace.line == rbrace.line and not inner_comments:
            body = " ".join(join_tokens(_tokens(f)) for f in fields)
            one = join_tokens(header) + (" { " + body + " }" if body else " {}")
            if len(INDENT * depth + one) <= LINE_WIDTH:
                self._emit(depth, one, first, last, blank_ok=blank_ok)
                return
        self._emit(
            depth, join_tokens(header) + " {", first, lbrace.line or first, blank_ok=blank_ok
        )
        inner_blank = False
        for f in fields:
            self._leading(depth + 1, _first_line(f), blank_ok=inner_blank)
            if f.data in BLOCKS:
                self.block(f, depth + 1, blank_ok=inner_blank)
            else:
                self._emit(
                    depth + 1,
                    join_tokens(_tokens(f)),
                    _first_line(f),
                    _last_line(f),
                    blank_ok=inner_blank,
                )
            inner_blank = True
        self._leading(depth + 1, rbrace.line or last, blank_ok=inner_blank)
        self._emit(depth, "}", rbrace.line or last, rbrace.line or last, blank_ok=False)
