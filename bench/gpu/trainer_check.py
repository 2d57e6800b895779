"""GPU check of the generated trainer (a section of bench/gpu/run.sh, or run alone).

bench/gpu/tiny1.embark (specs/tiny.embark's tables and model on one GPU, one table of each
cluster kind) compiled by `embarkc compile`, then its train.py run in one process:

1. exact: `train.py --device cuda --exact` (NCCL, fp64 sums by the torch kernels on the
   GPU) against `train.py --reference --exact --device cuda`: every table equal, losses
   within 1e-9; and against the reference on the CPU, whose dense model rounds
   differently: losses within 1e-6;
2. kernels: `train.py --device cuda --numerics fp32` (NCCL and the generated CUDA
   kernels, each checked against the torch path on its first call) against `--reference
   --numerics fp32` on the same device: the start line names
   the generated kernels, the first 10 losses agree within 1e-5 (later ones drift apart by
   fp32 summation order under adagrad and adam, see train.py --exact), the loss falls;
3. resume: the kernels run checkpointed every 10 steps, resumed from step 10 in a new
   process: it ends within 1e-5 of the uninterrupted run (table scale 0.05).

The program: bench/gpu/.build/tiny1 when bench/gpu/prepare.sh made it (on a machine with
embarkc's dependencies), else compiled here when embarkc imports. train.py needs
embark_runtime (this checkout's runtime/, put on the path here) and pydantic; prepare.sh
downloads the wheels that the GPU machine lacks.

    python bench/gpu/trainer_check.py [--device cuda|cpu] [--steps 30] [--out PATH]

`--device cpu` runs the same checks on the CPU (the tests do; it proves the harness, not
the GPU). Exit code: 0 every check passed, 1 one failed, 2 it cannot run (no CUDA device,
no program, a missing package).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny1.embark"
BUILT = HERE / ".build" / "tiny1"


class CannotRun(Exception):
    """The check cannot run here (the message says why)."""


def program_dir(work: Path) -> Path:
    """The compiled tiny1 program: prepare.sh's, or compiled now into `work`."""
    if (BUILT / "train.py").is_file():
        return BUILT
    try:
        sys.path.insert(0, str(ROOT))
        from embarkc.cli import main as embarkc
    except ImportError as e:
        raise CannotRun(
            f"no compiled program at {BUILT} and embarkc does not import here ({e}); run "
            "bench/gpu/prepare.sh where embarkc's dependencies are and carry bench/gpu/.build"
        ) from None
    out = work / "tiny1"
    if embarkc(["compile", str(SPEC), "-o", str(out), "-q"]) != 0:
        raise CannotRun(f"embarkc compile {SPEC} failed")
    return out


def runtime_path(work: Path) -> str:
    """A PYTHONPATH on which `import embark_runtime` finds this checkout's runtime/."""
    link = work / "pypath" / "embark_runtime"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(ROOT / "runtime", target_is_directory=True)
    parts = [str(link.parent), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else "no output"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(path: Path) -> list[float]:
    return [r["loss"] for r in records(path) if not r.get("eval")]


def tables(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def loss_diff(a: list[float], b: list[float]) -> float:
    """The largest difference of two runs' losses, step by step."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def max_diff(a: Path, b: Path) -> float:
    ta, tb = tables(a), tables(b)
    if sorted(ta) != sorted(tb):
        return float("inf")
    return max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)


class Checker:
    def __init__(self, program: Path, device: str, steps: int, work: Path):
        self.program, self.device, self.steps, self.work = program, device, steps, work
        self.env = {**os.environ, "PYTHONPATH": runtime_path(work), "OMP_NUM_THREADS": "4"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(k, None)
        self.lines: list[str] = []
        self.failed = 0

    def train(self, name: str, *args: str) -> tuple[str, Path, Path]:
        """Run train.py with `args`; returns (stdout, its log, its exported tables)."""
        log, npz = self.work / f"{name}.jsonl", self.work / f"{name}.npz"
        cmd = [sys.executable, str(self.program / "train.py"), "--quiet", "--steps"]
        cmd += [str(self.steps), "--log-json", str(log), "--export-embeddings", str(npz), *args]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=240)
        if r.returncode != 0:
            raise RuntimeError(f"{name}: train.py exited {r.returncode}: {r.stderr[-1500:]}")
        self.lines.append(f"* `{name}`: {time.perf_counter() - start:.1f} s")
        return r.stdout, log, npz

    def check(self, what: str, ok: bool, detail: str) -> None:
        self.lines.append(f"* {'ok' if ok else '**FAILED**'}: {what} ({detail})")
        self.failed += 0 if ok else 1

    def run(self) -> None:
        dev = ["--device", self.device]
        on_gpu = self.device == "cuda"
        # 1. exact mode on the device against the exact reference on the same device
        out, log_x, npz_x = self.train("exact", *dev, "--exact", "--eval-batches", "1")
        ref_out, log_r, npz_r = self.train("reference-exact", "--reference", "--exact", *dev)
        backend = "backend nccl" if on_gpu else "backend gloo"
        self.check(f"exact: runs on {backend}", backend in out, first_line(out))
        where = f"device {self.device}"
        self.check(f"exact: the reference runs on {where}", where in ref_out, first_line(ref_out))
        d = max_diff(npz_x, npz_r)
        self.check("exact: the reference's tables", d <= 1e-7, f"max difference {d:.3g}")
        lx, lr = losses(log_x), losses(log_r)
        dl = loss_diff(lx, lr)
        self.check("exact: the reference's losses", dl <= 1e-9, f"max difference {dl:.3g}")
        if on_gpu:
            # across devices the dense model's fp64 products round differently (cuBLAS and
            # the CPU sum in other orders); adagrad's g / sqrt(sum g^2) turns a last-bit
            # difference of a tiny gradient into a visible one, so only the losses compare
            _, log_c, npz_c = self.train(
                "reference-exact-cpu", "--reference", "--exact", "--device", "cpu"
            )
            lc = losses(log_c)
            dl = loss_diff(lx, lc)
            self.check("exact: the CPU reference's losses", dl <= 1e-6, f"max difference {dl:.3g}")
            self.lines.append(
                f"* exact: tables differ from the CPU reference's by at most "
                f"{max_diff(npz_x, npz_c):.3g} (the dense model's rounding on each device)"
            )
        # 2. the generated kernels (fp32) against the fp32 reference
        ck = self.work / "ckpt"
        fp32 = ("--numerics", "fp32")
        out, log_k, npz_k = self.train(
            "kernels", *dev, *fp32, "--checkpoint-dir", str(ck), "--checkpoint-every", "10"
        )
        _, log_f, npz_f = self.train("reference", "--reference", *fp32, *dev)
        if on_gpu:
            self.check(
                "kernels: the generated CUDA kernels ran",
                "generated CUDA kernels" in out,
                first_line(out),
            )
        lk, lf = losses(log_k), losses(log_f)
        dl = loss_diff(lk[:10], lf[:10])
        self.check(
            "kernels: the reference's first 10 losses", dl <= 1e-5, f"max difference {dl:.3g}"
        )
        falls = float(np.mean(lk[-5:])) < float(np.mean(lk[:5])) - 0.02
        self.check(
            "kernels: the loss falls", falls, f"{np.mean(lk[:5]):.4f} -> {np.mean(lk[-5:]):.4f}"
        )
        self.lines.append(
            f"* kernels: tables after {self.steps} steps differ from the fp32 reference by at "
            f"most {max_diff(npz_k, npz_f):.3g} (fp32 summation order, see --exact)"
        )
        # 3. resume from the step-10 checkpoint in a new process
        _, _, npz_c = self.train("resumed", *dev, *fp32, "--resume", str(ck / "step-10"))
        d = max_diff(npz_k, npz_c)
        self.check(
            "resume from step 10: the uninterrupted run's tables",
            d <= 1e-5,
            f"max difference {d:.3g}",
        )


def run_checks(device: str, steps: int) -> tuple[list[str], int]:
    """The report lines and the number of failed checks; raises CannotRun."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CannotRun("no CUDA device")
    try:
        import pydantic  # noqa: F401
    except ImportError:
        raise CannotRun(
            "pydantic is not installed (train.py reads plan.json with it): carry the wheels "
            "bench/gpu/prepare.sh downloads"
        ) from None
    with tempfile.TemporaryDirectory(prefix="embark-trainer-check-") as tmp:
        work = Path(tmp)
        checker = Checker(program_dir(work), device, steps, work)
        checker.lines.append(f"program: {checker.program}, {steps} steps, device {device}")
        checker.run()
    return checker.lines, checker.failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, help="also write the markdown lines here")
    args = ap.parse_args(argv)
    try:
        lines, failed = run_checks(args.device, args.steps)
    except CannotRun as e:
        print(f"bench/gpu/trainer_check: cannot run: {e}", file=sys.stderr)
        return 2
    lines.append("all trainer checks passed" if not failed else f"FAILED: {failed} checks")
    text = "\n".join(["## The generated trainer on the device", "", *lines]) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
