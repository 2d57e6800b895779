"""`table` and `tables` blocks: rows, dim, dtype, the sparse optimizer and the initialiser,
from the block, else `defaults`, else the IR's defaults."""

from __future__ import annotations

from typing import Any

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import Span
from embarkc.lowering.base import DTYPE_MAX, OPTIMIZER_PARAMS, Block, Field_, LowererBase, _Fail
from embarkc.syntax import parts, span_of


class TableLowering(LowererBase):
    def tables(
        self, blocks: list[tuple[str, Span, Block]], defaults: dict[str, Field_]
    ) -> list[ir.Table]:
        out: list[ir.Table] = []
        seen: dict[str, Span] = {}
        for name, span, b in blocks:
            if name in seen:
                self.error(
                    f"table `{name}` is declared twice",
                    span,
                    f"the first is at {seen[name].render_location()}",
                )
                continue
            seen[name] = span
            if b.kind == "table":
                tok = parts(b.tree)[0]
                assert isinstance(tok, Token)
                if self.attempt(self.identifier, tok, b.file, "table") is None:
                    continue
            t = self.attempt(self.table, name, span, b, defaults)
            if t is not None:
                out.append(t)
        return out

    def table(self, name: str, span: Span, b: Block, defaults: dict[str, Field_]) -> ir.Table:
        kw: dict[str, Any] = {}
        ok = True
        # One error per group for a missing field, not one per table of the group.
        for key in ("rows", "dim"):
            fld = self.lookup(key, b, defaults)
            if fld is None:
                if self._once(("missing", key, id(b))):
                    what = "table" if b.kind == "table" else "tables"
                    verb = "has" if b.kind == "table" else "have"
                    self.error(
                        f"{what} `{name if b.kind == 'table' else self._group_name(b)}` {verb} "
                        f"no `{key}`",
                        b.keyword_span() if b.kind == "table" else span,
                        f"add `{key} N` here or in `defaults`",
                    )
                ok = False
                continue
            node = fld.values[0]
            assert isinstance(node, Tree)
            v = self.cached(
                ("num", id(node)),
                self.num,
                node,
                fld.file,
                what=key,
            )
            if v is None:
                ok = False
            else:
                kw[key] = v
        fld = self.lookup("dtype", b, defaults)
        if fld is not None:
            tok = fld.values[0]
            assert isinstance(tok, Token)
            v = self.cached(
                ("dtype", id(tok)),
                self.choice,
                tok,
                fld.file,
                ("fp32", "fp16", "bf16"),
                "dtype",
            )
            if v is None:
                ok = False
            else:
                kw["dtype"] = v
        fld = self.lookup("optimizer", b, defaults)
        if fld is not None:
            opt = self.cached(("opt", id(fld.tree)), self.optimizer, fld)
            if opt is None:
                ok = False
            else:
                kw["optimizer"] = opt
        fld = self.lookup("schedule", b, defaults)
        if fld is not None:
            schedule = self.cached(("schedule", id(fld.tree)), self.schedule, fld)
            if schedule is None:
                ok = False
            else:
                base = kw.get("optimizer", ir.Optimizer())
                kw["optimizer"] = base.model_copy(update={"schedule": schedule})
        fld = self.lookup("init", b, defaults)
        if fld is not None:
            init = self.cached(("init", id(fld.tree)), self.init, fld)
            if init is None:
                ok = False
            else:
                kw["init"] = init
                dtype = kw.get("dtype", "fp32")
                if not self._init_fits(init, dtype) and self._once(("init", id(fld.tree), dtype)):
                    self.error(
                        f"`init {init.kind}(...)` gives values beyond the largest {dtype} "
                        f"({DTYPE_MAX[dtype]:.4g}): the table would start at infinity",
                        fld.span,
                        "choose a smaller init (embeddings start near 0, e.g. "
                        "`uniform(-0.05, 0.05)`)"
                        + (", or `dtype fp32`" if dtype == "fp16" else ""),
                    )
                    ok = False
        if not ok:
            raise _Fail
        return self.build(ir.Table, span, name=name, span=ir.SpanModel.of(span), **kw)

    @staticmethod
    def _init_fits(init: ir.Init, dtype: str) -> bool:
        """Whether `init` draws values that `dtype` holds (a normal: within 6 std)."""
        top = DTYPE_MAX[dtype]
        if init.kind == "uniform":
            return max(abs(init.low), abs(init.high)) <= top
        if init.kind == "normal":
            return abs(init.mean) + 6 * init.std <= top
        return abs(init.value) <= top

    def optimizer(self, fld: Field_) -> ir.Optimizer:
        kind, params, span = self.kind_with_params(fld, OPTIMIZER_PARAMS, "optimizer")
        return self.build(ir.Optimizer, span, kind=kind, span=ir.SpanModel.of(span), **params)

    def init(self, fld: Field_) -> ir.Init:
        call = fld.values[0]
        assert isinstance(call, Tree)
        kind_tok, *args = parts(call)
        assert isinstance(kind_tok, Token)
        kind = self.choice(kind_tok, fld.file, ("uniform", "normal", "constant"), "initialiser")
        names = {"uniform": ("low", "high"), "normal": ("mean", "std"), "constant": ("value",)}[
            kind
        ]
        span = fld.span
        if len(args) != len(names) or not all(isinstance(a, Tree) for a in args):
            shown = ", ".join(names)
            self.error(
                f"`{kind}` takes {len(names)} number{'s' if len(names) > 1 else ''} ({shown})",
                span_of(call, fld.file),
                f"e.g. `init {kind}({', '.join({'low': '-0.05', 'high': '0.05', 'mean': '0', 'std': '0.01', 'value': '0'}[n] for n in names)})`",
            )
            raise _Fail
        vals = {}
        for n, a in zip(names, args, strict=True):
            assert isinstance(a, Tree)
            vals[n] = self.num(a, fld.file, integer=False, what=n, minimum=None)
        if kind == "uniform" and not vals["low"] < vals["high"]:
            self.error("uniform(low, high) needs low < high", span_of(call, fld.file))
            raise _Fail
        if kind == "normal" and vals["std"] <= 0:
            self.error("normal(mean, std) needs std > 0", span_of(call, fld.file))
            raise _Fail
        return self.build(ir.Init, span, kind=kind, span=ir.SpanModel.of(span), **vals)
