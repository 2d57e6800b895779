"""`greedy.place_interleaved` (`Search.place_all`'s placement of all cells, heaviest
first, from lazy heaps) and `greedy._best_node_placed` (a unit's cells on each node, from
heaps) against the plain numpy loops they replaced, written here as they were: the same
rank for every cell, the same loads to the bit, the same refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embarkc.planner.search.place as search_place
from embarkc.planner.search.place import RanksFull, _best_node_placed, place_interleaved


def _loop(loads, mem, free, cells, load_cs, mem_cs, restricted, node_of, node_for):
    """The loop of numpy calls over all ranks per cell that `place_all` ran."""
    W = len(loads)
    out = [np.full(len(x), -1, dtype=np.int64) for x in load_cs]
    used: dict[int, np.ndarray] = {}
    allowed: dict[int, np.ndarray | None] = {}
    for ui, ci in cells:
        single = len(load_cs[ui]) == 1
        us = None if single else used.setdefault(ui, np.zeros(W, dtype=bool))
        if ui not in allowed:
            node = node_for(ui) if restricted[ui] else None
            allowed[ui] = None if node is None else node_of == node
        al = allowed[ui]
        room = mem + mem_cs[ui][ci] <= free
        if al is not None:
            room &= al
        cand = room
        if us is not None:
            fresh = room & ~us
            cand = fresh if fresh.any() else room
        if not cand.any():
            raise RanksFull(ui)
        a = int(np.argmin(np.where(cand, loads, np.inf)))
        out[ui][ci] = a
        if us is not None:
            us[a] = True
        loads[a] += load_cs[ui][ci]
        mem[a] += mem_cs[ui][ci]
    return out


def _best_node_loop(t, m, free, load_c, mem_c):
    """`_best_node_placed` as it was: all nodes at once, a dozen numpy calls per cell."""
    N, G = t.shape
    rows = np.arange(N)
    used = np.zeros((N, G), dtype=bool)
    ok = np.ones(N, dtype=bool)
    for lc, mc in zip(load_c, mem_c, strict=True):
        room = m + mc <= free
        fresh = room & ~used
        cand = np.where(fresh.any(axis=1, keepdims=True), fresh, room)
        ok &= cand.any(axis=1)
        a = np.argmin(np.where(cand, t, np.inf), axis=1)
        t[rows, a] += lc
        m[rows, a] += mc
        used[rows, a] = True
    if not ok.any():
        return None
    worst = np.where(ok, t.max(axis=1), np.inf)
    total = np.where(ok, t.sum(axis=1), np.inf)
    return int(np.lexsort((total, worst))[0])


# few distinct values: ties in loads, memory and nodes are the point
LOADS = st.sampled_from([0.0, 0.25, 1.0, 1.5, 2.0, 3.25])
MEMS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


@st.composite
def programs(draw):
    nodes = draw(st.integers(1, 4))
    G = draw(st.integers(1, 5))
    W = nodes * G
    loads = np.array(draw(st.lists(LOADS, min_size=W, max_size=W)))
    mem = np.array(draw(st.lists(MEMS, min_size=W, max_size=W)))
    U = draw(st.integers(1, 6))
    # units of one cell, of a few, and of more cells than ranks (their own heaps)
    sizes = [draw(st.sampled_from([1, 1, 2, 3, 7, 20, 40])) for _ in range(U)]
    load_cs = [np.array(draw(st.lists(LOADS, min_size=n, max_size=n))) for n in sizes]
    mem_cs = [np.array(draw(st.lists(MEMS, min_size=n, max_size=n))) for n in sizes]
    restricted = [draw(st.booleans()) for _ in range(U)]
    # a restricted unit's node: a fixed one, none (any rank) or the node of least load at
    # its first cell (which reads the loads the placement has reached)
    choice = [draw(st.sampled_from(["least", "none", *range(nodes)])) for _ in range(U)]
    free = draw(st.sampled_from([3.0, 6.0, 12.0, 40.0, 1e9]))
    cells = sorted(((-float(x), u, c) for u, lc in enumerate(load_cs) for c, x in enumerate(lc)))
    return (
        nodes,
        G,
        loads,
        mem,
        free,
        [(u, c) for _, u, c in cells],
        load_cs,
        mem_cs,
        restricted,
        choice,
    )


def _node_for(choice, loads, nodes, G):
    def node_for(ui):
        c = choice[ui]
        if c == "none":
            return None
        if c == "least":
            return int(np.argmin(loads.reshape(nodes, G).sum(axis=1)))
        return int(c)

    return node_for


def _run(fn, case):
    nodes, G, loads, mem, free, cells, load_cs, mem_cs, restricted, choice = case
    loads, mem = loads.copy(), mem.copy()
    node_of = np.repeat(np.arange(nodes), G)
    try:
        out = fn(
            loads,
            mem,
            free,
            cells,
            load_cs,
            mem_cs,
            restricted,
            node_of,
            _node_for(choice, loads, nodes, G),
        )
    except RanksFull as e:
        return ("full", e.args[0])
    return ([x.tolist() for x in out], loads.tolist(), mem.tolist())


@settings(max_examples=600, deadline=None)
@given(programs())
def test_the_heaps_place_every_cell_where_the_loop_does(case) -> None:
    assert _run(place_interleaved, case) == _run(_loop, case)


@settings(max_examples=150, deadline=None)
@given(programs())
def test_the_numpy_rule_taken_at_every_cell_places_as_the_heaps_do(case) -> None:
    """With no heap entries allowed per cell every cell falls back to the numpy rule; with
    one or two, most do after a pop or two: the placement is the same either way."""
    want = _run(place_interleaved, case)
    kept = search_place.HEAP_POPS
    try:
        for pops in (0, 1, 2):
            search_place.HEAP_POPS = pops
            assert _run(place_interleaved, case) == want
    finally:
        search_place.HEAP_POPS = kept


def test_a_unit_of_many_cells_spreads_then_stacks_and_a_full_rank_is_skipped():
    """Three ranks, rank 1 full: the first two cells go to ranks 0 and 2 (fresh), the
    next ones to the lighter of those two; a single cell later finds rank 2."""
    loads = np.array([0.0, 0.0, 0.5])
    mem = np.array([0.0, 9.0, 0.0])
    load_cs = [np.array([2.0, 2.0, 1.0, 1.0]), np.array([0.5])]
    mem_cs = [np.ones(4), np.ones(1)]
    cells = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    node_of = np.zeros(3, dtype=np.int64)
    out = place_interleaved(
        loads, mem, 9.5, cells, load_cs, mem_cs, [False, False], node_of, lambda u: None
    )
    assert [x.tolist() for x in out] == [[0, 2, 0, 2], [0]]
    assert loads.tolist() == [3.5, 0.0, 3.5]


def test_a_cell_without_room_names_its_unit():
    loads = np.zeros(2)
    mem = np.array([4.0, 4.0])
    with pytest.raises(RanksFull) as e:
        place_interleaved(
            loads,
            mem,
            5.0,
            [(0, 0), (1, 0)],
            [np.ones(1), np.ones(1)],
            [np.ones(1), np.full(1, 2.0)],
            [False, False],
            np.zeros(2, np.int64),
            lambda u: None,
        )
    assert e.value.args == (1,)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.data(),
)
def test_best_node_placed_picks_the_node_the_numpy_loop_picks(nodes, G, data) -> None:
    W = nodes * G
    t = np.array(data.draw(st.lists(LOADS, min_size=W, max_size=W))).reshape(nodes, G)
    m = np.array(data.draw(st.lists(MEMS, min_size=W, max_size=W))).reshape(nodes, G)
    n = data.draw(st.integers(1, 3 * G + 2))
    load_c = np.sort(np.array(data.draw(st.lists(LOADS, min_size=n, max_size=n))))[::-1].copy()
    mem_c = np.array(data.draw(st.lists(MEMS, min_size=n, max_size=n)))
    free = data.draw(st.sampled_from([3.0, 6.0, 1e9]))
    want = _best_node_loop(t.copy(), m.copy(), free, load_c, mem_c)
    assert _best_node_placed(t.copy(), m.copy(), free, load_c, mem_c) == want
