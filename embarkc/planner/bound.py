"""A lower bound on the step time of every plan of a program, by the cost model.

The step time is the slowest rank's time, so it is at least the mean rank's time, and the
mean is the program's total work (over all ranks) spread evenly, plus the fixed
latencies every rank pays. The total work of a table does not depend on where its cells
go, only on its kind, grid and communication, and it never falls below what its smallest
allowed grid costs:

* HBM: splitting rows writes one more pooled partial per sample and row shard, splitting
  columns reads the keys once more per cell and pads narrow rows to a 64-byte access;
  the ids, distinct rows and updates divide exactly. So the fewest row and column shards
  the spec allows (`Unit.min_r`, `Unit.min_c`) cost the least, columns cut as evenly as
  the 4-column granularity allows (the padding is convex in the width).
* Links: a rank's time on a link is its busier direction, at least its share of the
  bytes every rank sends; a flat rb cell sends `(W - G)` partials over the network
  whichever rank owns it, a hierarchical one one per (column range, node), least when
  its row shards share a node.
* Keys: only what outlasts the dense compute window counts; that is convex in a rank's
  key time, so the mean rank pays at least the total key time over `W` less the window.
* dp: the gradient exchange is the same on every rank.

Every table takes the cheapest of its allowed options (rb flat or hierarchical, ub flat
or hierarchical, dp with either gradient exchange when one replica fits a GPU), and the
latencies and kernel launches depend only on which kinds of cluster the plan has: the
bound is the least over those sets of kinds. It ignores memory beyond that and the
balance of the cells, so no plan can be faster than it, and a plan whose work is spread
perfectly evenly would reach it. The expected distinct ids of a row shard come from the
same statistics the cost model uses (exact head, integrated tail), whose sums over row
shards match the whole table's to within the integration's accuracy (6e-7 relative at
worst on the paper workloads, tests/test_planner_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from embarkc.planner.clusters import Unit, dp_bytes, units_of
from embarkc.planner.cost import HUB_HBM, CostModel, RankState
from embarkc.planner.types import Placement, column_widths

if TYPE_CHECKING:
    from embarkc.planner.budget import WorkMeter

CATEGORIES = ("rb_flat", "rb_hier", "ub", "ub_hier", "dp")
"""The kinds of cluster whose presence decides a rank's latencies (`RankState.counts`)."""


@dataclass(frozen=True)
class LowerBound:
    step_time: float
    """Seconds: no plan of the program is faster by the cost model."""
    kinds: tuple[str, ...]
    """The set of cluster kinds (of CATEGORIES) the bound was reached with."""
    work: float
    """Seconds of the mean rank's work (HBM, links, dp exchange) in that set."""
    keys: float
    """Seconds of the mean rank's keys beyond the dense compute window."""
    fixed: float
    """Seconds of latencies and kernel launches every rank pays in that set."""


def _options(cm: CostModel, u: Unit, name: str) -> list[tuple[str, Placement]]:
    """The table's cheapest placement of each allowed kind and communication, its cells
    all in node 0 (the totals do not depend on the ranks otherwise)."""
    tf = cm.facts[name]
    out: list[tuple[str, Placement]] = []
    r = u.min_r
    c = min(u.min_c, max(1, tf.dim // 4))
    widths = column_widths(tf.dim, c)
    ranks = tuple(j % cm.G for j in range(r) for _ in range(c))
    for kind in u.kinds:
        if kind == "dp":
            single = Unit((name,), ("dp",), 1, 1, 1, 1, False)
            if dp_bytes(cm, single) > cm.capacity:
                continue
            for exchange in ("dense", "sparse"):
                out.append(("dp", Placement("dp", exchange=exchange)))  # type: ignore[arg-type]
            continue
        for comm in ("flat", "hierarchical"):
            p = Placement(kind, r, widths, ranks, communication=comm)  # type: ignore[arg-type]
            if kind == "rb":
                out.append(("rb_hier" if comm == "hierarchical" else "rb_flat", p))
            elif comm == "flat":
                out.append(("ub", p))
            elif cm.nodes > 1:
                out.append(("ub_hier", p))
    return out


def _totals(
    cm: CostModel, name: str, p: Placement, meter: WorkMeter | None = None
) -> tuple[float, float, float]:
    """(work, keys, held): the seconds table `name` placed as `p` adds to the sum over
    ranks of their HBM, link and dp exchange time and of their key link time, and the
    bytes it adds to the sum of their memory (weights, state, buffers)."""
    W = cm.W
    if p.kind == "dp":
        # a replica on every rank and its gradient exchange, nothing on the all-to-all
        # links: what `RankState` sums for it, to the bit, without its per-rank arrays
        dv = cm.dp_values(cm.facts[name], p.exchange)
        held = W * (dv.weights + dv.state + dv.buf)
        return W * dv.hbm / cm.bw_hbm + W * dv.exchange_time, 0.0, held
    st = RankState(cm, meter)
    st.add_table(name, p, 1.0)
    held = float(st.memory().sum())
    hbm = float(st.hbm_own.sum()) + W * st.hbm_all
    if st.counts["ub_hier"]:
        hbm += float(st.aggregator(HUB_HBM).sum())
    work = hbm / cm.bw_hbm + W * st.dp_time
    keys = 0.0
    if W > 1:
        lk = st.links()

        def total(link: str) -> float:
            sent, recv = lk[link]
            return max(0.0, min(float(sent.sum()), float(recv.sum())))

        # forward and backward move the same bytes over each link
        work += 2.0 * (total("res_intra") / cm.bw_intra + total("res_inter") / cm.bw_inter)
        keys = total("dist_intra") / cm.bw_intra + total("dist_inter") / cm.bw_inter
    return work, keys, held


def _fixed(cm: CostModel, kinds: tuple[str, ...], meter: WorkMeter | None) -> float:
    """The mean rank's latencies and kernel launches when the plan has these kinds."""
    st = RankState(cm, meter)
    for k in kinds:
        st.counts[k] = 1
    return float(st.times().mean())


_UnitOptions = list[tuple[Unit, list[list[tuple[str, float, float, float]]]]]
"""Each unit with, per table, its options as (category, work, keys, held): `_totals`."""


def unit_options(cm: CostModel, meter: WorkMeter | None = None) -> _UnitOptions:
    """Each unit with, per table, its options as (category, work, keys, held). With a
    `meter` (a plan's search), costed once per plan and kept on the meter, counted the
    first time: shared by the greedy's bound start (of programs of up to 300 units) and
    the plan's bound (1.8 s on 5,000 generated tables). Without one, costed afresh and
    counted nowhere."""
    if meter is None:
        return _cost_options(cm, None)
    if meter.bound_options is None:
        meter.bound_options = _cost_options(cm, meter)
    return meter.bound_options  # type: ignore[no-any-return]


def _cost_options(cm: CostModel, meter: WorkMeter | None) -> _UnitOptions:
    out: _UnitOptions = []
    seen: dict[tuple[object, ...], list[tuple[str, float, float, float]]] = {}
    for u in units_of(cm):
        rows = []
        for name in u.tables:
            # tables of equal costs (`TableFacts.cache_key`) and bounds share their options
            key = (cm.facts[name].cache_key(u.min_r), u.kinds, u.min_r, u.min_c)
            got = seen.get(key)
            if got is None:
                got = [(cat, *_totals(cm, name, p, meter)) for cat, p in _options(cm, u, name)]
                seen[key] = got
            rows.append(got)
        out.append((u, rows))
    return out


def lower_bound(cm: CostModel, meter: WorkMeter | None = None) -> LowerBound:
    """The least step time any plan of `cm.program` can have by the cost model `cm`
    (`meter`: the plan's, whose options the greedy's bound start may have costed)."""
    return _lower_bound(cm, unit_options(cm, meter), meter)


def _lower_bound(cm: CostModel, units: _UnitOptions, meter: WorkMeter | None) -> LowerBound:
    rows = [opts for _, per_table in units for opts in per_table]
    W = cm.W
    # per table and category, its least work and least keys (inf: not allowed); a kind
    # set's table takes the least of each over the set's categories
    col = {c: i for i, c in enumerate(CATEGORIES)}
    least_work = np.full((len(rows), len(CATEGORIES)), np.inf)
    least_keys = np.full((len(rows), len(CATEGORIES)), np.inf)
    for i, opts in enumerate(rows):
        for cat, w, k, _ in opts:
            j = col[cat]
            least_work[i, j] = min(least_work[i, j], w)
            least_keys[i, j] = min(least_keys[i, j], k)
    best: LowerBound | None = None
    for size in range(1, len(CATEGORIES) + 1):
        for kinds in combinations(CATEGORIES, size):
            cols = [col[c] for c in kinds]
            works = least_work[:, cols].min(axis=1)
            if not np.isfinite(works).all():
                continue  # a table with no option in the set
            # summed in table order, as floats add (the bound is the same to the bit
            # whatever the vector sum's order would give)
            work = sum(works.tolist(), 0.0)
            keys = sum(least_keys[:, cols].min(axis=1).tolist(), 0.0)
            beyond = float(cm.keys_beyond_window(np.array([keys / W]))[0])
            fixed = _fixed(cm, kinds, meter)
            t = work / W + beyond + fixed
            if best is None or t < best.step_time:
                best = LowerBound(t, kinds, work / W, beyond, fixed)
    assert best is not None, "every table has an allowed option"
    return best


def least_memory(cm: CostModel, meter: WorkMeter | None = None) -> float:
    """Bytes a GPU holds at least on average in any plan of `cm.program`: every table's
    weights, optimizer state and buffers (its cells' and those every rank keeps for it)
    in its allowed option that holds the least, summed over all ranks and spread evenly,
    so the fullest GPU holds at least that. As with the work, a table's smallest allowed
    grid holds the least of its kind: a row split adds a partial per sample and row shard
    to the buffers, a column split the keys per cell (and rowwise_adagrad's row state per
    cell); a dp table is one replica on every GPU. From the options the bound costs
    (`unit_options`), costed aside and counted nowhere; memoised on `cm`."""
    if cm.least_held is None:
        total = 0.0
        for _, per_table in unit_options(cm, meter):
            for opts in per_table:
                total += min(held for _, _, _, held in opts)
        cm.least_held = total / cm.W
    return cm.least_held


def bound_categories(cm: CostModel, meter: WorkMeter | None = None) -> dict[str, str]:
    """Each unit's category (of CATEGORIES) in the kind set the lower bound is reached
    with: the one of that set in which the unit's tables cost least work over all ranks
    (their keys, then the order of CATEGORIES, break ties). A plan of these kinds whose
    work were spread evenly would reach the bound, so it is a start for the search
    (`greedy.bound_start`) that no single unit's move reaches when the kinds share a
    cluster's fixed costs: on DLRM-DCNv2 at 16 x 8 GPUs the ten smallest tables dp and the
    others rb, where each table alone is cheaper as rb than in a dp cluster of its own."""
    units = unit_options(cm, meter)
    lb = _lower_bound(cm, units, meter)
    out: dict[str, str] = {}
    for u, per_table in units:
        best: tuple[float, float, int] | None = None
        for i, cat in enumerate(CATEGORIES):
            if cat not in lb.kinds:
                continue
            work = keys = 0.0
            for opts in per_table:
                allowed = [(w, k) for c, w, k, _ in opts if c == cat]
                if not allowed:
                    break
                w, k = min(allowed)
                work, keys = work + w, keys + k
            else:
                if best is None or (work, keys, i) < best:
                    best = (work, keys, i)
                    out[u.name] = cat
    return out
