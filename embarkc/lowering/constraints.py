"""The `plan` block: the planner's options, per-table placement constraints and
`colocate` groups."""

from __future__ import annotations

from typing import Any

from lark import Token, Tree

from embark_runtime.formatting import format_bytes
from embarkc import ir
from embarkc.diagnostics import Span, did_you_mean
from embarkc.lowering.base import Block, Field_, LowererBase, _Fail
from embarkc.syntax import parts, span_of
from embarkc.units import Kind


class PlanBlockLowering(LowererBase):
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
