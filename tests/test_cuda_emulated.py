"""The generated kernels, run on the CPU by the host emulation (tests/cuda_emulator.py)
through the runtime's CudaKernels, agree with the torch path (TorchKernels)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_plans import tiny_plan  # noqa: E402

from embark_runtime.cuda_kernels import CudaKernels, KernelMismatchError  # noqa: E402
from embark_runtime.kernels import TorchKernels  # noqa: E402
from embarkc.codegen import cuda  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "bench" / "gpu" / "bench_kernels.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    """The bench's kernels and the tiny plan's, one manifest over both."""
    return _sources_for_subprocess()


@pytest.fixture(scope="module")
def launcher(sources):
    from cuda_emulator import HostLauncher

    return HostLauncher([t for p, t in sources.items() if p.endswith(".cu")])


def _kernels(sources, launcher, **kw) -> CudaKernels:
    kw.setdefault("poison", True)
    return CudaKernels(sources=sources, device="cpu", launcher=launcher, **kw)


def test_every_family_of_the_bench_agrees_with_the_torch_path(sources, launcher):
    bench = _bench()
    k = _kernels(sources, launcher, verify=False)
    rep = bench.Report()
    bench.check_all(rep, k, TorchKernels(), torch.device("cpu"), small=True)
    failures = [line for line in rep.lines if "FAIL" in line or "ERROR" in line]
    assert not failures, "\n".join(failures)
    assert not k.fallbacks
    assert rep.failed == 0 and len(k.calls) >= 40


def _bags(batch, hot, rows, fixed, gen):
    lengths = (
        torch.full((batch,), hot)
        if fixed
        else torch.randint(0, 2 * hot + 1, (batch,), generator=gen)
    )
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.randint(0, rows, (int(offsets[-1]),), generator=gen)
    return ids, offsets


def test_tiny_plan_cells_run_on_their_own_kernels_and_verify(sources, launcher):
    """Every (cell width, feature) of specs/tiny.embark's plan: forward, backward, fused
    update and sparse update through CudaKernels with verification on (a disagreement
    raises), none of them on the torch path."""
    plan = tiny_plan()
    k = _kernels(sources, launcher, verify=True)
    gen = torch.Generator().manual_seed(0)
    for t in plan.tables:
        cluster = plan.cluster_of(t.name)
        widths = {t.dim} if cluster.kind == "dp" else {s.width for s in plan.shards_of(t.name)}
        params = SimpleNamespace(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0)
        for w in sorted(widths):
            rows = 300
            for f in (f for f in plan.features if f.table == t.name):
                mode = "sum" if f.pooling == "concat" else f.pooling
                hot = 1 if f.pooling == "concat" else f.bag_max
                ids, offsets = _bags(32, hot, rows, f.fixed, gen)
                pw = torch.rand(ids.numel(), generator=gen) if f.weighted else None
                weight = torch.randn(rows, w, generator=gen)
                out = k.pooled_forward(weight, ids, offsets, pw, mode)
                assert out.shape == (32, w)
                grad = torch.randn(32, w, generator=gen)
                k.pooled_backward(grad, ids, offsets, pw, mode, rows)
                from embark_runtime.optim import new_state

                state = new_state(t.optimizer, rows, w, t.optimizer_params, "cpu")
                if cluster.kind != "ub":
                    k.pooled_backward_update(
                        weight, state, grad, ids, offsets, pw, mode, t.optimizer, params
                    )
                uniq = torch.unique(ids)
                k.sparse_update(
                    weight,
                    state,
                    uniq,
                    torch.randn(uniq.numel(), w, generator=gen),
                    t.optimizer,
                    params,
                )
    assert not k.fallbacks, k.fallbacks
    assert any(e.startswith("embark_bwd_adam_w8") for e in k.calls)  # tag's column cells


def test_concat_kernel_lays_positions_side_by_side(sources, launcher):
    k = _kernels(sources, launcher, verify=True)
    weight = torch.randn(50, 8)
    ids = torch.randint(0, 50, (2 * 20,))
    offsets = torch.arange(0, 41, 2)
    out = k.pooled_forward(weight, ids, offsets, None, "concat")
    assert torch.equal(out, weight[ids].reshape(20, 16))


def test_empty_inputs_and_empty_bags(sources, launcher):
    k = _kernels(sources, launcher, verify=True)
    weight = torch.randn(10, 128)
    offsets = torch.tensor([0, 0, 3, 3])
    ids = torch.tensor([1, 1, 9])
    out = k.pooled_forward(weight, ids, offsets, None, "mean")
    assert torch.equal(out[0], torch.zeros(128)) and torch.equal(out[2], torch.zeros(128))
    u, inv = k.dedup(torch.empty(0, dtype=torch.int64))
    assert u.numel() == 0 and inv.numel() == 0
    order, counts, local = k.bucketize(torch.empty(0, dtype=torch.int64), 100, 4, "mod")
    assert order.numel() == 0 and counts.tolist() == [0, 0, 0, 0]


def test_bucketize_rejects_keys_outside_the_table(sources, launcher):
    k = _kernels(sources, launcher)
    with pytest.raises(ValueError, match=r"2 keys outside \[0, 100\)"):
        k.bucketize(torch.tensor([5, 100, 7, 250]), 100, 4, "range")


def test_a_wrong_kernel_is_caught_by_verification(sources):
    """The checked fallback: the first call of a kernel is compared with the torch path."""
    from cuda_emulator import HostLauncher

    name = "kernels/fwd_w128_fp32_sum_unw_h4_int64.cu"
    bad = dict(sources)
    bad[name] = sources[name].replace("acc[c][e] += scale[u]", "acc[c][e] += 1.001f * scale[u]")
    assert bad[name] != sources[name]
    k = CudaKernels(sources=bad, device="cpu", launcher=HostLauncher([bad[name]]), verify=True)
    ids = torch.randint(0, 100, (64,))
    with pytest.raises(KernelMismatchError, match="embark_fwd_w128_fp32_sum_unw_h4_int64"):
        k.pooled_forward(torch.randn(100, 128), ids, torch.arange(0, 65, 8), None, "sum")


def test_calls_without_a_kernel_take_the_torch_path_and_say_why(sources, launcher):
    k = _kernels(sources, launcher)
    weight = torch.randn(20, 40)  # no width-40 kernel in this manifest
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    out = k.pooled_forward(weight, ids, offsets, None, "sum")
    assert torch.allclose(out, TorchKernels().pooled_forward(weight, ids, offsets, None, "sum"))
    assert any("width 40" in r for r in k.fallbacks)
    assert json.loads(sources["kernels/manifest.json"])["format"] == "embark-kernels"


def test_backward_rejects_rows_outside_the_table_like_the_torch_path(sources, launcher):
    k = _kernels(sources, launcher)
    grad = torch.randn(2, 128)
    offsets = torch.tensor([0, 1, 2])
    for bad in (torch.tensor([3, 10]), torch.tensor([3, 2**33]), torch.tensor([-1, 3])):
        with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
            k.pooled_backward(grad, bad, offsets, None, "sum", 10)
        with pytest.raises(IndexError):
            TorchKernels().pooled_backward(grad, bad, offsets, None, "sum", 10)


def test_the_emulation_traps_a_misaligned_vector_access(sources, launcher, tmp_path):
    """The emulated runs above would catch a kernel indexing vectors off their 16-byte
    grid: a float4 load 4 bytes off kills the process (SIGILL), as it would fault on a GPU.
    (The fixtures build the shared library first; the subprocess finds it in the cache.)"""
    import signal
    import subprocess

    script = tmp_path / "misaligned.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_cuda_emulated import _sources_for_subprocess\n"
        "from cuda_emulator import HostLauncher\n"
        "src = _sources_for_subprocess()\n"
        "L = HostLauncher([t for p, t in src.items() if p.endswith('.cu')])\n"
        "name = 'embark_pack_w128_fp32_int64'\n"
        "text = src['kernels/pack_w128_fp32_int64.cu']\n"
        "a, out, idx = torch.randn(10, 128), torch.empty(2, 128), torch.tensor([1, 2])\n"
        "for off in (0, 4):\n"
        "    args = [('ptr', a.data_ptr() + off), ('ptr', idx.data_ptr()),\n"
        "            ('ptr', out.data_ptr()), ('i64', 2)]\n"
        "    L.launch(text, name + '_gather', 1, 256, 0, args)\n"
        "    print('offset', off, 'copied', torch.equal(out, a[1:3]), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert "offset 0 copied True" in done.stdout, done.stderr[-2000:]
    assert "offset 4" not in done.stdout
    assert done.returncode == -signal.SIGILL, done.stderr[-2000:]


def _sources_for_subprocess() -> dict[str, str]:
    insts = set(_bench().bench_instantiations()) | set(cuda.kernel_instantiations(tiny_plan()))
    return cuda.render_instantiations(sorted(insts), arch="sm_90")


def _hot_bags(batch, hot, rows, hot_count, gen):
    """Bags of `hot` ids where row 7 occurs exactly `hot_count` times, the rest uniform."""
    ids = torch.randint(8, rows, (batch * hot,), generator=gen)
    ids[torch.randperm(ids.numel(), generator=gen)[:hot_count]] = 7
    return ids, torch.arange(0, batch * hot + 1, hot)


@pytest.mark.parametrize("config", [c for c in _bench().LOOKUPS if c.pooling != "concat"], ids=repr)
def test_a_row_drawn_many_times_is_summed_in_two_passes(sources, launcher, config):
    """A row in more than SPLIT_MIN occurrences: the plain backward sums chunks of them,
    then the plain or fused kernel sums each row's chunks; both agree with the torch path
    (verification on: a disagreement raises), for every pooling, weighting and optimizer."""
    from embark_runtime.cuda_kernels import SPLIT_MIN

    bench = _bench()
    gen = torch.Generator().manual_seed(config.width)
    rows, batch = 300, 64
    ids, offsets = _hot_bags(batch, config.hotness, rows, 3 * SPLIT_MIN + 5, gen)
    pw = torch.rand(ids.numel(), generator=gen) if config.weighted else None
    grad = torch.randn(batch, config.width, generator=gen)
    k = _kernels(sources, launcher, verify=True)
    unique, row_grads = k.pooled_backward(grad, ids, offsets, pw, config.pooling, rows)
    u0, g0 = TorchKernels().pooled_backward(grad, ids, offsets, pw, config.pooling, rows)
    assert torch.equal(unique, u0)
    assert (row_grads - g0).abs().max() <= 1e-5 * g0.abs().max(), (row_grads - g0).abs().max()
    plain = next(e for e in k.calls if e.startswith("embark_bwd_none_"))
    assert k.calls[plain] == 2  # chunks, then each row's chunks

    weight = (torch.randn(rows, config.width, generator=gen) * 0.1).to(bench._dt(config.dtype))
    state = bench._state(config.optimizer, rows, config.width, "cpu")
    params = bench._params(config.optimizer)
    w0, s0 = weight.clone(), {n: v.clone() for n, v in state.items()}
    k.pooled_backward_update(
        weight, state, grad, ids, offsets, pw, config.pooling, config.optimizer, params
    )
    TorchKernels().sparse_update(w0, s0, u0, g0, config.optimizer, params)
    assert torch.allclose(weight.float(), w0.float(), rtol=bench.TOL[config.dtype], atol=1e-6)
    assert k.calls[plain] == 3 and not k.fallbacks


@pytest.mark.parametrize("extra", [0, 1])
def test_two_passes_start_beyond_split_min(sources, launcher, extra):
    from embark_runtime.cuda_kernels import SPLIT_MIN

    gen = torch.Generator().manual_seed(extra)
    ids, offsets = _hot_bags(16, 4, 300, SPLIT_MIN + extra, gen)
    grad = torch.randn(16, 128, generator=gen)
    k = _kernels(sources, launcher, verify=True)
    _, row_grads = k.pooled_backward(grad, ids, offsets, None, "sum", 300)
    _, g0 = TorchKernels().pooled_backward(grad, ids, offsets, None, "sum", 300)
    assert torch.allclose(row_grads, g0, rtol=1e-5, atol=1e-6)
    assert k.calls["embark_bwd_none_w128_fp32_sum_unw_h0_int64"] == 1 + extra
