"""The greedy search's knobs: how many starts, moves, evaluations and passes, each with
the reason for its value and the plans that set it (the paper workloads: DCNv2, T180,
T200, T510, on 8 to 128 GPUs). The modules that use a knob import it by name, so a test
that turns one patches it where it is used."""

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
cell reads its ids again), and where the balance lies depends on the workload: on 128 GPUs the best
share is 0.42-0.63 for T180 (4.241 ms; 4.544 at 0.25 alone), 0.63 for T200 (3.224; 3.310),
0.19 for T510 (4.709; 4.989), and a descent from each ends in its own local minimum
(T180: 4.478, 4.554, 4.242, 4.241, 4.480 from fine to coarse)."""

COLUMN_ONLY_RANKS = 64
"""On more ranks than this, a program of more than FOUR_START_UNITS units whose keys hide
searches the column start alone: a descent's cost grows with the ranks (T510 on 128
GPUs: the first start's took 1.2 s), while on T510 at 32 GPUs the first start still
wins (13.750 ms against 13.767) in a fraction of a second."""

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
"""Layouts `Search.rebalance` evaluates at most (about 0.2 ms each on 128 GPUs, by
`RankState.move_cell`). The gains come after long plateaus of equal ranks: T200 on 128
GPUs 3.224 ms, 3.224 after 1,000 evaluations, 3.112 after 3,000; T180 on 8 GPUs 37.401,
37.139 after 1,000, 37.056 after 3,000, 37.023 after 6,000; DCNv2 on 32 GPUs 1.233,
1.219, 1.212, 1.198 (1.196 after 12,000)."""

REBALANCE_FIRST_EVALS = 10_000
"""Layouts the second pass of `Search.rebalance` (`first=True`: the heaviest cell of the
critical rank that has a move takes its best one, partners of any size) evaluates at
most. A pass that looks at every cell before it moves one spends its budget on a single
round where the critical rank holds many cells: T510 on 32 GPUs 12.634 ms, 12.620 after
10,000 evaluations that way, 11.698 after 10,000 this way (about 1 s; whole rb tables
swap with column cells of other tables: a rank whose links receive more than they send
carries more results for nothing, and one whose HBM is busy sheds lookups). It keeps
the column cells of one row shard on distinct ranks. On the paper's programs of up to
FOUR_START_UNITS units it gains up to 0.5 % (DCNv2 on 128 GPUs 0.636 -> 0.633 ms, T180
on 128 GPUs 4.199 -> 4.184)."""

PHASE_EVALS = 16000
"""Layouts one pass of `Search.balance_phases` evaluates at most (cell moves and unit
moves alike) on programs of up to FOUR_START_UNITS units. Where many ranks share a
phase's maximum, every one of them must shed work before the critical path falls: T200
on 128 GPUs (10 ranks tied in its lookups and results) gains nothing within 4,000
layouts and 3.372 -> 3.279 ms (step 3.112 -> 3.107) within 16,000, in 1.3 s of CPU; on
32 GPUs 9.754 -> 9.569 (step 9.474 -> 9.395) in 4.2 s. T180 on 128 GPUs: four passes in
1.1 s, the same plan as with 4,000."""

PHASE_EVALS_LARGE = 4000
"""The same for larger programs (planning time: T510 on 128 GPUs, one pass in 0.55 s)."""

RUNS_SHARE = 0.6
"""Share of a greedy's work budget (`greedy`'s `budget`) after which no further start
begins and the later starts' descents stop; the rest is for the rebalance and the phase
passes (T180 on 128 GPUs: its 20 runs take 7.8 s of its 11.4 s of work, the rebalance 1.2
and the phase pass 1.9). Before the later descents stopped there too, one begun just
under it ran to the end of the budget and the passes after it ran past: T180 on 16 x 8
GPUs at `--time-limit 2` took 1.9-2.0 s (now 1.6 s, its plan 4.716 -> 4.880 ms; at 5 s
4.199 -> 4.178, T200 3.237 -> 3.208)."""

PHASE_PASSES = 4
"""Passes of `Search.balance_phases` at most (`balanced_phases`; one for programs of more
than FOUR_START_UNITS units)."""

PHASE_MIN_GAIN = 0.01
"""`balanced_phases` stops after a pass that lowered the critical path by less than this
share (planning time; T180 on 128 GPUs 5.026 -> 4.779 -> 4.729 -> 4.581 ms, then
nothing)."""

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
what is short is room itself. Without the rule a unit went on doubling its row shards up
to 64 per rank: 12 tables of 1 GB kept on one node each (hierarchical rb) on 4 x 8 GPUs
of 396 MB, 97 % full, made 12,288 cells a table and took 33 s at a 3 s limit to find that
they do not fit."""


KICK_UNITS = 2
"""Units a kick re-decides at random (`kicked`) before the descent."""

KICK_PATIENCE = 40
"""Kicks in a row that find nothing faster, after which `kicked` stops."""
