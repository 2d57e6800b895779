"""The planner's time budget: how a `--time-limit` is shared between the stages, and the
work meter that the searches spend it by.

    PlanBudget.of(time_limit, size)      the limit, the command's reserve, the shares
    WorkMeter(ranks)                     the deterministic count of the search's work

Every budget is a deterministic count of work, not a clock: the searches count the
layouts they cost (`RankState.components`), the tables they add or remove
(`RankState.add_cells`) and the cells they place (`Search.place_all`) on a `WorkMeter`,
which turns the counts into CPU seconds of the development machine (`SECONDS_PER_*`).
So the same spec and limit give the same plan on any machine. The pipeline creates one
meter per plan and passes it to every stage that spends it; the cost model only costs.

How the limit is shared (`plan_program`): the rest of the command (`REST_*`: starting
Python, reading the spec, the statistics, the checker, writing the plan) and the fixed
strategies' step times (`BASELINE_*`, where they fit) are reserved first; the greedy gets
the rest (`PlanBudget.greedy_work`); CP-SAT gets what the greedy leaves, at most
REFINE_SHARE of the limit (`PlanBudget.refine_seconds`), and the random kicks what is
left beyond that (`PlanBudget.kick_work`). The measurements behind the constants are in
bench/RESULTS.md ("Planner work-cost constants").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embarkc.planner.cost import CommandSize

REFINE_SHARE = 0.7
"""Most of the time limit that CP-SAT's refinement gets (its own deterministic count of
work, see cpsat.py)."""

MAX_PLANNED_GPUS = 1 << 17
"""The largest cluster the planner plans (131,072 GPUs): it keeps a few numbers per rank
and unit; twice the limit would take twice the time and a plan file of 50 MB. The
language allows clusters up to 2^26 GPUs."""

REST_SECONDS = 0.45
REST_SECONDS_PER_TABLE = 1e-3
REST_SECONDS_PER_SIGNATURE = 1.3e-3
REST_SHARE = 0.1
"""The wall time the plan command spends besides the greedy's search, the refinement and
the baselines, from the process's start to its exit: REST_SECONDS (starting Python and
importing embarkc), plus per table (reading the spec, the estimate, the checker, writing
the plan), plus per distinct table signature (`TableFacts.signature`: the access
statistics, each unit's starting kinds, the lower bound), plus REST_SHARE of the greedy's
work. A little more than measured, for a margin."""

BASELINE_SECONDS_PER_TABLE = 2.8e-3
BASELINE_SECONDS_PER_HEAD = 8e-3
"""CPU seconds of the fixed strategies' step times (`baselines.baseline_times`), which
the plan command records: per table, and per exact zipf head that the row-split
strategies compute for each distinct table signature (`cost.head_weight`). Reserved from
the limit of every search where they fit (`baselines_fit`), so that a plan does not
depend on whether its caller records them."""

BASELINE_SHARE = 0.5
"""Most of the limit (less the rest of the command) that the baselines may take: with a
shorter limit the search keeps the time and the plan records no baselines."""

SECONDS_PER_PLACED = 2e-6
SECONDS_PER_PLACED_RANK = 0.09e-6
"""CPU seconds per unit or cell `Search.place_all` places (`WorkMeter.placed`), the first
plus the second per rank, taken at the high end of the measurements. Not search work: it
bounds only the time spent on starts while none has fit (`WorkMeter.placed_past`)."""

SECONDS_PER_EVALUATION = 133e-6
SECONDS_PER_EVALUATION_RANK = 0.35e-6
SECONDS_PER_ADDITION = 168e-6
"""The search's CPU seconds per layout evaluated (`WorkMeter.evaluations`; the first,
plus the second per rank) and per table added to or removed from a layout
(`WorkMeter.additions`), with the search's own work around them: a least-squares fit to
the greedy's CPU time on the 12 paper cases, times 1.25, so at least the measured time
on every one."""


@dataclass
class WorkMeter:
    """The search's deterministic count of work, and the deadline its passes stop at.

    One per plan: created by the pipeline (or by a caller of a search stage) and passed
    to every stage that spends it. A `RankState` given a meter counts its evaluations and
    additions on it; a state without one (a check, a message, a report) counts nothing.
    """

    ranks: int
    """The cluster's GPUs: an evaluation's cost grows with them."""
    evaluations: int = 0
    """`RankState.components` calls."""
    additions: int = 0
    """`RankState.add_cells` calls."""
    placed: int = 0
    """Units and cells `Search.place_all` placed, or tried to."""
    deadline: float = math.inf
    """The work (`seconds`) at which the searches' optional passes stop; inf: none."""
    bound_options: Any = None
    """The lower bound's options per unit (`bound.unit_options`), costed once per plan
    (counted here the first time) and shared by the greedy's bound start and the plan's
    bound."""

    def seconds(self) -> float:
        """The search work counted so far, in CPU seconds of the development machine."""
        per_eval = SECONDS_PER_EVALUATION + SECONDS_PER_EVALUATION_RANK * self.ranks
        return self.evaluations * per_eval + self.additions * SECONDS_PER_ADDITION

    def placing_seconds(self) -> float:
        """CPU seconds `Search.place_all` took so far, by the same machine's count."""
        return self.placed * (SECONDS_PER_PLACED + SECONDS_PER_PLACED_RANK * self.ranks)

    def placed_past(self, deadline: float) -> bool:
        """Whether the search's work and its placing together reach `deadline` (the
        greedy's budget, while no start has fit)."""
        return self.seconds() + self.placing_seconds() >= deadline

    def spent(self) -> bool:
        """Whether the work has reached the deadline."""
        return self.deadline != math.inf and self.seconds() >= self.deadline

    @contextmanager
    def until(self, deadline: float) -> Iterator[None]:
        """Within the block the deadline is `deadline`; afterwards what it was."""
        saved = self.deadline
        self.deadline = deadline
        try:
            yield
        finally:
            self.deadline = saved


def _fixed_rest(n_tables: int, signatures: int) -> float:
    return (
        REST_SECONDS + REST_SECONDS_PER_TABLE * n_tables + REST_SECONDS_PER_SIGNATURE * signatures
    )


def baseline_seconds(n_tables: int, heads: float = 0.0) -> float:
    """The fixed strategies' time for `n_tables` tables whose signatures make `heads`
    exact heads (`cost.head_weight`)."""
    return BASELINE_SECONDS_PER_TABLE * n_tables + BASELINE_SECONDS_PER_HEAD * heads


def baselines_fit(
    time_limit: float, n_tables: int, signatures: int = 0, heads: float = 0.0
) -> bool:
    """Whether the baselines' time of `n_tables` tables (of `signatures` distinct
    signatures making `heads` exact heads) fits in `time_limit` (BASELINE_SHARE of it,
    less the rest of the command)."""
    need = baseline_seconds(n_tables, heads)
    return need <= BASELINE_SHARE * (time_limit - _fixed_rest(n_tables, signatures))


def baselines_limit(n_tables: int, signatures: int = 0, heads: float = 0.0) -> int:
    """The least whole number of seconds of limit in which the baselines fit."""
    need = baseline_seconds(n_tables, heads)
    return math.ceil(_fixed_rest(n_tables, signatures) + need / BASELINE_SHARE)


def command_reserve(
    time_limit: float, n_tables: int, signatures: int = 0, heads: float = 0.0
) -> float:
    """Seconds of the limit kept from the searches besides REST_SECONDS and REST_SHARE of
    the greedy's work: the rest per table and per signature, and the baselines' time
    where they fit."""
    reserve = REST_SECONDS_PER_TABLE * n_tables + REST_SECONDS_PER_SIGNATURE * signatures
    if baselines_fit(time_limit, n_tables, signatures, heads):
        reserve += baseline_seconds(n_tables, heads)
    return reserve


def rest_seconds(greedy_work: float, reserve: float) -> float:
    """The rest of the command after a greedy of `greedy_work` (`WorkMeter.seconds`)."""
    return REST_SECONDS + REST_SHARE * greedy_work + reserve


def greedy_budget(time_limit: float, reserve: float = 0.0) -> float:
    """The work (`WorkMeter.seconds`) the greedy may take within `time_limit`: all of it
    but the rest of the command (REST_SECONDS, REST_SHARE of its work and `reserve`
    seconds for what the command does besides, the baselines')."""
    return (time_limit - REST_SECONDS - reserve) / (1.0 + REST_SHARE)


def refine_budget(
    time_limit: float, greedy_work: float, phase_work: float, reserve: float = 0.0
) -> float:
    """Seconds of CP-SAT's deterministic work that `time_limit` leaves after a greedy of
    `greedy_work`, a phase pass of `phase_work` on CP-SAT's layout and the rest of the
    command (`reserve` as for `greedy_budget`), at most REFINE_SHARE of the limit; 0 or
    less: none."""
    return min(
        time_limit * REFINE_SHARE,
        time_limit - greedy_work - phase_work - rest_seconds(greedy_work, reserve),
    )


@dataclass
class PlanBudget:
    """One plan's time limit, what the command keeps of it, and the work meter the
    searches spend the rest by (see the module docstring)."""

    time_limit: float
    size: CommandSize
    meter: WorkMeter

    @classmethod
    def of(cls, time_limit: float, size: CommandSize, ranks: int) -> PlanBudget:
        return cls(time_limit, size, WorkMeter(ranks))

    @property
    def reserve(self) -> float:
        """Seconds kept for the rest of the command and the baselines (`command_reserve`)."""
        return command_reserve(self.time_limit, *self.size)

    @property
    def baselines_fit(self) -> bool:
        """Whether the fixed strategies' step times fit in the limit (and are costed)."""
        return baselines_fit(self.time_limit, *self.size)

    def greedy_work(self) -> float:
        """The work the greedy may take (`greedy_budget`)."""
        return greedy_budget(self.time_limit, self.reserve)

    def refine_seconds(self, greedy_work: float, phase_work: float) -> float:
        """CP-SAT's deterministic seconds after the greedy (`refine_budget`)."""
        return refine_budget(self.time_limit, greedy_work, phase_work, self.reserve)

    def kick_work(self, greedy_work: float, phase_work: float, refine: float) -> float:
        """The work the random kicks may take: what the limit leaves beyond the greedy,
        its phase pass, the rest of the command and CP-SAT's `refine` seconds (the
        kicks' work adds REST_SHARE to the rest)."""
        slack = (
            self.time_limit
            - greedy_work
            - phase_work
            - rest_seconds(greedy_work, self.reserve)
            - max(refine, 0.0)
        )
        return slack / (1.0 + REST_SHARE)

    def command_rest(self) -> float:
        """The rest of the command besides the searches, for a message."""
        return REST_SECONDS + self.reserve
