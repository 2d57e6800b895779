"""What the CUDA code generator emits for a plan, and how the runtime finds a kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_plans import dcnv2_plan, dtype_plan, tiny_plan  # noqa: E402

from embark_runtime.cuda_kernels import CudaUnavailable, KernelIndex, kernels_for  # noqa: E402
from embark_runtime.kernels import TorchKernels  # noqa: E402
from embarkc.codegen import cuda  # noqa: E402
from embarkc.diagnostics import EmbarkError  # noqa: E402


@pytest.mark.parametrize(
    ("width", "dtype", "vec", "group", "chunks"),
    [
        (128, "fp32", 4, 32, 1),  # a warp per bag, one float4 per lane
        (256, "fp16", 8, 32, 1),  # eight halves per 16-byte load
        (512, "fp32", 4, 32, 4),  # wide rows: more vectors per lane, still one warp
        (16, "fp32", 4, 4, 1),  # narrow rows: a sub-warp group, no idle lane
        (24, "fp32", 4, 8, 1),  # 6 vectors -> a group of 8 (two lanes idle)
        (12, "fp16", 4, 4, 1),  # 12 halves: 8-byte vectors
        (10, "fp32", 2, 8, 1),  # 10 floats: 8-byte vectors
        (7, "bf16", 1, 8, 1),  # odd width: element accesses
    ],
)
def test_thread_layout_rule(width, dtype, vec, group, chunks):
    lay = cuda.thread_layout(width, dtype)
    assert (lay.vec, lay.group, lay.chunks) == (vec, group, chunks)
    assert lay.vec * lay.lanes == width
    assert lay.group * lay.chunks >= lay.lanes


def test_render_is_deterministic_and_every_file_is_in_the_manifest():
    a, b = cuda.render_kernels(dcnv2_plan()), cuda.render_kernels(dcnv2_plan())
    assert a == b
    manifest = json.loads(a[cuda.MANIFEST_PATH])
    assert manifest["arch"] == "sm_90" and manifest["compute"] == "compute_90"
    assert {k["file"] for k in manifest["kernels"]} == set(a) - {cuda.MANIFEST_PATH}
    assert [k["name"] for k in manifest["kernels"]] == sorted(
        k["name"] for k in manifest["kernels"]
    )


def test_constants_are_compile_time_in_the_source():
    inst = cuda.Instantiation("pooled_forward", 64, "fp16", "mean", True, 4)
    text = cuda.render_instantiation(inst)
    for line in (
        "typedef u16 storage_t;",
        "typedef uint4 raw_t;",
        "constexpr int WIDTH = 64;",
        "constexpr int VEC = 8;",
        "constexpr int GROUP = 8;",
        "constexpr bool WEIGHTED = true;",
        "constexpr int UNROLL = 4;",
        "embark_f16_to_float",
    ):
        assert line in text
    assert "/= len" in text  # mean pooling divides by the bag length
    assert "{{" not in text and "{%" not in text


def test_one_instantiation_per_distinct_cell_shape():
    insts = cuda.kernel_instantiations(dcnv2_plan())
    assert len(insts) == len(set(insts))
    fwd = [i for i in insts if i.family == "pooled_forward"]
    # dcnv2: widths 128 (whole tables) and 64 (column cells), sum, fp32, hotness
    # 1, 2, 3 and >= 4 (clamped to the unroll depth)
    assert {(i.width, i.hotness) for i in fwd} == {
        (w, h) for w in (64, 128) for h in (1, 2, 3, 4)
    } - {(64, 1), (64, 2)}  # only the 40M-row tables (hotness 3 and 7) are column-cut
    fused = [i for i in insts if i.family == "backward_update" and i.optimizer != "none"]
    assert {i.optimizer for i in fused} == {"adagrad"}
    # ub tables' requester pools wire buffers; their owner's update is the fused sum of
    # one-id bags, the same adagrad instantiation as the rb tables' of that width
    assert {i.family for i in insts} == set(cuda.FAMILIES)


def test_tiny_plan_covers_every_pooling_and_optimizer():
    insts = cuda.kernel_instantiations(tiny_plan())
    fwd = {(i.pooling, i.weighted) for i in insts if i.family == "pooled_forward"}
    assert {("sum", False), ("mean", False), ("concat", False), ("sum", True)} <= fwd
    opts = {i.optimizer for i in insts if i.family == "sparse_update"}
    assert opts == {"sgd", "adagrad", "rowwise_adagrad", "adam"}
    # tag is cut into columns [0, 8) and [8, 16): kernels of width 8
    assert any(i.width == 8 and i.optimizer == "adam" for i in insts)
    # concat (category, hotness 1) also gets a sum kernel for one-id bags
    assert cuda.Instantiation("pooled_forward", 8, "fp32", "sum", False, 1) in insts
    assert {i.partition for i in insts if i.family == "bucketize"} == {"mod"}
    assert {i.key for i in insts if i.family == "dedup"} == {"int32", "int64"}


def test_unsupported_architecture_is_a_user_error():
    plan = tiny_plan()
    bad = plan.model_copy(update={"topology": plan.topology.model_copy(update={"arch": "sm_70"})})
    with pytest.raises(EmbarkError, match="architecture `sm_70`"):
        cuda.render_kernels(bad)


def test_template_of_names_the_family_template():
    files = cuda.render_kernels(dtype_plan())
    for path in files:
        t = cuda.template_of(path)
        assert t.startswith("templates/cuda/") or path == cuda.MANIFEST_PATH
    assert cuda.template_of("kernels/bucketize_range_int64.cu") == "templates/cuda/bucketize.cu.j2"


def test_runtime_index_finds_the_kernel_for_a_call():
    manifest = json.loads(cuda.render_kernels(tiny_plan())[cuda.MANIFEST_PATH])
    idx = KernelIndex(manifest)
    # history: width 24, sum, mean length 8 -> the unroll-4 instantiation
    k = idx.forward(24, "fp32", "sum", False, "int64", 8.0)
    assert k is not None and k.get("hotness") == 4
    # brand: mean over 2 ids
    k = idx.forward(12, "fp32", "mean", False, "int64", 2.0)
    assert k is not None and k.name == "fwd_w12_fp32_mean_unw_h2_int64"
    # concat needs the exact bag size
    assert idx.forward(8, "fp32", "concat", False, "int64", 1.0) is not None
    assert idx.forward(8, "fp32", "concat", False, "int64", 2.0) is None
    assert idx.backward(8, "fp32", "sum", True, "int64", "none") is not None
    assert idx.backward(16, "fp32", "sum", True, "int64", "none") is None  # tag is cut in 8s
    assert idx.backward(8, "fp32", "sum", True, "int64", "adam") is not None
    assert idx.update(12, "fp32", "rowwise_adagrad", "int64") is not None
    assert idx.update(12, "fp16", "rowwise_adagrad", "int64") is None
    assert idx.dedup("int32") is not None
    assert idx.bucketize("int64", "mod") is not None and idx.bucketize("int64", "range") is None
    assert idx.pack(32, "fp32", "int64").entries[-1].endswith("_scatter_add")


def test_runtime_rejects_a_foreign_manifest():
    with pytest.raises(CudaUnavailable, match="not an embark-kernels"):
        KernelIndex({"format": "something-else", "version": 1})
    with pytest.raises(CudaUnavailable, match="not an embark-kernels"):
        KernelIndex([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "damage",
    [
        lambda k: k.pop("name"),
        lambda k: k.update(entries="fwd"),
        lambda k: k.update(constants=[1]),
        lambda k: k.update(file=3),
    ],
)
def test_runtime_names_a_damaged_manifest(damage):
    manifest = json.loads(cuda.render_kernels(tiny_plan())[cuda.MANIFEST_PATH])
    damage(manifest["kernels"][1])
    with pytest.raises(CudaUnavailable, match=r"damaged manifest: `kernels\[1\]`"):
        KernelIndex(manifest)
    manifest["kernels"] = 7
    with pytest.raises(CudaUnavailable, match=r"`kernels\[0\]` is not an instantiation"):
        KernelIndex(manifest)


def test_without_cuda_the_torch_path_is_chosen_and_said(tmp_path):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    for path, text in cuda.render_kernels(tiny_plan()).items():
        (tmp_path / path).write_text(text)
    k, why = kernels_for(kdir, "cpu")
    assert isinstance(k, TorchKernels) and "torch" in why
    if not torch.cuda.is_available():
        k, why = kernels_for(kdir, "cuda")
        assert isinstance(k, TorchKernels) and "no CUDA device" in why


class _RecordingLauncher:
    compiled = 0

    def __init__(self):
        self.launches = []

    def launch(self, source, entry, grid, block, shared, args):
        assert f" {entry}(" in source
        self.launches.append((entry, grid, block, shared, [kind for kind, _ in args]))


def test_kernels_load_from_a_compiled_output_folder(tmp_path):
    """CudaKernels reads kernel_dir as `embarkc compile` writes it (header line first, the
    manifest's "//" key) and launches with the manifest's grid shape."""
    from embark_runtime.cuda_kernels import CudaKernels

    kdir = tmp_path / "kernels"
    kdir.mkdir()
    for path, text in cuda.render_kernels(tiny_plan()).items():
        if path.endswith(".json"):
            text = json.dumps({"//": "Generated by embarkc. Do not edit.", **json.loads(text)})
        else:
            text = "// Generated by embarkc. Do not edit.\n" + text
        (tmp_path / path).write_text(text)
    rec = _RecordingLauncher()
    k = CudaKernels(kdir, device="cpu", launcher=rec, verify=False)
    weight = torch.zeros(100, 24)
    ids = torch.zeros(1000, dtype=torch.int64)
    k.pooled_forward(weight, ids, torch.arange(0, 1001, 10), None, "sum")
    # history (width 24): 6 vectors of 4 floats -> groups of 8 threads, 32 bags per block
    assert rec.launches == [
        ("embark_fwd_w24_fp32_sum_unw_h4_int64", 4, 256, 0, ["ptr"] * 5 + ["i64"])
    ]
    k.bucketize(torch.arange(600), 1000, 4, "mod")
    assert rec.launches[1][:4] == ("embark_bucketize_mod_int64_count", 3, 256, 8 * 4 * 4)
    assert not k.fallbacks
