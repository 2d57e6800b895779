"""The greedy search's knobs: how many starts, moves, evaluations and passes, each with
the reason for its value. The plans that set the values (the paper workloads: DCNv2, T180,
T200, T510, on 8 to 128 GPUs) are in bench/RESULTS.md, "The greedy's knobs". The modules
that use a knob import it by name, so a test that turns one patches it where it is used."""

from __future__ import annotations

MULTI_START_UNITS = 1000
"""Above this many units the greedy searches one start only (planning time)."""

FINE_START_RANKS = (128, 256)
"""On more ranks than the first, programs of more than FOUR_START_UNITS units also start
from the column-wise strategy's grids (`fine_column_start`), as programs of more than
MULTI_START_UNITS units do on any number of ranks; on up to the second, after their other
starts (where a short limit ends the search before it, it takes nothing from them)."""

FOUR_START_UNITS = 300
"""Up to this many units each start is also searched placing cells by owner loads alone
(the other mode places them by the full model's rank times): neither mode wins always."""

COLUMN_SHARES = (0.95, 0.63, 0.42, 0.28, 0.19)
"""The cell sizes `column_start` is run with, as fractions of a rank's fair share of the
owners' work: a geometric ladder of ratio 1.5, each searched and the fastest kept. Finer
cells pack the ranks closer but add work (narrow cells pay whole DRAM sectors, and every
cell reads its ids again), and where the balance lies depends on the workload (the best
share differs between the paper's workloads, and a descent from each ends in its own
local minimum)."""

COLUMN_ONLY_RANKS = 64
"""On more ranks than this, a program of more than FOUR_START_UNITS units whose keys hide
searches the column start alone: a descent's cost grows with the ranks, while on fewer
ranks the first start still wins, in a fraction of a second."""

P_NORM = 16.0
"""Exponent of the norm the search descends on (see `Search.score`)."""

POLISH_GRIDS = tuple((r, c) for r in (1, 2, 4, 8) for c in (1, 2, 4))
"""Grids the polish (`Search.polish`) tries for the heaviest units of the critical rank,
beside their neighbouring grids: jumps that single steps of the descent cannot make."""

DESCENT_CYCLES = 4
"""Rounds of descent and polish `descend` repeats while the step time falls (the polish
moves the critical rank, so the next descent starts elsewhere); one round for programs
of more than FOUR_START_UNITS units (planning time)."""

POLISH_ROUNDS = 6
"""Moves the polish applies at most (each one a full scan of its candidates)."""

REBALANCE_EVALS = 6000
"""Layouts `Search.rebalance` evaluates at most (each by `RankState.move_cell`). The gains
come after long plateaus of equal ranks, thousands of evaluations in."""

REBALANCE_FIRST_EVALS = 10_000
"""Layouts the second pass of `Search.rebalance` (`first=True`: the heaviest cell of the
critical rank that has a move takes its best one, partners of any size) evaluates at
most. A pass that looks at every cell before it moves one spends its budget on a single
round where the critical rank holds many cells; this way whole rb tables swap with
column cells of other tables (a rank whose links receive more than they send carries more
results for nothing, and one whose HBM is busy sheds lookups). It keeps the column cells
of one row shard on distinct ranks."""

PHASE_EVALS = 16000
"""Layouts one pass of `Search.balance_phases` evaluates at most (cell moves and unit
moves alike) on programs of up to FOUR_START_UNITS units. Where many ranks share a
phase's maximum, every one of them must shed work before the critical path falls, which
takes many more layouts than a single critical rank does."""

PHASE_EVALS_LARGE = 4000
"""The same for larger programs (planning time)."""

RUNS_SHARE = 0.6
"""Share of a greedy's work budget (`greedy`'s `budget`) after which no further start
begins and the later starts' descents stop; the rest is for the rebalance and the phase
passes. The later descents stop there too: one begun just under it would otherwise run to
the end of the budget, and the passes after it past the time limit."""

PHASE_PASSES = 4
"""Passes of `Search.balance_phases` at most (`balanced_phases`; one for programs of more
than FOUR_START_UNITS units)."""

PHASE_MIN_GAIN = 0.01
"""`balanced_phases` stops after a pass that lowered the critical path by less than this
share (planning time: the gains of later passes shrink fast)."""

REBALANCE_TARGETS = 16
"""`Search.rebalance` tries the critical rank's cells on this many of the least-loaded
ranks, and on every rank of the critical rank's node."""


HEAP_POPS = 32
"""Heap entries `place_interleaved` looks at for one cell before it decides by numpy
calls over all ranks (where many ranks lack room for the cell, or its unit's ranks fill
the head of a shared heap). Either way the cell goes to the same rank."""

OWN_HEAP_CELLS = 16
"""Units of at least this many cells (or of a quarter of their allowed ranks) get a heap
of their own fresh ranks in `place_interleaved`; smaller ones share one heap of all
ranks (per node for one-node units) and skip the ranks they already hold."""


FINE_CELL_SHARE = 1 / 32
"""`place_splitting` stops splitting the rows of a unit that finds no room once its cells
are this small against a GPU, or once a split no longer makes them a quarter smaller (their
communication buffers do not shrink with the rows): finer cells then pack no better, and
what is short is room itself. Without the rule a unit goes on doubling its row shards up
to 64 per rank on a nearly full cluster, and takes many times its limit to find that the
tables do not fit."""


KICK_UNITS = 2
"""Units a kick re-decides at random (`kicked`) before the descent."""

KICK_PATIENCE = 40
"""Kicks in a row that find nothing faster, after which `kicked` stops."""
