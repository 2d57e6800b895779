"""bench/gpu/calibrate.sh (issue 37's GPU check: calibrate, plan with the file, train with
--measure-phases, `embarkc measured`) runs end to end in its CPU dry mode."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import ROOT


def test_the_gpu_calibration_check_runs_on_the_cpu(tmp_path) -> None:
    script = ROOT / "bench" / "gpu" / "calibrate.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = tmp_path / "kept"
    r = subprocess.run(
        ["bash", str(script), "--device", "cpu", "--quick", "--steps", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "aim: lookup within 20%" in r.stdout and "aim: dense within 20%" in r.stdout
    assert "1 rank, backend gloo" in r.stdout and "exact mode" not in r.stdout  # fp32 numerics
    for name in ("gpu.embark", "plan.json", "log.jsonl", "measured.json", "measured.txt"):
        assert (out / name).is_file(), name
    plan = json.loads((out / "plan.json").read_text())
    assert plan["topology"]["constants"]["kernel_launch_seconds"] > 0  # the calibrated file
    assert "kernel_launch" in (out / "gpu.embark").read_text()
