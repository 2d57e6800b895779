"""Source spans, diagnostics and the one exception type users ever see.

A `Diagnostic` renders as::

    specs/x.embark:3:5: error: unknown field `hotnes`
      3 |     hotnes 3
        |     ^^^^^^
      hint: did you mean `hotness`?

Every user-facing failure of the compiler is an `EmbarkError` carrying one or more
diagnostics; the CLI prints them and exits with `EXIT_USER_ERROR`. Errors that have no
source position (a corrupt plan file, an impossible plan) use a span whose file is the
offending path and whose line is 0, and render as ``path: error: message``.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1
"""A check that the user asked for failed (fmt --check, diff --fail-if-slower...)."""
EXIT_USER_ERROR = 2
"""Bad input: a spec, plan, option or file that cannot be used as given."""


@dataclass(frozen=True, order=True)
class Span:
    """A region of one source file; lines and columns are 1-based, end is exclusive."""

    file: str
    line: int = 0
    col: int = 0
    end_line: int = 0
    end_col: int = 0

    @staticmethod
    def of_file(path: str) -> Span:
        return Span(path)

    def render_location(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    message: str
    span: Span
    hint: str | None = None
    severity: str = "error"
    notes: tuple[str, ...] = field(default_factory=tuple)
    more_follow: bool = False
    """The last diagnostic a cap kept (`syntax.MAX_SYNTAX_ERRORS`): its file has more."""

    def render(self, sources: dict[str, str] | None = None) -> str:
        """Render as text; `sources` maps file names to their text for the caret line."""
        out = [f"{self.span.render_location()}: {self.severity}: {self.message}"]
        text = (sources or {}).get(self.span.file)
        if text is not None and self.span.line > 0:
            lines = _lines(text)
            if self.span.line <= len(lines):
                src = lines[self.span.line - 1].removesuffix("\r")
                src = src.replace("\r", " ").expandtabs(1)  # a CR would move the cursor
                gutter = str(self.span.line)
                pad = " " * len(gutter)
                start = max(self.span.col, 1)
                if self.span.end_line == self.span.line and self.span.end_col > start:
                    width = self.span.end_col - start
                else:
                    width = max(len(src.rstrip()) - start + 1, 1)
                width = max(1, min(width, max(len(src) - start + 1, 1)))
                out.append(f"  {gutter} | {src.rstrip()}")
                out.append(f"  {pad} | {' ' * (start - 1)}{'^' * width}")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)


MAX_SHOWN = 40
"""How many diagnostics one error prints; the rest are counted (a spec of 100,000 tables
with one mistake each gives a readable message, not 100,000 caret blocks)."""


@functools.lru_cache(maxsize=8)
def _lines(text: str) -> tuple[str, ...]:
    """`text`'s lines as the parser counts them (`\\n` ends one; splitlines would also split
    at a form feed or U+2028 and quote the wrong line), split once per text rather than
    once per diagnostic (which made rendering many diagnostics quadratic)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the end of the last line, or of an empty file
    return tuple(lines)


class EmbarkError(Exception):
    """A user-facing error: one or more diagnostics, never a traceback."""

    def __init__(
        self,
        diagnostics: Diagnostic | Sequence[Diagnostic],
        sources: dict[str, str] | None = None,
    ):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        self.sources: dict[str, str] = dict(sources or {})
        super().__init__()

    def __str__(self) -> str:
        # rendered when shown, not when raised: an error re-raised with more diagnostics
        # (lowering collects them) would render its caret lines once per raise
        return self.render()

    @staticmethod
    def at(path: str, message: str, hint: str | None = None) -> EmbarkError:
        """An error about a whole file (no line), e.g. a corrupt plan."""
        return EmbarkError(Diagnostic(message, Span.of_file(path), hint))

    def render_with_files(self) -> str:
        """`render`, with the caret lines of diagnostics whose file text the error does not
        carry (errors raised after lowering, by the planner) read from disk when possible."""
        _read_sources(self.diagnostics, self.sources)
        return self.render()

    def render(self) -> str:
        shown = self.diagnostics[:MAX_SHOWN]
        body = "\n".join(d.render(self.sources) for d in shown)
        n = sum(1 for d in self.diagnostics if d.severity == "error")
        rest = len(self.diagnostics) - len(shown)
        if rest:
            body += (
                f"\n{n:,} errors; the first {len(shown)} diagnostics are shown and "
                f"{rest:,} more are not: fix these and run again"
            )
        elif any(d.more_follow for d in self.diagnostics):
            body += f"\n{n} errors shown, and more after them: fix these and run again"
        elif n > 1:
            body += f"\n{n} errors"
        return body


class Collector:
    """Collects diagnostics so that one run reports every mistake it can find."""

    def __init__(self, sources: dict[str, str] | None = None):
        self.diagnostics: list[Diagnostic] = []
        self.sources: dict[str, str] = dict(sources or {})

    def error(self, message: str, span: Span, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(message, span, hint))

    def warning(self, message: str, span: Span, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(message, span, hint, severity="warning"))

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    def extend(self, diags: Iterable[Diagnostic]) -> None:
        self.diagnostics.extend(diags)

    @property
    def failed(self) -> bool:
        return any(d.severity == "error" for d in self.diagnostics)

    def raise_if_failed(self) -> None:
        if self.failed:
            raise EmbarkError(self.diagnostics, self.sources)


def _read_sources(diags: Iterable[Diagnostic], sources: dict[str, str]) -> None:
    """Add to `sources` the text of every file a diagnostic points into (at a line) that
    it lacks, where the file can be read."""
    for d in diags:
        f = d.span.file
        if d.span.line > 0 and f not in sources:
            try:
                sources[f] = Path(f).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError, ValueError):
                continue


def print_warnings(diags: Iterable[Diagnostic], sources: dict[str, str] | None = None) -> None:
    """Print `diags` on stderr, with the caret lines of their files (from `sources`, else
    read from disk where they can be)."""
    diags = list(diags)
    texts = dict(sources or {})
    _read_sources(diags, texts)
    for d in diags:
        print(d.render(texts), file=sys.stderr)


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A hint naming the closest of `choices`, or None when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{match[0]}`?" if match else None
