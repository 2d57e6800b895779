"""bench/gpu (the GPU check and benchmark) imports, renders and runs its harness here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "gpu" / "run.sh"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", RUN.parent / "bench_kernels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run.sh would run")
def test_run_sh_without_a_gpu_says_so():
    ok = subprocess.run([str(RUN), "--allow-no-gpu"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "no CUDA device" in ok.stderr
    assert "kernel instantiations (rendered live)" in ok.stdout
    strict = subprocess.run([str(RUN)], capture_output=True, text=True, timeout=120)
    assert strict.returncode == 2 and "no CUDA device" in strict.stderr


def test_snapshot_of_the_bench_kernels_is_current():
    bench = _bench()
    want = bench.snapshot_files()
    if os.environ.get("EMBARKC_ACCEPT"):
        bench.write_snapshot()
    have = {p.name: p.read_text() for p in bench.SNAPSHOT.iterdir()}
    assert have == want, "bench/gpu/kernels is stale: rerun with EMBARKC_ACCEPT=1"


def test_without_jinja_the_snapshot_is_used(monkeypatch):
    bench = _bench()

    def no_jinja():
        raise ModuleNotFoundError("No module named 'jinja2'", name="jinja2")

    monkeypatch.setattr(bench, "render_bench_kernels", no_jinja)
    files, origin = bench.load_sources()
    assert "snapshot" in origin and "jinja2" in origin
    assert "kernels/manifest.json" in files
    import json

    from embark_runtime.cuda_kernels import KernelIndex

    idx = KernelIndex(json.loads(files["kernels/manifest.json"]))
    assert all(k.file in files for k in idx.kernels)


def test_harness_passes_with_the_torch_path_on_cpu(capsys):
    bench = _bench()
    assert bench.main(["--self-test-cpu", "--sections", "check"]) == 0
    out = capsys.readouterr().out
    assert "| bucketize | int64 range R=64 | 0.00e+00 | ok |" in out
    assert "all checks passed" in out
