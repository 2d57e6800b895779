"""Run the generated CUDA kernels on the CPU: a host emulation of the CUDA features they use.

There is no GPU where the tests run, yet the kernels' logic (indexing, group layout,
segment reduction, optimizer steps, hashing, stable bucketing, shuffles and barriers) must
be right. `HostLauncher` compiles the very sources `render_kernels` emits with g++ against
a small shim (below) and runs every CUDA thread as an OS thread: blocks one after another,
`__syncthreads` a block-wide barrier, warp shuffles and `__match_any_sync` exchanges among
exactly the lanes of their mask (a lane missing from a mask it names deadlocks here, which
the shim turns into an abort after 20 s, as it would be undefined on a GPU), atomics real
atomics, dynamic shared memory filled with garbage, and a misaligned vector access aborts
(the vector types carry CUDA's alignment and every access is checked, trapping with
SIGILL). It plugs into
`embark_runtime.cuda_kernels.CudaKernels(launcher=...)`, so the runtime's own launch code
(argument packing, grid sizes, prefix sums, compaction) is exercised too.

What it cannot show: timing, memory coalescing, and GPU-only hazards (warp-synchronous
assumptions without a sync, which the kernels do not make).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

SHIM = r"""
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__ __restrict

struct dim3 { unsigned x = 0, y = 0, z = 0; };
// CUDA's alignment of the vector types: with -fsanitize=alignment a vector access at an
// address a GPU would fault on aborts here
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
struct Gate { int arrived = 0; unsigned long long gen = 0; };
struct Warp { std::map<unsigned, Gate> gates; unsigned long long slots[32]; };
struct Block {
  std::mutex m;
  std::condition_variable cv;
  Warp warps[32];
  std::barrier<>* bar = nullptr;
  std::vector<unsigned char> shared;
};
thread_local Block* block = nullptr;

inline void gate_wait(std::unique_lock<std::mutex>& lk, Gate& g, int n) {
  const unsigned long long gen = g.gen;
  if (++g.arrived == n) {
    g.arrived = 0;
    g.gen++;
    block->cv.notify_all();
    return;
  }
  if (!block->cv.wait_for(lk, std::chrono::seconds(20), [&] { return g.gen != gen; })) {
    std::fprintf(stderr, "emulator: warp collective never completed (a lane of the mask "
                         "did not take part): thread %u block %u\n", threadIdx.x, blockIdx.x);
    std::abort();
  }
}

// Every lane of `mask` contributes `v`; out[l] is lane l's value.
inline void exchange(unsigned mask, unsigned long long v, unsigned long long out[32]) {
  const int lane = threadIdx.x % 32;
  if (!(mask & (1u << lane))) {
    std::fprintf(stderr, "emulator: lane %d calls a collective whose mask %08x excludes it\n",
                 lane, mask);
    std::abort();
  }
  Warp& w = block->warps[threadIdx.x / 32];
  std::unique_lock<std::mutex> lk(block->m);
  Gate& g = w.gates[mask];
  const int n = __builtin_popcount(mask);
  w.slots[lane] = v;
  gate_wait(lk, g, n);
  std::memcpy(out, w.slots, sizeof(w.slots));
  gate_wait(lk, g, n);
}

inline void run(unsigned grid, unsigned blk, unsigned shared, const std::function<void()>& body) {
  for (unsigned b = 0; b < grid; ++b) {
    Block B;
    std::barrier<> bar(blk);
    B.bar = &bar;
    B.shared.assign(shared + 16, 0xAB);  // garbage, as on a GPU
    std::vector<std::thread> threads;
    threads.reserve(blk);
    for (unsigned t = 0; t < blk; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = {t, 0, 0};
        blockIdx = {b, 0, 0};
        blockDim = {blk, 1, 1};
        gridDim = {grid, 1, 1};
        block = &B;
        body();
        bar.arrive_and_drop();  // an exited thread no longer holds __syncthreads back
      });
    }
    for (auto& th : threads) th.join();
  }
}
}  // namespace emu

inline void* emu_shared() { return emu::block->shared.data(); }
inline void __syncthreads() { emu::block->bar->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  unsigned long long out[32];
  unsigned bits;
  std::memcpy(&bits, &v, 4);
  emu::exchange(mask, bits, out);
  const int lane = threadIdx.x % 32;
  const int src = (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1));
  const unsigned r = (unsigned)out[src];
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  unsigned long long out[32];
  emu::exchange(mask, 0, out);
}

inline unsigned __match_any_sync(unsigned mask, unsigned long long v) {
  unsigned long long out[32];
  emu::exchange(mask, v, out);
  unsigned peers = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask & (1u << l)) && out[l] == v) peers |= 1u << l;
  return peers;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }

inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp,
                                    unsigned long long val) {
  __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
  unsigned* u = reinterpret_cast<unsigned*>(p);
  unsigned old = __atomic_load_n(u, __ATOMIC_SEQ_CST), want;
  do {
    float f;
    std::memcpy(&f, &old, 4);
    f += v;
    std::memcpy(&want, &f, 4);
  } while (!__atomic_compare_exchange_n(u, &old, want, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
  float f;
  std::memcpy(&f, &old, 4);
  return f;
}

// the PTX conversions of _common.cuh.j2, in C++ (round to nearest even)
inline float emu_f16_to_f32(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
inline unsigned short emu_f32_to_f16(float f) {
  _Float16 x = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline unsigned short emu_f32_to_bf16(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""

_ASM = [
    (
        'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));',
        "f = emu_f16_to_f32(h);",
    ),
    (
        'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));',
        "h = emu_f32_to_f16(f);",
    ),
    (
        'asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));',
        "h = emu_f32_to_bf16(f);",
    ),
]
GXX_FLAGS = (
    "-std=c++20",
    "-O1",
    "-shared",
    "-fPIC",
    "-pthread",
    "-w",
    # a vector access at an address CUDA would fault on traps (SIGILL)
    "-fsanitize=alignment",
    "-fsanitize-undefined-trap-on-error",
)
_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")
_ENTRY = re.compile(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(')


def _params(source: str, start: int) -> list[str]:
    """The parameter types of the function whose parameter list starts at `start`."""
    end = source.index(") {", start)
    text = re.sub(r"//[^\n]*", "", source[start:end])
    types = []
    for p in text.split(","):
        p = p.replace("__restrict__", "").strip()
        name = re.search(r"(\w+)\s*$", p)
        assert name, p
        types.append(p[: name.start()].strip())
    return types


def host_source(sources: list[str]) -> str:
    """One C++ translation unit: each kernel source in a namespace of its own, plus a
    launcher `emu_launch_<entry>(grid, block, shared, args)` per entry point."""
    parts = [SHIM]
    for i, src in enumerate(sources):
        for old, new in _ASM:
            src = src.replace(old, new)
        src = _SHARED.sub(r"\1* \2 = (\1*)emu_shared();", src)
        wrappers = []
        for m in _ENTRY.finditer(src):
            entry = m.group(1)
            types = _params(src, m.end())
            call = ", ".join(f"*({t}*)a[{k}]" for k, t in enumerate(types))
            wrappers.append(
                f'extern "C" void emu_launch_{entry}(unsigned grid, unsigned block, '
                f"unsigned shared, void** a) {{\n"
                f"  emu::run(grid, block, shared, [&] {{ {entry}({call}); }});\n}}"
            )
        parts.append(f"namespace k{i} {{\n{src}\n" + "\n".join(wrappers) + f"\n}}  // k{i}\n")
    return "\n".join(parts)


class HostLauncher:
    """`Launcher` for CudaKernels that runs the kernels on the CPU (see the module doc)."""

    def __init__(self, sources: list[str], cache: Path | None = None):
        if shutil.which("g++") is None:
            raise RuntimeError("g++ is needed for the host emulation of the kernels")
        text = host_source(sorted(set(sources)))
        digest = hashlib.sha256(" ".join([*GXX_FLAGS, text]).encode()).hexdigest()[:24]
        cache = cache or Path(tempfile.gettempdir()) / "embarkc-test-emulator"
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"{digest}.so"
        if not lib.exists():
            src = cache / f"{digest}.cc"
            src.write_text(text)
            tmp = cache / f"{digest}.{os.getpid()}.so"
            cmd = ["g++", *GXX_FLAGS, str(src), "-o", str(tmp)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"g++ failed on the emulated kernels:\n{done.stderr[:4000]}")
            tmp.replace(lib)
        self.lib = ctypes.CDLL(str(lib))
        self.compiled = len(set(sources))
        self.launches: list[tuple[str, int, int]] = []

    def launch(self, source, entry, grid, block, shared, args) -> None:
        fn = getattr(self.lib, f"emu_launch_{entry}")
        conv = {
            "ptr": ctypes.c_void_p,
            "i64": ctypes.c_int64,
            "f32": ctypes.c_float,
            "f64": ctypes.c_double,
        }
        values = [conv[kind](value) for kind, value in args]
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        fn(grid, block, shared, ptrs)
        self.launches.append((entry, grid, block))
