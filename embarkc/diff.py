"""`embarkc diff`: what plan B does differently from plan A, and what it costs.

Stages, each a plain function:

    load_side(path) -> Side               a plan file, or a spec planned on the fly
    view_of(plan, program) -> PlanView    the costs the diff needs, whatever wrote the plan
    diff_sides(a, b) -> PlanDiff          the comparison, most important first
    render_markdown / render_json / render_terminal(PlanDiff)

A `PlanView` takes the costs from the plan's own estimate fields when embarkc wrote it
(estimate.critical_rank, components, per_rank[].components, per_table). A plan from an
outside tool carries only the contract fields; it is re-costed with the project's cost
model when its program is known (a spec on either side with the same tables, or the spec
the plan names, found unchanged), else the diff shows what the contract allows (step
time, per-rank time) and says so. A plan whose layout or estimate was edited after
embarkc wrote it (`estimate.layout_sha256` or `figures_sha256` no longer matches) is
re-costed the same way; when no program can be found its stale figures are shown with a
note saying so. Memory, per rank and per table, is always counted from the cells (exact,
whatever an estimate says).

Plans' inputs (topology, features) are compared where both plans record a field: a
field only one of them gives (embarkc's own, absent from another tool's plan) is listed
once as not compared, and the loader's default for it is never shown as a change. Ranks
differ when their memory does or their times differ beyond the files' rounding.

Everything here is deterministic: the same inputs give byte-identical output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from embark_runtime.formatting import format_bytes, format_pct, format_seconds
from embark_runtime.plan import Plan, PlanError, load_plan
from embarkc.dense import iteration_of
from embarkc.diagnostics import Diagnostic, EmbarkError, print_warnings
from embarkc.ir import Program
from embarkc.migration import Migration, migration_cost
from embarkc.planner.check import format_number

COMPONENTS = ("lookup", "distributor", "nvlink", "network", "dp_exchange")
"""Components of a rank's step time (docs/communication.md), in display order."""

SAME_PCT = 0.05
"""Relative changes below this many percent read as "same" in the verdict."""

DIFF_FORMAT = "embark-diff"
DIFF_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- inputs


class Side:
    """One side of a diff: a plan and, when it came from a spec, the program behind it."""

    def __init__(self, label: str, plan: Plan, program: Program | None = None):
        self.label = label
        self.plan = plan
        self.program = program


def load_side(path: str) -> Side:
    """Load a plan file (or the plan.json of a folder `embarkc compile` wrote), or compile
    and plan a spec with its own options.

    Raises EmbarkError for a missing file or a bad spec and PlanError for a plan file
    that is corrupt, of another format or of another version.
    """
    from embarkc.frontend import is_plan_file, plan_in_folder

    path = plan_in_folder(path)
    p = Path(path)
    if not p.is_file():
        raise EmbarkError.at(path, "no such file" if not p.exists() else "not a file")

    if is_plan_file(p):
        return Side(path, load_plan(p))
    from embarkc.frontend import load_program
    from embarkc.planner import plan_program, warn_ignored_constraints

    warnings: list[Diagnostic] = []
    program = load_program(path, warnings)
    print_warnings(warnings)
    plan = plan_program(program)
    warn_ignored_constraints(program, plan)
    return Side(path, plan, program)


# --------------------------------------------------------------------------- views


class RankView(_Frozen):
    rank: int
    time: float | None
    """Seconds per step; None when the plan gives no per-rank estimate."""
    memory_bytes: int
    """Weights and optimizer state, counted from the cells (whatever the estimate says)."""
    components: dict[str, float] | None = None


class TableView(_Frozen):
    table: str
    kind: str
    """Cluster kind: dp, rb or ub."""
    cluster: str
    grid: str
    """Row shards x column shards, e.g. "4x2"; "4x1-2" when row shards split differently;
    "replicated" for dp."""
    cells: tuple[tuple[int, int, int, int], ...]
    """(row_shard, lo, hi, rank) of every cell, sorted; empty for dp."""
    ranks: tuple[int, ...]
    time: float | None
    """Seconds the table puts on its busiest rank (None when the plan does not say)."""
    memory_bytes: int
    """Weights and optimizer state over all its cells; a dp table counts one copy."""


class PlanView(_Frozen):
    """The numbers the diff and the report read from one plan."""

    step_time: float
    critical_rank: int | None
    components: dict[str, float] | None
    """Time of each component on the critical rank, seconds."""
    peak_memory: int
    hbm_bytes: int
    per_rank: tuple[RankView, ...]
    tables: dict[str, TableView]
    cost_source: Literal["plan", "cost model", "contract", "stale"]
    """Where the costs come from: the plan's own fields, a re-costing, or the contract only."""
    status: str
    bound: float | None
    lower_bound: float | None
    """The planner's lower bound on any plan of the spec (`embarkc.planner.bound`)."""
    critical_path: float | None = None
    """The step time if every phase waited for its slowest rank (docs/plan.md)."""
    iteration: float | None = None
    """The whole iteration as the trainer runs it: the step time plus the dense forward,
    backward and all-reduce, less what overlaps (`embarkc.dense.Iteration`); None when
    the plan's hardware gives no dense rate."""
    samples_per_second: float | None = None


def _critical_path(estimate: Any, ranks: list[RankView]) -> float | None:
    """The estimate's `critical_path`, or, for a plan written before it, the same sum from
    its ranks' components; None when neither is there."""
    got = _get(estimate, "critical_path")
    if got is not None:
        return float(got)
    if not ranks or any(r.components is None for r in ranks):
        return None
    from embarkc.planner.cost import critical_path_of

    return critical_path_of([r.components for r in ranks if r.components is not None])


def _extra(model: BaseModel, key: str) -> Any:
    return (model.model_extra or {}).get(key)


def _components(raw: Any) -> dict[str, float] | None:
    if not isinstance(raw, dict):
        return None
    return {k: float(raw.get(k, 0.0)) for k in COMPONENTS}


def _grid(plan: Plan, table: str) -> str:
    cells = plan.shards_of(table)
    r = cells[0].row_shards
    splits = sorted({sum(1 for c in cells if c.row_shard == j) for j in range(r)})
    cols = str(splits[0]) if len(splits) == 1 else f"{splits[0]}-{splits[-1]}"
    return f"{r}x{cols}"


def _table_memory(plan: Plan, table: str) -> int:
    """Weights and optimizer state summed over the table's cells; one copy of a dp table
    (as the planner's estimate.per_table counts it)."""
    t = plan.table(table)
    if plan.cluster_of(table).kind == "dp":
        return t.bytes_for(t.rows, t.dim)
    return sum(
        t.bytes_for(plan.row_count(table, s.row_shard, s.row_shards), s.width)
        for s in plan.shards_of(table)
    )


def _recost(program: Program, plan: Plan) -> dict[str, Any]:
    """The project's cost model applied to `plan` (an estimate dict as the planner writes)."""
    from embarkc.planner.cost import CostModel

    return CostModel(program).evaluate(plan)


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    value = getattr(obj, key, None)
    if value is None and isinstance(obj, BaseModel):
        value = _extra(obj, key)
    return value


def _lacks_our_fields(plan: Plan) -> bool:
    """Whether the plan's estimate is the contract's alone (another tool wrote it)."""
    est = plan.estimate
    return _extra(est, "components") is None or _extra(est, "per_table") is None


def view_of(plan: Plan, program: Program | None = None) -> PlanView:
    """Costs of `plan`: its own estimate fields (when they cost this layout), else a
    re-costing with `program`, else the contract fields (step_time, per_rank time and
    memory) or the stale estimate, marked as such."""
    from embarkc.planner import estimate_is_stale

    est = plan.estimate
    source: Literal["plan", "cost model", "contract", "stale"] = "plan"
    estimate: Any = est
    lacks = _lacks_our_fields(plan)
    if lacks or estimate_is_stale(plan):
        if program is not None:
            estimate, source = _recost(program, plan), "cost model"
        else:
            source = "contract" if lacks else "stale"

    # memory is exact from the cells, whatever the estimate says (a stale or hand-edited
    # estimate, or another tool's that counts something else); the loader lets per_rank
    # list every rank once or none
    given = {int(_get(r, "rank")): r for r in _get(estimate, "per_rank") or []}
    ranks: list[RankView] = []
    for i, mem in enumerate(plan.memory_by_rank()):
        r = given.get(i)
        ranks.append(
            RankView(
                rank=i,
                time=None if r is None else float(_get(r, "time")),
                memory_bytes=mem,
                components=None if r is None else _components(_get(r, "components")),
            )
        )

    critical = _get(estimate, "critical_rank")
    if critical is None and any(r.time for r in ranks):
        critical = max(ranks, key=lambda r: (r.time or 0.0, -r.rank)).rank
    components = _components(_get(estimate, "components"))
    if components is None and critical is not None:
        components = ranks[int(critical)].components

    table_time: dict[str, float | None] = {}
    for entry in _get(estimate, "per_table") or []:
        got = _get(entry, "time")
        table_time[str(_get(entry, "table"))] = None if got is None else float(got)
    tables: dict[str, TableView] = {}
    for t in plan.tables:
        cluster = plan.cluster_of(t.name)
        time = table_time.get(t.name)
        cells = tuple(
            sorted(
                (s.row_shard, s.columns[0], s.columns[1], s.rank) for s in plan.shards_of(t.name)
            )
        )
        dp = cluster.kind == "dp"
        tables[t.name] = TableView(
            table=t.name,
            kind=cluster.kind,
            cluster=cluster.name,
            grid="replicated" if dp else _grid(plan, t.name),
            cells=cells,
            ranks=tuple(range(plan.world_size)) if dp else tuple(sorted({c[3] for c in cells})),
            time=time,
            memory_bytes=_table_memory(plan, t.name),
        )

    planner = _get(estimate, "planner") or plan.planner
    bound = _get(plan.planner, "bound")
    low = _get(plan.planner, "lower_bound")
    step = float(_get(estimate, "step_time"))
    it = iteration_of(plan)
    iteration = step + it.dense + it.dense_allreduce - it.hidden if it.known else None
    return PlanView(
        iteration=iteration,
        samples_per_second=plan.batch_size / iteration if iteration else None,
        step_time=step,
        critical_rank=None if critical is None else int(critical),
        components=components,
        peak_memory=max((r.memory_bytes for r in ranks), default=0),
        hbm_bytes=plan.topology.hbm_bytes,
        per_rank=tuple(ranks),
        tables=tables,
        cost_source=source,
        status=str(_get(planner, "status") or plan.planner.status),
        bound=None if bound is None else float(bound),
        lower_bound=None if low is None else float(low),
        critical_path=_critical_path(estimate, ranks),
    )


# --------------------------------------------------------------------------- the diff


class Change(_Frozen):
    """One number on both sides; `pct` is the relative change, None when A is 0 (and
    capped at +-MAX_PCT, so that a change from a tiny A stays a finite number)."""

    a: float | None
    b: float | None
    delta: float | None
    pct: float | None


MAX_PCT = 1e12
"""The largest relative change shown, in percent."""


def _change(a: float | None, b: float | None) -> Change:
    if a is None or b is None:
        return Change(a=a, b=b, delta=None, pct=None)
    delta = b - a
    pct = None
    if a:
        # both are bounded by the loader; only the ratio can overflow
        ratio = delta / a
        pct = round(max(-MAX_PCT, min(MAX_PCT, 100.0 * ratio)), 4)
    return Change(a=a, b=b, delta=delta, pct=pct)


def _same(a: float | None, b: float | None) -> bool:
    """Equal to the plan files' rounding (9 significant digits); a figure one side does
    not give is no difference."""
    if a is None or b is None:
        return True
    return math.isclose(a, b, rel_tol=1e-8, abs_tol=1e-15)


class Summary(_Frozen):
    step_time: Change
    peak_memory: Change
    hbm_bytes: Change
    critical_rank_a: int | None
    critical_rank_b: int | None
    components: dict[str, Change]
    """Per component, the time on each side's critical rank; empty when unknown."""
    cost_source_a: str
    cost_source_b: str
    status_a: str
    status_b: str
    bound: Change
    lower_bound: Change
    critical_path: Change
    iteration: Change
    samples_per_second: Change


class TableChange(_Frozen):
    table: str
    changed: tuple[str, ...]
    """What changed, of: cluster, grid, placement."""
    kind_a: str
    kind_b: str
    grid_a: str
    grid_b: str
    ranks_a: tuple[int, ...]
    ranks_b: tuple[int, ...]
    time: Change
    memory: Change


class TableDelta(_Frozen):
    """A table added, removed or resized (changed rows, dim, dtype or optimizer)."""

    table: str
    change: Literal["added", "removed", "resized"]
    fields: dict[str, tuple[str, str]]
    """field -> (A, B) as text; for added/removed the table's shape on its side."""
    kind: str
    memory: Change


class RankChange(_Frozen):
    rank: int
    time: Change
    memory: Change
    worse: bool
    """Time or memory grew on a rank both plans have (a rank only one has is not worse)."""


class SpecChange(_Frozen):
    what: str
    """table, feature, topology, model, options, constraint, colocate, batch."""
    name: str
    change: Literal["added", "removed", "changed"]
    fields: dict[str, tuple[str, str]]


class PlanDiff(_Frozen):
    format: str = DIFF_FORMAT
    version: int = DIFF_VERSION
    a: str
    b: str
    identical: bool
    verdict: str
    summary: Summary
    tables_changed: tuple[TableChange, ...]
    tables_delta: tuple[TableDelta, ...]
    ranks_changed: tuple[RankChange, ...]
    ranks_worse: int
    world_a: int
    world_b: int
    migration: Migration
    spec_changes: tuple[SpecChange, ...]
    spec_changes_from: Literal["specs", "plans"]
    """`specs` when both sides were specs; else the inputs recorded in the plans."""
    not_compared: dict[str, tuple[str, ...]] = {}
    """Side ("A", "B") -> the input fields the other plan records and this one does not
    (fields of embarkc's own in a plan of another tool): not compared. Left out of the
    JSON when empty."""


def _comparable(plan: Plan) -> dict[str, Any]:
    """A plan's content without the fields that change between identical runs."""
    data = plan.model_dump(mode="json", exclude_none=True)
    data.pop("source", None)
    data.get("planner", {}).pop("wall_time", None)
    return data


def _flat(value: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> text of every leaf, spans dropped (they move when text moves)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for k in sorted(value):
            if k == "span" or value[k] is None:
                continue
            out.update(_flat(value[k], f"{prefix}{k}."))
        return out
    if isinstance(value, list | tuple) and value and isinstance(value[0], dict | BaseModel):
        for i, v in enumerate(value):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    if isinstance(value, list | tuple):
        text = json.dumps(value, sort_keys=True)
    else:
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)  # a mean hotness of 30, not 30.0
        text = format_number(value) if isinstance(value, int | float) else str(value)
    out[prefix.rstrip(".")] = text
    return out


def _recorded(value: Any) -> Any:
    """What a plan file gives of `value` (a model read from a plan): the loader's defaults
    for fields the file does not have are left out, so they are not compared."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    return value


Lacking = dict[str, set[str]]
"""Side ("A", "B") -> the fields the other side records and this one does not."""


def _field_changes(
    a: Any, b: Any, lacking: Lacking | None = None, what: str = ""
) -> dict[str, tuple[str, str]]:
    """Fields whose text differs. With `lacking` (plans), a field one side does not record
    is no change: it is noted in `lacking` under `what`."""
    if lacking is None:
        fa, fb = _flat(a), _flat(b)
    else:
        fa, fb = _flat(_recorded(a)), _flat(_recorded(b))
        for side, mine, other in (("A", fa, fb), ("B", fb, fa)):
            for k in other.keys() - mine.keys():
                lacking.setdefault(side, set()).add(f"{what}.{_unindexed(k)}")
        keys = fa.keys() & fb.keys()
        fa = {k: v for k, v in fa.items() if k in keys}
        fb = {k: v for k, v in fb.items() if k in keys}
    return {
        k: (fa.get(k, "-"), fb.get(k, "-"))
        for k in sorted(set(fa) | set(fb))
        if fa.get(k) != fb.get(k)
    }


def _unindexed(key: str) -> str:
    """A dotted key without its list indices (`counts.3` -> `counts`)."""
    return ".".join(p for p in key.split(".") if not p.isdigit())


def _keyed_changes(
    what: str,
    a: dict[str, Any],
    b: dict[str, Any],
    order: list[str],
    lacking: Lacking | None = None,
) -> list[SpecChange]:
    out: list[SpecChange] = []
    for name in order:
        if name not in b:
            out.append(SpecChange(what=what, name=name, change="removed", fields={}))
        elif name not in a:
            got = b[name] if lacking is None else _recorded(b[name])
            out.append(
                SpecChange(
                    what=what,
                    name=name,
                    change="added",
                    fields={k: ("-", v) for k, v in _flat(got).items() if k != "name"},
                )
            )
        else:
            fields = _field_changes(a[name], b[name], lacking, what)
            if fields:
                out.append(SpecChange(what=what, name=name, change="changed", fields=fields))
    return out


def _order(a: list[str], b: list[str]) -> list[str]:
    return a + [n for n in b if n not in set(a)]


def spec_changes(a: Program, b: Program) -> list[SpecChange]:
    """Tables, features, topology, dense model, options, constraints and colocations that
    differ between two programs, in source order of A then B."""
    out = _keyed_changes(
        "table",
        {t.name: t for t in a.tables},
        {t.name: t for t in b.tables},
        _order([t.name for t in a.tables], [t.name for t in b.tables]),
    )
    out += _keyed_changes(
        "feature",
        {f.name: f for f in a.features},
        {f.name: f for f in b.features},
        _order([f.name for f in a.features], [f.name for f in b.features]),
    )
    for what, ma, mb in (
        ("topology", a.topology, b.topology),
        ("model", a.model, b.model),
        ("options", a.options, b.options),
    ):
        fields = _field_changes(ma, mb)
        if fields:
            out.append(SpecChange(what=what, name=what, change="changed", fields=fields))
    out += _keyed_changes(
        "constraint",
        {c.table: c for c in a.constraints},
        {c.table: c for c in b.constraints},
        _order([c.table for c in a.constraints], [c.table for c in b.constraints]),
    )
    ca = {",".join(c.tables): c for c in a.colocate}
    cb = {",".join(c.tables): c for c in b.colocate}
    out += _keyed_changes("colocate", ca, cb, _order(list(ca), list(cb)))
    return out


def plan_input_changes(a: Plan, b: Plan, lacking: Lacking | None = None) -> list[SpecChange]:
    """What both plans record of their inputs (topology, batch, features) and differs.

    A field only one plan records (a plan of another tool has none of embarkc's own, a
    plan of an older embarkc lacks the newer ones) is no change: it is added to
    `lacking`, under the side that lacks it. Tables are compared in the table sections,
    so they are not repeated here.
    """
    lacking = {} if lacking is None else lacking
    out: list[SpecChange] = []
    fields = _field_changes(a.topology, b.topology, lacking, "topology")
    if fields:
        out.append(SpecChange(what="topology", name="topology", change="changed", fields=fields))
    if a.batch_size != b.batch_size or a.row_partition != b.row_partition:
        out.append(
            SpecChange(
                what="batch",
                name="batch",
                change="changed",
                fields=_field_changes(
                    {"batch_size": a.batch_size, "row_partition": a.row_partition},
                    {"batch_size": b.batch_size, "row_partition": b.row_partition},
                ),
            )
        )
    out += _keyed_changes(
        "feature",
        {f.name: f for f in a.features},
        {f.name: f for f in b.features},
        _order([f.name for f in a.features], [f.name for f in b.features]),
        lacking,
    )
    return out


def _table_fields(plan: Plan, name: str) -> dict[str, str]:
    t = plan.table(name)
    return {"rows": str(t.rows), "dim": str(t.dim), "dtype": t.dtype, "optimizer": t.optimizer}


def _stale_sides(s: Summary) -> list[str]:
    return [n for n, src in (("A", s.cost_source_a), ("B", s.cost_source_b)) if src == "stale"]


def _verdict(s: Summary, migration: Migration, identical: bool) -> str:
    if identical:
        return "no changes"
    pct = s.step_time.pct
    ta, tb = fmt_time(s.step_time.a), fmt_time(s.step_time.b)
    stale = _stale_sides(s)
    if stale:
        head = (
            f"**step time not known**: plan {' and '.join(stale)} has a stale estimate "
            f"({ta} -> {tb} before the edit)"
        )
    elif pct is None and s.step_time.a == 0 and s.step_time.b:
        head = f"**slower** ({ta} -> {tb}: from nothing)"
    elif pct is None or abs(pct) < SAME_PCT:
        head = f"**same step time** ({ta} -> {tb})"
    elif pct > 0:
        head = f"**slower by {format_pct(pct)} %** ({ta} -> {tb})"
    else:
        head = f"**faster by {format_pct(-pct)} %** ({ta} -> {tb})"
    mp = s.peak_memory.pct
    mem = "unchanged" if mp is None or abs(mp) < SAME_PCT else f"{format_pct(mp, signed=True)} %"
    if mp is None and s.peak_memory.a == 0 and s.peak_memory.b:
        mem = f"from nothing to {fmt_bytes(s.peak_memory.b)}"
    moved = migration.total_bytes
    move = f"{fmt_bytes(moved)} to migrate" if moved else "nothing to migrate"
    return f"{head}, peak memory {mem}, {move}"


def diff_sides(a: Side, b: Side) -> PlanDiff:
    """Compare two sides; see the module docstring for where the costs come from.

    A plan file without our estimate fields is re-costed with the other side's program
    when that program has the same tables, features and cluster as the plan records.
    """
    prog_a = a.program
    prog_b = b.program
    if prog_a is None and prog_b is not None and _same_tables(a.plan, prog_b):
        prog_a = prog_b
    if prog_b is None and prog_a is not None and _same_tables(b.plan, prog_a):
        prog_b = prog_a
    if prog_a is None and _needs_costing(a.plan):
        prog_a = program_of_plan(a.plan, a.label)
    if prog_b is None and _needs_costing(b.plan):
        prog_b = program_of_plan(b.plan, b.label)
    va, vb = view_of(a.plan, prog_a), view_of(b.plan, prog_b)
    return diff_views(a.label, a.plan, va, b.label, b.plan, vb, a.program, b.program)


def _needs_costing(plan: Plan) -> bool:
    """Whether `plan`'s own estimate does not cost its layout (it lacks our fields or is
    stale), so that a view of it needs the program."""
    from embarkc.planner import estimate_is_stale

    return _lacks_our_fields(plan) or bool(estimate_is_stale(plan))


def program_of_plan(plan: Plan, plan_path: str | None = None) -> Program | None:
    """The program behind `plan` when the spec it names is there, unchanged (same
    sha256; looked for from the current folder, then from `plan_path`'s folder, as
    `embarkc check` does) and describes the inputs the plan records; None otherwise.
    Never raises: a spec that no longer loads is as good as a missing one."""
    from embarkc.frontend import find_plan_spec, load_program

    spec, state = find_plan_spec(plan, plan_path)
    if state != "unchanged":
        return None
    try:
        program = load_program(str(spec))
    except (OSError, EmbarkError):
        return None
    return program if _same_tables(plan, program) else None


def _same_tables(plan: Plan, program: Program) -> bool:
    """Whether `program` describes the inputs `plan` records (so it may re-cost it)."""
    topo = plan.topology
    return (
        [(t.name, t.rows, t.dim) for t in plan.tables]
        == [(t.name, t.rows, t.dim) for t in program.tables]
        and [(f.name, f.table, f.hotness) for f in plan.features]
        == [(f.name, f.table, f.hotness) for f in program.features]
        and (topo.nodes, topo.gpus_per_node, plan.batch_size)
        == (program.topology.nodes, program.topology.gpus_per_node, program.batch_size)
    )


def diff_views(
    label_a: str,
    plan_a: Plan,
    va: PlanView,
    label_b: str,
    plan_b: Plan,
    vb: PlanView,
    program_a: Program | None = None,
    program_b: Program | None = None,
) -> PlanDiff:
    """The comparison of two costed plans (and their programs when both are known)."""
    identical = _comparable(plan_a) == _comparable(plan_b)
    lacking: Lacking = {}
    if program_a is not None and program_b is not None:
        changes, changes_from = spec_changes(program_a, program_b), "specs"
        identical = identical and not changes
    else:
        changes, changes_from = plan_input_changes(plan_a, plan_b, lacking), "plans"

    comps: dict[str, Change] = {}
    if va.components is not None and vb.components is not None:
        comps = {k: _change(va.components[k], vb.components[k]) for k in COMPONENTS}
    summary = Summary(
        step_time=_change(va.step_time, vb.step_time),
        peak_memory=_change(va.peak_memory, vb.peak_memory),
        hbm_bytes=_change(va.hbm_bytes, vb.hbm_bytes),
        critical_rank_a=va.critical_rank,
        critical_rank_b=vb.critical_rank,
        components=comps,
        cost_source_a=va.cost_source,
        cost_source_b=vb.cost_source,
        status_a=va.status,
        status_b=vb.status,
        bound=_change(va.bound, vb.bound),
        lower_bound=_change(va.lower_bound, vb.lower_bound),
        critical_path=_change(va.critical_path, vb.critical_path),
        iteration=_change(va.iteration, vb.iteration),
        samples_per_second=_change(va.samples_per_second, vb.samples_per_second),
    )

    changed: list[TableChange] = []
    delta: list[TableDelta] = []
    for name, ta in va.tables.items():
        tb = vb.tables.get(name)
        if tb is None:
            delta.append(
                TableDelta(
                    table=name,
                    change="removed",
                    fields={k: (v, "-") for k, v in _table_fields(plan_a, name).items()},
                    kind=ta.kind,
                    memory=_change(ta.memory_bytes, 0),
                )
            )
            continue
        what = []
        if ta.kind != tb.kind:
            what.append("cluster")
        if ta.grid != tb.grid:
            what.append("grid")
        if ta.ranks != tb.ranks or (ta.cells != tb.cells and ta.grid == tb.grid):
            what.append("placement")
        if what:
            changed.append(
                TableChange(
                    table=name,
                    changed=tuple(what),
                    kind_a=ta.kind,
                    kind_b=tb.kind,
                    grid_a=ta.grid,
                    grid_b=tb.grid,
                    ranks_a=ta.ranks,
                    ranks_b=tb.ranks,
                    time=_change(ta.time, tb.time),
                    memory=_change(ta.memory_bytes, tb.memory_bytes),
                )
            )
        fa, fb = _table_fields(plan_a, name), _table_fields(plan_b, name)
        if fa != fb:
            delta.append(
                TableDelta(
                    table=name,
                    change="resized",
                    fields={k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]},
                    kind=tb.kind,
                    memory=_change(ta.memory_bytes, tb.memory_bytes),
                )
            )
    for name, tb in vb.tables.items():
        if name not in va.tables:
            delta.append(
                TableDelta(
                    table=name,
                    change="added",
                    fields={k: ("-", v) for k, v in _table_fields(plan_b, name).items()},
                    kind=tb.kind,
                    memory=_change(0, tb.memory_bytes),
                )
            )

    def weight(c: TableChange) -> tuple[float, float, str]:
        dt = abs(c.time.delta) if c.time.delta is not None else 0.0
        dm = abs(c.memory.delta) if c.memory.delta is not None else 0.0
        return (-dt, -dm, c.table)

    changed.sort(key=weight)

    ranks: list[RankChange] = []
    ra = {r.rank: r for r in va.per_rank}
    rb = {r.rank: r for r in vb.per_rank}
    for rank in range(max(len(va.per_rank), len(vb.per_rank))):
        x, y = ra.get(rank), rb.get(rank)
        time = _change(x.time if x else None, y.time if y else None)
        mem = _change(x.memory_bytes if x else None, y.memory_bytes if y else None)
        if x is not None and y is not None and _same(x.time, y.time) and not mem.delta:
            continue
        # a rank only one plan has is neither worse nor better (the title counts it apart)
        worse = False
        if x is not None and y is not None:
            slower = not _same(x.time, y.time) and (y.time or 0.0) > (x.time or 0.0)
            worse = slower or y.memory_bytes > x.memory_bytes
        ranks.append(RankChange(rank=rank, time=time, memory=mem, worse=worse))
    ranks.sort(
        key=lambda r: (
            not r.worse,
            -(r.time.delta if r.time.delta is not None else math.inf),
            r.rank,
        )
    )

    migration = migration_cost(plan_a, plan_b)
    return PlanDiff(
        a=label_a,
        b=label_b,
        identical=identical,
        verdict=_verdict(summary, migration, identical),
        summary=summary,
        tables_changed=tuple(changed),
        tables_delta=tuple(delta),
        ranks_changed=tuple(ranks),
        ranks_worse=sum(1 for r in ranks if r.worse),
        world_a=plan_a.world_size,
        world_b=plan_b.world_size,
        migration=migration,
        spec_changes=tuple(changes),
        spec_changes_from=changes_from,
        not_compared={side: tuple(sorted(names)) for side, names in sorted(lacking.items())},
    )


# --------------------------------------------------------------------------- gates


def gate_failures(
    d: PlanDiff, fail_if_slower: float | None, fail_if_memory_over: float | None
) -> list[str]:
    """Messages for every CI gate that B fails; empty when all pass.

    `fail_if_slower`: B's step time exceeds A's by more than this many percent.
    `fail_if_memory_over`: B's peak memory per GPU exceeds A's by more than this many
    percent. A side whose A value is 0 fails a gate whenever B's value is larger.
    """
    out = []
    stale = _stale_sides(d.summary)
    if fail_if_slower is not None and stale:
        # a gate on figures of another layout would pass or fail by accident
        out.append(
            f"the step time of plan {' and '.join(stale)} is not known (its estimate is "
            "stale and its spec was not found unchanged), so --fail-if-slower cannot judge it"
        )
        fail_if_slower = None
    for limit, change, what, fmt in (
        (fail_if_slower, d.summary.step_time, "step time", fmt_time),
        (fail_if_memory_over, d.summary.peak_memory, "peak memory", fmt_bytes),
    ):
        if limit is None or change.a is None or change.b is None:
            continue
        pct = change.pct
        exceeded = (change.b > change.a) if pct is None else pct > limit
        if exceeded:
            grown = "from 0" if pct is None else f"by {format_pct(pct)} %"
            out.append(
                f"{what} grew {grown} ({fmt(change.a)} -> {fmt(change.b)}), "
                f"more than the allowed {limit:g} %"
            )
    return out


# --------------------------------------------------------------------------- formatting


def fmt_time(seconds: float | None) -> str:
    """`format_seconds`, "-" for a figure one side lacks."""
    return "-" if seconds is None else format_seconds(seconds)


def fmt_rate(per_second: float | None) -> str:
    """Samples per second, grouped (`437,167/s`)."""
    return "-" if per_second is None else f"{per_second:,.0f}/s"


def fmt_bytes(n: float | None) -> str:
    """`format_bytes`, "-" for a figure one side lacks."""
    return "-" if n is None else format_bytes(n)


def fmt_pct(c: Change) -> str:
    if c.pct is None:
        if c.a is None or c.b is None:
            return "-"
        return "=" if c.a == c.b else "new"
    if abs(c.pct) < SAME_PCT:
        return "="
    return f"{format_pct(c.pct, signed=True)} %"


def _fmt_delta(c: Change, fmt: Any) -> str:
    if c.delta is None:
        return "new" if c.a is None and c.b is not None else "-"
    if c.delta == 0:
        return "="
    sign = "+" if c.delta > 0 else "-"
    return f"{sign}{fmt(abs(c.delta))}"


def _ranks_text(ranks: tuple[int, ...], limit: int = 8) -> str:
    """Compact rank list: runs collapsed (0-7,12), cut after `limit` runs."""
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    if len(runs) > limit:
        return ",".join(runs[:limit]) + f",... ({len(ranks)} ranks)"
    return ",".join(runs)


def _fields_text(fields: dict[str, tuple[str, str]], limit: int = 6) -> str:
    items = [
        f"{k} {b}" if a == "-" else f"{k} {a}" if b == "-" else f"{k} {a} -> {b}"
        for k, (a, b) in fields.items()
    ]
    if len(items) > limit:
        items = items[:limit] + [f"... ({len(fields) - limit} more)"]
    return ", ".join(items)


MD_ROWS = 15
"""Rows shown per markdown table (a PR comment stays short; JSON has everything)."""


def _md_table(head: list[str], rows: list[list[str]], total: int | None = None) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows[:MD_ROWS]]
    n = len(rows) if total is None else total
    if n > MD_ROWS:
        out.append(f"\n_{n - MD_ROWS} more not shown; `--format json` has all of them._")
    return out


def render_markdown(d: PlanDiff) -> str:
    """A compact pull-request comment: the verdict on the first line, then the details."""
    lines = [d.verdict, ""]
    if d.identical:
        lines.append(f"`{d.a}` and `{d.b}` plan the same thing.")
        return "\n".join(lines) + "\n"
    s = d.summary
    lines.append(f"A: `{d.a}`, B: `{d.b}`")
    lines.append("")
    rows = [
        [
            "embedding step time",
            fmt_time(s.step_time.a),
            fmt_time(s.step_time.b),
            fmt_pct(s.step_time),
        ],
        [
            "critical path (phases wait)",
            fmt_time(s.critical_path.a),
            fmt_time(s.critical_path.b),
            fmt_pct(s.critical_path),
        ],
        *(
            [
                [
                    "iteration (with the dense part)",
                    fmt_time(s.iteration.a),
                    fmt_time(s.iteration.b),
                    fmt_pct(s.iteration),
                ],
                [
                    "samples/s",
                    fmt_rate(s.samples_per_second.a),
                    fmt_rate(s.samples_per_second.b),
                    fmt_pct(s.samples_per_second),
                ],
            ]
            if s.iteration.a is not None or s.iteration.b is not None
            else []
        ),
        [
            "peak memory / GPU",
            fmt_bytes(s.peak_memory.a),
            fmt_bytes(s.peak_memory.b),
            fmt_pct(s.peak_memory),
        ],
        ["HBM / GPU", fmt_bytes(s.hbm_bytes.a), fmt_bytes(s.hbm_bytes.b), fmt_pct(s.hbm_bytes)],
        ["ranks", str(d.world_a), str(d.world_b), ""],
        ["critical rank", _opt(s.critical_rank_a), _opt(s.critical_rank_b), ""],
    ]
    for name, c in s.components.items():
        rows.append([f"&nbsp;&nbsp;{name}", fmt_time(c.a), fmt_time(c.b), fmt_pct(c)])
    if s.lower_bound.a is not None or s.lower_bound.b is not None:
        rows.append(
            ["lower bound (any plan)", fmt_time(s.lower_bound.a), fmt_time(s.lower_bound.b), ""]
        )
    if s.bound.a is not None or s.bound.b is not None:
        rows.append(["cp-sat bound (its last model)", fmt_time(s.bound.a), fmt_time(s.bound.b), ""])
    rows.append(["planner status", s.status_a, s.status_b, ""])
    lines += _md_table(["", "A", "B", "change"], rows)
    if {"contract", "stale"} & {s.cost_source_a, s.cost_source_b}:
        lines += ["", _cost_source_note(s)]

    if d.tables_changed:
        lines += ["", f"### Tables placed differently ({len(d.tables_changed)})", ""]
        lines += _md_table(
            ["table", "changed", "cluster", "grid", "ranks", "time", "memory"],
            [
                [
                    f"`{c.table}`",
                    ", ".join(c.changed),
                    _arrow(c.kind_a, c.kind_b),
                    _arrow(c.grid_a, c.grid_b),
                    _arrow(_ranks_text(c.ranks_a, 3), _ranks_text(c.ranks_b, 3)),
                    f"{fmt_time(c.time.a)} -> {fmt_time(c.time.b)}",
                    f"{fmt_bytes(c.memory.a)} -> {fmt_bytes(c.memory.b)}",
                ]
                for c in d.tables_changed
            ],
        )
    if d.tables_delta:
        lines += ["", f"### Tables added, removed or resized ({len(d.tables_delta)})", ""]
        lines += _md_table(
            ["table", "", "cluster", "what", "memory"],
            [
                [
                    f"`{t.table}`",
                    t.change,
                    t.kind,
                    _fields_text(t.fields),
                    _arrow(fmt_bytes(t.memory.a), fmt_bytes(t.memory.b)),
                ]
                for t in d.tables_delta
            ],
        )
    if d.ranks_changed:
        lines += ["", f"### {ranks_title(d)}", ""]
        lines += _md_table(
            ["rank", "time", "change", "memory", "change"],
            [
                [
                    str(r.rank),
                    _arrow(fmt_time(r.time.a), fmt_time(r.time.b)),
                    _fmt_delta(r.time, fmt_time),
                    _arrow(fmt_bytes(r.memory.a), fmt_bytes(r.memory.b)),
                    _fmt_delta(r.memory, fmt_bytes),
                ]
                for r in d.ranks_changed
            ],
        )
    lines += ["", "### Migration from a checkpoint of A", ""]
    lines += _migration_lines(d.migration)
    if d.spec_changes:
        title = (
            "Spec changes"
            if d.spec_changes_from == "specs"
            else "Input changes recorded in the plans"
        )
        lines += ["", f"### {title} ({len(d.spec_changes)})", ""]
        lines += [_spec_line(c) for c in d.spec_changes[:MD_ROWS]]
        if len(d.spec_changes) > MD_ROWS:
            lines.append(f"- ... {len(d.spec_changes) - MD_ROWS} more")
    lines += [f"\n_{line}_" for line in not_compared_lines(d)]
    return "\n".join(lines) + "\n"


def not_compared_lines(d: PlanDiff) -> list[str]:
    """One line per plan that lacks input fields the other records."""
    return [
        f"Plan {side} does not record {', '.join(names)} (fields of embarkc's own, or of a "
        "newer embarkc): they are not compared."
        for side, names in d.not_compared.items()
    ]


def ranks_title(d: PlanDiff) -> str:
    """The heading of the rank table: how many ranks it lists, of how many, and how each
    of them changed (the parts add up to the rows listed)."""
    counts = dict.fromkeys(("worse", "better", "the same to rounding", "only in B", "only in A"), 0)
    for r in d.ranks_changed:
        if r.memory.a is None:
            counts["only in B"] += 1
        elif r.memory.b is None:
            counts["only in A"] += 1
        elif r.worse:
            counts["worse"] += 1
        elif (r.memory.delta or 0) < 0 or (
            (r.time.delta or 0) < 0 and not _same(r.time.a, r.time.b)
        ):
            counts["better"] += 1
        else:
            counts["the same to rounding"] += 1
    parts = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    return f"Ranks: {len(d.ranks_changed)} of {max(d.world_a, d.world_b)} changed ({parts})"


def _opt(v: int | None) -> str:
    return "-" if v is None else str(v)


def _arrow(a: str, b: str) -> str:
    return a if a == b else f"{a} -> {b}"


def _cost_source_note(s: Summary) -> str:
    notes = []
    for kind, text in (
        (
            "contract",
            "carries only the contract's estimate and no spec was given to re-cost it: "
            "components and per-table costs are not shown.",
        ),
        (
            "stale",
            "was edited after embarkc costed it (its estimate is of another layout) and the "
            "spec it names (source.spec, relative to where it was planned; looked for from "
            "here and from the plan's folder) was not found unchanged to re-cost it: its "
            "times are those of the layout before the edit, its memory is exact. Run the diff "
            "where that spec is found to see the new costs.",
        ),
    ):
        sides = [n for n, src in (("A", s.cost_source_a), ("B", s.cost_source_b)) if src == kind]
        if sides:
            notes.append(f"_Plan {' and '.join(sides)} {text}_")
    return "\n".join(notes)


def _migration_lines(m: Migration) -> list[str]:
    if not m.total_bytes:
        out = ["Nothing moves between ranks."]
    else:
        out = [
            f"{fmt_bytes(m.total_bytes)} move between ranks ({fmt_bytes(m.weight_bytes)} weights, "
            f"{fmt_bytes(m.state_bytes)} optimizer state): {fmt_bytes(m.intra_node_bytes)} "
            f"inside nodes, {fmt_bytes(m.inter_node_bytes)} across nodes.",
        ]
        cross = [f for f in m.by_node if f.src != f.dst][:5]
        if cross:
            out.append(
                "Busiest node pairs: "
                + ", ".join(f"node {f.src} -> {f.dst} {fmt_bytes(f.bytes)}" for f in cross)
                + "."
            )
        top = m.by_table[:5]
        out.append(
            "Largest tables: " + ", ".join(f"`{t.table}` {fmt_bytes(t.bytes)}" for t in top) + "."
        )
    if m.fresh_tables:
        out.append(f"Start from their initialiser: {', '.join(f'`{t}`' for t in m.fresh_tables)}.")
    if m.fresh_state_tables:
        out.append(
            "Optimizer changed, state starts fresh: "
            + ", ".join(f"`{t}`" for t in m.fresh_state_tables)
            + "."
        )
    return out


def _spec_line(c: SpecChange) -> str:
    subject = c.what if c.name == c.what else f"{c.what} `{c.name}`"
    if c.change == "removed":
        return f"- {subject} removed"
    text = _fields_text(c.fields)
    return f"- {subject} {c.change}" + (f": {text}" if text else "")


def render_json(d: PlanDiff) -> str:
    """The whole diff as deterministic JSON (sorted keys, newline at the end)."""
    data = d.model_dump(mode="json")
    data["migration"]["total_bytes"] = d.migration.total_bytes
    if not d.not_compared:
        del data["not_compared"]
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def render_terminal(d: PlanDiff, console: Any) -> None:
    """Print the diff with rich tables on `console` (colour only when it is a terminal)."""
    from rich.table import Table
    from rich.text import Text

    def coloured(c: Change, text: str, worse_when_up: bool = True) -> Text:
        if c.delta is None or c.delta == 0 or (c.pct is not None and abs(c.pct) < SAME_PCT):
            return Text(text)
        up = c.delta > 0
        return Text(text, style="red" if up == worse_when_up else "green")

    verdict = d.verdict.replace("**", "")
    console.print(Text(verdict, style="bold"))
    if d.identical:
        return
    console.print(f"A: {d.a}\nB: {d.b}")
    s = d.summary
    t = Table(title="Predicted step", title_justify="left")
    for h in ("", "A", "B", "change"):
        t.add_column(h, justify="right" if h else "left")
    t.add_row(
        "embedding step time",
        fmt_time(s.step_time.a),
        fmt_time(s.step_time.b),
        coloured(s.step_time, fmt_pct(s.step_time)),
    )
    t.add_row(
        "critical path (phases wait)",
        fmt_time(s.critical_path.a),
        fmt_time(s.critical_path.b),
        coloured(s.critical_path, fmt_pct(s.critical_path)),
    )
    if s.iteration.a is not None or s.iteration.b is not None:
        t.add_row(
            "iteration (with the dense part)",
            fmt_time(s.iteration.a),
            fmt_time(s.iteration.b),
            coloured(s.iteration, fmt_pct(s.iteration)),
        )
        t.add_row(
            "samples/s",
            fmt_rate(s.samples_per_second.a),
            fmt_rate(s.samples_per_second.b),
            fmt_pct(s.samples_per_second),
        )
    t.add_row(
        "peak memory / GPU",
        fmt_bytes(s.peak_memory.a),
        fmt_bytes(s.peak_memory.b),
        coloured(s.peak_memory, fmt_pct(s.peak_memory)),
    )
    t.add_row("HBM / GPU", fmt_bytes(s.hbm_bytes.a), fmt_bytes(s.hbm_bytes.b), fmt_pct(s.hbm_bytes))
    t.add_row("ranks", str(d.world_a), str(d.world_b), "")
    t.add_row("critical rank", _opt(s.critical_rank_a), _opt(s.critical_rank_b), "")
    for name, c in s.components.items():
        t.add_row(f"  {name}", fmt_time(c.a), fmt_time(c.b), coloured(c, fmt_pct(c)))
    if s.lower_bound.a is not None or s.lower_bound.b is not None:
        t.add_row(
            "lower bound (any plan)", fmt_time(s.lower_bound.a), fmt_time(s.lower_bound.b), ""
        )
    if s.bound.a is not None or s.bound.b is not None:
        t.add_row("cp-sat bound (its last model)", fmt_time(s.bound.a), fmt_time(s.bound.b), "")
    t.add_row("planner status", s.status_a, s.status_b, "")
    console.print(t)
    if {"contract", "stale"} & {s.cost_source_a, s.cost_source_b}:
        for note in _cost_source_note(s).splitlines():
            console.print(note.strip("_"))

    if d.tables_changed:
        t = Table(
            title=f"Tables placed differently ({len(d.tables_changed)})", title_justify="left"
        )
        for h in (
            "table",
            "changed",
            "cluster",
            "grid",
            "ranks",
            "time A",
            "time B",
            "memory A",
            "memory B",
        ):
            t.add_column(h)
        for tc in d.tables_changed:
            t.add_row(
                tc.table,
                ", ".join(tc.changed),
                _arrow(tc.kind_a, tc.kind_b),
                _arrow(tc.grid_a, tc.grid_b),
                _arrow(_ranks_text(tc.ranks_a, 3), _ranks_text(tc.ranks_b, 3)),
                fmt_time(tc.time.a),
                coloured(tc.time, fmt_time(tc.time.b)),
                fmt_bytes(tc.memory.a),
                coloured(tc.memory, fmt_bytes(tc.memory.b)),
            )
        console.print(t)
    if d.tables_delta:
        t = Table(title="Tables added, removed or resized", title_justify="left")
        for h in ("table", "", "cluster", "what", "memory"):
            t.add_column(h)
        for x in d.tables_delta:
            t.add_row(
                x.table,
                x.change,
                x.kind,
                _fields_text(x.fields),
                _arrow(fmt_bytes(x.memory.a), fmt_bytes(x.memory.b)),
            )
        console.print(t)
    if d.ranks_changed:
        t = Table(title=ranks_title(d), title_justify="left")
        for h in ("rank", "time A", "time B", "memory A", "memory B"):
            t.add_column(h, justify="right")
        for r in d.ranks_changed[:30]:
            t.add_row(
                str(r.rank),
                fmt_time(r.time.a),
                coloured(r.time, fmt_time(r.time.b)),
                fmt_bytes(r.memory.a),
                coloured(r.memory, fmt_bytes(r.memory.b)),
            )
        console.print(t)
        if len(d.ranks_changed) > 30:
            console.print(f"... {len(d.ranks_changed) - 30} more ranks changed (--format json)")
    console.print(Text("Migration from a checkpoint of A", style="bold"))
    for line in _migration_lines(d.migration):
        console.print(line.replace("`", ""))
    if d.spec_changes:
        title = (
            "Spec changes"
            if d.spec_changes_from == "specs"
            else "Input changes recorded in the plans"
        )
        console.print(Text(title, style="bold"))
        for sc in d.spec_changes:
            console.print(_spec_line(sc).replace("`", ""))
    for line in not_compared_lines(d):
        console.print(line)


def plan_error_to_embark(e: PlanError) -> EmbarkError:
    """A PlanError as the user-facing error type, hinting at what to do."""
    hint = None
    if e.rule == "version":
        hint = "re-plan the spec with this embarkc (`embarkc plan SPEC -o plan.json`)"
    elif e.rule in ("json", "format", "schema"):
        hint = "is this an embark plan file (`embarkc plan` writes one)?"
    return EmbarkError.at(e.path, f"invalid plan ({e.rule}): {e.message}", hint)
