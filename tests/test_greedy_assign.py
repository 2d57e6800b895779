"""`greedy.assign_heaps` (the placement of a unit's cells without numpy calls per cell)
against the rule it implements, written here as the plain loop over cells it replaced:
each cell, in order, to the allowed rank with room of least `ref` (ties to the lower
rank), among the ranks no cell of the unit holds yet when one of those has room."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embarkc.planner.search.place import RanksFull, assign_heaps


def _loop(mem, free, allowed, order, load_c, mem_c, ref):
    mem = mem.copy()
    used = np.zeros(len(mem), dtype=bool)
    out = []
    for idx in order:
        room = allowed & (mem + mem_c[idx] <= free)
        fresh = room & ~used
        cand = fresh if fresh.any() else room
        if not cand.any():
            return None
        a = int(np.argmin(np.where(cand, ref, np.inf)))
        ref[a] += load_c[idx]
        mem[a] += mem_c[idx]
        used[a] = True
        out.append(a)
    return np.array(out, dtype=np.int64)


@st.composite
def cases(draw):
    w = draw(st.integers(1, 12))
    n = draw(st.integers(1, 40))
    # few distinct values: ties in loads and memory are the point
    ref = np.array(
        draw(st.lists(st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.25]), min_size=w, max_size=w))
    )
    mem = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0]), min_size=w, max_size=w)))
    load_c = np.array(draw(st.lists(st.sampled_from([0.1, 0.5, 1.0, 2.0]), min_size=n, max_size=n)))
    mem_c = np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=n, max_size=n)))
    allowed = np.array(draw(st.lists(st.booleans(), min_size=w, max_size=w)))
    free = draw(st.sampled_from([4.0, 8.0, 20.0, 1e9]))
    order = np.argsort(-load_c, kind="stable")
    return mem, free, allowed, order, load_c, mem_c, ref


@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_heaps_place_every_cell_where_the_loop_does(case) -> None:
    mem, free, allowed, order, load_c, mem_c, ref = case
    want_ref = ref.copy()
    want = _loop(mem, free, allowed, order, load_c, mem_c, want_ref)
    got_ref = ref.copy()
    mem_before = mem.copy()
    if want is None:
        with pytest.raises(RanksFull):
            assign_heaps(mem, free, allowed, order, load_c, mem_c, got_ref)
        assert np.array_equal(got_ref, ref)  # nothing changed
    else:
        got = assign_heaps(mem, free, allowed, order, load_c, mem_c, got_ref)
        assert got.tolist() == want.tolist()
        assert np.array_equal(got_ref, want_ref)  # the same sums, to the bit
    assert np.array_equal(mem, mem_before)


def test_a_rank_without_room_for_any_later_cell_is_dropped_but_one_for_a_smaller_is_kept():
    """Rank 0 (least loaded) has room for the 1-byte cells only: the 3-byte cells go
    elsewhere, the later 1-byte cell still comes back to it."""
    mem = np.array([8.0, 0.0, 0.0])
    ref = np.array([0.0, 1.0, 2.0])
    load_c = np.array([3.0, 2.0, 1.0, 0.5])
    mem_c = np.array([3.0, 3.0, 1.0, 1.0])
    order = np.arange(4)
    got = assign_heaps(mem, 10.0, np.ones(3, dtype=bool), order, load_c, mem_c, ref)
    assert got.tolist() == [1, 2, 0, 0]
    assert ref.tolist() == [1.5, 4.0, 4.0]
