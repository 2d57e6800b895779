"""Unit moves: for the units that load the critical rank most, re-placing, splitting
and merging their grids, trading rows for columns, another kind or communication; kept
when they lower the P_NORM-norm of the rank times (`improve`), or the step time itself
(`polish`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import numpy as np

from embarkc.planner.clusters import (
    Unit,
    initial_grid,
)
from embarkc.planner.search.board import Board
from embarkc.planner.search.place import Decision, NoRoom
from embarkc.planner.search.starts import kind_comm
from embarkc.planner.search.tuning import P_NORM, POLISH_GRIDS, POLISH_ROUNDS

_S = TypeVar("_S")
"""What `Search.judged` judges a layout by."""


class UnitMoves(Board):
    """The board with its unit-level moves."""

    # ------------------------------------------------------------------ moves
    def candidates(
        self, u: Unit, d: Decision, extra_grids: tuple[tuple[int, int], ...] = ()
    ) -> list[Decision]:
        """The moves of unit `u` now at `d`: re-placed, neighbouring grids (and
            `extra_grids`), the other kinds and, for rb, the other communication (ub keeps the
        search's, `choose_ub_comm`)."""
        cm = self.cm
        out: list[Decision] = []
        if d.kind != "dp":
            out.append(d)  # the same grid re-placed: its cells move to the least-loaded ranks
        if d.kind == "dp":
            r, c = initial_grid(cm, u)
            for k in u.kinds:
                if k != "dp":
                    out.append(Decision(k, r, c, self._kind_comm(k)))
            return out
        grids = {
            (d.r + 1, d.c),
            (2 * d.r, d.c),
            (d.r - 1, d.c),
            (d.r, d.c + 1),
            (d.r, 2 * d.c),
            (d.r, d.c - 1),
            (d.r // 2, 2 * d.c),
            (2 * d.r, d.c // 2),
            *extra_grids,
        }
        for r2, c2 in sorted(grids):
            if (r2, c2) == (d.r, d.c) or not (u.min_r <= r2 <= u.max_r):
                continue
            if not (u.min_c <= c2 <= u.max_c) or r2 * c2 > 4 * cm.W:
                continue
            out.append(replace(d, r=r2, c=c2, comm=self._comm(d.comm)))
        for k in u.kinds:
            if k == d.kind:
                continue
            if k == "dp":
                out.append(Decision("dp"))
            else:
                out.append(replace(d, kind=k, comm=self._kind_comm(k)))
        if d.kind == "rb" and cm.nodes > 1 and self.comm_mode == "auto":
            out.append(replace(d, comm="flat" if d.comm == "hierarchical" else "hierarchical"))
        return out

    def _kind_comm(self, kind: str) -> str:
        return kind_comm(self.cm, kind, self.ub_comm)

    def _comm(self, current: str = "flat") -> str:
        if self.comm_mode != "auto":
            return self.comm_mode
        return current

    def scores(self, u: Unit, moves: list[Decision]) -> list[tuple[float, float]]:
        """`try_move` of every move in `moves` (`score`; (inf, inf) when it does not fit),
        each from the current state, which is restored afterwards."""
        return self.judged(u, moves, self.score, (math.inf, math.inf))

    def judged(
        self, u: Unit, moves: list[Decision], judge: Callable[[], _S], failed: _S
    ) -> list[_S]:
        """`judge()` of the layout after re-placing `u` with each move in `moves` (`failed`
        when it does not fit), each from the current state, which is restored afterwards;
        `u` is removed and the rank times without it computed once."""
        base = self.snapshot()
        self.remove(u)
        without = self.snapshot()
        ref = self.state.times() if self.exact_ref else None
        out: list[_S] = []
        for d in moves:
            try:
                self.place(u, d, None if ref is None else ref.copy())
                out.append(judge())
            except NoRoom:
                out.append(failed)
            self.restore(without)
        self.restore(base)
        return out

    def try_move(self, u: Unit, d: Decision) -> tuple[float, float]:
        """Score after re-placing `u` with `d` ((inf, inf) when it does not fit); kept."""
        self.remove(u)
        try:
            self.place(u, d)
        except NoRoom:
            return (math.inf, math.inf)
        return self.score()

    def score(self) -> tuple[float, float]:
        """(the 16-norm of the rank times, the step time).

        The search descends on the 16-norm, a smooth stand-in for the maximum: when many
        ranks share the maximum (every one holding a heavy cell), no single move lowers the
        maximum, but each move that unloads one of them lowers the norm. The best step
        time seen is kept separately.
        """
        t = self.state.times()
        m = float(t.max())
        if m <= 0:
            return 0.0, 0.0
        return m * float(((t / m) ** P_NORM).sum()) ** (1.0 / P_NORM), m

    def polish(self, rounds: int = POLISH_ROUNDS, top_units: int = 3) -> float:
        """Lower the step time itself: for the `top_units` heaviest units of the critical
        rank, try their moves and the grids of POLISH_GRIDS, apply the one that lowers the
        step time most, and repeat until none does. Ends in the state it returns the step
        time of (never worse than where it started)."""
        cm = self.cm
        best = self.score()[1]
        for _ in range(rounds):
            if self.meter.spent():
                break  # the time limit
            crit = int(np.argmax(self.state.times()))
            on_crit = {
                name: load
                for name, a in self.applied.items()
                if (load := a.load_on(crit)) is not None
            }
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], cm.facts[n].index))
            best_move: tuple[float, str, Decision] | None = None
            for name in ranked[:top_units]:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name], POLISH_GRIDS)
                for m, (_, t) in zip(moves, self.scores(u, moves), strict=True):
                    if t < best * (1 - 1e-9) and (best_move is None or t < best_move[0]):
                        best_move = (t, name, m)
            if best_move is None:
                break
            best = self.try_move(self.by_name[best_move[1]], best_move[2])[1]
        return best

    @staticmethod
    def better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return a[0] < b[0] * (1 - 1e-9)

    def improve(self, max_iterations: int, top_units: int = 3) -> tuple[float, float]:
        """Apply the best move on the critical rank until no move helps; the search ends
        in the best layout (by step time) it has seen."""
        best = self.score()
        best_seen = (best[1], dict(self.layout), self.snapshot())
        for it in range(max_iterations):
            if self.meter.spent():
                break  # the time limit: the best layout seen so far
            times = self.state.times()
            crit = int(np.argmax(times))
            on_crit: dict[str, float] = {}
            for name, a in self.applied.items():
                load = a.load_on(crit)
                if load is not None:
                    on_crit[name] = load
                elif a.uniform_load > 0:
                    on_crit[name] = a.uniform_load
            ranked = sorted(on_crit, key=lambda n: (-on_crit[n], self.cm.facts[n].index))
            # the units alone in their cluster kind: moving them removes a whole cluster's
            # collectives and kernel launches from every rank
            kinds: dict[tuple[str, str], list[str]] = {}
            for name, d in self.decisions.items():
                kinds.setdefault((d.kind, d.comm if d.kind == "rb" else ""), []).append(name)
            lonely = sorted(
                (v[0] for v in kinds.values() if len(v) == 1 and v[0] not in ranked[:top_units]),
                key=lambda n: self.cm.facts[n].index,
            )
            best_move: tuple[tuple[float, float], str, Decision] | None = None
            for name in ranked[:top_units] + lonely:
                u = self.by_name[name]
                moves = self.candidates(u, self.decisions[name])
                for d, sc in zip(moves, self.scores(u, moves), strict=True):
                    if self.better(sc, best) and (
                        best_move is None or self.better(sc, best_move[0])
                    ):
                        best_move = (sc, name, d)
            if best_move is None:
                break
            _, name, d = best_move
            best = self.try_move(self.by_name[name], d)
            if best[1] < best_seen[0] * (1 - 1e-9):
                best_seen = (best[1], dict(self.layout), self.snapshot())
            if self.progress is not None and it % 10 == 0:
                self.progress("greedy", min(1.0, it / max_iterations), best_seen[0])
        self.restore(best_seen[2])
        return self.score()
