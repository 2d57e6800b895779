"""Learning-rate schedules, dense precision and the top MLP's output: the math of
embark_runtime.schedules at given steps, what the language makes of `schedule`,
`precision` and `top_mlp`, what the plan file carries (only when set), and the
trainer's rates step by step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from embark_runtime.dense import MixedPrecision, make_optimizer, set_rate
from embark_runtime.plan import dense_precision, dense_schedule, parse_plan
from embark_runtime.schedules import Schedule, rate_at
from embarkc.diagnostics import EmbarkError
from embarkc.format import format_text
from embarkc.frontend import load_program_text
from embarkc.ir import without_spans
from embarkc.planner import plan_program, plan_to_json

# --------------------------------------------------------------------------- the math


def test_constant_is_the_optimizers_own_rate():
    assert [rate_at(0.05, None, t) for t in (0, 1, 10**9)] == [0.05] * 3
    assert [Schedule().rate(0.05, t) for t in (0, 7)] == [0.05, 0.05]


def test_linear_warmup_reaches_the_rate_on_its_last_step():
    s = Schedule(warmup=4)
    assert [s.rate(1.0, t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_poly_decay_after_warmup_is_the_mlperf_dlrm_schedule():
    """MLPerf DLRM-DCNv2: warm-up, then (1 - (t - S) / (E - S)) ** 2 down to 0."""
    s = Schedule(warmup=2, decay="poly", start=4, end=8, power=2.0)
    got = [s.rate(2.0, t) for t in range(10)]
    want = [1.0, 2.0, 2.0, 2.0, 2.0, 2.0 * 0.75**2, 2.0 * 0.5**2, 2.0 * 0.25**2, 0.0, 0.0]
    assert got == pytest.approx(want, rel=1e-15, abs=0)


def test_poly_decay_ends_at_its_end_rate_and_power_1_is_linear():
    s = Schedule(decay="poly", start=0, end=10, power=1.0, end_lr=0.1)
    assert s.rate(1.1, 0) == 1.1
    assert s.rate(1.1, 5) == pytest.approx(0.6)
    assert s.rate(1.1, 10) == s.rate(1.1, 10**6) == 0.1


def test_step_decay_cuts_the_rate_by_factor_every_n_steps_from_its_start():
    s = Schedule(warmup=2, decay="step", start=3, every=2, factor=0.5)
    got = [s.rate(1.0, t) for t in range(9)]
    assert got == [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


@given(
    warmup=st.integers(0, 50),
    gap=st.integers(0, 50),
    length=st.integers(1, 100),
    power=st.floats(0.1, 5),
    end_lr=st.floats(0, 0.01),
    step=st.integers(0, 400),
)
def test_a_poly_schedule_stays_between_its_end_rate_and_the_rate(
    warmup, gap, length, power, end_lr, step
):
    lr = 0.05
    s = Schedule(
        warmup=warmup,
        decay="poly",
        start=warmup + gap,
        end=warmup + gap + length,
        power=power,
        end_lr=end_lr,
    )
    r = s.rate(lr, step)
    assert 0 < r <= lr or (r == end_lr and step >= s.end)
    if step >= warmup:
        assert r >= end_lr and r <= s.rate(lr, max(warmup, step - 1))


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"warmup": 10, "decay": "poly", "start": 5, "end": 20}, "inside the warm-up"),
        ({"decay": "poly", "start": 5, "end": 5}, "ends after it starts"),
        ({"decay": "step", "every": 0}, "greater than 0"),
        ({"decay": "step", "factor": 1.5}, "less than or equal to 1"),
        ({"warmup": -1}, "greater than or equal to 0"),
        ({"decay": "cosine"}, "'none', 'poly' or 'step'"),
    ],
)
def test_a_schedule_that_cannot_be_is_refused(fields, needle):
    with pytest.raises(ValidationError, match=needle):
        Schedule(**fields)


def test_steps_count_from_zero():
    with pytest.raises(ValueError, match="from 0"):
        Schedule().rate(0.1, -1)


# --------------------------------------------------------------------------- language

HW = "hardware { preset dgx_h100 }\n"


def _program(body: str, model: str = "model { batch 64 }\n"):
    return load_program_text(HW + body + model)


def test_a_tables_schedule_comes_from_defaults_or_its_own_block():
    p = _program(
        "defaults { dim 16 hotness 1 schedule { warmup 10 decay poly { to 100 power 2 } } }\n"
        "table a { rows 100 optimizer adagrad { lr 0.1 } }\n"
        "table b { rows 100 schedule { decay step { from 5 every 20 factor 0.5 } } }\n"
    )
    a, b = (t.optimizer.schedule for t in p.tables)
    assert p.tables[0].optimizer.kind == "adagrad" and p.tables[0].optimizer.lr == 0.1
    assert a is not None and (a.warmup, a.decay, a.start, a.end, a.power) == (
        10,
        "poly",
        10,
        100,
        2,
    )
    assert b is not None and (b.warmup, b.decay, b.start, b.every, b.factor) == (
        0,
        "step",
        5,
        20,
        0.5,
    )
    assert a.runtime().rate(0.1, 9) == pytest.approx(0.1)


def test_the_model_takes_a_dense_schedule_and_a_precision():
    p = _program(
        "table a { rows 100 dim 16 hotness 1 }\n",
        "model { batch 64 optimizer adam { lr 0.001 } precision bf16\n"
        "  schedule { warmup 100 decay poly { from 200 to 1000 power 2 end 0.0001 } } }\n",
    )
    m = p.model
    assert m.precision == "bf16" and m.optimizer.kind == "adam"
    s = m.optimizer.schedule
    assert s is not None and (s.start, s.end, s.end_lr) == (200, 1000, 0.0001)


def test_the_plan_carries_schedules_and_precision_only_when_set():
    plain = _program("table a { rows 100 dim 16 hotness 1 }\n")
    text = plan_to_json(plan_program(plain, solver="greedy"))
    assert "schedule" not in text and "precision" not in text
    assert "weight_decay" not in json.dumps(json.loads(text)["model"])
    set_ = _program(
        "table a { rows 100 dim 16 hotness 1 schedule { warmup 3 } }\n",
        "model { batch 64 precision bf16 schedule { decay step { every 10 } } }\n",
    )
    text = plan_to_json(plan_program(set_, solver="greedy"))
    plan = parse_plan(text)
    assert plan.tables[0].optimizer_params.schedule == Schedule(warmup=3)
    assert dense_schedule(plan) == Schedule(decay="step", every=10)
    assert dense_precision(plan) == "bf16"
    data = json.loads(text)
    assert data["model"]["precision"] == "bf16"


def test_a_plan_whose_schedule_is_not_the_specs_is_stale():
    from embarkc.planner.check import validate_plan

    a = _program("table a { rows 100 dim 16 hotness 1 schedule { warmup 3 } }\n")
    b = _program("table a { rows 100 dim 16 hotness 1 }\n", "model { batch 64 precision bf16 }\n")
    plan_a = plan_program(a, solver="greedy")
    messages = [v.message for v in validate_plan(b, plan_a)]
    assert any("optimizer_params.schedule is warm-up 3 steps" in m for m in messages), messages
    assert any("model.precision is fp32, the spec says bf16" in m for m in messages), messages


@pytest.mark.parametrize(
    ("body", "model", "needle"),
    [
        ("", "model { batch 64 top_mlp [8] }", "`top_mlp` ends in 8"),
        ("", "model { batch 64 precision fp64 }", "unknown precision `fp64`"),
        ("", "model { batch 64 schedule { warmup 2 warmup 3 } }", "`warmup` is given twice"),
        ("", "model { batch 64 schedule { decay step } }", "a `step` decay needs `every`"),
        ("", "model { batch 64 schedule { decay poly { to 0 } } }", "not after its start"),
        ("", "model { batch 64 schedule { decay step { every 4 power 2 } } }", "no parameter"),
        ("", "model { batch 64 schedule { decay poly { to 10 power 0 } } }", "power must be"),
        ("", "model { batch 64 schedule { warmup 2e12 } }", "warmup must be at most"),
    ],
)
def test_bad_schedules_precisions_and_top_mlps_are_diagnosed(body, model, needle):
    with pytest.raises(EmbarkError) as e:
        _program("table a { rows 100 dim 16 hotness 1 }\n" + body, model + "\n")
    text = e.value.render_with_files()
    assert needle in text, text


def test_fmt_keeps_a_schedule_on_its_field_line():
    src = (
        HW + "table a { rows 100 dim 16 hotness 1\n  schedule {\n    warmup 10\n"
        "    decay poly { to 100  power 2 }\n  }\n}\nmodel { batch 64 precision bf16 }\n"
    )
    out = format_text(src)
    assert "  schedule { warmup 10 decay poly { to 100 power 2 } }\n" in out
    assert format_text(out) == out
    meaning = [without_spans(load_program_text(t).model_dump()["tables"]) for t in (src, out)]
    assert meaning[0] == meaning[1]


# --------------------------------------------------------------------------- trainer parts


def test_set_rate_gives_every_group_the_scheduled_rate():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer(
        [p],
        type("C", (), {"kind": "adam", "lr": 0.01, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999})(),
    )
    s = Schedule(warmup=4)
    assert set_rate(opt, 0.01, s, 1) == pytest.approx(0.005)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    assert set_rate(opt, 0.01, None, 1) == 0.01


def test_mixed_precision_refuses_fp16_off_cuda_and_bf16_autocasts_on_cpu():
    with pytest.raises(ValueError, match="CUDA only"):
        MixedPrecision("fp16", torch.device("cpu"))
    mp = MixedPrecision("bf16", torch.device("cpu"))
    lin = torch.nn.Linear(4, 2)
    with mp.autocast():
        y = lin(torch.randn(3, 4))
    assert y.dtype == torch.bfloat16 and mp.output(y).dtype == torch.float32
    assert lin.weight.dtype == torch.float32
    fp32 = MixedPrecision("fp32", torch.device("cpu"))
    with fp32.autocast():
        assert lin(torch.randn(3, 4)).dtype == torch.float32
    assert math.isclose(sum(1 for _ in fp32.state()), 0)


def _one_rank_plan(schedule: str):
    spec = (
        "hardware { nodes 1 gpus_per_node 1 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s "
        "network 10 Gb/s }\n"
        f"table a {{ rows 50 dim 4 hotness 2 optimizer sgd {{ lr 0.5 }} {schedule} }}\n"
        "table b { rows 40 dim 4 hotness 1 optimizer adagrad { lr 0.1 } }\n"
        "model { batch 8 }\n"
    )
    return parse_plan(plan_to_json(plan_program(load_program_text(spec), solver="greedy")))


@pytest.mark.parametrize("step", [0, 2, 5])
def test_both_embedding_paths_update_at_the_scheduled_rate(step):
    """One SGD step at `step` of `warmup 4 decay step { every 1 factor 0.5 }` moves table
    a by rate(step) * gradient in the sharded path (one rank) and the reference alike;
    the unscheduled adagrad table b moves at its own rate in both."""
    from embark_runtime.embedding import ReferenceEmbeddings, ShardedEmbeddings
    from embark_runtime.kernels import TorchKernels
    from embark_runtime.optim import schedule_clusters
    from embark_runtime.synthetic import Bag

    plan = _one_rank_plan("schedule { warmup 4 decay step { every 1 factor 0.5 } }")
    rate = plan.tables[0].optimizer_params.schedule.rate(0.5, step)
    assert rate == [0.125, 0.25, 0.375, 0.5, 0.5, 0.25][step]
    batch = {
        "a": Bag(ids=np.array([3, 7, 3, 9] * 4), offsets=np.arange(0, 17, 2)),
        "b": Bag(ids=np.arange(8) * 5, offsets=np.arange(9)),
    }
    sharded = ShardedEmbeddings(plan, 0, 1, kernels=TorchKernels(torch.float64), seed=0)
    reference = ReferenceEmbeddings(plan, seed=0, accum=torch.float64)
    before = reference.table_weights("a").clone()
    schedule_clusters(sharded.clusters, step)
    reference.step = step
    for emb in (sharded, reference):
        out = emb(batch)
        (out["a"].sum() + 2 * out["b"].sum()).backward()
    sharded.finish_backward()
    moved = before - reference.table_weights("a")
    counts = torch.bincount(torch.tensor([3, 7, 3, 9] * 4), minlength=50).float()
    assert torch.allclose(moved, (rate * counts)[:, None].expand(50, 4), rtol=0, atol=1e-6)
    for name in ("a", "b"):
        assert torch.equal(sharded.gather_table(name).float(), reference.table_weights(name))


def test_the_loss_scale_is_taken_off_the_embedding_gradients_and_an_overflow_dropped():
    """fp16's dynamic loss scaling (CUDA) multiplies the loss by S; the embeddings update
    inside the backward, so their gradients are divided by S on the way out of the dense
    model, and an overflowed one is zeroed (the dense step of that step is skipped)."""
    from embark_runtime.dense import _Unscale

    x = torch.ones(2, 3, requires_grad=True)
    y = _Unscale.apply(x, torch.tensor(1024.0))
    (y * 2048.0).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))
    x.grad = None
    y = _Unscale.apply(x, torch.tensor(1024.0))
    (y * torch.tensor([[1.0, float("inf"), 1.0], [1.0, 1.0, 1.0]])).sum().backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_check_names_the_schedules_and_precision_only_when_set(tmp_path, capsys):
    from embarkc.cli import main

    spec = tmp_path / "s.embark"
    spec.write_text(HW + "table a { rows 100 dim 16 hotness 1 }\nmodel { batch 64 }\n")
    assert main(["check", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "rate" not in out and "precision" not in out
    spec.write_text(
        HW + "table a { rows 100 dim 16 hotness 1 schedule { warmup 10 } }\n"
        "model { batch 64 optimizer adam { lr 0.001 } precision bf16\n"
        "  schedule { warmup 100 decay poly { from 200 to 1000 power 2 } } }\n"
    )
    assert main(["check", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "scheduled rates       1 of 1 tables" in out
    assert (
        "dense rate            adam lr 0.001, warm-up 100 steps, poly decay (power 2) "
        "from step 200 to 1000, down to 0" in out
    )
    assert "dense precision       bf16" in out


def test_the_dense_optimizer_takes_weight_decay_into_plan_and_train_py(tmp_path):
    from embarkc.cli import main

    spec = tmp_path / "s.embark"
    spec.write_text(
        "hardware { nodes 1 gpus_per_node 2 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s "
        "network 10 Gb/s }\ntable a { rows 100 dim 8 hotness 2 }\n"
        "model { batch 16 dense_features 3 optimizer adam { lr 0.01 weight_decay 0.01 } }\n"
    )
    assert main(["compile", str(spec), "-o", str(tmp_path / "out"), "-q"]) == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["model"]["optimizer"]["weight_decay"] == 0.01
    assert "    weight_decay=0.01,\n" in (tmp_path / "out" / "train.py").read_text()
    p = torch.nn.Parameter(torch.ones(2))
    opt = make_optimizer([p], type("C", (), {"kind": "sgd", "lr": 0.5, "weight_decay": 0.1})())
    p.grad = torch.zeros(2)
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 1 - 0.5 * 0.1))


def test_a_top_mlp_without_its_logit_is_refused_by_the_ir_the_plan_loader_and_the_runtime():
    """The trainer no longer adds an output layer: every stage refuses a top MLP whose
    last width is not 1, naming it."""
    from embark_runtime.dense import DenseConfig
    from embark_runtime.plan import PlanError
    from embarkc import ir

    with pytest.raises(ValidationError, match=r"top_mlp \[8\] must end in 1"):
        ir.DenseModel(batch_size=64, dense_features=1, top_mlp=(8,))
    with pytest.raises(ValueError, match=r"top_mlp \[6\] does not end in 1"):
        DenseConfig(1, (), "dot", (6,), (4,))
    good = plan_to_json(plan_program(_program("table a { rows 100 dim 16 hotness 1 }\n")))
    data = json.loads(good)
    data["model"]["top_mlp"] = [8]
    with pytest.raises(PlanError, match=r"model.top_mlp.*ends in the model's one logit"):
        parse_plan(json.dumps(data))
