"""The host tier's paths on one GPU: cache hits, staged misses and zero-copy misses
against the host link's copy bandwidth (issue 38: "measure and pick").

A host-tier cell's rows live in pinned host memory and an HBM cache of some of them
(embark_runtime.cache.RowCache, docs/host_tier.md). A miss can reach the device two ways:
a **staged copy** (the host gathers the rows, cudaMemcpy carries them, the device writes
them into cache slots: what RowCache does today) or **zero-copy** (the pinned rows are
mapped into the device's address space by unified addressing and a device gather reads
them over the link). This bench measures, for every row width x optimizer x batch of
distinct rows (fp32; sgd: no state, adagrad: one fp32 per element), in GB/s of the rows'
bytes (weights and optimizer state):

    link          a large pinned buffer host -> device, device -> host, and both at once
                  on two streams (`copy_` with non_blocking=True): the reference
    hit           the rows gathered from the HBM copy (index_select on the device)
    fetch staged  cache.py's `_fetch`: `dev[slots] = host[rows].to(dev, non_blocking=True)`
    fetch pinned  the same through a double-buffered pinned staging buffer (the host
                  gather overlaps the previous copy)
    fetch 0-copy  `dev[slots] = mapped[rows]`: the device gathers from the mapped rows
    wb staged     cache.py's `_write_back`: `host[rows] = dev[slots].to("cpu")`
    wb 0-copy     `mapped.index_copy_(0, rows, dev[slots])`: the device writes the rows
    cache hit     RowCache steps as the trainer calls them (dedup, admit, read, update:
                  torch kernels) on a batch that is all cached
    cache miss    the same on batches that all miss (a cache of one batch, two disjoint
                  batches in turn): every row fetched and an evicted dirty row written
                  back; its bytes count both directions

Each cell of the table is GB/s and, in parentheses, the ratio to the link in the path's
direction (both directions: the link's time for those bytes one after the other). Rows of
a batch are a sorted random set of distinct rows (as `torch.unique` gives them) of a table
of two batches' rows or more; successive timed calls read disjoint sets so that the L2
cache does not hold them. Every path's values are checked: the fetched rows equal the
host table's, the written-back rows the device's, the staged and zero-copy paths alike.
The verdict names the faster miss path (fetch and write-back) per width and batch.

Zero-copy uses torch's own pinned memory (cudaHostAlloc: mapped, and its device pointer
is the host pointer under unified addressing; cupy's pointerGetAttributes confirms it
when cupy imports) wrapped as a CUDA tensor through `__cuda_array_interface__`. On the
CPU (`--device cpu`) "mapped" is the host tensor itself and the sizes are tiny: the same
code paths, measuring nothing (the repository's tests run it).

    python bench/gpu/host_tier.py --out bench/gpu/host_tier.md          # on the GPU
    python bench/gpu/host_tier.py --quick                               # batches 4k, 64k
    python bench/gpu/host_tier.py --device cpu --quick                  # the CPU dry run

Exit code: 0 measured and every check passed, 1 a check failed, 2 it cannot run here (no
CUDA device: 0 with --allow-no-gpu; torch missing; bad arguments; --out not writable),
124 the --budget ran out (what was measured is printed, and written to --out).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
F32 = 4
OPTIMIZERS = {"sgd": 0, "adagrad": 1}
"""fp32 state tensors of [rows, width] each optimizer keeps (embark_runtime.optim)."""
PATHS = (
    "hit",
    "fetch staged",
    "fetch pinned",
    "fetch 0-copy",
    "wb staged",
    "wb 0-copy",
    "cache hit",
    "cache miss",
)
FETCHES = ("fetch staged", "fetch pinned", "fetch 0-copy")
WRITE_BACKS = ("wb staged", "wb 0-copy")
DIRECTION = {p: "h2d" for p in ("hit", "cache hit", *FETCHES)}
DIRECTION |= {"wb staged": "d2h", "wb 0-copy": "d2h", "cache miss": "both"}
L2_DEFAULT = 50 * 2**20


class CannotRun(Exception):
    """The bench cannot run here (the message says why)."""


def _bootstrap() -> None:
    """embark_runtime from this checkout's runtime/ when it is not installed (the GPU
    machine runs from the checkout): bench_kernels.py's bootstrap."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import _bootstrap as bootstrap

    bootstrap()


# ----------------------------------------------------------------------------- memory


class _DeviceArray:
    """`__cuda_array_interface__` of fp32 host memory mapped into the device's address
    space; keeps the host tensor alive as long as the CUDA tensor made from it."""

    def __init__(self, host: Any, pointer: int) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<f4",
            "data": (pointer, False),
            "strides": None,
            "version": 2,
        }


def device_pointer(host_pointer: int) -> int:
    """The device's address of pinned host memory: the host address under unified
    addressing (every 64-bit CUDA platform), confirmed by cupy when it imports."""
    try:
        import cupy
    except ImportError:
        return host_pointer
    attrs = cupy.cuda.runtime.pointerGetAttributes(host_pointer)
    return int(attrs.devicePointer) or host_pointer


def mapped(host: Any, device: Any) -> Any:
    """`host` (pinned fp32, contiguous) as a tensor on `device` that reads and writes the
    host memory itself (zero-copy); on the CPU, `host`."""
    import torch

    if device.type == "cpu":
        return host
    if host.dtype != torch.float32 or not host.is_contiguous() or not host.is_pinned():
        raise ValueError("zero-copy needs contiguous pinned fp32 host memory")
    pointer = device_pointer(host.data_ptr())
    view = torch.as_tensor(_DeviceArray(host, pointer), device=device)
    if view.device != device or view.data_ptr() != pointer:
        raise RuntimeError(f"the mapped view is a copy on {view.device}, not the host memory")
    return view


def pinned(t: Any) -> Any:
    """`t` in host memory, pinned where CUDA is (RowCache's host tier does the same)."""
    import torch

    return t.pin_memory() if torch.cuda.is_available() else t


@dataclass
class Tables:
    """One table's weights and optimizer state three ways: in pinned host memory, that
    memory mapped into the device (zero-copy), and a copy in HBM (the cache)."""

    host: list[Any]
    mapped: list[Any]
    """empty when the host memory cannot be mapped here (`unmapped` says why)"""
    dev: list[Any]
    width: int
    unmapped: str = ""

    @property
    def rows(self) -> int:
        return int(self.host[0].shape[0])

    @property
    def row_bytes(self) -> int:
        return len(self.host) * self.width * F32


def make_tables(rows: int, width: int, states: int, device: Any, seed: int) -> Tables:
    import torch

    gen = torch.Generator().manual_seed(seed)
    host = [pinned(torch.rand(rows, width, generator=gen)) for _ in range(1 + states)]
    dev = [h.to(device, copy=True) for h in host]
    try:
        return Tables(host, [mapped(h, device) for h in host], dev, width)
    except Exception as e:  # reported in every case's checks; the other paths still run
        return Tables(host, [], dev, width, f"zero-copy unavailable: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- the paths


def hit(t: Tables, rows_dev: Any) -> list[Any]:
    return [d.index_select(0, rows_dev) for d in t.dev]


def fetch_staged(t: Tables, rows: Any, slots_dev: Any, dst: list[Any]) -> None:
    """RowCache._fetch's copies."""
    for h, d in zip(t.host, dst, strict=True):
        d[slots_dev] = h[rows].to(d.device, non_blocking=True)


class Staging:
    """Two pinned buffers of `capacity` rows per tensor, used in turn: the host gathers
    into one while the other's copy to the device may still run (an event guards it)."""

    def __init__(self, t: Tables, capacity: int, device: Any) -> None:
        import torch

        self.buffers = [[pinned(torch.empty(capacity, t.width)) for _ in t.host] for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.cuda = device.type == "cuda"
        self.turn = 0

    def fetch(self, t: Tables, rows: Any, slots_dev: Any, dst: list[Any]) -> None:
        import torch

        i, self.turn = self.turn, 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        n = rows.numel()
        for h, d, buf in zip(t.host, dst, self.buffers[i], strict=True):
            torch.index_select(h, 0, rows, out=buf[:n])
            d[slots_dev] = buf[:n].to(d.device, non_blocking=True)
        if self.cuda:
            self.events[i] = torch.cuda.Event()
            self.events[i].record()


def fetch_zero_copy(t: Tables, rows_dev: Any, slots_dev: Any, dst: list[Any]) -> None:
    for m, d in zip(t.mapped, dst, strict=True):
        d.index_copy_(0, slots_dev, m.index_select(0, rows_dev))


def write_back_staged(t: Tables, slots_dev: Any, rows: Any, src: list[Any]) -> None:
    """RowCache._write_back's copies."""
    for h, s in zip(t.host, src, strict=True):
        h[rows] = s[slots_dev].to("cpu")


def write_back_zero_copy(t: Tables, slots_dev: Any, rows_dev: Any, src: list[Any]) -> None:
    for m, s in zip(t.mapped, src, strict=True):
        m.index_copy_(0, rows_dev, s.index_select(0, slots_dev))


# ----------------------------------------------------------------------------- timing


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[int], object], reps: int, device: Any) -> float:
    """Seconds a call of `fn(i)`, i = 0 .. reps - 1 back to back after one warm-up call
    (CUDA events around them: host work between the launches counts, as the device
    waits for it)."""
    import torch

    fn(reps)
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - t0) / reps


@dataclass
class Link:
    """The host link's copy bandwidth of a large pinned buffer, bytes a second."""

    h2d: float
    d2h: float
    both: float
    """both directions at once (two streams), bytes of both a second"""
    nbytes: int

    def reference(self, direction: str) -> float:
        if direction == "both":  # the link's time for both one after the other
            return 2 / (1 / self.h2d + 1 / self.d2h)
        return self.h2d if direction == "h2d" else self.d2h


def measure_link(nbytes: int, device: Any, reps: int) -> Link:
    import torch

    n = nbytes // F32
    host_in, host_out = pinned(torch.rand(n)), pinned(torch.empty(n))
    dev_in, dev_out = host_in.to(device), torch.empty(n, device=device)
    h2d = timed(lambda i: dev_out.copy_(host_in, non_blocking=True), reps, device)
    d2h = timed(lambda i: host_out.copy_(dev_in, non_blocking=True), reps, device)
    if device.type == "cuda":
        up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both(i: int) -> None:
            main = torch.cuda.current_stream(device)
            for s, dst, src in ((up, dev_out, host_in), (down, host_out, dev_in)):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
                main.wait_stream(s)

        t_both = timed(both, reps, device)
    else:
        t_both = timed(lambda i: (dev_out.copy_(host_in), host_out.copy_(dev_in)), reps, device)
    if not torch.equal(host_out, host_in):
        raise RuntimeError("the link's copies did not carry the buffer's values")
    return Link(n * F32 / h2d, n * F32 / d2h, 2 * n * F32 / t_both, n * F32)


# ----------------------------------------------------------------------------- a case


@dataclass
class Case:
    width: int
    optimizer: str
    batch: int
    row_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def gbps(self, path: str) -> float:
        return self.nbytes[path] / self.seconds[path] / GB

    def winner(self, paths: tuple[str, ...]) -> str | None:
        have = [p for p in paths if p in self.seconds]
        return min(have, key=lambda p: self.seconds[p]) if have else None


def row_sets(rows: int, batch: int, count: int, device: Any) -> tuple[list[Any], list[Any]]:
    """`count` disjoint sorted random sets of `batch` distinct rows of `rows` (wrapping
    around when they do not fit), on the host and on the device."""
    import torch

    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(batch))
    k = max(1, rows // batch)
    host = [perm[(i % k) * batch : (i % k + 1) * batch].sort().values for i in range(count)]
    return host, [r.to(device) for r in host]


def reps_for(nbytes: int, device: Any, quick: bool) -> int:
    """Calls timed per path: about 1 GiB of rows on a GPU (half with --quick), 3 to 200."""
    if device.type == "cpu":
        return 2
    aim = (2**29 if quick else 2**30) / max(nbytes, 1)
    return max(3, min(200, math.ceil(aim)))


def check_paths(t: Tables, rows: Any, rows_dev: Any, device: Any) -> list[str]:
    """The staged and zero-copy paths carry the same values: fetched rows equal the host
    table's, written-back rows the device's (the table is restored after)."""
    import torch

    failures = []
    n = rows.numel()
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(device)
    want = [h[rows] for h in t.host]
    staging = Staging(t, n, device)
    fetches = {
        "fetch staged": lambda dst: fetch_staged(t, rows, slots, dst),
        "fetch pinned": lambda dst: staging.fetch(t, rows, slots, dst),
        "fetch 0-copy": lambda dst: fetch_zero_copy(t, rows_dev, slots, dst),
    }
    if not t.mapped:
        del fetches["fetch 0-copy"]
    for name, fn in fetches.items():
        dst = [torch.zeros(n, t.width, device=device) for _ in t.host]
        fn(dst)
        sync(device)
        got = [d[slots].cpu() for d in dst]
        if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
            failures.append(f"{name}: the fetched rows differ from the host table's")
    got = [d.cpu() for d in hit(t, rows_dev)]
    if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
        failures.append("hit: the gathered rows differ from the table's")
    marked = [(w + 1).to(device) for w in want]  # what the device holds: other values
    src = [torch.zeros(n, t.width, device=device) for _ in t.host]
    for s, m in zip(src, marked, strict=True):
        s[slots] = m
    backs = {
        "wb staged": lambda: write_back_staged(t, slots, rows, src),
        "wb 0-copy": lambda: write_back_zero_copy(t, slots, rows_dev, src),
    }
    if not t.mapped:
        del backs["wb 0-copy"]
    for name, fn in backs.items():
        fn()
        sync(device)
        if not all(torch.equal(h[rows], m.cpu()) for h, m in zip(t.host, marked, strict=True)):
            failures.append(f"{name}: the host rows differ from the written-back rows")
        for h, w in zip(t.host, want, strict=True):
            h[rows] = w
    return failures


def optimizer_table(optimizer: str) -> SimpleNamespace:
    params = SimpleNamespace(
        lr=0.01, eps=1e-8, initial_accumulator=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0
    )
    return SimpleNamespace(optimizer=optimizer, optimizer_params=params)


def cache_steps(
    t: Tables, optimizer: str, sets_dev: list[Any], device: Any, reps: int, case: Case
) -> None:
    """RowCache on the host table (its pinned tensors): steps of a batch that all hits,
    and of two disjoint batches in turn that all miss (a cache of one batch)."""
    import torch

    from embark_runtime.cache import RowCache
    from embark_runtime.kernels import TorchKernels

    kernels, table = TorchKernels(torch.float32), optimizer_table(optimizer)
    state = dict(zip(("sum",), t.host[1:], strict=False))
    batch = int(sets_dev[0].numel())
    grads = torch.full((batch, t.width), 1e-3, device=device)
    cache = RowCache(t.host[0], state, batch, device)

    def step(rows: Any) -> None:
        unique, inverse = kernels.dedup(rows)
        counts = torch.bincount(inverse, minlength=unique.numel())
        slots = cache.admit(unique, counts)
        cache.read(unique, slots)
        cache.update(kernels, rows, grads, table)

    step(sets_dev[0])
    cache.take_stats()
    case.seconds["cache hit"] = timed(lambda i: step(sets_dev[0]), reps, device)
    s = cache.take_stats()
    if s.hits != s.lookups:
        case.failures.append(f"cache hit: {s.lookups - s.hits} of {s.lookups} lookups missed")
    turn = [0]

    def miss(i: int) -> None:  # the two batches in turn, whatever the call's index
        turn[0] = 1 - turn[0]
        step(sets_dev[turn[0]])

    case.seconds["cache miss"] = timed(miss, reps, device)
    s = cache.take_stats()
    if s.hits or s.fetches != s.lookups or s.writebacks != s.lookups:
        case.failures.append(
            f"cache miss: {s.hits} hits, {s.fetches} fetches, {s.writebacks} write-backs "
            f"of {s.lookups} lookups (every row should miss and evict a dirty row)"
        )
    case.nbytes["cache hit"] = batch * t.row_bytes
    case.nbytes["cache miss"] = 2 * batch * t.row_bytes
    cache.flush()


def run_case(t: Tables, optimizer: str, batch: int, device: Any, quick: bool, l2: int) -> Case:
    case = Case(t.width, optimizer, batch, t.row_bytes)
    nbytes = batch * t.row_bytes
    reps = reps_for(nbytes, device, quick)
    # disjoint sets for successive calls, until they exceed the L2 cache several times
    count = min(reps + 1, max(2, math.ceil(4 * l2 / nbytes)))
    sets, sets_dev = row_sets(t.rows, batch, count, device)
    case.failures += check_paths(t, sets[0], sets_dev[0], device)
    staging = Staging(t, batch, device)

    def at(i: int) -> tuple[Any, Any]:
        return sets[i % count], sets_dev[i % count]

    paths: dict[str, Callable[[int], object]] = {
        "hit": lambda i: hit(t, at(i)[1]),
        "fetch staged": lambda i: fetch_staged(t, at(i)[0], at(i)[1], t.dev),
        "fetch pinned": lambda i: staging.fetch(t, at(i)[0], at(i)[1], t.dev),
        "fetch 0-copy": lambda i: fetch_zero_copy(t, at(i)[1], at(i)[1], t.dev),
        "wb staged": lambda i: write_back_staged(t, at(i)[1], at(i)[0], t.dev),
        "wb 0-copy": lambda i: write_back_zero_copy(t, at(i)[1], at(i)[1], t.dev),
    }
    if not t.mapped:
        case.failures.append(t.unmapped)
        del paths["fetch 0-copy"], paths["wb 0-copy"]
    for name, fn in paths.items():
        case.seconds[name] = timed(fn, reps, device)
        case.nbytes[name] = nbytes
    cache_steps(t, optimizer, sets_dev, device, reps, case)
    for d, h in zip(t.dev, t.host, strict=True):  # the cache's updates reached host only
        d.copy_(h)
    return case


# ----------------------------------------------------------------------------- report


def cell(case: Case, path: str, link: Link) -> str:
    if path not in case.seconds:
        return "-"
    gbps = case.gbps(path)
    return f"{gbps:,.1f} ({gbps * GB / link.reference(DIRECTION[path]):.2f}x)"


def short(path: str) -> str:
    return {"fetch staged": "staged", "fetch pinned": "pinned", "fetch 0-copy": "0-copy"}.get(
        path, {"wb staged": "staged", "wb 0-copy": "0-copy"}.get(path, path)
    )


def table(cases: list[Case], link: Link) -> list[str]:
    lines = [
        "| width | optimizer | rows | row bytes | "
        + " | ".join(PATHS)
        + " | fetch by | write back by | same values |",
        "|---:|---|---:|---:|" + "---:|" * len(PATHS) + "---|---|---|",
    ]
    for c in cases:
        fetch, wb = c.winner(FETCHES), c.winner(WRITE_BACKS)
        lines.append(
            f"| {c.width} | {c.optimizer} | {c.batch:,} | {c.row_bytes} | "
            + " | ".join(cell(c, p, link) for p in PATHS)
            + f" | {short(fetch) if fetch else '-'} | {short(wb) if wb else '-'} | "
            + ("yes" if not c.failures else "NO: " + "; ".join(c.failures))
            + " |"
        )
    return lines


def verdict(cases: list[Case]) -> str:
    """Which miss path to use, fetch and write-back: one winner everywhere, or where
    each wins (width/optimizer/batch); with how many times faster than cache.py's staged
    copies it ran there."""
    parts = []
    for what, paths in (("fetch misses by", FETCHES), ("write back by", WRITE_BACKS)):
        where: dict[str, list[Case]] = {}
        for c in cases:
            w = c.winner(paths)
            if w is not None:
                where.setdefault(w, []).append(c)
        texts = []
        for w, won in where.items():
            gain = [c.seconds[paths[0]] / c.seconds[w] for c in won]
            text = f"{short(w)} ({min(gain):.2f}-{max(gain):.2f}x cache.py's staged)"
            if len(where) > 1:
                text += " at " + " ".join(f"w{c.width}/{c.optimizer}/{c.batch}" for c in won)
            texts.append(text)
        if texts:
            every = " (every case measured)" if len(where) == 1 else ""
            parts.append(f"{what} " + ", ".join(texts) + every)
    if not parts:
        return "verdict: nothing measured"
    return "verdict: " + "; ".join(parts)


def report(cases: list[Case], link: Link | None, header: list[str], note: str) -> str:
    lines = [*header, ""]
    if link is None:
        return "\n".join([*lines, note, ""])
    lines += [
        f"Host link, a pinned buffer of {link.nbytes / 2**20:,.0f} MiB: host -> device "
        f"{link.h2d / GB:,.1f} GB/s, device -> host {link.d2h / GB:,.1f} GB/s, both at once "
        f"{link.both / GB:,.1f} GB/s (together).",
        "",
        "GB/s of row bytes (weights and optimizer state) and the ratio to the link in the "
        "path's direction; `cache miss` counts the fetched and the written-back rows.",
        "",
        *table(cases, link),
        "",
        verdict(cases),
        "",
    ]
    if note:
        lines += [note, ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise CannotRun(f"--{what}: comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CannotRun(f"--{what}: at least one value, every one at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run)")
    ap.add_argument("--widths", default="32,64,128")
    ap.add_argument("--optimizers", default="sgd,adagrad", help="sgd,adagrad")
    ap.add_argument("--batches", help="distinct rows a batch (GPU 4096,65536,524288)")
    ap.add_argument("--link-mib", type=int, help="the link's buffer (GPU 256 MiB)")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller batches")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds (exit 124 past it)")
    ap.add_argument("--out", type=Path, help="also write the markdown report here")
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 without a CUDA device")
    args = ap.parse_args(argv)
    started = time.time()
    try:
        widths = parse_ints(args.widths, "widths")
        optimizers = [o for o in args.optimizers.split(",") if o]
        bad = [o for o in optimizers if o not in OPTIMIZERS]
        if bad or not optimizers:
            raise CannotRun(f"--optimizers: choose from {', '.join(OPTIMIZERS)}")
        cpu = args.device == "cpu"
        default = ("64,512" if args.quick else "256,2048") if cpu else "4096,65536,524288"
        if args.quick and not cpu and args.batches is None:
            default = "4096,65536"
        batches = parse_ints(args.batches or default, "batches")
        link_mib = args.link_mib or (1 if cpu else 64 if args.quick else 256)
        try:
            import torch
        except ImportError as e:
            raise CannotRun(f"torch does not import ({e})") from None
        if not cpu and not torch.cuda.is_available():
            if args.allow_no_gpu:
                print("host_tier: no CUDA device; skipped (--allow-no-gpu)")
                return 0
            raise CannotRun("no CUDA device (use --device cpu for a check of the harness)")
        if args.out:
            try:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.touch()
            except OSError as e:
                raise CannotRun(f"cannot write --out {args.out} ({e.strerror})") from None
    except CannotRun as e:
        print(f"host_tier: cannot run: {e}", file=sys.stderr)
        return 2
    _bootstrap()
    if cpu:  # the dry run on a shared machine: one thread, no oversubscribed pool
        torch.set_num_threads(1)
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    if cpu:
        where, l2 = "CPU (dry run: measures nothing)", 0
    else:
        props = torch.cuda.get_device_properties(device)
        where, l2 = props.name, int(getattr(props, "L2_cache_size", 0) or L2_DEFAULT)
    try:
        import cupy

        cupy_text = f"cupy {cupy.__version__}"
    except ImportError:
        cupy_text = "no cupy (device pointer = host pointer, unified addressing)"
    header = [
        "## Host tier: hits, staged and zero-copy misses against the host link "
        f"(`bench/gpu/host_tier.py`{' --quick' if args.quick else ''})",
        "",
        f"{where}; torch {torch.__version__}; {cupy_text}; fp32 rows; batches "
        f"{', '.join(f'{b:,}' for b in batches)} distinct rows; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]
    link, cases, note = None, [], ""
    try:
        link = measure_link(link_mib * 2**20, device, 2 if cpu else 10)
        for width in widths:
            for optimizer in optimizers:
                t = make_tables(2 * max(batches), width, OPTIMIZERS[optimizer], device, seed=width)
                for batch in batches:
                    if time.time() - started > args.budget:
                        raise TimeoutError
                    cases.append(run_case(t, optimizer, batch, device, args.quick, l2))
                    print(f"host_tier: w{width} {optimizer} {batch} done", file=sys.stderr)
                del t
                if not cpu:
                    torch.cuda.empty_cache()
        status = 1 if any(c.failures for c in cases) else 0
    except TimeoutError:
        note = f"budget of {args.budget:.0f} s ran out: the cases above are what was measured"
        status = 124
    text = report(cases, link, header, note)
    print(text)
    if args.out:
        tmp = Path(f"{args.out}.tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
