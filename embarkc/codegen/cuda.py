"""Plan -> the CUDA kernels it needs -> rendered `.cu` sources plus a manifest.

`render_kernels(plan)` is the whole stage: it collects the distinct kernel instantiations
the plan's cells need (`kernel_instantiations`), renders each from its family's template
in `templates/cuda/` and adds `kernels/manifest.json`, which the runtime
(`embark_runtime.cuda_kernels`) reads to find the kernel for a call. Nothing here touches
the disk or imports CUDA.

Families (one template each, sharing the config include `_common.cuh.j2`):

  pooled_forward   lookup + sum/mean/concat pooling of bags (optionally weighted)
  backward_update  pooled backward: per distinct row, the gradient summed over its
                   occurrences (sort-based segment reduction); with an optimizer it applies
                   the sparse update in the same kernel, otherwise it writes the row grads
  sparse_update    the sparse optimizer step from per-row gradients (UB owners, dp)
  dedup            hash-table deduplication of keys, with the inverse index
  bucketize        keys -> row shard counts, stable permutation and local rows
  pack             gather_rows / scatter_add_rows of communication buffers

An instantiation's key holds exactly the constants that change its code: width, storage
dtype, pooling, weighted, hotness, key width, optimizer, partition, each only for the
families that use it. `hotness` is the fixed bag size for concat (it sets the output
stride) and, for sum/mean, the bag bound clamped at `MAX_UNROLL` (the number of row loads
kept in flight per thread); backward kernels of sum/mean bags do not depend on it.
Two cells that differ only in constants a family ignores share its kernel.

Thread layout (`thread_layout`): a row is read as VEC-element vectors, VEC being the
widest power of two with VEC * element size <= 16 bytes that divides the width (so a
float4 / eight halves per load when the width allows). With LANES = width / VEC vectors per
row, a bag (or row) gets GROUP = min(32, next power of two >= LANES) threads: one warp for
rows of 32 vectors or more (128 fp32, 256 fp16), a sub-warp group for narrower rows so no
lane idles; wider rows give each lane CHUNKS = ceil(LANES / 32) vectors rather than more
warps, which keeps a row inside one warp (row-wise reductions are warp shuffles, no shared
memory, no block synchronisation). Blocks are BLOCK = 256 threads.

C++ spellings (type names, vector types, conversion functions) live in the tables below;
templates receive them already spelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from embark_runtime.optimizers import OPTIMIZER_NAMES
from embark_runtime.plan import Plan
from embarkc.diagnostics import EmbarkError

MANIFEST_PATH = "kernels/manifest.json"
MANIFEST_FORMAT = "embark-kernels"
MANIFEST_VERSION = 1

BLOCK = 256
"""Threads per block for every family (8 warps: enough to hide latency, small enough for
several resident blocks per SM at the register counts these kernels use)."""

MAX_UNROLL = 4
"""Row loads a forward thread keeps in flight: 4 x 16 bytes per chunk per lane."""

ARCH_TO_COMPUTE = {
    "sm_80": "compute_80",
    "sm_86": "compute_86",
    "sm_89": "compute_89",
    "sm_90": "compute_90",
}
"""Architectures the kernels target. sm_80 is the floor: bf16 conversion (cvt.rn.bf16.f32)
and __match_any_sync need it."""


@dataclass(frozen=True)
class DType:
    """How a storage dtype is spelled in C++ (fp16/bf16 as raw 16-bit patterns)."""

    c_type: str
    bytes: int
    to_float: str
    from_float: str
    torch_name: str


DTYPES: dict[str, DType] = {
    "fp32": DType("float", 4, "embark_f32_to_float", "embark_float_to_f32", "float32"),
    "fp16": DType("u16", 2, "embark_f16_to_float", "embark_float_to_f16", "float16"),
    "bf16": DType("u16", 2, "embark_bf16_to_float", "embark_float_to_bf16", "bfloat16"),
}

KEY_TYPES: dict[str, str] = {"int32": "i32", "int64": "i64"}

RAW_BY_BYTES: dict[int, str] = {16: "uint4", 8: "uint2", 4: "u32", 2: "u16"}
"""The integer vector type that moves N bytes in one load or store."""

STEP_TYPE = "float"
"""Adam's per-row step counter is kept in fp32 like all optimizer state (exact up to 2^24
steps per row)."""

_NAME_PREFIXES = {
    "pooled_forward": "fwd_",
    "backward_update": "bwd_",
    "sparse_update": "upd_",
    "dedup": "dedup_",
    "bucketize": "bucketize_",
    "pack": "pack_",
}

FAMILIES = ("pooled_forward", "backward_update", "sparse_update", "dedup", "bucketize", "pack")
TEMPLATES = {f: f"{f}.cu.j2" for f in FAMILIES}
OPTIMIZERS = OPTIMIZER_NAMES
INT32_KEY_LIMIT = 2**31


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Layout:
    """How the threads of a group cover a row; see the module docstring."""

    vec: int
    lanes: int
    group: int
    chunks: int

    @property
    def bags_per_block(self) -> int:
        return BLOCK // self.group


def thread_layout(width: int, dtype: str) -> Layout:
    """The vector width and thread group for rows of `width` elements of `dtype`."""
    if width <= 0:
        raise ValueError(f"row width must be positive, got {width}")
    vec = 16 // DTYPES[dtype].bytes
    while width % vec:
        vec //= 2
    lanes = width // vec
    group = min(32, _next_pow2(lanes))
    chunks = -(-lanes // group)
    return Layout(vec, lanes, group, chunks)


@dataclass(frozen=True, order=True)
class Instantiation:
    """One kernel source: a family with its compile-time constants.

    Fields a family does not use keep their defaults, so equal code means equal keys.
    """

    family: str
    width: int = 0
    dtype: str = "fp32"
    pooling: str = ""
    weighted: bool = False
    hotness: int = 0
    key: str = "int64"
    optimizer: str = ""
    partition: str = ""

    @property
    def name(self) -> str:
        f = self.family
        if f == "pooled_forward":
            w = "wt" if self.weighted else "unw"
            return f"fwd_w{self.width}_{self.dtype}_{self.pooling}_{w}_h{self.hotness}_{self.key}"
        if f == "backward_update":
            w = "wt" if self.weighted else "unw"
            return (
                f"bwd_{self.optimizer}_w{self.width}_{self.dtype}_{self.pooling}_{w}"
                f"_h{self.hotness}_{self.key}"
            )
        if f == "sparse_update":
            return f"upd_{self.optimizer}_w{self.width}_{self.dtype}_{self.key}"
        if f == "pack":
            return f"pack_w{self.width}_{self.dtype}_{self.key}"
        if f == "dedup":
            return f"dedup_{self.key}"
        if f == "bucketize":
            return f"bucketize_{self.partition}_{self.key}"
        raise ValueError(f"unknown kernel family {f!r}")

    @property
    def entry(self) -> str:
        """The `extern "C"` symbol (prefix of the symbols for multi-entry families)."""
        return f"embark_{self.name}"

    @property
    def entries(self) -> tuple[str, ...]:
        """Every `extern "C"` symbol the instantiation defines."""
        e = self.entry
        if self.family == "pack":
            return (f"{e}_gather", f"{e}_scatter_add") if self.dtype == "fp32" else (f"{e}_gather",)
        if self.family == "dedup":
            return (f"{e}_insert", f"{e}_inverse")
        if self.family == "bucketize":
            return (f"{e}_count", f"{e}_scatter")
        return (e,)

    @property
    def path(self) -> str:
        return f"kernels/{self.name}.cu"

    @property
    def uses_rows(self) -> bool:
        return self.family in ("pooled_forward", "backward_update", "sparse_update", "pack")

    def layout(self) -> Layout | None:
        return thread_layout(self.width, self.dtype) if self.uses_rows else None

    def constants(self) -> dict[str, Any]:
        """The manifest's view of the instantiation: the key plus the derived launch shape."""
        c: dict[str, Any] = {"key": self.key}
        f = self.family
        if self.uses_rows:
            c["width"] = self.width
            c["dtype"] = self.dtype
        if f in ("pooled_forward", "backward_update"):
            c.update(pooling=self.pooling, weighted=self.weighted, hotness=self.hotness)
        if f in ("backward_update", "sparse_update"):
            c["optimizer"] = self.optimizer
        if f == "bucketize":
            c["partition"] = self.partition
        lay = self.layout()
        if lay is not None:
            c.update(vec=lay.vec, group=lay.group, chunks=lay.chunks)
        c["block"] = BLOCK
        return c


def forward_hotness(pooling: str, bag_max: int) -> int:
    """The `hotness` constant of a forward kernel (see the module docstring)."""
    return bag_max if pooling == "concat" else min(max(bag_max, 1), MAX_UNROLL)


def backward_hotness(pooling: str, bag_max: int) -> int:
    return bag_max if pooling == "concat" else 0


def lookup_instantiations(
    width: int,
    dtype: str,
    pooling: str,
    weighted: bool,
    bag_max: int,
    optimizer: str,
    *,
    fused: bool = True,
) -> list[Instantiation]:
    """The forward, backward and update kernels of one (cell width, feature) pair."""
    out = [
        Instantiation(
            "pooled_forward", width, dtype, pooling, weighted, forward_hotness(pooling, bag_max)
        ),
        # the plain backward works on fp32 gradients only; the table dtype plays no part
        Instantiation(
            "backward_update",
            width,
            "fp32",
            pooling,
            weighted,
            backward_hotness(pooling, bag_max),
            optimizer="none",
        ),
        Instantiation("sparse_update", width, dtype, optimizer=optimizer),
    ]
    if fused:
        out.append(
            Instantiation(
                "backward_update",
                width,
                dtype,
                pooling,
                weighted,
                backward_hotness(pooling, bag_max),
                optimizer=optimizer,
            )
        )
    return out


def kernel_instantiations(plan: Plan) -> list[Instantiation]:
    """The distinct kernels the plan's cells need, sorted (deterministic).

    * every table, for each of its cell widths (dp: the whole dim) and each feature reading
      it: the forward in the table's dtype, the plain backward, the sparse update and (dp,
      rb: the lookup and the update happen on the same rank) the fused backward + update;
    * dp and ub tables also get the fused update of unweighted sums: the runtime applies
      their updates (after the gradient exchange) as sums of one-id bags through it, so
      that no update waits for the device (CudaKernels.sparse_update_padded);
    * ub tables pool at the requester from fp32 vectors received over the wire, so their
      forward and backward also run on fp32 buffers of the cell width;
    * pack (gather in the table's dtype, gather and scatter-add of fp32 buffers) per width;
    * dedup for ub tables and sparse dp exchange, bucketize for rb/ub tables, in int64 keys
      and also int32 keys where the table's keys fit (int32 key datasets).
    """
    out: set[Instantiation] = set()
    for t in plan.tables:
        cluster = plan.cluster_of(t.name)
        if cluster.kind == "dp":
            widths = {t.dim}
        else:
            widths = {s.width for s in plan.shards_of(t.name)}
        features = [f for f in plan.features if f.table == t.name]
        key_widths = ["int64"] + (["int32"] if t.rows < INT32_KEY_LIMIT else [])
        for w in sorted(widths):
            for f in features:
                # the runtime may also pool a concat feature as a sum of one-id bags
                shapes = [(f.pooling, f.bag_max)] + ([("sum", 1)] if f.pooling == "concat" else [])
                for pooling, bag_max in shapes:
                    fused = cluster.kind != "ub"
                    out.update(
                        lookup_instantiations(
                            w, t.dtype, pooling, f.weighted, bag_max, t.optimizer, fused=fused
                        )
                    )
                    if cluster.kind == "ub":
                        wire = lookup_instantiations(
                            w, "fp32", pooling, f.weighted, bag_max, t.optimizer, fused=False
                        )
                        out.update(i for i in wire if i.family != "sparse_update")
            if cluster.kind in ("dp", "ub"):
                # their updates run as sums of one-id bags, the counts on the device
                out.add(Instantiation("backward_update", w, t.dtype, "sum", optimizer=t.optimizer))
            out.add(Instantiation("pack", w, t.dtype))
            out.add(Instantiation("pack", w, "fp32"))
        if cluster.kind == "ub" or (cluster.kind == "dp" and cluster.gradient_exchange == "sparse"):
            out.update(Instantiation("dedup", key=k) for k in key_widths)
        if cluster.kind in ("rb", "ub"):
            out.update(
                Instantiation("bucketize", key=k, partition=plan.row_partition) for k in key_widths
            )
    return sorted(out)


# ---------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class _Constant:
    kind: str  # "type" for a typedef, else the C++ type of a constexpr
    name: str
    value: str
    doc: str


@dataclass
class _Context:
    entry: str
    constants: list[_Constant] = field(default_factory=list)
    vectors: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {
            "entry": self.entry,
            "constants": self.constants,
            "vectors": self.vectors,
        }
        d.update(self.extra)
        return d


def _cbool(b: bool) -> str:
    return "true" if b else "false"


def _context(inst: Instantiation) -> _Context:
    """Everything a family template needs, spelled in C++."""
    ctx = _Context(entry=inst.entry)
    k = ctx.constants
    k.append(_Constant("type", "key_t", KEY_TYPES[inst.key], f"row index / key ({inst.key})"))
    k.append(_Constant("int", "BLOCK", str(BLOCK), "threads per block"))
    lay = inst.layout()
    if lay is not None:
        dt = DTYPES[inst.dtype]
        k.append(_Constant("type", "storage_t", dt.c_type, f"element as stored ({inst.dtype})"))
        k.append(
            _Constant("type", "raw_t", RAW_BY_BYTES[lay.vec * dt.bytes], "one vector, raw bits")
        )
        k.append(_Constant("int", "WIDTH", str(inst.width), "elements per row (cell width)"))
        k.append(_Constant("int", "VEC", str(lay.vec), "elements per vector access"))
        k.append(_Constant("int", "GROUP", str(lay.group), "threads per bag / row"))
        k.append(_Constant("int", "CHUNKS", str(lay.chunks), "vectors per thread"))
        ctx.vectors = True
        ctx.extra.update(to_float=dt.to_float, from_float=dt.from_float)
    if inst.family in ("pooled_forward", "backward_update"):
        out_width = inst.width * inst.hotness if inst.pooling == "concat" else inst.width
        k.append(_Constant("bool", "WEIGHTED", _cbool(inst.weighted), "per-id weights"))
        k.append(_Constant("int", "OUT_WIDTH", str(out_width), "columns of the pooled output"))
        if inst.pooling == "concat":
            k.append(_Constant("int", "HOTNESS", str(inst.hotness), "ids per bag (concat)"))
        elif inst.family == "pooled_forward":
            k.append(_Constant("int", "UNROLL", str(inst.hotness), "row loads in flight"))
        ctx.extra.update(pooling=inst.pooling, weighted=inst.weighted)
    if inst.family in ("backward_update", "sparse_update"):
        k.append(_Constant("type", "step_t", STEP_TYPE, "adam's per-row step count"))
        ctx.extra["optimizer"] = inst.optimizer
    if inst.family == "dedup":
        k.append(_Constant("u64", "EMPTY", "0xffffffffffffffffull", "an empty slot"))
    if inst.family == "bucketize":
        k.append(_Constant("int", "WARPS", str(BLOCK // 32), "warps per block"))
        ctx.extra["partition"] = inst.partition
    if inst.family == "pack":
        ctx.extra["scatter"] = inst.dtype == "fp32"
    return ctx


def template_of(path: str) -> str:
    """The template an output of `render_kernels` was rendered from (for its header line)."""
    if path == MANIFEST_PATH:
        return "embarkc.codegen.cuda.render_kernels"
    stem = path.removeprefix("kernels/").removesuffix(".cu")
    for family, prefix in _NAME_PREFIXES.items():
        if stem.startswith(prefix):
            return f"templates/cuda/{TEMPLATES[family]}"
    raise ValueError(f"{path} is not a kernel file of embarkc.codegen.cuda")


def render_instantiation(inst: Instantiation) -> str:
    """The source of one instantiation (without the generated-file header line, which
    `embarkc.emit` adds in front of every output)."""
    from embarkc.codegen import environment

    template = environment().get_template(f"cuda/{TEMPLATES[inst.family]}")
    return template.render(_context(inst).as_dict())


def render_instantiations(insts: list[Instantiation], *, arch: str) -> dict[str, str]:
    """{path: text} for the given instantiations plus the manifest (used by the planless
    GPU bench as well as by `render_kernels`). `arch` must be a key of ARCH_TO_COMPUTE."""
    files: dict[str, str] = {}
    entries = []
    for inst in sorted(set(insts), key=lambda i: i.name):
        if inst.path in files:  # names encode every key field, so this is a bug here
            raise AssertionError(f"two kernel instantiations named {inst.name}")
        files[inst.path] = render_instantiation(inst)
        entries.append(
            {
                "name": inst.name,
                "family": inst.family,
                "file": inst.path,
                "entries": list(inst.entries),
                "constants": inst.constants(),
            }
        )
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "arch": arch,
        "compute": ARCH_TO_COMPUTE[arch],
        "kernels": entries,
    }
    files[MANIFEST_PATH] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return files


def render_kernels(plan: Plan) -> dict[str, str]:
    """Every kernel the plan needs, as {"kernels/<name>.cu": text}, plus the manifest."""
    if plan.topology.arch not in ARCH_TO_COMPUTE:
        raise EmbarkError.at(
            plan.source.spec,
            f"cannot generate CUDA kernels for architecture `{plan.topology.arch}`",
            hint=f"supported architectures: {', '.join(ARCH_TO_COMPUTE)}",
        )
    return render_instantiations(kernel_instantiations(plan), arch=plan.topology.arch)


class NvrtcUnavailable(RuntimeError):
    """NVRTC cannot be loaded (install the `cuda` extra: cupy-cuda12x, nvidia-cuda-nvrtc-cu12)."""


def compile_ptx(source: str, *, arch: str = "sm_90", name: str = "kernel.cu") -> str:
    """Compile one rendered source to PTX with NVRTC (no GPU needed); return the PTX.

    The kernels include no header, so only the NVRTC library is required. Raises
    RuntimeError with NVRTC's log when the source does not compile.
    """
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # cupy missing, or its NVRTC library cannot be found
        raise NvrtcUnavailable(f"NVRTC is not available: {e}") from None
    # the options the runtime compiles with (cupy adds -arch for the present device)
    options = (f"-arch={ARCH_TO_COMPUTE[arch]}", "--std=c++17")
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed on {name} ({e}):\n{log}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else str(ptx)
