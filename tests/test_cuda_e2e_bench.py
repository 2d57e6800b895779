"""bench/gpu/e2e.py, the one-GPU training-step bench, runs on the CPU: the harness, the
runtime's torch path and the generated kernels under the host emulation train the same
model as the plain PyTorch DLRM, and the CUDA path's steps never wait for the device."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_syncs import HostWaits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "gpu" / "e2e.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def e2e():
    return _e2e()


@pytest.fixture(scope="module")
def programs(e2e, tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    return {v: e2e.compile_variant(v, work / f"e2e_{v}") for v in e2e.VARIANTS}


def test_the_variants_are_criteo_kaggle_on_one_gpu_with_their_hotness(e2e, programs):
    from embark_runtime.plan import load_plan

    for v, folder in programs.items():
        plan = load_plan(folder / "plan.json")
        assert plan.topology.nodes * plan.topology.gpus_per_node == 1
        assert len(plan.tables) == 26 and {t.dim for t in plan.tables} == {16}
        hot = {(f.hotness, f.bag_max, f.fixed) for f in plan.features}
        assert hot == {"h1": {(1, 1, True)}, "h8": {(8, 8, True)}, "multi": {(4, 16, False)}}[v]


def test_cpu_run_writes_the_table_and_both_sides_agree(e2e, programs, tmp_path, capsys):
    out = tmp_path / "e2e.md"
    argv = ["--device", "cpu", "--rows-cap", "500", "--batch", "32", "--steps", "2"]
    assert e2e.main([*argv, "--warmup", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["h1", "h8", "multi"]
    assert "DISAGREE" not in text and "torch kernels (device cpu)" in text
    assert rows[1].split("|")[2].strip() == "8.00"
    assert 3.0 < float(rows[2].split("|")[2]) < 5.0  # hotness mean 4


def test_bad_arguments_exit_2_with_a_message(e2e, capsys):
    assert e2e.main(["--device", "cpu", "--variants", "h3"]) == 2
    assert "unknown h3" in capsys.readouterr().err
    assert e2e.main(["--device", "cpu", "--steps", "0"]) == 2
    if not torch.cuda.is_available():
        assert e2e.main(["--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        assert e2e.main(["--device", "cuda", "--allow-no-gpu"]) == 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("variant", ["h8", "multi"])
def test_generated_kernels_train_as_the_torch_dlrm_and_never_wait(e2e, programs, variant):
    """The embarkc side on the generated kernels (host emulation, each kernel verified on
    its first call): its steps end on the DLRM's loss and tables, and a step after the
    first has no host wait."""
    from cuda_emulator import HostLauncher

    from embark_runtime.cuda_kernels import CudaKernels

    program = e2e.load_program(programs[variant])
    kdir = Path(program.kernels_dir)
    launcher = HostLauncher([p.read_text() for p in sorted(kdir.glob("*.cu"))])
    kernels = CudaKernels(kdir, device="cpu", launcher=launcher, verify=True)
    model = e2e.model_of(program, 200)
    batches = e2e.make_batches(model, 16, 3, "cpu", seed=1)
    weights = e2e.initial_tables(model, seed=2)
    ours = e2e.EmbarkStep(model, kernels, weights, "cpu")
    theirs = e2e.TorchDLRMStep(model, weights, "cpu")
    for b in batches[:2]:
        a, t = ours(b), theirs(b)
        assert torch.allclose(a, t, rtol=1e-5)
    with HostWaits() as waits:
        ours(batches[2])
    theirs(batches[2])
    assert waits.waits == []
    kernels.check_rows()
    for tbl in model.tables:
        got, want = ours.weights[tbl.name], theirs.bags[tbl.name].weight.detach()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), tbl.name
    assert not kernels.fallbacks and ours.fused
    assert any(e.startswith("embark_bwd_sgd_w16") for e in kernels.calls)
