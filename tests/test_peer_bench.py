"""bench/peer_torchrec.py without TorchRec: it says how to install the peer and exits 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_module

BENCH = Path(__file__).resolve().parent.parent / "bench" / "peer_torchrec.py"


def _load_bench():
    return load_module(BENCH)


def test_absent_torchrec_skips_with_install_hint(monkeypatch, capsys):
    bench = _load_bench()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchrec" else real(name, *a),
    )

    def must_not_run(*a, **k):
        raise AssertionError("the bench ran without TorchRec")

    monkeypatch.setattr(bench, "data_plan", must_not_run)
    monkeypatch.setattr(bench, "embarkc_planner", must_not_run)
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "TorchRec not installed" in out
    assert "bench/peer_torchrec_setup.sh" in out


def test_missing_fbgemm_is_named(monkeypatch):
    bench = _load_bench()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util,
        "find_spec",
        lambda name, *a: (
            object() if name == "torchrec" else (None if name == "fbgemm_gpu" else real(name, *a))
        ),
    )
    msg = bench.torchrec_missing()
    assert msg is not None and "fbgemm_gpu" in msg


def test_script_exits_zero_in_the_project_environment():
    if importlib.util.find_spec("torchrec") is not None:
        pytest.skip("TorchRec is installed in this environment")
    r = subprocess.run(
        [sys.executable, str(BENCH), "--no-planner"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "TorchRec not installed" in r.stdout
    assert r.stderr == ""
