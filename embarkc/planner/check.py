"""An independent validator of any plan against the program it claims to plan.

`validate_plan(program, plan)` returns every broken rule it finds as a `Violation`;
`check_plan(program, plan, path)` raises an `EmbarkError` that names them;
`constraint_violations(program, plan)` checks only the spec's placement constraints (the
last six rules below), each violation with the span of its constraint. Its rules know
nothing of how plans are searched (they never use the planner's search or cost code),
so they judge the planner's output, a baseline, or a hand-edited file alike.
`estimate_warnings(program, plan, path)` says where the plan's estimate is not what
embarkc computes for its layout (a hand edit, or another version of embarkc): the one
check that reads the cost model, because the estimate is by definition its figures;
`check_plan` prints them as warnings (the layout is still a valid plan).

THE RULES (the `rule` field of a Violation)
===========================================
* `rule 1` .. `rule 4`, `schema`: the plan-v1 contract itself
  (`embark_runtime.plan.validate_rules`); when one is broken nothing else is checked,
  because the other rules assume a well-formed plan.
* `complete`: the plan file gives every field the spec determines
  (`embark_runtime.plan.missing_fields`, and each feature's `column` the spec sets;
  docs/plan.md lists those it may leave out), so that no reader falls back on a model's
  default where the spec says otherwise.
* `matches-program`: the plan describes the program: the same topology, global batch,
  row partition, tables (rows, dim, dtype, optimizer) and features (table, hotness,
  pooling, access), in the same order; and where the plan gives them, the fields of
  embarkc's own that the spec determines: topology.arch and dense_flops, every table's
  optimizer_params and init, every feature's max_hotness, fixed and weighted, the dense
  `model` and the `seed`; a feature's `column` where either gives it (a plan lacking
  the spec's column breaks `complete`).
* `memory`: the weights and optimizer state on every rank fit in `hbm_bytes` minus the
  spec's `memory_headroom`; a host-tier cell counts its HBM cache (cache_rows x (dim x
  dtype bytes + optimizer state)), not its rows.
* `tier`: a cell's `cache_rows` is given only with `tier: "host"` and is at most the
  cell's rows.
* `host-memory`: the host-tier cells of every node (weights and optimizer state) fit in
  the spec's `host_memory` (per node); a spec without `host_memory` has no host tier.
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
from typing import Any

from embark_runtime.formatting import format_number
from embark_runtime.optimizers import columns_may_be_cut, optimizer
from embark_runtime.plan import (
    Plan,
    PlanError,
    check_complete,
    dense_precision,
    dense_schedule,
    validate_rules,
)
from embark_runtime.schedules import Schedule
from embarkc.diagnostics import Diagnostic, EmbarkError, Span, print_warnings
from embarkc.ir import Access, Program, without_spans

__all__ = [
    "Violation",
    "validate_plan",
    "check_plan",
    "constraint_violations",
    "estimate_warnings",
    "format_number",
    "ignored_constraints",
    "warn_ignored_constraints",
    "check_against_spec",
]


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
    out += _tiers(program, plan)
    out += _cells(program, plan)
    if constraints:
        out += constraint_violations(program, plan)
    return out


def check_plan(
    program: Program,
    plan: Plan,
    path: str,
    *,
    constraints: bool = True,
    estimate: bool = True,
    complete: bool = False,
) -> None:
    """Raise an EmbarkError naming every broken rule of `plan` (nothing when it is valid);
    with `complete` (a plan read from a file as the plan of `program`'s spec), first the
    fields the spec determines that it lacks (rule `complete`: a reader would take a
    model's default where the spec may say otherwise); with `estimate`, then print
    `estimate_warnings` on stderr."""
    bad = validate_plan(program, plan, constraints=constraints)
    try:
        if complete:
            check_complete(plan, path, unwritten=_unwritten(program, plan))
    except PlanError as e:
        bad.insert(0, Violation(e.rule, e.message))
    if bad:
        raise EmbarkError(
            [Diagnostic(f"invalid plan ({v.rule}): {v.message}", Span.of_file(path)) for v in bad]
        )
    if estimate:
        print_warnings(estimate_warnings(program, plan, path))


def _unwritten(program: Program, plan: Plan) -> list[str]:
    """Dotted paths of the fields a plan writes only when its spec sets them
    (docs/plan.md) that `program` sets and `plan` lacks: each feature's `column` (without
    it the trainer would read the column named as the feature)."""
    if [f.name for f in program.features] != [f.name for f in plan.features]:
        return []  # `matches-program` says how the features differ
    return [
        f"features.{i}.column"
        for i, (f, p) in enumerate(zip(program.features, plan.features, strict=True))
        if f.column is not None and "column" not in p.model_fields_set
    ]


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

    def differ(where: str, got: Any, want: Any, table: str | None = None) -> None:
        if got is None and want is not None:
            bad(f"{where} is missing, the spec says {_text(want)}", table)
        elif not _same_value(got, want):
            bad(f"{where} is {_text(got)}, the spec says {_text(want)}", table)

    topo, pt = program.topology, plan.topology
    for name in ("nodes", "gpus_per_node", "hbm_bytes"):
        differ(f"topology.{name}", getattr(pt, name), getattr(topo, name))
    for name in ("hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
        differ(f"topology.{name}", getattr(pt, name), getattr(topo, name))
    for name in ("arch", "dense_flops"):
        if name in pt.model_fields_set:
            differ(f"topology.{name}", getattr(pt, name), getattr(topo, name))
    given = pt.constants or {}
    for name in sorted(set(given) | set(topo.constants)):
        differ(f"topology.constants.{name}", given.get(name), topo.constants.get(name))
    differ("batch_size", plan.batch_size, program.batch_size)
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
                    bad(
                        f"table `{t.name}` has {name} {_text(got)}, the spec says {_text(want)}",
                        t.name,
                    )
            for group, given, spec in (
                ("optimizer_params", p.optimizer_params, t.optimizer),
                ("init", p.init, t.init),
            ):
                if group in p.model_fields_set:
                    for name in sorted(given.model_fields_set - {"schedule"}):
                        differ(
                            f"table `{t.name}` {group}.{name}",
                            getattr(given, name),
                            getattr(spec, name),
                            t.name,
                        )
            # a schedule is compared whether the plan gives one or not: a plan without
            # one trains at a constant rate
            spec_schedule = t.optimizer.schedule.runtime() if t.optimizer.schedule else None
            if p.optimizer_params.schedule != spec_schedule:
                bad(
                    f"table `{t.name}` optimizer_params.schedule is "
                    f"{_schedule_text(p.optimizer_params.schedule)}, the spec says "
                    f"{_schedule_text(spec_schedule)}",
                    t.name,
                )
    what = _names_differ([f.name for f in program.features], [f.name for f in plan.features])
    if what:
        bad(f"the plan's features are not the spec's: {what}")
    else:
        for i, (f, p) in enumerate(zip(program.features, plan.features, strict=True)):
            if f.table != p.table:
                bad(f"feature `{f.name}` reads `{p.table}`, the spec says `{f.table}`", f.table)
            if not _close(f.hotness, p.hotness):
                bad(f"feature `{f.name}` has hotness {p.hotness}, the spec says {f.hotness}")
            if f.pooling != p.pooling:
                bad(f"feature `{f.name}` pools by {p.pooling}, the spec says {f.pooling}")
            if not _access_matches(f.access, p.access):
                bad(f"feature `{f.name}` has another access distribution than the spec's")
            for name in ("max_hotness", "fixed", "weighted"):
                if name in p.model_fields_set:
                    differ(f"feature `{f.name}` {name}", getattr(p, name), getattr(f, name))
            # written only when the spec sets it; a plan lacking it is `complete`'s
            if "column" in p.model_fields_set and p.column != f.column:
                named = f'"{f.column}"' if f.column is not None else "none (its own name)"
                given = f'"{p.column}"' if p.column is not None else "null"
                bad(
                    f"feature `{f.name}` column (`features.{i}.column`) is {given}, "
                    f"the spec says {named}"
                )
    own = plan.model_extra or {}
    if own.get("model") is not None:
        want = without_spans(program.model.model_dump(mode="json"))
        for where, got, spec in _model_differences(want, own["model"], "model"):
            bad(f"{where} is {_text(got)}, the spec says {_text(spec)}")
        # fields written only when set: their absence on either side says fp32, constant
        differ("model.precision", dense_precision(plan), program.model.precision)
        optimizer = own["model"].get("optimizer") if isinstance(own["model"], dict) else None
        given = optimizer.get("weight_decay", 0.0) if isinstance(optimizer, dict) else 0.0
        differ("model.optimizer.weight_decay", given, program.model.optimizer.weight_decay)
        sched = program.model.optimizer.schedule
        want_schedule = sched.runtime() if sched else None
        if dense_schedule(plan) != want_schedule:
            bad(
                f"model.optimizer.schedule is {_schedule_text(dense_schedule(plan))}, the spec "
                f"says {_schedule_text(want_schedule)}"
            )
    if own.get("seed") is not None:
        differ("seed", own["seed"], program.options.seed)
    return out


def _schedule_text(schedule: Schedule | None) -> str:
    return "none (a constant rate)" if schedule is None else schedule.describe()


def _same_value(got: Any, want: Any) -> bool:
    """Equal, numbers to the plan files' rounding (9 significant digits)."""
    if isinstance(got, list | tuple) and isinstance(want, list | tuple):
        return len(got) == len(want) and all(map(_same_value, got, want))
    numbers = (int, float)
    if isinstance(got, numbers) and isinstance(want, numbers):
        if isinstance(got, bool) or isinstance(want, bool):
            return got is want
        return got == want or _close(float(got), float(want))
    return bool(got == want)


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return format_number(value)


def _model_differences(want: Any, got: Any, where: str) -> list[tuple[str, Any, Any]]:
    """(dotted field, plan's value, spec's value) of every field of the plan's `model`
    that differs from the spec's dense model; fields the plan does not give are not
    compared (a plan written before them)."""
    if isinstance(got, dict) and isinstance(want, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(got):
            if key in want:
                out += _model_differences(want[key], got[key], f"{where}.{key}")
        return out
    if isinstance(want, dict) and isinstance(got, str):
        want = want.get("kind")  # `"interaction": "dot"`, as older plans say it
    return [] if _same_value(got, want) else [(where, got, want)]


def _memory(program: Program, plan: Plan) -> list[Violation]:
    """Weights plus optimizer state per rank, computed here from the shards."""
    used = _memory_used(program, plan)
    capacity = program.topology.hbm_bytes - program.options.memory_headroom
    return [
        Violation(
            "memory",
            f"rank {r} holds {format_number(u)} bytes of weights and optimizer state, more "
            f"than the {format_number(capacity)} bytes available (hbm_bytes "
            f"{format_number(program.topology.hbm_bytes)} minus memory_headroom "
            f"{format_number(program.options.memory_headroom)})",
        )
        for r, u in enumerate(used)
        if u > capacity
    ]


def _memory_used(program: Program, plan: Plan) -> list[int]:
    """Weights plus optimizer state on every rank, counted from the program's tables and
    the plan's cells."""
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
        if s.tier == "host":
            rows = s.cache_rows or 0
        used[s.rank] += _cell_bytes(program, s.table, rows, s.width)
    return used


def _cell_bytes(program: Program, table: str, rows: int, width: int) -> int:
    """Weights plus optimizer state of `rows` x `width` of `table`, from the program."""
    t = next(t for t in program.tables if t.name == table)
    return rows * width * t.element_bytes + optimizer(t.optimizer.kind).state_bytes(rows, width)


def _tiers(program: Program, plan: Plan) -> list[Violation]:
    """The `tier` and `host-memory` rules (module docstring)."""
    out = []
    host = [0] * program.topology.nodes
    for i, s in enumerate(plan.shards):
        rows = plan.row_count(s.table, s.row_shard, s.row_shards)
        where = f"shards[{i}] (`{s.table}` row shard {s.row_shard}, columns {list(s.columns)})"
        if s.cache_rows is not None and s.tier != "host":
            out.append(
                Violation(
                    "tier",
                    f"{where} has cache_rows {s.cache_rows} but is in HBM: add "
                    '"tier": "host" or remove cache_rows',
                )
            )
        if s.cache_rows is not None and not 0 <= s.cache_rows <= rows:
            out.append(
                Violation(
                    "tier",
                    f"{where} caches {s.cache_rows} rows; a cache holds 0 to the cell's "
                    f"{rows} rows",
                )
            )
        if s.tier == "host":
            host[program.topology.node_of(s.rank)] += _cell_bytes(program, s.table, rows, s.width)
    capacity = program.topology.host_memory
    if capacity is None and any(host):
        out.append(
            Violation(
                "host-memory",
                "the plan keeps cells in host memory but the spec's hardware gives no "
                "`host_memory`: add e.g. `host_memory 512 GiB` (per node) to the hardware "
                "block, or put the cells back in HBM",
            )
        )
    elif capacity is not None:
        out += [
            Violation(
                "host-memory",
                f"node {n} keeps {format_number(u)} bytes of host-tier weights and optimizer "
                f"state, more than its host_memory {format_number(capacity)}",
            )
            for n, u in enumerate(host)
            if u > capacity
        ]
    return out


ESTIMATE_REL_TOL = 1e-6
"""How far a recorded time may be from the cost model's before it reads as edited: plan
files round to 9 significant digits."""

ESTIMATE_SHOWN = 4
"""Differences named in the warning; the rest are counted."""


def estimate_warnings(program: Program, plan: Plan, path: str) -> list[Diagnostic]:
    """A warning when the estimate of a plan embarkc costed (its `layout_sha256` matches
    the layout: a layout edited since gets the stale warning instead) is not what embarkc
    computes for the layout and `program`: every rank's memory_bytes (counted from the
    cells) and time, the step time, critical path and components (the cost model). Assumes
    `plan` describes `program` (`validate_plan` found nothing)."""
    from embarkc.planner.build import layout_is_stale
    from embarkc.planner.cost import CostModel

    if layout_is_stale(plan) is not False:
        return []
    est = plan.estimate
    used = _memory_used(program, plan)
    found = [
        f"estimate.per_rank (rank {r.rank}) memory_bytes is {format_number(r.memory_bytes)}, "
        f"its cells hold {format_number(used[r.rank])} bytes"
        for r in est.per_rank
        if r.memory_bytes != used[r.rank]
    ]
    want = CostModel(program).evaluate(plan)
    extra = est.model_extra or {}

    def compare(where: str, got: Any, expect: Any) -> None:
        if got is None or expect is None:
            return
        if not math.isclose(float(got), float(expect), rel_tol=ESTIMATE_REL_TOL, abs_tol=1e-15):
            found.append(f"{where} is {_seconds(got)}, the cost model says {_seconds(expect)}")

    compare("estimate.step_time", est.step_time, want.get("step_time"))
    compare("estimate.critical_path", extra.get("critical_path"), want.get("critical_path"))
    comps, want_comps = extra.get("components"), want.get("components") or {}
    if isinstance(comps, dict):
        for name in sorted(comps):
            compare(f"estimate.components.{name}", comps[name], want_comps.get(name))
    by_rank = {int(r["rank"]): r for r in want.get("per_rank", [])}
    for r in est.per_rank:
        got = by_rank.get(r.rank)
        compare(f"estimate.per_rank (rank {r.rank}) time", r.time, got and got.get("time"))
    if not found:
        return []
    shown = "; ".join(found[:ESTIMATE_SHOWN])
    more = f"; and {len(found) - ESTIMATE_SHOWN} more" if len(found) > ESTIMATE_SHOWN else ""
    return [
        Diagnostic(
            "the plan's estimate is not what embarkc computes for its layout and spec "
            f"(edited by hand, or written by another version of embarkc): {shown}{more}",
            Span.of_file(path),
            hint="re-plan the spec (`embarkc plan`) to write the estimate anew; "
            "`embarkc diff` and `embarkc report` count memory from the cells",
            severity="warning",
        )
    ]


def _seconds(x: Any) -> str:
    x = float(x)
    if x == 0 or abs(x) >= 1:
        return f"{format_number(x)} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.6g} ms"
    return f"{x * 1e6:.6g} us"


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
        if not columns_may_be_cut(t.optimizer.kind) and (lo, hi) != (0, t.dim):
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


def ignored_constraints(program: Program, plan: Plan) -> list[Diagnostic]:
    """A warning, at the constraint in the spec, for every constraint of the spec that
    `plan`'s fixed strategy does not honour (none for the search: it honours them all)."""
    strategy = plan.planner.strategy
    if strategy in ("embark", "greedy"):
        return []
    return [
        Diagnostic(
            f"the fixed strategy {strategy} ignores this constraint: {v.message}",
            v.span or Span.of_file(program.sources[0].path),
            hint="plan with the search (--strategy embark) to honour every constraint",
            severity="warning",
        )
        for v in constraint_violations(program, plan)
    ]


def warn_ignored_constraints(program: Program, plan: Plan) -> None:
    """Print `ignored_constraints` on stderr, each with its line of the spec."""
    print_warnings(ignored_constraints(program, plan))


def check_against_spec(program: Program, plan: Plan, path: str, *, estimate: bool = True) -> None:
    """Hold `plan`, read from a file, to every rule of the checker against `program`
    (`check_plan`, every field the spec determines given): the spec's placement
    constraints are rules for a search's plan, and warnings for a fixed strategy's, which
    ignores them by design (`embarkc check`, `compile --plan`)."""
    fixed = plan.planner.strategy not in ("embark", "greedy")
    check_plan(program, plan, path, constraints=not fixed, estimate=estimate, complete=True)
    if fixed:
        warn_ignored_constraints(program, plan)
