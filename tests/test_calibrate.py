"""`embarkc calibrate`: the file it writes is a hardware block that `check` and `plan`
accept, each value commented; its constants reach the plan (a calibrated plan differs
from the preset one by what the constants say); bad output paths are clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from embarkc.calibrate import Calibration, Value, fit_line, render, with_hardware
from embarkc.cli import main
from embarkc.frontend import load_program
from embarkc.planner import constants as K
from tests.conftest import ROOT

TINY = ROOT / "specs" / "tiny.embark"


def _calibrated_spec(tmp_path: Path, hardware: Path) -> Path:
    spec = tmp_path / "tiny_cal.embark"
    spec.write_text(with_hardware(TINY.read_text(), hardware.name))
    return spec


def test_render_is_a_hardware_block_with_a_comment_per_value(tmp_path: Path) -> None:
    cal = Calibration(where="test", when="2026-01-01 00:00 UTC")
    cal.fields = {
        "nodes": Value("2", "from tiny"),
        "gpus_per_node": Value("2", "from tiny"),
        "hbm": Value("4 MiB", "from tiny"),
        "hbm_bandwidth": Value("12.5 GB/s", "copy"),
        "kernel_launch": Value("7 us", "one id"),
        "hbm_efficiency": Value("0.5", "lookups"),
        "dense_flops": Value("100 GFLOP/s", "matmul"),
        "dense_efficiency": Value("0.25", "model"),
        "nvlink": Value("1 GB/s", "a2a"),
        "collective_latency": Value("50 us", "a2a"),
        "network": Value("500 MB/s", "rail"),
        "network_latency": Value("100 us", "rail"),
    }
    text = render(cal)
    body = text[text.index("hardware {") : text.index("}")]
    for line in body.splitlines()[1:]:
        assert re.match(r"  \w+ .+  # .+", line), line
    hw = tmp_path / "hw.embark"
    hw.write_text(text)
    program = load_program(str(_calibrated_spec(tmp_path, hw)))
    topo = program.topology
    assert (topo.nodes, topo.gpus_per_node, topo.hbm_bytes) == (2, 2, 4 << 20)
    assert topo.hbm_bandwidth == 12.5e9 and topo.dense_flops == 1e11
    k = K.of(topo)
    assert k.hbm_efficiency == 0.5 and k.kernel_launch_seconds == pytest.approx(7e-6)
    assert k.dense_efficiency == 0.25 and k.collective_latency_seconds == pytest.approx(5e-5)
    assert k.inter_node_latency_seconds == pytest.approx(1e-4)
    assert k.nvlink_efficiency == K.NVLINK_EFFICIENCY  # not in the file: the default


def test_fit_line_recovers_latency_and_bandwidth() -> None:
    xs = [1e3, 1e5, 1e6, 4e6]
    ys = [20e-6 + x / 2e9 for x in xs]
    a, b = fit_line(xs, ys)
    assert a == pytest.approx(20e-6) and 1 / b == pytest.approx(2e9)
    assert fit_line([1.0, 2.0], [2.0, 1.0]) == (1.5, 0.0)  # never a negative slope


def test_quick_calibration_feeds_check_and_plan(tmp_path: Path, capsys) -> None:
    hw = tmp_path / "cpu.embark"
    assert main(["calibrate", "--quick", "--spec", str(TINY), "-o", str(hw)]) == 0
    text = hw.read_text()
    for key in ("hbm_bandwidth", "hbm_efficiency", "kernel_launch", "dense_flops"):
        assert re.search(rf"(?m)^  {key} \S+.*# \w", text), key
    assert "Written by `embarkc calibrate` on 20" in text
    spec = _calibrated_spec(tmp_path, hw)
    assert main(["check", str(spec)]) == 0
    out = tmp_path / "cal.json"
    base = tmp_path / "base.json"
    args = ["--solver", "greedy", "--time-limit", "5"]
    assert main(["plan", str(spec), *args, "-o", str(out)]) == 0
    assert main(["plan", str(TINY), *args, "-o", str(base)]) == 0
    cal, pre = json.loads(out.read_text()), json.loads(base.read_text())
    assert cal["topology"]["constants"]["kernel_launch_seconds"] > 0
    assert "constants" not in pre["topology"]
    # the calibrated rates are not tiny's: the predicted step differs
    assert cal["estimate"]["step_time"] != pre["estimate"]["step_time"]
    assert cal["topology"]["hbm_bandwidth"] != pre["topology"]["hbm_bandwidth"]
    capsys.readouterr()


def test_output_must_be_a_file_in_a_folder(tmp_path: Path, capsys) -> None:
    assert main(["calibrate", "--quick", "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["calibrate", "--quick", "-o", str(tmp_path / "no" / "x.embark")]) == 2
    assert "create it first" in capsys.readouterr().err


def test_with_hardware_needs_a_hardware_block() -> None:
    assert with_hardware("hardware { nodes 1 }\ntable t {}", "h.embark").startswith(
        'include "h.embark"\n'
    )
    with pytest.raises(ValueError, match="no hardware block"):
        with_hardware("table t { rows 1 dim 4 }", "h.embark")
