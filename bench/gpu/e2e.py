"""Whole training steps on one GPU: embarkc's generated trainer pieces against a plain
PyTorch DLRM of the same model, in the same run.

The model is specs/criteo_kaggle.embark on one GPU (its 26 tables of dim 16, sgd; the
DLRM bottom and top MLPs with the dot interaction), compiled by `embarkc compile` with
the ids a sample carries set per variant:

    h1     one id a feature (the spec as written)
    h8     8 ids a feature, every bag full
    multi  `hotness mean 4 max 16`: bags of 1 to 16 ids

A step of each side, on the same synthetic batches (ids uniform over each table):
* embarkc: the generated train.py's dense model (embark_runtime.dense.DLRMDense with its
  DenseConfig and dense optimizer), every feature pooled by the generated CUDA kernels
  (`kernels_for(kernels/, device)`: embark_runtime.cuda_kernels.CudaKernels) and its
  table updated by the fused backward + sparse update, which never waits for the device;
  on a CPU (or without cupy) the runtime's torch path, pooled_backward + sparse_update;
* DLRM: one torch.nn.EmbeddingBag(mode="sum", sparse=True) per table, the same dense model
  and initial weights, torch.optim.SGD (Adagrad for adagrad tables) on the sparse
  gradients, and the same dense optimizer.
Samples per second of each (steps timed back to back after a warm-up, one wait for the
device at the end), their ratio, the loss of both sides after the timed steps (the same
math: they agree to fp32 summation order), and on CUDA the host waits of one embarkc
step counted by torch.cuda.set_sync_debug_mode (the dense model's own, if any, included).

    python bench/gpu/e2e.py --prepare                 # where embarkc is: compile the variants
    python bench/gpu/e2e.py --out bench/gpu/e2e.md    # on the GPU (run.sh runs it)
    python bench/gpu/e2e.py --device cpu --rows-cap 1000 --batch 64 --steps 3

The programs come from bench/gpu/.build/e2e_<variant> (made by --prepare, which
bench/gpu/prepare.sh runs) or are compiled into a temporary folder when embarkc imports.
Exit code: 0 measured (and both sides' losses agree), 1 they disagree, 2 it cannot run
(no CUDA device for --device cuda, no program, a missing package).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = HERE / ".build"
SPEC = ROOT / "specs" / "criteo_kaggle.embark"
VARIANTS = {"h1": "hotness 1", "h8": "hotness 8", "multi": "hotness mean 4 max 16"}
"""The `defaults` hotness line of each variant."""
LOSS_RTOL = 1e-3
"""How far apart the two sides' losses may end (fp32 sums in another order, sgd steps)."""


class CannotRun(Exception):
    """The bench cannot run here (the message says why)."""


def variant_spec(variant: str) -> str:
    """criteo_kaggle's text on one GPU with the variant's hotness."""
    text = SPEC.read_text()
    text, n = re.subn(r"(?m)^  nodes 1$", "  nodes 1\n  gpus_per_node 1", text)
    text, m = re.subn(r"(?m)^  hotness 1$", f"  {VARIANTS[variant]}", text)
    if n != 1 or m != 1:
        raise CannotRun(f"{SPEC}: no `nodes 1` or `hotness 1` line to set (was it edited?)")
    return f"# bench/gpu/e2e.py variant {variant} of {SPEC.name}, on one GPU\n" + text


def compile_variant(variant: str, out: Path) -> Path:
    """`embarkc compile` of the variant into `out`; CannotRun when embarkc is not here."""
    try:
        sys.path.insert(0, str(ROOT))
        from embarkc.cli import main as embarkc
    except ImportError as e:
        raise CannotRun(
            f"no compiled program for {variant} in {BUILD} and embarkc does not import here "
            f"({e}); run `python bench/gpu/e2e.py --prepare` where embarkc is and carry "
            "bench/gpu/.build"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    spec = out.parent / f"e2e_{variant}.embark"
    spec.write_text(variant_spec(variant))
    if embarkc(["compile", str(spec), "-o", str(out), "-q"]) != 0:
        raise CannotRun(f"embarkc compile {spec} failed")
    return out


def program_dir(variant: str, work: Path) -> Path:
    built = BUILD / f"e2e_{variant}"
    if (built / "train.py").is_file():
        return built
    return compile_variant(variant, work / f"e2e_{variant}")


def load_program(folder: Path) -> Any:
    """The generated train.py's PROGRAM (its dense model, optimizer, plan and kernels)."""
    sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("embark_runtime") is None:
        # this checkout's runtime/ as embark_runtime, without installing it (the GPU
        # machine has no install of this repository)
        link = Path(tempfile.mkdtemp(prefix="embark-e2e-path-")) / "embark_runtime"
        link.symlink_to(ROOT / "runtime", target_is_directory=True)
        sys.path.insert(0, str(link.parent))
    spec = importlib.util.spec_from_file_location(f"train_{folder.name}", folder / "train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:
        raise CannotRun(f"{folder / 'train.py'} does not import ({e})") from None
    return mod.PROGRAM


@dataclass
class Model:
    """What both sides train: the plan's tables and features, sizes as run."""

    program: Any
    tables: list[Any]
    rows: dict[str, int]
    features: list[Any]


def model_of(program: Any, rows_cap: int | None) -> Model:
    from embark_runtime.plan import load_plan

    plan = load_plan(program.plan_path)
    rows = {t.name: min(t.rows, rows_cap) if rows_cap else t.rows for t in plan.tables}
    return Model(program, list(plan.tables), rows, list(plan.features))


def make_batches(model: Model, batch: int, count: int, device, seed: int) -> list[dict]:
    """`count` synthetic batches on `device`: dense features, labels, and per feature the
    ids and bag offsets (fixed bags of the hotness, or 1 to max ids, `hotness` on average)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        feats = {}
        for f in model.features:
            if f.fixed or f.bag_max == 1:
                lengths = torch.full((batch,), f.bag_max, dtype=torch.int64)
            else:
                # 1 + Binomial(max - 1, p): bags of 1 to max ids, `hotness` on average
                p = (f.hotness - 1) / (f.bag_max - 1)
                draws = torch.rand(batch, f.bag_max - 1, generator=gen) < p
                lengths = 1 + draws.sum(1)
            offsets = torch.zeros(batch + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            ids = torch.randint(0, model.rows[f.table], (int(offsets[-1]),), generator=gen)
            feats[f.name] = (ids.to(device), offsets.to(device))
        dense = torch.randn(batch, model.program.dense.dense_features, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append({"dense": dense.to(device), "labels": labels.to(device), "feats": feats})
    return out


def initial_tables(model: Model, seed: int) -> dict[str, Any]:
    """fp32 weights of every table, uniform in [-0.05, 0.05) (the same for both sides)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        t.name: (torch.rand(model.rows[t.name], t.dim, generator=gen) - 0.5) * 0.1
        for t in model.tables
    }


class EmbarkStep:
    """One training step through the runtime's pieces: the kernels' pooled forward, the
    generated dense model, the fused backward + sparse update of every feature."""

    def __init__(self, model: Model, kernels, weights: dict, device) -> None:
        import torch

        from embark_runtime.dense import DLRMDense, make_optimizer
        from embark_runtime.optim import new_state

        self.model, self.kernels, self.device = model, kernels, device
        self.tables = {t.name: t for t in model.tables}
        self.weights = {n: w.to(device).clone() for n, w in weights.items()}
        self.state = {
            t.name: new_state(t.optimizer, model.rows[t.name], t.dim, t.optimizer_params, device)
            for t in model.tables
        }
        self.dense = DLRMDense(model.program.dense).to(device)
        self.opt = make_optimizer(self.dense.parameters(), model.program.optimizer)
        self.fused = hasattr(kernels, "pooled_backward_update")
        self._torch = torch

    def __call__(self, b: dict) -> Any:
        torch = self._torch
        k, feats = self.kernels, b["feats"]
        bottom = self.dense.bottom_forward(b["dense"])
        pooled = []
        for f in self.model.features:
            ids, offsets = feats[f.name]
            out = k.pooled_forward(self.weights[f.table], ids, offsets, None, f.pooling)
            pooled.append(out.requires_grad_())
        logits = self.dense(b["dense"], pooled, bottom=bottom)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b["labels"])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        for f, p in zip(self.model.features, pooled, strict=True):
            ids, offsets = feats[f.name]
            t = self.tables[f.table]
            w, s = self.weights[f.table], self.state[f.table]
            if self.fused:
                k.pooled_backward_update(
                    w, s, p.grad, ids, offsets, None, f.pooling, t.optimizer, t.optimizer_params
                )
            else:
                rows, grads = k.pooled_backward(p.grad, ids, offsets, None, f.pooling, w.shape[0])
                k.sparse_update(w, s, rows, grads, t.optimizer, t.optimizer_params)
        return loss.detach()


class TorchDLRMStep:
    """The same model in plain PyTorch: nn.EmbeddingBag(sparse=True) per table."""

    def __init__(self, model: Model, weights: dict, device) -> None:
        import torch
        from torch import nn

        from embark_runtime.dense import DLRMDense, make_optimizer

        self.model = model
        self.bags = nn.ModuleDict()
        for t in model.tables:
            bag = nn.EmbeddingBag(
                model.rows[t.name], t.dim, mode="sum", sparse=True, include_last_offset=True
            )
            with torch.no_grad():
                bag.weight.copy_(weights[t.name])
            self.bags[t.name] = bag
        self.bags.to(device)
        self.sparse_opts = []
        for t in model.tables:
            p, lr = [self.bags[t.name].weight], t.optimizer_params.lr
            if t.optimizer == "sgd":
                self.sparse_opts.append(torch.optim.SGD(p, lr=lr))
            elif t.optimizer in ("adagrad", "rowwise_adagrad"):  # torch has no rowwise one
                self.sparse_opts.append(torch.optim.Adagrad(p, lr=lr))
            else:
                self.sparse_opts.append(torch.optim.SparseAdam(p, lr=lr))
        self.dense = DLRMDense(model.program.dense).to(device)
        self.opt = make_optimizer(self.dense.parameters(), model.program.optimizer)
        self._torch = torch

    def __call__(self, b: dict) -> Any:
        torch = self._torch
        bottom = self.dense.bottom_forward(b["dense"])
        pooled = [self.bags[f.table](*b["feats"][f.name]) for f in self.model.features]
        logits = self.dense(b["dense"], pooled, bottom=bottom)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b["labels"])
        self.opt.zero_grad(set_to_none=True)
        for o in self.sparse_opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        for o in self.sparse_opts:
            o.step()
        return loss.detach()


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable, batches: list, warmup: int, steps: int, device) -> tuple[float, Any]:
    """(seconds a step, the last loss): `steps` steps back to back after `warmup`."""
    loss = None
    for i in range(warmup):
        loss = step(batches[i % len(batches)])
    _sync(device)
    t = time.perf_counter()
    for i in range(steps):
        loss = step(batches[(warmup + i) % len(batches)])
    _sync(device)
    return (time.perf_counter() - t) / steps, loss


def host_waits(step: Callable, batch: dict, device) -> int | None:
    """Host waits for the device in one step, by torch's sync debug mode (CUDA only)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@dataclass
class Row:
    variant: str
    ids_per_sample: float
    embark_sps: float
    torch_sps: float
    embark_loss: float
    torch_loss: float
    waits: int | None
    kernels: str
    fallbacks: int = 0

    @property
    def agree(self) -> bool:
        return math.isclose(self.embark_loss, self.torch_loss, rel_tol=LOSS_RTOL, abs_tol=1e-6)


def run_variant(
    variant: str,
    program: Any,
    device: str,
    batch: int,
    steps: int,
    warmup: int,
    rows_cap: int | None,
    kernels=None,
) -> Row:
    """Both sides of one variant; `kernels` replaces the runtime's choice (the tests pass
    the generated kernels run by the host emulation)."""
    import torch

    from embark_runtime.cuda_kernels import kernels_for

    model = model_of(program, rows_cap)
    if kernels is None:
        kernels, why = kernels_for(program.kernels_dir, device, verify=True)
    else:
        why = f"{getattr(kernels, 'name', type(kernels).__name__)} kernels (given)"
    batch = batch or model_batch(model) or 8192
    batches = make_batches(model, batch, 4, device, seed=1)
    weights = initial_tables(model, seed=2)
    ours = EmbarkStep(model, kernels, weights, device)
    theirs = TorchDLRMStep(model, weights, device)
    t_ours, loss_ours = timed(ours, batches, warmup, steps, device)
    t_theirs, loss_theirs = timed(theirs, batches, warmup, steps, device)
    waits = host_waits(ours, batches[0], device)
    if hasattr(kernels, "check_rows"):
        kernels.check_rows()
    ids = sum(int(batches[0]["feats"][f.name][0].numel()) for f in model.features) / batch
    del ours, theirs
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return Row(
        variant,
        ids / len(model.features),
        batch / t_ours,
        batch / t_theirs,
        float(loss_ours),
        float(loss_theirs),
        waits,
        why,
        sum(getattr(kernels, "fallbacks", {}).values()),
    )


def model_batch(model: Model) -> int | None:
    from embark_runtime.plan import load_plan

    m = load_plan(model.program.plan_path).model
    return m.batch_size if m is not None else None


def table(rows: list[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| variant | ids a feature | embarkc (samples/s) | PyTorch DLRM, EmbeddingBag "
        "(samples/s) | embarkc / DLRM | loss embarkc / DLRM | host waits, one embarkc step |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        ratio = r.embark_sps / r.torch_sps
        mark = "" if r.agree else " (DISAGREE)"
        lines.append(
            f"| {r.variant} | {r.ids_per_sample:.2f} | {r.embark_sps:,.0f} | "
            f"{r.torch_sps:,.0f} | {ratio:.2f}x | {r.embark_loss:.6f} / {r.torch_loss:.6f}"
            f"{mark} | {'-' if r.waits is None else r.waits} |"
        )
    kinds = sorted({r.kernels for r in rows})
    fell = sum(r.fallbacks for r in rows)
    lines += ["", "embarkc's kernels: " + "; ".join(kinds), ""]
    if fell:
        lines += [f"({fell} calls of the generated kernels went to the torch path)", ""]
    return "\n".join(lines)


def prepare() -> int:
    """Compile every variant into bench/gpu/.build (needs embarkc)."""
    for v in VARIANTS:
        out = compile_variant(v, BUILD / f"e2e_{v}")
        print(f"compiled {v} into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="h1,h8,multi")
    ap.add_argument("--batch", type=int, default=0, help="samples a step (default the spec's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rows-cap", type=int, default=0, help="cap every table's rows (CPU runs)")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--prepare", action="store_true", help="compile the variants and exit")
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 without a CUDA device")
    args = ap.parse_args(argv)
    try:
        if args.prepare:
            return prepare()
        variants = [v for v in args.variants.split(",") if v]
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise CannotRun(
                f"--variants: unknown {', '.join(bad)}; choose from {', '.join(VARIANTS)}"
            )
        if args.steps < 1 or args.warmup < 0 or args.batch < 0 or args.rows_cap < 0:
            raise CannotRun(
                "--steps must be at least 1; --warmup, --batch, --rows-cap not negative"
            )
        try:
            import torch
        except ImportError as e:
            raise CannotRun(f"torch does not import ({e})") from None
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            if args.allow_no_gpu:
                print("e2e: no CUDA device; skipped (--allow-no-gpu)")
                return 0
            raise CannotRun("no CUDA device (use --device cpu for a check of the harness)")
        rows = []
        with tempfile.TemporaryDirectory(prefix="embark-e2e-") as work:
            for v in variants:
                program = load_program(program_dir(v, Path(work)))
                rows.append(
                    run_variant(
                        v,
                        program,
                        args.device,
                        args.batch,
                        args.steps,
                        args.warmup,
                        args.rows_cap or None,
                    )
                )
                print(f"e2e: {v} done", file=sys.stderr, flush=True)
    except CannotRun as e:
        print(f"e2e: cannot run: {e}", file=sys.stderr)
        return 2
    import torch

    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    batch = f"batch {args.batch}" if args.batch else "the spec's batch"
    header = (
        f"## Training steps of criteo_kaggle on one device ({where}; {batch}, "
        f"{args.steps} steps after {args.warmup}; torch {torch.__version__}"
        + (f"; rows capped at {args.rows_cap}" if args.rows_cap else "")
        + ")"
    )
    text = table(rows, header)
    print(text)
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{args.out}.tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(args.out)
        except OSError as e:
            print(f"e2e: cannot write {args.out} ({e.strerror})", file=sys.stderr)
            return 2
    return 0 if all(r.agree for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
