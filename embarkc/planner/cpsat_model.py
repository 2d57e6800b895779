"""One neighbourhood's CP-SAT model, built one constraint family at a time.

Each method of `NeighbourhoodModel` adds one line of the model written in cpsat.py's
docstring, and is named for it; `build` calls them in the order the model has always
been built (the solver's search depends on the order of its variables and
constraints, so the same seed gives the same plan). Before the model:

    measure_options   every free unit's grid options, each with U_o (what it adds to
                      every rank besides owner HBM work and links), measured one unit
                      at a time against the current plan
    linearise         the current plan's sides of every link and phase, and the bases
                      that make the model give the current plan exactly the full
                      model's rank and phase times

After it, `solve` runs CP-SAT and `extract` reads the chosen options and cell ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from embarkc.planner.clusters import Unit
from embarkc.planner.cost import phase_times
from embarkc.planner.search import one_node

if TYPE_CHECKING:
    from embarkc.planner.cpsat import _Option, _Refiner

Terms = dict[int, list[tuple[int, Any]]]
"""Per free rank, the (coefficient, variable) terms of one sum."""


@dataclass
class Neighbourhood:
    """The free ranks and units of one solve, and the options measured for them."""

    ranks_f: list[int]
    free_units: list[Unit]
    partial_units: list[Unit]
    movable: dict[str, list[int]]
    """Per partly free unit, its cells on the free ranks (which may move among them)."""
    m0: np.ndarray
    """Memory per rank without the free units and the movable cells (bytes)."""
    t0: np.ndarray
    """Rank times without the free units (seconds)."""
    out_f: np.ndarray
    """The ranks outside the neighbourhood (mask)."""
    opts: dict[str, list[_Option]] = field(default_factory=dict)


def neighbourhood(
    ref: _Refiner, ranks_f: list[int], free_units: list[Unit], partial_units: list[Unit]
) -> Neighbourhood:
    """The current plan without the free units, and the movable cells of the others."""
    cm = ref.cm
    from embarkc.planner.cpsat import _apply, _clone

    base = _clone(ref.state)
    for u in free_units:
        _apply(base, ref.option(u, ref.decision[u.name]), ref.ranks[u.name], -1.0)
    t0 = base.times()
    m0 = base.memory()
    fset = set(ranks_f)
    movable: dict[str, list[int]] = {}
    for u in partial_units:
        o = ref.option(u, ref.decision[u.name])
        movable[u.name] = [c for c, a in enumerate(ref.ranks[u.name]) if int(a) in fset]
        for c in movable[u.name]:
            m0[int(ref.ranks[u.name][c])] -= float(o.mem[c])
    out_f = np.ones(cm.W, dtype=bool)
    out_f[ranks_f] = False
    return Neighbourhood(ranks_f, free_units, partial_units, movable, m0, t0, out_f)


def measure_options(ref: _Refiner, nb: Neighbourhood) -> None:
    """Every free unit's options (`grid_options`) within MAX_CELL_VARS cell variables,
    each with U_o: what it adds to every rank besides owner HBM work and links
    (requester lookups, launches, latencies, the dp exchange), the same on every rank;
    measured with the option in the current plan without this unit only (the
    linearisation is around the current plan, one unit at a time), on the lightest free
    ranks (or where it is)."""
    from embarkc.planner.cpsat import (
        MAX_CELL_VARS,
        TIME_SCALE,
        _apply,
        _clone,
        _shared_seconds,
        grid_options,
    )

    cm = ref.cm
    ranks_f = nb.ranks_f
    light = sorted(ranks_f, key=lambda a: (nb.t0[a], a))
    budget = MAX_CELL_VARS
    work = _clone(ref.state)
    for u in nb.free_units:
        cur = ref.decision[u.name]
        cur_o = ref.option(u, cur)
        _apply(work, cur_o, ref.ranks[u.name], -1.0)
        shared_u, shared_ph = _shared_seconds(work)
        free_mask = np.zeros(cm.W, dtype=bool)
        free_mask[ranks_f] = True
        home = (
            cm.node_of == cm.node_of[int(ref.ranks[u.name][0])]
            if cur.kind != "dp"
            else np.ones(cm.W, dtype=bool)
        )
        lst = []
        for d in grid_options(cm, u, cur, len(ranks_f)):
            o = ref.option(u, d)
            # within_node and hierarchical rb units keep their cells on their node
            allowed = free_mask & home if one_node(u, d) else free_mask
            cost = len(o.load) * int(allowed.sum())
            if d != cur and cost > budget:
                continue
            budget -= cost
            if d == cur:
                where = ref.ranks[u.name]
            else:
                ok = [a for a in light if allowed[a]] or light
                where = np.array([ok[i % len(ok)] for i in range(len(o.load))], np.int64)
            _apply(work, o, where, 1.0)
            with_o, with_ph = _shared_seconds(work)
            _apply(work, o, where, -1.0)
            uni = copy.copy(o)
            uni.uni_load = max(0, int(round((with_o - shared_u) * TIME_SCALE)))
            uni.uni_phase = np.maximum(np.round((with_ph - shared_ph) * TIME_SCALE), 0).astype(
                np.int64
            )
            uni.allowed = allowed
            lst.append(uni)
        nb.opts[u.name] = lst
        _apply(work, cur_o, ref.ranks[u.name], 1.0)


@dataclass
class Linearisation:
    """The current plan around which the model is linear (integer nanoseconds)."""

    cur_part: dict[str, np.ndarray]
    """The owner sides (and HBM work) of the cells that may move, per rank they are on."""
    cur_other: dict[str, np.ndarray | int]
    """What those cells put on the other side of each free rank's links now."""
    node_oth: dict[str, np.ndarray]
    """What they put on the other side of the links, per node they are on."""
    cur_hub: dict[tuple[str, str], np.ndarray]
    """The hierarchical ub cells' link terms (`_Option.hub`), per rank they are on."""
    hub_near: dict[str, np.ndarray]
    hub_far: dict[str, np.ndarray]
    """What the hierarchical ub cells put on each rank's two sides now."""
    var_ns: dict[str, np.ndarray]
    fix_ns: dict[str, np.ndarray]
    """Each link's owner side and other side now, per rank."""
    side_now: dict[str, np.ndarray]
    keys_now: np.ndarray
    """The key phase beyond the dense compute window now, per rank."""
    t_ns: np.ndarray
    window_ns: int
    base_ns: np.ndarray
    """Per rank, its time less the variable parts: base_a."""
    ph_ns: list[np.ndarray]
    base_ph: list[np.ndarray]
    """Per phase group and rank, its time now and less its variable part."""
    crit_ns: int
    key_cap_ns: int


def linearise(ref: _Refiner, nb: Neighbourhood) -> Linearisation:
    """Base times such that the model gives the current plan exactly the full model's
    rank times, and each phase its phase times."""
    from embarkc.planner.cpsat import HUB_KEYS, LINKS, PARTS, TIME_SCALE, _per_byte

    cm = ref.cm
    ranks_f, movable = nb.ranks_f, nb.movable
    cur_uni = sum(
        o.uni_load for lst in nb.opts.values() for o in lst if o.d == ref.decision[o.unit.name]
    )
    cur_part = {k: np.zeros(cm.W, dtype=np.int64) for k in PARTS}
    cur_oth = {k: np.zeros(cm.W, dtype=np.int64) for k in LINKS}
    for u in nb.free_units + nb.partial_units:
        o = ref.option(u, ref.decision[u.name])
        assert o.parts is not None and o.other is not None
        cells = range(len(o.load)) if u.name not in movable else movable[u.name]
        for c in cells:
            b = int(ref.ranks[u.name][c])
            for k in PARTS:
                cur_part[k][b] += int(o.parts[k][c])
            for k in LINKS:
                cur_oth[k][b] += int(o.other[k][c])
    # the aggregator loads the movable cells put on the ranks of their rails now, and
    # the hierarchical ub cells' link terms, per rank they are on
    cur_rail_own = np.zeros(cm.W, dtype=np.int64)
    cur_hub = {hk: np.zeros(cm.W, dtype=np.int64) for hk in HUB_KEYS}
    for u in nb.free_units + nb.partial_units:
        o = ref.option(u, ref.decision[u.name])
        cells = range(len(o.load)) if u.name not in movable else movable[u.name]
        for c in cells:
            b = int(ref.ranks[u.name][c])
            if o.rail is not None:
                cur_rail_own[b] += int(o.rail[c])
            if o.hub is not None:
                for hk in HUB_KEYS:
                    cur_hub[hk][b] += int(o.hub[hk][c])
    li = cm.local_of
    f_mask = np.zeros(cm.W, dtype=bool)
    f_mask[ranks_f] = True
    # on a free rank: the movable cells on the free ranks of its rail, its own aside
    rail_free = np.bincount(li[f_mask], cur_rail_own[f_mask], cm.G).astype(np.int64)
    cur_rail = rail_free[li] - cur_rail_own
    hub_near = {k: np.zeros(cm.W, dtype=np.int64) for k in LINKS}
    hub_far = {k: np.zeros(cm.W, dtype=np.int64) for k in LINKS}
    for (cls, k), arr in cur_hub.items():
        if cls == "near_rail":
            hub_near[k] += np.bincount(li, arr, cm.G).astype(np.int64)[li]
        elif cls == "far_rail":
            hub_far[k] += np.bincount(li, arr, cm.G).astype(np.int64)[li]
        elif cls == "far_tot":
            hub_far[k] += int(arr.sum())
        else:
            hub_far[k] += arr
    # the other side of each free rank: the cells on the other ranks of its node
    # (intra-node links) or on the other nodes (inter-node links)
    node_oth = {k: np.bincount(cm.node_of, cur_oth[k], cm.nodes) for k in LINKS}
    cur_other: dict[str, np.ndarray | int] = {}
    for k in LINKS:
        at_node = node_oth[k][cm.node_of].astype(np.int64)
        if k.endswith("intra"):
            cur_other[k] = at_node - cur_oth[k]
        else:
            cur_other[k] = int(cur_oth[k].sum()) - at_node
    links = ref.state.links()
    var_ns: dict[str, np.ndarray] = {}
    fix_ns: dict[str, np.ndarray] = {}
    for k in LINKS:
        sent, received = links[k]
        scale = TIME_SCALE * _per_byte(cm, k)
        own_side, other = (received, sent) if k.startswith("dist") else (sent, received)
        var_ns[k] = np.round(np.maximum(own_side, 0) * scale).astype(np.int64)
        fix_ns[k] = np.round(np.maximum(other, 0) * scale).astype(np.int64)
    t_ns = np.round(ref.times * TIME_SCALE).astype(np.int64)
    window_ns = int(round(cm.key_window * TIME_SCALE))
    side_now = {k: np.maximum(var_ns[k], fix_ns[k]) for k in LINKS}
    keys_now = np.maximum(side_now["dist_intra"] + side_now["dist_inter"] - window_ns, 0)
    link_now = side_now["res_intra"] + side_now["res_inter"] + keys_now
    base_ns = t_ns - link_now - cur_part["hbm"] - cur_uni - cur_rail
    ph_ns = [np.round(v * TIME_SCALE).astype(np.int64) for v in phase_times(ref.state.components())]
    cur_uni_ph = np.zeros(len(ph_ns), dtype=np.int64)
    for lst in nb.opts.values():
        for o in lst:
            if o.d == ref.decision[o.unit.name]:
                assert o.uni_phase is not None
                cur_uni_ph += o.uni_phase
    base_ph = [
        ph_ns[0] - cur_part["hbm"] - cur_rail - cur_uni_ph[0],
        ph_ns[1] - keys_now - cur_uni_ph[1],
        ph_ns[2] - side_now["res_intra"] - side_now["res_inter"] - cur_uni_ph[2],
        ph_ns[3] - cur_uni_ph[3],
    ]
    crit_ns = int(sum(int(v.max()) for v in ph_ns))
    key_cap_ns = int(ref.key_cap * TIME_SCALE) if np.isfinite(ref.key_cap) else 0
    return Linearisation(
        cur_part,
        cur_other,
        node_oth,
        cur_hub,
        hub_near,
        hub_far,
        var_ns,
        fix_ns,
        side_now,
        keys_now,
        t_ns,
        window_ns,
        base_ns,
        ph_ns,
        base_ph,
        crit_ns,
        key_cap_ns,
    )


class NeighbourhoodModel:
    """The CP-SAT model of one neighbourhood: `y[o]` (option o of a free unit is
    chosen), `x[c, a]` (cell c on free rank a), and the sums, links, makespan and
    phase maxima cpsat.py's docstring defines."""

    def __init__(self, ref: _Refiner, nb: Neighbourhood, lin: Linearisation):
        from ortools.sat.python import cp_model

        from embarkc.planner.cpsat import HUB_KEYS, LINKS, PARTS

        self.ref, self.cm, self.nb, self.lin = ref, ref.cm, nb, lin
        self.m = cp_model.CpModel()
        self.y: dict[tuple[str, int], Any] = {}
        self.x: dict[tuple[str, int, int, int], Any] = {}
        ranks_f = nb.ranks_f
        self.terms: dict[str, Terms] = {k: {a: [] for a in ranks_f} for k in PARTS}
        """Per free rank, each cell's HBM work and owner side of each link."""
        self.oterms: dict[str, Terms] = {k: {a: [] for a in ranks_f} for k in LINKS}
        """Per free rank, what each cell puts on the other side of each link."""
        self.mem_terms: Terms = {a: [] for a in ranks_f}
        self.rail_terms: Terms = {a: [] for a in ranks_f}
        self.hub_terms: dict[tuple[str, str], Terms] = {
            hk: {a: [] for a in ranks_f} for hk in HUB_KEYS
        }
        self.uni_load: list[tuple[int, Any]] = []
        self.uni_ph: list[tuple[np.ndarray, Any]] = []
        self.uni_mem: list[tuple[int, Any]] = []
        self.hints: list[tuple[Any, int]] = []
        self.z_hints: list[tuple[Any, int]] = []
        self.keep: list[Any] = []
        self.node_sum: dict[tuple[str, int], Any] = {}
        self.own_oth: dict[tuple[str, int], Any] = {}
        self.rail_sum: dict[int, Any] = {}
        self.hub_rail: dict[tuple[str, str, int], Any] = {}
        self.hub_tot: dict[tuple[str, str], Any] = {}
        self.rank_exprs: dict[int, tuple[Any, dict[str, tuple[Any, Any]]]] = {}
        """Per free rank: its time less its links, and each link's two bounds (what the
        solution's makespan is evaluated from: T and the z are only bounded below)."""
        self.phase_exprs: list[list[Any]] = [[] for _ in lin.ph_ns]
        self.phase_rows: dict[int, list[Any]] = {}
        self.phase_out: list[Any] = [0 for _ in lin.ph_ns]
        self.capacity = int(self.cm.capacity)
        self.top = 0
        self.T: Any = None
        self.weight = 1
        self.f_nodes: list[int] = []
        self.umem: Any = 0
        self.uload: Any = 0
        self.uph: list[Any] = []
        self.grow: list[list[tuple[int, Any]]] = [[] for _ in lin.ph_ns]

    # ------------------------------------------------------------------ the model
    def build(self) -> None:
        """Every family of constraints, in the model's order."""
        self.one_option_per_free_unit()
        self.few_grids_change()
        self.partial_cells_placed_once()
        self.makespan()
        self.far_side_per_node()
        self.aggregators_per_rail()
        self.hub_sums()
        # each phase's options' part on the free ranks (the phase maxima P bound them)
        self.uph = [
            sum(int(c[g]) * v for c, v in self.uni_ph if c[g]) for g in range(len(self.lin.ph_ns))
        ]
        for a in self.nb.ranks_f:
            self.free_rank(a)
        self.ranks_outside_below_step_time()
        self.critical_path_within_greedy()
        self.objective_and_hints()

    def add_terms(self, o: _Option, c: int, a: int, xv: Any) -> None:
        """What cell `c` of option `o` puts on free rank `a` when `xv` places it there."""
        from embarkc.planner.cpsat import HUB_KEYS, LINKS, PARTS

        assert o.parts is not None and o.other is not None
        for k in PARTS:
            if o.parts[k][c]:
                self.terms[k][a].append((int(o.parts[k][c]), xv))
        for k in LINKS:
            if o.other[k][c]:
                self.oterms[k][a].append((int(o.other[k][c]), xv))
        if o.rail is not None and o.rail[c]:
            self.rail_terms[a].append((int(o.rail[c]), xv))
        if o.hub is not None:
            for hk in HUB_KEYS:
                if o.hub[hk][c]:
                    self.hub_terms[hk][a].append((int(o.hub[hk][c]), xv))
        self.mem_terms[a].append((int(o.mem[c]), xv))

    def one_option_per_free_unit(self) -> None:
        """sum_o y[o] == 1, and a chosen option's cells are placed once:
        sum_a x[c, a] == y[o] (hinted with the current plan)."""
        m, ref = self.m, self.ref
        for u in self.nb.free_units:
            cur = ref.decision[u.name]
            ys = []
            for oi, o in enumerate(self.nb.opts[u.name]):
                v = m.new_bool_var(f"y_{u.name}_{oi}")
                self.y[u.name, oi] = v
                ys.append(v)
                self.hints.append((v, int(o.d == cur)))
                self.uni_load.append((o.uni_load, v))
                assert o.uni_phase is not None
                self.uni_ph.append((o.uni_phase, v))
                self.uni_mem.append((o.uni_mem, v))
                assert o.allowed is not None
                cand = [a for a in self.nb.ranks_f if o.allowed[a]]
                for c in range(len(o.load)):
                    xs = []
                    for a in cand:
                        xv = m.new_bool_var(f"x_{u.name}_{oi}_{c}_{a}")
                        self.x[u.name, oi, c, a] = xv
                        xs.append(xv)
                        self.add_terms(o, c, a, xv)
                        on = o.d == cur and int(ref.ranks[u.name][c]) == a
                        self.hints.append((xv, int(on)))
                    m.add(sum(xs) == v)
            m.add_exactly_one(ys)
            self.keep.append(ys[0])

    def few_grids_change(self) -> None:
        """sum_u (1 - y[current option of u]) <= MAX_GRID_CHANGES: the linearisation is
        additive only for a few changes at a time."""
        from embarkc.planner.cpsat import MAX_GRID_CHANGES

        if self.keep:
            self.m.add(sum(1 - v for v in self.keep) <= MAX_GRID_CHANGES)

    def partial_cells_placed_once(self) -> None:
        """The movable cells of the partly free units: each on one free rank (of its
        node, for within_node and hierarchical rb units)."""
        m, ref, cm = self.m, self.ref, self.cm
        fset = set(self.nb.ranks_f)
        for u in self.nb.partial_units:
            o = ref.option(u, ref.decision[u.name])
            ok = [a for a in self.nb.ranks_f if a in fset]
            if one_node(u, ref.decision[u.name]):
                node = cm.node_of[int(ref.ranks[u.name][0])]
                ok = [a for a in ok if cm.node_of[a] == node]
            for c in self.nb.movable[u.name]:
                xs = []
                for a in ok:
                    xv = m.new_bool_var(f"p_{u.name}_{c}_{a}")
                    self.x[u.name, -1, c, a] = xv
                    xs.append(xv)
                    self.add_terms(o, c, a, xv)
                    self.hints.append((xv, int(int(ref.ranks[u.name][c]) == a)))
                m.add_exactly_one(xs)

    def makespan(self) -> None:
        """T, bounded above by everything the options could add to the largest rank."""
        lin, cm = self.lin, self.cm
        self.top = int(max(0, lin.t_ns.max(), *(int(v.max()) for v in lin.fix_ns.values()))) + sum(
            int(o.load.sum())
            + o.uni_load
            + sum(int(v.sum()) for v in (o.parts or {}).values())
            + sum(int(v.sum()) for v in (o.other or {}).values())
            + (int(o.rail.sum()) * cm.nodes if o.rail is not None else 0)
            + sum(int(np.abs(v).sum()) * cm.W for v in (o.hub or {}).values())
            for lst in self.nb.opts.values()
            for o in lst
        )
        self.T = self.m.new_int_var(0, self.top + 1, "T")

    def far_side_per_node(self) -> None:
        """S[l, n] == sum_{c, a on n} w_lc x[c, a]: the other side of each link, per node
        of the free ranks (and per free rank, what its own cells put there)."""
        from embarkc.planner.cpsat import LINKS

        cm, ranks_f = self.cm, self.nb.ranks_f
        self.f_nodes = sorted({int(cm.node_of[a]) for a in ranks_f})
        for k in LINKS:
            for n in self.f_nodes:
                sv = self.m.new_int_var(0, self.top + 1, f"s_{k}_{n}")
                own_n = []
                for a in ranks_f:
                    if int(cm.node_of[a]) == n:
                        self.own_oth[k, a] = sum(c * v for c, v in self.oterms[k][a])
                        own_n += self.oterms[k][a]
                self.m.add(sv == sum(c * v for c, v in own_n))
                self.node_sum[k, n] = sv
                # its value in the current plan (the hint): every movable cell is on a
                # free rank
                self.z_hints.append((sv, int(self.lin.node_oth[k][n])))
        self.umem = sum(c * v for c, v in self.uni_mem)
        self.uload = sum(c * v for c, v in self.uni_load if c)

    def aggregators_per_rail(self) -> None:
        """R[l] == sum_{c, a on rail l} g_c x[c, a] (hierarchical ub)."""
        ranks_f, li = self.nb.ranks_f, self.cm.local_of
        if any(self.rail_terms[a] for a in ranks_f):
            for l_ in sorted({int(li[a]) for a in ranks_f}):
                self.rail_sum[l_] = sum(
                    c * v for a in ranks_f if int(li[a]) == l_ for c, v in self.rail_terms[a]
                )

    def hub_sums(self) -> None:
        """H[l, r]: the hierarchical ub cells' terms per rail of the free ranks (the cells
        placed on its free ranks), and in total."""
        from embarkc.planner.cpsat import HUB_KEYS

        m, ranks_f, li, top = self.m, self.nb.ranks_f, self.cm.local_of, self.top
        f_mask = np.zeros(self.cm.W, dtype=bool)
        f_mask[ranks_f] = True
        f_rails = sorted({int(li[a]) for a in ranks_f})
        cur_hub = self.lin.cur_hub
        for hk in HUB_KEYS:
            if not any(self.hub_terms[hk][a] for a in ranks_f):
                continue
            if hk[0] == "far_tot":
                tv = m.new_int_var(-(top + 1), top + 1, f"ht_{hk[0]}_{hk[1]}")
                m.add(tv == sum(c * v for a in ranks_f for c, v in self.hub_terms[hk][a]))
                self.hub_tot[hk] = tv
                self.z_hints.append((tv, int(cur_hub[hk][f_mask].sum())))
            elif hk[0] != "far_own":
                for l_ in f_rails:
                    on_rail = [a for a in ranks_f if int(li[a]) == l_]
                    rv = m.new_int_var(-(top + 1), top + 1, f"hr_{hk[0]}_{hk[1]}_{l_}")
                    m.add(rv == sum(c * v for a in on_rail for c, v in self.hub_terms[hk][a]))
                    self.hub_rail[(*hk, l_)] = rv
                    self.z_hints.append((rv, int(sum(int(cur_hub[hk][a]) for a in on_rail))))

    def hub_side(self, a: int, k: str, near: bool) -> Any:
        """The hierarchical ub cells' part of one side of link `k` of free rank `a`."""
        out: Any = 0
        li = self.cm.local_of
        for cls in ("near_rail",) if near else ("far_tot", "far_rail", "far_own"):
            if cls == "far_tot":
                out = out + self.hub_tot.get((cls, k), 0)
            elif cls == "far_own":
                out = out + sum(c * v for c, v in self.hub_terms.get((cls, k), {}).get(a, []))
            else:
                out = out + self.hub_rail.get((cls, k, int(li[a])), 0)
        return out

    def free_rank(self, a: int) -> None:
        """Free rank `a`'s lines of the model, in their order: its links, its keys
        within the cap and beyond the window, its time below T, its phases, its memory."""
        zs, bounds = self.link_busier_side(a)
        self.keys_within_cap(a, zs)
        key = self.keys_beyond_window(a, zs)
        hbm = self.rank_below_makespan(a, zs, key, bounds)
        self.phases_of(a, zs, key, hbm)
        self.memory_fits(a)

    def link_busier_side(self, a: int) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
        """z[l, a] >= both sides of link l: the owner side (fixed part plus the cells
        placed here) and the other side (fixed part plus the cells on the other ranks
        of the node, for intra-node links, or on the other nodes)."""
        from embarkc.planner.cpsat import LINKS

        m, lin, cm = self.m, self.lin, self.cm
        zs: dict[str, Any] = {}
        bounds: dict[str, tuple[Any, Any]] = {}
        for k in LINKS:
            z = m.new_int_var(0, self.top + 1, f"z_{k}_{a}")
            v0 = int(lin.var_ns[k][a] - lin.cur_part[k][a] - lin.hub_near[k][a])
            w0 = int(lin.fix_ns[k][a] - lin.cur_other[k][a] - lin.hub_far[k][a])  # type: ignore[index]
            here = self.node_sum[k, int(cm.node_of[a])]
            if k.endswith("intra"):
                far = w0 + here - self.own_oth[k, a]
            else:
                far = w0 + sum(self.node_sum[k, n] for n in self.f_nodes) - here
            far = far + self.hub_side(a, k, near=False)
            near = v0 + sum(c * v for c, v in self.terms[k][a]) + self.hub_side(a, k, near=True)
            m.add(z >= far)
            m.add(z >= near)
            bounds[k] = (near, far)
            self.z_hints.append((z, int(lin.side_now[k][a])))
            zs[k] = z
        return zs, bounds

    def keys_within_cap(self, a: int, zs: dict[str, Any]) -> None:
        """z[dist_intra, a] + z[dist_inter, a] <= K: no more key time than the greedy
        plan's busiest rank has (or this rank now)."""
        if np.isfinite(self.ref.key_cap):
            side_now = self.lin.side_now
            keys_a = int(side_now["dist_intra"][a] + side_now["dist_inter"][a])
            self.m.add(zs["dist_intra"] + zs["dist_inter"] <= max(self.lin.key_cap_ns, keys_a))

    def keys_beyond_window(self, a: int, zs: dict[str, Any]) -> Any:
        """The key phase beyond the dense compute window (`RankState.components`)."""
        key = self.m.new_int_var(0, self.top + 1, f"keys_{a}")
        self.m.add(key >= zs["dist_intra"] + zs["dist_inter"] - self.lin.window_ns)
        self.z_hints.append((key, int(self.lin.keys_now[a])))
        return key

    def rank_below_makespan(
        self, a: int, zs: dict[str, Any], key: Any, bounds: dict[str, tuple[Any, Any]]
    ) -> Any:
        """base_a + sum_o U_o y[o] + sum_c h_c x[c, a] + sum_l z[l, a] + R[rail a]
        - sum_c g_c x[c, a] <= T; returns the rank's HBM work."""
        hbm = sum(c * v for c, v in self.terms["hbm"][a])
        if self.rail_sum:
            # it aggregates the cells of its rail's other ranks (all on other nodes)
            rail = self.rail_sum[int(self.cm.local_of[a])]
            hbm = hbm + rail - sum(c * v for c, v in self.rail_terms[a])
        base = int(self.lin.base_ns[a])
        self.m.add(base + self.uload + hbm + zs["res_intra"] + zs["res_inter"] + key <= self.T)
        self.rank_exprs[a] = (base + self.uload + hbm, bounds)
        return hbm

    def phases_of(self, a: int, zs: dict[str, Any], key: Any, hbm: Any) -> None:
        """Free rank `a`'s phases less their links (the keys' in phase 1, the results'
        in phase 2), for the phase maxima P."""
        ph_ns, base_ph = self.lin.ph_ns, self.lin.base_ph
        uph = self.uph
        rows = [int(base_ph[g][a]) + uph[g] for g in range(len(ph_ns))]
        rows[0] = rows[0] + hbm
        self.phase_rows[a] = rows
        self.phase_exprs[0].append(rows[0])
        self.phase_exprs[1].append(rows[1] + key)
        self.phase_exprs[2].append(rows[2] + zs["res_intra"] + zs["res_inter"])
        self.phase_exprs[3].append(rows[3])

    def memory_fits(self, a: int) -> None:
        """mem_a + sum_o M_o y[o] + sum_c m_c x[c, a] <= capacity."""
        mem = int(np.ceil(self.nb.m0[a]))
        self.m.add(mem + self.umem + sum(c * v for c, v in self.mem_terms[a]) <= self.capacity)

    def ranks_outside_below_step_time(self) -> None:
        """max_b t_b + sum_o (U_o - U_cur) y[o] <= max_a t_a: the ranks outside, together,
        their largest time now plus each option's change against the unit's current
        option; and their memory."""
        nb, lin, ref = self.nb, self.lin, self.ref
        if not nb.out_f.any():
            return
        out_t = int(lin.t_ns[nb.out_f].max())
        out_u = []
        for u in nb.free_units:
            now = next(o for o in nb.opts[u.name] if o.d == ref.decision[u.name])
            assert now.uni_phase is not None
            for oi, o in enumerate(nb.opts[u.name]):
                change = o.uni_load - now.uni_load
                if change:
                    out_u.append((change, self.y[u.name, oi]))
                assert o.uni_phase is not None
                for g in range(len(lin.ph_ns)):
                    if o.uni_phase[g] != now.uni_phase[g]:
                        change_g = int(o.uni_phase[g] - now.uni_phase[g])
                        self.grow[g].append((change_g, self.y[u.name, oi]))
        # no worse than the plan's step time now: T itself is the makespan of the free
        # ranks, so that a neighbourhood can lower them while other ranks share the
        # maximum (a plateau the 16-norm acceptance then takes apart)
        self.m.add(out_t + sum(c * v for c, v in out_u) <= max(out_t, int(lin.t_ns.max())))
        self.m.add(int(np.ceil(float(nb.m0[nb.out_f].max()))) + self.umem <= self.capacity)

    def critical_path_within_greedy(self) -> None:
        """P[g] >= phase g of each free rank and of the ranks outside (their phases now
        plus the options' changes); sum_g P[g] <= the greedy plan's critical path (or
        the current plan's, if that is above it by rounding)."""
        from embarkc.planner.cpsat import TIME_SCALE

        m, lin, nb = self.m, self.lin, self.nb
        ph_top = self.top + 1 + lin.crit_ns
        phase_max = []
        for g, exprs in enumerate(self.phase_exprs):
            pv = m.new_int_var(0, ph_top, f"phase_{g}")
            for e in exprs:
                m.add(pv >= e)
            if nb.out_f.any():
                self.phase_out[g] = int(lin.ph_ns[g][nb.out_f].max()) + sum(
                    c * v for c, v in self.grow[g]
                )
                m.add(pv >= self.phase_out[g])
            phase_max.append(pv)
            self.z_hints.append((pv, int(lin.ph_ns[g].max())))
        if np.isfinite(self.ref.crit_cap):
            m.add(sum(phase_max) <= max(lin.crit_ns, int(self.ref.crit_cap * TIME_SCALE)))

    def objective_and_hints(self) -> None:
        """Minimise T, then the number of changes (a cell that moves or an option that
        changes without lowering T only adds linearisation error); the current plan as
        a complete hint, a first solution the solver only repairs."""
        m = self.m
        stay = [v for v, h in self.hints if h == 1]
        self.weight = len(stay) + 1
        m.minimize(self.weight * self.T - sum(stay))
        for v, h in self.hints:
            m.add_hint(v, h)
        # the hinted makespan is the model's own value of the current plan (rounding
        # of the calibrated base must not make the hint infeasible)
        for z, h in self.z_hints:
            m.add_hint(z, h)
        m.add_hint(self.T, max(int(self.lin.t_ns[self.nb.ranks_f].max()), 0))
