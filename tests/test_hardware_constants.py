"""The cost model's constants set from the spec's `hardware` block: the language reads
them (units, bounds, messages), the plan file carries them, and each one changes the
predicted step time by the amount its formula says, in the planner and the simulator."""

from __future__ import annotations

import pytest

from embark_runtime.plan import dumps_plan, load_plan
from embarkc.cli import main
from embarkc.frontend import load_program_text
from embarkc.planner import constants as K
from embarkc.planner import plan_program
from embarkc.simulate import simulate

BASE = """
hardware {{ nodes 1 gpus_per_node 2 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
  network 10 GB/s dense_flops 1 TFLOP/s {extra} }}
table a {{ rows 20000 dim 16 hotness 4 }}
table b {{ rows 5000 dim 8 hotness 2 }}
model {{ batch 256 dense_features 4 bottom_mlp [16, 8] top_mlp [8, 1] }}
"""


def _plan(extra: str, strategy: str = "table-wise"):
    program = load_program_text(BASE.format(extra=extra), "hw.embark")
    return program, plan_program(program, strategy=strategy, baselines=False)


def test_every_tunable_constant_is_read_with_its_unit() -> None:
    program = load_program_text(
        BASE.format(
            extra="hbm_efficiency 0.5 nvlink_efficiency 0.6 network_efficiency 0.7 "
            "dense_efficiency 0.4 kernel_launch 8 us collective_latency 30 us "
            "network_latency 2 ms min_read 32 B"
        ),
        "hw.embark",
    )
    k = K.of(program.topology)
    assert k == K.Constants(
        hbm_efficiency=0.5,
        nvlink_efficiency=0.6,
        network_efficiency=0.7,
        dense_efficiency=0.4,
        kernel_launch_seconds=8e-6,
        collective_latency_seconds=30e-6,
        inter_node_latency_seconds=2e-3,
        small_vector_bytes=32.0,
    )
    # nothing set: the defaults, and the plan file has no `constants`
    plain = load_program_text(BASE.format(extra=""), "hw.embark")
    assert K.of(plain.topology) == K.DEFAULTS
    assert plain.topology.constants == {}


def test_hbm_efficiency_scales_the_lookup_phase() -> None:
    _, base = _plan("")
    _, half = _plan("hbm_efficiency 0.4")
    assert [s.rank for s in base.shards] == [s.rank for s in half.shards]  # table-wise: fixed
    for rb, rh in zip(base.estimate.per_rank, half.estimate.per_rank, strict=True):
        # lookup = bytes / (bw * eff) + launches * kernel_launch: at half the efficiency the
        # bytes' part doubles, so 2 * base - half is the launches' part alone
        lb, lh = rb.components["lookup"], rh.components["lookup"]
        launches = (2 * lb - lh) / K.KERNEL_LAUNCH_SECONDS
        assert launches == pytest.approx(round(launches), abs=1e-3) and round(launches) >= 3
        assert lh - lb > 0
    assert half.estimate.step_time > base.estimate.step_time


def test_kernel_launch_adds_its_difference_per_launch() -> None:
    _, base = _plan("")
    _, slow = _plan("kernel_launch 1 ms")
    for rb, rs in zip(base.estimate.per_rank, slow.estimate.per_rank, strict=True):
        extra = rs.components["lookup"] - rb.components["lookup"]
        launches = extra / (1e-3 - K.KERNEL_LAUNCH_SECONDS)
        assert launches == pytest.approx(round(launches), abs=1e-6) and round(launches) >= 3
    assert slow.estimate.step_time >= base.estimate.step_time + 3 * (1e-3 - 5e-6) - 1e-9


def test_collective_latency_and_nvlink_efficiency_change_the_exchange() -> None:
    _, base = _plan("", strategy="row-wise")
    _, lat = _plan("collective_latency 1 ms", strategy="row-wise")
    _, slow = _plan("nvlink_efficiency 0.25", strategy="row-wise")
    assert lat.estimate.step_time > base.estimate.step_time + 1e-3
    nv_b = max(r.components["nvlink"] for r in base.estimate.per_rank)
    nv_s = max(r.components["nvlink"] for r in slow.estimate.per_rank)
    # the bandwidth part of nvlink time is inversely proportional to the efficiency
    lat_part = nv_b - (nv_s - nv_b) / (K.NVLINK_EFFICIENCY / 0.25 - 1)
    assert nv_s - lat_part == pytest.approx((nv_b - lat_part) * K.NVLINK_EFFICIENCY / 0.25)
    assert slow.estimate.step_time > base.estimate.step_time


def test_dense_efficiency_sets_the_key_window() -> None:
    _, base = _plan("")
    _, slow = _plan("dense_efficiency 0.35")
    assert slow.estimate.key_window == pytest.approx(
        base.estimate.key_window * K.DENSE_EFFICIENCY / 0.35, rel=1e-6
    )


def test_the_plan_file_carries_them_and_the_simulator_uses_them(tmp_path) -> None:
    _, base = _plan("", strategy="row-wise")
    _, half = _plan("hbm_efficiency 0.4 collective_latency 100 us", strategy="row-wise")
    assert half.topology.constants == {
        "hbm_efficiency": 0.4,
        "collective_latency_seconds": 1e-4,
    }
    # a plan of the default constants is written as before they existed
    assert '"constants"' not in dumps_plan(base)
    path = tmp_path / "p.json"
    path.write_text(dumps_plan(half))
    again = load_plan(path)
    assert again.topology.constants == half.topology.constants
    sb, sh = simulate(base, batches=2, seed=0), simulate(again, batches=2, seed=0)
    for rb, rh in zip(sb.per_rank, sh.per_rank, strict=True):
        assert rh.components["lookup"] > 1.9 * rb.components["lookup"] - 1e-4
    assert sh.step_time > sb.step_time


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("hbm_efficiency 1.2", "hbm_efficiency must be above 0 and at most 1, got 1.2"),
        ("hbm_efficiency 0", "hbm_efficiency must be above 0 and at most 1, got 0"),
        ("kernel_launch 5", "kernel_launch must be above 0 and at most 1 s, got 5"),
        ("kernel_launch 2 s", "kernel_launch must be above 0 and at most 1 s, got 2"),
        ("min_read 1 MiB", "min_read must be above 0 and at most 4096 B"),
        ("dense_efficiency 50 GB/s", "dense_efficiency: "),
    ],
)
def test_bad_constants_are_clear_errors(tmp_path, capsys, field: str, message: str) -> None:
    spec = tmp_path / "bad.embark"
    spec.write_text(BASE.format(extra=field))
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "bad.embark:3:" in err


TWO_NODES = """
hardware {{ nodes 2 gpus_per_node 2 hbm 1 GiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
  network 10 GB/s dense_flops 1 TFLOP/s {extra} }}
table a {{ rows 20000 dim 16 hotness 4 }}
table b {{ rows 5000 dim 4 hotness 2 }}
model {{ batch 256 dense_features 4 bottom_mlp [16, 8] top_mlp [8, 1] }}
"""

CHANGED = {
    "hbm_efficiency": "0.3",
    "nvlink_efficiency": "0.2",
    "network_efficiency": "0.2",
    "dense_efficiency": "0.1",
    "kernel_launch": "1 ms",
    "collective_latency": "1 ms",
    "network_latency": "1 ms",
    "min_read": "1024 B",
}


@pytest.mark.parametrize("key", sorted(K.TUNABLE))
def test_every_settable_constant_changes_the_estimate(key: str) -> None:
    """Each constant the hardware block may set moves the plan's estimate (the step time,
    or for dense_efficiency the dense compute's key window), on two nodes so that
    the network constants take part; a new constant in TUNABLE must be listed here."""
    assert set(CHANGED) == set(K.TUNABLE)

    def estimate(extra: str):
        program = load_program_text(TWO_NODES.format(extra=extra), "hw2.embark")
        return plan_program(program, strategy="row-wise", baselines=False).estimate

    base, changed = estimate(""), estimate(f"{key} {CHANGED[key]}")
    if key == "dense_efficiency":
        # slower dense compute: a longer window for the next batch's keys to hide in
        assert changed.key_window > base.key_window
    else:
        assert changed.step_time > base.step_time
