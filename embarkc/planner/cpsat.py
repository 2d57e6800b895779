"""CP-SAT refinement of the greedy plan (OR-tools): grids and placements, warm-started.

The refinement re-decides, for a neighbourhood of units (tables or colocate groups) and
ranks, both each unit's grid (kind, row shards, column cuts, rb communication) among a
few options around its current one, and the rank of every cell of the chosen option.
Model of one neighbourhood (times in integer nanoseconds, memory in bytes):

    y[o]      option o of a free unit is chosen
    x[c, a]   cell c of option o is on rank a (a free rank)
    S[l, n]   what the cells placed on node n put on the far side of link l
    H[l, r]   what the hierarchical ub cells placed on rail r put on a side of link l
    z[l, a]   seconds of all-to-all link l (keys or results, intra or inter node) on rank a
    T         the makespan of the free ranks
    P[g]      phase g (cost.PHASE_GROUPS) at its slowest rank, free or outside

    one option per free unit:                 sum_o y[o] == 1
    a chosen option's cells are placed once:  sum_a x[c, a] == y[o]
    the far side per node:                    S[l, n] == sum_{c, a on n} w_lc x[c, a]
    a link costs its busier side:             z[l, a] >= V_l(a) + sum_c v_lc x[c, a] + Hn[l, rail a]
      intra-node links:                       z[l, a] >= F_l(a) + S[l, node a] - sum_c w_lc x[c, a] + hub
      inter-node links:                       z[l, a] >= F_l(a) + sum_n S[l, n] - S[l, node a] + hub
      hub (hierarchical ub cells):            sum_r Ht[l, r] + Hr[l, rail a] + sum_c e_lc x[c, a]
    a rank's time is below T:                 base_a + sum_o U_o y[o] + sum_c h_c x[c, a] + sum_l z[l, a]
                                              + R[rail a] - sum_c g_c x[c, a] <= T
    aggregators per rail (hierarchical ub):   R[l] == sum_{c, a on rail l} g_c x[c, a]
    the ranks outside stay below the step time:  max_b t_b + sum_o (U_o - U_cur) y[o] <= max_a t_a
    memory fits on every rank:                mem_a + sum_o M_o y[o] + sum_c m_c x[c, a] <= capacity
    within_node and hierarchical rb units stay on their node:  x[c, a] == 0 for a off it
    few grids change at once:                 sum_u (1 - y[current option of u]) <= 2
    the critical path stays within the greedy plan's:  P[g] >= phase g of each free rank
                                              (its part of the rank's time above),
                                              P[g] >= phase g outside now + options' change,
                                              sum_g P[g] <= critical path of the greedy plan
    no rank's keys beyond the greedy plan's busiest:  z[dist_intra, a] + z[dist_inter, a] <= K
    minimise T, then the number of changes; hints: the current plan (a complete solution)

This is the full cost model (`cost.RankState`) around the current plan. `h_c` is a
cell's HBM work on its owner; `v_lc` its owner's side of link l (keys received, results
sent forward and backward); `w_lc` what it puts on the far side of one rank that talks to
it (keys that rank sends it, results that rank receives from it): the ranks of its node
over NVLink, the others over the network. Hierarchical ub cells talk along rails instead
(`RankState.links`): every rank off the owner's rail sends its keys and receives the
vectors over NVLink, to the owner or to its node's aggregator (the rank with the owner's
local index); the aggregators send their node's keys and receive the vectors over the
network; the owner and each aggregator serve their own node over NVLink. So their terms
are summed per rail over the free ranks (`H`: Hn on the owner side of the rail's ranks,
Ht on every rank's other side and Hr less on its rail's, Hr on the other side of the
rail's aggregators and `e_lc` less on the owner). `g_c` is the HBM work a hierarchical
ub cell puts on each of its aggregators, summed per rail over the free ranks (`R`).
`V_l(a)` and `F_l(a)` are the two sides of the
cells that do not move (links are full duplex: `max(sent, received)`, as the cost model
says), so a cell that moves changes the far side of every free rank it talks to, its old
node's and its new one's. `U_o` is what the option adds to every rank besides owner HBM
work and links (requester lookups of dp tables, kernel launches, latencies, the dp
exchange): the change of that shared part in the full model when the option replaces the
unit's current one. `base` is calibrated so that the model gives the current plan exactly
the full model's rank times. The phases split the same terms: HBM work (the aggregators'
too) in the lookups, the key links beyond the window in the keys, the result links in the
results, `U_o` measured per phase (`_Option.uni_phase`), each phase with its own
calibrated base, so that the current plan gets exactly its phase times. What is not
exact: the ranks outside (their far sides are not variables), keys of several cells of
one row shard on one rank (the full model sends them once) and options measured one at a
time. Every solution is re-costed by the full
model and accepted when it lowers the 16-norm of the rank times (the greedy's descent
criterion) or the step time, its critical path (`RankState.critical_path`) is at most
the greedy plan's and no rank's key all-to-all (`RankState.key_seconds`) is longer than
the greedy plan's longest: CP-SAT may not buy a shorter step with phases that wait longer
for their slowest rank (`CRIT_SLACK`), nor move keys the dense compute window hides onto
fewer ranks (`KEY_CAP`). The makespan a solve reports is the model's value of its
solution (every link at the larger of its bounds): `T` and the `z` are only bounded
below, and a solve that stops within its gap may leave them above it.

Neighbourhoods (large-neighbourhood search), of two kinds in turn: the critical rank, the
ranks of the units on it, the lightest ranks and seeded random others; or the same
around the critical rank and a few other ranks that share the maximum (the plateau: a
plan whose top ranks tie cannot lower its step time by relieving one of them), with the
slowest rank of each phase (where the cap on the critical path binds). The free
units are those whose cells all lie there, plus a few dp units; units spread further
keep their grid, and their cells on the free ranks may move among them. When CP-SAT
has proven GROW_AFTER neighbourhoods in a row to hold nothing faster, the neighbourhoods
double (ranks and units, up to MAX_SCALE times). Small programs are solved whole (every
unit, every rank).
The search stops when it stalls: after LNS_AT_LIMIT neighbourhoods in a row that end at
their deterministic limit without a better plan (CP-SAT found nothing faster there and
could not prove there is nothing; a proven neighbourhood ends the run, as it counts
towards growing them), or after LNS_STALL neighbourhoods of any kind without one. Both
are counts of neighbourhoods and their solvers' statuses at a deterministic limit, so
the stop, like the plan, does not depend on the clock. A whole-program model is not a
neighbourhood: the first rule leaves it to its doubling limits.
Each solve uses one worker and `max_deterministic_time`. The time limit is spent in a
deterministic count of work: every neighbourhood costs its solver's deterministic time
and the size of its model, at the CPU seconds they took on the development machine
(`SECONDS_PER_DET`, `SECONDS_PER_VAR`, `SECONDS_PER_OPTION`), so a fixed seed gives the
same plan and the refinement ends near its limit in CPU time. A whole-program solve
that ends at its deterministic limit without a better plan is repeated with twice the
limit; one the solver proves optimal without a better plan ends the search.
The refinement returns the greedy layout unless it found a strictly faster one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embarkc.planner.clusters import Unit, default_comm, initial_grid
from embarkc.planner.cost import HUB_HBM, CostModel, RankState, phase_times
from embarkc.planner.search import (
    P_NORM,
    Decision,
    GreedyResult,
    decision_of,
    unit_cells,
)
from embarkc.planner.types import Layout, Placement

LNS_RANKS = 4
"""Ranks of a neighbourhood besides the critical rank and the ranks of its units: the
lightest half of them, and seeded random others."""

MAX_RANKS = 8
"""Most ranks of the critical rank and its units in one neighbourhood (the units join
while their ranks fit; LNS_RANKS more join after them). Small neighbourhoods: the
greedy's rebalance leaves no single-cell move, and CP-SAT finds the coordinated ones in
small models within its 0.25 deterministic seconds, not in large ones. With 4 and 8
(CP-SAT 30 s; in brackets with the former 8 and 16): T510 on 32 GPUs 13.750 -> 13.574
ms (13.687), T200 on 32 9.605 -> 9.577 (greedy kept), on 128 3.112 -> 3.111 (kept), T180
on 8 37.023 -> 37.008 (kept); 4 and 12 were nowhere better than 4 and 8."""

WHOLE_RANKS = 16
"""Programs of at most WHOLE_UNITS units on at most this many ranks are solved whole."""

MAX_FREE_UNITS = 32
"""Most units whose grid and placement one neighbourhood re-decides."""

DP_FREE_UNITS = 2
"""dp units freed per neighbourhood (their option of becoming sharded)."""

WHOLE_UNITS = 32
"""Programs of at most this many units on at most WHOLE_RANKS ranks are solved whole."""

MAX_CELL_VARS = 12000
"""Most cell-to-rank booleans in one model: options beyond it are left out."""

MAX_GRID_CHANGES = 2
"""Most units whose option changes in one neighbourhood. What an option adds to every
rank (U_o) is measured alone, and a larger search space costs solve time: with 4, the
whole-program solve of DCNv2 on 8 GPUs found nothing within 30 s and T200 on 8 GPUs came
out slower (19.595 -> 19.624 ms), while T510 on 32 came out faster (14.852 -> 14.834)."""

CRIT_SLACK = 0.0
"""How far above the greedy plan's critical path a refined plan's may lie (fraction; inf
lifts the cap). Without the cap, T180 on 16 x 8 GPUs refined to 4.146 ms with a critical
path of 4.661 (greedy 4.178 and 4.581); with it 4.141 and 4.463 (4.174 and 4.518 with
KEY_CAP too); with 0.5 % slack 4.164 and 4.513 (CP-SAT 30 s, the plan command with its
phase pass after). A tolerance of 200 ns
on the model's cap (its rounding) made DCNv2 on 128 GPUs 0.2 % faster and T180 0.2 %
slower: none."""

KEY_CAP = True
"""No rank of a refined plan has more key all-to-all time than the greedy plan's busiest
rank. The dense compute window hides the keys up to its length, so the model alone lets
CP-SAT pile them on some ranks for nothing; a faster dense part or a slower network than
the constants assume then shows them."""

PHASE_RANKS = True
"""In plateau neighbourhoods the slowest rank of each phase (`cost.PHASE_GROUPS`) joins
the free ranks: the cap on the critical path binds at the phase maxima, and a
neighbourhood that cannot lower them cannot move work onto their ranks' phases. CP-SAT
30 s at 16 x 8 GPUs: T180 4.174 -> 4.156 ms (critical path 4.518 -> 4.414, with the keys
in full 7.507 -> 7.004), T200 3.104 -> 3.103; at 4 x 8 T180 14.324 -> 14.313, DCNv2 1.193
-> 1.195; on one node T510 16.940 -> 16.925, T200 18.928 -> 18.938. In every
neighbourhood instead: T180 4.164, T200 3.107, DCNv2 at 4 x 8 1.195."""

PLATEAU = 2e-3
"""Ranks within this fraction of the step time share the maximum (the plateau)."""

PLATEAU_RANKS = 3
"""Plateau ranks that join the critical rank in one neighbourhood."""

GROW_AFTER = 4
"""Consecutive neighbourhoods that CP-SAT proves hold nothing faster (optimal at the
current plan) after which the neighbourhoods double (ranks and units), up to MAX_SCALE
times the first size: the small ones are exhausted, and time is left."""

MAX_SCALE = 4
"""Most times the first size a neighbourhood grows to (64 ranks, 128 units)."""

LNS_STALL = 40
"""Consecutive neighbourhoods without a better plan (of any status) after which the
search stops."""

LNS_AT_LIMIT = 4
"""Consecutive neighbourhoods that end at their deterministic limit without a better plan
(CP-SAT's status feasible or unknown: it neither found a faster plan nor proved there is
none) after which the search stops. A neighbourhood proven to hold nothing faster ends
the run: it counts towards growing them (GROW_AFTER), and proven ones are cheap. CP-SAT
at the plan command's default 30 s, 2026-12-08 (bench/RESULTS.md): T510 at 16 x 8 GPUs
ran 10 neighbourhoods to their limit without a better plan (0 kept); T200 there kept 3
of 8, at most 3 in a row at the limit between them; T180 on one node found its last
gain after 7 in a row (36.9967 -> 36.9944 ms, which 4 gives up: 1.00006x the step time);
DCNv2 at 16 x 8 went 13 neighbourhoods without a better plan, 4 of them at the limit and
never more than 1 in a row, before its neighbourhoods grew and gained 0.25 %. So 4
keeps every other gain at 16, 4 and 1 x 8 GPUs and stops T510 after 4 neighbourhoods;
counting every neighbourhood without a better plan, any count that kept DCNv2's gain
(14 or more) would have let T510 run to its limit."""

SECONDS_PER_DET = 7.0
"""CPU seconds per deterministic second of CP-SAT's search (without presolve) on the
2-core development machine. It depends on the model: with column-cut units (the
greedy's column start) T200 on 128 GPUs took 6.4 s alone and 7.1-9.0 s with another
job on the second core, DCNv2 on 32 GPUs 5.0-7.5 s, T180 on 128 GPUs 1.9 s; the
largest models decide, so that the plan command stays within its time limit."""

SECONDS_PER_VAR = 1e-4
"""CPU seconds of building one boolean of a neighbourhood model and its terms (about
nine terms each): 85,354 booleans took 9.4 s on T200 on 128 GPUs, 108,156 took 10.3 s on
DCNv2 on 32 (with another job on the second core)."""

SECONDS_PER_OPTION = 1.5e-3
"""CPU seconds of measuring one grid option in the full model (its U_o)."""

LNS_STEP_DET = 0.25
"""Deterministic seconds of solver work per neighbourhood."""

WHOLE_STEP_DET = 1.0
"""Deterministic seconds per solve when the program is solved whole."""

TIME_SCALE = 1e9
"""Integer model time unit: nanoseconds."""

LINKS = ("dist_intra", "dist_inter", "res_intra", "res_inter")
"""All-to-all links whose time is max(sent, received): the owner side varies with the
placement, the other side is taken as it is in the current plan."""

PARTS = ("hbm", *LINKS)

HUB_KEYS = tuple(
    (cls, k)
    for cls, links in (
        ("near_rail", ("dist_intra", "res_intra")),
        ("far_tot", ("dist_intra", "res_intra")),
        ("far_rail", LINKS),
        ("far_own", ("dist_inter", "res_inter")),
    )
    for k in links
)
"""The (class, link) terms of hierarchical ub cells (`_Option.hub`)."""


@dataclass
class RefineResult:
    layout: Layout
    status: str
    """optimal | feasible | greedy (CP-SAT did not beat the greedy plan)."""
    objective: float | None
    """Makespan T of the last accepted neighbourhood model (seconds)."""
    bound: float | None
    """CP-SAT's lower bound on that makespan (seconds)."""
    deterministic_time: float
    """The work the search counted against its time limit (seconds; see the module
    docstring): deterministic, unlike the clock."""
    message: str
    neighbourhoods: int = 0
    """Neighbourhoods (or whole-program solves) the search ran."""
    stopped: str = "nothing"
    """Why the search stopped (`STOPS`)."""


STOPS = {
    "nothing": "nothing to refine",
    "limit": "its share of the time limit spent",
    "at-limit": f"{LNS_AT_LIMIT} neighbourhoods in a row at their deterministic limit without a "
    "better plan",
    "stall": f"{LNS_STALL} neighbourhoods in a row without a better plan",
    "proven": "CP-SAT proved that the whole-program model holds nothing faster",
}
"""Why the refinement stopped (`RefineResult.stopped`, the plan's `planner.stopped`), in
the words its message gives."""


@dataclass
class _Option:
    unit: Unit
    d: Decision
    templates: list[tuple[str, Placement]]
    load: np.ndarray
    """L_c, ns per cell (int64)."""
    mem: np.ndarray
    """m_c, bytes per cell (int64)."""
    uni_mem: int
    """M_o, bytes on every rank."""
    uni_load: int = 0
    """U_o (ns): what the option adds to every rank besides owner HBM work and links."""
    uni_phase: np.ndarray | None = None
    """U_o per phase group (`cost.PHASE_GROUPS`; ns, int64, shape (4,))."""
    parts: dict[str, np.ndarray] | None = None
    """Per cell (ns, int64): `hbm` (owner's HBM work) and the owner's side of each
    all-to-all link (`dist_intra`, `dist_inter`: keys received; `res_intra`,
    `res_inter`: results sent, forward and backward)."""
    other: dict[str, np.ndarray] | None = None
    """Per cell (ns, int64): what it puts on the other side of each link of one rank that
    talks to it: keys that rank sends it (`dist_*`), results that rank receives from it
    (`res_*`); intra-node links for the ranks of its node, inter-node for the others."""
    allowed: np.ndarray | None = None
    rail: np.ndarray | None = None
    """Per cell (ns, int64): the HBM work it puts on each of its aggregators (hierarchical
    ub: the ranks with its owner's local index on the other nodes). None when no cell has
    any."""
    hub: dict[tuple[str, str], np.ndarray] | None = None
    """Hierarchical ub cells (ns, int64, per cell): their terms in the links of the ranks
    that talk to them, which follow rails, not nodes (`RankState.links`), keyed by (class,
    link): `near_rail` on the owner side of every rank of the owner's rail (the owner's
    and its aggregators' NVLink: keys received, vectors sent), and on the other side
    `far_tot` on every rank, `far_rail` on every rank of the rail and `far_own` on the
    owner. None when the option has no such cell."""


def _norm(t: np.ndarray) -> float:
    m = float(t.max())
    return m * float(((t / m) ** P_NORM).sum()) ** (1.0 / P_NORM) if m > 0 else 0.0


def _per_byte(cm: CostModel, link: str) -> float:
    """Seconds per byte on the busier side of all-to-all `link`, as `RankState.components`
    counts it: results cross twice (forward and backward), keys once."""
    bw = cm.bw_intra if link.endswith("intra") else cm.bw_inter
    return (2.0 if link.startswith("res") else 1.0) / bw


def _shared_seconds(st: RankState) -> tuple[float, np.ndarray]:
    """The part of a rank's time that every rank shares (`_shared_parts`) at the rank
    where it is largest; and the same per phase group."""
    t, rest = _shared_parts(st)
    return float(t.max()), np.array([float(r.max()) for r in rest])


def _shared_parts(st: RankState) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Per rank, the part of its time that every rank shares (requester lookups of dp
    tables, kernel launches, fixed latencies, the dp exchange): its time less its owner
    and aggregator HBM work and its all-to-all links, which the model has as variables;
    and the same per phase group (`cost.PHASE_GROUPS`: each phase's time less its
    variable part)."""
    cm = st.cm
    lk = st.links()
    comp = st.components()
    own = st.hbm_own / cm.bw_hbm
    if st.counts["ub_hier"]:
        # the aggregators' HBM work: the model has it per rail (`R`), not shared
        own = own + st.aggregator(HUB_HBM) / cm.bw_hbm
    t = sum(comp.values(), np.zeros(cm.W)) - own
    keys = np.zeros(cm.W)
    res = np.zeros(cm.W)
    for k in LINKS:
        sent, received = lk[k]
        side = np.maximum(np.maximum(sent, received), 0.0) * _per_byte(cm, k)
        if k.startswith("dist"):
            keys = keys + side
        else:
            res = res + side
            t = t - side
    # the key phase counts only beyond the dense compute window (RankState.components)
    beyond = cm.keys_beyond_window(keys)
    ph = phase_times(comp)
    return t - beyond, (ph[0] - own, ph[1] - beyond, ph[2] - res, ph[3])


def _link_values(
    solver: Any, bounds: dict[str, tuple[Any, Any]], window_ns: int
) -> tuple[int, int]:
    """One rank's links in the solver's solution (ns), each at the larger of its two
    bounds: (the keys beyond the dense compute window, the results over both links)."""
    side = {
        k: max(int(solver.value(near)), int(solver.value(far))) for k, (near, far) in bounds.items()
    }
    keys = max(side["dist_intra"] + side["dist_inter"] - window_ns, 0)
    return keys, side["res_intra"] + side["res_inter"]


def _critical_path(
    solver: Any,
    phase_rows: dict[int, list[Any]],
    rank_exprs: dict[int, tuple[Any, dict[str, tuple[Any, Any]]]],
    phase_out: list[Any],
    window_ns: int,
) -> int:
    """The model's critical path in the solver's solution (ns): each phase at its largest
    over the free ranks (links at the larger of their bounds, `_link_values`) and the
    ranks outside (their phases now plus the options' changes)."""
    top = [int(solver.value(e)) if not isinstance(e, int) else e for e in phase_out]
    for a, rows in phase_rows.items():
        keys, results = _link_values(solver, rank_exprs[a][1], window_ns)
        vals = [int(solver.value(r)) if not isinstance(r, int) else r for r in rows]
        vals[1] += keys
        vals[2] += results
        top = [max(t, v) for t, v in zip(top, vals, strict=True)]
    return sum(top)


def _clone(st: RankState) -> RankState:
    out = copy.copy(st)
    for k, v in vars(st).items():
        if isinstance(v, np.ndarray):
            setattr(out, k, v.copy())
    out.counts = dict(st.counts)
    return out


def grid_options(cm: CostModel, u: Unit, d: Decision, max_cells: int) -> list[Decision]:
    """The decisions a neighbourhood may give unit `u` now at `d`: `d` itself first, one
    row shard more or fewer, one column cut more or fewer (cuts at any multiple of 4, not
    only powers of two), rows traded for columns, the other kinds and, for rb and ub on
    several nodes, the other communication. At most `max_cells` cells each."""
    out = [d]
    if d.kind == "dp":
        r, c = initial_grid(cm, u)
        out += [Decision(k, r, c, default_comm(cm, k)) for k in u.kinds if k != "dp"]
        return [o for o in out if o.kind == "dp" or o.r * o.c <= max_cells]
    grids = [
        (d.r + 1, d.c),
        (d.r - 1, d.c),
        (d.r, d.c + 1),
        (d.r, d.c - 1),
        (d.r - 1, d.c + 1),
        (d.r + 1, d.c - 1),
    ]
    for r, c in grids:
        if u.min_r <= r <= u.max_r and u.min_c <= c <= u.max_c and r * c <= max_cells:
            # one row shard has no partials to reduce in the node: flat, unless the spec
            # asks every rb cluster to be hierarchical (what `default_comm` says)
            comm = d.comm if r > 1 or d.kind == "ub" else default_comm(cm, "rb")
            out.append(Decision(d.kind, r, c, comm))
    for k in u.kinds:
        if k == "dp":
            out.append(Decision("dp"))
        elif k != d.kind:
            out.append(Decision(k, d.r, d.c, default_comm(cm, k)))
    mode = cm.program.options.communication
    if d.kind == "rb" and d.r > 1 and cm.nodes > 1 and mode == "auto":
        out.append(Decision("rb", d.r, d.c, "flat" if d.comm == "hierarchical" else "hierarchical"))
    if d.kind == "ub" and cm.nodes > 1 and mode == "auto":
        out.append(Decision("ub", d.r, d.c, "flat" if d.comm == "hierarchical" else "hierarchical"))
    return out


def _option(cm: CostModel, u: Unit, d: Decision) -> _Option:
    if d.kind == "dp":
        templates = []
        uni = 0.0
        for n in u.tables:
            ex = cm.best_exchange(cm.facts[n])
            dv = cm.dp_values(cm.facts[n], ex)
            uni += dv.weights + dv.state + dv.buf
            templates.append((n, Placement(kind="dp", exchange=ex)))  # type: ignore[arg-type]
        empty = np.zeros(0, dtype=np.int64)
        return _Option(
            u,
            d,
            templates,
            empty,
            empty,
            int(np.ceil(uni)),
            parts={k: empty for k in PARTS},
            other={k: empty for k in LINKS},
        )
    load, mem, templates = unit_cells(cm, u, d)
    uni = 0.0
    parts = {k: np.zeros(d.r * d.c) for k in PARTS}
    other = {k: np.zeros(d.r * d.c) for k in LINKS}
    rail = np.zeros(d.r * d.c)
    hub = {key: np.zeros(d.r * d.c) for key in HUB_KEYS}
    W, G = cm.W, cm.G
    for n, p in templates:
        cv = cm.grid_values(cm.facts[n], p)
        parts["hbm"] += cv.hbm_own / cm.bw_hbm
        uni += cv.buf_all
        if cv.node_dedup:
            # hierarchical ub: its node's requesters and one aggregator per other node
            # talk to the owner; every rank talks to the cell over NVLink (to the owner or
            # its aggregator); the aggregators (the owner's local index on the other
            # nodes) carry its network side and do its aggregation HBM work (`rail`)
            assert cv.dist_node is not None and cv.res_node is not None
            assert cv.agg_hbm is not None
            n1 = cm.nodes - 1
            rail += cv.agg_hbm / cm.bw_hbm
            kd = cv.dist / cm.bw_intra
            kn = cv.dist_node / cm.bw_inter
            vd = 2.0 * cv.res / cm.bw_intra
            vn = 2.0 * cv.res_node / cm.bw_inter
            # the owner receives its node's keys and sends its node the vectors over
            # NVLink, as each aggregator does for its own node (`near_rail`); over the
            # network it receives each aggregator's keys and sends it the vectors
            parts["dist_inter"] += n1 * kn
            parts["res_inter"] += n1 * vn
            hub[("near_rail", "dist_intra")] += (G - 1) * kd
            hub[("near_rail", "res_intra")] += (G - 1) * vd
            # every rank off the rail sends its keys and receives the vectors over NVLink
            # (to the owner or its node's aggregator); the aggregators send the keys and
            # receive the vectors over the network
            hub[("far_tot", "dist_intra")] += kd
            hub[("far_rail", "dist_intra")] -= kd
            hub[("far_tot", "res_intra")] += vd
            hub[("far_rail", "res_intra")] -= vd
            hub[("far_rail", "dist_inter")] += kn
            hub[("far_own", "dist_inter")] -= kn
            hub[("far_rail", "res_inter")] += vn
            hub[("far_own", "res_inter")] -= vn
            continue
        parts["dist_intra"] += (G - 1) * cv.dist / cm.bw_intra
        parts["dist_inter"] += (W - G) * cv.dist / cm.bw_inter
        other["dist_intra"] += cv.dist / cm.bw_intra
        other["dist_inter"] += cv.dist / cm.bw_inter
        if d.hierarchical and cm.nodes > 1:
            # partials for other nodes go to the rail peer inside the node; one summed
            # vector per column range leaves the node (a 1/r share per row shard cell:
            # all of them are on one node)
            parts["res_intra"] += 2.0 * cm.nodes * (G - 1) * cv.res / cm.bw_intra
            other["res_intra"] += 2.0 * cm.nodes * cv.res / cm.bw_intra
            other["res_inter"] += 2.0 * cv.res / cm.bw_inter / d.r
        else:
            parts["res_intra"] += 2.0 * (G - 1) * cv.res / cm.bw_intra
            parts["res_inter"] += 2.0 * (W - G) * cv.res / cm.bw_inter
            other["res_intra"] += 2.0 * cv.res / cm.bw_intra
            other["res_inter"] += 2.0 * cv.res / cm.bw_inter
    return _Option(
        u,
        d,
        templates,
        np.round(load * TIME_SCALE).astype(np.int64),
        np.ceil(mem).astype(np.int64),
        int(np.ceil(uni)),
        parts={k: np.round(v * TIME_SCALE).astype(np.int64) for k, v in parts.items()},
        other={k: np.round(v * TIME_SCALE).astype(np.int64) for k, v in other.items()},
        rail=np.round(rail * TIME_SCALE).astype(np.int64) if rail.any() else None,
        hub=(
            {key: np.round(v * TIME_SCALE).astype(np.int64) for key, v in hub.items()}
            if any(v.any() for v in hub.values())
            else None
        ),
    )


def _apply(st: RankState, o: _Option, ranks: np.ndarray, sign: float) -> None:
    for n, p in o.templates:
        q = p if o.d.kind == "dp" else p.with_ranks(tuple(int(r) for r in ranks))
        st.add_table(n, q, sign)


def _placed(o: _Option, ranks: np.ndarray) -> list[tuple[str, Placement]]:
    if o.d.kind == "dp":
        return list(o.templates)
    return [(n, p.with_ranks(tuple(int(r) for r in ranks))) for n, p in o.templates]


class _Refiner:
    """The current plan of the refinement: per unit its option and cell ranks."""

    def __init__(self, cm: CostModel, g: GreedyResult):
        self.cm = cm
        self.units = g.units
        self.by_name = {u.name: u for u in g.units}
        self.decision = {u.name: decision_of(g.layout[u.tables[0]]) for u in g.units}
        self.ranks = {
            u.name: np.asarray(g.layout[u.tables[0]].rank_list(), dtype=np.int64) for u in g.units
        }
        self.layout = dict(g.layout)
        self.state = cm.layout_state(self.layout)
        self.times = self.state.times()
        self._options: dict[tuple[str, Decision], _Option] = {}
        self.last_work = 0.0
        """Estimated CPU seconds of building the last neighbourhood's model."""
        self.crit_cap = (
            self.state.critical_path() * (1.0 + CRIT_SLACK) if np.isfinite(CRIT_SLACK) else np.inf
        )
        """The most critical path a plan of the refinement may have (seconds)."""
        self.key_cap = float(self.state.key_seconds().max()) if KEY_CAP else np.inf
        """The most key all-to-all time a rank may have (seconds): the greedy plan's
        busiest rank's (`KEY_CAP`)."""
        self.last_critical_path = 0.0
        """The model's critical path of the last solution (seconds; `_critical_path`)."""
        self.last_rank_times: dict[int, float] = {}
        """The model's time of each free rank in the last solution (seconds)."""

    def option(self, u: Unit, d: Decision) -> _Option:
        key = (u.name, d)
        o = self._options.get(key)
        if o is None:
            o = self._options[key] = _option(self.cm, u, d)
        return o

    def neighbourhood(
        self, rng: np.random.Generator, whole: bool, plateau: bool = False, scale: int = 1
    ) -> tuple[list[int], list[Unit], list[Unit]]:
        """Free ranks, free units (grid and placement re-decided) and partly free units
        (keep their grid; their cells on free ranks may move among them) of the next
        neighbourhood. With `plateau`, a few other ranks that share the maximum join the
        critical rank, and so does the slowest rank of each phase (`PHASE_RANKS`); `scale`
        multiplies the numbers of ranks and units."""
        cm = self.cm
        lns_ranks, max_ranks = LNS_RANKS * scale, MAX_RANKS * scale
        max_free = MAX_FREE_UNITS * scale
        if whole:
            return list(range(cm.W)), list(self.units), []
        t = self.times
        crit = int(np.argmax(t))
        free = {crit}
        # the plateau: the ranks that share the maximum (within PLATEAU), of which a
        # random few join the critical rank, so that the neighbourhood can lower all of
        # them at once
        if plateau:
            top = [int(a) for a in np.flatnonzero(t >= t[crit] * (1 - PLATEAU)) if int(a) != crit]
            if top:
                k = min(len(top), PLATEAU_RANKS)
                free |= {top[int(e)] for e in rng.choice(len(top), size=k, replace=False)}
        on_top = set(free)
        on_crit = [u for u in self.units if on_top & set(self.ranks[u.name].tolist())]
        on_crit.sort(key=lambda u: -float(self.option(u, self.decision[u.name]).load.sum()))
        for u in on_crit:
            more = free | set(self.ranks[u.name].tolist())
            if len(more) <= max_ranks:
                free = more
        if PHASE_RANKS and plateau and np.isfinite(self.crit_cap):
            # the slowest rank of each phase: the critical path's cap binds there
            for ph in phase_times(self.state.components()):
                if ph.max() > ph.min() * (1 + 1e-9):
                    free.add(int(np.argmax(ph)))
        order = [int(a) for a in np.argsort(t, kind="stable") if int(a) not in free]
        for a in order[: lns_ranks // 2]:
            free.add(a)
        rest = [a for a in order if a not in free]
        k = min(len(rest), max(0, lns_ranks - lns_ranks // 2 - 1))
        for e in rng.choice(len(rest), size=k, replace=False) if k else []:
            free.add(rest[int(e)])
        ranks = sorted(free)
        fr = set(ranks)
        inside = [
            u
            for u in self.units
            if self.decision[u.name].kind != "dp" and set(self.ranks[u.name].tolist()) <= fr
        ]
        first = [u for u in inside if u in on_crit]
        others = [u for u in inside if u not in on_crit]
        if plateau and len(first) > max_free // 2:
            rng.shuffle(first)  # type: ignore[arg-type]
            others = first[max_free // 2 :] + others
            first = first[: max_free // 2]
        rng.shuffle(others)  # type: ignore[arg-type]
        chosen = (first + others)[:max_free]
        dps = [u for u in self.units if self.decision[u.name].kind == "dp"]
        if dps:
            pick = rng.choice(len(dps), size=min(DP_FREE_UNITS, len(dps)), replace=False)
            chosen += [dps[int(i)] for i in sorted(pick)]
        inside_names = {u.name for u in inside}
        partial = [
            u
            for u in self.units
            if self.decision[u.name].kind != "dp"
            and u.name not in inside_names
            and fr & set(self.ranks[u.name].tolist())
        ]
        partial = ([u for u in partial if u in on_crit] + [u for u in partial if u not in on_crit])[
            :max_free
        ]
        order_ix = {u.name: i for i, u in enumerate(self.units)}
        return (
            ranks,
            sorted(chosen, key=lambda u: order_ix[u.name]),
            sorted(partial, key=lambda u: order_ix[u.name]),
        )

    def step(
        self,
        ranks_f: list[int],
        free_units: list[Unit],
        partial_units: list[Unit],
        time_limit: float,
        seed: int,
    ) -> tuple[str, dict[str, tuple[_Option, np.ndarray]], float, float, float]:
        """Solve one neighbourhood; returns (status, unit -> (option, ranks), T, bound,
        deterministic time). The model is `cpsat_model.NeighbourhoodModel`, one method per
        line of the module docstring's model."""
        from embarkc.planner import cpsat_model as cm_

        nb = cm_.neighbourhood(self, ranks_f, free_units, partial_units)
        cm_.measure_options(self, nb)
        lin = cm_.linearise(self, nb)
        model = cm_.NeighbourhoodModel(self, nb, lin)
        model.build()
        self.last_work = SECONDS_PER_VAR * (len(model.x) + len(model.y)) + SECONDS_PER_OPTION * sum(
            len(lst) for lst in nb.opts.values()
        )
        return self._solve(model, time_limit, seed)

    def _solve(
        self, model: Any, time_limit: float, seed: int
    ) -> tuple[str, dict[str, tuple[_Option, np.ndarray]], float, float, float]:
        """Run CP-SAT on `model` (one worker, a deterministic limit) and read its
        solution: the chosen options and cell ranks, the model's makespan and bound."""
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = seed
        solver.parameters.max_deterministic_time = max(time_limit, 0.01)
        # the linearised model is within about 1 % of the full one: a tighter gap buys
        # nothing the re-costing would keep
        solver.parameters.relative_gap_limit = 0.0005
        # no presolve: on these models it spends most of a neighbourhood's deterministic
        # limit, and a solve stopped in presolve returns nothing, not even the hint
        solver.parameters.cp_model_presolve = False
        # a wall-clock safety net far above the deterministic limit (it never binds in
        # practice, so results stay reproducible)
        solver.parameters.max_time_in_seconds = 10.0 * time_limit + 30.0
        status = solver.solve(model.m)
        dt = float(solver.deterministic_time)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            name = "infeasible" if status == cp_model.INFEASIBLE else "unknown"
            return name, {}, 0.0, 0.0, dt
        chosen = self._extract(model, solver)
        window_ns = model.lin.window_ns
        self.last_critical_path = (
            _critical_path(solver, model.phase_rows, model.rank_exprs, model.phase_out, window_ns)
            / TIME_SCALE
        )
        # each free rank with its links at the larger of their bounds, the keys beyond the
        # window: `T` and the links' `z` are only bounded below, and a solve stopped within
        # its gap may leave them above that
        rank_ns = {
            a: int(solver.value(rest)) + sum(_link_values(solver, bounds, window_ns))
            for a, (rest, bounds) in model.rank_exprs.items()
        }
        self.last_rank_times = {a: v / TIME_SCALE for a, v in rank_ns.items()}
        name = "optimal" if status == cp_model.OPTIMAL else "feasible"
        return (
            name,
            chosen,
            max(rank_ns.values()) / TIME_SCALE,
            # a bound on T: objective = weight * T - kept >= bound, kept <= len(stay)
            max(0.0, solver.best_objective_bound / model.weight) / TIME_SCALE,
            dt,
        )

    def _extract(self, model: Any, solver: Any) -> dict[str, tuple[_Option, np.ndarray]]:
        """Per free or partly free unit, its chosen option and the ranks of its cells."""
        nb, x, ranks_f = model.nb, model.x, model.nb.ranks_f
        chosen: dict[str, tuple[_Option, np.ndarray]] = {}
        for u in nb.free_units:
            for oi, o in enumerate(nb.opts[u.name]):
                if not solver.value(model.y[u.name, oi]):
                    continue
                where = np.zeros(len(o.load), dtype=np.int64)
                for c in range(len(o.load)):
                    where[c] = next(
                        a
                        for a in ranks_f
                        if (u.name, oi, c, a) in x and solver.value(x[u.name, oi, c, a])
                    )
                chosen[u.name] = (o, where)
        for u in nb.partial_units:
            where = self.ranks[u.name].copy()
            for c in nb.movable[u.name]:
                where[c] = next(
                    a
                    for a in ranks_f
                    if (u.name, -1, c, a) in x and solver.value(x[u.name, -1, c, a])
                )
            chosen[u.name] = (self.option(u, self.decision[u.name]), where)
        assert ranks_f  # never empty
        return chosen

    def trial(
        self, free_units: list[Unit], chosen: dict[str, tuple[_Option, np.ndarray]]
    ) -> RankState:
        """The full model's state with the `chosen` options and ranks of `free_units`."""
        st = _clone(self.state)
        for u in free_units:
            _apply(st, self.option(u, self.decision[u.name]), self.ranks[u.name], -1.0)
            o, where = chosen[u.name]
            _apply(st, o, where, 1.0)
        return st

    def accept(
        self,
        free_units: list[Unit],
        chosen: dict[str, tuple[_Option, np.ndarray]],
        st: RankState,
        times: np.ndarray,
    ) -> None:
        for u in free_units:
            o, where = chosen[u.name]
            self.decision[u.name] = o.d
            self.ranks[u.name] = where
            for n, p in _placed(o, where):
                self.layout[n] = p
        self.state, self.times = st, times


def refine(
    cm: CostModel,
    g: GreedyResult,
    time_limit: float,
    seed: int = 0,
    progress: Callable[[str, float, float], None] | None = None,
) -> RefineResult:
    """Refine the greedy plan with CP-SAT (see the module docstring); never returns a
    layout slower than greedy's by the full cost model."""
    if not g.units or cm.W == 1 or time_limit <= 0:
        return RefineResult(g.layout, "greedy", None, None, 0.0, "nothing to refine")
    ref = _Refiner(cm, g)
    rng = np.random.default_rng(seed)
    whole = cm.W <= WHOLE_RANKS and len(g.units) <= WHOLE_UNITS
    best_t, best_layout = float(ref.times.max()), dict(ref.layout)
    cur_norm = _norm(ref.times)
    per_step = min(time_limit / 4, WHOLE_STEP_DET) if whole else LNS_STEP_DET
    spent = 0.0
    steps = improved = stall = proven = at_limit = 0
    scale = 1
    last: tuple[str, float, float] | None = None
    stopped = "limit"
    while spent < time_limit - 1e-9:
        if stall >= LNS_STALL:
            stopped = "stall"
            break
        if at_limit >= LNS_AT_LIMIT:
            stopped = "at-limit"
            break
        # the two kinds of neighbourhood alternate: around the critical rank alone, and
        # around it with others of the plateau
        ranks_f, free_units, partial_units = ref.neighbourhood(rng, whole, steps % 2 == 1, scale)
        if not free_units and not partial_units:
            stall += 1
            steps += 1
            spent += per_step
            continue
        status, chosen, obj, bound, dt = ref.step(
            ranks_f,
            free_units,
            partial_units,
            min(per_step, (time_limit - spent) / SECONDS_PER_DET),
            seed + steps,
        )
        free_units = free_units + partial_units
        spent += SECONDS_PER_DET * dt + ref.last_work
        steps += 1
        better = False
        if chosen:
            st = ref.trial(free_units, chosen)
            times = st.times()
            norm = _norm(times)
            # lower (the 16-norm or the step time), the critical path not longer and no
            # rank's keys longer than the greedy plan's busiest
            if (
                (norm < cur_norm * (1 - 1e-9) or times.max() < ref.times.max() * (1 - 1e-9))
                and st.critical_path() <= ref.crit_cap * (1 + 1e-9)
                and float(st.key_seconds().max()) <= ref.key_cap * (1 + 1e-9)
                # the model's memory rows leave out the hierarchical ub aggregators'
                # buffers (on the owners' rail peers): the full model has the last word
                and float(st.memory().max()) <= cm.capacity
            ):
                better = True
                ref.accept(free_units, chosen, st, times)
                cur_norm, stall, at_limit = norm, 0, 0
                last = (status if whole else "feasible", obj, bound)
                if float(times.max()) < best_t * (1 - 1e-9):
                    best_t, best_layout = float(times.max()), dict(ref.layout)
                    improved += 1
        if not better:
            stall += 1
            proven = proven + 1 if status == "optimal" else 0
            # a neighbourhood proven to hold nothing faster (infeasible: not even the hint,
            # which only rounding can cause) ends the run at the limit; a whole-program
            # model is solved again with twice the limit instead
            at_limit = at_limit + 1 if status in ("feasible", "unknown") and not whole else 0
            if (
                not whole
                and proven >= GROW_AFTER
                and scale < MAX_SCALE
                and MAX_RANKS * scale < cm.W
            ):
                scale, proven = scale * 2, 0
            if whole:
                if status == "optimal":
                    # the model's best is the current plan: solving it again finds the same
                    stopped = "proven"
                    break
                # the solve ended at its limit: give the next one twice as long
                per_step *= 2.0
        if progress is not None:
            progress("cp-sat", min(1.0, spent / time_limit), best_t)
    # the kept layout is re-costed from scratch: no drift of the incremental sums decides
    final_t = cm.step_time(best_layout)
    kind = "whole-program model" if whole else "large-neighbourhood search"
    msg = (
        f"cp-sat {kind} over grids and placements ({len(g.units)} units x {cm.W} ranks, "
        f"{steps} neighbourhoods, {improved} improved the step time; stopped: "
        f"{STOPS[stopped]})"
    )
    if last is not None and final_t < g.step_time * (1 - 1e-9):
        return RefineResult(
            best_layout, last[0], last[1], min(last[2], last[1]), spent, msg, steps, stopped
        )
    obj_b = (last[1], min(last[2], last[1])) if last else (None, None)
    return RefineResult(
        g.layout, "greedy", obj_b[0], obj_b[1], spent, msg + "; greedy kept", steps, stopped
    )
