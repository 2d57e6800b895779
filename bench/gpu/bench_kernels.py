"""GPU check and benchmark of embarkc's generated CUDA kernels (run through bench/gpu/run.sh).

1. check: every kernel family of a few configurations (widths 8 to 256; fp32, fp16, bf16;
   sum, mean, concat; weighted or not; every optimizer; int32 and int64 keys; mod and range
   partitions) against the torch path (embark_runtime.kernels.TorchKernels) on fresh random
   inputs, every output poisoned with NaN / -7 before the launch;
2. time: CUDA-event timings at sizes several times the L2 cache (H100 50 MB, H200 60 MB):
   the pooled forward at dim 128 against the measured device-to-device copy bandwidth, and
   forward + backward (to row gradients, and with the fused adagrad update) against
   torch.nn.EmbeddingBag's forward + backward (and + torch.optim.Adagrad), and, where
   importable, FBGEMM's table-batched embedding; on uniform and skewed ids, each time
   taken over back-to-back calls (the host's launch work overlaps the device's, as in
   training);
3. tune: the pooled forward at dim 128 with other UNROLL / BLOCK constants and with
   experimental loads, a ceiling for reads of random rows (gathers), the backward kernel
   unrolled or fed pre-sorted bags, and the parts of a training step timed apart;
4. trainer: bench/gpu/trainer_check.py, the generated train.py of a one-GPU spec on the
   device (NCCL, the generated kernels, --exact, a resume) against its reference on the
   same device (and the exact one on the CPU).

Prints markdown tables (also written to --out). Exit code 0 when every check passes, 1 when
one fails, 2 without a CUDA device (0 with --allow-no-gpu, after rendering the kernels) or
when --out cannot be written.
Each section is guarded: an exception is reported in the table and the run goes on.
`--self-test-cpu` runs the same harness on the CPU with the torch path standing in for the
kernels and tiny sizes (the repository's tests use it; it measures nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE.parent.parent / "tests" / "snapshots" / "bench_kernels"
"""The rendered bench kernels, checked in: the tests keep them equal to a live render (a
golden of the templates) and a GPU machine without jinja2 reads them."""


def _bootstrap() -> None:
    """Make `embarkc` and `embark_runtime` importable from a bare checkout (the GPU machine
    may have no editable install): embark_runtime is the runtime/ folder."""
    try:
        import embark_runtime  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "embark_runtime",
            ROOT / "runtime" / "__init__.py",
            submodule_search_locations=[str(ROOT / "runtime")],
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["embark_runtime"] = mod
        spec.loader.exec_module(mod)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import embarkc.templates  # noqa: F401
    except ImportError:
        try:
            import embarkc
        except ImportError:
            return
        spec = importlib.util.spec_from_file_location(
            "embarkc.templates",
            ROOT / "templates" / "__init__.py",
            submodule_search_locations=[str(ROOT / "templates")],
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["embarkc.templates"] = mod
        spec.loader.exec_module(mod)
        embarkc.templates = mod  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class LookupConfig:
    width: int
    dtype: str
    pooling: str
    weighted: bool
    hotness: int  # mean bag length (exact for concat)
    optimizer: str


LOOKUPS = [
    LookupConfig(128, "fp32", "sum", False, 8, "adagrad"),
    LookupConfig(64, "fp16", "mean", True, 5, "adam"),
    LookupConfig(256, "bf16", "sum", False, 3, "rowwise_adagrad"),
    LookupConfig(8, "fp32", "concat", False, 2, "sgd"),
    LookupConfig(12, "fp32", "mean", False, 4, "adagrad"),
    LookupConfig(24, "fp16", "sum", True, 1, "sgd"),
    LookupConfig(512, "fp32", "sum", True, 2, "adam"),
]


def bench_instantiations() -> list[Any]:
    """The kernels of the configurations above (rendered live or read from the snapshot)."""
    from embarkc.codegen import cuda

    out = []
    for c in LOOKUPS:
        out += cuda.lookup_instantiations(
            c.width, c.dtype, c.pooling, c.weighted, c.hotness, c.optimizer
        )
        out.append(cuda.Instantiation("pack", c.width, c.dtype))
        out.append(cuda.Instantiation("pack", c.width, "fp32"))
    for key in ("int32", "int64"):
        out.append(cuda.Instantiation("dedup", key=key))
        for part in ("mod", "range"):
            out.append(cuda.Instantiation("bucketize", key=key, partition=part))
    return out


def render_bench_kernels() -> dict[str, str]:
    from embarkc.codegen import cuda

    return cuda.render_instantiations(bench_instantiations(), arch="sm_90")


SNAPSHOT_HEADER = (
    "Generated by bench/gpu/bench_kernels.py --write-snapshot from templates/cuda; do not edit."
)


def snapshot_files() -> dict[str, str]:
    """{file name: text} of tests/snapshots/bench_kernels as a live render would write it."""
    out = {}
    for path, text in render_bench_kernels().items():
        name = path.removeprefix("kernels/")
        if name.endswith(".json"):
            data = {"//": SNAPSHOT_HEADER, **json.loads(text)}
            out[name] = json.dumps(data, indent=2, sort_keys=True) + "\n"
        else:
            out[name] = f"// {SNAPSHOT_HEADER}\n{text}"
    return out


def write_snapshot() -> None:
    files = snapshot_files()
    SNAPSHOT.mkdir(exist_ok=True)
    for old in SNAPSHOT.iterdir():
        if old.name not in files:
            old.unlink()
    for name, text in files.items():
        (SNAPSHOT / name).write_text(text)


def load_sources() -> tuple[dict[str, str], str]:
    """Rendered live when the compiler's dependencies are here, else the checked-in
    snapshot (tests/snapshots/bench_kernels, kept equal to a live render by the tests)."""
    try:
        return render_bench_kernels(), "rendered live"
    except ImportError as e:
        files = {f"kernels/{p.name}": p.read_text() for p in sorted(SNAPSHOT.iterdir())}
        return files, f"snapshot tests/snapshots/bench_kernels ({e.name} not installed)"


# ----------------------------------------------------------------------------- helpers


def _dt(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _params(optimizer: str):
    return SimpleNamespace(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.01)


def _state(optimizer: str, rows: int, width: int, device):
    import torch

    f = {"dtype": torch.float32, "device": device}
    if optimizer == "adagrad":
        return {"sum": torch.rand(rows, width, **f)}
    if optimizer == "rowwise_adagrad":
        return {"sum": torch.rand(rows, **f)}
    if optimizer == "adam":
        return {
            "m": torch.randn(rows, width, **f) * 0.01,
            "v": torch.rand(rows, width, **f) * 0.01,
            "step": torch.randint(0, 5, (rows,), device=device).float(),
        }
    return {}


def _bags(batch: int, hotness: int, rows: int, fixed: bool, device, key_dtype=None):
    """Random bags: lengths uniform in [0, 2 * hotness] (some empty), or exactly hotness."""
    import torch

    if fixed:
        lengths = torch.full((batch,), hotness, dtype=torch.int64, device=device)
    else:
        lengths = torch.randint(0, 2 * hotness + 1, (batch,), device=device)
    offsets = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    # skewed ids: repeated rows inside and across bags exercise the segment reduction
    ids = (torch.rand(nnz, device=device) ** 3 * rows).long().clamp_(max=rows - 1)
    return ids.to(key_dtype or torch.int64), offsets


def _err(actual, expected) -> float:
    import torch

    if actual.shape != expected.shape:
        return math.inf
    if actual.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    if torch.isnan(a).any() and not torch.isnan(e).any():
        return math.inf
    # relative to each element, floored at 1 % of the data's scale: a sum that nearly
    # cancels carries the absolute rounding of its terms, which any summation order
    # changes (fp32 sums of terms of size ~1 round at ~1e-7 absolute)
    floor = max(1e-3, 1e-2 * float(e.abs().max()))
    return float(((a - e).abs() / (e.abs() + floor)).max())


TOL = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}


class Report:
    """Markdown lines on stdout and, line by line, in `path` (so that a run cut short by
    its time limit still leaves what it measured)."""

    def __init__(self, path: Path | None = None) -> None:
        self.lines: list[str] = []
        self.failed = 0
        self.path = path
        if path is not None:
            path.write_text("")

    def out(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def table(self, header: list[str]) -> None:
        self.out("| " + " | ".join(header) + " |")
        self.out("|" + "---|" * len(header))

    def row(self, cells: list[Any]) -> None:
        self.out("| " + " | ".join(str(c) for c in cells) + " |")


# ----------------------------------------------------------------------------- checks


def check_all(rep: Report, cand, ref, device, small: bool) -> None:
    import torch

    rep.out("## Correctness against the torch path (fresh random inputs, poisoned outputs)")
    rep.out()
    rep.table(["family", "configuration", "max relative error", "result"])
    batch = 64 if small else 4096
    rows = 500 if small else 100_000

    def record(family: str, config: str, fn) -> None:
        fell = dict(getattr(cand, "fallbacks", {}))
        try:
            err, tol = fn()
            ok = err <= tol
            result = "ok" if ok else f"FAIL (tolerance {tol:g})"
            new = {k: v for k, v in getattr(cand, "fallbacks", {}).items() if fell.get(k) != v}
            if new:
                # the torch path checked against itself proves nothing about the kernels
                ok = False
                result = "FAIL (ran on the torch path: " + "; ".join(sorted(new)) + ")"
            rep.row([family, config, f"{err:.2e}", result])
            if not ok:
                rep.failed += 1
        except Exception as e:  # a section failing must not hide the others
            rep.failed += 1
            rep.row([family, config, "-", f"ERROR {type(e).__name__}: {str(e)[:160]}"])
            traceback.print_exc(file=sys.stderr)

    for c in LOOKUPS:
        cfg = f"w{c.width} {c.dtype} {c.pooling} {'weighted' if c.weighted else 'unweighted'} h{c.hotness} {c.optimizer}"
        fixed = c.pooling == "concat"

        def data(c=c, fixed=fixed):
            torch.manual_seed(zlib.crc32(repr(c).encode()))
            weight = (torch.randn(rows, c.width, device=device) * 0.1).to(_dt(c.dtype))
            ids, offsets = _bags(batch, c.hotness, rows, fixed, device)
            pw = torch.rand(ids.numel(), device=device) if c.weighted else None
            return weight, ids, offsets, pw

        def fwd(c=c, data=data):
            weight, ids, offsets, pw = data()
            if c.pooling != "concat" or getattr(cand, "name", "") == "cuda":
                got = cand.pooled_forward(weight, ids, offsets, pw, c.pooling)
            else:  # the torch path has no concat mode: the self-test compares it with itself
                one = torch.arange(ids.numel() + 1, device=device)
                got = cand.pooled_forward(weight, ids, one, pw, "sum").reshape(batch, -1)
            if c.pooling == "concat":
                flat = ref.pooled_forward(
                    weight, ids, torch.arange(ids.numel() + 1, device=device), pw, "sum"
                )
                want = flat.reshape(offsets.numel() - 1, -1)
            else:
                want = ref.pooled_forward(weight, ids, offsets, pw, c.pooling)
            return _err(got, want), TOL["fp32"]

        record("pooled_forward", cfg, fwd)
        if c.pooling == "concat":
            # the runtime pools concat features as sums of one-id bags
            continue

        def bwd(c=c, data=data):
            weight, ids, offsets, pw = data()
            grad = torch.randn(offsets.numel() - 1, c.width, device=device)
            u1, g1 = cand.pooled_backward(grad, ids, offsets, pw, c.pooling, rows)
            u0, g0 = ref.pooled_backward(grad, ids, offsets, pw, c.pooling, rows)
            if not torch.equal(u1.cpu(), u0.cpu()):
                return math.inf, 0.0
            return _err(g1, g0), TOL["fp32"]

        record("backward (row grads)", cfg, bwd)

        def upd(c=c, data=data):
            weight, ids, offsets, pw = data()
            uniq = torch.unique(ids)
            grads = torch.randn(uniq.numel(), c.width, device=device)
            st1 = _state(c.optimizer, rows, c.width, device)
            w1, st0, w0 = weight.clone(), {k: v.clone() for k, v in st1.items()}, weight.clone()
            cand.sparse_update(w1, st1, uniq, grads, c.optimizer, _params(c.optimizer))
            ref.sparse_update(w0, st0, uniq, grads, c.optimizer, _params(c.optimizer))
            errs = [_err(w1.float(), w0.float())] + [_err(st1[k], st0[k]) for k in st0]
            return max(errs), TOL[c.dtype]

        record("sparse_update", cfg, upd)

        def fused(c=c, data=data):
            weight, ids, offsets, pw = data()
            grad = torch.randn(offsets.numel() - 1, c.width, device=device)
            st1 = _state(c.optimizer, rows, c.width, device)
            w1, st0, w0 = weight.clone(), {k: v.clone() for k, v in st1.items()}, weight.clone()
            fn = getattr(cand, "pooled_backward_update", None)
            if fn is None:
                u, g = cand.pooled_backward(grad, ids, offsets, pw, c.pooling, rows)
                cand.sparse_update(w1, st1, u, g, c.optimizer, _params(c.optimizer))
            else:
                fn(w1, st1, grad, ids, offsets, pw, c.pooling, c.optimizer, _params(c.optimizer))
            u, g = ref.pooled_backward(grad, ids, offsets, pw, c.pooling, rows)
            ref.sparse_update(w0, st0, u, g, c.optimizer, _params(c.optimizer))
            errs = [_err(w1.float(), w0.float())] + [_err(st1[k], st0[k]) for k in st0]
            return max(errs), TOL[c.dtype]

        record("backward + fused update", cfg, fused)

        def pack(c=c, data=data):
            weight, ids, offsets, pw = data()
            index = ids[: max(1, ids.numel() // 2)]
            e1 = _err(
                cand.gather_rows(weight, index).float(), ref.gather_rows(weight, index).float()
            )
            buf = torch.randn(index.numel(), c.width, device=device)
            d1 = torch.randn(rows, c.width, device=device)
            d0 = d1.clone()
            cand.scatter_add_rows(d1, index, buf)
            ref.scatter_add_rows(d0, index, buf)
            return max(e1, _err(d1, d0)), TOL["fp32"]

        record("pack (gather / scatter-add)", cfg, pack)

    for key in (torch.int32, torch.int64):
        kname = str(key).removeprefix("torch.")

        def dedup(key=key):
            keys = (torch.rand(batch * 8, device=device) ** 4 * 1_000_000).long().to(key)
            u1, i1 = cand.dedup(keys)
            u0, i0 = ref.dedup(keys)
            same = torch.equal(u1.cpu().long(), u0.cpu().long()) and torch.equal(
                i1.cpu().long(), i0.cpu().long()
            )
            return (0.0 if same else math.inf), 0.0

        record("dedup", kname, dedup)
        for part in ("mod", "range"):
            for shards in (1, 3, 8, 64):

                def bucket(key=key, part=part, shards=shards):
                    table_rows = 1_000_003
                    keys = torch.randint(0, table_rows, (batch * 8 + 5,), device=device).to(key)
                    o1, c1, l1 = cand.bucketize(keys, table_rows, shards, part)
                    o0, c0, l0 = ref.bucketize(keys, table_rows, shards, part)
                    same = all(
                        torch.equal(a.cpu().long(), b.cpu().long())
                        for a, b in ((o1, o0), (c1, c0), (l1, l0))
                    )
                    return (0.0 if same else math.inf), 0.0

                record("bucketize", f"{kname} {part} R={shards}", bucket)
    rep.out()


# ----------------------------------------------------------------------------- timing


class Timer:
    """Seconds per call of fn(*args): the median over `iters` samples of `reps` calls
    back to back, timed by CUDA events on a GPU (so the host's launch overhead overlaps
    the device's work, as in a training loop) and by perf_counter on the CPU."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, *args, warmup: int = 3, iters: int = 7, reps: int = 10) -> float:
        import torch

        for _ in range(warmup):
            fn(*args)
        if self.cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    fn(*args)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3 / reps)
            else:
                t = time.perf_counter()
                for _ in range(reps):
                    fn(*args)
                times.append((time.perf_counter() - t) / reps)
        return statistics.median(times)


COPY_BYTES = {True: 16 << 20, False: 2 << 30}


def table_shape(small: bool) -> tuple[int, int]:
    """(rows, dim) of the timed table: 4M x 128 fp32 = 2 GB, 33x the L2 of an H200."""
    return (20_000, 128) if small else (4_000_000, 128)


def forward_bytes(ids, offsets, dim: int) -> int:
    """Bytes a pooled forward moves: rows read, ids, offsets, fp32 output."""
    batch = offsets.numel() - 1
    return ids.numel() * dim * 4 + ids.numel() * 8 + offsets.numel() * 8 + batch * dim * 4


def copy_bandwidth(timer: Timer, device, small: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of COPY_BYTES."""
    import torch

    n = COPY_BYTES[small]
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * n / timer(dst.copy_, src)


def time_all(rep: Report, cand, ref, device, small: bool) -> None:
    import torch

    timer = Timer(device)
    rep.out("## Bandwidth and speed")
    rep.out()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0)
        rep.out(
            f"Device: {props.name}, L2 {l2 / 2**20:.0f} MiB, {props.total_memory / 2**30:.0f} GiB"
        )
        rep.out()
    copy_bw = copy_bandwidth(timer, device, small)
    rep.out(
        f"Device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write of "
        f"{COPY_BYTES[small] >> 20} MiB)"
    )
    rep.out()
    rep.table(
        [
            "operation",
            "rows x dim",
            "batch x hotness",
            "time (ms)",
            "GB/s",
            "% of copy",
            "vs EmbeddingBag",
        ]
    )
    # plus 2 GB of adagrad state; uniform ids read every row from HBM
    rows, dim = table_shape(small)
    cases = (
        [(256, 8, False)] if small else [(65536, 8, False), (65536, 1, False), (16384, 64, False)]
    )
    cases.append((256, 8, True) if small else (65536, 8, True))
    weight = (torch.randn(rows, dim, device=device) * 0.01).float()
    bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True)
    bag = bag.to(device)
    with torch.no_grad():
        bag.weight.copy_(weight)
    state = {"sum": torch.zeros(rows, dim, device=device)}
    for batch, hot, skewed in cases:
        _time_case(rep, timer, cand, bag, weight, state, batch, hot, skewed, copy_bw, device)
    rep.out()
    rep.out(
        "Bytes of the forward: ids x dim x 4 (rows read) + ids x 8 + offsets + batch x dim x 4 "
        "(output); the target is >= 80% of the copy bandwidth at dim 128."
    )
    rep.out()


def _speedup(ours: float, theirs: float) -> str:
    return f"{theirs / ours:.2f}x faster" if ours < theirs else f"{ours / theirs:.2f}x slower"


def skewed_ids(n: int, rows: int, device):
    """n ids where P(id < x) = (x / rows)^(1/3): the hottest row draws (1 / rows)^(1/3)
    of them (0.6 % of 4M rows), a long tail of rows drawn once."""
    import torch

    return (torch.rand(n, device=device) ** 3 * rows).long().clamp_(max=rows - 1)


def fixed_bags(batch: int, hot: int, rows: int, skewed: bool, device):
    """(ids, offsets) of `batch` bags of exactly `hot` ids, uniform or skewed_ids."""
    import torch

    n = batch * hot
    ids = skewed_ids(n, rows, device) if skewed else torch.randint(0, rows, (n,), device=device)
    return ids, torch.arange(0, n + 1, hot, device=device)


def _time_case(rep, timer, cand, bag, weight, state, batch, hot, skewed, copy_bw, device) -> None:
    """The rows of the timing table for one (batch, hotness)."""
    import torch

    rows, dim = weight.shape
    params = _params("adagrad")
    ids, offsets = fixed_bags(batch, hot, rows, skewed, device)
    grad = torch.randn(batch, dim, device=device)
    moved = forward_bytes(ids, offsets, dim)
    size, shape = f"{rows} x {dim}", f"{batch} x {hot}{', skewed' if skewed else ''}"

    def bandwidth(t: float) -> list[str]:
        return [f"{t * 1e3:.3f}", f"{moved / t / 1e9:.0f}", f"{100 * moved / t / copy_bw:.0f}%"]

    def guarded(name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # one failing measurement must not hide the others
            rep.row([name, size, shape, "-", "-", "-", f"ERROR {type(e).__name__}: {str(e)[:120]}"])
            traceback.print_exc(file=sys.stderr)

    def forward() -> None:
        t_ours = timer(cand.pooled_forward, weight, ids, offsets, None, "sum")
        t_bag = timer(bag, ids, offsets)
        rep.row(["pooled forward (ours)", size, shape, *bandwidth(t_ours), _speedup(t_ours, t_bag)])
        rep.row(["EmbeddingBag forward", size, shape, *bandwidth(t_bag), "1.00x"])

    def train() -> None:
        fused = getattr(cand, "pooled_backward_update", None)

        def ours_backward() -> None:
            cand.pooled_forward(weight, ids, offsets, None, "sum")
            cand.pooled_backward(grad, ids, offsets, None, "sum", rows)

        padded = getattr(cand, "pooled_backward_padded", None)

        def ours_backward_padded() -> None:
            cand.pooled_forward(weight, ids, offsets, None, "sum")
            if padded is not None:
                padded(grad, ids, offsets, None, "sum", rows)
            else:
                cand.pooled_backward(grad, ids, offsets, None, "sum", rows)

        def ours_step() -> None:
            cand.pooled_forward(weight, ids, offsets, None, "sum")
            if fused is not None:
                fused(weight, state, grad, ids, offsets, None, "sum", "adagrad", params)
            else:
                u, g = cand.pooled_backward(grad, ids, offsets, None, "sum", rows)
                cand.sparse_update(weight, state, u, g, "adagrad", params)

        def bag_backward() -> None:
            bag.zero_grad(set_to_none=True)
            bag(ids, offsets).backward(grad)

        opt = torch.optim.Adagrad(bag.parameters(), lr=params.lr, eps=params.eps)

        def bag_step() -> None:
            opt.zero_grad(set_to_none=True)
            bag(ids, offsets).backward(grad)
            opt.step()

        pairs = [
            (
                "forward + backward to row gradients (ours)",
                ours_backward,
                "EmbeddingBag forward + backward (sparse gradient)",
                bag_backward,
            ),
            (
                "forward + backward to row gradients, counts on the device (ours, padded)",
                ours_backward_padded,
                "EmbeddingBag forward + backward (sparse gradient)",
                bag_backward,
            ),
            (
                "forward + backward + adagrad (ours, fused)",
                ours_step,
                "EmbeddingBag + torch.optim.Adagrad (sparse)",
                bag_step,
            ),
        ]
        for ours_name, ours, theirs_name, theirs in pairs:
            t_ours, t_bag = timer(ours), timer(theirs)
            rep.row(
                [ours_name, size, shape, f"{t_ours * 1e3:.3f}", "-", "-", _speedup(t_ours, t_bag)]
            )
            rep.row([theirs_name, size, shape, f"{t_bag * 1e3:.3f}", "-", "-", "1.00x"])

    def fbgemm() -> None:
        try:
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )
        except Exception:
            return  # not installed: nothing to compare with
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)],
            optimizer=EmbOptimType.EXACT_ADAGRAD,
            learning_rate=0.05,
            eps=1e-8,
        ).to(device)

        def step() -> None:
            tbe(ids, offsets).backward(grad)

        t_fwd, t_step = timer(tbe, ids, offsets), timer(step)
        rep.row(["FBGEMM TBE forward", size, shape, *bandwidth(t_fwd), "-"])
        rep.row(
            [
                "FBGEMM TBE forward + backward + adagrad",
                size,
                shape,
                f"{t_step * 1e3:.3f}",
                "-",
                "-",
                "-",
            ]
        )

    guarded("pooled forward", forward)
    if device.type == "cuda" or batch * hot <= 4096:
        guarded("forward + backward", train)
    if device.type == "cuda":
        guarded("FBGEMM TBE", fbgemm)


# ----------------------------------------------------------------------------- tune

TUNE_UNROLL = (1, 2, 4, 8)
TUNE_BLOCK = (128, 256)


def _variant(source: str, **constants: int) -> str:
    """The kernel source with some `constexpr int NAME = N;` constants changed."""
    for name, value in constants.items():
        source, n = re.subn(
            rf"constexpr int {name} = \d+;", f"constexpr int {name} = {value};", source, count=1
        )
        if n != 1:
            raise ValueError(f"no constant {name} in the kernel source")
    return source


_PLAIN_LOAD = "  pk.raw = *reinterpret_cast<const cfg::raw_t*>(p);\n"
_NC_LOAD = """  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(pk.raw.x), "=r"(pk.raw.y), "=r"(pk.raw.z), "=r"(pk.raw.w) : "l"(p));
"""
_IDS_ONE_BY_ONE = """  for (i64 i = start; i < end; i += cfg::UNROLL) {
    i64 row[cfg::UNROLL];
    float scale[cfg::UNROLL];
#pragma unroll
    for (int u = 0; u < cfg::UNROLL; ++u) {
      const bool present = i + u < end;
      row[u] = present ? (i64)rows[i + u] : -1;
      scale[u] = 1.0f;
    }
"""
_IDS_BY_THE_WARP = """  for (i64 base = start; base < end; base += 32) {
    const i64 mine = base + lane;
    const i64 my_row = mine < end ? (i64)rows[mine] : -1;
    const int n = end - base < 32 ? (int)(end - base) : 32;
    for (int j = 0; j < n; j += cfg::UNROLL) {
    i64 row[cfg::UNROLL];
    float scale[cfg::UNROLL];
#pragma unroll
    for (int u = 0; u < cfg::UNROLL; ++u) {
      const i64 r = __shfl_sync(0xffffffffu, my_row, (j + u) & 31);
      row[u] = j + u < n ? r : -1;
      scale[u] = 1.0f;
    }
"""
_LOOP_END = """      }
  }
#pragma unroll
  for (int c = 0; c < cfg::CHUNKS; ++c) {
    const int col = (lane + c * cfg::GROUP) * cfg::VEC;
    if (col < cfg::WIDTH) store_f32("""


def _edit(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise ValueError("the kernel source does not have the text this variant replaces")
    return source.replace(old, new)


def forward_variants(source: str) -> dict[str, str]:
    """Experimental sources of the w128 fp32 sum forward (one warp per bag): `nc` loads
    rows with ld.global.nc, no L1 allocation and a 256-byte L2 prefetch; `warp-ids` has
    the 32 lanes fetch 32 ids at once and shuffle them out, instead of every lane fetching
    every id (one dependent load per UNROLL ids instead of one per id); both."""
    nc = _edit(source, _PLAIN_LOAD, _NC_LOAD)
    end = _LOOP_END.replace("      }\n  }\n", "      }\n    }\n  }\n", 1)

    def warp(src: str) -> str:
        return _edit(_edit(src, _IDS_ONE_BY_ONE, _IDS_BY_THE_WARP), _LOOP_END, end)

    return {"templates": source, "nc": nc, "warp-ids": warp(source), "warp-ids + nc": warp(nc)}


_SEGMENT_LOOP = """  for (i64 k = seg[u]; k < seg_end; ++k) {
    const i64 occ = sorted_occ[k];
    const i64 bag = occ_bag[occ];
    float scale = 1.0f;
    const float* src = grad_out + bag * cfg::OUT_WIDTH;
#pragma unroll
    for (int c = 0; c < cfg::CHUNKS; ++c) {
      const int col = (lane + c * cfg::GROUP) * cfg::VEC;
      if (col < cfg::WIDTH) {
        float v[cfg::VEC];
        load_f32(src + col, v);
#pragma unroll
        for (int e = 0; e < cfg::VEC; ++e) g[c][e] += scale * v[e];
      }
    }
  }
"""
_SEGMENT_LOOP_UNROLLED = """  for (i64 k0 = seg[u]; k0 < seg_end; k0 += @N@) {
    i64 bagq[@N@];
#pragma unroll
    for (int q = 0; q < @N@; ++q) bagq[q] = k0 + q < seg_end ? occ_bag[sorted_occ[k0 + q]] : -1;
    float v[@N@][cfg::CHUNKS][cfg::VEC];
#pragma unroll
    for (int q = 0; q < @N@; ++q)
#pragma unroll
      for (int c = 0; c < cfg::CHUNKS; ++c) {
        const int col = (lane + c * cfg::GROUP) * cfg::VEC;
        if (bagq[q] >= 0 && col < cfg::WIDTH)
          load_f32(grad_out + bagq[q] * cfg::OUT_WIDTH + col, v[q][c]);
      }
#pragma unroll
    for (int q = 0; q < @N@; ++q)
#pragma unroll
      for (int c = 0; c < cfg::CHUNKS; ++c) {
        const int col = (lane + c * cfg::GROUP) * cfg::VEC;
        if (bagq[q] >= 0 && col < cfg::WIDTH)
#pragma unroll
          for (int e = 0; e < cfg::VEC; ++e) g[c][e] += v[q][c][e];
      }
  }
"""


_ROWS_PER_GROUP_BODY = """(
    const float* __restrict__ grad_out, const i64* __restrict__ offsets,
    const float* __restrict__ per_id_weights, const i64* __restrict__ occ_bag,
    const i64* __restrict__ sorted_occ, const i64* __restrict__ seg,
    const cfg::key_t* __restrict__ unique_rows, const i64* __restrict__ count,
    float* __restrict__ row_grads) {
  // @R@ distinct rows a group, their occurrences walked side by side: @R@ chains of
  // dependent loads in flight per lane instead of one
  const i64 gid = (i64)blockIdx.x * cfg::BLOCK + threadIdx.x;
  const i64 u0 = gid / cfg::GROUP * @R@;
  const int lane = (int)(gid % cfg::GROUP);
  const i64 num_unique = *count;
  if (u0 >= num_unique) return;
  float g[@R@][cfg::CHUNKS][cfg::VEC];
  i64 k[@R@], end[@R@];
#pragma unroll
  for (int r = 0; r < @R@; ++r) {
    const bool here = u0 + r < num_unique;
    k[r] = here ? seg[u0 + r] : 0;
    end[r] = here ? seg[u0 + r + 1] : 0;
#pragma unroll
    for (int c = 0; c < cfg::CHUNKS; ++c)
#pragma unroll
      for (int e = 0; e < cfg::VEC; ++e) g[r][c][e] = 0.0f;
  }
  bool more = true;
  while (more) {
    more = false;
    i64 bag[@R@];
#pragma unroll
    for (int r = 0; r < @R@; ++r) bag[r] = k[r] < end[r] ? occ_bag[sorted_occ[k[r]]] : -1;
    float v[@R@][cfg::CHUNKS][cfg::VEC];
#pragma unroll
    for (int r = 0; r < @R@; ++r)
#pragma unroll
      for (int c = 0; c < cfg::CHUNKS; ++c) {
        const int col = (lane + c * cfg::GROUP) * cfg::VEC;
        if (bag[r] >= 0 && col < cfg::WIDTH)
          load_f32(grad_out + bag[r] * cfg::OUT_WIDTH + col, v[r][c]);
      }
#pragma unroll
    for (int r = 0; r < @R@; ++r) {
      if (bag[r] < 0) continue;
#pragma unroll
      for (int c = 0; c < cfg::CHUNKS; ++c) {
        const int col = (lane + c * cfg::GROUP) * cfg::VEC;
        if (col < cfg::WIDTH)
#pragma unroll
          for (int e = 0; e < cfg::VEC; ++e) g[r][c][e] += v[r][c][e];
      }
      ++k[r];
      more = more || k[r] < end[r];
    }
  }
#pragma unroll
  for (int r = 0; r < @R@; ++r)
#pragma unroll
    for (int c = 0; c < cfg::CHUNKS; ++c) {
      const int col = (lane + c * cfg::GROUP) * cfg::VEC;
      if (u0 + r < num_unique && col < cfg::WIDTH)
        store_f32(row_grads + (u0 + r) * cfg::WIDTH + col, g[r][c]);
    }
}
"""


def _rows_per_group(source: str, rows: int) -> str:
    """The plain backward with `rows` distinct rows a thread group (see the body)."""
    m = re.compile(r"(embark_\w+)\(").search(source, source.find('extern "C"'))
    if 'extern "C"' not in source or m is None:
        raise ValueError("the kernel source has no entry point to replace")
    return source[: m.end(1)] + _ROWS_PER_GROUP_BODY.replace("@R@", str(rows))


def backward_variants(source: str) -> dict[str, tuple[str, int]]:
    """Experimental sources of the w128 fp32 sum unweighted backward, each with the
    distinct rows one thread group takes: the segment's occurrences N at a time with
    their gradient rows loaded together, or R rows a group walked side by side (both
    keep the templates' summation order)."""
    out = {"templates": (source, 1)}
    for n in (4, 8):
        out[f"unrolled {n}"] = (
            _edit(source, _SEGMENT_LOOP, _SEGMENT_LOOP_UNROLLED.replace("@N@", str(n))),
            1,
        )
    for r in (2, 4):
        out[f"{r} rows a group"] = (_rows_per_group(source, r), r)
    return out


def _check_and_time(rep: Report, timer: Timer, go, out, want) -> tuple[float, str, bool]:
    """Launch a variant once into `out` (poisoned by the caller), compare with `want`,
    then time it: (seconds a call, the check's cell, whether it passed; a failure is
    counted)."""
    go()
    err = _err(out, want)
    ok = err <= TOL["fp32"]
    rep.failed += 0 if ok else 1
    return timer(go), "ok" if ok else f"FAIL ({err:.2e})", ok


def tune_backward(rep: Report, cand, ref, device, small: bool, timer: Timer) -> None:
    """The row-gradient backward kernel alone (segments made beforehand), as the templates
    write it, unrolled, or with several rows a group; each with the bag of every
    occurrence looked up through the occurrence (as the runtime passes it) or gathered
    into sorted order beforehand."""
    import torch

    from embark_runtime.kernels import bag_of_ids

    rows, dim = table_shape(small)
    cases = [(256, 8, False), (256, 8, True)] if small else [(65536, 8, False), (65536, 8, True)]
    info = cand.index.backward(dim, "fp32", "sum", False, "int64", "none")
    source, entry = cand._read(info.file), info.entries[0]
    group = int(info.get("group"))
    variants = backward_variants(source)
    rep.out(f"Kernel {info.name}: the segments' time is apart, above")
    rep.out()
    rep.table(["batch x hotness", "variant", "bags", "time (ms)", "check"])
    for batch, hot, skewed in cases:
        ids, offsets = fixed_bags(batch, hot, rows, skewed, device)
        grad = torch.randn(batch, dim, device=device)
        segs = cand._segments(ids, rows)
        unique = segs.unique[: int(segs.count.item())]
        seg, sorted_occ, longest = segs.seg, segs.sorted_occ, int(segs.longest.item())
        occ_bag = bag_of_ids(offsets, ids.numel())
        sorted_bag = occ_bag[sorted_occ]
        identity = torch.arange(ids.numel(), device=device)
        _, want = ref.pooled_backward(grad, ids, offsets, None, "sum", rows)
        shape = f"{batch} x {hot}" + (f", skewed (longest segment {longest})" if skewed else "")
        for name, (src, per_group) in variants.items():
            for bags, (a, b) in (
                ("through the occurrence", (occ_bag, sorted_occ)),
                ("pre-sorted", (sorted_bag, identity)),
            ):
                try:
                    out = torch.full((unique.numel(), dim), float("nan"), device=device)
                    args = [
                        ("ptr", grad.data_ptr()),
                        ("ptr", offsets.data_ptr()),
                        ("ptr", 0),
                        ("ptr", a.data_ptr()),
                        ("ptr", b.data_ptr()),
                        ("ptr", seg.data_ptr()),
                        ("ptr", unique.data_ptr()),
                        ("ptr", segs.count.data_ptr()),
                        ("ptr", out.data_ptr()),
                    ]
                    groups = -(-unique.numel() // per_group)
                    blocks = -(-groups * group // int(info.get("block")))

                    def go(src=src, blocks=blocks, args=args) -> None:
                        cand.launcher.launch(src, entry, blocks, int(info.get("block")), 0, args)

                    t, check, _ = _check_and_time(rep, timer, go, out, want)
                    rep.row([shape, name, bags, f"{t * 1e3:.4f}", check])
                except Exception as e:
                    rep.failed += 1
                    rep.row([shape, name, bags, "-", f"ERROR {e!s:.120}"])
                    traceback.print_exc(file=sys.stderr)
    rep.out()


def tune_section(rep: Report, cand, ref, device, small: bool) -> None:
    """The pooled forward at dim 128 with other row loads in flight (UNROLL) and block
    sizes than the templates choose, and the parts of a training step timed apart: what
    a change of the templates would buy, measured before it is made."""
    import torch

    rep.out("## Tuning: forward variants and the parts of a training step")
    rep.out()
    launcher = getattr(cand, "launcher", None)
    if launcher is None:
        rep.out("(needs the generated kernels: not run on the torch path)")
        rep.out()
        return
    timer = Timer(device)
    copy_bw = copy_bandwidth(timer, device, small)
    rows, dim = table_shape(small)
    cases = [(256, 8)] if small else [(65536, 8), (65536, 1), (16384, 64)]
    weight = (torch.randn(rows, dim, device=device) * 0.01).float()
    info = cand.index.forward(dim, "fp32", "sum", False, "int64", 8)
    source, entry = cand._read(info.file), info.entries[0]
    group = int(info.get("group"))
    rep.out(
        f"Kernel {info.name} (templates: UNROLL {info.get('hotness')}, BLOCK {info.get('block')})"
    )
    rep.out()
    variants = forward_variants(source)
    grid = [("templates", u, b) for u in TUNE_UNROLL for b in TUNE_BLOCK]
    grid += [(v, u, 256) for v in list(variants)[1:] for u in (2, 4, 8)]
    rep.table(
        ["batch x hotness", "variant", "UNROLL", "BLOCK", "time (ms)", "GB/s", "% of copy", "check"]
    )
    for batch, hot in cases:
        ids, offsets = fixed_bags(batch, hot, rows, False, device)
        want = ref.pooled_forward(weight, ids, offsets, None, "sum")
        moved = forward_bytes(ids, offsets, dim)
        best = None
        for gather in ("torch index_select", "ours (pack gather)"):
            # a ceiling for reads of random rows: gather them into a dense buffer
            fn = (
                (lambda ids=ids: torch.index_select(weight, 0, ids))
                if gather.startswith("torch")
                else (lambda ids=ids: cand.gather_rows(weight, ids))
            )
            try:
                t = timer(fn)
                g_moved = 2 * ids.numel() * dim * 4 + ids.numel() * 8
                rep.row(
                    [
                        f"{batch} x {hot}",
                        f"gather of the rows, {gather}",
                        "-",
                        "-",
                        f"{t * 1e3:.4f}",
                        f"{g_moved / t / 1e9:.0f}",
                        f"{100 * g_moved / t / copy_bw:.0f}%",
                        "",
                    ]
                )
            except Exception as e:
                rep.failed += 1
                rep.row([f"{batch} x {hot}", gather, "-", "-", "-", "-", "-", f"ERROR {e!s:.120}"])
        for name, unroll, block in grid:
            try:
                src = _variant(variants[name], UNROLL=unroll, BLOCK=block)
                out = torch.full((batch, dim), float("nan"), device=device)
                args = [
                    ("ptr", weight.data_ptr()),
                    ("ptr", ids.data_ptr()),
                    ("ptr", offsets.data_ptr()),
                    ("ptr", 0),
                    ("ptr", out.data_ptr()),
                    ("i64", batch),
                ]
                blocks = -(-batch * group // block)

                def go(src=src, blocks=blocks, block=block, args=args) -> None:
                    launcher.launch(src, entry, blocks, block, 0, args)

                t, check, ok = _check_and_time(rep, timer, go, out, want)
                if ok and (best is None or t < best[0]):
                    best = (t, f"{name}, UNROLL {unroll}, BLOCK {block}")
                rep.row(
                    [
                        f"{batch} x {hot}",
                        name,
                        unroll,
                        block,
                        f"{t * 1e3:.4f}",
                        f"{moved / t / 1e9:.0f}",
                        f"{100 * moved / t / copy_bw:.0f}%",
                        check,
                    ]
                )
            except Exception as e:  # one variant failing must not hide the others
                rep.failed += 1
                rep.row(
                    [f"{batch} x {hot}", name, unroll, block, "-", "-", "-", f"ERROR {e!s:.120}"]
                )
                traceback.print_exc(file=sys.stderr)
        if best is not None:
            rep.out(
                f"| best for {batch} x {hot} | {best[1]} | | | {best[0] * 1e3:.4f} | "
                f"{moved / best[0] / 1e9:.0f} | {100 * moved / best[0] / copy_bw:.0f}% | |"
            )
    rep.out()
    tune_backward(rep, cand, ref, device, small, timer)
    # the parts of the training step that time_all measures as a whole
    batch, hot = cases[0]
    rep.table([f"part of a training step ({rows} x {dim}, {batch} x {hot})", "time (ms)"])
    ids, offsets = fixed_bags(batch, hot, rows, False, device)
    grad = torch.randn(batch, dim, device=device)
    state = {"sum": torch.zeros(rows, dim, device=device)}
    params = _params("adagrad")
    bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True)
    bag = bag.to(device)

    def bag_backward() -> None:
        bag.zero_grad(set_to_none=True)
        out.backward(grad, retain_graph=True)

    out = bag(ids, offsets)
    parts = [
        ("ours: forward", lambda: cand.pooled_forward(weight, ids, offsets, None, "sum")),
        (
            "ours: sort into segments (torch.sort, counts on the device)",
            lambda: cand._segments(ids, rows),
        ),
        (
            "ours: segments + fused backward/adagrad kernel",
            lambda: cand.pooled_backward_update(
                weight, state, grad, ids, offsets, None, "sum", "adagrad", params
            ),
        ),
        ("EmbeddingBag: forward", lambda: bag(ids, offsets)),
        ("EmbeddingBag: backward (sparse)", bag_backward),
    ]
    for name, fn in parts:
        try:
            rep.row([name, f"{timer(fn) * 1e3:.4f}"])
        except Exception as e:
            rep.failed += 1
            rep.row([name, f"ERROR {e!s:.120}"])
            traceback.print_exc(file=sys.stderr)
    rep.out()


# ----------------------------------------------------------------------------- trainer


def trainer_section(rep: Report, device: str, steps: int = 30) -> None:
    """bench/gpu/trainer_check.py's checks, into the report (a check that cannot run is
    said so, and counted as failed: the script is meant to run them all)."""
    spec = importlib.util.spec_from_file_location("trainer_check", HERE / "trainer_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trainer_check"] = mod
    spec.loader.exec_module(mod)
    rep.out("## The generated trainer on the device")
    rep.out()
    try:
        lines, failed = mod.run_checks(device, steps)
    except mod.CannotRun as e:
        rep.out(f"**not run**: {e}")
        rep.failed += 1
        rep.out()
        return
    except Exception:  # the section is guarded like the others: report, go on
        rep.out("**FAILED** with an exception:")
        rep.out("```")
        rep.out(traceback.format_exc().rstrip())
        rep.out("```")
        rep.failed += 1
        rep.out()
        return
    for line in lines:
        rep.out(line)
    rep.failed += failed
    rep.out()


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--allow-no-gpu",
        action="store_true",
        help="without a CUDA device, render the kernels and exit 0",
    )
    ap.add_argument(
        "--self-test-cpu",
        action="store_true",
        help="run the harness on the CPU with the torch path (tests only)",
    )
    ap.add_argument(
        "--sections",
        default="check,time,tune,trainer",
        help="comma-separated: check,time,tune,trainer",
    )
    ap.add_argument("--out", type=Path, help="also write the markdown report here")
    ap.add_argument(
        "--write-snapshot",
        action="store_true",
        help="rewrite tests/snapshots/bench_kernels from the templates and exit",
    )
    args = ap.parse_args(argv)
    _bootstrap()
    if args.write_snapshot:
        write_snapshot()
        return 0
    started = time.time()
    try:
        import torch
    except ImportError:
        print("bench/gpu: torch is not installed", file=sys.stderr)
        return 2
    sources, origin = load_sources()
    kernels_in = json.loads(sources["kernels/manifest.json"])["kernels"]
    try:
        rep = Report(args.out)
    except OSError as e:
        print(f"bench/gpu: cannot write --out {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    rep.out("# embarkc generated CUDA kernels: GPU check and benchmark")
    rep.out()
    rep.out(f"{len(kernels_in)} kernel instantiations ({origin}); torch {torch.__version__}")
    rep.out()
    from embark_runtime.kernels import TorchKernels

    ref = TorchKernels()
    if args.self_test_cpu:
        device = torch.device("cpu")
        cand: Any = TorchKernels()
        small = True
    else:
        if not torch.cuda.is_available():
            print(
                "no CUDA device: the GPU check and benchmark need one (torch.cuda.is_available() "
                "is False)",
                file=sys.stderr,
            )
            return 0 if args.allow_no_gpu else 2
        try:
            import cupy

            rep.out(f"cupy {cupy.__version__}, device {torch.cuda.get_device_name()}")
            rep.out()
        except ImportError:
            print(
                "bench/gpu: cupy is not installed (cupy-cuda12x or cupy-cuda13x)", file=sys.stderr
            )
            return 2
        from embark_runtime.cuda_kernels import CudaKernels

        device = torch.device("cuda", torch.cuda.current_device())
        cand = CudaKernels(sources=sources, device=device, verify=False, poison=True)
        small = False
    sections = set(args.sections.split(","))
    if "check" in sections:
        check_all(rep, cand, ref, device, small)
    if "time" in sections:
        if hasattr(cand, "poison"):
            cand.poison = False  # timings without the NaN fills
        time_all(rep, cand, ref, device, small)
    if "tune" in sections:
        if hasattr(cand, "poison"):
            cand.poison = False
        tune_section(rep, cand, ref, device, small)
    if "trainer" in sections:
        trainer_section(rep, "cpu" if args.self_test_cpu else "cuda")
    fallbacks = getattr(cand, "fallbacks", {})
    if fallbacks:
        rep.out(
            "Calls that fell back to the torch path: "
            + "; ".join(f"{k} (x{v})" for k, v in sorted(fallbacks.items()))
        )
        rep.out()
    rep.out(
        f"{'FAILED: ' + str(rep.failed) + ' checks' if rep.failed else 'all checks passed'}; "
        f"{time.time() - started:.0f} s"
    )
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
