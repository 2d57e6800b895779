"""An independent validator of any plan against the program it claims to plan.

`validate_plan(program, plan)` returns every broken rule it finds as a `Violation`;
`check_plan(program, plan, path)` raises an `EmbarkError` that names them;
`constraint_violations(program, plan)` checks only the spec's placement constraints (the
last six rules below), each violation with the span of its constraint. It knows
nothing of how plans are searched (it never imports the planner's search or cost code),
so it can judge the planner's output, a baseline, or a hand-edited file alike.

THE RULES (the `rule` field of a Violation)
===========================================
* `rule 1` .. `rule 4`, `schema`: the plan-v1 contract itself
  (`embark_runtime.plan.validate_rules`); when one is broken nothing else is checked,
  because the other rules assume a well-formed plan.
* `matches-program`: the plan describes the program: the same topology, global batch,
  row partition, tables (rows, dim, dtype, optimizer) and features (table, hotness,
  pooling, access), in the same order.
* `memory`: the weights and optimizer state on every rank fit in `hbm_bytes` minus the
  spec's `memory_headroom`.
* `column-cuts`: every column cut lies at a multiple of 4 (the lookup kernels' vector
  width); a cell may end at `dim` when dim is not a multiple of 4.
* `rowwise-adagrad`: a rowwise_adagrad table is never column-split (the row's mean
  needs every column).
* `cluster-kind`: a table pinned to a cluster kind by the spec is in such a cluster.
* `row-shards`, `column-shards`: the table's grid lies within the spec's bounds
  (`no_column_split` is max_column_shards 1). A dp table counts as one row shard and one
  column shard.
* `within-node`: every cell of a `within_node` table is on the GPUs of one node (a dp
  table is on every rank, so it satisfies this only on a one-node cluster).
* `colocate`: the tables of a colocate group occupy the same set of ranks.
* `communication`: where the spec's plan options name a communication (flat or
  hierarchical, not auto), every rb and ub cluster has it.

(That every rb cluster says how its results travel, flat or hierarchical, is contract
rule 1.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embark_runtime.plan import Plan, PlanError, validate_rules
from embarkc.diagnostics import Diagnostic, EmbarkError, Span
from embarkc.ir import Access, Program

__all__ = ["Violation", "validate_plan", "check_plan", "constraint_violations"]


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    table: str | None = None
    span: Span | None = None
    """where the spec states what is broken (constraints), when known"""

    def __str__(self) -> str:
        return f"({self.rule}) {self.message}"


def _names_differ(spec: list[str], plan: list[str]) -> str | None:
    """How the plan's list of names differs from the spec's, or None when equal."""
    if spec == plan:
        return None
    missing = [n for n in spec if n not in plan]
    extra = [n for n in plan if n not in spec]
    if missing:
        return f"missing {missing}"
    return f"unknown {extra}" if extra else "in another order"


def validate_plan(program: Program, plan: Plan, *, constraints: bool = True) -> list[Violation]:
    """Every rule (module docstring) that `plan` breaks for `program`, in rule order;
    without `constraints`, the spec's placement constraints (cluster-kind to communication)
    are not checked (a fixed strategy ignores them by design)."""
    try:
        validate_rules(plan)
    except PlanError as e:
        return [Violation(e.rule, e.message)]
    out: list[Violation] = []
    out += _matches_program(program, plan)
    if out:
        # the remaining rules read the program's tables through the plan's names
        return out
    out += _memory(program, plan)
    out += _cells(program, plan)
    if constraints:
        out += constraint_violations(program, plan)
    return out


def check_plan(program: Program, plan: Plan, path: str, *, constraints: bool = True) -> None:
    """Raise an EmbarkError naming every broken rule of `plan` (nothing when it is valid)."""
    bad = validate_plan(program, plan, constraints=constraints)
    if bad:
        raise EmbarkError(
            [Diagnostic(f"invalid plan ({v.rule}): {v.message}", Span.of_file(path)) for v in bad]
        )


# --------------------------------------------------------------------------- rules


def _close(a: float, b: float) -> bool:
    # plan files round floats to 9 significant digits
    return math.isclose(a, b, rel_tol=1e-8, abs_tol=0.0)


def _access_matches(ir: Access, plan_access) -> bool:
    if ir.kind != plan_access.kind:
        return False
    if ir.kind == "zipf":
        return (
            plan_access.alpha is not None
            and _close(ir.alpha, plan_access.alpha)
            and ir.permuted == (plan_access.permuted if plan_access.permuted is not None else True)
        )
    if ir.kind == "histogram":
        return list(ir.keys) == list(plan_access.keys or []) and list(ir.counts) == list(
            plan_access.counts or []
        )
    return True


def _matches_program(program: Program, plan: Plan) -> list[Violation]:
    out: list[Violation] = []

    def bad(message: str, table: str | None = None) -> None:
        out.append(Violation("matches-program", message, table))

    topo, pt = program.topology, plan.topology
    for name in ("nodes", "gpus_per_node", "hbm_bytes"):
        if getattr(topo, name) != getattr(pt, name):
            bad(f"topology.{name} is {getattr(pt, name)}, the spec says {getattr(topo, name)}")
    for name in ("hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
        if not _close(getattr(topo, name), getattr(pt, name)):
            bad(f"topology.{name} is {getattr(pt, name)}, the spec says {getattr(topo, name)}")
    if plan.batch_size != program.batch_size:
        bad(f"batch_size is {plan.batch_size}, the spec says {program.batch_size}")
    if plan.row_partition != program.options.row_partition:
        bad(
            f"row_partition is `{plan.row_partition}`, the spec says "
            f"`{program.options.row_partition}`"
        )
    what = _names_differ([t.name for t in program.tables], [t.name for t in plan.tables])
    if what:
        bad(f"the plan's tables are not the spec's: {what}")
    else:
        for t, p in zip(program.tables, plan.tables, strict=True):
            for name, want, got in (
                ("rows", t.rows, p.rows),
                ("dim", t.dim, p.dim),
                ("dtype", t.dtype, p.dtype),
                ("optimizer", t.optimizer.kind, p.optimizer),
            ):
                if want != got:
                    bad(f"table `{t.name}` has {name} {got}, the spec says {want}", t.name)
    what = _names_differ([f.name for f in program.features], [f.name for f in plan.features])
    if what:
        bad(f"the plan's features are not the spec's: {what}")
    else:
        for f, p in zip(program.features, plan.features, strict=True):
            if f.table != p.table:
                bad(f"feature `{f.name}` reads `{p.table}`, the spec says `{f.table}`", f.table)
            if not _close(f.hotness, p.hotness):
                bad(f"feature `{f.name}` has hotness {p.hotness}, the spec says {f.hotness}")
            if f.pooling != p.pooling:
                bad(f"feature `{f.name}` pools by {p.pooling}, the spec says {f.pooling}")
            if not _access_matches(f.access, p.access):
                bad(f"feature `{f.name}` has another access distribution than the spec's")
    return out


def _memory(program: Program, plan: Plan) -> list[Violation]:
    """Weights plus optimizer state per rank, computed here from the shards."""
    by_name = {t.name: t for t in program.tables}
    world = program.topology.world_size
    used = [0] * world
    for c in plan.clusters:
        if c.kind == "dp":
            for name in c.tables:
                t = by_name[name]
                used = [u + t.rows * t.row_bytes for u in used]
    for s in plan.shards:
        t = by_name[s.table]
        rows = plan.row_count(s.table, s.row_shard, s.row_shards)
        w = s.width
        per_elem, per_row = {
            "sgd": (0, 0),
            "adagrad": (1, 0),
            "rowwise_adagrad": (0, 1),
            "adam": (2, 1),
        }[t.optimizer.kind]
        used[s.rank] += rows * (w * t.element_bytes + (w * per_elem + per_row) * 4)
    capacity = program.topology.hbm_bytes - program.options.memory_headroom
    return [
        Violation(
            "memory",
            f"rank {r} holds {u} bytes of weights and optimizer state, more than the "
            f"{capacity} bytes available (hbm_bytes {program.topology.hbm_bytes} minus "
            f"memory_headroom {program.options.memory_headroom})",
        )
        for r, u in enumerate(used)
        if u > capacity
    ]


def _cells(program: Program, plan: Plan) -> list[Violation]:
    out: list[Violation] = []
    by_name = {t.name: t for t in program.tables}
    for s in plan.shards:
        t = by_name[s.table]
        lo, hi = s.columns
        if lo % 4 or (hi % 4 and hi != t.dim):
            out.append(
                Violation(
                    "column-cuts",
                    f"a cell of `{t.name}` covers columns [{lo}, {hi}): cuts must lie at "
                    "multiples of 4",
                    t.name,
                )
            )
        if t.optimizer.kind == "rowwise_adagrad" and (lo, hi) != (0, t.dim):
            out.append(
                Violation(
                    "rowwise-adagrad",
                    f"`{t.name}` uses rowwise_adagrad and must not be column-split "
                    f"(a cell covers [{lo}, {hi}) of {t.dim})",
                    t.name,
                )
            )
    return out


def _grid(plan: Plan, table: str) -> tuple[str, int, int, set[int]]:
    """(kind, row shards, largest column-shard count of a row shard, ranks) of a table."""
    kind = plan.cluster_of(table).kind
    if kind == "dp":
        return kind, 1, 1, set(range(plan.world_size))
    cells = plan.shards_of(table)
    r = cells[0].row_shards
    cols = max(sum(1 for s in cells if s.row_shard == j) for j in range(r))
    return kind, r, cols, {s.rank for s in cells}


def _span(node) -> Span | None:
    s = node.span
    return None if s is None else Span(s.file, s.line, s.col, s.end_line, s.end_col)


def constraint_violations(program: Program, plan: Plan) -> list[Violation]:
    """The spec's placement constraints that `plan` breaks (rules cluster-kind to
    communication), each with the span of the constraint. Assumes `plan` describes
    `program`."""
    out: list[Violation] = []
    g = program.topology.gpus_per_node
    for c in program.constraints:
        at = _span(c)
        kind, r, cols, ranks = _grid(plan, c.table)
        if c.cluster is not None and kind != c.cluster:
            out.append(
                Violation(
                    "cluster-kind",
                    f"`{c.table}` is pinned to {c.cluster} but the plan puts it in a {kind} "
                    "cluster",
                    c.table,
                    at,
                )
            )
        hi_r = c.max_row_shards if c.max_row_shards is not None else r
        if not c.min_row_shards <= r <= hi_r:
            out.append(
                Violation(
                    "row-shards",
                    f"`{c.table}` has {r} row shards; the spec allows "
                    f"{_bounds(c.min_row_shards, c.max_row_shards)}",
                    c.table,
                    at,
                )
            )
        lo_c = min(
            (sum(1 for s in plan.shards_of(c.table) if s.row_shard == j) for j in range(r)),
            default=1,
        )
        hi_c = c.max_column_shards if c.max_column_shards is not None else cols
        if kind == "dp":
            lo_c = 1
        if not (c.min_column_shards <= lo_c and cols <= hi_c):
            out.append(
                Violation(
                    "column-shards",
                    f"`{c.table}` has {cols} column shards; the spec allows "
                    f"{_bounds(c.min_column_shards, c.max_column_shards)}",
                    c.table,
                    at,
                )
            )
        if c.within_node and len({rank // g for rank in ranks}) > 1:
            out.append(
                Violation(
                    "within-node",
                    f"`{c.table}` must stay within one node but lives on nodes "
                    f"{sorted({rank // g for rank in ranks})}",
                    c.table,
                    at,
                )
            )
    mode = program.options.communication
    if mode != "auto":
        for cl in plan.clusters:
            if cl.kind != "dp" and cl.communication is not None and cl.communication != mode:
                out.append(
                    Violation(
                        "communication",
                        f"the spec's plan options ask for {mode} communication but "
                        f"{cl.kind} cluster `{cl.name}` is {cl.communication}",
                        cl.tables[0] if cl.tables else None,
                        _span(program.options),
                    )
                )
    for group in program.colocate:
        sets = {name: _grid(plan, name)[3] for name in group.tables}
        first = group.tables[0]
        for name in group.tables[1:]:
            if sets[name] != sets[first]:
                out.append(
                    Violation(
                        "colocate",
                        f"`{name}` is on ranks {sorted(sets[name])} but `{first}`, colocated "
                        f"with it, is on ranks {sorted(sets[first])}",
                        name,
                        _span(group),
                    )
                )
    return out


def _bounds(lo: int, hi: int | None) -> str:
    return f"{lo} to {hi}" if hi is not None else f"at least {lo}"
