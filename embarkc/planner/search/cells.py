"""Cell moves: single cells of the critical rank moved or swapped onto lighter ranks
(`rebalance`), and cell and unit moves that lower the critical path without raising the
step time (`balance_phases`), each judged by the exact cost model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from embarkc.planner.cost import phase_times
from embarkc.planner.search.moves import UnitMoves
from embarkc.planner.search.place import Decision, one_node
from embarkc.planner.search.tuning import P_NORM, REBALANCE_TARGETS


class Search(UnitMoves):
    """The whole search's state and moves: the board (board.py), its unit moves
    (moves.py) and, here, its cell moves."""

    def rebalance(self, max_evals: int, first: bool = False) -> float:
        """Move single cells off the critical rank: each cell there to one of the
        REBALANCE_TARGETS least-loaded ranks or to a rank of its node, alone or swapped
        with a lighter cell of that rank (memory and one-node units respected), judged by
        the exact model; apply the move that lowers the 16-norm most, and repeat until
        none does or `max_evals` layouts have been evaluated. With `first`, the cells are
        tried heaviest first and the first one that has a move takes its best, swapped with
        a cell of any size (REBALANCE_FIRST_EVALS says why). Whole-unit moves cannot make
        these trades: re-placing a unit moves all its cells, and the owner loads that
        place them overstate what a cell adds to a rank whose links have slack (a rank
        that receives more than it sends carries a cell's results for nothing). Ends in
        the layout of the lowest step time seen, which it returns."""
        cm = self.cm
        free = cm.capacity - self.uniform_mem
        cur = self.score()
        best = (cur[1], self.snapshot())
        evals = 0
        while evals < max_evals and not self.meter.spent():
            t = self.state.times()
            crit = int(np.argmax(t))
            node = int(cm.node_of[crit])
            order = [int(a) for a in np.argsort(t, kind="stable")]
            targets = list(
                dict.fromkeys(
                    order[:REBALANCE_TARGETS]
                    + [a for a in order if cm.node_of[a] == node and a != crit]
                )
            )
            on = self._cells_by_rank()
            moving = sorted(on.get(crit, []))
            found: tuple[float, list[tuple[str, int, int]]] | None = None
            for neg, name, ci in moving:
                stay = one_node(self.by_name[name], self.decisions[name])
                for tr in targets:
                    if tr == crit or (stay and cm.node_of[tr] != node):
                        continue
                    options: list[tuple[str, int] | None] = [None]
                    options += [
                        (n2, cj)
                        for neg2, n2, cj in sorted(on.get(tr, []))
                        if n2 != name and (first or -neg2 < -neg)
                    ]
                    for other in options:
                        moves = self._cell_moves(name, ci, tr, crit, other, free, first)
                        if moves is None:
                            continue
                        if evals >= max_evals or self.meter.spent():
                            break
                        sc = self._score_moves(moves)
                        evals += 1
                        if self.better(sc, cur) and (found is None or sc[0] < found[0]):
                            found = (sc[0], moves)
                if first and found is not None:
                    break
            if found is None:
                break
            self._apply_cell_moves(found[1])
            cur = self.score()
            if cur[1] < best[0] * (1 - 1e-9):
                best = (cur[1], self.snapshot())
        self.restore(best[1])
        return best[0]

    def _cell_moves(
        self,
        name: str,
        ci: int,
        tr: int,
        crit: int,
        other: tuple[str, int] | None,
        free: float,
        apart: bool = False,
    ) -> list[tuple[str, int, int]] | None:
        """(unit, cell, new rank) of the cells that change when cell `ci` of `name` moves
        from `crit` to `tr` (and cell `other` of `tr` to `crit`); None when memory or the
        other unit's node forbids it, or with `apart` when a cell would join another cell
        of its row shard (a layout the grid search's wider cell expresses, which CP-SAT's
        model of the keys does not: it sends them once per cell)."""
        a = self.applied[name]
        if apart and self._row_shard_on(name, ci, tr):
            return None
        if other is None:
            if self.mem[tr] + a.mem[ci] > free:
                return None
            return [(name, ci, tr)]
        n2, cj = other
        b = self.applied[n2]
        if one_node(self.by_name[n2], self.decisions[n2]) and (
            self.cm.node_of[crit] != self.cm.node_of[tr]
        ):
            return None
        if self.mem[tr] - b.mem[cj] + a.mem[ci] > free:
            return None
        if apart and n2 != name and self._row_shard_on(n2, cj, crit):
            return None
        if self.mem[crit] - a.mem[ci] + b.mem[cj] > free:
            return None
        return [(name, ci, tr), (n2, cj, crit)]

    def balance_phases(self, max_evals: int, cap: float | None = None) -> tuple[float, float]:
        """Lower the critical path (`RankState.critical_path`: every phase waits for its
        slowest rank) without raising the step time. The step time lets a rank light in
        one phase carry more of another, which a runtime whose collectives wait for every
        rank does not credit; among the layouts of equal step time this moves towards
        those whose phases are balanced too. Moves: single cells off the slowest rank of
        a phase (phases by how far their slowest rank is above their mean), alone or
        swapped with a cell of any size, to the ranks lightest in that phase, lightest
        in all, or of its node (memory and one-node units respected); when no cell move
        helps, the `candidates` of the heaviest units of that rank. It applies the move
        that lowers the phases' 16-norms most (`_phase_score`) with the step time at most
        `cap` (where it started when None), and repeats until none does or `max_evals`
        layouts have been evaluated; it ends in the layout of the lowest critical path
        seen and returns (step time, critical path) there."""
        cm = self.cm
        free = cm.capacity - self.uniform_mem
        st = self.state
        cur = self._phase_score()
        cap = cur[0] if cap is None else cap
        best = (cur[2], self.snapshot())
        evals = 0
        while evals < max_evals and not self.meter.spent():
            groups = phase_times(st.components())
            totals = np.sum(groups, axis=0)
            # the phases by how far their slowest rank is above their mean rank
            order = sorted(
                range(len(groups)),
                key=lambda g: (-float(groups[g].max() - groups[g].mean()), g),
            )
            on = self._cells_by_rank()
            found: tuple[tuple[float, ...], list[tuple[str, int, int]]] | None = None
            for g in order:
                t = groups[g]
                if t.max() - t.mean() <= 1e-12 * max(cur[1], 1e-30):
                    break
                crit = int(np.argmax(t))
                node = int(cm.node_of[crit])
                light = [int(a) for a in np.argsort(t, kind="stable")]
                idle = [int(a) for a in np.argsort(totals, kind="stable")]
                targets = list(
                    dict.fromkeys(
                        light[:REBALANCE_TARGETS]
                        + idle[:REBALANCE_TARGETS]
                        + [a for a in light if cm.node_of[a] == node and a != crit]
                    )
                )
                for _, name, ci in sorted(on.get(crit, [])):
                    stay = one_node(self.by_name[name], self.decisions[name])
                    for tr in targets:
                        if tr == crit or (stay and cm.node_of[tr] != node):
                            continue
                        options: list[tuple[str, int] | None] = [None]
                        options += [(n2, cj) for _, n2, cj in sorted(on.get(tr, [])) if n2 != name]
                        for other in options:
                            moves = self._cell_moves(name, ci, tr, crit, other, free, True)
                            if moves is None or evals >= max_evals or self.meter.spent():
                                continue
                            sc = self._score_moves(moves, self._phase_score)
                            evals += 1
                            if sc[0] <= cap and sc[1] < cur[1] * (1 - 1e-9):
                                if found is None or sc[1] < found[0][1]:
                                    found = (sc[:2], moves)
                    if found is not None:
                        break  # the heaviest cell that has a move takes its best
                if found is not None:
                    break
            if found is None:
                if self.meter.spent():
                    break
                # no cell move helps: re-place or re-grid a whole unit of a phase's
                # slowest rank
                which, d, spent = self._phase_unit_move(order, groups, cap, cur)
                evals += spent
                if which is None or d is None:
                    break
                u = self.by_name[which]
                self.remove(u)
                self.place(u, d)
            else:
                self._apply_cell_moves(found[1])
            cur = self._phase_score()
            if cur[2] < best[0] * (1 - 1e-9):
                best = (cur[2], self.snapshot())
        self.restore(best[1])
        return st.step_time(), st.critical_path()

    def _phase_unit_move(
        self,
        order: list[int],
        groups: list[np.ndarray],
        cap: float,
        cur: tuple[float, float, float],
        top_units: int = 3,
    ) -> tuple[str | None, Decision | None, int]:
        """The best move (`candidates`) of the `top_units` heaviest units on the slowest
        rank of the phases in `order` that lowers the phase norm with the step time at
        most `cap`: (unit, decision, layouts evaluated), or (None, None, evaluated)."""
        evals = 0
        for g in order:
            t = groups[g]
            if t.max() - t.mean() <= 1e-12 * max(cur[1], 1e-30):
                break
            crit = int(np.argmax(t))
            on_crit = {
                name: load
                for name, a in self.applied.items()
                if (load := a.load_on(crit)) is not None
            }
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], self.cm.facts[n].index))
            best: tuple[float, str, Decision] | None = None
            for name in ranked[:top_units]:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name])
                failed = (math.inf, math.inf, math.inf)
                judged = self.judged(u, moves, self._phase_score, failed)
                for d, sc in zip(moves, judged, strict=True):
                    if sc[0] <= cap and sc[1] < cur[1] * (1 - 1e-9):
                        if best is None or sc[1] < best[0]:
                            best = (sc[1], name, d)
                evals += len(moves)
            if best is not None:
                return best[1], best[2], evals
        return None, None, evals

    def _phase_score(self) -> tuple[float, float, float]:
        """(step time, the sum over `cost.PHASE_GROUPS` of the 16-norms of their rank times,
        critical path): the norm is the search's smooth stand-in for the critical path,
        as in `score`."""
        groups = np.array(phase_times(self.state.components()))
        times = groups.sum(axis=0)
        peak = groups.max(axis=1)
        on = peak > 0
        top = peak[on]
        norms = top * ((groups[on] / top[:, None]) ** P_NORM).sum(axis=1) ** (1.0 / P_NORM)
        norm = crit = 0.0
        for x in norms.tolist():
            norm += x
        for x in peak.tolist():
            crit += x
        return float(times.max()), norm, crit

    def _row_shard_on(self, name: str, ci: int, rank: int) -> bool:
        """Whether another cell of cell `ci`'s row shard of unit `name` is on `rank`."""
        c = self.decisions[name].c
        j = ci // c
        ranks = self.applied[name].ranks
        return any(int(ranks[k]) == rank for k in range(j * c, (j + 1) * c) if k != ci)

    def _move_cell(self, name: str, ranks: np.ndarray, ci: int, to: int) -> None:
        """Move cell `ci` of unit `name`, whose cells are on `ranks`, to rank `to` in the
        exact state only (`RankState.move_cell`); `ranks` is updated."""
        cm = self.cm
        for t in self.by_name[name].tables:
            p = self.layout[t]
            cv = cm.placement_values(cm.facts[t], p)
            self.state.move_cell(cv, ranks, ci, to, p.hierarchical)
        ranks[ci] = to

    def _score_moves(
        self,
        moves: list[tuple[str, int, int]],
        score: Callable[[], tuple[float, ...]] | None = None,
    ) -> tuple[float, ...]:
        """`score` (`self.score` when None) with the cell `moves` made; the state is left
        as it was."""
        ranks = {name: self.applied[name].ranks.copy() for name, _, _ in moves}
        for name, ci, to in moves:
            self._move_cell(name, ranks[name], ci, to)
        sc = (score or self.score)()
        for name, ci, _ in reversed(moves):
            self._move_cell(name, ranks[name], ci, int(self.applied[name].ranks[ci]))
        return sc

    def _apply_cell_moves(self, moves: list[tuple[str, int, int]]) -> None:
        """Make the (unit, cell, new rank) `moves` in the search state."""
        for name, ci, to in moves:
            ranks = self.applied[name].ranks.copy()
            ranks[ci] = to
            self._set_ranks(self.by_name[name], ranks)

    def _cells_by_rank(self) -> dict[int, list[tuple[float, str, int]]]:
        """Per rank, its cells as (-load, unit, cell index), for sorting heaviest first."""
        on: dict[int, list[tuple[float, str, int]]] = {}
        for name, a in self.applied.items():
            for ci, r in enumerate(a.ranks.tolist()):
                on.setdefault(r, []).append((-float(a.load[ci]), name, ci))
        return on
