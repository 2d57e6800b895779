"""Host waits per training step of the trainer's clusters on the generated CUDA kernels,
run on the CPU by the host emulation (tests/cuda_emulator.py) and counted by
tests/cuda_syncs.py: a one-rank plan with dense and sparse dp, rb and ub clusters
(tests/test_cuda_syncs.py's `_clusters_plan`). Prints the waits of a step after the first,
verified one, by phase and by place.

    python bench/cluster_waits.py [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from cuda_emulator import HostLauncher
    from cuda_syncs import HostWaits
    from mp_harness import random_global_batch
    from test_cuda_syncs import _backward_waits, _clusters_plan

    from embark_runtime.cuda_kernels import CudaKernels
    from embark_runtime.embedding import ShardedEmbeddings
    from embarkc.codegen import cuda

    plan = _clusters_plan()
    src = cuda.render_instantiations(cuda.kernel_instantiations(plan), arch="sm_90")
    launcher = HostLauncher([t for p, t in src.items() if p.endswith(".cu")])
    kernels = CudaKernels(sources=src, device="cpu", launcher=launcher, verify=True)
    emb = ShardedEmbeddings(plan, 0, 1, kernels=kernels, seed=3)
    forward: list = []
    backward: list = []
    for step in range(max(2, args.steps)):
        with HostWaits() as w:
            out = emb(random_global_batch(plan, step, seed=5))
        forward = w.waits
        backward = _backward_waits(emb, sum(v.sum() for v in out.values()))
    print("| phase | waits a step | where |")
    print("|---|---:|---|")
    for name, waits in (("distribute + forward", forward), ("backward + updates", backward)):
        where = Counter(w for _, w in waits)
        places = ", ".join(f"{w.split()[-1]} {n}" for w, n in sorted(where.items()))
        print(f"| {name} | {len(waits)} | {places} |")
    print(
        f"\ntables: {len(plan.tables)}; kernel calls on the torch path: {sum(kernels.fallbacks.values())}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
