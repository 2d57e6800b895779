"""What every part of lowering shares: the parsed file, field and block, the diagnostics
collector and the helpers that read numbers, choices and names (`LowererBase`).

The parts of lowering (`embarkc.lowering.hardware`, `model`, `tables`, `features`,
`constraints`, `checks`) extend `LowererBase`; `embarkc.lower.Lowerer` combines them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lark import Token, Tree
from pydantic import ValidationError

from embark_runtime.schedules import MAX_STEPS
from embarkc import ir
from embarkc.diagnostics import Collector, Span, did_you_mean
from embarkc.syntax import parts, span_of
from embarkc.units import Kind, UnitError, quantity

MAX_HISTOGRAM_BYTES = 1 << 30
"""Measured histograms can be large (one line per distinct id); 1 GiB of text at most."""

MAX_GROUP_TABLES = 100_000
"""A `tables` group larger than this is almost certainly a typo in its range."""

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

FIELD_KEY = {
    "hotness_fixed": "hotness",
    "hotness_variable": "hotness",
    "access_histogram": "access",
    "reads": "table",
}
FEATURE_FIELDS = ("hotness", "pooling", "weighted", "access")
DTYPE_MAX = {"fp32": 3.4028234663852886e38, "fp16": 65504.0, "bf16": 3.3895313892515355e38}
"""The largest finite value of each table dtype."""

TABLE_FIELDS = ("rows", "dim", "dtype", "optimizer", "schedule", "init")

OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", "weight_decay"),
    "adagrad": ("lr", "eps", "initial_accumulator", "weight_decay"),
    "rowwise_adagrad": ("lr", "eps", "initial_accumulator", "weight_decay"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
}
DENSE_OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", "weight_decay"),
    "adagrad": ("lr", "eps", "weight_decay"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
}
INTERACTION_PARAMS: dict[str, tuple[str, ...]] = {"dot": (), "dcnv2": ("layers", "low_rank")}
DECAY_PARAMS: dict[str, tuple[str, ...]] = {
    "none": (),
    "poly": ("from", "to", "power", "end"),
    "step": ("from", "every", "factor"),
}
"""`decay KIND { ... }` of a `schedule`: `from` S, `to` E, `end` the rate from E on."""
OTHER_DECAYS = frozenset({"cosine", "exponential", "exp", "linear", "constant", "inverse_sqrt"})
"""Decays other trainers name, which the language has not (or spells otherwise)."""
DECAY_FIELD = {"from": "start", "to": "end", "end": "end_lr"}
"""The IR's (and plan file's) name of each decay parameter that the language spells
otherwise (`from`/`to` read as the steps they are)."""
INTEGER_PARAMS = frozenset({"layers", "low_rank"})


T = TypeVar("T")


@dataclass(frozen=True)
class SourceFile:
    """One parsed file: its display path, text and tree."""

    path: str
    text: str
    tree: Tree


@dataclass
class Field_:
    """A field node and the file it was written in."""

    tree: Tree
    file: str

    @property
    def span(self) -> Span:
        return span_of(self.tree, self.file)

    @property
    def values(self) -> list[Tree | Token]:
        return parts(self.tree)


@dataclass
class Block:
    kind: str
    tree: Tree
    file: str
    fields: dict[str, Field_] = field(default_factory=dict)

    @property
    def span(self) -> Span:
        return span_of(self.tree, self.file)

    def keyword_span(self) -> Span:
        first = self.tree.children[0]
        return span_of(first, self.file)


class _Fail(Exception):
    """A value could not be lowered; its diagnostic is already collected."""


class LowererBase:
    """The state of one lowering (files, collected diagnostics, histograms read) and the
    helpers every block's lowering uses."""

    def __init__(self, files: list[SourceFile]):
        self.files = files
        self.c = Collector({f.path: f.text for f in files})
        self.histograms: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
        self.unresolved_readers = False
        """Some `feature` block names no table or an unknown one."""

    def error(self, message: str, span: Span, hint: str | None = None) -> None:
        self.c.error(message, span, hint)

    def warning(self, message: str, span: Span, hint: str | None = None) -> None:
        """Something the spec says that does nothing or is not what it seems: the spec
        still compiles, and the commands print it on stderr."""
        self.c.warning(message, span, hint)

    def block(self, tree: Tree, file: str) -> Block:
        b = Block(tree.data, tree, file)
        for child in parts(tree):
            if not isinstance(child, Tree) or child.data in ("name_range", "params"):
                continue
            key = FIELD_KEY.get(child.data, child.data)
            if key in ("constrain", "colocate"):
                continue
            f = Field_(child, file)
            if key in b.fields:
                first = b.fields[key].span
                self.error(
                    f"`{key}` is given twice in this `{tree.data}` block",
                    self._head_span(f),
                    f"the first is at line {first.line}; remove one",
                )
                continue
            b.fields[key] = f
        return b

    def _head_span(self, f: Field_) -> Span:
        return span_of(f.tree.children[0], f.file)

    def num(
        self,
        node: Tree,
        file: str,
        kind: Kind = "count",
        *,
        integer: bool = True,
        what: str = "value",
        minimum: float | None = 1,
        maximum: int | None = None,
    ) -> Any:
        """The value of a `num` node, checked against `minimum` and `maximum` (one of
        `ir.LIMITS`, by default the limit of `what` if it has one); raises _Fail."""
        tok = node.children[0]
        unit = node.children[1] if len(node.children) > 1 else None
        span = span_of(node, file)
        try:
            value = quantity(
                str(tok), str(unit) if unit is not None else None, kind, integer=integer
            )
        except UnitError as e:
            self.error(f"{what}: {e}", span, e.hint)
            raise _Fail from None
        if minimum is not None and value < minimum:
            if minimum == 1 and integer:
                self.error(f"{what} must be positive, got {tok}", span)
            elif minimum == 0:
                self.error(f"{what} must not be negative, got {tok}", span)
            else:
                self.error(f"{what} must be at least {minimum:g}, got {tok}", span)
            raise _Fail
        if maximum is None:
            maximum = ir.LIMITS.get(what)
        if maximum is not None and value > maximum:
            self.error(
                f"{what} must be at most {maximum:,} (2^{maximum.bit_length() - 1}), got {tok}",
                span,
                "the sizes a spec may hold keep every count derived from them exact; "
                "no real model comes near this",
            )
            raise _Fail
        return value

    def choice(self, tok: Token, file: str, allowed: Iterable[str], what: str) -> str:
        allowed = tuple(allowed)
        value = str(tok)
        if value in allowed:
            return value
        hint = did_you_mean(value, allowed) or "one of " + ", ".join(f"`{a}`" for a in allowed)
        self.error(f"unknown {what} `{value}`", span_of(tok, file), hint)
        raise _Fail

    def attempt(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T | None:
        """`fn(*args, **kw)`, or None when it failed (its diagnostics are collected)."""
        try:
            return fn(*args, **kw)
        except _Fail:
            return None

    def build(self, cls: type[T], where: Span, **kw: Any) -> T:
        """Construct an IR node; a validation failure here is a missed check, shown plainly."""
        try:
            return cls(**kw)
        except ValidationError as e:
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                self.error(f"invalid {loc}: {err['msg']}", where)
            raise _Fail from None

    def name_range(self, rng: Tree, file: str) -> list[str]:
        base, lo_node, hi_node = parts(rng)
        assert isinstance(base, Token) and isinstance(lo_node, Tree) and isinstance(hi_node, Tree)
        self.identifier(base, file, "table")
        lo = self.num(lo_node, file, what="range start", minimum=0)
        hi = self.num(hi_node, file, what="range end", minimum=0)
        if hi < lo:
            self.error(
                f"empty range `{base}[{lo}..{hi}]`: the end is below the start",
                span_of(rng, file),
                f"ranges include both ends: `{base}[{hi}..{lo}]`?",
            )
            raise _Fail
        if hi - lo + 1 > MAX_GROUP_TABLES:
            self.error(
                f"range `{base}[{lo}..{hi}]` declares {hi - lo + 1:,} tables; at most "
                f"{MAX_GROUP_TABLES:,} per group",
                span_of(rng, file),
            )
            raise _Fail
        return [f"{base}{i}" for i in range(lo, hi + 1)]

    def identifier(self, tok: Token, file: str, what: str) -> bool:
        if not IDENT.match(str(tok)):
            self.error(
                f"{what} name `{tok}` is not an identifier",
                span_of(tok, file),
                "names use letters, digits and `_`: `" + str(tok).replace("-", "_") + "`",
            )
            raise _Fail
        return True

    def lookup(self, key: str, b: Block, defaults: dict[str, Field_]) -> Field_ | None:
        return b.fields.get(key) or defaults.get(key)

    def _group_name(self, b: Block) -> str:
        rng = parts(b.tree)[0]
        return (
            "".join(str(t) for t in rng.scan_values(lambda v: isinstance(v, Token)))
            if isinstance(rng, Tree)
            else "?"
        )

    _seen_once: set[Any]
    _cache: dict[Any, Any]

    def _once(self, key: Any) -> bool:
        seen = self.__dict__.setdefault("_seen_once", set())
        if key in seen:
            return False
        seen.add(key)
        return True

    def cached(self, key: Any, fn: Callable[..., T], *args: Any, **kw: Any) -> T | None:
        """Lower a node shared by many tables (a group's or defaults' field) once."""
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = self.attempt(fn, *args, **kw)
        return cache[key]

    def schedule(self, fld: Field_) -> ir.Schedule:
        """`schedule { warmup W decay KIND { ... } }` -> ir.Schedule; checks its values
        and that they fit together (a decay starts after the warm-up, ends after it
        starts), each at the number that breaks the rule."""
        kw: dict[str, Any] = {}
        ok = True
        seen: dict[str, Field_] = {}
        for item in parts(fld.tree):
            if not isinstance(item, Tree):
                continue
            sub = Field_(item, fld.file)
            if item.data in seen:
                self.error(
                    f"`{item.data}` is given twice in this `schedule`",
                    self._head_span(sub),
                    f"the first is at line {seen[item.data].span.line}; remove one",
                )
                ok = False
                continue
            seen[item.data] = sub
            if item.data == "warmup":
                node = sub.values[0]
                assert isinstance(node, Tree)
                v = self.attempt(
                    self.num, node, fld.file, what="warmup", minimum=0, maximum=MAX_STEPS
                )
                ok = ok and v is not None
                kw["warmup"] = v
                continue
            kind_tok = sub.values[0]
            if str(kind_tok) not in DECAY_PARAMS and str(kind_tok) in OTHER_DECAYS:
                # a decay of other trainers: say which this one has, not the nearest word
                self.error(
                    f"unknown decay `{kind_tok}`",
                    span_of(kind_tok, fld.file),
                    "the decays are `none`, `poly { from to power end }` and `step { from "
                    "every factor }`; `poly` with power 1 is linear",
                )
                ok = False
                continue
            got = self.attempt(self.kind_with_params, sub, DECAY_PARAMS, "decay")
            if got is None:
                ok = False
                continue
            kind, params, _ = got
            kw["decay"] = kind
            for name, value in params.items():
                kw[DECAY_FIELD.get(name, name)] = value
        if not ok:
            raise _Fail
        decay = seen.get("decay")
        kind = kw.get("decay", "none")
        block = decay.values[1] if decay and len(decay.values) > 1 else None
        where = {
            DECAY_FIELD.get(name, name): span_of(p, fld.file)
            for p in (parts(block) if isinstance(block, Tree) else [])
            if isinstance(p, Tree)
            for name in [str(parts(p)[0])]
        }
        warmup = kw.get("warmup", 0)
        if kind != "none":
            kw.setdefault("start", warmup)
            if kw["start"] < warmup:
                self.error(
                    f"the decay starts at step {kw['start']}, inside the warm-up of {warmup} steps",
                    where["start"],
                    f"start it at step {warmup} or later (`from` defaults to the warm-up's end)",
                )
                raise _Fail
        if kind == "poly":
            if "end" not in kw:
                assert decay is not None
                self.error(
                    "a `poly` decay needs `to`, the step at which the rate reaches `end`",
                    decay.span,
                    f"e.g. `decay poly {{ to {kw['start'] + 1000} power 2 }}`",
                )
                raise _Fail
            if kw["end"] <= kw["start"]:
                self.error(
                    f"the decay ends at step {kw['end']}, not after its start at step "
                    f"{kw['start']}",
                    where["end"],
                    "`to` is the step at which the rate reaches `end`: after `from`",
                )
                raise _Fail
        if kind == "step" and "every" not in kw:
            assert decay is not None
            self.error(
                "a `step` decay needs `every`, the steps between two cuts of the rate",
                decay.span,
                "e.g. `decay step { every 1000 factor 0.5 }`",
            )
            raise _Fail
        return self.build(ir.Schedule, fld.span, span=ir.SpanModel.of(fld.span), **kw)

    def kind_with_params(
        self, fld: Field_, allowed: dict[str, tuple[str, ...]], what: str
    ) -> tuple[str, dict[str, Any], Span]:
        """`optimizer adam { lr 0.001 beta1 0.9 }` -> ("adam", {...}, span); checks values."""
        vals = fld.values
        kind_tok = vals[0]
        assert isinstance(kind_tok, Token)
        kind = self.choice(kind_tok, fld.file, allowed, what)
        params: dict[str, Any] = {}
        ok = True
        if len(vals) > 1:
            block = vals[1]
            assert isinstance(block, Tree)
            for p in parts(block):
                assert isinstance(p, Tree)
                pname_tok, pnum = parts(p)
                assert isinstance(pname_tok, Token) and isinstance(pnum, Tree)
                pname = str(pname_tok)
                if pname not in allowed[kind]:
                    names = allowed[kind]
                    hint = did_you_mean(pname, names) or (
                        "it takes " + ", ".join(f"`{n}`" for n in names)
                        if names
                        else "it takes none"
                    )
                    self.error(
                        f"{what} `{kind}` has no parameter `{pname}`",
                        span_of(pname_tok, fld.file),
                        hint,
                    )
                    ok = False
                    continue
                if pname in params:
                    self.error(f"`{pname}` is given twice", span_of(pname_tok, fld.file))
                    ok = False
                    continue
                v = self.attempt(self.param_value, pname, pnum, fld.file)
                if v is None:
                    ok = False
                else:
                    params[pname] = v
        if not ok:
            raise _Fail
        return kind, params, fld.span

    def param_value(self, pname: str, pnum: Tree, file: str) -> Any:
        if pname in ("from", "to"):
            return self.num(pnum, file, what=pname, minimum=0, maximum=MAX_STEPS)
        if pname == "every":
            return self.num(pnum, file, what=pname, maximum=MAX_STEPS)
        if pname in ("power", "factor"):
            v = self.num(pnum, file, integer=False, what=pname, minimum=None)
            top = 1.0 if pname == "factor" else 1e3
            if not 0 < v <= top:
                self.error(
                    f"{pname} must be above 0 and at most {top:g}, got {pnum.children[0]}",
                    span_of(pnum, file),
                    "the rate is multiplied by `factor` at each cut" if pname == "factor" else None,
                )
                raise _Fail
            return v
        if pname in INTEGER_PARAMS:
            return self.num(pnum, file, what=pname)
        if pname in ("lr", "eps"):
            v = self.num(pnum, file, integer=False, what=pname, minimum=None)
            if v <= 0:
                self.error(f"{pname} must be positive, got {pnum.children[0]}", span_of(pnum, file))
                raise _Fail
            return v
        if pname in ("beta1", "beta2"):
            v = self.num(pnum, file, integer=False, what=pname, minimum=0)
            if v >= 1:
                self.error(f"{pname} must be below 1, got {pnum.children[0]}", span_of(pnum, file))
                raise _Fail
            return v
        return self.num(pnum, file, integer=False, what=pname, minimum=0)


def _nodes(n: int) -> str:
    """`1 node`, `16 nodes`, `1,024 nodes`."""
    return f"{n:,} node" + ("" if n == 1 else "s")


def _unquote(s: str) -> str:
    body = s[1:-1]
    return re.sub(r"\\(.)", r"\1", body)
