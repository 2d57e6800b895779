"""The DLRM dense model, its data-parallel loss split, the dense optimizer's checkpoint
round-trip, and AUC."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from embark_runtime.dense import (
    DenseConfig,
    DenseOptimizerConfig,
    DenseStateError,
    DLRMDense,
    allreduce_gradients,
    check_dense_state,
    load_optimizer_state_tensors,
    local_loss,
    make_optimizer,
    optimizer_state_tensors,
)
from embark_runtime.metrics import log_loss, roc_auc

DOT = DenseConfig(
    dense_features=5, bottom_mlp=(8, 4), interaction="dot", top_mlp=(6, 1), feature_widths=(4, 4, 8)
)
DCN = DenseConfig(
    dense_features=5,
    bottom_mlp=(4,),
    interaction="dcnv2",
    top_mlp=(6, 1),
    feature_widths=(4, 12),
    cross_layers=2,
    low_rank=3,
)


def _inputs(cfg: DenseConfig, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(b, cfg.dense_features, generator=g)
    emb = [torch.randn(b, w, generator=g) for w in cfg.feature_widths]
    labels = (torch.rand(b, generator=g) > 0.5).float()
    return dense, emb, labels


@pytest.mark.parametrize("cfg", [DOT, DCN], ids=["dot", "dcnv2"])
def test_model_gives_one_logit_per_sample_and_same_seed_same_replica(cfg):
    a, b = DLRMDense(cfg, seed=3), DLRMDense(cfg, seed=3)
    dense, emb, _ = _inputs(cfg, 7)
    out = a(dense, emb)
    assert out.shape == (7,)
    assert torch.equal(out, b(dense, emb))
    assert not torch.equal(out, DLRMDense(cfg, seed=4)(dense, emb))


@pytest.mark.parametrize("cfg", [DOT, DCN], ids=["dot", "dcnv2"])
def test_bottom_run_first_gives_the_same_logits_and_runs_after_the_lookup_in_backward(cfg):
    """The trainer runs the bottom MLP before the embedding lookup so that the lookup's
    backward (and its dp exchange) comes first; the result must not change."""
    model = DLRMDense(cfg, seed=3)
    dense, emb, _ = _inputs(cfg, 7)
    want = model(dense, emb)
    order: list[str] = []

    class Lookup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            order.append("lookup")
            return g

    first = next(model.bottom.parameters())
    first.register_hook(lambda g: order.append("bottom"))
    bottom = model.bottom_forward(dense)
    leaves = [e.clone().requires_grad_() for e in emb]
    got = model(dense, [Lookup.apply(e) for e in leaves], bottom=bottom)
    assert torch.equal(got, want)
    got.sum().backward()
    assert order.index("lookup") < order.index("bottom")


def test_seeded_construction_leaves_global_rng_alone():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    DLRMDense(DOT, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_dot_interaction_without_dense_features_uses_embeddings_only():
    cfg = DenseConfig(0, (), "dot", (1,), (4, 4, 4))
    model = DLRMDense(cfg)
    emb = [torch.randn(2, 4) for _ in range(3)]
    assert model(torch.zeros(2, 0), emb).shape == (2,)
    assert model.top[0].in_features == 3  # three pairwise dots, no bottom output


def test_dcnv2_cross_layers_follow_the_recurrence():
    """With U = 0 and bias c every layer adds c * x0: x_L = x0 * (1 + L * c)."""
    model = DLRMDense(DCN)
    for up in model.cross.up:
        torch.nn.init.zeros_(up.weight)
        torch.nn.init.constant_(up.bias, 0.25)
    x0 = torch.randn(3, model.cross.up[0].out_features)
    assert torch.allclose(model.cross(x0), x0 * (1 + DCN.cross_layers * 0.25))


@pytest.mark.parametrize("cfg", [DOT, DCN], ids=["dot", "dcnv2"])
def test_slices_summed_equal_the_global_batch_gradient(cfg):
    """SUM over ranks of per-slice gradients of local_loss == gradient of the global mean."""
    dense, emb, labels = _inputs(cfg, 8, seed=1)
    ref = DLRMDense(cfg, seed=0)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(ref(dense, emb), labels)
    loss.backward()
    summed = [torch.zeros_like(p) for p in ref.parameters()]
    for lo in range(0, 8, 2):
        rep = DLRMDense(cfg, seed=0)
        local_loss(
            rep(dense[lo : lo + 2], [e[lo : lo + 2] for e in emb]), labels[lo : lo + 2], 8
        ).backward()
        for acc, p in zip(summed, rep.parameters(), strict=True):
            acc += p.grad
    for acc, p in zip(summed, ref.parameters(), strict=True):
        assert torch.allclose(acc, p.grad, atol=1e-6)


def test_allreduce_reduces_one_flat_buffer_and_counts_its_bytes():
    model = DLRMDense(DOT)
    dense, emb, labels = _inputs(DOT, 4)
    local_loss(model(dense, emb), labels, 4).backward()
    before = [p.grad.clone() for p in model.parameters()]
    nbytes = allreduce_gradients(model.parameters())
    assert nbytes == 4 * sum(p.numel() for p in model.parameters())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))
    # a given reduce sees one flat buffer and its result becomes every gradient
    seen = []
    allreduce_gradients(model.parameters(), lambda flat: seen.append(flat.mul_(3)))
    assert len(seen) == 1 and seen[0].numel() * 4 == nbytes
    assert all(torch.equal(3 * a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_optimizer_state_round_trips_through_flat_tensors(kind):
    cfg = DenseOptimizerConfig(kind=kind, lr=0.1)
    dense, emb, labels = _inputs(DOT, 4)

    def step(model, opt):
        opt.zero_grad()
        local_loss(model(dense, emb), labels, 4).backward()
        opt.step()

    a = DLRMDense(DOT)
    opt_a = make_optimizer(a.parameters(), cfg)
    step(a, opt_a)
    b = DLRMDense(DOT)
    b.load_state_dict(a.state_dict())
    opt_b = make_optimizer(b.parameters(), cfg)
    load_optimizer_state_tensors(opt_b, optimizer_state_tensors(opt_a))
    step(a, opt_a)
    step(b, opt_b)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def _trained_state(cfg: DenseConfig, kind: str) -> tuple[DLRMDense, dict, dict]:
    model = DLRMDense(cfg, seed=1)
    opt = make_optimizer(model.parameters(), DenseOptimizerConfig(kind=kind, lr=0.1))
    dense, embs, _ = _inputs(cfg, 4)
    model(dense, embs).sum().backward()
    opt.step()
    return model, model.state_dict(), optimizer_state_tensors(opt)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_a_checkpointed_dense_state_must_be_of_the_same_model_and_optimizer(kind):
    """What a resume checks before loading: the same parameters and shapes, and the
    optimizer state of the same dense optimizer (torch would load adagrad's `sum` into adam
    and fail at its first step, or an sgd checkpoint into adam and start it fresh)."""
    model, weights, opt = _trained_state(DOT, kind)
    check_dense_state(model, weights, kind, opt)
    for other in {"sgd", "adagrad", "adam"} - {kind}:
        with pytest.raises(DenseStateError, match=rf"holds {kind}'s state .* now {other}"):
            check_dense_state(model, weights, other, opt)
    wider = DenseConfig(**{**DOT.__dict__, "bottom_mlp": (16, 4)})
    with pytest.raises(DenseStateError, match=r"`bottom.0.weight` is \[8, 5\] in the checkpoint"):
        check_dense_state(DLRMDense(wider, seed=1), weights, kind, opt)
    with pytest.raises(DenseStateError, match=r"the checkpoint has `x`, which the dense model"):
        check_dense_state(model, {**weights, "x": torch.zeros(1)}, kind, opt)
    first = next(iter(weights))
    fewer = {k: v for k, v in weights.items() if k != first}
    with pytest.raises(DenseStateError, match=rf"has `{first}`, which the checkpoint lacks"):
        check_dense_state(model, fewer, kind, opt)
    with pytest.raises(DenseStateError):
        check_dense_state(DLRMDense(DCN, seed=1), weights, kind, opt)
    if kind != "sgd":
        some = dict(opt)
        name = next(k for k in some if not k.endswith(".step"))
        some[name] = some[name][:1]
        with pytest.raises(DenseStateError, match=rf"`{name}` is \["):
            check_dense_state(model, weights, kind, some)


def test_bad_configs_are_refused_with_a_message():
    with pytest.raises(ValueError, match="interaction"):
        DenseConfig(1, (), "cross", (1,), (4,))
    with pytest.raises(ValueError, match="no input"):
        DenseConfig(0, (), "dot", (1,), ())
    with pytest.raises(ValueError, match="dense optimizer"):
        make_optimizer(DLRMDense(DOT).parameters(), DenseOptimizerConfig(kind="lamb"))


def test_auc_counts_ties_as_half_and_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(y, s) == pytest.approx(pairs / (pos.size * neg.size))
    assert roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert math.isnan(roc_auc([1, 1], [0.2, 0.3]))
    with pytest.raises(ValueError, match="0 or 1"):
        roc_auc([2, 0], [0.1, 0.2])


def test_log_loss_of_perfect_and_uninformed_predictions():
    assert log_loss([1, 0], [1.0, 0.0]) < 1e-6
    assert log_loss([1, 0], [0.5, 0.5]) == pytest.approx(math.log(2))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_exported_tables_round_trip_atomically(tmp_path, suffix):
    from embark_runtime.trainer import export_tables, load_exported

    tables = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones((2, 5), np.float32)}
    path = tmp_path / "sub" / f"tables{suffix}"
    export_tables(path, tables)
    back = load_exported(path)
    assert sorted(back) == ["a", "b"]
    assert all(np.array_equal(back[k], v) for k, v in tables.items())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def _fp16_on_the_cpu(init_scale: float = 1024.0, growth_interval: int = 3):
    """MixedPrecision with an fp16 loss scaler on the CPU: fp16 training is refused off
    CUDA, but the scaler and its state are device-independent (torch.amp.GradScaler('cpu')),
    which is what a checkpoint holds."""
    from embark_runtime.dense import MixedPrecision

    mp = MixedPrecision("fp32", torch.device("cpu"))
    mp.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return mp


def _scaled_steps(mp, model, opt, steps: int, overflow_at: int | None = None) -> None:
    dense, embs, _ = _inputs(DOT, 4)
    for i in range(steps):
        opt.zero_grad()
        mp.backward(model(dense, embs).sum())
        if i == overflow_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        mp.step(opt)


def test_the_fp16_loss_scale_is_checkpointed_and_a_resumed_run_continues_with_it(tmp_path):
    """The loss scale and its growth tracker go into the checkpoint's extra and come back
    on resume (the checkpoint code path: save_checkpoint, load_checkpoint, the trainer's
    dense_extra and load_dense_extra); the resumed run then scales as the uninterrupted
    one does."""
    from mp_harness import FeatureSpec, TableSpec, make_plan

    from embark_runtime.checkpoint import load_checkpoint, save_checkpoint
    from embark_runtime.embedding import ShardedEmbeddings
    from embark_runtime.trainer import SCALER_PREFIX, dense_extra, load_dense_extra

    plan = make_plan(
        [TableSpec("t", 10, 4)], [FeatureSpec("f", "t")], nodes=1, gpus_per_node=1, batch_size=4
    )
    cfg = DenseOptimizerConfig(kind="adam", lr=0.01)
    model = DLRMDense(DOT, seed=1)
    opt = make_optimizer(model.parameters(), cfg)
    mp = _fp16_on_the_cpu()
    # 1024 -> 2048 after 3 clean steps, halved by the overflow, then 2 clean steps
    _scaled_steps(mp, model, opt, 6, overflow_at=3)
    assert mp.scaler.get_scale() == 1024.0 and mp.scaler._get_growth_tracker() == 2
    extra = dense_extra(model, opt, mp)
    assert {k for k in extra if k.startswith(SCALER_PREFIX)} == {
        "dense_scaler.scale",
        "dense_scaler.growth_tracker",
    }
    cells = ShardedEmbeddings(plan, 0, 1).cells()
    save_checkpoint(tmp_path, 6, plan, 0, 1, cells, extra, finalize=True)
    _, _, loaded = load_checkpoint(tmp_path, plan, 0)

    model2 = DLRMDense(DOT, seed=7)
    opt2 = make_optimizer(model2.parameters(), cfg)
    mp2 = _fp16_on_the_cpu()
    found = load_dense_extra(loaded, model2, opt2, mp2, "adam")
    assert found.model and found.scaler
    assert mp2.scaler.get_scale() == 1024.0 and mp2.scaler._get_growth_tracker() == 2
    # one more clean step grows the scale in both runs (the tracker reached 3)
    _scaled_steps(mp, model, opt, 1)
    _scaled_steps(mp2, model2, opt2, 1)
    assert mp.scaler.get_scale() == mp2.scaler.get_scale() == 2048.0
    assert mp2.scaler._get_growth_tracker() == 0


def test_fp32_and_bf16_checkpoints_hold_no_scale_and_older_ones_still_load(tmp_path):
    """Without fp16 the extra is what it was (the model and its optimizer, nothing more);
    an fp16 run resumed from such a checkpoint (or one of before the scale was saved)
    loads the model and starts the scale afresh; a scale in the checkpoint of an fp16 run
    is ignored by an fp32 one."""
    from embark_runtime.dense import MixedPrecision
    from embark_runtime.trainer import (
        DENSE_OPT_PREFIX,
        DENSE_PREFIX,
        dense_extra,
        load_dense_extra,
    )

    model = DLRMDense(DOT, seed=1)
    opt = make_optimizer(model.parameters(), DenseOptimizerConfig(kind="sgd", lr=0.1))
    for name in ("fp32", "bf16"):
        extra = dense_extra(model, opt, MixedPrecision(name, torch.device("cpu")))
        assert all(k.startswith((DENSE_PREFIX, DENSE_OPT_PREFIX)) for k in extra), sorted(extra)
        assert set(extra) == {DENSE_PREFIX + k for k in model.state_dict()}
    older = dense_extra(model, opt, MixedPrecision("fp32", torch.device("cpu")))
    mp = _fp16_on_the_cpu(init_scale=512.0)
    found = load_dense_extra(older, DLRMDense(DOT, seed=2), opt, mp, "sgd")
    assert found.model and not found.scaler and mp.scaler.get_scale() == 512.0

    fp16 = dense_extra(model, opt, _fp16_on_the_cpu(init_scale=64.0))
    plain = MixedPrecision("fp32", torch.device("cpu"))
    assert load_dense_extra(fp16, DLRMDense(DOT, seed=2), opt, plain, "sgd").scaler is False
    broken = {k: v for k, v in fp16.items() if not k.endswith("growth_tracker")}
    with pytest.raises(DenseStateError, match="no growth_tracker"):
        load_dense_extra(broken, DLRMDense(DOT, seed=2), opt, _fp16_on_the_cpu(), "sgd")
