"""Every kernel emitted for the test plans compiles to PTX with NVRTC (no GPU needed), for
the plan's architecture, with the expected entry points and 16-byte vector accesses."""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cuda_plans import dcnv2_plan, dtype_plan, tiny_plan  # noqa: E402

from embarkc.codegen import cuda  # noqa: E402

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy-cuda12x) not installed")

CACHE = Path(tempfile.gettempdir()) / "embarkc-test-nvrtc"


def ptx_of(source: str, arch: str, name: str) -> str:
    """Compile with NVRTC, cached on disk by the hash of (source, arch)."""
    key = hashlib.sha256(f"{arch}\n{source}".encode()).hexdigest()
    hit = CACHE / f"{key}.ptx"
    if hit.exists():
        return hit.read_text()
    ptx = cuda.compile_ptx(source, arch=arch, name=name)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = hit.with_suffix(".tmp")
    tmp.write_text(ptx)
    tmp.replace(hit)
    return ptx


ROOT = Path(__file__).resolve().parent.parent


def planned(spec: str):
    """The planner's plan of a spec (greedy: the kernels depend on the cells, not on how
    good the placement is)."""

    def build():
        from embarkc.frontend import load_program
        from embarkc.planner import plan_program

        return plan_program(load_program(ROOT / spec), solver="greedy", baselines=False)

    return build


PLANS = {
    "tiny": tiny_plan,
    "dtypes": dtype_plan,
    "dcnv2": dcnv2_plan,
    "tiny-planned": planned("specs/tiny.embark"),
    "dcnv2-planned": planned("specs/paper/dcnv2.embark"),
}


@pytest.mark.parametrize("which", sorted(PLANS))
def test_every_emitted_kernel_compiles_with_its_entries(which):
    plan = PLANS[which]()
    files = cuda.render_kernels(plan)
    insts = {i.path: i for i in cuda.kernel_instantiations(plan)}
    assert set(files) == set(insts) | {cuda.MANIFEST_PATH}
    target = cuda.ARCH_TO_COMPUTE[plan.topology.arch].replace("compute", "sm")
    for path, inst in sorted(insts.items()):
        ptx = ptx_of(files[path], plan.topology.arch, path)
        assert f".target {target}" in ptx, path
        entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
        assert entries == set(inst.entries), path
        lay = inst.layout()
        if lay is not None and lay.vec * cuda.DTYPES[inst.dtype].bytes == 16:
            assert re.search(r"ld\.global(\.nc)?\.v4\.", ptx), f"{path}: no 16-byte load"
        if inst.family == "pooled_forward" and lay is not None and lay.vec >= 4:
            assert "st.global.v4.f32" in ptx, f"{path}: no 16-byte store of the pooled output"
        if inst.family == "dedup":
            assert "atom.global.cas.b64" in ptx, path
        if inst.family == "bucketize":
            assert "match.any.sync.b64" in ptx, path


def test_kernels_compile_for_a100_as_well():
    insts = cuda.kernel_instantiations(tiny_plan()) + cuda.kernel_instantiations(dtype_plan())
    files = cuda.render_instantiations(insts, arch="sm_80")
    for inst in insts:
        assert ".target sm_80" in ptx_of(files[inst.path], "sm_80", inst.path)


def test_a_template_error_is_reported_with_nvrtc_log():
    with pytest.raises(RuntimeError, match="NVRTC failed on broken.cu"):
        cuda.compile_ptx('extern "C" __global__ void k() { undefined_name(); }', name="broken.cu")
