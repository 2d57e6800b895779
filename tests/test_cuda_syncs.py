"""The CUDA path's training step does not wait for the device: the forward and the fused
backward + update queue their work and return, with every count kept on the device;
pooled_backward waits once (its results are as long as the distinct rows). Counted under
the host emulation of the kernels (tests/cuda_emulator.py) by tests/cuda_syncs.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_syncs import HostWaits  # noqa: E402
from test_cuda_emulated import _bench, _sources_for_subprocess  # noqa: E402

from embark_runtime.cuda_kernels import SPLIT_MIN, CudaKernels  # noqa: E402
from embark_runtime.kernels import TorchKernels, bag_of_ids  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return _sources_for_subprocess()


@pytest.fixture(scope="module")
def launcher(sources):
    from cuda_emulator import HostLauncher

    return HostLauncher([t for p, t in sources.items() if p.endswith(".cu")])


def _case(config, skewed: bool, seed: int):
    """Bags of `config.hotness` ids over 300 rows; skewed: row 7 in 3 * SPLIT_MIN + 5 of
    them (the backward takes two passes)."""
    gen = torch.Generator().manual_seed(seed)
    batch, rows = 48, 300
    ids = torch.randint(8, rows, (batch * config.hotness,), generator=gen)
    if skewed:
        ids[torch.randperm(ids.numel(), generator=gen)[: 3 * SPLIT_MIN + 5]] = 7
    offsets = torch.arange(0, ids.numel() + 1, config.hotness)
    pw = torch.rand(ids.numel(), generator=gen) if config.weighted else None
    out_width = config.width * (config.hotness if config.pooling == "concat" else 1)
    grad = torch.randn(batch, out_width, generator=gen)
    return ids, offsets, pw, grad, rows


def _table(config, rows: int):
    bench = _bench()
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(rows, config.width, generator=gen) * 0.1).to(bench._dt(config.dtype))
    return weight, bench._state(config.optimizer, rows, config.width, "cpu")


CASES = [
    (c, skewed)
    for c in _bench().LOOKUPS
    if c.pooling != "concat"  # no fused kernel: the trainer pools concat as one-id sums
    for skewed in ((False, True) if c.hotness > 1 else (False,))
]


@pytest.mark.parametrize(("config", "skewed"), CASES, ids=repr)
def test_a_training_step_of_a_table_never_waits_for_the_device(sources, launcher, config, skewed):
    """Forward and fused backward + update, after the first (verified) call: no host wait,
    and the same bits as the launches the host picks when it has read the counts (the
    way the kernels ran before the counts stayed on the device)."""
    bench = _bench()
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True)
    ids, offsets, pw, grad, rows = _case(config, skewed, config.width)
    weight, state = _table(config, rows)
    params = bench._params(config.optimizer)
    for _ in range(2):  # the first call of every entry is verified: it may wait
        k.pooled_forward(weight, ids, offsets, pw, config.pooling)
        k.pooled_backward_update(
            weight, state, grad, ids, offsets, pw, config.pooling, config.optimizer, params
        )
    w0, s0 = weight.clone(), {n: v.clone() for n, v in state.items()}
    with HostWaits() as waits:
        out = k.pooled_forward(weight, ids, offsets, pw, config.pooling)
        k.pooled_backward_update(
            weight, state, grad, ids, offsets, pw, config.pooling, config.optimizer, params
        )
    assert waits.waits == []
    expected = TorchKernels().pooled_forward(w0, ids, offsets, pw, config.pooling)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-6)

    # the host-decided launches on the same inputs
    info = k.index.backward(
        config.width,
        config.dtype,
        config.pooling,
        pw is not None,
        "int64",
        config.optimizer,
    )
    s = k._segments(ids, rows)
    count, longest = int(s.count.item()), int(s.longest.item())
    assert (longest > SPLIT_MIN) == skewed
    tail = [w0, *k._state_args(w0, s0, config.optimizer), *_opt_args(params)]
    pwf = pw.float() if pw is not None else None
    k._backward_launch(
        info,
        grad,
        offsets,
        pwf,
        bag_of_ids(offsets, ids.numel()),
        s,
        config.pooling,
        tail,
        (count, longest),
    )
    assert torch.equal(weight, w0)
    for n in state:
        assert torch.equal(state[n], s0[n])
    assert not k.fallbacks


def _opt_args(params):
    from embark_runtime.cuda_kernels import _opt_args as args

    return args(params)


def test_pooled_backward_waits_once_for_its_result_size(sources, launcher):
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True)
    config = _bench().LOOKUPS[0]
    for skewed in (False, True):
        ids, offsets, pw, grad, rows = _case(config, skewed, 3)
        k.pooled_backward(grad, ids, offsets, pw, "sum", rows)
        with HostWaits() as waits:
            unique, row_grads = k.pooled_backward(grad, ids, offsets, pw, "sum", rows)
        assert [w for w, _ in waits.waits] == ["tolist"], waits.waits
        u0, g0 = TorchKernels().pooled_backward(grad, ids, offsets, pw, "sum", rows)
        assert torch.equal(unique, u0)
        assert (row_grads - g0).abs().max() <= 1e-5 * g0.abs().max()


def test_rows_outside_the_table_update_nothing_and_are_said_at_the_next_check(sources, launcher):
    config = _bench().LOOKUPS[0]
    bench = _bench()
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True)
    ids, offsets, pw, grad, rows = _case(config, False, 5)
    weight, state = _table(config, rows)
    params = bench._params(config.optimizer)
    args = (grad, ids, offsets, pw, "sum", config.optimizer, params)
    k.pooled_backward_update(weight, state, *args)  # verified
    k.check_rows()
    bad = ids.clone()
    bad[3] = rows
    w0 = weight.clone()
    with pytest.raises(IndexError, match=r"outside \[0, 300\)"):
        CudaKernels(sources=sources, device="cpu", launcher=launcher).pooled_backward_update(
            weight, state, grad, bad, offsets, pw, "sum", config.optimizer, params
        )
    with HostWaits() as waits:
        k.pooled_backward_update(
            weight, state, grad, bad, offsets, pw, "sum", config.optimizer, params
        )
    assert waits.waits == [] and torch.equal(weight, w0)
    with pytest.raises(IndexError, match="outside the table"):
        k.check_rows()
    k.check_rows()  # said once


def test_padded_row_gradients_never_wait_and_equal_pooled_backward(sources, launcher):
    """pooled_backward_padded: the same rows and gradient bits as pooled_backward in its
    first `count` entries, with the count on the device and no host wait (the first call
    is pooled_backward's, verified)."""
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True)
    for config in _bench().LOOKUPS:
        if config.pooling == "concat":
            continue
        for skewed in (False, True):
            ids, offsets, pw, grad, rows = _case(config, skewed, 11)
            k.pooled_backward_padded(grad, ids, offsets, pw, config.pooling, rows)
            with HostWaits() as waits:
                u, g, count = k.pooled_backward_padded(grad, ids, offsets, pw, config.pooling, rows)
            assert waits.waits == []
            u0, g0 = k.pooled_backward(grad, ids, offsets, pw, config.pooling, rows)
            n = int(count.item())
            assert u.numel() == ids.numel() and n == u0.numel()
            assert torch.equal(u[:n], u0) and torch.equal(g[:n], g0)
    assert not k.fallbacks
    bad = ids.clone()
    bad[0] = -1
    _, _, count = k.pooled_backward_padded(grad, bad, offsets, pw, "sum", rows)
    assert int(count.item()) == 0
    with pytest.raises(IndexError):
        k.check_rows()


def test_the_chunk_size_on_the_device_is_the_hosts_isqrt():
    """The two-pass chunk size the device computes equals the host's
    max(SPLIT_MIN, isqrt(longest - 1) + 1) wherever a batch's ids can count."""
    import math

    from embark_runtime.cuda_kernels import chunk_size

    longest = torch.cat(
        [torch.arange(1, 300_001), torch.tensor([2**31 - 1, 2**32, 2**20 * 2**20 - 1, 2**40 - 1])]
    )
    host = torch.tensor([max(SPLIT_MIN, math.isqrt(n - 1) + 1) for n in longest.tolist()])
    assert torch.equal(chunk_size(longest), host)


def test_dedup_waits_once_for_its_result_size(sources, launcher):
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True)
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.int64, torch.int32):
        keys = torch.randint(0, 1000, (300,), generator=gen).to(dtype)
        k.dedup(keys)
        with HostWaits() as waits:
            unique, inverse = k.dedup(keys)
        assert [w for w, _ in waits.waits] == ["tolist"], waits.waits
        u0, inv0 = TorchKernels().dedup(keys)
        assert torch.equal(unique, u0) and torch.equal(inverse, inv0.to(torch.int64))
    with pytest.raises(ValueError, match="non-negative"):
        k.dedup(torch.tensor([3, -1, 3]))
    assert not k.fallbacks


def _clusters_plan():
    """One rank with every kind of cluster: dense and sparse dp, an rb table cut 2 x 2,
    a ub table in two row shards; four optimizers, a weighted feature."""
    from mp_harness import FeatureSpec, TableSpec, make_plan

    tables = [
        TableSpec("d", 50, 16, kind="dp", optimizer="adagrad", exchange="dense"),
        TableSpec("s", 60, 8, kind="dp", optimizer="sgd", exchange="sparse"),
        TableSpec("r", 300, 16, kind="rb", grid=(2, 2), optimizer="adam"),
        TableSpec("u", 200, 8, kind="ub", grid=(2, 1), optimizer="rowwise_adagrad"),
    ]
    features = [
        FeatureSpec("fd", "d", 3.0),
        FeatureSpec("fs", "s", 2.0),
        FeatureSpec("fr", "r", 3.0),
        FeatureSpec("fr2", "r", 2.0, weighted=True),
        FeatureSpec("fu", "u", 3.0),
    ]
    return make_plan(tables, features, nodes=1, gpus_per_node=1, batch_size=32)


def _backward_waits(emb, loss) -> list[tuple[str, str]]:
    """The host waits of the embeddings' backward (run by autograd, where the mode of the
    caller is not active: counted inside it) and of finish_backward."""
    waits: list[tuple[str, str]] = []
    inner = emb._backward_step

    def counted(step, grads):
        with HostWaits() as w:
            inner(step, grads)
        waits.extend(w.waits)

    emb._backward_step = counted
    try:
        loss.backward()
    finally:
        del emb._backward_step
    with HostWaits() as w:
        emb.finish_backward()
    return waits + w.waits


def test_the_clusters_backward_waits_only_to_size_the_sparse_dp_all_gather():
    """A training step of the rb, ub and dp clusters on the generated kernels (host
    emulation): after the first, verified step, the backward and the updates never wait
    per table; the one wait left is the sparse dp cluster's (its tables' row counts, read
    together, size its all-gather), besides all_gather_ints itself. Before the clusters
    used the wait-free kernels, this step waited 17 times: once per pooled_backward (7)
    and per update's dedup (8), plus the dense dp mask's nonzero and all_gather_ints.
    The tables end as on the torch path."""
    from cuda_emulator import HostLauncher
    from mp_harness import random_global_batch

    from embark_runtime.embedding import ShardedEmbeddings
    from embarkc.codegen import cuda

    plan = _clusters_plan()
    src = cuda.render_instantiations(cuda.kernel_instantiations(plan), arch="sm_90")
    launcher = HostLauncher([t for p, t in src.items() if p.endswith(".cu")])
    k = CudaKernels(sources=src, device="cpu", launcher=launcher, verify=True, poison=True)
    ours = ShardedEmbeddings(plan, 0, 1, kernels=k, seed=3)
    theirs = ShardedEmbeddings(plan, 0, 1, kernels=TorchKernels(), seed=3)
    per_step = []
    for step in range(3):
        batch = random_global_batch(plan, step, seed=5)
        for emb in (ours, theirs):
            out = emb(batch)
            loss = sum((v * (1 + i)).sum() for i, v in enumerate(out.values()))
            if emb is ours:
                per_step.append(_backward_waits(emb, loss))
            else:
                loss.backward()
                emb.finish_backward()
    k.check_rows()
    for waits in per_step[1:]:
        assert [(w, where.split(":")[0], where.split()[-1]) for w, where in waits] == [
            ("tolist", "clusters.py", "start_backward"),
            ("tolist", "comm.py", "all_gather_ints"),
        ], waits
    assert not k.fallbacks, k.fallbacks
    assert {e.split("_w")[0] for e in k.calls} >= {
        "embark_bwd_adam",  # rb: fused on the owner's bags
        "embark_bwd_rowwise_adagrad",  # ub owner: one-id bags
        "embark_bwd_adagrad",  # dense dp: sparse_update_padded
        "embark_bwd_sgd",  # sparse dp: one-id bags
    }, sorted(k.calls)
    for t in plan.tables:
        assert torch.allclose(ours.gather_table(t.name), theirs.gather_table(t.name), atol=1e-5)
        for name, v in ours.gather_state(t.name).items():
            assert torch.allclose(v, theirs.gather_state(t.name)[name], rtol=1e-4, atol=1e-5)


def test_updates_of_repeated_and_padded_rows_never_wait_and_match_apply_update(sources, launcher):
    """The updates the clusters run without a wait: rows that repeat (one-id bags through
    the fused kernel) and distinct rows padded past a count on the device
    (sparse_update_padded), against apply_update on the torch path."""
    from types import SimpleNamespace

    from embark_runtime.optim import apply_update

    config = next(c for c in _bench().LOOKUPS if c.pooling == "sum" and not c.weighted)
    bench = _bench()
    params = bench._params(config.optimizer)
    table = SimpleNamespace(optimizer=config.optimizer, optimizer_params=params)
    k = CudaKernels(sources=sources, device="cpu", launcher=launcher, verify=True, poison=True)
    gen = torch.Generator().manual_seed(9)
    for call in range(2):  # the first call of each entry is verified and may wait
        weight, state = _table(config, 300)
        w0, s0 = weight.clone(), {n: v.clone() for n, v in state.items()}
        rows = torch.randint(0, 40, (90,), generator=gen)
        grads = torch.randn(90, config.width, generator=gen)
        with HostWaits() as waits:
            k.pooled_backward_update(
                weight, state, grads, rows, torch.arange(91), None, "sum", config.optimizer, params
            )
        apply_update(TorchKernels(), w0, s0, rows, grads, table)
        assert call == 0 or waits.waits == []
        assert torch.allclose(weight.float(), w0.float(), rtol=1e-4, atol=1e-6)
        for n in state:
            assert torch.allclose(state[n], s0[n], rtol=1e-4, atol=1e-6)

        distinct = torch.randperm(300, generator=gen)[:50]
        padded = torch.cat([distinct, torch.full((30,), -7)])  # past the count: never read
        pgrads = torch.randn(80, config.width, generator=gen)
        with HostWaits() as waits:
            k.sparse_update_padded(
                weight, state, padded, pgrads, torch.tensor([50]), config.optimizer, params
            )
        apply_update(TorchKernels(), w0, s0, distinct, pgrads[:50], table)
        assert call == 0 or waits.waits == []
        assert torch.allclose(weight.float(), w0.float(), rtol=1e-4, atol=1e-6)
        for n in state:
            assert torch.allclose(state[n], s0[n], rtol=1e-4, atol=1e-6)
    assert not k.fallbacks, k.fallbacks
