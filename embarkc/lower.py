"""Lower parsed spec files into the typed IR (`embarkc.ir.Program`).

`lower(files, name, sources)` takes the parse trees of the root spec and of every file it
includes (in include order) and returns a `Program` whose invariants are those written
at the top of `embarkc/ir.py`: names resolved, units normalised, defaults applied, spans
kept. Every mistake found is collected as a diagnostic; when there is any, one
`EmbarkError` carrying all of them (and the source texts, for carets) is raised.

Semantics, in the order they are checked (docs/language.md is the user's version):

* At most one `hardware`, `model` and `plan` block over all files; `defaults` blocks
  merge (a field given twice is an error). A field given twice in one block is an error.
* `table X {...}` declares table X; `tables t[0..3] {...}` declares t0..t3 (inclusive).
  Table fields come from the block, else from `defaults`, else the IR's defaults; `rows`,
  `dim` and (for a table's own feature) `hotness` have no IR default.
* A table that no `feature` block reads declares a feature of its own name, with the
  feature fields (hotness, pooling, weighted, access) of its block or `defaults`. A table
  that `feature` blocks read has no feature of its own; feature fields in its block are
  then an error (they would be silently ignored).
* Cross-object checks: batch divisible by the GPU count, constraint contradictions, and
  whether the tables fit in the cluster's memory (one copy of weights plus optimizer
  state against nodes x GPUs x (HBM - headroom)).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lark import Token, Tree
from pydantic import ValidationError

from embark_runtime.formatting import format_bytes
from embark_runtime.optimizers import columns_may_be_cut
from embark_runtime.schedules import MAX_STEPS
from embarkc import ir
from embarkc.diagnostics import Collector, Diagnostic, EmbarkError, Span, did_you_mean
from embarkc.planner import constants as K
from embarkc.presets import PRESETS
from embarkc.syntax import parts, span_of
from embarkc.units import MAX_INT, Kind, UnitError, quantity

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


class Lowerer:
    def __init__(self, files: list[SourceFile]):
        self.files = files
        self.c = Collector({f.path: f.text for f in files})
        self.histograms: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
        self.unresolved_readers = False
        """Some `feature` block names no table or an unknown one."""

    # ------------------------------------------------------------------ helpers

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

    # ------------------------------------------------------------------ top level

    def run(self, name: str, sources: tuple[ir.Source, ...]) -> ir.Program:
        singles: dict[str, Block] = {}
        defaults: dict[str, Field_] = {}
        table_blocks: list[tuple[str, Span, Block]] = []
        declares_tables = False  # a `tables` group whose range failed has its own error
        feature_blocks: list[Block] = []
        for f in self.files:
            for item in parts(f.tree):
                if not isinstance(item, Tree):
                    continue
                if item.data in ("hardware", "model", "plan"):
                    b = self.block(item, f.path)
                    if item.data in singles:
                        first = singles[item.data]
                        where = first.keyword_span()
                        self.error(
                            f"a second `{item.data}` block",
                            b.keyword_span(),
                            f"the first is at {where.render_location()}; merge them",
                        )
                        continue
                    singles[item.data] = b
                elif item.data == "defaults":
                    b = self.block(item, f.path)
                    for key, fld in b.fields.items():
                        if key in defaults:
                            where = defaults[key].span
                            self.error(
                                f"`{key}` is given twice in `defaults`",
                                self._head_span(fld),
                                f"the first is at {where.render_location()}",
                            )
                        else:
                            defaults[key] = fld
                elif item.data == "table":
                    declares_tables = True
                    b = self.block(item, f.path)
                    name_tok = parts(item)[0]
                    assert isinstance(name_tok, Token)
                    table_blocks.append((str(name_tok), span_of(name_tok, f.path), b))
                elif item.data == "tables":
                    declares_tables = True
                    b = self.block(item, f.path)
                    rng = parts(item)[0]
                    assert isinstance(rng, Tree)
                    span = span_of(rng, f.path)
                    for tname in self.attempt(self.name_range, rng, f.path) or ():
                        table_blocks.append((tname, span, b))
                elif item.data == "feature":
                    feature_blocks.append(self.block(item, f.path))

        topology = self.attempt(self.topology, singles.get("hardware"))
        model = self.attempt(self.model, singles.get("model"))
        if not declares_tables:
            self.error(
                "the spec declares no embedding table: embarkc plans and trains embedding tables",
                Span.of_file(self.files[0].path),
                "add one, e.g. `table items { rows 1M dim 64 hotness 1 }`",
            )
        tables = self.tables(table_blocks, defaults)
        table_names = {name for name, _, _ in table_blocks}
        features = self.features(feature_blocks, table_blocks, tables, defaults)
        options, constraints, colocate = self.plan(singles.get("plan"), table_names, topology)
        if topology is not None and model is not None:
            self.check_batch(model, topology, singles["model"])
        if topology is not None:
            self.check_constraints(tables, constraints, colocate, topology)
            if options is not None:
                self.check_memory(tables, constraints, topology, options, singles.get("hardware"))
        self.c.raise_if_failed()
        assert topology is not None and model is not None and options is not None
        return ir.Program(
            name=name,
            sources=sources,
            topology=topology,
            tables=tuple(tables),
            features=tuple(features),
            model=model,
            options=options,
            constraints=tuple(constraints),
            colocate=tuple(colocate),
        )

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

    # ------------------------------------------------------------------ hardware

    def topology(self, b: Block | None) -> ir.Topology:
        if b is None:
            first = self.files[0].path
            self.error(
                "the spec has no `hardware` block",
                Span(first, 1, 1, 1, 2),
                "add e.g. `hardware { preset dgx_h100 nodes 2 }`",
            )
            raise _Fail
        values: dict[str, Any] = {}
        preset: str | None = None
        if "preset" in b.fields:
            tok = b.fields["preset"].values[0]
            assert isinstance(tok, Token)
            preset = self.attempt(self.choice, tok, b.file, PRESETS, "hardware preset")
            if preset is None:
                raise _Fail
            values.update(PRESETS[preset])
        ok = True
        spec = {
            "nodes": ("nodes", "count", True),
            "gpus_per_node": ("gpus_per_node", "count", True),
            "hbm": ("hbm_bytes", "bytes", True),
            "hbm_bandwidth": ("hbm_bandwidth", "bandwidth", False),
            "nvlink": ("intra_node_bandwidth", "bandwidth", False),
            "network": ("inter_node_bandwidth", "bandwidth", False),
        }
        optional = {"dense_flops": ("dense_flops", "compute", False)}
        for key, (attr, kind, integer) in {**spec, **optional}.items():
            fld = b.fields.get(key)
            if fld is None:
                continue
            node = fld.values[0]
            assert isinstance(node, Tree)
            # dense_flops 0: the dense rate is unknown and no key overlap is credited
            least = 0 if key in optional else 1
            v = self.attempt(
                self.num, node, fld.file, kind, integer=integer, what=key, minimum=least
            )
            top = ir.RATE_LIMITS.get(key)
            if v is not None and top is not None and v > top:
                self.error(
                    f"{key} must be at most {top:g} {'FLOP/s' if kind == 'compute' else 'B/s'}"
                    f" per GPU, got {node.children[0]}"
                    f"{' ' + str(node.children[1]) if len(node.children) > 1 else ''}",
                    span_of(node, fld.file),
                    "no GPU comes near this: is the unit right?",
                )
                v = None
            elif v is not None and key == "dense_flops" and 0 < v < 1:
                self.error(
                    f"dense_flops must be 0 (unknown) or at least 1 FLOP/s, got {v:g}",
                    span_of(node, fld.file),
                )
                v = None
            if v is None:
                ok = False
            else:
                values[attr] = v
        constants = self.attempt(self.cost_constants, b)
        if constants is None:
            ok = False
        elif constants:
            values["constants"] = constants
        if "arch" in b.fields:
            tok = b.fields["arch"].values[0]
            if re.fullmatch(r"sm_[0-9]{2,3}a?", str(tok)):
                values["arch"] = str(tok)
            else:
                self.error(
                    f"unknown GPU architecture `{tok}`",
                    span_of(tok, b.fields["arch"].file),
                    "write it as CUDA does: `sm_80`, `sm_90`",
                )
                ok = False
        if preset is None:
            values.setdefault("nodes", 1)
            missing = [k for k, (attr, _, _) in spec.items() if attr not in values]
            if missing and ok:
                self.error(
                    "hardware is missing " + ", ".join(f"`{m}`" for m in missing),
                    b.keyword_span(),
                    "start from a preset (`preset dgx_h100`, `dgx_h200`, `dgx_a100_80gb`) "
                    "or give every field",
                )
                ok = False
        if not ok:
            raise _Fail
        return self.build(
            ir.Topology, b.span, preset=preset, span=ir.SpanModel.of(b.span), **values
        )

    def cost_constants(self, b: Block) -> dict[str, float]:
        """The cost model's constants the hardware block sets ({`Constants` field: value}):
        efficiencies are fractions in (0, 1], latencies times of at most a second, `min_read`
        a size of at most 4 KiB; raises _Fail after reporting every bad one."""
        out: dict[str, float] = {}
        ok = True
        for key, (attr, kind, _) in K.TUNABLE.items():
            fld = b.fields.get(key)
            if fld is None:
                continue
            node = fld.values[0]
            assert isinstance(node, Tree)
            top: float = {"count": 1.0, "time": 1.0, "bytes": 4096.0}[kind]
            v = self.attempt(
                self.num, node, fld.file, kind, integer=kind == "bytes", what=key, minimum=0
            )
            if v is not None and not 0 < v <= top:
                self.error(
                    f"{key} must be above 0 and at most {top:g}"
                    f"{' ' + {'time': 's', 'bytes': 'B'}[kind] if kind != 'count' else ''}"
                    f", got {v:g}",
                    span_of(node, fld.file),
                    "an efficiency is the share of the peak a kernel or collective reaches"
                    if kind == "count"
                    else None,
                )
                v = None
            if v is None:
                ok = False
            else:
                out[attr] = float(v)
        if not ok:
            raise _Fail
        return out

    # ------------------------------------------------------------------ dense model

    def model(self, b: Block | None) -> ir.DenseModel:
        if b is None:
            self.error(
                "the spec has no `model` block",
                Span(self.files[0].path, 1, 1, 1, 2),
                "add e.g. `model { batch 65536 dense_features 13 }`",
            )
            raise _Fail
        kw: dict[str, Any] = {}
        ok = True
        if "batch" not in b.fields:
            self.error(
                "`model` has no `batch`",
                b.keyword_span(),
                "add the global batch size: `batch 65536`",
            )
            ok = False
        for key, minimum in (("batch", 1), ("dense_features", 0)):
            if key in b.fields:
                node = b.fields[key].values[0]
                assert isinstance(node, Tree)
                v = self.attempt(self.num, node, b.file, what=key, minimum=minimum)
                if v is None:
                    ok = False
                else:
                    kw["batch_size" if key == "batch" else key] = v
        kw.setdefault("dense_features", 0)
        for key in ("bottom_mlp", "top_mlp"):
            if key in b.fields:
                lst = b.fields[key].values[0]
                assert isinstance(lst, Tree)
                sizes = []
                for n in parts(lst):
                    assert isinstance(n, Tree)
                    v = self.attempt(self.num, n, b.file, what=f"{key} layer width")
                    if v is None:
                        ok = False
                    sizes.append(v)
                if len(sizes) > ir.MAX_MLP_LAYERS:
                    self.error(
                        f"`{key}` has {len(sizes):,} layers; an MLP may have at most "
                        f"{ir.MAX_MLP_LAYERS:,}",
                        b.fields[key].span,
                    )
                    ok = False
                if key == "top_mlp" and not sizes:
                    self.error(
                        "`top_mlp` needs at least its output layer",
                        b.fields[key].span,
                        "e.g. `top_mlp [256, 1]`",
                    )
                    ok = False
                if key == "top_mlp" and not self.top_output(b.fields[key], sizes):
                    ok = False
                kw[key] = tuple(sizes)
        if "interaction" in b.fields:
            fld = b.fields["interaction"]
            got = self.attempt(self.kind_with_params, fld, INTERACTION_PARAMS, "interaction")
            if got is None:
                ok = False
            else:
                kind, params, span = got
                inter = self.attempt(
                    self.build,
                    ir.Interaction,
                    span,
                    kind=kind,
                    span=ir.SpanModel.of(span),
                    **params,
                )
                ok = ok and inter is not None
                kw["interaction"] = inter
        if "optimizer" in b.fields:
            fld = b.fields["optimizer"]
            got = self.attempt(
                self.kind_with_params, fld, DENSE_OPTIMIZER_PARAMS, "dense optimizer"
            )
            if got is None:
                ok = False
            else:
                kind, params, span = got
                opt = self.attempt(
                    self.build,
                    ir.DenseOptimizer,
                    span,
                    kind=kind,
                    span=ir.SpanModel.of(span),
                    **params,
                )
                ok = ok and opt is not None
                kw["optimizer"] = opt
        if "schedule" in b.fields:
            schedule = self.attempt(self.schedule, b.fields["schedule"])
            if schedule is None:
                ok = False
            elif ok:
                base = kw.get("optimizer", ir.DenseOptimizer())
                kw["optimizer"] = base.model_copy(update={"schedule": schedule})
        if "precision" in b.fields:
            tok = b.fields["precision"].values[0]
            assert isinstance(tok, Token)
            v = self.attempt(self.choice, tok, b.file, ("fp32", "bf16", "fp16"), "precision")
            if v is None:
                ok = False
            else:
                kw["precision"] = v
        if not ok:
            raise _Fail
        return self.build(ir.DenseModel, b.span, span=ir.SpanModel.of(b.span), **kw)

    def top_output(self, fld: Field_, sizes: list[Any]) -> bool:
        """Whether the top MLP ends in the model's one logit per sample (its last width
        is 1; the trainer adds no layer); else says so."""
        if sizes and sizes[-1] is not None and sizes[-1] != 1:
            lst = fld.values[0]
            assert isinstance(lst, Tree)
            last = parts(lst)[-1]
            self.error(
                f"`top_mlp` ends in {sizes[-1]}; its last layer is the output, one logit "
                "per sample, so it must be 1",
                span_of(last, fld.file),
                f"add the output layer: `top_mlp [{', '.join(str(x) for x in sizes)}, 1]`",
            )
            return False
        return True

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

    # ------------------------------------------------------------------ tables

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

    def lookup(self, key: str, b: Block, defaults: dict[str, Field_]) -> Field_ | None:
        return b.fields.get(key) or defaults.get(key)

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

    # ------------------------------------------------------------------ features

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

    # ------------------------------------------------------------------ plan

    def plan(
        self, b: Block | None, table_names: set[str], topology: ir.Topology | None
    ) -> tuple[ir.PlanOptions | None, list[ir.TableConstraint], list[ir.Colocate]]:
        if b is None:
            return ir.PlanOptions(), [], []
        kw: dict[str, Any] = {}
        ok = True
        enums = {
            "objective": ("step_time", "memory"),
            "strategy": ir.STRATEGIES,
            "solver": ("greedy", "cp-sat"),
            "row_partition": ("mod", "range"),
            "communication": ("auto", "flat", "hierarchical"),
        }
        for key, allowed in enums.items():
            if key in b.fields:
                tok = b.fields[key].values[0]
                assert isinstance(tok, Token)
                v = self.attempt(self.choice, tok, b.file, allowed, key)
                if v is None:
                    ok = False
                else:
                    kw[key] = v
                if v == "hierarchical" and topology is not None and topology.nodes == 1:
                    self.warning(
                        "`communication hierarchical` does nothing on a cluster of one "
                        "node: nothing crosses the network, so the clusters run and are "
                        "costed as flat ones",
                        span_of(tok, b.file),
                        "remove it, or describe the cluster's nodes in `hardware`",
                    )
        numeric: dict[str, tuple[Kind, bool, float | None]] = {
            "time_limit": ("time", False, None),
            "seed": ("count", True, 0),
            "memory_headroom": ("bytes", True, 0),
        }
        for key, (kind, integer, minimum) in numeric.items():
            if key in b.fields:
                node = b.fields[key].values[0]
                assert isinstance(node, Tree)
                v = self.attempt(
                    self.num, node, b.file, kind, integer=integer, what=key, minimum=minimum
                )
                if v is not None and key == "time_limit" and v <= 0:
                    self.error("time_limit must be positive", span_of(node, b.file))
                    v = None
                if v is not None and key == "seed" and v > ir.MAX_SEED:
                    self.error(
                        f"seed must be at most {ir.MAX_SEED} (the solver's seeds are 32-bit)",
                        span_of(node, b.file),
                    )
                    v = None
                if v is not None and key == "memory_headroom" and topology is not None:
                    if v >= topology.hbm_bytes:
                        self.error(
                            f"memory_headroom {format_bytes(v)} leaves nothing of the "
                            f"{format_bytes(topology.hbm_bytes)} of HBM per GPU",
                            span_of(node, b.file),
                        )
                        v = None
                if v is None:
                    ok = False
                else:
                    kw[key] = v
        options = (
            self.attempt(self.build, ir.PlanOptions, b.span, span=ir.SpanModel.of(b.span), **kw)
            if ok
            else None
        )

        constraints: dict[str, ir.TableConstraint] = {}
        first: dict[str, Span] = {}
        colocate: list[ir.Colocate] = []
        for item in parts(b.tree):
            if not isinstance(item, Tree):
                continue
            if item.data == "constrain":
                target = parts(item)[0]
                names = self.attempt(self.targets, target, b.file, table_names)
                if names is None:
                    continue
                made = self.attempt(self.constraint_fields, item, b.file)
                if made is None:
                    continue
                span = span_of(target, b.file)
                for n in names:
                    if n in constraints:
                        self.error(
                            f"table `{n}` is constrained twice",
                            span,
                            f"the first is at line {first[n].line}; merge them",
                        )
                        continue
                    first[n] = span
                    c = self.attempt(
                        self.build,
                        ir.TableConstraint,
                        span,
                        table=n,
                        span=ir.SpanModel.of(span),
                        **made,
                    )
                    if c is not None:
                        constraints[n] = c
            elif item.data == "colocate":
                names_all: list[str] = []
                bad = False
                for target in parts(item):
                    got = self.attempt(self.targets, target, b.file, table_names)
                    if got is None:
                        bad = True
                    else:
                        names_all.extend(got)
                if bad:
                    continue
                span = span_of(item, b.file)
                uniq = list(dict.fromkeys(names_all))
                if len(names_all) < 2:
                    self.error(
                        "`colocate` needs at least two tables",
                        span,
                        "e.g. `colocate a, b` or `colocate t[0..3]`",
                    )
                    continue
                if len(uniq) != len(names_all):
                    dup = next(n for n in names_all if names_all.count(n) > 1)
                    self.error(f"`colocate` names table `{dup}` twice", span)
                    continue
                colocate.append(ir.Colocate(tables=tuple(uniq), span=ir.SpanModel.of(span)))
        return options, list(constraints.values()), colocate

    def targets(self, target: Tree | Token, file: str, table_names: set[str]) -> list[str]:
        if isinstance(target, Token):
            names = [str(target)]
            span = span_of(target, file)
        else:
            names = self.name_range(target, file)
            span = span_of(target, file)
        for n in names:
            if n not in table_names:
                self.error(f"unknown table `{n}`", span, did_you_mean(n, table_names))
                raise _Fail
        return names

    def constraint_fields(self, item: Tree, file: str) -> dict[str, Any]:
        b = self.block(item, file)
        out: dict[str, Any] = {}
        ok = True
        if "cluster" in b.fields:
            tok = b.fields["cluster"].values[0]
            assert isinstance(tok, Token)
            v = self.attempt(self.choice, tok, file, ("dp", "rb", "ub"), "cluster kind")
            ok = ok and v is not None
            out["cluster"] = v
        for key, prefix in (("row_shards", "row"), ("column_shards", "column")):
            if key in b.fields:
                got = self.attempt(self.bound, b.fields[key], key)
                if got is None:
                    ok = False
                else:
                    out[f"min_{prefix}_shards"], out[f"max_{prefix}_shards"] = got
        if "no_column_split" in b.fields:
            fld = b.fields["no_column_split"]
            if out.get("min_column_shards", 1) > 1:
                self.error(
                    "`no_column_split` contradicts `column_shards` above 1",
                    fld.span,
                    "keep one of them",
                )
                ok = False
            out["max_column_shards"] = 1
        if "within_node" in b.fields:
            out["within_node"] = True
        if not ok:
            raise _Fail
        return out

    def bound(self, fld: Field_, what: str) -> tuple[int, int | None]:
        node = fld.values[0]
        assert isinstance(node, Tree)
        nums = [n for n in parts(node) if isinstance(n, Tree)]
        vals = [self.num(n, fld.file, what=what) for n in nums]
        if node.data == "bound_exact":
            return vals[0], vals[0]
        if node.data == "bound_min":
            return vals[0], None
        if node.data == "bound_max":
            return 1, vals[0]
        lo, hi = vals
        if lo > hi:
            self.error(
                f"{what} {lo}..{hi}: the minimum is above the maximum", span_of(node, fld.file)
            )
            raise _Fail
        return lo, hi

    # ------------------------------------------------------------------ cross checks

    def check_batch(self, model: ir.DenseModel, topo: ir.Topology, b: Block) -> None:
        w = topo.world_size
        if model.batch_size % w:
            fld = b.fields["batch"]
            lo = model.batch_size // w * w
            hint = f"the batch is split evenly over the GPUs: try {lo + w}" + (
                f" or {lo}" if lo else ""
            )
            self.error(
                f"batch {model.batch_size} is not divisible by the {w} GPUs "
                f"({_nodes(topo.nodes)} x {topo.gpus_per_node})",
                span_of(fld.values[0], b.file),
                hint,
            )

    def check_constraints(
        self,
        tables: list[ir.Table],
        constraints: list[ir.TableConstraint],
        colocate: list[ir.Colocate],
        topo: ir.Topology,
    ) -> None:
        by_name = {t.name: t for t in tables}
        w, g = topo.world_size, topo.gpus_per_node
        for c in constraints:
            t = by_name.get(c.table)
            if t is None or c.span is None:
                continue
            span = c.span.to_span()
            rmin, cmin = c.min_row_shards, c.min_column_shards
            name = f"`{c.table}`"
            if c.cluster == "dp" and (rmin > 1 or cmin > 1):
                self.error(
                    f"table {name} is pinned to `dp` (a whole copy on every GPU) but asks for at "
                    f"least {rmin if rmin > 1 else cmin} {'row' if rmin > 1 else 'column'} shards",
                    span,
                    "dp tables are not sharded: drop the shard bounds or pin `rb`/`ub`",
                )
                continue
            if c.cluster == "dp" and c.within_node and topo.nodes > 1:
                self.error(
                    f"table {name} is pinned to `dp` (on every GPU of every node) and `within_node`",
                    span,
                    "drop `within_node`, or pin `rb`/`ub`",
                )
            if rmin > t.rows:
                self.error(
                    f"table {name} has {t.rows} rows, fewer than its {rmin} row shards", span
                )
            if rmin * cmin > w:
                self.error(
                    f"table {name} needs at least {rmin * cmin} shards ({rmin} x {cmin}) but the "
                    f"cluster has {w} GPU{'s' if w != 1 else ''}",
                    span,
                )
            elif c.within_node and rmin * cmin > g:
                self.error(
                    f"table {name} must stay within one node but needs at least {rmin * cmin} "
                    f"shards ({rmin} row x {cmin} column) and a node has {g} "
                    f"GPU{'s' if g != 1 else ''}",
                    span,
                    "lower the shard minimums or drop `within_node`",
                )
            if cmin > 1:
                if t.dim % 4:
                    self.error(
                        f"table {name} asks for {cmin} column shards but its dim {t.dim} is not "
                        "a multiple of 4",
                        span,
                        "dim must be a multiple of 4 for column sharding",
                    )
                elif cmin > t.dim // 4:
                    self.error(
                        f"table {name} asks for {cmin} column shards but dim {t.dim} splits into "
                        f"at most {t.dim // 4} (column widths are multiples of 4)",
                        span,
                        f"use at most `column_shards {t.dim // 4}`",
                    )
                if not columns_may_be_cut(t.optimizer.kind):
                    self.error(
                        f"table {name} uses `{t.optimizer.kind}`, whose state is one value per "
                        f"whole row, but asks for {cmin} column shards",
                        span,
                        "use `no_column_split`, or `adagrad`",
                    )
        self.check_colocated(by_name, constraints, colocate, topo)

    def check_colocated(
        self,
        by_name: dict[str, ir.Table],
        constraints: list[ir.TableConstraint],
        colocate: list[ir.Colocate],
        topo: ir.Topology,
    ) -> None:
        """A colocate group (groups sharing a table merge) is placed as one unit of one
        cluster kind on one grid: its members' pins and shard bounds must agree (the
        planner's `clusters.units_of` holds the same rules; here they are errors at the
        `colocate` line, found by `check` too)."""
        of = {c.table: c for c in constraints}
        order = {n: i for i, n in enumerate(by_name)}
        parent: dict[str, int] = {}  # table -> index of its merged group
        groups: list[tuple[set[str], ir.Colocate]] = []
        for col in colocate:
            members = {n for n in col.tables if n in by_name}
            joined = sorted({parent[n] for n in members if n in parent})
            if joined:
                keep = joined[0]
                for k in joined[1:]:
                    members |= groups[k][0]
                    groups[k] = (set(), groups[k][1])
                groups[keep] = (groups[keep][0] | members, groups[keep][1])
            else:
                keep = len(groups)
                groups.append((members, col))
            for n in groups[keep][0]:
                parent[n] = keep
        for members, col in groups:
            if len(members) < 2 or col.span is None:
                continue
            names = sorted(members, key=order.__getitem__)
            span = col.span.to_span()
            pins: dict[str, str] = {}
            for n in names:
                pin = of[n].cluster if n in of else None
                if pin is not None:
                    pins[n] = pin
            kinds = sorted(set(pins.values()))
            if len(kinds) > 1:
                a = next(n for n in names if pins.get(n) == kinds[0])
                b = next(n for n in names if pins.get(n) == kinds[1])
                if "dp" in (pins[a], pins[b]):
                    dp, other = (a, b) if pins[a] == "dp" else (b, a)
                    self.error(
                        f"`colocate` joins `{dp}` (pinned `dp`, on every GPU) with `{other}` "
                        f"(pinned `{pins[other]}`)",
                        span,
                        "dp tables are everywhere already: leave them out of `colocate`",
                    )
                else:
                    self.error(
                        f"`colocate` joins `{a}` (pinned `{pins[a]}`) with `{b}` (pinned "
                        f"`{pins[b]}`): a colocated group is one unit of one cluster kind",
                        span,
                        "pin them to the same kind, or drop the colocate",
                    )
                continue
            within = [n for n in names if n in of and of[n].within_node]
            if kinds == ["dp"] and within and topo.nodes > 1:
                self.error(
                    f"`colocate` joins `{within[0]}` (`within_node`) with tables pinned `dp` "
                    "(on every GPU of every node)",
                    span,
                    "drop `within_node`, or pin the group to `rb` or `ub`",
                )
                continue
            # the group's one grid: the largest minimum and the smallest maximum of each
            bounds = []
            for axis in ("row", "column"):
                lo, lo_by, hi, hi_by = 1, "", None, ""
                for n in names:
                    t, c = by_name[n], of.get(n)
                    if axis == "row":
                        cap, cap_by = t.rows, f"`{n}` ({t.rows:,} rows)"
                        low = c.min_row_shards if c else 1
                        high = c.max_row_shards if c else None
                    else:
                        cap, cap_by = max(1, t.dim // 4), f"`{n}` (dim {t.dim})"
                        if not columns_may_be_cut(t.optimizer.kind):
                            cap, cap_by = 1, f"`{n}` ({t.optimizer.kind})"
                        low = c.min_column_shards if c else 1
                        high = c.max_column_shards if c else None
                    if high is not None and high < cap:
                        cap, cap_by = high, f"`{n}`"
                    if hi is None or cap < hi:
                        hi, hi_by = cap, cap_by
                    if low > lo:
                        lo, lo_by = low, f"`{n}`"
                if hi is not None and lo > hi:
                    bounds.append(
                        f"{lo_by} asks for at least {lo} {axis} shards, {hi_by} allows at most {hi}"
                    )
            if bounds:
                self.error(
                    "the tables of this `colocate` share one grid, and their shard bounds "
                    "contradict each other: " + "; ".join(bounds),
                    span,
                    "relax the bounds, or drop the colocate",
                )

    def check_memory(
        self,
        tables: list[ir.Table],
        constraints: list[ir.TableConstraint],
        topo: ir.Topology,
        options: ir.PlanOptions,
        hw: Block | None,
    ) -> None:
        per_gpu = topo.hbm_bytes - options.memory_headroom
        if not tables or per_gpu <= 0:
            return
        span = hw.keyword_span() if hw is not None else Span(self.files[0].path)
        total = sum(t.bytes for t in tables)
        capacity = per_gpu * topo.world_size
        headroom = (
            f" - {format_bytes(options.memory_headroom)} headroom"
            if options.memory_headroom
            else ""
        )
        if total > capacity:
            need_nodes = math.ceil(total / (per_gpu * topo.gpus_per_node))
            biggest = max(tables, key=lambda t: t.bytes)
            self.error(
                f"the tables need {format_bytes(total)} (weights and optimizer state) but the "
                f"cluster holds {format_bytes(capacity)} ({_nodes(topo.nodes)} x "
                f"{topo.gpus_per_node} GPUs x ({format_bytes(topo.hbm_bytes)}{headroom})): "
                f"short by {format_bytes(total - capacity)}",
                span,
                (
                    f"use at least {_nodes(need_nodes)}, bigger GPUs, or smaller tables "
                    f"(the largest, `{biggest.name}`, needs {format_bytes(biggest.bytes)})"
                    if need_nodes <= ir.LIMITS["nodes"]
                    else f"the largest table, `{biggest.name}`, needs "
                    f"{format_bytes(biggest.bytes)}: is its `rows` a typo?"
                ),
            )
            return
        by_name = {t.name: t for t in tables}
        dp = [by_name[c.table] for c in constraints if c.cluster == "dp" and c.table in by_name]
        dp_bytes = sum(t.bytes for t in dp)
        if dp_bytes > per_gpu:
            self.error(
                f"the tables pinned to `dp` need {format_bytes(dp_bytes)} on every GPU, more "
                f"than the {format_bytes(per_gpu)} each GPU holds",
                span,
                "pin fewer or smaller tables to `dp`",
            )
            return
        # a dp table takes its bytes on every GPU: the others share what the copies leave
        rest = total - dp_bytes
        left = per_gpu - dp_bytes
        if dp and rest > left * topo.world_size:
            biggest = max(dp, key=lambda t: t.bytes)
            names = ", ".join(f"`{t.name}`" for t in dp[:3]) + (", ..." if len(dp) > 3 else "")
            fixes = [
                f"pin fewer tables to `dp` (sharding `{biggest.name}` frees "
                f"{format_bytes(biggest.bytes)} on every GPU)"
            ]
            if left > 0:
                need_nodes = math.ceil(rest / (left * topo.gpus_per_node))
                if need_nodes <= ir.LIMITS["nodes"]:
                    fixes.append(f"use at least {_nodes(need_nodes)}")
            pin = next(c for c in constraints if c.cluster == "dp" and c.table == biggest.name)
            self.error(
                f"the tables pinned to `dp` ({names}) take {format_bytes(dp_bytes)} on every "
                f"GPU, which leaves {format_bytes(left)} on each of the {topo.world_size:,} "
                f"GPUs ({format_bytes(left * topo.world_size)} in all) for the other tables; "
                f"they need {format_bytes(rest)}",
                pin.span.to_span() if pin.span is not None else span,
                ", or ".join(fixes),
            )


def _nodes(n: int) -> str:
    """`1 node`, `16 nodes`, `1,024 nodes`."""
    return f"{n:,} node" + ("" if n == 1 else "s")


def _unquote(s: str) -> str:
    body = s[1:-1]
    return re.sub(r"\\(.)", r"\1", body)


def lower(
    files: list[SourceFile],
    name: str,
    sources: tuple[ir.Source, ...],
    warnings: list[Diagnostic] | None = None,
) -> ir.Program:
    """Lower parsed files (root first, then includes) into a `Program`; raise `EmbarkError`
    (whose diagnostics include the warnings). The warnings of a spec that lowers are
    appended to `warnings` when it is given."""
    lowerer = Lowerer(files)
    program = lowerer.run(name, sources)
    if warnings is not None:
        warnings.extend(lowerer.c.warnings)
    return program
