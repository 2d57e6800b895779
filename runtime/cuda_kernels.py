"""The `Kernels` interface on CUDA tensors, with the kernels `embarkc compile` generated.

`CudaKernels(kernel_dir)` reads `kernel_dir/manifest.json` (written by
`embarkc.codegen.cuda.render_kernels`; this module never imports the compiler), compiles
each kernel with NVRTC through cupy the first time it is needed (cached in memory by the
sha256 of its source, and on disk by cupy's own kernel cache), and launches it on torch's
current stream with the tensors' device pointers.

The torch path (`embark_runtime.kernels.TorchKernels`) is the checked fallback:
* a call the generated kernels cannot serve (no instantiation for that width / dtype /
  pooling / optimizer, CPU tensors, int32 keys without an int32 kernel, too many row shards
  for the bucketize kernel's shared memory) goes to the torch path, and the reason is
  counted in `fallbacks`;
* with `verify=True` (the default) the first call of every kernel entry is also computed
  by the torch path and compared (exactly for permutations and copies, within a tolerance
  for the dtype for arithmetic); a disagreement raises `KernelMismatchError` rather than
  training on wrong numbers.

Waits for the device: the forward and the fused backward + update (the training step of a
table) never wait after their first, verified call: the sort into segments sizes every
buffer by the ids' count and keeps the counts on the device, and the kernels read them
from device memory (see `Segments`, `_backward_launch`); rows outside the table are said
at the next `check_rows`. `pooled_backward_padded` gives row gradients the same way;
`sparse_update_padded` updates the first rows of a buffer, their count on the device;
`pooled_backward` and `dedup` wait once, for the size of their results. tests/
test_cuda_syncs.py counts the waits under the emulator.

`kernels_for(kernel_dir, device)` picks CudaKernels when CUDA, cupy and the kernels are
there, and TorchKernels otherwise, with a sentence saying which and why.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from embark_runtime.kernels import Kernels, OptimizerParamsLike, TorchKernels, bag_of_ids
from embark_runtime.optimizers import OPTIMIZERS

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "embark-kernels"
SPLIT_MIN = 32
"""Occurrences of one row that one thread group sums alone in the backward (beyond, the
sums take two passes: see CudaKernels._backward_launch)."""
SHARED_MEMORY_LIMIT = 48 * 1024
"""Dynamic shared memory a kernel may use without opting in (bucketize's counters)."""

TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
KEY_NAMES = {torch.int64: "int64", torch.int32: "int32"}
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}
"""Relative tolerance of the verification, by the dtype results are stored in."""


class CudaUnavailable(RuntimeError):
    """The CUDA kernels cannot be used here (no GPU, no cupy, no manifest)."""


class KernelMismatchError(RuntimeError):
    """A generated kernel disagrees with the torch path on the same inputs."""


@dataclass(frozen=True)
class KernelInfo:
    """One instantiation of the manifest."""

    name: str
    family: str
    file: str
    entries: tuple[str, ...]
    constants: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.constants.get(key, default)


class KernelIndex:
    """The manifest's instantiations, looked up by what a call needs (no CUDA involved)."""

    def __init__(self, manifest: Mapping[str, Any], where: str = MANIFEST):
        if (
            not isinstance(manifest, Mapping)
            or manifest.get("format") != MANIFEST_FORMAT
            or manifest.get("version") != 1
        ):
            raise CudaUnavailable(
                f"{where}: not an embark-kernels version 1 manifest; recompile the spec "
                "with this embarkc"
            )
        self.arch: str = str(manifest.get("arch", ""))
        self.kernels: list[KernelInfo] = []
        self._found: dict[tuple[Any, ...], list[KernelInfo]] = {}
        kernels = manifest.get("kernels", [])
        for i, k in enumerate(kernels if isinstance(kernels, list) else [kernels]):
            # a damaged or hand-edited manifest: said, not a crash at the first lookup
            ok = (
                isinstance(k, Mapping)
                and all(isinstance(k.get(f), str) for f in ("name", "family", "file"))
                and isinstance(k.get("entries"), list)
                and all(isinstance(e, str) for e in k["entries"])
                and isinstance(k.get("constants"), Mapping)
            )
            if not ok:
                raise CudaUnavailable(
                    f"{where}: damaged manifest: `kernels[{i}]` is not an instantiation "
                    "(name, family, file, entries, constants); recompile the spec with "
                    "embarkc compile"
                )
            self.kernels.append(
                KernelInfo(k["name"], k["family"], k["file"], tuple(k["entries"]), k["constants"])
            )

    def _match(self, family: str, **want: Any) -> list[KernelInfo]:
        # memoized: every launch looks its kernel up, and a scan of the manifest costs
        # tens of microseconds of Python per call
        key = (family, *sorted(want.items()))
        found = self._found.get(key)
        if found is None:
            found = [
                k
                for k in self.kernels
                if k.family == family and all(k.get(name) == v for name, v in want.items())
            ]
            self._found[key] = found
        return found

    def forward(
        self, width: int, dtype: str, pooling: str, weighted: bool, key: str, mean_hotness: float
    ) -> KernelInfo | None:
        """The forward kernel for these bags. Any sum/mean instantiation is correct (its
        hotness only sets the loads in flight): take the one closest to the bags' mean
        length. A concat kernel must match the bag size exactly."""
        found = self._match(
            "pooled_forward", width=width, dtype=dtype, pooling=pooling, weighted=weighted, key=key
        )
        if pooling == "concat":
            exact = [k for k in found if k.get("hotness") == round(mean_hotness)]
            return exact[0] if exact else None
        if not found:
            return None
        return min(found, key=lambda k: (abs(k.get("hotness") - mean_hotness), -k.get("hotness")))

    def backward(
        self,
        width: int,
        dtype: str,
        pooling: str,
        weighted: bool,
        key: str,
        optimizer: str,
        hotness: int = 0,
    ) -> KernelInfo | None:
        found = self._match(
            "backward_update",
            width=width,
            dtype=dtype,
            pooling=pooling,
            weighted=weighted,
            key=key,
            optimizer=optimizer,
            hotness=hotness if pooling == "concat" else 0,
        )
        return found[0] if found else None

    def update(self, width: int, dtype: str, optimizer: str, key: str) -> KernelInfo | None:
        found = self._match("sparse_update", width=width, dtype=dtype, optimizer=optimizer, key=key)
        return found[0] if found else None

    def pack(self, width: int, dtype: str, key: str) -> KernelInfo | None:
        found = self._match("pack", width=width, dtype=dtype, key=key)
        return found[0] if found else None

    def dedup(self, key: str) -> KernelInfo | None:
        found = self._match("dedup", key=key)
        return found[0] if found else None

    def bucketize(self, key: str, partition: str) -> KernelInfo | None:
        found = self._match("bucketize", key=key, partition=partition)
        return found[0] if found else None


class Launcher(Protocol):
    """Compiles kernel sources and launches their entries (CUDA through cupy, or a host
    emulation in the tests)."""

    compiled: int

    def launch(
        self,
        source: str,
        entry: str,
        grid: int,
        block: int,
        shared: int,
        args: list[tuple[str, int | float]],
    ) -> None: ...


_NUMPY_KINDS = {"ptr": np.uint64, "i64": np.int64, "f32": np.float32, "f64": np.float64}
"""numpy scalar type of each kernel argument kind, as cupy passes them."""


class CupyLauncher:
    """NVRTC through cupy; modules cached by the sha256 of their source (and on disk by
    cupy's kernel cache); launches on torch's current stream of `device`."""

    def __init__(self, device: torch.device):
        import cupy

        self.cupy = cupy
        self.device = device
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._streams: dict[int, Any] = {}

    @property
    def compiled(self) -> int:
        return len(self._modules)

    def launch(self, source, entry, grid, block, shared, args) -> None:
        # keyed by the text itself: a str caches its hash, so a launch does not hash the
        # source again (CudaKernels reads each file once)
        fn = self._functions.get((source, entry))
        if fn is None:
            digest = hashlib.sha256(source.encode()).hexdigest()
            module = self._modules.get(digest)
            if module is None:
                with self.cupy.cuda.Device(self.device.index):
                    # cupy adds -arch for the present device
                    module = self.cupy.RawModule(code=source, options=("--std=c++17",))
                    module.compile()
                self._modules[digest] = module
            fn = module.get_function(entry)
            self._functions[(source, entry)] = fn
        packed = tuple(_NUMPY_KINDS[kind](value) for kind, value in args)
        with self.cupy.cuda.Device(self.device.index), self._stream():
            fn((grid,), (block,), packed, shared_mem=shared)

    def _stream(self) -> Any:
        """cupy's view of torch's current stream, made once per stream (a launch costs
        microseconds of Python, which count where a sync leaves the GPU waiting)."""
        current = torch.cuda.current_stream(self.device)
        stream = self._streams.get(current.cuda_stream)
        if stream is None:
            if hasattr(current, "__cuda_stream__") and hasattr(
                self.cupy.cuda.Stream, "from_external"
            ):
                stream = self.cupy.cuda.Stream.from_external(current)
            else:  # cupy before 14, or a torch without the CUDA stream protocol
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = self.cupy.cuda.ExternalStream(current.cuda_stream, self.device.index)
            self._streams[current.cuda_stream] = stream
        return stream


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    """The CUDA device to run on; CudaUnavailable when there is none fit for the kernels."""
    if not torch.cuda.is_available():
        raise CudaUnavailable("no CUDA device is available to torch")
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise CudaUnavailable(
            f"cupy is not installed ({e}); install cupy-cuda12x or cupy-cuda13x"
        ) from None
    if device is None:
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise CudaUnavailable(f"device {dev} is not a CUDA device")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        raise CudaUnavailable(
            f"the generated kernels need compute capability 8.0 or newer; "
            f"{torch.cuda.get_device_name(dev)} has {major}.{minor}"
        )
    return dev


def chunk_size(longest: Tensor) -> Tensor:
    """The two-pass backward's chunk of occurrences for the longest segment, on the
    device: max(SPLIT_MIN, isqrt(longest - 1) + 1) = max(SPLIT_MIN, ceil(sqrt(longest))),
    fp64's root being exact enough for any count below 2^40."""
    return longest.double().sqrt().ceil().long().clamp(min=SPLIT_MIN)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Segments:
    """The occurrences of a backward's rows sorted into one segment per distinct row, with
    every size a bound the host knows (capacity = the ids' count) and every count on the
    device, so that making them never waits for the device.

    unique: [capacity] the distinct rows ascending, in the rows' dtype (the first `count`
    are set); seg: [capacity + 1] int64 bounds in sorted_occ (seg[count:] = nnz: empty
    segments); sorted_occ: [nnz] the occurrences sorted by row, stable; count: [1] int64
    how many distinct rows (0 when some row is outside the table); longest: [1] int64 the
    most occurrences of one row; bad: [1] bool, some row outside [0, num_rows)."""

    unique: Tensor
    seg: Tensor
    sorted_occ: Tensor
    count: Tensor
    longest: Tensor
    bad: Tensor


class _Fallback(Exception):
    """Internal: this call goes to the torch path, for the reason given."""


def _close(actual: Tensor, expected: Tensor, rtol: float) -> tuple[bool, float]:
    if actual.shape != expected.shape:
        return False, math.inf
    if actual.numel() == 0:
        return True, 0.0
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    scale = e.abs().max().item() + 1e-30
    bound = rtol * (e.abs() + 1e-3 * scale)
    return bool((err <= bound).all()), float(err.max().item())


class CudaKernels:
    """`Kernels` backed by the generated CUDA kernels; see the module docstring.

    kernel_dir: the `kernels/` folder of `embarkc compile`'s output (with manifest.json);
    sources: alternatively, the rendered files in memory ({"kernels/<name>.cu": text,
    "kernels/manifest.json": text}, as `render_kernels` returns them);
    device: the CUDA device (default: the current one);
    fallback: the torch implementation used for what the kernels do not cover;
    verify: check the first call of every kernel entry against the fallback;
    poison: fill every buffer a kernel writes with NaN (floats) or -7 (integers) before the
    launch, so that an element a kernel fails to write cannot pass for a right one (for the
    GPU check; costs a fill per call);
    launcher: how kernels are compiled and launched (default: NVRTC and CUDA through cupy;
    the tests pass a host emulation that runs the same sources on the CPU).
    """

    accum = torch.float32
    """the generated kernels accumulate in fp32 (the exact mode uses TorchKernels(fp64))"""

    name = "cuda"

    def __init__(
        self,
        kernel_dir: str | Path | None = None,
        *,
        sources: Mapping[str, str] | None = None,
        device: torch.device | str | int | None = None,
        fallback: Kernels | None = None,
        verify: bool = True,
        poison: bool = False,
        launcher: Launcher | None = None,
    ):
        if (kernel_dir is None) == (sources is None):
            raise ValueError("give exactly one of kernel_dir and sources")
        self._sources: dict[str, str] = {}
        self._dir: Path | None = None
        if sources is not None:
            self._sources = {str(k).removeprefix("kernels/"): v for k, v in sources.items()}
            where = "kernels/manifest.json (in memory)"
        else:
            d = Path(kernel_dir)  # type: ignore[arg-type]
            if not (d / MANIFEST).is_file():
                raise CudaUnavailable(f"{d / MANIFEST}: no kernel manifest (run embarkc compile)")
            self._dir = d
            where = str(d / MANIFEST)
        text = self._read(MANIFEST, where)
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as e:
            raise CudaUnavailable(f"{where}: not valid JSON ({e})") from None
        self.index = KernelIndex(manifest, where)
        self.launcher: Launcher
        if launcher is not None:
            # a host emulation (tests): tensors live on the CPU, pointers are host pointers
            self.device = torch.device(device if device is not None else "cpu")
            self.launcher = launcher
        else:
            self.device = _cuda_device(device)
            self.launcher = CupyLauncher(self.device)
        self.fallback: Kernels = fallback if fallback is not None else TorchKernels()
        self.verify = verify
        self.poison = poison
        self._verified: set[str] = set()
        self._consts: dict[tuple[str, int, str], Tensor] = {}
        self._bad: Tensor | None = None
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()

    # ------------------------------------------------------------------ plumbing
    def _read(self, rel: str, where: str | None = None) -> str:
        """The text of a kernel file (read once: every launch asks for its source)."""
        rel = rel.removeprefix("kernels/")
        text = self._sources.get(rel)
        if text is not None:
            return text
        if self._dir is None:
            raise CudaUnavailable(f"{where or rel}: missing from the kernel sources")
        try:
            text = (self._dir / rel).read_text()
        except OSError as e:
            raise CudaUnavailable(f"{self._dir / rel}: cannot read ({e.strerror})") from None
        self._sources[rel] = text
        return text

    def _launch(
        self, info: KernelInfo, entry: str, items: int, args: list[Any], shared: int = 0
    ) -> None:
        """Launch `entry` over `items` groups (GROUP threads each, BLOCK per block).

        Arguments: a tensor passes its data pointer, None a null pointer, an int an i64,
        a float an fp32, a (kind, value) pair that kind (the kernels' parameter types)."""
        group = int(info.get("group", 1))
        block = int(info.get("block", 256))
        grid = _ceil_div(items * group, block)
        if grid == 0:
            return
        packed: list[tuple[str, Any]] = []
        for a in args:
            if isinstance(a, tuple):  # already typed: (kind, value)
                packed.append(a)
            elif isinstance(a, Tensor):
                packed.append(("ptr", a.data_ptr()))
            elif a is None:
                packed.append(("ptr", 0))
            elif isinstance(a, bool):
                raise TypeError("no bool kernel arguments")
            elif isinstance(a, int):
                packed.append(("i64", a))
            else:
                packed.append(("f32", float(a)))
        self.launcher.launch(self._read(info.file), entry, grid, block, shared, packed)
        self.calls[entry] += 1

    def _alloc(self, *shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        if not self.poison:
            return torch.empty(*shape, dtype=dtype, device=device)
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, dtype=dtype, device=device)

    def _on_device(self, *tensors: Tensor | None) -> None:
        for t in tensors:
            if t is not None and t.device != self.device:
                raise _Fallback(f"tensor on {t.device}, kernels on {self.device}")

    @staticmethod
    def _aligned(*tensors: Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise _Fallback("a non-contiguous tensor")
            if t.data_ptr() % 16:
                raise _Fallback("a tensor not aligned to 16 bytes")

    def _dtype(self, t: Tensor) -> str:
        name = TORCH_DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise _Fallback(f"dtype {t.dtype}")
        return name

    @staticmethod
    def _key(t: Tensor) -> str:
        name = KEY_NAMES.get(t.dtype)
        if name is None:
            raise _Fallback(f"index dtype {t.dtype}")
        return name

    def _fall(self, what: str, reason: str) -> None:
        self.fallbacks[f"{what}: {reason}"] += 1

    def _check(self, entry: str, actual: Tensor, expected: Tensor, rtol: float | None) -> None:
        if rtol is None:
            ok = actual.shape == expected.shape and bool(torch.equal(actual, expected))
            err = 0.0 if ok else math.inf
        else:
            ok, err = _close(actual, expected, rtol)
        if not ok:
            raise KernelMismatchError(
                f"generated kernel {entry} disagrees with the torch path (largest difference "
                f"{err:.3g}); train with embark_runtime.kernels.TorchKernels and report this "
                "as a bug in embarkc's CUDA templates"
            )

    def _first(self, entry: str) -> bool:
        """True (once per entry) when this call should be verified."""
        if not self.verify or entry in self._verified:
            return False
        self._verified.add(entry)
        return True

    # ------------------------------------------------------------------ Kernels
    def pooled_forward(
        self,
        weight: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
    ) -> Tensor:
        """As `Kernels.pooled_forward`; also accepts mode "concat" (every bag holds exactly
        `hotness` ids; result [B, hotness * w], the bags' rows side by side)."""
        try:
            self._on_device(weight, rows, offsets, per_id_weights)
            bags = offsets.numel() - 1
            nnz = rows.numel()
            mean_hotness = nnz / bags if bags > 0 else 1.0
            dtype = self._dtype(weight)
            info = self.index.forward(
                weight.shape[1],
                dtype,
                mode,
                per_id_weights is not None,
                self._key(rows),
                mean_hotness,
            )
            if info is None:
                raise _Fallback(f"no forward kernel for width {weight.shape[1]} {dtype} {mode}")
            rows_c, offsets_c = rows.contiguous(), offsets.contiguous().long()
            pw = per_id_weights.contiguous().float() if per_id_weights is not None else None
            self._aligned(weight)
        except _Fallback as f:
            self._fall("pooled_forward", str(f))
            return self._torch_forward(weight, rows, offsets, per_id_weights, mode)
        out_width = weight.shape[1] * (info.get("hotness") if mode == "concat" else 1)
        out = self._alloc(bags, out_width, dtype=torch.float32, device=weight.device)
        entry = info.entries[0]
        self._launch(info, entry, bags, [weight, rows_c, offsets_c, pw, out, bags])
        if self._first(entry):
            expected = self._torch_forward(weight, rows, offsets, per_id_weights, mode)
            self._check(entry, out, expected, TOLERANCE["fp32"])
        return out

    def _torch_forward(self, weight, rows, offsets, per_id_weights, mode) -> Tensor:
        if mode != "concat":
            return self.fallback.pooled_forward(weight, rows, offsets, per_id_weights, mode)
        bags = offsets.numel() - 1
        ones = torch.arange(rows.numel() + 1, device=offsets.device)
        flat = self.fallback.pooled_forward(weight, rows, ones, per_id_weights, "sum")
        return flat.reshape(bags, -1)

    def _segments(self, rows: Tensor, num_rows: int) -> Segments:
        """The occurrences sorted into one segment per distinct row, without a wait for
        the device: every buffer is sized by the ids' count (a bound the host knows), and
        the counts stay on the device (see Segments). `rows` must not be empty."""
        n = rows.numel()
        dev = rows.device
        lo, hi = torch.aminmax(rows)
        bad = ((lo < 0) | (hi >= num_rows)).reshape(1)
        # a radix sort costs a pass per key byte: sort 32-bit keys when the rows fit
        keys = rows.to(torch.int32) if num_rows <= 2**31 - 1 else rows
        sorted_rows, sorted_occ = torch.sort(keys, stable=True)
        head = torch.ones(n, dtype=torch.bool, device=dev)
        torch.ne(sorted_rows[1:], sorted_rows[:-1], out=head[1:])
        rank = torch.cumsum(head, 0) - 1
        # rows outside the table: no segment at all, so no kernel touches them; the
        # error is raised where the host next waits
        count = torch.where(bad, 0, rank[-1:] + 1)
        unique = self._alloc(n, dtype=rows.dtype, device=dev)
        unique.index_put_((rank,), sorted_rows.to(rows.dtype))
        # seg[u] = the first sorted position of row u, seg[count:] = n (empty segments);
        # the positions that start no segment write to a slot past the end
        seg = torch.full((n + 2,), n, dtype=torch.int64, device=dev)
        seg.scatter_(0, torch.where(head, rank, n + 1), self._iota(n, dev))
        seg = seg[: n + 1]
        longest = (seg[1:] - seg[:-1]).max().reshape(1)
        return Segments(unique, seg, sorted_occ, count, longest, bad)

    def _iota(self, n: int, device: torch.device) -> Tensor:
        """arange(n) on `device`, made once per size (every backward asks for one)."""
        key = ("arange", n, str(device))
        t = self._consts.get(key)
        if t is None:
            if len(self._consts) > 64:
                self._consts.clear()
            t = self._consts[key] = torch.arange(n, dtype=torch.int64, device=device)
        return t

    def _ones(self, n: int, device: torch.device) -> Tensor:
        """ones(n) in fp32 on `device`, made once per size."""
        key = ("ones", n, str(device))
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.ones(n, dtype=torch.float32, device=device)
        return t

    def _defer(self, bad: Tensor) -> None:
        """Remember, on the device, that a call had rows outside its table."""
        self._bad = bad if self._bad is None else self._bad | bad

    def check_rows(self) -> None:
        """Raise the IndexError of any wait-free backward since the last check
        (pooled_backward_update, pooled_backward_padded) whose rows were outside the
        table: such a call updates nothing (its count is 0) and is said here rather than
        wait for the device itself. Waits for the device once: call it where the caller
        waits anyway (a logged loss)."""
        bad, self._bad = self._bad, None
        if bad is not None and bool(bad.any()):
            raise IndexError(
                "row index outside the table in a backward since the last check; that call "
                "updated nothing"
            )

    def _backward_launch(
        self,
        info: KernelInfo,
        grad: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        occ_bag: Tensor,
        s: Segments,
        mode: str,
        tail: list[Any],
        known: tuple[int, int] | None = None,
    ) -> None:
        """Launch the backward `info` (plain or fused) over the distinct rows, with `tail`
        after its common arguments.

        One group sums all the occurrences of its row, one after the other: a row drawn
        thousands of times (the head of a skewed table) would hold the whole launch. When
        some row occurs more than SPLIT_MIN times, the sums take two passes: the plain
        backward sums chunks of at most `size` occurrences into partial rows, then `info`
        sums each row's partials (bags of one partial each, weight 1: mean and weights are
        applied once, in the first pass). size ~ sqrt(longest) bounds both passes' serial
        work; the summation order is fixed, so the result is deterministic.

        known: (distinct rows, longest segment) when the caller has read them from the
        device; the launches then cover exactly those rows and take one way. Without
        them nothing waits for the device: whether some row is that long is known on the
        device only, so both ways are launched over the capacity, each with its count
        zeroed on the device when the other one is taken (its groups leave at once); the
        chunk buffers are sized by their bound (size >= SPLIT_MIN: at most capacity +
        nnz // SPLIT_MIN chunks)."""
        capacity = known[0] if known is not None else s.unique.numel()
        width = grad.shape[1]
        weighted = per_id_weights is not None
        plain = None
        maybe_long = capacity > SPLIT_MIN if known is None else known[1] > SPLIT_MIN
        if maybe_long and mode != "concat":
            plain = self.index.backward(width, "fp32", mode, weighted, self._key(s.unique), "none")
        seg = s.seg[: capacity + 1]
        common = [grad, offsets, per_id_weights, occ_bag, s.sorted_occ, seg, s.unique]
        if plain is None:
            self._launch(info, info.entries[0], capacity, [*common, s.count, *tail])
            return
        dev = grad.device
        nnz = s.sorted_occ.numel()
        size: int | Tensor
        if known is not None:
            size = max(SPLIT_MIN, math.isqrt(known[1] - 1) + 1)  # = chunk_size's
            chunks = capacity + nnz // size
            two_pass = s.count
        else:
            split = s.longest > SPLIT_MIN
            self._launch(
                info, info.entries[0], capacity, [*common, torch.where(split, 0, s.count), *tail]
            )
            size = chunk_size(s.longest)
            chunks = capacity + nnz // SPLIT_MIN
            two_pass = torch.where(split, s.count, 0)
        per_row = (seg[1:] - seg[:-1] + size - 1) // size
        row_end = torch.cumsum(per_row, 0)
        row_start = row_end - per_row
        c = self._iota(chunks + 1, dev)
        owner = torch.searchsorted(row_end, c[:-1], right=True)
        mine = owner.clamp(max=capacity - 1)
        start = seg[mine] + (c[:-1] - row_start[mine]) * size
        seg1 = torch.cat([torch.where(owner < capacity, start, nnz), seg[-1:]])
        seg2 = torch.cat([row_start, row_end[-1:]])
        partials = self._alloc(chunks, width, dtype=torch.float32, device=dev)
        first = [grad, offsets, per_id_weights, occ_bag, s.sorted_occ, seg1, s.unique]
        # the chunk pass works when the two passes are taken (two_pass > 0 on the device)
        used = torch.where(two_pass > 0, row_end[-1:], 0)
        self._launch(plain, plain.entries[0], chunks, [*first, used, partials])
        ones = self._ones(chunks, dev) if weighted else None
        second = [partials, c, ones, c[:-1], c[:-1], seg2, s.unique]
        self._launch(info, info.entries[0], capacity, [*second, two_pass, *tail])

    def pooled_backward(
        self,
        grad_out: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
        num_rows: int,
    ) -> tuple[Tensor, Tensor]:
        try:
            self._on_device(grad_out, rows, offsets, per_id_weights)
            if grad_out.dtype != torch.float32:
                raise _Fallback(f"gradient dtype {grad_out.dtype}")
            info = self.index.backward(
                grad_out.shape[1],
                "fp32",
                mode,
                per_id_weights is not None,
                self._key(rows),
                "none",
            )
            if info is None:
                raise _Fallback(f"no backward kernel for width {grad_out.shape[1]} {mode}")
            grad = grad_out.contiguous()
            self._aligned(grad)
        except _Fallback as f:
            self._fall("pooled_backward", str(f))
            return self.fallback.pooled_backward(
                grad_out, rows, offsets, per_id_weights, mode, num_rows
            )
        if rows.numel() == 0:
            return rows.clone(), torch.zeros(0, grad.shape[1], device=grad.device)
        offsets_c = offsets.contiguous().long()
        s = self._segments(rows.contiguous(), num_rows)
        # the one wait of this call: its results are as long as the distinct rows
        count, longest, bad = torch.cat([s.count, s.longest, s.bad.long()]).tolist()
        if bad:
            raise IndexError(f"row index outside [0, {num_rows})")
        occ_bag = bag_of_ids(offsets_c, rows.numel())
        pw = per_id_weights.contiguous().float() if per_id_weights is not None else None
        row_grads = self._alloc(count, grad.shape[1], dtype=torch.float32, device=grad.device)
        entry = info.entries[0]
        known = (count, longest)
        self._backward_launch(info, grad, offsets_c, pw, occ_bag, s, mode, [row_grads], known)
        unique = s.unique[:count]
        if self._first(entry):
            exp_rows, exp_grads = self.fallback.pooled_backward(
                grad_out, rows, offsets, per_id_weights, mode, num_rows
            )
            self._check(entry, unique, exp_rows.to(unique.dtype), None)
            self._check(entry, row_grads, exp_grads, TOLERANCE["fp32"])
        return unique, row_grads

    def pooled_backward_padded(
        self,
        grad_out: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
        num_rows: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """pooled_backward without waiting for the device (extension of Kernels): the
        distinct rows and their gradients in buffers as long as the ids, and how many
        of them are set, [1] int64 on the device. Rows outside the table give a count of
        0 and are said at the next `check_rows`. A call the kernels cannot serve goes to
        the torch path, whose results are exact (count = their length)."""
        try:
            self._on_device(grad_out, rows, offsets, per_id_weights)
            if grad_out.dtype != torch.float32:
                raise _Fallback(f"gradient dtype {grad_out.dtype}")
            info = self.index.backward(
                grad_out.shape[1], "fp32", mode, per_id_weights is not None, self._key(rows), "none"
            )
            unverified = self.verify and info is not None and info.entries[0] not in self._verified
            if info is None or rows.numel() == 0 or unverified:
                # pooled_backward serves (and verifies) the first call: it waits anyway
                raise _Fallback("the torch path or the verified first call")
            grad = grad_out.contiguous()
            self._aligned(grad)
        except _Fallback:
            # pooled_backward meets the same reason again and counts it
            unique, grads = self.pooled_backward(
                grad_out, rows, offsets, per_id_weights, mode, num_rows
            )
            count = torch.full((1,), unique.numel(), dtype=torch.int64, device=unique.device)
            return unique, grads, count
        offsets_c = offsets.contiguous().long()
        s = self._segments(rows.contiguous(), num_rows)
        self._defer(s.bad)
        occ_bag = bag_of_ids(offsets_c, rows.numel())
        pw = per_id_weights.contiguous().float() if per_id_weights is not None else None
        row_grads = self._alloc(
            s.unique.numel(), grad.shape[1], dtype=torch.float32, device=grad.device
        )
        self._backward_launch(info, grad, offsets_c, pw, occ_bag, s, mode, [row_grads])
        return s.unique, row_grads, s.count

    def _state_args(self, weight: Tensor, state: dict[str, Tensor], optimizer: str) -> list[Any]:
        facts = OPTIMIZERS.get(optimizer)
        if facts is None:
            raise ValueError(f"unknown optimizer {optimizer!r}")
        names = facts.state_names
        tensors = []
        for n in names:
            t = state.get(n)
            if t is None:
                raise ValueError(f"{optimizer} state has no {n!r} tensor")
            if t.dtype != torch.float32:
                raise _Fallback(f"{optimizer} state {n!r} is {t.dtype}, not float32")
            self._on_device(t)
            self._aligned(t)
            tensors.append(t)
        return (tensors + [None, None, None])[:3]

    def _snapshot(self, weight, state, rows) -> tuple[Tensor, dict[str, Tensor]]:
        return weight.index_select(0, rows), {k: v.index_select(0, rows) for k, v in state.items()}

    def _verify_update(self, entry, before, weight, state, rows, grads, optimizer, params):
        w0, s0 = before
        local = torch.arange(rows.numel(), device=rows.device)
        self.fallback.sparse_update(w0, s0, local, grads, optimizer, params)
        rtol = TOLERANCE[self._dtype(weight)]
        self._check(entry, weight.index_select(0, rows).float(), w0.float(), rtol)
        for k, v in state.items():
            self._check(entry, v.index_select(0, rows), s0[k], TOLERANCE["fp32"])

    def sparse_update(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        unique_rows: Tensor,
        row_grads: Tensor,
        optimizer: str,
        params: OptimizerParamsLike,
    ) -> None:
        if unique_rows.numel() == 0:
            return
        try:
            self._on_device(weight, unique_rows, row_grads)
            info = self.index.update(
                weight.shape[1], self._dtype(weight), optimizer, self._key(unique_rows)
            )
            if info is None:
                raise _Fallback(f"no {optimizer} update kernel for width {weight.shape[1]}")
            grads = row_grads.contiguous().float()
            self._aligned(weight, grads)
            states = self._state_args(weight, state, optimizer)
        except _Fallback as f:
            self._fall("sparse_update", str(f))
            self.fallback.sparse_update(weight, state, unique_rows, row_grads, optimizer, params)
            return
        entry = info.entries[0]
        rows_c = unique_rows.contiguous()
        check = self._first(entry)
        before = self._snapshot(weight, state, rows_c) if check else None
        self._launch(
            info,
            entry,
            rows_c.numel(),
            [weight, *states, rows_c, grads, rows_c.numel(), *_opt_args(params)],
        )
        if before is not None:
            self._verify_update(entry, before, weight, state, rows_c, grads, optimizer, params)

    def pooled_backward_update(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        grad_out: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
        optimizer: str,
        params: OptimizerParamsLike,
    ) -> None:
        """pooled_backward followed by sparse_update, fused into one kernel: the gradient of
        each distinct row is summed in registers and applied at once (extension of Kernels;
        the torch path runs the two steps)."""
        try:
            self._on_device(weight, grad_out, rows, offsets, per_id_weights)
            if grad_out.dtype != torch.float32:
                raise _Fallback(f"gradient dtype {grad_out.dtype}")
            info = self.index.backward(
                weight.shape[1],
                self._dtype(weight),
                mode,
                per_id_weights is not None,
                self._key(rows),
                optimizer,
            )
            if info is None or grad_out.shape[1] != weight.shape[1]:
                raise _Fallback(f"no fused {optimizer} kernel for width {weight.shape[1]} {mode}")
            grad = grad_out.contiguous()
            self._aligned(weight, grad)
            states = self._state_args(weight, state, optimizer)
        except _Fallback as f:
            self._fall("pooled_backward_update", str(f))
            unique, grads = self.pooled_backward(
                grad_out, rows, offsets, per_id_weights, mode, weight.shape[0]
            )
            self.sparse_update(weight, state, unique, grads, optimizer, params)
            return
        if rows.numel() == 0:
            return
        offsets_c = offsets.contiguous().long()
        s = self._segments(rows.contiguous(), weight.shape[0])
        occ_bag = bag_of_ids(offsets_c, rows.numel())
        pw = per_id_weights.contiguous().float() if per_id_weights is not None else None
        entry = info.entries[0]
        before = None
        if self._first(entry):
            # the verification waits for the device anyway: rows outside the table are
            # said at once, and the rows the update touches are known
            count, bad = torch.cat([s.count, s.bad.long()]).tolist()
            if bad:
                raise IndexError(f"row index outside [0, {weight.shape[0]})")
            before = self._snapshot(weight, state, s.unique[:count])
        else:
            self._defer(s.bad)
        tail = [weight, *states, *_opt_args(params)]
        self._backward_launch(info, grad, offsets_c, pw, occ_bag, s, mode, tail)
        if before is not None:
            _, grads = self.fallback.pooled_backward(
                grad_out, rows, offsets, per_id_weights, mode, weight.shape[0]
            )
            unique = s.unique[: before[0].shape[0]]
            self._verify_update(entry, before, weight, state, unique, grads, optimizer, params)

    def sparse_update_padded(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        unique_rows: Tensor,
        row_grads: Tensor,
        count: Tensor,
        optimizer: str,
        params: OptimizerParamsLike,
    ) -> None:
        """sparse_update of the first `count` ([1] int64 on the device) of `unique_rows`
        (distinct, inside the table) with their `row_grads`, without waiting for the device
        (extension of Kernels): the fused kernel over segments of one occurrence each,
        whose groups past the count leave at once. The entries past the count are not
        read. The first, verified call and a call the kernels cannot serve wait once."""
        try:
            self._on_device(weight, unique_rows, row_grads, count)
            dtype, key = self._dtype(weight), self._key(unique_rows)
            info = self.index.backward(weight.shape[1], dtype, "sum", False, key, optimizer)
            if info is None or row_grads.shape[1] != weight.shape[1]:
                raise _Fallback(f"no fused {optimizer} kernel for width {weight.shape[1]} sum")
            grads = row_grads.contiguous().float()
            self._aligned(weight, grads)
            states = self._state_args(weight, state, optimizer)
        except _Fallback as f:
            self._fall("sparse_update_padded", str(f))
            n = int(count.item())
            self.sparse_update(weight, state, unique_rows[:n], row_grads[:n], optimizer, params)
            return
        n = unique_rows.numel()
        if n == 0:
            return
        dev = unique_rows.device
        entry = info.entries[0]
        rows_c = unique_rows.contiguous()
        before = None
        if self._first(entry):
            used = rows_c[: int(count.item())]
            before = self._snapshot(weight, state, used)
        iota = self._iota(n + 1, dev)
        one = torch.ones(1, dtype=torch.int64, device=dev)
        s = Segments(
            rows_c, torch.minimum(iota, count), iota[:n], count, one, torch.zeros_like(one).bool()
        )
        tail = [weight, *states, *_opt_args(params)]
        self._backward_launch(info, grads, iota, None, iota[:n], s, "sum", tail, known=(n, 1))
        if before is not None:
            m = before[0].shape[0]
            self._verify_update(
                entry, before, weight, state, rows_c[:m], grads[:m], optimizer, params
            )

    def dedup(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        try:
            self._on_device(keys)
            info = self.index.dedup(self._key(keys))
            if info is None:
                raise _Fallback(f"no dedup kernel for {keys.dtype} keys")
        except _Fallback as f:
            self._fall("dedup", str(f))
            return self.fallback.dedup(keys)
        keys_c = keys.contiguous()
        n = keys_c.numel()
        if n == 0:
            return keys_c.clone(), torch.empty(0, dtype=torch.int64, device=keys.device)
        capacity = 1 << max(6, (2 * n - 1).bit_length())
        table = torch.full((capacity,), -1, dtype=torch.int64, device=keys.device)
        slot_of = self._alloc(n, dtype=torch.int64, device=keys.device)
        negative = (keys_c < 0).any()
        insert, inverse_entry = info.entries
        self._launch(info, insert, n, [keys_c, n, table, capacity - 1, slot_of])
        full = table != -1
        # the one wait: the distinct keys' count (the size of the result), read together
        # with the check of the keys
        count, bad = torch.stack([full.sum(), negative.long()]).tolist()
        if bad:
            raise ValueError("dedup: keys must be non-negative")
        occupied = torch.nonzero_static(full, size=count).squeeze(1)
        unique, order = torch.sort(table[occupied])
        slot_rank = torch.empty(capacity, dtype=torch.int64, device=keys.device)
        slot_rank[occupied[order]] = torch.arange(unique.numel(), device=keys.device)
        inverse = self._alloc(n, dtype=torch.int64, device=keys.device)
        self._launch(info, inverse_entry, n, [slot_of, slot_rank, n, inverse])
        unique = unique.to(keys.dtype)
        if self._first(insert):
            exp_u, exp_inv = self.fallback.dedup(keys)
            self._check(insert, unique, exp_u, None)
            self._check(inverse_entry, inverse, exp_inv.to(torch.int64), None)
        return unique, inverse

    def bucketize(
        self, keys: Tensor, rows: int, row_shards: int, partition: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        try:
            self._on_device(keys)
            info = self.index.bucketize(self._key(keys), partition)
            if info is None:
                raise _Fallback(f"no bucketize kernel for {keys.dtype} keys, {partition}")
            warps = int(info.get("block", 256)) // 32
            shared = warps * row_shards * 4
            if shared > SHARED_MEMORY_LIMIT:
                raise _Fallback(f"{row_shards} row shards exceed the kernel's shared memory")
        except _Fallback as f:
            self._fall("bucketize", str(f))
            return self.fallback.bucketize(keys, rows, row_shards, partition)
        keys_c = keys.contiguous()
        n = keys_c.numel()
        dev = keys.device
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return empty, torch.zeros(row_shards, dtype=torch.int64, device=dev), empty.clone()
        count, scatter = info.entries
        blocks = _ceil_div(n, int(info.get("block", 256)))
        block_counts = self._alloc(row_shards * blocks, dtype=torch.int64, device=dev)
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        self._launch(
            info, count, n, [keys_c, n, rows, row_shards, block_counts, bad], shared=shared
        )
        base = torch.cumsum(block_counts, 0) - block_counts
        counts = block_counts.view(row_shards, blocks).sum(1)
        if int(bad.item()):
            raise ValueError(f"bucketize: {int(bad.item())} keys outside [0, {rows}) of the table")
        order = self._alloc(n, dtype=torch.int64, device=dev)
        local = self._alloc(n, dtype=torch.int64, device=dev)
        self._launch(
            info, scatter, n, [keys_c, n, rows, row_shards, base, order, local], shared=shared
        )
        if self._first(count):
            e_order, e_counts, e_local = self.fallback.bucketize(keys, rows, row_shards, partition)
            self._check(count, counts, e_counts.to(torch.int64), None)
            self._check(scatter, order, e_order.to(torch.int64), None)
            self._check(scatter, local, e_local.to(torch.int64), None)
        return order, counts, local.to(keys.dtype) if keys.dtype != torch.int64 else local

    def gather_rows(self, src: Tensor, index: Tensor) -> Tensor:
        try:
            self._on_device(src, index)
            info = self.index.pack(src.shape[1], self._dtype(src), self._key(index))
            if info is None:
                raise _Fallback(f"no pack kernel for width {src.shape[1]} {src.dtype}")
            self._aligned(src)
        except _Fallback as f:
            self._fall("gather_rows", str(f))
            return self.fallback.gather_rows(src, index)
        index_c = index.contiguous()
        out = self._alloc(index_c.numel(), src.shape[1], dtype=src.dtype, device=src.device)
        entry = info.entries[0]
        self._launch(info, entry, index_c.numel(), [src, index_c, out, index_c.numel()])
        if self._first(entry):
            self._check(entry, out, self.fallback.gather_rows(src, index), None)
        return out

    def scatter_add_rows(self, dst: Tensor, index: Tensor, src: Tensor) -> None:
        try:
            self._on_device(dst, index, src)
            if dst.dtype != torch.float32:
                raise _Fallback(f"scatter-add into {dst.dtype}")
            info = self.index.pack(dst.shape[1], "fp32", self._key(index))
            if info is None or len(info.entries) < 2:
                raise _Fallback(f"no scatter-add kernel for width {dst.shape[1]}")
            src_c = src.contiguous().float()
            self._aligned(dst, src_c)
        except _Fallback as f:
            self._fall("scatter_add_rows", str(f))
            self.fallback.scatter_add_rows(dst, index, src)
            return
        index_c = index.contiguous()
        entry = info.entries[1]
        check = self._first(entry)
        expected = None
        if check:
            expected = dst.clone()
            self.fallback.scatter_add_rows(expected, index, src)
        self._launch(info, entry, index_c.numel(), [dst, index_c, src_c, index_c.numel()])
        if expected is not None:
            self._check(entry, dst, expected, TOLERANCE["fp32"])

    def describe(self) -> str:
        """One line for the trainer's start-up message and logs."""
        used = sum(self.calls.values())
        fell = sum(self.fallbacks.values())
        return (
            f"generated CUDA kernels ({len(self.index.kernels)} in the manifest, "
            f"{self.launcher.compiled} compiled; {used} launches, {fell} calls on the torch path)"
        )


def _opt_args(params: OptimizerParamsLike) -> list[tuple[str, float]]:
    """lr, eps, beta1, beta2, weight_decay as the update kernels take them (betas in
    double, so that 1 - beta and 1 - beta^t match the torch path's Python floats)."""
    return [
        ("f32", float(params.lr)),
        ("f32", float(params.eps)),
        ("f64", float(getattr(params, "beta1", 0.9))),
        ("f64", float(getattr(params, "beta2", 0.999))),
        ("f32", float(getattr(params, "weight_decay", 0.0))),
    ]


def kernels_for(
    kernel_dir: str | Path | None, device: torch.device | str = "cpu", *, verify: bool = True
) -> tuple[Kernels, str]:
    """The kernels to train with on `device`, and a sentence saying which and why.

    CudaKernels when the device is CUDA and the generated kernels load; TorchKernels
    otherwise (never an error: the torch path computes the same results).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return TorchKernels(), f"torch kernels (device {dev})"
    if kernel_dir is None:
        return TorchKernels(), "torch kernels (no generated kernels given)"
    try:
        k = CudaKernels(kernel_dir, device=dev, verify=verify)
    except CudaUnavailable as e:
        return TorchKernels(), f"torch kernels ({e})"
    return k, f"generated CUDA kernels from {kernel_dir}"
