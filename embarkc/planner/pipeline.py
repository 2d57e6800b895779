"""The planner's stages, in the order `plan_program` runs them.

    request     the strategy, solver, limit and seed; the cluster within what we plan
    fixed       the fixed strategies' step times, and their layouts as starts (fixed.py)
    greedy      EMBark's starts and descents within the greedy's share (greedy.py)
    kicks       random kicks from the greedy plan, in what CP-SAT leaves of the limit
    cp-sat      OR-tools refinement of the greedy placement (cpsat.py)
    fallback    a fixed strategy that beat what the search found within the limit
    bound       the least step time any plan of the spec can have (bound.py)
    build       layout + the search's record -> plan file (build.py)
    checker     the independent checker's last word on a search's plan (check.py)

Tables that fit in HBM in no plan, on hardware with host memory, go through
`tiered_plan`: tiers chosen (tiers.py), the stages above on a cost model that knows
them, each host cell's cache written on its placement and grown into the free HBM.

A fixed strategy (`--strategy table-wise`, ...) is built, recorded with the constraints
it ignores, and written without a search. The time limit is shared by one `PlanBudget`
created here and passed to the stages that spend it (budget.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from embark_runtime.plan import Plan
from embarkc.diagnostics import Diagnostic, EmbarkError, Span
from embarkc.ir import Program
from embarkc.planner import baselines as bl
from embarkc.planner import tiers
from embarkc.planner.budget import MAX_PLANNED_GPUS, PlanBudget, WorkMeter
from embarkc.planner.build import build_plan
from embarkc.planner.clusters import NoFit
from embarkc.planner.cost import CommandSize, CostModel
from embarkc.planner.fixed import FixedOffer, faster_fixed, fixed_offer
from embarkc.planner.search import GreedyResult, balanced_phases, greedy, kicked
from embarkc.planner.types import Layout

Progress = Callable[[str, float, float], None]
"""progress(stage, fraction done, best step time so far)."""

SEARCHES = ("embark", "greedy")
"""The strategies that search (the others are fixed strategies, `baselines.FIXED`)."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan with: the arguments of `plan_program`, the spec's options for those
    left None."""

    strategy: str
    solver: str
    time_limit: float
    seed: int

    @property
    def searches(self) -> bool:
        return self.strategy in SEARCHES

    @property
    def refines(self) -> bool:
        """Whether CP-SAT refines the greedy plan (and random kicks precede it)."""
        return self.strategy == "embark" and self.solver == "cp-sat"


@dataclass
class SearchRecord:
    """The plan file's `planner` section of a search, field by field in the order it is
    written; fields left None are not written."""

    strategy: str
    seed: int
    baselines: dict[str, float] | None = None
    solver: str = "greedy"
    status: str = "greedy"
    wall_time: float = 0.0
    greedy_step_time: float | None = None
    objective: float | None = None
    bound: float | None = None
    message: str = ""
    neighbourhoods: int | None = None
    stopped: str | None = None
    kicked_from: float | None = None
    fixed_start: str | None = None
    fixed_strategy: str | None = None
    lower_bound: float | None = None

    def as_planner(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


# ----------------------------------------------------------------------------- stages


def plan_request(
    program: Program,
    strategy: str | None,
    solver: str | None,
    time_limit: float | None,
    seed: int | None,
) -> PlanRequest:
    """The request, from the arguments and the spec's options; a user error for an
    unknown strategy or solver, or a cluster larger than the planner plans."""
    opts = program.options
    req = PlanRequest(
        strategy or opts.strategy,
        solver or opts.solver,
        opts.time_limit if time_limit is None else time_limit,
        opts.seed if seed is None else seed,
    )
    path = program.sources[0].path
    if req.strategy not in bl.STRATEGIES:
        raise EmbarkError.at(
            path,
            f"unknown strategy `{req.strategy}`",
            hint=f"strategies: {', '.join(bl.STRATEGIES)}",
        )
    if req.solver not in ("greedy", "cp-sat"):
        raise EmbarkError.at(path, f"unknown solver `{req.solver}`", hint="solvers: greedy, cp-sat")
    world = program.topology.world_size
    if world > MAX_PLANNED_GPUS:
        topo_span = program.topology.span
        raise EmbarkError(
            Diagnostic(
                f"the cluster has {world:,} GPUs; the planner plans at most {MAX_PLANNED_GPUS:,}",
                topo_span.to_span() if topo_span else Span.of_file(path),
                "describe the nodes one training job runs on",
            )
        )
    return req


def greedy_stage(
    cm: CostModel, budget: PlanBudget, offer: FixedOffer, progress: Progress | None
) -> GreedyResult:
    """EMBark's greedy search (its starts, descents, rebalance and phase passes) within
    the greedy's share of the limit, from the fixed strategies too where they were
    costed."""
    return greedy(
        cm, progress=progress, budget=budget.greedy_work(), fixed=offer.start, meter=budget.meter
    )


def kicks_stage(
    cm: CostModel,
    g: GreedyResult,
    budget: PlanBudget,
    refine_seconds: float,
    seed: int,
    progress: Progress | None,
) -> GreedyResult:
    """Random kicks from the greedy plan in what the limit leaves beyond CP-SAT's share."""
    work = budget.kick_work(g.work, g.phase_work, refine_seconds)
    return kicked(cm, g, work, seed, progress, budget.meter)


def greedy_message(g: GreedyResult, time_limit: float) -> str:
    cut = f"; its search cut at the {time_limit:g} s time limit" if g.stopped else ""
    return "greedy placement with critical-rank splitting" + cut


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


def cpsat_stage(
    cm: CostModel,
    g: GreedyResult,
    refine_seconds: float,
    req: PlanRequest,
    record: SearchRecord,
    progress: Progress | None,
) -> Layout:
    """CP-SAT's refinement of the greedy plan within `refine_seconds` of deterministic
    work, its new layout's phases balanced as the greedy's were; the record says what it
    did (or that the greedy left it nothing)."""
    record.solver = "cp-sat"
    if refine_seconds <= 0:
        record.message = no_refine_message(g, req.time_limit, refine_seconds)
        return g.layout
    from embarkc.planner.cpsat import refine

    r = refine(cm, g, time_limit=refine_seconds, seed=req.seed, progress=progress)
    layout = r.layout
    if layout != g.layout:
        # the greedy's layout had its phases balanced; CP-SAT's new one too (its work
        # reserved as the greedy's pass took; the pass is not cut short)
        layout = balanced_phases(cm, g.units, layout, progress)
    record.status = r.status
    record.wall_time = r.deterministic_time
    record.objective = r.objective
    record.bound = r.bound
    record.message = r.message
    record.neighbourhoods = r.neighbourhoods
    record.stopped = r.stopped
    return layout


def note_search(record: SearchRecord, g: GreedyResult, budget: PlanBudget) -> None:
    """What the record adds of how the search went: a first start cut by the limit, the
    kicks' gain, a fixed strategy's layout searched on from."""
    if g.first_cut:
        # the limit cut the first start's descent (how much longer that descent would
        # have run is not known when it stops)
        record.message = (
            f"the {budget.time_limit:g} s time limit cut the search in its first start "
            f"(the rest of the command takes about {budget.command_rest():.2g} s for "
            f"{budget.size.tables} tables): the plan is barely searched; a longer limit "
            "searches it"
        )
    if g.kicked_from is not None:
        record.kicked_from = g.kicked_from
        record.message += (
            f"; {g.kicks} random kicks took the greedy plan from "
            f"{g.kicked_from * 1e3:.3f} to {g.step_time * 1e3:.3f} ms"
        )
    if g.from_fixed is not None:
        record.fixed_start = g.from_fixed
        record.message += (
            f"; the greedy went on from the {g.from_fixed} strategy's layout, faster than "
            "what its own starts reached"
        )


def fallback_stage(
    cm: CostModel, layout: Layout, offer: FixedOffer, record: SearchRecord, time_limit: float
) -> Layout:
    """`layout`, or the fastest fixed strategy the spec allows when it is faster (a
    search cut short by its limit, above all)."""
    if offer.start is None:
        return layout
    found = faster_fixed(cm, layout, offer.start)
    if found is None:
        return layout
    name, fixed_layout = found
    record.fixed_strategy = name
    record.message = (
        f"{record.message}; the fixed strategy {name} is faster than what the "
        f"search found within the {time_limit:g} s time limit, and is the plan"
    )
    return fixed_layout


def checker_stage(program: Program, plan: Plan) -> Plan:
    """The independent checker has the last word on every plan the search returns; a
    rejection is a planner bug, reported as one."""
    from embarkc.planner.check import validate_plan

    broken = validate_plan(program, plan)
    if broken:
        raise AssertionError(
            "the planner produced a plan that embarkc.planner.check rejects: "
            + "; ".join(str(v) for v in broken[:5])
        )
    return plan


# ----------------------------------------------------------------------------- plans


def search_plan(
    program: Program,
    req: PlanRequest,
    progress: Progress | None,
    record_baselines: bool,
) -> Plan:
    """The search's plan: fixed -> greedy -> kicks -> CP-SAT -> fallback -> bound ->
    build -> checker. The baselines' time is reserved (where they fit) whether or not
    they are recorded: the plan depends on the spec and the limit alone. Tables that
    find no placement in HBM go to host memory where the hardware has it
    (`tiered_plan`)."""
    from embarkc.planner.bound import lower_bound

    cm = CostModel(program)
    aside = WorkMeter(cm.W)  # the bound's options of every table in HBM, costed once
    if tiers.needs_host(cm, aside):
        return tiered_plan(program, cm, req, progress, record_baselines, aside)
    try:
        layout, record, budget = search_layout(cm, req, progress, record_baselines)
    except NoFit:
        if not tiers.host_tier_available(program):
            raise
        return tiered_plan(program, cm, req, progress, record_baselines, aside)
    # the bound's options: the search's own where its bound start costed them, else those
    # the tier check costed (the same figures; costed once either way)
    bound_meter = budget.meter if budget.meter.bound_options is not None else aside
    record.lower_bound = lower_bound(cm, bound_meter).step_time
    plan = build_plan(program, layout, record.as_planner(), cm.evaluate_layout(layout))
    return checker_stage(program, plan)


def tiered_plan(
    program: Program,
    cm: CostModel,
    req: PlanRequest,
    progress: Progress | None,
    record_baselines: bool,
    aside: WorkMeter,
) -> Plan:
    """The plan of tables that do not fit in HBM (`embarkc.planner.tiers`): tiers chosen
    for a share of HBM (`tiers.FILLS`, lower while the search finds no placement), the
    search with those tiers, the caches grown into the HBM it left free. `cm` costs
    every table in HBM; the bound is its own (host memory only adds time), its options
    costed on `aside`."""
    from embarkc.planner.bound import lower_bound

    refused: NoFit | None = None
    spent = 0.0  # the work of the tries that found no placement: they share the limit
    for fill in tiers.FILLS:
        chosen = tiers.choose_tiers(cm, fill)
        if not chosen:
            continue
        tcm = CostModel(program, chosen)
        left = req.time_limit - spent
        budget = PlanBudget.of(left, CommandSize.of(tcm.facts), tcm.W)
        if budget.greedy_work() <= 0 and refused is not None:
            break
        try:
            layout, record, budget = search_layout(tcm, req, progress, record_baselines, budget)
        except NoFit as e:
            refused = e
            spent += budget.meter.seconds() + budget.meter.placing_seconds()
            continue
        except EmbarkError as e:
            raise tiers.with_tiers_said(e, chosen, fill) from None
        layout = tiers.materialize(tcm, layout)
        searched = cm.step_time(layout)
        layout = tiers.grow_caches(cm, layout)
        estimate = cm.evaluate_layout(layout)
        problem = tiers.host_memory_problem(cm, estimate)
        if problem is not None:
            raise EmbarkError.at(
                program.sources[0].path,
                f"the tables fit in HBM and host memory only in a plan that overfills a "
                f"node's host memory: {problem}",
                hint="add host_memory or nodes, or make the tables smaller",
            )
        # the bound of every table in HBM, costed aside: the search's meter holds the
        # tiered model's options (its bound start), not `cm`'s
        record.lower_bound = lower_bound(cm, aside).step_time
        record.message += tiers.tier_message(estimate, searched, fill)
        plan = build_plan(program, layout, record.as_planner(), estimate)
        return checker_stage(program, plan)
    raise tiers.refusal(cm, refused)


def search_layout(
    cm: CostModel,
    req: PlanRequest,
    progress: Progress | None,
    record_baselines: bool,
    budget: PlanBudget | None = None,
) -> tuple[Layout, SearchRecord, PlanBudget]:
    """The stages from the fixed strategies to the fallback on `cm`: the layout, the
    record of how it was found and the budget the stages spent (`budget`: the request's
    limit, unless given)."""
    program = cm.program
    if budget is None:
        budget = PlanBudget.of(req.time_limit, CommandSize.of(cm.facts), cm.W)
    record = SearchRecord(req.strategy, req.seed)
    offer = fixed_offer(program, cm, budget)
    if record_baselines:
        record.baselines = offer.times
    g = greedy_stage(cm, budget, offer, progress)
    refine_seconds = 0.0
    if req.refines:
        refine_seconds = budget.refine_seconds(g.work, g.phase_work)
        g = kicks_stage(cm, g, budget, refine_seconds, req.seed, progress)
    record.greedy_step_time = record.objective = g.step_time
    record.message = greedy_message(g, req.time_limit)
    layout = g.layout
    if req.refines:
        layout = cpsat_stage(cm, g, refine_seconds, req, record, progress)
    note_search(record, g, budget)
    layout = fallback_stage(cm, layout, offer, record, req.time_limit)
    return layout, record, budget


def fixed_strategy_plan(program: Program, req: PlanRequest) -> Plan:
    """The plan of a fixed strategy: what its name says, whatever the spec constrains;
    the constraints it breaks are recorded in the plan (and reported as warnings by the
    commands)."""
    from embarkc.planner.check import constraint_violations

    cm = CostModel(program)
    layout = bl.build_layout(cm, req.strategy)
    estimate = cm.evaluate_layout(layout)
    info: dict[str, Any] = {
        "strategy": req.strategy,
        "seed": req.seed,
        "solver": "none",
        "status": "baseline",
        "wall_time": 0.0,
        "message": f"fixed strategy {req.strategy}",
        "objective": estimate["step_time"],
    }
    plan = build_plan(program, layout, info, estimate)
    broken = constraint_violations(program, plan)
    if broken:
        info["ignored_constraints"] = [
            {"rule": v.rule, "table": v.table, "message": v.message} for v in broken
        ]
        plan = build_plan(program, layout, info, estimate)
    return plan


def plan_program(
    program: Program,
    *,
    strategy: str | None = None,
    solver: str | None = None,
    time_limit: float | None = None,
    seed: int | None = None,
    progress: Progress | None = None,
    baselines: bool = True,
) -> Plan:
    """Plan `program`; arguments left None come from `program.options`.

    strategy "embark" runs the greedy search (within `PlanBudget.greedy_work`) then
    `solver` ("cp-sat" refines the greedy placement for what `time_limit` leaves after
    the greedy, in deterministic work; "greedy" stops after the greedy); "greedy" is the
    greedy alone; any other name of `baselines.STRATEGIES` builds that fixed strategy.
    With `baselines`, the step time of every fixed strategy (that fits) is recorded in
    `planner.baselines`. The result passes `validate_rules`; the same program and
    arguments give the same bytes from `dumps_plan`.
    """
    req = plan_request(program, strategy, solver, time_limit, seed)
    if req.searches:
        return search_plan(program, req, progress, baselines)
    return fixed_strategy_plan(program, req)
