"""`embarkc calibrate`: microbenchmarks of the machine it runs on, written as a `hardware`
block whose every measured value carries a comment (what, how, when).

What is measured, and which field of the hardware block it sets:

* `hbm_bandwidth`: the device memory's copy rate (one large tensor copied into another,
  read plus written bytes over the best time).
* `hbm_efficiency`, `kernel_launch`: pooled lookups over a grid of dims, hotness, row
  counts and dtypes, through what the trainer would run them with: on CUDA the generated
  pooled_forward kernels (rendered for the grid by the compiler's codegen, loaded by
  `CudaKernels`, timed with CUDA events), on the CPU `TorchKernels.pooled_forward`
  (perf_counter). The per-call overhead is the time of a lookup of one id; the
  lookups' bytes (as the cost model counts them: a key and at least `min_read` bytes of
  row per id, a pooled vector per bag) over their time less that overhead give the
  lookup bandwidth, and its share of the copy rate is the efficiency (at most 1: small
  tables that sit in a CPU cache read faster than memory).
* `dense_flops`, `dense_efficiency`: the best rate of a large square fp32 matmul (the
  trainer computes the dense part in fp32), and the share of it the model's own dense
  part (runtime/dense.py's `DLRMDense`, forward and backward at the spec's samples per
  GPU) reaches, its FLOPs counted as `embarkc.dense` counts them.
* Under torchrun with several processes: the all-to-all of `embark_runtime.comm.Comm`
  (the trainer's collective) inside a node (`nvlink`, `collective_latency`) and, with
  several nodes, on the rails across nodes (`network`, `network_latency`): the time of
  exchanges of several sizes fitted to `latency + bytes sent per rank / bandwidth`. The
  measured rate is the collective's own, so the file sets the efficiency of the link to 1.

The topology's shape (nodes, GPUs per node, memory per GPU, arch) is not measured: it
comes from `--spec` (the spec whose hardware block the file replaces) or, without one,
from the job (torchrun's LOCAL_WORLD_SIZE and WORLD_SIZE, the device's memory).
`render` (no torch) turns the measurements into the file's text; `measure` (torch) runs
the benchmarks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from embarkc.planner import constants as K


@dataclass
class Value:
    """One field of the hardware block: its value in the spec's syntax and the comment
    that says where it came from."""

    text: str
    comment: str


@dataclass
class Calibration:
    """What `measure` found: the fields of the hardware block in the order written."""

    where: str
    """The machine, in words (device, processes)."""
    when: str
    fields: dict[str, Value] = field(default_factory=dict)
    lookups: list[dict[str, float]] = field(default_factory=list)
    """Every lookup measured (dim, hotness, rows, dtype bytes, bytes, seconds), for the
    file's trailing table."""


def _g(v: float) -> str:
    """A number as the spec writes it: 4 significant digits, no exponent below 1e-4."""
    return f"{v:.4g}"


def rate_text(bytes_per_second: float) -> str:
    """A bandwidth in the language's units (`12.3 GB/s`)."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_second >= scale:
            return f"{_g(bytes_per_second / scale)} {unit}"
    return f"{_g(max(bytes_per_second, 1.0))} B/s"


def flops_text(flops: float) -> str:
    """A compute rate in the language's units (`1.2 TFLOP/s`)."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if flops >= scale:
            return f"{_g(flops / scale)} {unit}"
    return f"{_g(max(flops, 1.0))} FLOP/s"


def time_text(seconds: float) -> str:
    """A time in the language's units: microseconds below a millisecond, else ms."""
    if seconds < 1e-3:
        return f"{_g(max(seconds, 1e-9) * 1e6)} us"
    return f"{_g(seconds * 1e3)} ms"


def size_text(nbytes: int) -> str:
    """A memory size in whole MiB or GiB (the language's binary units)."""
    if nbytes >= 1 << 30 and nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30} GiB"
    if nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes} B"


def render(cal: Calibration) -> str:
    """The text of the hardware file: a header saying what and when, the block with one
    comment per field, and the lookups it was fitted from (as comments)."""
    lines = [
        f"# Written by `embarkc calibrate` on {cal.when} ({cal.where}).",
        '# Include it in a spec (`include "hardware/NAME.embark"`) in place of its',
        "# `hardware` block; every value says what was measured and how (docs/measure.md).",
        "",
        "hardware {",
    ]
    width = max(len(k) + 1 + len(v.text) for k, v in cal.fields.items())
    for key, v in cal.fields.items():
        stmt = f"{key} {v.text}"
        lines.append(f"  {stmt.ljust(width)}  # {v.comment}")
    lines.append("}")
    if cal.lookups:
        lines += ["", "# lookups measured (dim, hotness, rows, bytes per element: GB/s):"]
        for m in cal.lookups:
            lines.append(
                f"#   dim {int(m['dim'])} hotness {int(m['hotness'])} rows {int(m['rows'])}"
                f" elem {int(m['elem'])}: {m['bytes'] / m['seconds'] / 1e9:.3f} GB/s"
                f" ({m['seconds'] * 1e6:.1f} us)"
            )
    return "\n".join(lines) + "\n"


def lookup_bytes(bags: int, hotness: int, dim: int, elem: int) -> float:
    """Bytes of one pooled forward as the cost model counts them: per id a key and the
    row (at least `min_read` bytes), per bag the fp32 pooled vector written."""
    ids = bags * hotness
    return ids * (K.KEY_BYTES + max(dim * elem, K.SMALL_VECTOR_BYTES)) + bags * dim * 4


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares `y = a + b x` (a intercept, b slope), both kept non-negative."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    a = max(my - b * mx, 0.0)
    return a, b


# --------------------------------------------------------------------------- benchmarks


class Clock(Protocol):
    """Times one call of a benchmark on the device it runs on."""

    def seconds(self, fn: Callable[[], Any]) -> float: ...


@dataclass
class HostClock:
    """`perf_counter` around the call and `sync` (the CPU, or a device to wait for)."""

    sync: Callable[[], None] = lambda: None

    def seconds(self, fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


@dataclass
class EventClock:
    """CUDA events recorded on the current stream before and after the call, the end one
    waited for: the device's time of what the call enqueued, with the gaps the host leaves
    while it enqueues (a launch's overhead, when the stream has nothing else to run).
    `event` makes one timing event (`torch.cuda.Event(enable_timing=True)`)."""

    event: Callable[[], Any]

    def seconds(self, fn: Callable[[], Any]) -> float:
        start, end = self.event(), self.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def best_seconds(fn: Callable[[], Any], clock: Clock, repeats: int, budget: float) -> float:
    """The least time of one call of `fn` over `repeats` runs (after one warm-up, which
    also compiles and verifies a generated kernel), stopping early once `budget` seconds
    are spent."""
    clock.seconds(fn)
    best = math.inf
    spent = 0.0
    for _ in range(repeats):
        dt = clock.seconds(fn)
        best = min(best, dt)
        spent += dt
        if spent > budget:
            break
    return best


MAX_TABLE_BYTES = 128 << 20
"""The largest table a lookup benchmark allocates on the CPU (every process of a torchrun
job holds its own): larger than any CPU cache, small enough for a shared machine."""

MAX_TABLE_BYTES_CUDA = 1 << 30
"""The same on a GPU: far larger than its L2 cache, a small share of its memory."""


@dataclass(frozen=True)
class LookupPoint:
    """One pooled lookup the calibration times: `bags` sum-pooled bags of `hotness` ids
    into a table of `rows` x `dim` elements of `dtype` (fp32, fp16, bf16)."""

    rows: int
    dim: int
    hotness: int
    dtype: str
    bags: int

    @property
    def elem(self) -> int:
        return {"fp32": 4, "fp16": 2, "bf16": 2}[self.dtype]


OVERHEAD_POINT = LookupPoint(rows=16, dim=4, hotness=1, dtype="fp32", bags=1)
"""A lookup of one id: its time is the per-call overhead (`kernel_launch`)."""


def lookup_grid(quick: bool, cuda: bool) -> list[LookupPoint]:
    """The lookups measured for the bandwidth: dims x hotness x rows x dtypes, each table
    at most MAX_TABLE_BYTES (MAX_TABLE_BYTES_CUDA on a GPU). A GPU gets a batch's worth of
    bags (a kernel of a few thousand bags is all launch on it)."""
    dims = (16, 64) if quick else (8, 32, 128)
    hots = (1, 8) if quick else (1, 8, 64)
    rowss = (10_000,) if quick else (10_000, 1_000_000)
    dtypes = ("fp32",) if quick else ("fp32", "fp16")
    bags = 256 if quick else (65_536 if cuda else 2048)
    cap = MAX_TABLE_BYTES_CUDA if cuda else MAX_TABLE_BYTES
    out = []
    for rows in rowss:
        for dtype in dtypes:
            for dim in dims:
                for hot in hots:
                    p = LookupPoint(rows, dim, hot, dtype, bags)
                    if rows * dim * p.elem <= cap:
                        out.append(p)
    return out


def lookup_instantiations(points: Sequence[LookupPoint]) -> list[Any]:
    """The forward kernels that time `points`: for each, the pooled_forward instantiation
    the trainer's kernel set holds for a cell of that width and dtype read by a sum-pooled,
    unweighted feature of that hotness (`embarkc.codegen.cuda.lookup_instantiations`,
    where `kernel_instantiations` takes a plan's kernels from). Sorted, each once."""
    from embarkc.codegen import cuda

    found = set()
    for p in points:
        for inst in cuda.lookup_instantiations(p.dim, p.dtype, "sum", False, p.hotness, "sgd"):
            if inst.family == "pooled_forward":
                found.add(inst)
    return sorted(found)


def lookup_kernel_files(points: Sequence[LookupPoint], arch: str) -> dict[str, str]:
    """{path: source} of those kernels plus their manifest, rendered as `embarkc compile`
    renders a plan's (`render_instantiations`), for `arch`."""
    from embarkc.codegen import cuda

    return cuda.render_instantiations(lookup_instantiations(points), arch=arch)


def kernel_arch(major: int, minor: int) -> str:
    """The newest architecture the templates target that a device of compute capability
    major.minor runs (the manifest records it; cupy compiles for the device itself)."""
    from embarkc.codegen import cuda

    fits = [a for a in cuda.ARCH_TO_COMPUTE if int(a[3:]) <= major * 10 + minor]
    return max(fits, key=lambda a: int(a[3:])) if fits else min(cuda.ARCH_TO_COMPUTE)


def lookup_kernels(
    points: Sequence[LookupPoint], device: Any, launcher: Callable[[list[str]], Any] | None
) -> tuple[Any, str]:
    """The kernels the lookups are timed through, and how the file says it.

    On CUDA (or with `launcher`, which makes a `Launcher` from the kernels' sources: the
    tests' host emulation) the generated kernels: rendered for `points` and loaded by
    `embark_runtime.cuda_kernels.CudaKernels`, the class the compiled trainer trains with
    (NVRTC through cupy, each kernel's first call checked against the torch path). On the
    CPU, or where the generated kernels cannot load (no cupy), the torch path, as the
    trainer would fall back to it."""
    from embark_runtime.kernels import TorchKernels

    torch_path = "TorchKernels.pooled_forward, the trainer's CPU path"
    if device.type != "cuda" and launcher is None:
        return TorchKernels(), torch_path
    from embark_runtime.cuda_kernels import CudaKernels, CudaUnavailable

    arch = "sm_90"
    if device.type == "cuda":
        import torch

        arch = kernel_arch(*torch.cuda.get_device_capability(device))
    files = lookup_kernel_files(points, arch)
    n = sum(p.endswith(".cu") for p in files)
    try:
        if launcher is not None:
            sources = [t for p, t in sorted(files.items()) if p.endswith(".cu")]
            kern = CudaKernels(sources=files, device=device, launcher=launcher(sources))
        else:
            kern = CudaKernels(sources=files, device=device)
    except CudaUnavailable as e:
        return TorchKernels(), f"{torch_path} (the generated kernels do not load: {e})"
    how = "NVRTC through cupy" if launcher is None else "a host emulation"
    return kern, f"the generated pooled_forward kernels ({n}, {arch}, {how}, CudaKernels)"


def time_lookups(
    kern: Any,
    points: Sequence[LookupPoint],
    device: Any,
    clock: Clock,
    repeats: int,
    budget: float,
) -> list[dict[str, float]]:
    """Each point's best time through `kern.pooled_forward` (random ids, seed 0), with
    its bytes as the cost model counts them (`lookup_bytes`)."""
    import torch

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for p in points:
        weight = torch.empty(p.rows, p.dim, dtype=dtypes[p.dtype], device=device).uniform_()
        ids = torch.randint(0, p.rows, (p.bags * p.hotness,), generator=gen).to(device)
        offsets = torch.arange(0, p.bags * p.hotness + 1, p.hotness, device=device)

        def call(w: Any = weight, i: Any = ids, o: Any = offsets) -> Any:
            return kern.pooled_forward(w, i, o, None, "sum")

        t = best_seconds(call, clock, repeats, budget)
        out.append(
            {
                "dim": p.dim,
                "hotness": p.hotness,
                "rows": p.rows,
                "elem": p.elem,
                "bytes": lookup_bytes(p.bags, p.hotness, p.dim, p.elem),
                "seconds": t,
            }
        )
    return out


@dataclass
class Options:
    """What to measure: `quick` shrinks every grid and size (tests); `model` is the
    spec's dense model (a `DenseShape`) with its samples per GPU, or None for a generic
    DLRM-sized one; `shape` the topology fields copied from the spec, or None."""

    quick: bool = False
    model: Any = None
    samples: int = 0
    shape: dict[str, str] | None = None
    spec: str | None = None
    gpus_per_node: int = 0
    """Ranks a node groups under torchrun: the spec's (so that 4 processes of a 2 x 2
    spec measure its node and rail groups, as the trainer forms them), else the job's
    LOCAL_WORLD_SIZE."""
    launcher: Callable[[list[str]], Any] | None = None
    """Makes the `Launcher` of the generated kernels from their sources, in place of
    cupy's: with one, the lookups go through the generated kernels on the CPU (the tests
    pass tests/cuda_emulator.py's HostLauncher)."""


def measure(opts: Options) -> Calibration:
    """Run the benchmarks on this process's device (CUDA when available, else the CPU);
    under torchrun also the collectives. Every process of a torchrun job must call it."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    comm = None
    if distributed:
        comm = _join(cuda, opts.gpus_per_node)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    clock: Clock = EventClock(lambda: torch.cuda.Event(enable_timing=True)) if cuda else HostClock()
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    world = comm.world if comm is not None else 1
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cal = Calibration(where=f"{name}, {world} process{'es' if world > 1 else ''}", when=when)
    how = "torch " + torch.__version__
    f = cal.fields

    # ---- shape of the topology
    if opts.shape is not None:
        for key, text in opts.shape.items():
            f[key] = Value(text, f"from {opts.spec} (not measured)")
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        f["nodes"] = Value(str(max(1, world // local)), "the job's processes / LOCAL_WORLD_SIZE")
        f["gpus_per_node"] = Value(str(local), "torchrun's LOCAL_WORLD_SIZE (1 without torchrun)")
        if cuda:
            mem = torch.cuda.get_device_properties(device).total_memory
            f["hbm"] = Value(size_text(mem >> 20 << 20), f"{name}'s total memory")
        else:
            phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            share = (phys // max(local, 1)) >> 20 << 20
            f["hbm"] = Value(size_text(share), "the machine's memory / processes on it")

    # ---- memory copy rate
    n = (8 if opts.quick else 64) << 20
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src), clock, 5 if opts.quick else 20, 2.0)
    copy_rate = 2 * n / copy
    f["hbm_bandwidth"] = Value(
        rate_text(copy_rate),
        f"copy of a {n >> 20} MiB fp32 tensor, read + written bytes over the best of "
        f"several ({how})",
    )

    # ---- lookups
    points = lookup_grid(opts.quick, cuda)
    kern, via = lookup_kernels([OVERHEAD_POINT, *points], device, opts.launcher)
    repeats = 5 if opts.quick else 20
    (one,) = time_lookups(kern, [OVERHEAD_POINT], device, clock, repeats, 1.0)
    overhead = one["seconds"]
    cal.lookups = time_lookups(kern, points, device, clock, repeats, 1.0)
    fell = sum(getattr(kern, "fallbacks", {}).values())
    if fell:
        via += f"; {fell} calls fell back to the torch path: {dict(kern.fallbacks)}"
    f["kernel_launch"] = Value(
        time_text(overhead),
        f"a pooled lookup of one id through {via}, best of several "
        f"({'CUDA events' if cuda else 'perf_counter'}): the per-call overhead",
    )
    moved = sum(m["bytes"] for m in cal.lookups)
    spent = sum(max(m["seconds"] - overhead, 1e-9) for m in cal.lookups)
    lookup_rate = moved / spent
    dtypes = sorted({p.dtype for p in points})
    grid = (
        f"{len(points)} pooled lookups (dims {sorted({p.dim for p in points})}, hotness "
        f"{sorted({p.hotness for p in points})}, rows {sorted({p.rows for p in points})}, "
        f"{' and '.join(dtypes)}, {points[0].bags} bags, through the kernels above)"
    )
    if lookup_rate > copy_rate:
        # the lookups read tables a cache holds: the copy rate would overstate their time,
        # so the lookups' own rate is the bandwidth the cost model divides by
        f["hbm_bandwidth"] = Value(
            rate_text(lookup_rate),
            f"{grid}: bytes over time less the per-call overhead; above the "
            f"{rate_text(copy_rate)} copy of a {n >> 20} MiB tensor (cached reads) ({how})",
        )
        f["hbm_efficiency"] = Value("1", "the lookups' own rate is hbm_bandwidth")
    else:
        f["hbm_efficiency"] = Value(
            _g(lookup_rate / copy_rate),
            f"{grid}: {rate_text(lookup_rate)} less the per-call overhead, over hbm_bandwidth",
        )

    # ---- dense compute
    side = 512 if opts.quick else 2048
    a = torch.rand(side, side, device=device)
    b = torch.rand(side, side, device=device)
    mm = best_seconds(lambda: a @ b, clock, 3 if opts.quick else 10, 3.0)
    peak = 2 * side**3 / mm
    f["dense_flops"] = Value(
        flops_text(peak), f"fp32 matmul {side}x{side}x{side}, best of several ({how})"
    )
    rate, what = _dense_rate(opts, device, clock)
    f["dense_efficiency"] = Value(
        _g(min(1.0, max(rate / peak, 1e-4))),
        f"{what} at {flops_text(rate)}, over dense_flops",
    )

    # ---- collectives
    if comm is not None:
        # the ranks' benchmarks above take different times on a shared machine
        comm.barrier()
        _collectives(comm, opts, clock, device, f)
    else:
        f["nvlink"] = Value(
            rate_text(copy_rate),
            "no collective measured (one process): the memory copy rate; run under "
            "`torchrun --nproc-per-node N` to measure the all-to-all",
        )
        f["network"] = Value(
            rate_text(copy_rate), "no collective measured (one process): as nvlink"
        )
    if "arch" not in f:
        arch = "sm_90"
        if cuda:
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}"
        f["arch"] = Value(arch, "the device's compute capability" if cuda else "no GPU: default")
    return cal


def _dense_rate(opts: Options, device: Any, clock: Clock) -> tuple[float, str]:
    """FLOP/s of the dense part's forward and backward (the spec's model, or a
    DLRM-sized one), and a description of what ran."""
    import torch

    from embark_runtime.dense import DenseConfig, DLRMDense
    from embarkc.dense import DenseShape

    shape = opts.model
    samples = opts.samples
    if shape is None:
        shape = DenseShape(13, (512, 256, 64), "dot", (512, 256, 1), (64,) * 26)
        samples = 512 if opts.quick else 4096
        what = f"a DLRM dense part (bottom 512-256-64, dot of 26 features, top 512-256-1), {samples} samples"
    else:
        what = f"the spec's dense part at its {samples} samples per GPU, forward + backward"
    model = DLRMDense(
        DenseConfig(
            dense_features=shape.dense_features,
            bottom_mlp=shape.bottom_mlp,
            interaction=shape.interaction,
            top_mlp=shape.top_mlp,
            feature_widths=shape.feature_widths,
            cross_layers=shape.cross_layers,
            low_rank=shape.low_rank,
        )
    ).to(device)
    dense = torch.rand(samples, shape.dense_features, device=device)
    emb = [torch.rand(samples, w, device=device, requires_grad=True) for w in shape.feature_widths]

    def step() -> None:
        out = model(dense, emb)
        out.sum().backward()

    t = best_seconds(step, clock, 3 if opts.quick else 10, 3.0)
    bottom, rest = shape.forward_flops()
    flops = (bottom + rest) * (1 + K.BACKWARD_FLOPS_FACTOR) * samples
    return flops / t, what


def _join(cuda: bool, gpus_per_node: int) -> Any:
    """This process's `Comm` over the torchrun job, `gpus_per_node` ranks a node (0: the
    job's LOCAL_WORLD_SIZE)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from embark_runtime.comm import Comm

    if not dist.is_initialized():
        # generous: on a busy machine one rank's benchmarks can end minutes after another's
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=1800))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    local = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    comm = Comm.create(local, device="cuda" if cuda else "cpu")
    assert comm is not None
    return comm


def _collectives(comm: Any, opts: Options, clock: Clock, device: Any, f: dict[str, Value]) -> None:
    """All-to-all inside the node and (several nodes) on the rails: latency and bandwidth
    fitted over message sizes; the slowest rank's time counts (a collective ends for all
    when its slowest member ends)."""
    import torch
    import torch.distributed as dist

    sizes = (1 << 10, 1 << 16, 1 << 20) if opts.quick else tuple(1 << s for s in range(10, 25, 2))

    def fit(scope: str) -> tuple[float, float] | None:
        peers = comm.peers(scope)
        p = len(peers)
        if p < 2:
            return None
        xs, ys = [], []
        for size in sizes:
            per = size // 4
            chunks = [torch.ones(per, device=device) for _ in range(p)]

            def exchange(chunks: list[Any] = chunks, per: int = per) -> None:
                comm.all_to_all(chunks, [per] * p, scope=scope)

            t = best_seconds(
                exchange,
                clock,
                5 if opts.quick else 20,
                2.0,
            )
            worst = torch.tensor([t], dtype=torch.float64)
            if device.type == "cuda":
                worst = worst.to(device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            xs.append(float(size * (p - 1)))
            ys.append(float(worst.item()))
        lat, inv = fit_line(xs, ys)
        return lat, (1.0 / inv if inv > 0 else max(xs) / max(min(ys), 1e-9))

    sizes_text = f"{sizes[0]} B to {sizes[-1] >> 10} KiB"
    node = fit("node")
    if node is not None:
        lat, bw = node
        f["nvlink"] = Value(
            rate_text(bw),
            f"Comm.all_to_all inside a node ({len(comm.peers('node'))} ranks, {sizes_text} a "
            "peer): bytes sent per rank over time, fitted",
        )
        f["nvlink_efficiency"] = Value("1", "the all-to-all's own rate is measured")
        f["collective_latency"] = Value(
            time_text(max(lat, 1e-7)), "the all-to-all's fixed time (the fit's intercept)"
        )
    rail = fit("rail") if comm.nodes > 1 else None
    if rail is not None:
        lat_r, bw_r = rail
        f["network"] = Value(
            rate_text(bw_r),
            f"Comm.all_to_all on a rail across {comm.nodes} nodes ({sizes_text} a peer), fitted",
        )
        f["network_efficiency"] = Value("1", "the all-to-all's own rate is measured")
        base = node[0] if node is not None else 0.0
        f["network_latency"] = Value(
            time_text(max(lat_r - base, 1e-7)),
            "the rail all-to-all's fixed time beyond the in-node one",
        )
    else:
        nv = f.get("nvlink")
        f["network"] = Value(
            nv.text if nv is not None else "1 GB/s",
            "one node: no network measured (as nvlink)",
        )


def with_hardware(spec_text: str, include: str) -> str:
    """`spec_text` with its `hardware` block replaced by `include "INCLUDE"` (a calibrated
    file); the hardware block holds no nested braces, so its closing brace ends it."""
    import re

    found = re.search(r"(?m)^[ \t]*hardware\s*\{[^}]*\}", spec_text)
    if found is None:
        raise ValueError("the spec has no hardware block of its own")
    return spec_text[: found.start()] + f'include "{include}"' + spec_text[found.end() :]
