"""What a plan looks like to a reviewer: `view_of(plan, program) -> PlanView`.

A `PlanView` holds the figures `embarkc diff` and `embarkc report` read, whatever wrote
the plan. The costs come from the plan's own estimate fields when embarkc wrote it
(estimate.critical_rank, components, per_rank[].components, per_table). A plan from an
outside tool carries only the contract fields; it is re-costed with the project's cost
model when its program is known, else the view holds what the contract gives (step time,
per-rank time) and says so (`cost_source`). A plan whose layout or estimate was edited
after embarkc wrote it (`estimate.layout_sha256` or `figures_sha256` no longer matches)
is re-costed the same way; without its program its stale figures are kept, marked
"stale". Memory, per rank and per table, is always counted from the cells (exact,
whatever an estimate says).

Torch-free, and deterministic: the same plan gives the same view.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from embark_runtime.plan import Plan
from embarkc.dense import iteration_of
from embarkc.ir import Program

COMPONENTS = ("lookup", "distributor", "nvlink", "network", "dp_exchange")
"""Components of a rank's step time (docs/communication.md), in display order."""


class Frozen(BaseModel):
    """The base of every review model: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class RankView(Frozen):
    rank: int
    time: float | None
    """Seconds per step; None when the plan gives no per-rank estimate."""
    memory_bytes: int
    """Weights and optimizer state, counted from the cells (whatever the estimate says)."""
    components: dict[str, float] | None = None


class TableView(Frozen):
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


class PlanView(Frozen):
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
    """Row shards x column shards ("4x2"), followed by where the cells live when some are
    in host memory ("4x2 host 3/8, cache 64 rows"): a change of tier or cache is a change
    of the table's layout to a reviewer. A table all in HBM reads as before tiers existed."""
    cells = plan.shards_of(table)
    r = cells[0].row_shards
    splits = sorted({sum(1 for c in cells if c.row_shard == j) for j in range(r)})
    cols = str(splits[0]) if len(splits) == 1 else f"{splits[0]}-{splits[-1]}"
    return f"{r}x{cols}" + _storage(cells)


def _storage(cells: list[Any]) -> str:
    """ " host K/N, cache C rows" (or "caches A-B rows") for cells in host memory; ""."""
    host = [c for c in cells if c.on_host]
    if not host:
        return ""
    caches = sorted({c.cache_rows or 0 for c in host})
    cache = (
        f"cache {caches[0]:,} rows"
        if len(caches) == 1
        else f"caches {caches[0]:,}-{caches[-1]:,} rows"
    )
    return f" host {len(host)}/{len(cells)}, {cache}"


def _table_memory(plan: Plan, table: str) -> int:
    """Weights and optimizer state the table's cells hold in HBM (a host-tier cell: its
    cache, as `Plan.memory_by_rank` counts it); one copy of a dp table (as the planner's
    estimate.per_table counts it)."""
    t = plan.table(table)
    if plan.cluster_of(table).kind == "dp":
        return t.bytes_for(t.rows, t.dim)
    return sum(t.bytes_for(plan.cell_hbm_rows(s), s.width) for s in plan.shards_of(table))


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


def lacks_our_fields(plan: Plan) -> bool:
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
    lacks = lacks_our_fields(plan)
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


def needs_costing(plan: Plan) -> bool:
    """Whether `plan`'s own estimate does not cost its layout (it lacks our fields or is
    stale), so that a view of it needs the program."""
    from embarkc.planner import estimate_is_stale

    return lacks_our_fields(plan) or bool(estimate_is_stale(plan))
