"""bench/gpu (the GPU check and benchmark) imports, renders and runs its harness here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import load_module

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "gpu" / "run.sh"


def _load(name: str):
    """bench/gpu/<name>.py as the module `name` (bench/gpu is no package)."""
    return load_module(RUN.parent / f"{name}.py")


def _bench():
    return _load("bench_kernels")


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
    assert have == want, "tests/snapshots/bench_kernels is stale: rerun with EMBARKC_ACCEPT=1"


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


def _trainer_check():
    return _load("trainer_check")


def test_the_trainer_checks_spec_is_tiny_on_one_gpu():
    """bench/gpu/tiny1.embark has specs/tiny.embark's tables, features and model."""
    from embarkc.frontend import load_program

    one, tiny = (
        load_program(str(RUN.parent / "tiny1.embark")),
        load_program(str(ROOT / "specs" / "tiny.embark")),
    )

    from embarkc.ir import without_spans

    def strip(x):
        return without_spans(x.model_dump(mode="json"))

    for a, b in ((one.tables, tiny.tables), (one.features, tiny.features)):
        assert [strip(m) for m in a] == [strip(m) for m in b]
    assert strip(one.model) == strip(tiny.model)
    assert (one.topology.nodes, one.topology.gpus_per_node) == (1, 1)


@pytest.mark.slow
def test_trainer_check_passes_on_the_cpu(tmp_path, monkeypatch):
    """The GPU trainer section, run on the CPU: compiles tiny1, trains it in exact and
    fp32 mode against the reference and resumes a checkpoint; every check passes."""
    check = _trainer_check()
    monkeypatch.setattr(check, "BUILT", tmp_path / "none")  # compile afresh, not prepare.sh's
    lines, failed = check.run_checks("cpu", steps=12)
    text = "\n".join(lines)
    assert failed == 0, text
    for what in (
        "ok: exact: runs on backend gloo",
        "ok: exact: the reference's tables (max difference 0)",
        "ok: kernels: the reference's first 10 losses",
        "ok: resume from step 10: the uninterrupted run's tables",
    ):
        assert what in text, text


def test_trainer_check_without_cuda_or_program_says_why(monkeypatch, tmp_path):
    check = _trainer_check()
    if not torch.cuda.is_available():
        with pytest.raises(check.CannotRun, match="no CUDA device"):
            check.run_checks("cuda", steps=12)
    monkeypatch.setattr(check, "BUILT", tmp_path / "none")
    monkeypatch.setitem(sys.modules, "embarkc.cli", None)  # embarkc does not import
    with pytest.raises(check.CannotRun, match="bench/gpu/prepare.sh"):
        check.program_dir(tmp_path)


def test_the_tune_variants_apply_to_the_templates_and_compile():
    """The tune section edits the rendered forward and backward: a template change that
    moves the text it edits fails here, not on a GPU machine's clock."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC not installed")
    from embarkc.codegen.cuda import compile_ptx

    bench = _bench()
    sources, _ = bench.load_sources()
    fwd = sources["kernels/fwd_w128_fp32_sum_unw_h4_int64.cu"]
    bwd = sources["kernels/bwd_none_w128_fp32_sum_unw_h0_int64.cu"]
    forward = bench.forward_variants(fwd)
    assert len(set(forward.values())) == 4 and forward["templates"] == fwd
    for text in forward.values():
        ptx = compile_ptx(bench._variant(text, UNROLL=8, BLOCK=128))
        assert "embark_fwd_w128_fp32_sum_unw_h4_int64" in ptx
    assert "L2::256B" in compile_ptx(forward["nc"])
    backward = bench.backward_variants(bwd)
    assert len({text for text, _ in backward.values()}) == 5
    for text, _ in backward.values():
        assert "embark_bwd_none_w128" in compile_ptx(bench._variant(text, BLOCK=128))
    with pytest.raises(ValueError, match="no constant UNROLL"):
        bench._variant(bwd, UNROLL=2)


def test_the_report_is_written_line_by_line(tmp_path, capsys):
    """A run cut short by its time limit keeps what it measured; an --out it cannot
    write is said, with exit code 2."""
    bench = _bench()
    out = tmp_path / "r.md"
    rep = bench.Report(out)
    rep.out("# one")
    rep.row(["a", 1])
    assert out.read_text() == "# one\n| a | 1 |\n"
    assert bench.main(["--self-test-cpu", "--out", str(tmp_path / "no" / "r.md")]) == 2
    assert "cannot write --out" in capsys.readouterr().err
