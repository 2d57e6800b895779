"""Sharded training equals the unsharded reference, on 4 and 2 gloo processes.

One spawn of 4 processes runs every case (2-process cases on the subgroup {0, 1}): the
grid of cluster kind x pooling x grid x optimizer x flat/hierarchical, and random small
plans. After several steps every row and optimizer state must equal the reference's
within 1e-5 of the table's scale, the global loss must match at every step, and the
bytes each rank reports must equal docs/communication.md's count. In the exact mode
(fp64 sums), 16 more random plans must equal the reference bit for bit after 4 steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mp_harness import spawn
from runtime_cases import (
    PROBE_LAYOUTS,
    PROBE_SEGMENTS,
    doc_bytes,
    exact_cases,
    grid_cases,
    hierarchical_allreduce_messages,
    local_batches,
    overlap_cases,
    probe_values,
    rail_allgather_messages,
    random_cases,
    uneven_cases,
    worker,
)

GRID = grid_cases()
RANDOM = random_cases(16, seed=2024)
OVERLAP = overlap_cases()
UNEVEN = uneven_cases()
EXACT = exact_cases(16, seed=7)
TOL = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = spawn(worker, 4, GRID + RANDOM + OVERLAP + UNEVEN + EXACT)
    by_case: dict[str, list[dict]] = {}
    for rank_results in per_rank:
        for r in rank_results:
            by_case.setdefault(r["name"], []).append(r)
    return by_case


def _check_exact(case, runs) -> None:
    assert len(runs) == case.world
    for rank, run in enumerate(runs):
        for what, err in run["errors"].items():
            assert err <= TOL, f"{case.name} rank {rank}: {what} differs by {err:.3g} of its scale"
        for step, (got, want) in enumerate(run["losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (
                f"{case.name} step {step}: loss {got} != {want}"
            )


def _check_bytes(case, runs) -> None:
    plan = case.plan()
    globals_, _ = local_batches(plan, case, case.world)
    for step, gb in enumerate(globals_):
        want = doc_bytes(plan, gb, case.world)
        for rank, run in enumerate(runs):
            assert run["bytes"][step] == want[rank], f"{case.name} step {step} rank {rank}"


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_grid_case_matches_reference(results, case):
    _check_exact(case, results[case.name])


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_grid_case_bytes_follow_the_communication_doc(results, case):
    _check_bytes(case, results[case.name])


@pytest.mark.parametrize("case", RANDOM, ids=[c.name for c in RANDOM])
def test_random_plan_matches_reference_and_doc(results, case):
    _check_exact(case, results[case.name])
    _check_bytes(case, results[case.name])


@pytest.mark.parametrize("case", EXACT, ids=[c.name for c in EXACT])
def test_exact_mode_trains_the_reference_bit_for_bit(results, case):
    """fp64 sums: every weight and optimizer state equal to the reference's, no tolerance."""
    runs = results[case.name]
    assert len(runs) == case.world
    for rank, run in enumerate(runs):
        assert run["errors"] == dict.fromkeys(run["errors"], 0.0), f"{case.name} rank {rank}"
        for step, (got, want) in enumerate(run["losses"]):
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), f"{case.name} step {step}"


def test_prefetch_overlap_gives_bitwise_identical_training(results):
    on, off = (results[c.name] for c in OVERLAP)
    assert [r["digest"] for r in on] == [r["digest"] for r in off]
    assert [r["losses"] for r in on] == [r["losses"] for r in off]
    _check_exact(OVERLAP[0], on)


@pytest.mark.parametrize(
    "case", GRID + RANDOM + UNEVEN, ids=[c.name for c in GRID + RANDOM + UNEVEN]
)
def test_bytes_equal_the_simulators_count(results, case):
    """The runtime's measured bytes, summed over ranks, equal embarkc.simulate.count_bytes
    on the same batches (the compiler's side of docs/communication.md)."""
    simulate = pytest.importorskip("embarkc.simulate")
    plan = case.plan()
    _, per_rank = local_batches(plan, case, case.world)
    runs = results[case.name]
    for step, slices in enumerate(per_rank):
        want = simulate.count_bytes(plan, [SimpleNamespace(sparse=s) for s in slices])
        got = {
            c.name: {
                k: sum(run["bytes"][step][c.name][k] for run in runs) for k in ("intra", "inter")
            }
            for c in plan.clusters
        }
        assert got == want, f"{case.name} step {step}"


def test_a_bad_batch_on_one_rank_raises_on_every_rank(results):
    raised = [r["raised"] for r in results["bad-batch"]]
    assert "id 1000000 is outside table `rf`" in raised[1]
    assert all(
        m == "rank 1's batch is invalid (see its error)" for i, m in enumerate(raised) if i != 1
    )


def test_init_distributed_builds_nodes_and_rails_and_refuses_another_world(results):
    layouts = [r["layout"] for r in results["init"]]
    assert layouts == [
        (0, 4, 2, [0, 1], [0, 2]),
        (1, 4, 2, [0, 1], [1, 3]),
        (2, 4, 2, [2, 3], [0, 2]),
        (3, 4, 2, [2, 3], [1, 3]),
    ]
    assert all(
        "the job has 4 processes but the plan is for 2 ranks" in r["refused"]
        for r in results["init"]
    )


@pytest.mark.parametrize("case", UNEVEN, ids=[c.name for c in UNEVEN])
def test_uneven_column_cuts_match_reference_and_doc(results, case):
    _check_exact(case, results[case.name])
    _check_bytes(case, results[case.name])


def _per_rank(messages, world: int, g: int) -> list[dict[str, int]]:
    out = [{"intra": 0, "inter": 0} for _ in range(world)]
    for src, dst, n in messages:
        if src != dst and n:
            out[src]["intra" if src // g == dst // g else "inter"] += n
    return out


@pytest.mark.parametrize(("world", "g"), PROBE_LAYOUTS)
def test_hierarchical_all_reduce_sums_and_counts_the_doc_bytes(results, world, g):
    """Every rank ends with the sum of all ranks' values (uneven chunks, empty segments,
    async and not) and sends exactly the doc's bytes, segment by segment."""
    import torch

    runs = [r["got"] for r in results["collectives"]][:world]
    for k, segs in enumerate(PROBE_SEGMENTS):
        want = sum(probe_values(r, sum(segs), k) for r in range(world))
        doc = [{"intra": 0, "inter": 0} for _ in range(world)]
        for e in segs:
            for r, v in enumerate(
                _per_rank(hierarchical_allreduce_messages(e, world, g), world, g)
            ):
                doc[r]["intra"] += v["intra"]
                doc[r]["inter"] += v["inter"]
        for rank, run in enumerate(runs):
            values, moved = run[("allreduce", world, g, k)]
            assert torch.allclose(torch.tensor(values), want, atol=1e-6), (world, g, k, rank)
            assert values == runs[0][("allreduce", world, g, k)][0]  # identical on every rank
            mine = moved.get("c", {"intra": 0, "inter": 0})
            assert mine == doc[rank], (world, g, k, rank)


@pytest.mark.parametrize(("world", "g"), PROBE_LAYOUTS)
def test_rail_all_gather_delivers_every_message_and_counts_the_doc_bytes(results, world, g):
    runs = [r["got"] for r in results["collectives"]][:world]
    want = [[10 * i + r for i in range(r + 2)] for r in range(world)]
    doc = _per_rank(rail_allgather_messages([8 * (r + 2) for r in range(world)], g), world, g)
    for rank, run in enumerate(runs):
        values, moved = run[("allgather", world, g)]
        assert values == want
        assert moved.get("c", {"intra": 0, "inter": 0}) == doc[rank]
