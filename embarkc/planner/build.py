"""Layout -> plan file: `build_plan` turns a layout and the planner's record into the
plan file's model, every float rounded to 9 significant digits so that the same inputs
give the same bytes; the estimate carries the digests of the layout it costs and of its
own figures, from which `stale_reason` tells a plan edited after embarkc wrote it.

    build_plan(program, layout, planner, estimate=None) -> Plan
    adopt_plan(program, plan, recost) -> Plan         a checked plan as the spec's
    layout_digest, figures_digest, stale_reason, layout_is_stale, estimate_is_stale
    plan_to_json(plan) -> str                         the deterministic text
    fixed_strategy_note(planner) -> str               what check and report say of it
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from embark_runtime.plan import Plan, PlanError, Shard, dumps_plan, parse_plan, validate_rules
from embarkc.diagnostics import EmbarkError
from embarkc.ir import Program, without_spans
from embarkc.planner.types import Layout


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
            # only when set: the plans of specs without column names stay as they were
            **({"column": f.column} if f.column is not None else {}),
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
        cache = p.cache or ()
        for i, (j, lo, hi, rank) in enumerate(p.cell_list()):
            shard: dict[str, Any] = {
                "table": name,
                "row_shard": j,
                "row_shards": p.row_shards,
                "columns": [lo, hi],
                "rank": rank,
            }
            if cache and cache[i] >= 0:
                # only host-tier cells say so: an all-HBM plan reads as before
                shard["tier"] = "host"
                if cache[i] > 0:
                    shard["cache_rows"] = cache[i]
            shards.append(shard)
    host: dict[str, Any] = {}
    if any(s.get("tier") == "host" for s in shards):
        # a host-tier plan names the host memory and link it was planned for
        if topo.host_memory is not None:
            host["host_memory_bytes"] = topo.host_memory
        if topo.host_bandwidth is not None:
            host["host_bandwidth"] = topo.host_bandwidth
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
            **host,
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


def _tier_of(shard: Shard) -> list[Any]:
    """A host-tier cell's tier and cache rows ([] for a cell in HBM)."""
    return [shard.tier, shard.cache_rows] if shard.on_host else []


def layout_digest(plan: Plan) -> str:
    """sha256 of what the estimate depends on besides the spec: the row partition, the
    clusters (kind, communication, gradient exchange, tables) and every cell, with its
    storage tier and cache when it is not in HBM (an all-HBM plan digests as before)."""
    import hashlib
    import json

    clusters = [
        [c.name, c.kind, c.communication, getattr(c, "gradient_exchange", None), list(c.tables)]
        for c in plan.clusters
    ]
    shards = sorted(
        [s.table, s.row_shard, s.row_shards, s.columns[0], s.columns[1], s.rank] + _tier_of(s)
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
