"""`feature` blocks and the features tables declare of their own: the table read,
hotness, pooling, weights and the access distribution (zipf or a measured histogram)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import EmbarkError, Span, did_you_mean
from embarkc.lowering.base import (
    FEATURE_FIELDS,
    MAX_HISTOGRAM_BYTES,
    Block,
    Field_,
    LowererBase,
    _Fail,
    _unquote,
)
from embarkc.syntax import parts, span_of
from embarkc.units import MAX_INT


class FeatureLowering(LowererBase):
    def features(
        self,
        feature_blocks: list[Block],
        table_blocks: list[tuple[str, Span, Block]],
        tables: list[ir.Table],
        defaults: dict[str, Field_],
    ) -> list[ir.Feature]:
        by_name = {t.name: t for t in tables}
        declared = {name for name, _, _ in table_blocks}
        readers: dict[str, list[str]] = {}
        explicit: list[tuple[str, Span, Block, str]] = []
        for b in feature_blocks:
            tok = parts(b.tree)[0]
            assert isinstance(tok, Token)
            fspan = span_of(tok, b.file)
            if self.attempt(self.identifier, tok, b.file, "feature") is None:
                continue
            reads = b.fields.get("table")
            if reads is None:
                self.unresolved_readers = True
                self.error(
                    f"feature `{tok}` reads no table",
                    fspan,
                    "add `table NAME` to say which table it looks up",
                )
                continue
            ttok = reads.values[0]
            assert isinstance(ttok, Token)
            tname = str(ttok)
            if tname not in declared:
                self.unresolved_readers = True
                self.error(
                    f"feature `{tok}` reads unknown table `{tname}`",
                    span_of(ttok, b.file),
                    did_you_mean(tname, declared),
                )
                continue
            readers.setdefault(tname, []).append(str(tok))
            explicit.append((str(tok), fspan, b, tname))

        out: list[ir.Feature] = []
        seen: dict[str, Span] = {}

        def add(fname: str, span: Span, b: Block, t: ir.Table | None, implicit: bool) -> None:
            if fname in seen:
                why = " (every table that no `feature` reads declares a feature of its name)"
                self.error(
                    f"feature `{fname}` is declared twice{why if implicit or fname in declared else ''}",
                    span,
                    f"the first is at {seen[fname].render_location()}",
                )
                return
            seen[fname] = span
            f = self.attempt(self.feature, fname, span, b, t, defaults)
            if f is not None:
                out.append(f)

        # Declaration order: a table's own feature where the table is declared, explicit
        # features after all tables, in their order.
        done: set[str] = set()
        for tname, span, b in table_blocks:
            if tname in done:
                continue
            done.add(tname)
            if tname in readers:
                # A group's feature fields still serve its other tables.
                for key in FEATURE_FIELDS if b.kind == "table" else ():
                    if key in b.fields and self._once(("unused", key, id(b))):
                        fld = b.fields[key]
                        self.error(
                            f"`{key}` in table `{tname}` has no effect: the table is read by "
                            f"feature `{readers[tname][0]}`",
                            self._head_span(fld),
                            f"move it into `feature {readers[tname][0]}`",
                        )
                continue
            t = by_name.get(tname)
            add(tname, span, b, t, True)
        for fname, fspan, b, tname in explicit:
            t = by_name.get(tname)
            add(fname, fspan, b, t, False)
        return out

    def feature(
        self, name: str, span: Span, b: Block, table: ir.Table | None, defaults: dict[str, Field_]
    ) -> ir.Feature:
        """Lower one feature; with `table` None (the table failed) only check its fields."""
        kw: dict[str, Any] = {}
        ok = True
        hot = self.lookup("hotness", b, defaults)
        if hot is None:
            # A table whose reader failed to resolve would get a confusing second error.
            if not self.unresolved_readers and self._once(("missing", "hotness", id(b))):
                label = name if b.kind != "tables" else self._group_name(b)
                verb = "have" if b.kind == "tables" else "has"
                self.error(
                    f"{'feature' if b.kind == 'feature' else b.kind} `{label}` {verb} no `hotness`",
                    b.keyword_span() if b.kind != "tables" else span,
                    "add `hotness N` (ids per sample) or `hotness mean M max N`, here or in `defaults`",
                )
            raise _Fail
        got = self.cached(("hot", id(hot.tree)), self.hotness, hot)
        if got is None:
            ok = False
        else:
            kw.update(got)
        pool = self.lookup("pooling", b, defaults)
        if pool is not None:
            tok = pool.values[0]
            assert isinstance(tok, Token)
            v = self.cached(
                ("pool", id(tok)),
                self.choice,
                tok,
                pool.file,
                ("sum", "mean", "concat"),
                "pooling",
            )
            if v is None:
                ok = False
            else:
                kw["pooling"] = v
                if v == "concat" and got is not None and not got["fixed"]:
                    if self._once(("concat", id(pool.tree), id(hot.tree))):
                        self.error(
                            "pooling `concat` needs a fixed hotness",
                            span_of(tok, pool.file),
                            f"`{name}` has a variable hotness (line {hot.span.line}); use `sum` or `mean`, "
                            "or a fixed `hotness N`",
                        )
                    ok = False
        wfld = self.lookup("weighted", b, defaults)
        if wfld is not None:
            kw["weighted"] = not any(
                isinstance(v, Token) and v.type == "BOOL" and str(v) == "false" for v in wfld.values
            )
        acc = self.lookup("access", b, defaults)
        if acc is not None:
            rows = table.rows if table is not None else None
            a = self.cached(("acc", id(acc.tree), rows), self.access, acc, table)
            if a is None:
                ok = False
            else:
                kw["access"] = a
        col = b.fields.get("column")
        if col is not None:
            tok = col.values[0]
            assert isinstance(tok, Token)
            kw["column"] = _unquote(str(tok))
            if not kw["column"].strip():
                self.error(
                    f"feature `{name}` names an empty column",
                    span_of(tok, col.file),
                    'give the data\'s column name, e.g. `column "C14"`',
                )
                ok = False
        if not ok or table is None:
            raise _Fail
        return self.build(
            ir.Feature, span, name=name, table=table.name, span=ir.SpanModel.of(span), **kw
        )

    def hotness(self, fld: Field_) -> dict[str, Any]:
        vals = fld.values
        if fld.tree.data == "hotness_fixed":
            node = vals[0]
            assert isinstance(node, Tree)
            text = str(node.children[0])
            if "." in text and len(node.children) == 1:
                self.error(
                    f"a fixed hotness is a whole number of ids, got {text}",
                    span_of(node, fld.file),
                    f"for bags of varying length write `hotness mean {text} max N`",
                )
                raise _Fail
            h = self.num(node, fld.file, what="hotness")
            return {"hotness": float(h), "max_hotness": h, "fixed": True}
        mean_node, max_node = vals
        assert isinstance(mean_node, Tree) and isinstance(max_node, Tree)
        mean = self.attempt(
            self.num, mean_node, fld.file, integer=False, what="mean hotness", minimum=None
        )
        mx = self.num(max_node, fld.file, what="max hotness")
        if mean is None:
            raise _Fail
        if not 1 <= mean <= mx:
            self.error(
                f"mean hotness {mean_node.children[0]} is not within 1..{mx}",
                span_of(mean_node, fld.file),
                "every bag holds 1 to `max` ids, so the mean is between 1 and `max`",
            )
            raise _Fail
        return {"hotness": float(mean), "max_hotness": mx, "fixed": False}

    def access(self, fld: Field_, table: ir.Table | None) -> ir.Access:
        span = fld.span
        if fld.tree.data == "access_histogram":
            tok = fld.values[0]
            assert isinstance(tok, Token)
            keys, counts = self.histogram(tok, fld.file, table)
            rel = _unquote(str(tok))
            return self.build(
                ir.Access,
                span,
                kind="histogram",
                path=rel,
                keys=keys,
                counts=counts,
                span=ir.SpanModel.of(span),
            )
        call = fld.values[0]
        assert isinstance(call, Tree)
        kind_tok, *args = parts(call)
        assert isinstance(kind_tok, Token)
        kind = self.choice(
            kind_tok, fld.file, ("uniform", "zipf", "histogram"), "access distribution"
        )
        cspan = span_of(call, fld.file)
        if kind == "histogram":
            self.error(
                "`histogram` takes a file name",
                cspan,
                'write `access histogram "counts.txt"` (lines of `key count`)',
            )
            raise _Fail
        if kind == "uniform":
            if args:
                self.error("`uniform` takes no arguments", cspan, "write `access uniform`")
                raise _Fail
            return self.build(ir.Access, span, kind="uniform", span=ir.SpanModel.of(span))
        if not args or not isinstance(args[0], Tree) or len(args) > 2:
            self.error(
                "`zipf` takes the exponent and optionally `sorted` or `permuted`",
                cspan,
                "e.g. `access zipf(1.1)` or `access zipf(1.1, sorted)`",
            )
            raise _Fail
        alpha = self.num(args[0], fld.file, integer=False, what="zipf exponent", minimum=None)
        if alpha <= 0:
            self.error(
                f"zipf exponent must be positive, got {args[0].children[0]}",
                span_of(args[0], fld.file),
            )
            raise _Fail
        permuted = True
        if len(args) == 2:
            order = args[1]
            if not isinstance(order, Token):
                self.error(
                    "the second argument of `zipf` is `sorted` or `permuted`",
                    span_of(order, fld.file),
                )
                raise _Fail
            permuted = (
                self.choice(order, fld.file, ("permuted", "sorted"), "zipf key order") == "permuted"
            )
        return self.build(
            ir.Access, span, kind="zipf", alpha=alpha, permuted=permuted, span=ir.SpanModel.of(span)
        )

    def histogram(
        self, tok: Token, file: str, table: ir.Table | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Read `key count` lines; errors point into the histogram file."""
        rel = _unquote(str(tok))
        base = Path(file).parent if not file.startswith("<") else Path.cwd()
        path = base / rel
        shown = str(path) if not Path(rel).is_absolute() else rel
        span = span_of(tok, file)
        if shown not in self.histograms:
            self.histograms[shown] = self.attempt(self._read_histogram, path, shown, span)
        got = self.histograms[shown]
        if got is None:
            raise _Fail
        keys, counts = got
        if table is not None and keys and max(keys) >= table.rows:
            k = max(keys)
            self.error(
                f"histogram `{rel}` has key {k}, but table `{table.name}` has {table.rows} rows",
                span,
                "keys are row numbers: 0 <= key < rows",
            )
            raise _Fail
        return keys, counts

    def _read_histogram(
        self, path: Path, shown: str, span: Span
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        from embarkc.syntax import check_text, read_source

        try:
            data = read_source(path, shown, MAX_HISTOGRAM_BYTES)
        except EmbarkError as e:
            self.error(f"cannot read histogram `{shown}`: it {e.diagnostics[0].message}", span)
            raise _Fail from None
        except OSError as e:
            self.error(f"cannot read histogram `{shown}`: {e.strerror or e}", span)
            raise _Fail from None
        try:
            text = check_text(data, shown, MAX_HISTOGRAM_BYTES)
        except EmbarkError as e:
            self.c.extend(e.diagnostics)
            raise _Fail from None
        self.c.sources[shown] = text
        keys: list[int] = []
        counts: list[int] = []
        seen: dict[int, int] = {}
        errors = 0
        for lineno, line in enumerate(text.splitlines(), 1):
            body = line.split("#", 1)[0]
            fields = body.split()
            if not fields:
                continue
            col = len(body) - len(body.lstrip()) + 1
            lspan = Span(shown, lineno, col, lineno, len(body.rstrip()) + 1)
            bad = None
            if len(fields) != 2:
                bad = f"expected `key count`, got {len(fields)} field{'s' if len(fields) != 1 else ''}"
            elif not (fields[0].isdigit() and fields[1].isdigit()):
                bad = "key and count must be non-negative integers"
            else:
                k, n = int(fields[0]), int(fields[1])
                if k > MAX_INT or n > MAX_INT:
                    bad = "number too large"
                elif n == 0:
                    bad = "count must be positive (leave out keys never seen)"
                elif k in seen:
                    bad = f"key {k} appears twice (first at line {seen[k]})"
                else:
                    seen[k] = lineno
                    keys.append(k)
                    counts.append(n)
            if bad:
                errors += 1
                if errors <= 10:
                    self.error(f"histogram: {bad}", lspan)
        if errors:
            raise _Fail
        if not keys:
            self.error(f"histogram `{shown}` has no `key count` lines", span)
            raise _Fail
        return tuple(keys), tuple(counts)
