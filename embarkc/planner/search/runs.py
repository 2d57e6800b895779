"""EMBark's greedy search: place cells by cost, split what is on the critical rank.

1. Every unit (a table or a colocate group) starts with a kind (`clusters.initial_kinds`,
   or rb for every unit in the second start) and the smallest grid whose cells fit
   comfortably (`clusters.initial_grid`). On several nodes, when the spec leaves the
   communication to the planner, a further start makes every rb unit hierarchical
   (`hierarchical_start`). When the keys hide under the dense compute, the first start
   is also searched with its heavy units cut into columns, once per cell size of
   COLUMN_SHARES (`column_start`). All ub units of a start share one communication,
   flat or hierarchical (ids deduplicated per node before the network, on the owner's
   rail peer there: docs/communication.md); where the spec leaves it to the planner on
   several nodes, small programs search both (`_ub_worlds`), large ones the one whose
   first start has less work (`choose_ub_comm`). Small programs also start from the kinds
   of the lower bound's kind set (`bound_start`, and its column starts): kinds that share
   a cluster's fixed costs, which no single unit's choice or move reaches.
2. `place_all`: all cells, heaviest first, each on the least-loaded rank that has room
   (load = the seconds a cell puts on its owner, `cost.owner_seconds`, keys only beyond
   the dense compute window; room = weights, state and buffers within
   `hbm_bytes - memory_headroom`). Cells of one unit prefer
   distinct ranks. `within_node` units and hierarchical rb units keep all their cells on
   one node (`one_node`): the node whose ranks they leave least loaded (`best_node`).
   A hierarchical table's partials are summed inside that node, so one vector per
   sample crosses the network, and each of the node's NICs sends its rail's share.
3. `Search.improve`: on the critical rank of the exact cost model, for the units that
   load it most (and the units alone in their cluster kind), try re-placing the unit,
   row and column splits and merges (cuts at multiples of 4), rows traded for columns,
   another kind and, for rb, the other communication; keep the move that lowers the
   16-norm of the rank times most; stop when no move helps. The best step time seen wins.
4. `Search.polish`: for the heaviest units of the critical rank, their moves and wider
   grids (`POLISH_GRIDS`), judged by the step time itself; a few rounds. The norm's
   descent stops in local minima that a jump to a grid several steps away leaves
   (T510 on 128 GPUs with the keys in full and flat ub: 6.50 -> 5.87 ms). Descent and
   polish repeat while the step time falls (`DESCENT_CYCLES`).
5. A fresh heaviest-first placement of the final grids, improved again; the faster of the
   two, and of the starts, is kept.
6. `Search.rebalance` (programs of up to FOUR_START_UNITS units): single cells of the
   critical rank moved, or swapped with lighter cells, onto the least-loaded ranks and
   the ranks of their node, by the exact model.
7. `balanced_phases`: the critical path (every phase at its slowest rank,
   `RankState.critical_path`) lowered by cell and unit moves that do not raise the step
   time (`Search.balance_phases`); the result is returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from embarkc.diagnostics import EmbarkError
from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    NoFit,
    Unit,
    check_fits,
    initial_kinds,
    units_of,
)
from embarkc.planner.cost import CostModel
from embarkc.planner.search.board import Progress
from embarkc.planner.search.cells import Search
from embarkc.planner.search.descent import descend, place_splitting
from embarkc.planner.search.finish import balanced_phases, decision_of, fits_exactly, rebalanced
from embarkc.planner.search.place import Decision, NoRoom
from embarkc.planner.search.starts import (
    bound_start,
    column_start,
    fine_column_start,
    hierarchical_start,
    kind_of,
    start_of,
    ub_worlds,
)
from embarkc.planner.search.tuning import (
    COLUMN_ONLY_RANKS,
    COLUMN_SHARES,
    FINE_START_RANKS,
    FOUR_START_UNITS,
    MULTI_START_UNITS,
    RUNS_SHARE,
)
from embarkc.planner.types import Layout
from embarkc.units import format_bytes


@dataclass
class GreedyResult:
    layout: Layout
    step_time: float
    decisions: dict[str, Decision]
    units: list[Unit]
    work: float = 0.0
    """The search's deterministic work (`WorkMeter.seconds`), all of it."""
    phase_work: float = 0.0
    """The part of `work` its `balanced_phases` took."""
    stopped: bool = False
    """The budget ran out: later starts were not begun, or the work reached the budget,
    where the descents, the rebalance and the phase passes stop (rarely, a last pass that
    ends on its own just past the budget counts too)."""
    first_cut: bool = False
    """The budget ran out in the first start's descent: the plan is barely searched."""
    from_fixed: str | None = None
    """The fixed strategy whose layout the plan was searched on from (`greedy`'s `fixed`),
    when that layout was faster than every start's descent; None otherwise."""
    kicks: int = 0
    """Kicks that `kicked` tried after the greedy."""
    kicked_from: float | None = None
    """The greedy's step time before `kicked` found a faster plan; None when it did not."""


def greedy(
    cm: CostModel,
    progress: Progress | None = None,
    max_iterations: int | None = None,
    budget: float | None = None,
    fixed: FixedStart | None = None,
    meter: WorkMeter | None = None,
) -> GreedyResult:
    """EMBark's greedy search on the cost model `cm` (see the module docstring).

    Up to three starts are searched and the fastest result kept: the kinds the cost model
    prefers for each unit alone, the same without dp (a replicated table is cheap alone
    but its descent can end in a worse plan), and every unit sharded with its first
    allowed kind (rb where allowed, dp only if pinned), since a plan's best kinds depend
    on the whole plan, not on each table alone; small programs search each start in two
    placement modes (`FOUR_START_UNITS`), programs with more than `MULTI_START_UNITS`
    units the first start only. When keys hide under the dense compute
    (`CostModel.key_window`), more: the first start with its heavy units cut into
    columns, once per share of COLUMN_SHARES (`column_start`; for programs of more than
    FOUR_START_UNITS units on more than COLUMN_ONLY_RANKS ranks these replace the other
    starts). Programs of up to FOUR_START_UNITS units also search the lower bound's kinds
    (`bound_start`) and, when the keys hide, their column starts; programs of more than
    MULTI_START_UNITS units, and those of more than FOUR_START_UNITS on more than
    FINE_START_RANKS[0] ranks, the column-wise strategy's grids (`fine_column_start`),
    right after their first start (after the others on up to FINE_START_RANKS[1] ranks).
    The fastest result is rebalanced cell by cell (`Search.rebalance`): on
    programs of up to FOUR_START_UNITS units by the best move of all, then on those and on
    larger programs on up to COLUMN_ONLY_RANKS ranks by the first cell's best move. Last,
    every program's critical path is lowered without raising its step time
    (`balanced_phases`).

    `budget`: the work (`WorkMeter.seconds`) the search may take, from a time limit. The first
    start's placement always runs whole; the others start, and their descents run, only
    within RUNS_SHARE of the budget; the first start's descent, the rebalance and the
    phase passes stop where it ends (each with the best layout it has seen). None: no
    limit.

    `fixed`: the fixed strategies' step times and layouts (`FixedStart`). When the fastest
    that the spec's constraints allow is faster than every start's descent, or no start
    fits, the search takes its layout up and descends from it like a later start
    (`_from_fixed`): the starts' grids placed by the search can miss a layout as regular
    as the column-wise strategy's, whose every rank carries the same share (16 ranks,
    four tables of 100M rows cut into 4 columns and ten small ones: the starts end at
    0.184 ms, column-wise is 0.170 ms).
    """
    meter = meter if meter is not None else WorkMeter(cm.W)
    start_work = meter.seconds()
    if budget is None:
        return _greedy(cm, meter, progress, max_iterations, start_work, fixed=fixed)
    with meter.until(start_work + budget):
        return _greedy(
            cm,
            meter,
            progress,
            max_iterations,
            start_work,
            start_work + RUNS_SHARE * budget,
            fixed=fixed,
        )


def _greedy(
    cm: CostModel,
    meter: WorkMeter,
    progress: Progress | None,
    max_iterations: int | None,
    start_work: float,
    runs_until: float = math.inf,
    flat_ub: bool = False,
    fixed: FixedStart | None = None,
) -> GreedyResult:
    """`greedy`, its later starts only while the work stays below `runs_until`;
    `flat_ub`: every ub unit flat (the search again when every plan of its hierarchical
    ub overran a rank with its aggregators' buffers)."""
    units = units_of(cm)
    check_fits(cm, units)
    known: dict[str, dict[str, str]] = {}
    ub_comm, other = ("flat", None) if flat_ub else ub_worlds(cm, units, known)
    kinds = known.get(ub_comm) or initial_kinds(cm, units, ub_comm=ub_comm)
    # planning time: large programs whose keys hide search the column starts only
    columns_only = cm.key_window > 0 and len(units) > FOUR_START_UNITS and cm.W > COLUMN_ONLY_RANKS
    starts = [start_of(cm, units, partial(kind_of, kinds), ub_comm)]
    if not columns_only:
        sharded = initial_kinds(cm, units, allow_dp=False, ub_comm=ub_comm)
        for choose in (partial(kind_of, sharded), lambda u: u.kinds[0]):
            decisions = start_of(cm, units, choose, ub_comm)
            if decisions not in starts:
                starts.append(decisions)
        hier = hierarchical_start(cm, units, starts[0])
        if hier is not None and hier not in starts:
            starts.append(hier)
    runs = [(d, True) for d in starts]
    # small programs also descend every start again with the rough reference (a second
    # look at the same starts): last, so that a short limit reaches the other starts first
    second_looks = [(d, False) for d in starts] if len(units) <= FOUR_START_UNITS else []
    if len(units) > MULTI_START_UNITS:
        runs = runs[:1]
    if cm.key_window > 0:
        # keys hide under the dense compute: column cuts cost the owners nothing more
        cols: list[dict[str, Decision]] = []
        for share in COLUMN_SHARES:
            col = column_start(cm, units, starts[0], share)
            if col not in starts and col not in cols:
                cols.append(col)
        if cols and columns_only:
            # planning time: on large programs they replace the other starts, and they
            # end lower (T510 on 128 GPUs 4.709 ms in about 0.2 s of descent each, the
            # first start 5.394 ms in 1.2 s; 5,000 tables on 1,024 GPUs 6.184 against 6.872)
            runs = []
        runs += [(col, True) for col in cols]
    bounded = bound_start(cm, units, starts[0], meter)
    if bounded is not None and bounded not in starts:
        # the lower bound's kinds: clusters whose fixed costs no unit pays for alone;
        # searched right after the first start, so that a short limit reaches them too
        # (at 5 s on 16 x 8 GPUs: DCNv2 0.609 -> 0.558 ms, T200 3.541 -> 3.230; at 10 s
        # T200 3.107 -> 3.112; every plan at 30 s and without a limit the same)
        more_runs = [bounded]
        if cm.key_window > 0:
            more_runs += [column_start(cm, units, bounded, share) for share in COLUMN_SHARES]
        runs[1:1] = [(b, True) for b in more_runs if (b, True) not in runs]
    if other is not None:
        # the other ub communication: its first start, hierarchical rb start and column
        # starts (one unit's move to the other communication cannot show what all of
        # them gain, and the better depends on the workload)
        kinds_o = initial_kinds(cm, units, ub_comm=other)
        first = start_of(cm, units, partial(kind_of, kinds_o), other)
        more = [first, hierarchical_start(cm, units, first)]
        if cm.key_window > 0:
            more += [column_start(cm, units, first, share) for share in COLUMN_SHARES]
        for d in more:
            if d is not None and d not in starts and (d, True) not in runs:
                runs.append((d, True))
    if len(units) > MULTI_START_UNITS or (
        len(units) > FOUR_START_UNITS and cm.W > FINE_START_RANKS[0]
    ):
        # the column-wise strategy's grids: on many tables and ranks the descents balance
        # no better than its cells of 16 columns placed heaviest first (5,000 generated
        # tables on 1,024 GPUs: 6.228 ms from the other starts at the default limit, the
        # column-wise strategy 5.712, the descent from its grids 5.712; unlimited greedy
        # on generated programs: 350 tables on 1,024 GPUs 1.387 -> 1.240 ms, 600 on 512
        # 1.997 -> 1.955 (column-wise 1.977), 1,000 on 256 4.752 -> 4.461 (column-wise
        # 4.461)), and the plan command cannot cost the fixed strategies there within
        # the default limit. Right after the first start, as the later starts share what
        # is left of the budget (at 15 s of work: 350 tables on 1,024 GPUs 1.240 ms, 1.390
        # with the start last; 800 on 512 2.276 against 2.324), except on up to
        # FINE_START_RANKS[1] ranks, where it comes last: at 2 s of work 400 tables on
        # 256 GPUs 2.526 ms with it last or without, 2.692 right after the first start.
        # Programs of up to FOUR_START_UNITS units search more starts, and on up to
        # FINE_START_RANKS[0] ranks the start gains nothing for its work (T180 on 128
        # GPUs at 30 s: 4.156 -> 4.164 ms with it last; T510 on 128 and 32 GPUs the same
        # plans unlimited, and at 2 s 4.405 -> 4.696 and 12.19 -> 12.95 ms right after
        # the first start)
        fine = fine_column_start(cm, units, starts[0])
        if fine not in starts and (fine, True) not in runs:
            if len(units) > MULTI_START_UNITS or cm.W > FINE_START_RANKS[1]:
                runs.insert(1, (fine, True))
            else:
                runs.append((fine, True))
    runs += second_looks
    limit = max_iterations if max_iterations is not None else 20 * len(units) + 200
    best: tuple[float, Layout, dict[str, Decision]] | None = None
    stopped = first_cut = overran = False
    deadline = meter.deadline
    refused: EmbarkError | None = None
    refusal: EmbarkError | None = None  # why no start fits, while a fixed start may
    for i, (decisions, exact_ref) in enumerate(runs):
        if i > 0 and best is not None and meter.seconds() >= runs_until:
            stopped = True
            break  # the time limit: the rest is for the rebalance and the phase passes
        if best is None and refused is not None and meter.placed_past(deadline):
            # no start has fit, and trying them has taken the greedy's whole budget: the
            # last start's refusal, with the starts left untried (near the memory's end a
            # start can take seconds to fail: 200 tables at 97 % took 6 s at a 3 s limit)
            refusal = _cut_refusal(refused, i, len(runs))
            if fixed is None:
                raise refusal from None
            break
        if best is not None:
            # the later starts' descents stop where no further start may begin
            meter.deadline = min(deadline, runs_until)
        comm = next((x.comm for x in decisions.values() if x.kind == "ub"), ub_comm)
        search = Search(cm, units, progress, exact_ref, comm, meter=meter)
        try:
            # while none has fit, a start also stops splitting at the greedy's budget
            decisions = place_splitting(search, decisions, deadline if best is None else None)
        except EmbarkError as e:
            if best is None and i == len(runs) - 1:
                refusal = _cut_refusal(e, len(runs), len(runs)) if search.cut_short else e
                if fixed is None:
                    raise refusal from None
                break
            refused = e
            continue
        found = descend(search, limit)
        if best is None:
            # the first start that fits (its descent had the whole budget)
            first_cut = meter.seconds() >= deadline
        elif meter.spent():
            stopped = True  # a later start's descent, cut where no further start may begin
        if best is None or found[0] < best[0] * (1 - 1e-9):
            if fits_exactly(cm, found[1]):
                best = found
            else:
                overran = True  # the aggregators' buffers of its hierarchical ub
    meter.deadline = deadline
    from_fixed: str | None = None
    offered = sorted(fixed.times.items(), key=lambda kv: (kv[1], kv[0])) if fixed else []
    layout_of = fixed.layout_of if fixed else None
    for name, t in offered:
        if best is not None and not t < best[0] * (1 - 1e-9):
            break
        # a fixed strategy's layout beats every start: the search goes on from there, a
        # start of its own (on the whole budget when no other start fits)
        start = layout_of(name) if layout_of else None
        if start is None:
            continue  # the spec's constraints forbid it
        meter.deadline = deadline if best is None else min(deadline, runs_until)
        taken = _from_fixed(cm, units, progress, ub_comm, start, limit, meter)
        meter.deadline = deadline
        if taken is not None and (best is None or taken[0] < best[0] * (1 - 1e-9)):
            best, from_fixed = taken, name
            stopped = stopped or meter.spent()
            break
    auto = cm.program.options.communication == "auto"
    if best is None and overran and auto and not flat_ub:
        return _greedy(
            cm, meter, progress, max_iterations, start_work, runs_until, flat_ub=True, fixed=fixed
        )
    if best is None and refusal is not None:
        raise refusal from None
    if best is None:
        raise NoFit.at(
            cm.program.sources[0].path,
            f"no placement fits in {cm.W} GPUs of {format_bytes(cm.capacity)}: the "
            "buffers of the hierarchical ub aggregators overrun a GPU in every plan found",
            hint="plan with `communication flat` (or auto), lower memory_headroom, or add GPUs",
        )
    best = (cm.step_time(best[1], meter), best[1], best[2])  # from scratch: no drift of the sums
    if cm.W > 1 and (len(units) <= FOUR_START_UNITS or cm.W <= COLUMN_ONLY_RANKS):
        best = rebalanced(cm, units, progress, best, meter)
    phase_start = meter.seconds()
    layout = balanced_phases(cm, units, best[1], progress, meter)
    phase_work = meter.seconds() - phase_start
    if layout is not best[1]:
        decisions = {u.name: decision_of(layout[u.tables[0]]) for u in units}
        best = (cm.step_time(layout, meter), layout, decisions)
    if progress is not None:
        progress("greedy", 1.0, best[0])
    work = meter.seconds() - start_work
    stopped = stopped or meter.spent()
    return GreedyResult(
        best[1], best[0], best[2], units, work, phase_work, stopped, first_cut, from_fixed
    )


@dataclass(frozen=True)
class FixedStart:
    """The fixed strategies offered to the greedy as starts (`greedy`'s `fixed`)."""

    times: dict[str, float]
    """The step time of each fixed strategy that fits."""
    layout_of: Callable[[str], Layout | None]
    """A strategy's layout, or None when the spec's constraints forbid it (called only
    for a strategy faster than every start: its check costs 0.25 s on T510 at 128 GPUs)."""


def _from_fixed(
    cm: CostModel,
    units: list[Unit],
    progress: Progress | None,
    ub_comm: str,
    layout: Layout,
    limit: int,
    meter: WorkMeter,
) -> tuple[float, Layout, dict[str, Decision]] | None:
    """The descent (`descend`, within `WorkMeter.deadline`) from a fixed strategy's
    `layout`, or None when the search cannot hold that layout as it is: a unit whose
    tables the strategy placed apart, or a kind or grid outside a unit's constraints.
    Never slower than the layout itself."""
    decisions: dict[str, Decision] = {}
    for u in units:
        p = layout.get(u.tables[0])
        if p is None or p.cells_explicit is not None:
            return None
        d = decision_of(p)
        if d.kind not in u.kinds:
            return None
        if d.kind != "dp":
            if not (u.min_r <= d.r <= u.max_r and u.min_c <= d.c <= u.max_c):
                return None
            if u.within_node and len({r // cm.G for r in p.ranks}) > 1:
                return None
        decisions[u.name] = d
    search = Search(cm, units, progress, True, ub_comm, meter=meter)
    try:
        search.adopt(decisions, layout)
    except NoRoom:
        return None  # a replica finds no room beside the cells, by the search's count
    if set(search.layout) != set(layout) or any(search.layout[t] != p for t, p in layout.items()):
        return None  # the search lays out a unit's grid otherwise (a colocated group)
    adopted = (search.state.step_time(), dict(search.layout), dict(search.decisions))
    found = descend(search, limit)
    if found[0] < adopted[0] * (1 - 1e-9) and fits_exactly(cm, found[1]):
        return found
    return adopted


def _cut_refusal(refused: EmbarkError, tried: int, starts: int) -> EmbarkError:
    """`refused` (the last start's), saying that the time limit left starts untried, or
    cut the last one short (`tried == starts`)."""
    first, *rest = refused.diagnostics
    untried = starts - tried
    message = (
        f"the time limit ended the search after {tried} of its {starts} starts, and none of "
        f"them fits; the last one: {first.message}"
    )
    longer = (
        f"a longer --time-limit tries the {untried} other start{'s' if untried != 1 else ''}"
        if untried
        else "a longer --time-limit lets the last start split its tables further"
    )
    hint = longer + (f"; {first.hint}" if first.hint else "")
    # not a NoFit: a longer limit may find room in HBM, which the host tier must not take
    return EmbarkError([replace(first, message=message, hint=hint), *rest], refused.sources)
