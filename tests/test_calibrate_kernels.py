"""`embarkc calibrate` on a GPU times its lookups through the generated kernels: the ones a
compiled trainer would load for a table of that width, dtype and hotness, rendered by the
same codegen and loaded by the same `CudaKernels`, timed with CUDA events. No GPU here:
the host emulation (tests/cuda_emulator.py) stands in for cupy, NVRTC compiles the
sources, and a fake event stands in for CUDA's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from embarkc import calibrate as C
from embarkc.codegen import cuda
from embarkc.frontend import load_program_text
from embarkc.planner import plan_program

sys.path.insert(0, str(Path(__file__).parent))

SPEC = """
hardware { preset dgx_h100 gpus_per_node 2 }
table a { rows 10_000 dim 32 hotness 8 dtype fp32 optimizer sgd { lr 0.1 } }
table b { rows 10_000 dim 128 hotness 1 dtype fp16 optimizer adagrad { lr 0.1 } }
model { batch 1024 dense_features 4 bottom_mlp [16, 8] top_mlp [8, 1] }
"""


def test_the_lookup_kernels_are_the_ones_the_trainer_compiles() -> None:
    plan = plan_program(
        load_program_text(SPEC, "t.embark"), strategy="data-parallel", baselines=False
    )
    trainer = cuda.render_kernels(plan)
    points = [C.LookupPoint(10_000, 32, 8, "fp32", 64), C.LookupPoint(10_000, 128, 1, "fp16", 64)]
    ours = C.lookup_kernel_files(points, plan.topology.arch)
    kernels = sorted(p for p in ours if p.endswith(".cu"))
    assert len(kernels) == 2 and all("/fwd_" in p for p in kernels)
    for path in kernels:
        assert ours[path] == trainer[path], path


def test_every_lookup_of_a_gpu_calibration_has_a_generated_kernel() -> None:
    points = [C.OVERHEAD_POINT, *C.lookup_grid(quick=False, cuda=True)]
    insts = C.lookup_instantiations(points)
    index = {(i.width, i.dtype, i.hotness) for i in insts}
    for p in points:
        assert (p.dim, p.dtype, cuda.forward_hotness("sum", p.hotness)) in index, p
    assert {i.family for i in insts} == {"pooled_forward"}
    assert {p.bags for p in points[1:]} == {65_536}
    assert max(p.rows * p.dim * p.elem for p in points) <= C.MAX_TABLE_BYTES_CUDA


def test_the_gpu_calibration_kernels_compile_with_nvrtc() -> None:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC not installed")
    points = [C.OVERHEAD_POINT, *C.lookup_grid(quick=False, cuda=True)]
    files = C.lookup_kernel_files(points, "sm_90")
    for inst in C.lookup_instantiations(points):
        ptx = cuda.compile_ptx(files[inst.path], arch="sm_90", name=inst.path)
        assert f".entry {inst.entry}(" in ptx


def test_kernel_arch_is_the_newest_target_the_device_runs() -> None:
    assert C.kernel_arch(9, 0) == "sm_90"
    assert C.kernel_arch(8, 7) == "sm_86"
    assert C.kernel_arch(10, 0) == "sm_90"
    assert C.kernel_arch(12, 1) == "sm_90"


class FakeEvent:
    """A CUDA event on a fake clock: `record` reads it, `synchronize` is counted."""

    now = 0.0
    synced = 0

    def record(self) -> None:
        self.at = FakeEvent.now

    def synchronize(self) -> None:
        FakeEvent.synced += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's


def test_the_event_clock_times_between_its_events() -> None:
    def work() -> None:
        FakeEvent.now += 0.25

    FakeEvent.synced = 0
    assert C.EventClock(FakeEvent).seconds(work) == pytest.approx(0.25)
    assert FakeEvent.synced == 1
    assert C.best_seconds(work, C.EventClock(FakeEvent), 3, 10.0) == pytest.approx(0.25)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (host emulation)")
def test_calibrate_on_an_emulated_gpu_goes_through_the_generated_kernels() -> None:
    from cuda_emulator import HostLauncher

    launched: list[str] = []

    class Spy(HostLauncher):
        def launch(self, source, entry, grid, block, shared, args) -> None:
            launched.append(entry)
            super().launch(source, entry, grid, block, shared, args)

    cal = C.measure(C.Options(quick=True, launcher=Spy))
    want = {
        i.entry for i in C.lookup_instantiations([C.OVERHEAD_POINT, *C.lookup_grid(True, False)])
    }
    assert set(launched) == want
    # every point timed: a warm-up (verified against the torch path) and the repeats
    assert len(launched) >= 2 * (len(C.lookup_grid(True, False)) + 1)
    comment = cal.fields["kernel_launch"].comment
    assert "generated pooled_forward kernels" in comment and "CudaKernels" in comment
    assert "fell back" not in comment
    assert "through the kernels above" in cal.fields["hbm_efficiency"].comment or (
        "through the kernels above" in cal.fields["hbm_bandwidth"].comment
    )
    assert len(cal.lookups) == len(C.lookup_grid(True, False))
