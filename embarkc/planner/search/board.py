"""The search's board: the ranks' proxy loads and memory, the layout and the exact
`RankState`, with the placement and removal of units and snapshots to go back to.
`Search` (moves.py) adds the moves on top of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from embarkc.planner.budget import WorkMeter
from embarkc.planner.clusters import (
    Unit,
    default_comm,
    dp_bytes,
)
from embarkc.planner.cost import CostModel, RankState
from embarkc.planner.search.place import (
    Decision,
    NoRoom,
    RanksFull,
    _Applied,
    assign_heaps,
    best_node,
    one_node,
    place_interleaved,
    unit_cells,
)
from embarkc.planner.types import Layout, Placement

Progress = Callable[[str, float, float], None]
"""progress(stage, fraction done, best step time so far)."""


class Board:
    """Greedy placement state: proxy loads and memory per rank, plus the exact RankState."""

    def __init__(
        self,
        cm: CostModel,
        units: list[Unit],
        progress: Progress | None = None,
        exact_ref: bool = True,
        ub_comm: str | None = None,
        *,
        meter: WorkMeter | None = None,
    ):
        self.cm = cm
        self.meter = meter if meter is not None else WorkMeter(cm.W)
        """Where this search counts its work, and the deadline its passes stop at (a
        meter of its own when none is given: no deadline)."""
        self.exact_ref = exact_ref
        self.ub_comm = ub_comm if ub_comm is not None else default_comm(cm, "ub")
        """The communication a unit gets when a move makes it ub (`choose_ub_comm`)."""
        self.units = units
        self.by_name = {u.name: u for u in units}
        self.progress = progress
        self.comm_mode = cm.program.options.communication
        self.cut_short = False
        """`place_splitting` gave up at its deadline (no start had fit yet)."""
        self.reset()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        W = self.cm.W
        self.loads = np.zeros(W)
        self.mem = np.zeros(W)
        self.uniform_load = 0.0
        self.uniform_mem = 0.0
        self.layout: Layout = {}
        self.applied: dict[str, _Applied] = {}
        self.decisions: dict[str, Decision] = {}
        self.state = RankState(self.cm, self.meter)

    def _cells(
        self, u: Unit, d: Decision
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, Placement]]]:
        return unit_cells(self.cm, u, d)

    def _room_everywhere(self, extra: float) -> bool:
        """Whether every rank has room for `extra` more bytes (what a unit puts on all)."""
        return float(self.mem.max()) + self.uniform_mem + extra <= self.cm.capacity

    def _uniform_bytes(self, templates: list[tuple[str, Placement]]) -> float:
        """Bytes a sharded unit puts on every rank: the requesters' buffers."""
        cm = self.cm
        return float(sum(cm.grid_values(cm.facts[n], p).buf_all for n, p in templates))

    def _node_send(self, u: Unit, d: Decision) -> float:
        """Result bytes a hierarchical rb unit on one node returns to each requester on
        another node (one vector per column range; 0 for other kinds): every rank of the
        node sends that much to each of its rail's remote ranks."""
        cm = self.cm
        if not d.hierarchical or cm.nodes == 1:
            return 0.0
        total = 0.0
        for name in u.tables:
            cv = cm.grid_values(cm.facts[name], d.placement(cm.facts[name].dim))
            total += float(cv.res[cv.j == 0].sum())
        return total

    def _dp(self, u: Unit) -> tuple[float, float, list[tuple[str, Placement]]]:
        cm = self.cm
        load = 0.0
        out = []
        for name in u.tables:
            tf = cm.facts[name]
            ex = cm.best_exchange(tf)
            dv = cm.dp_values(tf, ex)
            load += dv.hbm / cm.bw_hbm + dv.exchange_time
            out.append((name, Placement(kind="dp", exchange=ex)))  # type: ignore[arg-type]
        return load, dp_bytes(cm, u), out

    def remove(self, u: Unit) -> None:
        a = self.applied.pop(u.name)
        np.add.at(self.loads, a.ranks, -a.load)
        np.add.at(self.mem, a.ranks, -a.mem)
        self.uniform_load -= a.uniform_load
        self.uniform_mem -= a.uniform_mem
        for name in u.tables:
            self.state.add_table(name, self.layout.pop(name), -1.0)
        del self.decisions[u.name]

    def place(self, u: Unit, d: Decision, ref: np.ndarray | None = None) -> None:
        """Place one unit with decision `d` on the current loads (raises NoRoom); `ref`:
        the rank times of the current state when the caller has them (it is consumed)."""
        if d.kind != "dp":
            load_c, mem_c, templates, uni = self._prepare(u, d)
            if not self._room_everywhere(uni):
                raise NoRoom(u)
            order = np.argsort(-load_c, kind="stable")
            send = self._node_send(u, d)
            ranks = self._assign(u, order, load_c, mem_c, ref, one_node(u, d), send, uni)
            self.uniform_mem += uni
            self._install(u, d, load_c, mem_c, templates, ranks, uni)
            return
        load, mem, placements = self._dp(u)
        if not self._room_everywhere(mem):
            raise NoRoom(u)
        self.uniform_load += load
        self.uniform_mem += mem
        empty = np.zeros(0, dtype=np.int64)
        self.applied[u.name] = _Applied(empty, np.zeros(0), np.zeros(0), load, mem)
        for name, p in placements:
            self.layout[name] = p
            self.state.add_table(name, p, 1.0)
        self.decisions[u.name] = d

    def _assign(
        self,
        u: Unit,
        order: np.ndarray,
        load_c: np.ndarray,
        mem_c: np.ndarray,
        ref: np.ndarray | None = None,
        one_node: bool = False,
        node_send: float = 0.0,
        uniform: float = 0.0,
    ) -> np.ndarray:
        """Ranks for the unit's cells in `order`; `uniform`: bytes the unit puts on every
        rank besides its cells (the requesters' communication buffers)."""
        cm = self.cm
        allowed = np.ones(cm.W, dtype=bool)
        free = cm.capacity - self.uniform_mem - uniform
        # rank times of the exact model without this unit (or the owner loads alone, in
        # the owner-load mode), plus what its cells add
        if not self.exact_ref:
            ref = self.loads.copy()
        elif ref is None:
            ref = self.state.times()
        if one_node:
            if node_send > 0 and self.exact_ref:
                # every rank of the owner node sends its rail's share of the results, and
                # the node's own requesters receive them over NVLink instead
                sent, received = self.state.links()["res_inter"]
                n1 = cm.nodes - 1
                ref += (
                    2.0
                    * (
                        np.maximum(sent + n1 * node_send, received - node_send)
                        - np.maximum(sent, received)
                    )
                    / cm.bw_inter
                )
            node = best_node(cm, ref, self.mem, free, load_c[order], mem_c[order])
            if node is not None:
                allowed = cm.node_of == node
            elif u.within_node:
                raise NoRoom(u)
        try:
            placed = assign_heaps(self.mem, free, allowed, order, load_c, mem_c, ref)
        except RanksFull:
            raise NoRoom(u) from None
        ranks = np.empty(len(load_c), dtype=np.int64)
        ranks[order] = placed
        # in placement order, as one cell at a time would add them (the same sums to the bit)
        np.add.at(self.loads, placed, load_c[order])
        np.add.at(self.mem, placed, mem_c[order])
        return ranks

    def place_all(self, decisions: dict[str, Decision]) -> None:
        """Place every unit from scratch: dp first, then all cells heaviest first."""
        self.reset()
        cells: list[tuple[float, int, int]] = []
        prepared: dict[str, Any] = {}
        sharded: list[Unit] = []
        for u in self.units:
            d = decisions[u.name]
            if d.kind == "dp":
                self.place(u, d)
                continue
            load_c, mem_c, templates, uni = self._prepare(u, d)
            prepared[u.name] = (load_c, mem_c, templates, uni)
            si = len(sharded)
            sharded.append(u)
            for ci, x in enumerate(load_c.tolist()):
                cells.append((-x, si, ci))
        cells.sort()
        cm = self.cm
        self.meter.placed += len(self.units) + len(cells)
        # every rank holds every sharded unit's requester buffers
        buffers = sum(v[3] for v in prepared.values())
        if prepared and not self._room_everywhere(buffers):
            raise NoRoom(self.by_name[next(iter(prepared))])
        self.uniform_mem += buffers
        free = cm.capacity - self.uniform_mem

        def node_for(si: int) -> int | None:
            u = sharded[si]
            load_c, mem_c = prepared[u.name][:2]
            order = np.argsort(-load_c, kind="stable")
            node = best_node(cm, self.loads, self.mem, free, load_c[order], mem_c[order])
            if node is None and u.within_node:
                raise NoRoom(u)
            return node

        try:
            placed = place_interleaved(
                self.loads,
                self.mem,
                free,
                [(si, ci) for _, si, ci in cells],
                [prepared[u.name][0] for u in sharded],
                [prepared[u.name][1] for u in sharded],
                [one_node(u, decisions[u.name]) for u in sharded],
                cm.node_of,
                node_for,
            )
        except RanksFull as e:
            raise NoRoom(sharded[e.args[0]]) from None
        for si, u in enumerate(sharded):
            load_c, mem_c, templates, uni = prepared[u.name]
            self._install(u, decisions[u.name], load_c, mem_c, templates, placed[si], uni)

    def _prepare(
        self, u: Unit, d: Decision
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, Placement]], float]:
        """A sharded unit's cell loads, cell memory, template placements and the bytes it
        puts on every rank (cached on the cost model for every search: read-only)."""
        key = (u.name, d)
        hit = self.cm.unit_cache.get(key)
        if hit is None:
            load_c, mem_c, templates = self._cells(u, d)
            load_c.flags.writeable = False
            mem_c.flags.writeable = False
            hit = self.cm.unit_cache[key] = (
                load_c,
                mem_c,
                templates,
                self._uniform_bytes(templates),
            )
        return hit

    def _install(
        self,
        u: Unit,
        d: Decision,
        load_c: np.ndarray,
        mem_c: np.ndarray,
        templates: list[tuple[str, Placement]],
        ranks: np.ndarray,
        uni: float,
    ) -> None:
        """Record sharded unit `u`, its cells on `ranks`, in the layout and the exact state
        (the proxy loads and memory are the caller's)."""
        self.applied[u.name] = _Applied(ranks, load_c, mem_c, 0.0, uni)
        for name, p in templates:
            q = p.with_ranks(tuple(int(x) for x in ranks))
            self.layout[name] = q
            self.state.add_table(name, q, 1.0)
        self.decisions[u.name] = d

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> tuple[Any, ...]:
        st = self.state
        arrays = {k: v.copy() for k, v in vars(st).items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in vars(st).items() if isinstance(v, float)}
        return (
            self.loads.copy(),
            self.mem.copy(),
            self.uniform_load,
            self.uniform_mem,
            dict(self.layout),
            dict(self.applied),
            dict(self.decisions),
            arrays,
            scalars,
            dict(st.counts),
        )

    def restore(self, snap: tuple[Any, ...]) -> None:
        (loads, mem, ul, um, layout, applied, decisions, arrays, scalars, counts) = snap
        self.loads, self.mem = loads.copy(), mem.copy()
        self.uniform_load, self.uniform_mem = ul, um
        self.layout, self.applied, self.decisions = dict(layout), dict(applied), dict(decisions)
        for k, v in arrays.items():
            setattr(self.state, k, v.copy())
        for k, v in scalars.items():
            setattr(self.state, k, v)
        self.state.counts = dict(counts)

    def adopt(self, decisions: dict[str, Decision], layout: Layout) -> None:
        """Set the state to `layout`, whose units have the grids of `decisions`."""
        self.reset()
        for u in self.units:
            d = decisions[u.name]
            if d.kind == "dp":
                self.place(u, d)
                continue
            load_c, mem_c, templates, uni = self._prepare(u, d)
            ranks = np.asarray(layout[u.tables[0]].ranks, dtype=np.int64)
            np.add.at(self.loads, ranks, load_c)
            np.add.at(self.mem, ranks, mem_c)
            self.uniform_mem += uni
            self._install(u, d, load_c, mem_c, templates, ranks, uni)

    def _set_ranks(self, u: Unit, ranks: np.ndarray) -> None:
        """Move the cells of sharded unit `u` to `ranks` (one per cell), grid unchanged."""
        a = self.applied[u.name]
        np.add.at(self.loads, a.ranks, -a.load)
        np.add.at(self.mem, a.ranks, -a.mem)
        for name in u.tables:
            p = self.layout[name]
            self.state.add_table(name, p, -1.0)
            q = p.with_ranks(tuple(int(x) for x in ranks))
            self.layout[name] = q
            self.state.add_table(name, q, 1.0)
        np.add.at(self.loads, ranks, a.load)
        np.add.at(self.mem, ranks, a.mem)
        self.applied[u.name] = _Applied(ranks, a.load, a.mem, a.uniform_load, a.uniform_mem)
