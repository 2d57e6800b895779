"""The comparison of two plan views: `diff_views(...) -> PlanDiff`, and the CI gates.

Plans' inputs (topology, features) are compared where both plans record a field: a
field only one of them gives (embarkc's own, absent from another tool's plan) is listed
once as not compared, and the loader's default for it is never shown as a change. Ranks
differ when their memory does or their times differ beyond the files' rounding. Changes
are ordered most important first; the verdict is the one line a reviewer reads.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel

from embark_runtime.formatting import format_number, format_pct
from embark_runtime.plan import Plan
from embarkc.ir import Program
from embarkc.migration import Migration, migration_cost
from embarkc.review.text import fmt_bytes, fmt_time
from embarkc.review.views import COMPONENTS, Frozen, PlanView

SAME_PCT = 0.05
"""Relative changes below this many percent read as "same" in the verdict."""

DIFF_FORMAT = "embark-diff"
DIFF_VERSION = 1


class Change(Frozen):
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


def same_to_rounding(a: float | None, b: float | None) -> bool:
    """Equal to the plan files' rounding (9 significant digits); a figure one side does
    not give is no difference."""
    if a is None or b is None:
        return True
    return math.isclose(a, b, rel_tol=1e-8, abs_tol=1e-15)


class Summary(Frozen):
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


class TableChange(Frozen):
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


class TableDelta(Frozen):
    """A table added, removed or resized (changed rows, dim, dtype or optimizer)."""

    table: str
    change: Literal["added", "removed", "resized"]
    fields: dict[str, tuple[str, str]]
    """field -> (A, B) as text; for added/removed the table's shape on its side."""
    kind: str
    memory: Change


class RankChange(Frozen):
    rank: int
    time: Change
    memory: Change
    worse: bool
    """Time or memory grew on a rank both plans have (a rank only one has is not worse)."""


class SpecChange(Frozen):
    what: str
    """table, feature, topology, model, options, constraint, colocate, batch."""
    name: str
    change: Literal["added", "removed", "changed"]
    fields: dict[str, tuple[str, str]]


class PlanDiff(Frozen):
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
    host = migration.host_hbm.total_bytes if migration.host_hbm is not None else 0
    if host:
        move += f", {fmt_bytes(host)} host <-> HBM"
    return f"{head}, peak memory {mem}, {move}"


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
        if x is not None and y is not None and same_to_rounding(x.time, y.time) and not mem.delta:
            continue
        # a rank only one plan has is neither worse nor better (the title counts it apart)
        worse = False
        if x is not None and y is not None:
            slower = not same_to_rounding(x.time, y.time) and (y.time or 0.0) > (x.time or 0.0)
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
