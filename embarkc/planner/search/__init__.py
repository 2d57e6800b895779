"""EMBark's greedy search, by the steps a reader would name (greedy.py's docstring has
the algorithm):

    place.py      Decision; where a unit's cells go (heaviest first, least-loaded rank)
    board.py      the ranks' loads and memory, the layout and its exact RankState
    moves.py      unit moves: improve (the norm's descent) and polish
    cells.py      Search: the board with every move, the cell moves here (rebalance,
                  phase balancing)
    starts.py     the starts: kinds and grids before the descent
    descent.py    a start placed (splitting what finds no room) and descended
    finish.py     the fastest plan rebalanced and its phases balanced; the memory check
    runs.py       greedy(): the starts' runs within the budget, the fixed-strategy starts
    kicks.py      random kicks from the greedy plan
    tuning.py     the knobs, each with its reason

Every stage that spends the time limit takes the plan's `budget.WorkMeter`.
"""

from embarkc.planner.search.cells import Search
from embarkc.planner.search.finish import balanced_phases, decision_of, fits_exactly
from embarkc.planner.search.kicks import kicked
from embarkc.planner.search.place import Decision, one_node, unit_cells
from embarkc.planner.search.runs import FixedStart, GreedyResult, greedy
from embarkc.planner.search.tuning import P_NORM

__all__ = [
    "Decision",
    "FixedStart",
    "GreedyResult",
    "P_NORM",
    "Search",
    "balanced_phases",
    "decision_of",
    "fits_exactly",
    "greedy",
    "kicked",
    "one_node",
    "unit_cells",
]
