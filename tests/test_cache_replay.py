"""embarkc's replay of a host-tier cell's cache (embarkc.cache_replay) counts what the
runtime's RowCache counts, step for step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embark_runtime.cache import STAT_NAMES, RowCache
from embark_runtime.kernels import TorchKernels
from embark_runtime.optim import new_state
from embarkc.cache_replay import LruReplay

KERNELS = TorchKernels(torch.float64)
SGD = SimpleNamespace(
    optimizer="sgd",
    optimizer_params=SimpleNamespace(lr=0.5, eps=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0),
)


def _row_cache(rows: int, capacity: int) -> RowCache:
    weight = torch.zeros(rows, 2, dtype=torch.float32)
    params = SimpleNamespace(initial_accumulator=0.1)
    return RowCache(weight, new_state("sgd", rows, 2, params, "cpu"), capacity, "cpu")


@pytest.mark.parametrize("capacity", [0, 1, 3, 17, 60, 200])
@pytest.mark.parametrize("skew", [0.0, 1.2])
def test_the_replay_counts_what_row_cache_counts_on_random_steps(capacity, skew):
    rows, steps = 200, 40
    rng = np.random.default_rng(capacity * 7 + int(skew * 10))
    p = (np.arange(rows) + 1.0) ** -skew
    p /= p.sum()
    cache, replay = _row_cache(rows, capacity), LruReplay(capacity)
    for _ in range(steps):
        ids = rng.choice(rows, size=int(rng.integers(0, 80)), p=p)
        unique, counts = np.unique(ids, return_counts=True)
        r = torch.from_numpy(unique)
        slots = cache.admit(r, torch.from_numpy(counts) if len(ids) else None)
        cache.update(KERNELS, r, torch.ones(len(unique), 2, dtype=torch.float64), SGD)
        replay.step(unique, counts if len(ids) else None)
        assert cache.stats.as_list() == [replay.stats.as_dict()[n] for n in STAT_NAMES]
        # the same rows in the same slots, so the next step's victims are the same
        assert (replay.slots_of(unique) == slots.numpy()).all()
    assert replay.stats.lookups > 0


def test_a_step_of_more_rows_than_slots_admits_the_most_read_first():
    replay = LruReplay(2)
    s = replay.step(np.array([4, 5, 6]), np.array([2, 3, 1]))
    assert (s.fetches, s.host_reads) == (2, 1)
    assert replay.slots_of(np.array([4, 5, 6])).tolist() == [1, 0, -1]
