"""Checks across blocks: the batch splits over the GPUs, constraints do not contradict each
other or the tables, colocated tables agree, and the tables fit in the cluster's memory."""

from __future__ import annotations

import math

from embark_runtime.formatting import format_bytes
from embark_runtime.optimizers import columns_may_be_cut
from embarkc import ir
from embarkc.diagnostics import Span
from embarkc.lowering.base import Block, LowererBase, _nodes
from embarkc.syntax import span_of


class CrossChecks(LowererBase):
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
        host = (topo.host_memory or 0) * topo.nodes
        if host and capacity < total <= capacity + host:
            # the planner puts tables in host memory behind HBM caches (docs/host_tier.md)
            return
        biggest = max(tables, key=lambda t: t.bytes)
        if host and total > capacity:
            need_nodes = math.ceil(total / (per_gpu * topo.gpus_per_node + (topo.host_memory or 0)))
            self.error(
                f"the tables need {format_bytes(total)} (weights and optimizer state), more "
                f"than the cluster's HBM ({format_bytes(capacity)}: {_nodes(topo.nodes)} x "
                f"{topo.gpus_per_node} GPUs x ({format_bytes(topo.hbm_bytes)}{headroom})) "
                f"and host memory ({format_bytes(host)}: {_nodes(topo.nodes)} x "
                f"{format_bytes(topo.host_memory or 0)}) hold together: short by "
                f"{format_bytes(total - capacity - host)}",
                span,
                (
                    f"use at least {_nodes(need_nodes)}, more host_memory, bigger GPUs, or "
                    f"smaller tables (the largest, `{biggest.name}`, needs "
                    f"{format_bytes(biggest.bytes)})"
                    # as without host memory: a size no spec's nodes hold in HBM is a typo
                    if math.ceil(total / (per_gpu * topo.gpus_per_node)) <= ir.LIMITS["nodes"]
                    else f"the largest table, `{biggest.name}`, needs "
                    f"{format_bytes(biggest.bytes)}: is its `rows` a typo?"
                ),
            )
            return
        if total > capacity:
            need_nodes = math.ceil(total / (per_gpu * topo.gpus_per_node))
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
