"""The starts of the greedy search: each unit's kind, grid and communication before
the descent (the kinds the cost model prefers per unit, all sharded, hierarchical, column
cuts, the lower bound's kinds, the column-wise strategy's grids).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from embarkc.planner.baselines import column_wise_cells
from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    Unit,
    default_comm,
    dp_total_seconds,
    initial_grid,
    initial_kinds,
    sharded_total_seconds,
)
from embarkc.planner.cost import CostModel
from embarkc.planner.search.place import Decision, unit_cells
from embarkc.planner.search.tuning import FOUR_START_UNITS


def start_of(
    cm: CostModel, units: list[Unit], choose: Callable[[Unit], str], ub_comm: str
) -> dict[str, Decision]:
    """Each unit on its `choose`n kind and initial grid, ub with `ub_comm`."""
    out: dict[str, Decision] = {}
    for u in units:
        k = choose(u)
        if k == "dp":
            out[u.name] = Decision("dp")
        else:
            r, c = initial_grid(cm, u)
            out[u.name] = Decision(k, r, c, kind_comm(cm, k, ub_comm))
    return out


def kind_comm(cm: CostModel, kind: str, ub_comm: str) -> str:
    """The communication of a sharded unit of `kind` in a search whose ub is `ub_comm`."""
    return ub_comm if kind == "ub" else default_comm(cm, kind)


def kind_of(kinds: dict[str, str], u: Unit) -> str:
    return kinds[u.name]


def ub_worlds(
    cm: CostModel, units: list[Unit], known: dict[str, dict[str, str]] | None = None
) -> tuple[str, str | None]:
    """(the ub communication of the search's starts, the other one whose first starts are
    also searched, or None). Where the spec leaves it to the planner on several nodes:
    programs of up to FOUR_START_UNITS units search every start with flat ub and a few
    with hierarchical ub; larger ones one communication (`choose_ub_comm`)."""
    default = default_comm(cm, "ub")
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return default, None
    if not any("ub" in u.kinds for u in units):
        return default, None
    if len(units) <= FOUR_START_UNITS:
        return "flat", "hierarchical"
    return choose_ub_comm(cm, units, known), None


def choose_ub_comm(
    cm: CostModel, units: list[Unit], known: dict[str, dict[str, str]] | None = None
) -> str:
    """The communication of every ub unit of a large program's search: the spec's, or
    under `auto` on several nodes the one whose first start (the kinds the cost model
    prefers for each unit alone with that ub) has less work over all ranks, the work the
    descent then balances. One unit's move to the other communication cannot show what all
    of them gain (a second cluster costs its own collectives), so the search keeps one.
    On T510 at 128 GPUs hierarchical ub (4.709 -> 4.405 ms). `known` receives the
    starting kinds of each communication."""
    default = default_comm(cm, "ub")
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return default
    if not any("ub" in u.kinds for u in units):
        return default
    work = {}
    for comm in ("hierarchical", "flat"):
        kinds = initial_kinds(cm, units, ub_comm=comm)
        if known is not None:
            known[comm] = kinds
        total = 0.0
        for u in units:
            k = kinds[u.name]
            if k == "dp":
                total += dp_total_seconds(cm, u)
            else:
                total += sharded_total_seconds(cm, u, k, *initial_grid(cm, u), ub_comm=comm)
        work[comm] = total
    return min(work, key=lambda c: (work[c], c != default))


def column_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision], share: float
) -> dict[str, Decision]:
    """`start` with every sharded unit whose owner work (`owner_seconds`) exceeds `share`
    of a rank's fair share (the owners' total work over the ranks) cut into enough
    column shards, within its bounds, that each cell is about that size.

    With the keys hidden under the dense compute a column cut adds no owner work (every
    column cell's owner receives the keys, which hide; the results are split, not
    copied, and each cell's HBM work falls with its width), and small cells let the
    heaviest-first placement pack the ranks closely. Row cuts are not used: each row
    shard adds a partial vector per sample."""
    out = dict(start)
    loads = {
        u.name: float(unit_cells(cm, u, start[u.name])[0].sum())
        for u in units
        if start[u.name].kind != "dp"
    }
    piece = share * sum(loads.values()) / cm.W
    if piece <= 0:
        return out
    for u in units:
        if u.name not in loads:
            continue
        d = start[u.name]
        c = min(u.max_c, max(d.c, math.ceil(loads[u.name] / (piece * d.r))))
        if c != d.c:
            out[u.name] = replace(d, c=c)
    return out


def fine_column_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision]
) -> dict[str, Decision]:
    """`start` with every unit that may be rb cut as the column-wise strategy cuts its
    tables (`baselines.column_wise_cells`; the fewest of a colocated group's tables,
    within the unit's bounds): rb with its starting communication, the fewest row shards
    allowed. Units that may not be rb keep `start`'s decision."""
    out = dict(start)
    tables = cm.program.table_by_name
    for u in units:
        if "rb" not in u.kinds:
            continue
        c = min(column_wise_cells(tables[n], cm.W) for n in u.tables)
        c = max(u.min_c, min(u.max_c, c))
        out[u.name] = Decision("rb", u.min_r, c, default_comm(cm, "rb"))
    return out


def hierarchical_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision]
) -> dict[str, Decision] | None:
    """`start` with every rb unit hierarchical, and twice the row shards for each rb unit
    whose owner work (`owner_seconds`, hierarchical) exceeds the mean per rank of all rb
    units' owner work, for programs of several nodes whose spec leaves the communication to
    the planner and of at most FOUR_START_UNITS units (planning time); None otherwise.
    Each node's NICs then share what its owners send, and a row-split table's partials are
    summed in the node before they cross the network (T180 on 128 GPUs: 6.42 -> 5.98 ms)."""
    if cm.nodes == 1 or cm.program.options.communication != "auto":
        return None
    if len(units) > FOUR_START_UNITS:
        return None
    by_name = {u.name: u for u in units}
    hier = {n: replace(d, comm="hierarchical") if d.kind == "rb" else d for n, d in start.items()}
    loads = {
        u.name: float(unit_cells(cm, u, hier[u.name])[0].sum())
        for u in units
        if hier[u.name].kind == "rb"
    }
    # a unit heavier than a rank's fair share of the owners' work cannot be balanced
    # whole; split in rows on its node, its partials are summed before the network
    fair = sum(loads.values()) / cm.W
    for name, load in loads.items():
        d = hier[name]
        if load > fair and 2 * d.r <= by_name[name].max_r:
            hier[name] = replace(d, r=2 * d.r)
    return hier


def bound_start(
    cm: CostModel, units: list[Unit], start: dict[str, Decision], meter: WorkMeter | None = None
) -> dict[str, Decision] | None:
    """Every unit on the kind and communication of its category in the lower bound's
    kind set (`bound.bound_categories`; the spec's communication where it names one) and
    its initial grid, for programs of at most FOUR_START_UNITS units (planning time);
    units without one keep `start`'s decision. None when the set has both flat and
    hierarchical ub (a search shares one ub communication).

    The other starts choose each unit's kind alone, and a descent moves one unit's kind
    at a time, so neither reaches a plan in which several tables share a cluster whose
    fixed costs (its collectives' latencies) none of them pays for alone: on DLRM-DCNv2
    at 16 x 8 GPUs the ten smallest tables replicated (dp) and the rest rb, no ub
    cluster (0.633 -> 0.558 ms with its column starts)."""
    if len(units) > FOUR_START_UNITS or cm.W == 1:
        return None
    from embarkc.planner.bound import bound_categories

    cats = bound_categories(cm, meter)
    auto = cm.program.options.communication == "auto"
    if auto and "ub" in cats.values() and "ub_hier" in cats.values():
        return None
    out = dict(start)
    for u in units:
        cat = cats.get(u.name)
        if cat is None:
            continue
        if cat == "dp":
            out[u.name] = Decision("dp")
            continue
        kind, _, comm = cat.partition("_")
        r, c = initial_grid(cm, u)
        if auto:
            comm = "hierarchical" if comm == "hier" else "flat"
        else:
            comm = default_comm(cm, kind)  # the spec's communication
        out[u.name] = Decision(kind, r, c, comm)
    return out
