"""The planner: IR `Program` -> `embark_runtime.plan.Plan`.

    plan_program(program, strategy=, solver=, time_limit=, seed=, progress=) -> Plan
    ignored_constraints(program, plan) -> warnings for what a fixed strategy left out
    warn_ignored_constraints(program, plan): print them (commands that plan a spec)

Stages (each a plain function): `clusters` (units, allowed kinds, starting kinds),
`greedy` (EMBark's greedy placement and splitting), `cpsat` (OR-tools refinement of the
greedy placement), `baselines` (fixed strategies for comparison); `cost.CostModel` costs
any layout or plan. `build_plan` turns a layout into the plan file's model, with every
float rounded to 9 significant digits so that the same inputs give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from embark_runtime.plan import Plan, PlanError, dumps_plan, parse_plan, validate_rules
from embarkc.diagnostics import Diagnostic, EmbarkError, Span
from embarkc.ir import Program, without_spans
from embarkc.planner.types import Layout

if TYPE_CHECKING:
    from embarkc.planner.cost import CostModel
    from embarkc.planner.greedy import FixedStart, GreedyResult

__all__ = [
    "plan_program",
    "build_plan",
    "plan_to_json",
    "round9",
    "ignored_constraints",
    "warn_ignored_constraints",
    "layout_digest",
    "estimate_is_stale",
    "layout_is_stale",
    "figures_digest",
    "stale_reason",
    "fixed_plan",
]

REFINE_SHARE = 0.7
"""Most of the time limit that CP-SAT's refinement gets (its own deterministic count of
work, see cpsat.py). It gets less where the greedy's work (`greedy.work_seconds`), a
second phase pass as long as the greedy's and the rest of the command (REST_SECONDS)
would leave less. The greedy itself stops its search where the limit ends
(`greedy_budget`). So the whole plan command stays within its limit on the development
machine (down to the placement of the greedy's first start), and every budget being a
deterministic count, the same spec and limit give the same plan on any machine."""

MAX_PLANNED_GPUS = 1 << 17
"""The largest cluster the planner plans (131,072 GPUs): it keeps a few numbers per rank
and unit, and plans 65,536 GPUs in about 8 s and 0.5 GB here; twice the limit takes
twice that and a plan file of 50 MB. The language allows clusters up to 2^26 GPUs."""

REST_SECONDS = 0.45
REST_SECONDS_PER_TABLE = 1e-3
REST_SECONDS_PER_SIGNATURE = 1.3e-3
REST_SHARE = 0.1
"""The wall time the plan command spends besides the greedy's search, the refinement and
the baselines, from the process's start to its exit: starting Python and importing
embarkc (0.3 s); per table reading the spec, the estimate, the checker, writing the plan
and its summary; per distinct table signature (`TableFacts.signature`: tables of equal
costs share them) the access statistics, each unit's starting kinds and the lower bound.
Counted as REST_SECONDS plus REST_SECONDS_PER_TABLE a table plus
REST_SECONDS_PER_SIGNATURE a signature plus REST_SHARE of the greedy's work.

Measured from `/proc/self/stat`'s start to the exit at 0.52 s on T180 (177 tables) and
0.64 s on T510 (510) at 16 x 8 GPUs, about 0.45 s on small specs. On 5,000 generated
tables on 1,024 GPUs (5,000 signatures), 2026-12-03: reading the spec 1.9-2.3 s, building,
checking and writing the plan 1.7-2 s (0.8 ms a table); the statistics and starting kinds
of both ub communications 3.7-4.4 s and the bound 1.8-2.8 s (1.1-1.4 ms a signature), on
the AMD EPYC development VM whose speed varies by a quarter from one hour to the next. The
counted rest is a little more, for a margin: with REST_SECONDS 0.35, T180 at
`--time-limit 2` took 2.01 s."""

BASELINE_SECONDS_PER_TABLE = 2.8e-3
BASELINE_SECONDS_PER_HEAD = 8e-3
"""CPU seconds of the fixed strategies' step times (`baselines.baseline_times`, five
layouts costed from scratch), which the plan command records: per table, and per exact
head that the row-split strategies compute for each distinct table signature (`HEAD_RANKS`
zipf ranks, fewer for a table of fewer rows: `cost.head_weight` counts them in whole
heads; beyond the 1,024 heads their cache holds, table-row-wise computes them again).
Measured 1.42-1.52 s for T510's 510 tables (6.0 heads), 0.34-0.46 s for T180's 177 (9.3)
and T200's 200 (9.5), 0.05-0.16 s for DCNv2's 26 (9.8), 5.8-6.0 s for 1,000 generated
tables on 256 GPUs (670 heads) and 40-44 s for 5,000 on 1,024 GPUs (3,348; row-wise 23-27
s of it, found not to fit only once costed), AMD EPYC development VM, 2026-12-03.
Reserved from the limit of every search (`plan_program`) where they fit in it
(`baselines_fit`), so that a plan does not depend on whether its caller records them."""

BASELINE_SHARE = 0.5
"""Most of the limit (less the rest of the command) that the baselines may take: with a
shorter limit the search keeps the time and the plan records no baselines (T510 at 2 s:
they would take 1.4 s of it)."""


def _fixed_rest(n_tables: int, signatures: int) -> float:
    return (
        REST_SECONDS + REST_SECONDS_PER_TABLE * n_tables + REST_SECONDS_PER_SIGNATURE * signatures
    )


def baseline_seconds(n_tables: int, heads: float = 0.0) -> float:
    """The fixed strategies' time for `n_tables` tables whose signatures make `heads`
    exact heads (`cost.head_weight`)."""
    return BASELINE_SECONDS_PER_TABLE * n_tables + BASELINE_SECONDS_PER_HEAD * heads


def baselines_fit(
    time_limit: float, n_tables: int, signatures: int = 0, heads: float = 0.0
) -> bool:
    """Whether the baselines' time of `n_tables` tables (of `signatures` distinct
    signatures making `heads` exact heads) fits in `time_limit` (BASELINE_SHARE of it,
    less the rest of the command)."""
    need = baseline_seconds(n_tables, heads)
    return need <= BASELINE_SHARE * (time_limit - _fixed_rest(n_tables, signatures))


def baselines_limit(n_tables: int, signatures: int = 0, heads: float = 0.0) -> int:
    """The least whole number of seconds of limit in which the baselines fit."""
    need = baseline_seconds(n_tables, heads)
    return math.ceil(_fixed_rest(n_tables, signatures) + need / BASELINE_SHARE)


def command_reserve(
    time_limit: float, n_tables: int, signatures: int = 0, heads: float = 0.0
) -> float:
    """Seconds of the limit kept from the searches besides REST_SECONDS and REST_SHARE of
    the greedy's work: the rest per table and per signature, and the baselines' time
    where they fit."""
    reserve = REST_SECONDS_PER_TABLE * n_tables + REST_SECONDS_PER_SIGNATURE * signatures
    if baselines_fit(time_limit, n_tables, signatures, heads):
        reserve += baseline_seconds(n_tables, heads)
    return reserve


def round9(x: Any) -> Any:
    """Round every float inside `x` to 9 significant digits (ints and others unchanged)."""
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, dict):
        return {k: round9(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [round9(v) for v in x]
    return x


def _access(a: Any) -> dict[str, Any]:
    if a.kind == "uniform":
        return {"kind": "uniform"}
    if a.kind == "zipf":
        return {"kind": "zipf", "alpha": a.alpha, "permuted": a.permuted}
    return {"kind": "histogram", "keys": list(a.keys), "counts": list(a.counts)}


def build_plan(
    program: Program,
    layout: Layout,
    planner: dict[str, Any],
    estimate: dict[str, Any] | None = None,
) -> Plan:
    """The plan file of `layout` (estimate computed by the cost model unless given)."""
    from embarkc.planner.cost import CostModel

    spec = program.sources[0].path
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError:
        raise EmbarkError.at(
            spec.encode("utf-8", "backslashreplace").decode("utf-8"),
            "the spec's file name is not UTF-8 text: a plan records it in `source.spec`, "
            "and a plan file is JSON, which holds only text",
            hint="rename the spec",
        ) from None
    topo = program.topology
    if estimate is None:
        estimate = CostModel(program).evaluate_layout(layout)
    tables = []
    for t in program.tables:
        o = t.optimizer
        tables.append(
            {
                "name": t.name,
                "rows": t.rows,
                "dim": t.dim,
                "dtype": t.dtype,
                "optimizer": o.kind,
                "optimizer_params": {
                    "lr": o.lr,
                    "eps": o.eps,
                    "initial_accumulator": o.initial_accumulator,
                    "beta1": o.beta1,
                    "beta2": o.beta2,
                    "weight_decay": o.weight_decay,
                    # only when set: the plans of specs without schedules stay as they were
                    **({"schedule": o.schedule.runtime().model_dump()} if o.schedule else {}),
                },
                "init": without_spans(t.init.model_dump()),
            }
        )
    features = [
        {
            "name": f.name,
            "table": f.table,
            "hotness": f.hotness,
            "pooling": f.pooling,
            "access": _access(f.access),
            "max_hotness": f.max_hotness,
            "fixed": f.fixed,
            "weighted": f.weighted,
        }
        for f in program.features
    ]
    order = {t.name: i for i, t in enumerate(program.tables)}
    groups: dict[tuple[str, str], list[str]] = {}
    for name in sorted(layout, key=lambda n: order[n]):
        p = layout[name]
        key: tuple[str, str]
        if p.kind == "dp":
            key = ("dp", p.exchange)
        elif p.kind == "rb":
            key = ("rb", p.communication)
        else:
            key = ("ub", "hierarchical" if p.node_dedup else "")
        groups.setdefault(key, []).append(name)
    clusters: list[dict[str, Any]] = []
    counters: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (("dp", "rb", "ub").index(k[0]), k[1])):
        kind, sub = key
        i = counters.get(kind, 0)
        counters[kind] = i + 1
        c: dict[str, Any] = {"name": f"{kind}{i}", "kind": kind, "tables": groups[key]}
        if kind == "rb" or sub == "hierarchical":
            c["communication"] = sub
        if kind == "dp":
            c["gradient_exchange"] = sub
        clusters.append(c)
    names = {t: c["name"] for c in clusters for t in c["tables"]}
    estimate = dict(estimate)
    estimate["per_table"] = [
        {**row, "cluster": names[row["table"]]} for row in estimate.get("per_table", [])
    ]
    shards = []
    for name in sorted(layout, key=lambda n: order[n]):
        p = layout[name]
        if p.kind == "dp":
            continue
        for j, lo, hi, rank in p.cell_list():
            shards.append(
                {
                    "table": name,
                    "row_shard": j,
                    "row_shards": p.row_shards,
                    "columns": [lo, hi],
                    "rank": rank,
                }
            )
    data = {
        "format": "embark-plan",
        "version": 1,
        "source": {"spec": program.sources[0].path, "sha256": program.sources[0].sha256},
        "topology": {
            "nodes": topo.nodes,
            "gpus_per_node": topo.gpus_per_node,
            "hbm_bytes": topo.hbm_bytes,
            "hbm_bandwidth": topo.hbm_bandwidth,
            "intra_node_bandwidth": topo.intra_node_bandwidth,
            "inter_node_bandwidth": topo.inter_node_bandwidth,
            "dense_flops": topo.dense_flops,
            "arch": topo.arch,
            # only when the spec sets any: a plan of the default constants reads as before
            **({"constants": dict(topo.constants)} if topo.constants else {}),
        },
        "batch_size": program.batch_size,
        "tables": tables,
        "features": features,
        "row_partition": program.options.row_partition,
        "clusters": clusters,
        "shards": shards,
        "estimate": estimate,
        "planner": planner,
        "model": without_spans(program.model.model_dump(mode="json")),
        "seed": program.options.seed,
    }
    return _plan_of(program, data, stamp=True)


def _plan_of(program: Program, data: dict[str, Any], stamp: bool) -> Plan:
    """The Plan of the plan file's fields `data` for `program`, held to the rules and to
    every bound a plan file is read with; `stamp`: its estimate gets the digests of the
    layout it costs and of its own figures."""
    try:
        plan = Plan.model_validate(round9(data))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise _beyond_plan_files(program, f"field `{where}`: {err['msg']}") from None
    validate_rules(plan, program.sources[0].path)
    if stamp:
        # the estimate names the layout it costs and its own figures, so that an edit of
        # either shows (`figures_digest` leaves the digests out)
        digests = {"layout_sha256": layout_digest(plan), "figures_sha256": figures_digest(plan)}
        plan = plan.model_copy(update={"estimate": plan.estimate.model_copy(update=digests)})
    try:
        # every bound a plan file is read with (its fields of our own too): the planner
        # never writes a plan that the commands reading it refuse
        parse_plan(dumps_plan(plan), program.sources[0].path)
    except PlanError as e:
        raise _beyond_plan_files(program, e.message) from None
    return plan


def adopt_plan(program: Program, plan: Plan, recost: bool) -> Plan:
    """`plan`, which the checker found to describe `program`, as the plan of `program`'s
    spec: its `source` names that spec, and with `recost` its estimate is the cost
    model's for its layout (a plan edited by hand, or from another tool), with the
    digests that say so. Clusters, shards and the planner's record stay as they are."""
    from embark_runtime.plan import plan_to_dict
    from embarkc.planner.cost import CostModel

    data = plan_to_dict(plan)
    source = program.sources[0]
    data["source"] = {"spec": source.path, "sha256": source.sha256}
    if recost:
        data["estimate"] = CostModel(program).evaluate(plan)
    return _plan_of(program, data, stamp=recost)


def _beyond_plan_files(program: Program, what: str) -> EmbarkError:
    """The error of a spec whose plan breaks a bound of plan files (embark_runtime.plan:
    a step of more than MAX_SECONDS, say), which the commands reading it would refuse."""
    return EmbarkError.at(
        program.sources[0].path,
        f"the plan of this spec breaks a bound of plan files ({what})",
        hint="its numbers are beyond any training run (a step of days, say): check the "
        "hardware's bandwidths and the sizes",
    )


def layout_digest(plan: Plan) -> str:
    """sha256 of what the estimate depends on besides the spec: the row partition, the
    clusters (kind, communication, gradient exchange, tables) and every cell."""
    import hashlib
    import json

    clusters = [
        [c.name, c.kind, c.communication, getattr(c, "gradient_exchange", None), list(c.tables)]
        for c in plan.clusters
    ]
    shards = sorted(
        [s.table, s.row_shard, s.row_shards, s.columns[0], s.columns[1], s.rank]
        for s in plan.shards
    )
    text = json.dumps([plan.row_partition, clusters, shards], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


DIGESTS = ("layout_sha256", "figures_sha256")
"""The estimate's own digests, left out of `figures_digest`."""


def figures_digest(plan: Plan) -> str:
    """sha256 of the estimate's figures as the plan file holds them (every field of
    `estimate` but its digests): a hand edit of a time or a size no longer matches."""
    import hashlib
    import json

    from embark_runtime.plan import plan_to_dict

    est = {k: v for k, v in plan_to_dict(plan)["estimate"].items() if k not in DIGESTS}
    text = json.dumps(est, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def layout_is_stale(plan: Plan) -> bool | None:
    """Whether the plan's layout changed after embarkc costed it (None: the estimate does
    not say which layout it costs, e.g. a plan from another tool)."""
    recorded = (plan.estimate.model_extra or {}).get("layout_sha256")
    if recorded is None:
        return None
    return bool(recorded != layout_digest(plan))


def stale_reason(plan: Plan) -> str | None:
    """Why the plan's estimate is not embarkc's for its layout: its layout or its figures
    were edited after embarkc wrote it (None: neither, or the estimate does not say which
    layout it costs, e.g. a plan from another tool; a plan of an embarkc before
    `figures_sha256` is judged by its layout alone)."""
    layout = layout_is_stale(plan)
    if layout is None:
        return None
    if layout:
        return "the layout was edited after embarkc costed it"
    figures = (plan.estimate.model_extra or {}).get("figures_sha256")
    if figures is not None and figures != figures_digest(plan):
        return "the estimate's figures were edited after embarkc wrote them"
    return None


def estimate_is_stale(plan: Plan) -> bool | None:
    """Whether the plan's estimate no longer costs it as embarkc did (`stale_reason`);
    None: the estimate does not say which layout it costs (a plan from another tool)."""
    if layout_is_stale(plan) is None:
        return None
    return stale_reason(plan) is not None


def plan_to_json(plan: Plan) -> str:
    """The deterministic text of a plan (same as `embark_runtime.plan.dumps_plan`)."""
    return dumps_plan(plan)


def ignored_constraints(program: Program, plan: Plan) -> list[Diagnostic]:
    """A warning, at the constraint in the spec, for every constraint of the spec that
    `plan`'s fixed strategy does not honour (none for the search: it honours them all)."""
    from embarkc.planner.check import constraint_violations

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
    from embarkc.diagnostics import print_warnings

    print_warnings(ignored_constraints(program, plan))


def check_against_spec(program: Program, plan: Plan, path: str, *, estimate: bool = True) -> None:
    """Hold `plan`, read from a file, to every rule of the checker against `program`
    (`check.check_plan`, every field the spec determines given): the spec's placement
    constraints are rules for a search's plan, and warnings for a fixed strategy's, which
    ignores them by design (`embarkc check`, `compile --plan`)."""
    from embarkc.planner.check import check_plan

    fixed = plan.planner.strategy not in ("embark", "greedy")
    check_plan(program, plan, path, constraints=not fixed, estimate=estimate, complete=True)
    if fixed:
        warn_ignored_constraints(program, plan)


def _rest(greedy_work: float, reserve: float) -> float:
    return REST_SECONDS + REST_SHARE * greedy_work + reserve


def greedy_budget(time_limit: float, reserve: float = 0.0) -> float:
    """The work (`greedy.work_seconds`) the greedy may take within `time_limit`: all of it
    but the rest of the command (REST_SECONDS, REST_SHARE of its work and `reserve`
    seconds for what the command does besides, the baselines')."""
    return (time_limit - REST_SECONDS - reserve) / (1.0 + REST_SHARE)


def refine_budget(
    time_limit: float, greedy_work: float, phase_work: float, reserve: float = 0.0
) -> float:
    """Seconds of CP-SAT's deterministic work that `time_limit` leaves after a greedy of
    `greedy_work` (`greedy.work_seconds`), a phase pass of `phase_work` on CP-SAT's
    layout and the rest of the command (`reserve` as for `greedy_budget`), at most
    REFINE_SHARE of the limit; 0 or less: none."""
    return min(
        time_limit * REFINE_SHARE,
        time_limit - greedy_work - phase_work - _rest(greedy_work, reserve),
    )


def no_refine_message(g: GreedyResult, time_limit: float, budget: float) -> str:
    """What the plan says when the greedy `g` left CP-SAT no `budget`
    of `time_limit`, with the limit that would refine when the greedy was not cut."""
    cut = ", its search cut short by the limit" if g.stopped else ""
    msg = (
        f"the greedy's work (about {g.work:.1f} s{cut}) left nothing of the "
        f"{time_limit:g} s time limit for CP-SAT"
    )
    if g.stopped:
        return msg + ": a longer limit gives both more"
    return msg + f"; a limit of {math.ceil(time_limit - budget + 1.0)} s or more refines the plan"


def fixed_strategy_note(planner: Any) -> str:
    """What `embarkc check` and `report` say of a plan whose `planner` section records a
    fixed strategy kept over the search (`planner.fixed_strategy`) or searched on from
    (`planner.fixed_start`); "" for any other."""
    extra = getattr(planner, "model_extra", None) or {}
    if fixed := extra.get("fixed_strategy"):
        return f"the plan is the fixed strategy {fixed} (faster than what the search found)"
    if start := extra.get("fixed_start"):
        return (
            f"searched on from the fixed strategy {start} (faster than the search's starts reached)"
        )
    return ""


def _faster_fixed(cm: CostModel, layout: Layout, offer: FixedStart) -> tuple[str, Layout] | None:
    """The fastest of the fixed strategies `offer` holds that is faster than `layout` and
    that the spec allows (`FixedStart.layout_of`, the greedy's own check), with its
    layout; None when none is."""
    current = cm.step_time(layout)
    for name, t in sorted(offer.times.items(), key=lambda kv: (kv[1], kv[0])):
        if not t < current * (1 - 1e-9):
            return None
        candidate = offer.layout_of(name)
        if candidate is not None:
            return name, candidate
    return None


def fixed_start(program: Program, cm: CostModel, fixed: dict[str, float]) -> FixedStart:
    """The fixed strategies (`fixed`: their step times) as starts of the greedy: a
    strategy's layout is offered when its plan passes the checker with the spec's
    constraints (on one node, with the communication the spec names); each strategy is
    checked once, for the greedy and for the plan's last word (`_faster_fixed`)."""
    from embarkc.planner import baselines as bl
    from embarkc.planner.check import validate_plan
    from embarkc.planner.greedy import FixedStart

    allowed: dict[str, Layout | None] = {}

    def layout_of(name: str) -> Layout | None:
        if name not in allowed:
            layout = bl.build_layout(cm, name)
            mode = program.options.communication
            if cm.nodes == 1 and mode != "auto":
                # on one node the spec's communication costs as flat does
                # (docs/language.md): the strategy's layout in the spec's word, the same
                # step time
                layout = {
                    t: p if p.kind == "dp" else replace(p, communication=mode)
                    for t, p in layout.items()
                }
            plan = fixed_plan(program, cm, name, layout)[1]
            allowed[name] = None if validate_plan(program, plan) else layout
        return allowed[name]

    return FixedStart(dict(fixed), layout_of)


def fixed_plan(
    program: Program, cm: CostModel, name: str, layout: Layout | None = None
) -> tuple[Layout, Plan]:
    """The layout of the fixed strategy `name` (`baselines.FIXED`) and its plan file, as
    `plan_program` would write it without the search's record; `layout`: that strategy's
    layout when the caller has built it."""
    from embarkc.planner import baselines as bl

    if layout is None:
        layout = bl.build_layout(cm, name)
    info = {"strategy": name, "solver": "none", "status": "baseline", "seed": 0}
    return layout, build_plan(program, layout, info, cm.evaluate_layout(layout))


def plan_program(
    program: Program,
    *,
    strategy: str | None = None,
    solver: str | None = None,
    time_limit: float | None = None,
    seed: int | None = None,
    progress: Callable[[str, float, float], None] | None = None,
    baselines: bool = True,
) -> Plan:
    """Plan `program`; arguments left None come from `program.options`.

    strategy "embark" runs the greedy search (within `greedy_budget(time_limit)`) then
    `solver` ("cp-sat" refines the greedy placement for what `time_limit` leaves after
    the greedy, `refine_budget`, in deterministic work; "greedy" stops after the greedy);
    "greedy" is the greedy alone; any other name of `baselines.STRATEGIES` builds that
    fixed strategy. With `baselines`, the step time of
    every fixed strategy (that fits) is recorded in `planner.baselines`.
    The result passes `validate_rules`; the same program and arguments give the same
    bytes from `dumps_plan`.
    """
    from embarkc.planner import baselines as bl
    from embarkc.planner.bound import lower_bound
    from embarkc.planner.cost import CommandSize, CostModel
    from embarkc.planner.greedy import balanced_phases, greedy

    opts = program.options
    strategy = strategy or opts.strategy
    solver = solver or opts.solver
    time_limit = opts.time_limit if time_limit is None else time_limit
    seed = opts.seed if seed is None else seed
    if strategy not in bl.STRATEGIES:
        raise EmbarkError.at(
            program.sources[0].path,
            f"unknown strategy `{strategy}`",
            hint=f"strategies: {', '.join(bl.STRATEGIES)}",
        )
    if solver not in ("greedy", "cp-sat"):
        raise EmbarkError.at(
            program.sources[0].path, f"unknown solver `{solver}`", hint="solvers: greedy, cp-sat"
        )
    world = program.topology.world_size
    if world > MAX_PLANNED_GPUS:
        topo_span = program.topology.span
        raise EmbarkError(
            Diagnostic(
                f"the cluster has {world:,} GPUs; the planner plans at most {MAX_PLANNED_GPUS:,}",
                topo_span.to_span() if topo_span else Span.of_file(program.sources[0].path),
                "describe the nodes one training job runs on",
            )
        )
    cm = CostModel(program)
    info: dict[str, Any] = {"strategy": strategy, "seed": seed}
    if strategy in ("embark", "greedy"):
        # the greedy gets the whole limit but the rest of the command; CP-SAT what it leaves
        # the baselines' time is reserved (where they fit) whether or not this call
        # records them: the plan depends on the spec and the limit alone
        size = CommandSize.of(cm.facts)
        reserve = command_reserve(time_limit, *size)
        fixed: dict[str, float] | None = None
        if baselines_fit(time_limit, *size):
            # costed whether or not the caller records them (their time was reserved), so
            # that the plan does not depend on it; the fastest the spec allows is also a
            # start of the greedy
            fixed = bl.baseline_times(cm)
            if baselines:
                info["baselines"] = fixed
        offer = fixed_start(program, cm, fixed) if fixed else None
        g = greedy(cm, progress=progress, budget=greedy_budget(time_limit, reserve), fixed=offer)
        refining = strategy == "embark" and solver == "cp-sat"
        if refining:
            from embarkc.planner.greedy import kicked

            # the greedy, a phase pass on CP-SAT's layout and the rest share the limit
            # with the refinement, all by deterministic counts of work
            budget = refine_budget(time_limit, g.work, g.phase_work, reserve)
            # what the limit leaves beyond the refinement's share goes to random kicks
            # from the greedy plan first (their work adds REST_SHARE to the rest)
            slack = time_limit - g.work - g.phase_work - _rest(g.work, reserve) - max(budget, 0.0)
            g = kicked(cm, g, slack / (1.0 + REST_SHARE), seed, progress)
        layout = g.layout
        info.update(
            solver="greedy",
            status="greedy",
            wall_time=0.0,
            greedy_step_time=g.step_time,
            objective=g.step_time,
            bound=None,
            message="greedy placement with critical-rank splitting"
            + (f"; its search cut at the {time_limit:g} s time limit" if g.stopped else ""),
        )
        if refining:
            from embarkc.planner.cpsat import refine

            if budget > 0:
                r = refine(cm, g, time_limit=budget, seed=seed, progress=progress)
                layout = r.layout
                if layout != g.layout:
                    # the greedy's layout had its phases balanced; CP-SAT's new one too (its
                    # work reserved as the greedy's pass took; the pass is not cut short:
                    # the refinement's count overstates its CPU time 2-3x on the VM)
                    layout = balanced_phases(cm, g.units, layout, progress)
                info.update(
                    solver="cp-sat",
                    status=r.status,
                    wall_time=r.deterministic_time,
                    objective=r.objective,
                    bound=r.bound,
                    message=r.message,
                )
            else:
                info.update(solver="cp-sat", message=no_refine_message(g, time_limit, budget))
        if g.first_cut:
            # the limit cut the first start's descent: say so (how much longer that descent
            # would have run is not known when it stops)
            rest = REST_SECONDS + reserve
            info["message"] = (
                f"the {time_limit:g} s time limit cut the search in its first start (the rest "
                f"of the command takes about {rest:.2g} s for {size.tables} tables): "
                "the plan is barely searched; a longer limit searches it"
            )
        if g.kicked_from is not None:
            info["kicked_from"] = g.kicked_from
            info["message"] += (
                f"; {g.kicks} random kicks took the greedy plan from "
                f"{g.kicked_from * 1e3:.3f} to {g.step_time * 1e3:.3f} ms"
            )
        if g.from_fixed is not None:
            info["fixed_start"] = g.from_fixed
            info["message"] += (
                f"; the greedy went on from the {g.from_fixed} strategy's layout, faster than "
                "what its own starts reached"
            )
        if offer is not None:
            # a search (cut short by its limit, above all) may end slower than a fixed
            # strategy: the plan is then the fastest fixed strategy the spec allows
            found = _faster_fixed(cm, layout, offer)
            if found is not None:
                name, layout = found
                info["fixed_strategy"] = name
                info["message"] = (
                    f"{info['message']}; the fixed strategy {name} is faster than what the "
                    f"search found within the {time_limit:g} s time limit, and is the plan"
                )
        # the least step time any plan of the spec can have by the same cost model
        info["lower_bound"] = lower_bound(cm).step_time
    else:
        layout = bl.build_layout(cm, strategy)
        info.update(
            solver="none", status="baseline", wall_time=0.0, message=f"fixed strategy {strategy}"
        )
    estimate = cm.evaluate_layout(layout)
    info.setdefault("objective", estimate["step_time"])
    info = {k: v for k, v in info.items() if v is not None}
    plan = build_plan(program, layout, info, estimate)
    if strategy not in ("embark", "greedy"):
        # a fixed strategy is what its name says, whatever the spec constrains: the
        # constraints it breaks are recorded in the plan and reported as warnings
        from embarkc.planner.check import constraint_violations

        broken_constraints = constraint_violations(program, plan)
        if broken_constraints:
            info["ignored_constraints"] = [
                {"rule": v.rule, "table": v.table, "message": v.message} for v in broken_constraints
            ]
            plan = build_plan(program, layout, info, estimate)
    if strategy in ("embark", "greedy"):
        # the independent checker has the last word on every plan the search returns;
        # a rejection is a planner bug, reported as one (baselines ignore constraints
        # by design and are not checked against them)
        from embarkc.planner.check import validate_plan

        broken = validate_plan(program, plan)
        if broken:
            raise AssertionError(
                "the planner produced a plan that embarkc.planner.check rejects: "
                + "; ".join(str(v) for v in broken[:5])
            )
    return plan
