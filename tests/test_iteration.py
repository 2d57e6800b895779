"""The step time users read (issue 36): `plan`, the report, `diff` and the generated
README state the embedding step, the dense forward and backward, the dense all-reduce
and the whole iteration as the trainer runs it, with samples/s."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from embarkc.cli import main
from embarkc.dense import DenseShape, iteration_lines, iteration_of
from embarkc.diff import diff_sides, load_side
from embarkc.frontend import load_program_text
from embarkc.planner import constants as K
from embarkc.planner import plan_program
from embarkc.planner.cost import dense_shape
from embarkc.review.render import render_markdown

SPEC = """
hardware {{ nodes 1 gpus_per_node 2 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
  network 10 GB/s {flops} }}
table a {{ rows 20000 dim 16 hotness 4 }}
table b {{ rows 5000 dim 8 hotness 2 }}
table c {{ rows 300 dim 8 hotness 1 pooling concat }}
model {{ batch 512 dense_features 4 bottom_mlp [64, 16] top_mlp [128, 64, 1] }}
"""


def _plan(flops: str = "dense_flops 1 TFLOP/s", strategy: str = "table-wise"):
    program = load_program_text(SPEC.format(flops=flops), "it.embark")
    return program, plan_program(program, strategy=strategy, baselines=False)


def test_the_iteration_adds_the_dense_part_to_the_embedding_step() -> None:
    program, plan = _plan()
    it = iteration_of(plan)
    shape = dense_shape(program)
    bottom, rest = shape.forward_flops()
    # forward and backward (twice the forward) of every layer on one GPU's 256 samples
    want = (bottom + rest) * 3 * 256 / (1e12 * K.DENSE_EFFICIENCY)
    assert it.known and it.dense == pytest.approx(want, rel=1e-9)
    extra = plan.estimate.model_extra or {}
    assert it.embedding == plan.estimate.step_time
    assert it.dense_allreduce == pytest.approx(extra["dense_allreduce_time"])
    assert it.seconds == pytest.approx(it.embedding + it.dense + it.dense_allreduce - it.hidden)
    assert it.samples_per_second == pytest.approx(512 / it.seconds)
    # the window the keys hide in is the dense compute less the bottom MLP's forward
    assert extra["key_window"] == pytest.approx(
        (rest + 2 * (bottom + rest)) * 256 / (1e12 * K.DENSE_EFFICIENCY), rel=1e-9
    )
    assert it.seconds > it.embedding + it.dense


def test_the_dp_exchange_under_the_dense_allreduce_is_not_counted_twice() -> None:
    _, plan = _plan(strategy="data-parallel")
    it = iteration_of(plan)
    crit = plan.estimate.model_extra["critical_rank"]
    dp = next(r for r in plan.estimate.per_rank if r.rank == crit).components["dp_exchange"]
    assert dp > 0 and it.hidden == pytest.approx(min(dp, it.dense_allreduce))


def test_without_a_dense_rate_the_dense_part_is_not_counted() -> None:
    _, plan = _plan(flops="")
    it = iteration_of(plan)
    assert not it.known and it.dense == 0
    lines = iteration_lines(plan)
    assert any("not counted (the hardware gives no dense_flops)" in x for x in lines)
    assert "(without the dense part)" in lines[-1]


def test_plan_readme_report_and_diff_state_it(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "it.embark"
    spec.write_text(SPEC.format(flops="dense_flops 1 TFLOP/s"))
    out = tmp_path / "p.json"
    assert main(["plan", str(spec), "--strategy", "table-wise", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    _, plan = _plan()
    it = iteration_of(plan)
    assert f"embedding step {plan.estimate.step_time * 1e3:.3f} ms" in text
    assert f"dense forward + backward {it.dense * 1e3:.3f} ms" in text
    assert f"iteration {it.seconds * 1e3:.3f} ms as the trainer runs it" in text
    assert f"{it.samples_per_second:,.0f} samples/s" in text
    build = tmp_path / "build"
    assert main(["compile", str(spec), "--strategy", "table-wise", "-o", str(build)]) == 0
    readme = (build / "README.md").read_text()
    assert f"| estimated iteration | {it.seconds * 1e3:.3f} ms as the trainer runs it" in readme
    assert f"| estimated dense forward + backward | {it.dense * 1e3:.3f} ms |" in readme
    capsys.readouterr()
    other = tmp_path / "q.json"
    assert main(["plan", str(spec), "--strategy", "row-wise", "-o", str(other)]) == 0
    capsys.readouterr()
    md = render_markdown(diff_sides(load_side(str(out)), load_side(str(other))))
    assert "| iteration (with the dense part) |" in md and "| samples/s |" in md
    report = tmp_path / "r.html"
    assert main(["report", str(out), "-o", str(report)]) == 0
    assert "predicted iteration" in report.read_text()


def test_dense_shape_of_a_concat_feature_counts_its_width() -> None:
    program, plan = _plan()
    shape = dense_shape(program)
    assert shape.feature_widths == (16, 8, 8)
    assert isinstance(replace(shape), DenseShape)
