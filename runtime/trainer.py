"""The training loop that every generated train.py drives.

A generated train.py holds what the plan does not say (a `TrainProgram`: the dense model,
its optimizer, and the digest of the plan it was compiled from) and calls `main(program)`.
`main` parses the command line, checks that plan.json is that plan (`plan_digest`), and
runs one of:

* the sharded trainer (under torchrun, one process per rank of the plan): the plan's
  embedding clusters (embark_runtime.embedding.ShardedEmbeddings, whose backward performs
  the communication and the fused sparse optimizer update), the DLRM dense model
  replicated on every rank, NCCL and the generated CUDA kernels when CUDA is available,
  gloo and the torch kernels otherwise;
* the reference trainer (`--reference`, one process, no torch.distributed): the same
  tables unsharded (ReferenceEmbeddings) and the same dense model on the whole global batch.

Both compute the same thing: the loss of a step is the mean binary cross-entropy over the
global batch; each rank's share is the sum over its samples divided by the global batch,
and the dense gradients are SUM-all-reduced (embark_runtime.dense). Trained weights agree
with the reference up to floating-point summation order.

`--numerics exact` (`--exact`) removes the summation order from the comparison: the
embedding sums and the values on the wire are fp64 (TorchKernels(torch.float64), also on
CUDA), the dense model runs in fp64, and every embedding gradient is rounded to fp32 once
before the table's optimizer. The sharded run then trains the same fp32 tables as the
exact reference (bit for bit on tiny.embark, whose adagrad and adam amplify fp32
rounding differences until the runs drift apart), at twice the communicated bytes and
fp64 dense compute. It is the default (`--numerics auto`) on the CPU, where runs are for
development and checking, and for `--reference`; on CUDA the default is fp32 with the
generated kernels. The start line says which.

Fault tolerance: checkpoints are written atomically every `--checkpoint-every` steps
(embark_runtime.checkpoint); `--resume` continues from the latest one, also after torchrun
restarted the group, and from a checkpoint written under another plan (resharded on load).
The data of step s is a pure function of (seed, s), so a resumed run sees exactly the
batches the interrupted one would have.

For tests, EMBARK_FAULT_AT_STEP=N makes rank EMBARK_FAULT_RANK (default 1) kill itself
with SIGKILL at the start of step N, once: it first creates the marker file
EMBARK_FAULT_MARKER (default `<checkpoint-dir>/.fault-injected`) and does nothing when
the marker exists.

User mistakes (wrong world size, a plan.json that does not match, a missing checkpoint)
end with `train.py: error: ...` and exit code 2, never a traceback. So do failures of one
rank during training (a malformed record in its slice of a batch, a full disk under a
checkpoint or the --log-json file): the rank carries its error into the step's one
all-reduce, every rank learns of it there, a checkpoint of the last whole step is written
when --checkpoint-dir is given, and all of them stop together, each saying its part.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import numpy as np
import torch

from embark_runtime.cache import cache_text, host_tier_clusters, stats_flat, stats_record
from embark_runtime.comm import Traffic
from embark_runtime.dense import (
    DenseConfig,
    DenseOptimizerConfig,
    DenseStateError,
    DLRMDense,
    MixedPrecision,
    allreduce_gradients,
    check_dense_state,
    load_optimizer_state_tensors,
    local_loss,
    make_optimizer,
    optimizer_state_tensors,
    set_rate,
)
from embark_runtime.files import RunPath, run_path_clash
from embark_runtime.formatting import format_mib
from embark_runtime.metrics import log_loss, roc_auc
from embark_runtime.optim import schedule_clusters
from embark_runtime.plan import (
    Plan,
    PlanError,
    check_complete,
    dense_precision,
    dense_schedule,
    load_plan,
    plan_digest,
)
from embark_runtime.prefetch import Prefetcher
from embark_runtime.schedules import rate_at as schedule_rate

EXIT_USER_ERROR = 2

EVAL_STEP_BASE = 1 << 30
"""Synthetic held-out data: evaluation batch i is the batch of step EVAL_STEP_BASE + i,
a step no training run reaches, so evaluation samples are never trained on."""

DENSE_PREFIX = "dense."
DENSE_OPT_PREFIX = "dense_opt."
SCALER_PREFIX = "dense_scaler."
"""The fp16 loss scaler's state in a checkpoint's extra (MixedPrecision.scaler_state)."""


_T = TypeVar("_T")


class TrainerError(Exception):
    """A user-facing error of the generated trainer (printed without a traceback)."""


class _Stopped(TrainerError):
    """An error every rank of the job knows of (see `_Sharded._together`): each rank says
    its part, then they all wait for each other before exiting, so that torchrun, which
    stops the other ranks when the first one exits, cuts no rank's message off. `shared`:
    every rank failed alike (a missing checkpoint, say): rank 0 alone says it."""

    def __init__(self, message: str, shared: bool = False):
        super().__init__(message)
        self.shared = shared


@dataclass(frozen=True)
class TrainProgram:
    """What a generated train.py bakes in (see templates/program/train.py.j2): where its
    plan.json and kernels are, the digest of the plan it was compiled from, and the dense
    model with its optimizer. The layout (topology, batch, tables, clusters, cells,
    features) is read from plan.json alone, which `check_plan` holds to that digest.
    """

    name: str
    plan_path: Path
    kernels_dir: Path
    plan_sha256: str
    """`embark_runtime.plan.plan_digest` of the plan train.py was compiled from."""
    dense: DenseConfig
    optimizer: DenseOptimizerConfig

    def check_plan(self, plan: Plan) -> None:
        """Raise TrainerError when `plan` is not the plan this program was compiled from
        (plan.json edited or replaced after `embarkc compile`): the generated kernels, the
        dense model's input widths and the README were made for that plan."""
        got = plan_digest(plan)
        if got != self.plan_sha256:
            path = _shown(self.plan_path)
            folder = _shown(self.plan_path.parent)
            raise TrainerError(
                f"{path} is not the plan train.py was compiled from (its digest is "
                f"{got[:12]}, train.py's PLAN_SHA256 is {self.plan_sha256[:12]}): it was "
                "edited or replaced after `embarkc compile`. Compile the spec with it "
                f"(`embarkc compile SPEC --plan {path} -o {folder}`; the plan is "
                "checked against the spec), or put back the plan.json train.py was compiled from"
            )
        widths = len(self.dense.feature_widths)
        if widths != len(plan.features):
            raise TrainerError(
                f"train.py's DENSE_MODEL reads {widths} feature(s) but {_shown(self.plan_path)} "
                f"has {len(plan.features)}: train.py was edited; recompile the spec"
            )


def _shown(path: Path) -> str:
    """`path` as a user gave it: relative to the current folder when it lies inside it
    (train.py knows its plan.json by absolute path)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- command line


def build_parser(program: TrainProgram) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {program.name} with its embarkc plan ({program.plan_path.name}).",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic data")
    p.add_argument(
        "--data",
        type=Path,
        help="Criteo TSV, HugeCTR raw or Parquet file or folder (default: synthetic)",
    )
    p.add_argument(
        "--data-format",
        choices=("auto", "criteo", "hugectr", "parquet"),
        default="auto",
        help="of --data",
    )
    p.add_argument(
        "--column-map",
        metavar="F=COL,...|JSON",
        help="read feature F from column COL (Parquet column names; Criteo's C1..C26), or "
        "from a JSON file {feature: column}",
    )
    p.add_argument(
        "--prefetch",
        type=int,
        default=2,
        metavar="N",
        help="batches a reader thread reads ahead while the step runs (0: read on the "
        "critical path; default 2)",
    )
    p.add_argument("--log-json", type=Path, help="write one JSON object per step to this file")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps (no terminal)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at end)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out global batches per eval")
    p.add_argument("--checkpoint-dir", type=Path, help="folder of periodic checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=0,
        metavar="K",
        help="keep only the newest K checkpoints in --checkpoint-dir (default 0: keep all)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="continue from a checkpoint: PATH, or the latest in --checkpoint-dir if any",
    )
    p.add_argument(
        "--export-embeddings",
        type=Path,
        metavar="PATH",
        help="at the end, write every table: a FOLDER gets a sharded export (each rank "
        "writes its own cells, no gather); x.safetensors or x.npz one whole-table file "
        "(gathered on rank 0 a table at a time); `embarkc export FOLDER -o x.safetensors` "
        "joins a folder's",
    )
    p.add_argument(
        "--init-embeddings",
        type=Path,
        metavar="PATH",
        help="start the tables from PATH (a .safetensors/.npz of whole tables by name, a "
        "sharded export or a checkpoint folder), under any plan; ignored on --resume",
    )
    p.add_argument(
        "--reference", action="store_true", help="train unsharded in one process (no torchrun)"
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="do not prefetch the next batch (the plan's estimate hides key time under the "
        "dense compute unless its hardware says `dense_flops 0`)",
    )
    p.add_argument(
        "--numerics",
        choices=("auto", "exact", "fp32"),
        default="auto",
        help="exact: fp64 sums, wire values and dense model (torch kernels), so that the "
        "sharded run equals the reference whatever the summation order, at twice the "
        "communicated bytes; fp32: the production path (the generated kernels on CUDA); "
        "auto (default): exact on the CPU and for --reference, fp32 on CUDA",
    )
    p.add_argument(
        "--exact", dest="numerics", action="store_const", const="exact", help="--numerics exact"
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        help="the dense model's compute, overriding the spec's `precision`: bf16 or fp16 "
        "(CUDA only, with dynamic loss scaling) under autocast over fp32 weights; not with "
        "--numerics exact (auto numerics then mean fp32)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to train, --reference too (auto: CUDA when present)",
    )
    p.add_argument(
        "--measure-phases",
        action="store_true",
        help="time each phase of every step (data wait, distributor, lookup, nvlink, network, "
        "dp exchange, dense, updates) per rank and slowest rank, into --log-json's records",
    )
    p.add_argument(
        "--phase-barriers",
        action="store_true",
        help="with --measure-phases: a barrier before the dense phases, so that waiting for "
        "other ranks is not counted in them (slows the step)",
    )
    p.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="torch.profiler trace of steps A to B-1 per rank (Perfetto/TensorBoard); steps "
        "count from 1, as the console, the log and the checkpoints' step-N",
    )
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=Path("profile"),
        help="folder of the --profile-steps traces (default ./profile)",
    )
    p.add_argument(
        "--tensorboard", type=Path, metavar="DIR", help="TensorBoard scalars to this folder"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="check the options, outputs, plan.json, the checkpoint to resume and whether "
        "the tables fit this machine's memory in one process, then exit (0, or 2 with the "
        "problem) without training; launch.sh runs it before torchrun",
    )
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in (
        "steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "keep_checkpoints",
        "prefetch",
    ):
        if getattr(args, name) < 0:
            raise TrainerError(f"--{name.replace('_', '-')} must not be negative")
    if not 0 <= args.seed <= 2**31 - 1:
        raise TrainerError(f"--seed must lie in [0, {2**31 - 1}], got {args.seed}")
    if args.log_every == 0:
        args.log_every = 1
    if args.checkpoint_every and args.checkpoint_dir is None:
        raise TrainerError("--checkpoint-every needs --checkpoint-dir")
    if args.keep_checkpoints and args.checkpoint_dir is None:
        raise TrainerError("--keep-checkpoints needs --checkpoint-dir")
    if args.resume == "" and args.checkpoint_dir is None:
        raise TrainerError("--resume without a PATH needs --checkpoint-dir")
    if args.reference and (args.checkpoint_dir is not None or args.resume is not None):
        raise TrainerError("--reference does not write or read checkpoints")
    if args.reference and args.export_embeddings is not None:
        if _sharded_export(args.export_embeddings):
            raise TrainerError(
                f"--export-embeddings {args.export_embeddings}: --reference writes one "
                "whole-table file: give a name ending in .safetensors or .npz"
            )
    exported = args.export_embeddings
    if exported is not None and exported.suffix not in (".safetensors", ".npz"):
        if exported.suffix and not exported.is_dir():
            raise TrainerError(
                f"--export-embeddings {exported}: the name must end in .safetensors or .npz "
                "(one whole-table file), or be a folder name without a suffix (a sharded "
                "export)"
            )
    if args.init_embeddings is not None and not args.init_embeddings.exists():
        raise TrainerError(f"--init-embeddings {args.init_embeddings}: no such file or folder")
    if args.phase_barriers and not args.measure_phases:
        raise TrainerError("--phase-barriers needs --measure-phases")
    if args.profile_steps is not None:
        from embark_runtime.phases import parse_steps

        try:
            args.profile_range = parse_steps(args.profile_steps)
        except ValueError as e:
            raise TrainerError(str(e)) from None
    if args.data is not None:
        _check_data(args.data)
    elif args.column_map is not None:
        raise TrainerError("--column-map needs --data")
    # outputs are checked before training, not when the first write fails hours later
    for flag, path, folder in (
        ("--export-embeddings", exported, exported is not None and _sharded_export(exported)),
        ("--log-json", args.log_json, False),
        ("--checkpoint-dir", args.checkpoint_dir, True),
        ("--tensorboard", args.tensorboard, True),
        ("--profile-dir", args.profile_dir if args.profile_steps else None, True),
    ):
        if path is not None:
            _check_output(flag, path, folder)
    if exported is not None and _sharded_export(exported):
        from embark_runtime.export import ExportError, check_export_folder

        try:
            check_export_folder(exported)
        except ExportError as e:
            raise TrainerError(str(e)) from None


def _sharded_export(path: Path) -> bool:
    """--export-embeddings PATH: a sharded export folder unless PATH names a whole-table
    file (.safetensors, .npz); `_check_args` refuses other suffixes (a typo, not a folder)."""
    return path.suffix not in (".safetensors", ".npz")


def _open_init(args: argparse.Namespace, plan: Plan) -> None:
    """Open --init-embeddings and check it against the plan (names, shapes, dtypes)
    before anything trains: `args.init_source` and `args.init_warnings`."""
    args.init_source, args.init_warnings = None, []
    if args.init_embeddings is None:
        return
    from embark_runtime.export import ExportError, check_against_plan, open_source

    try:
        args.init_source = open_source(args.init_embeddings)
        args.init_warnings = check_against_plan(args.init_source, plan)
    except ExportError as e:
        msg = str(e)
        raise TrainerError(
            msg if msg.startswith("--init-embeddings") else f"--init-embeddings {msg}"
        ) from None


def _check_data(path: Path) -> None:
    """--data names a regular file or a folder: a device, FIFO or socket is named for
    what it is (reading /dev/zero as Criteo TSV would never end)."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        raise TrainerError(f"--data {path}: no such file or folder") from None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = (
        "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    raise TrainerError(
        f"--data {path}: is {kind}, not a data file; give a data file (see --data-format) "
        "or a folder of them"
    )


def _check_output(flag: str, path: Path, folder: bool) -> None:
    """TrainerError when `path` (a file, or a folder with `folder`) cannot be written: it
    is of the other kind, or the folder it would go in is a file or not writable."""
    if path.exists():
        if folder and not path.is_dir():
            raise TrainerError(f"{flag} {path}: exists and is not a folder")
        if not folder and path.is_dir():
            raise TrainerError(f"{flag} {path}: is a folder (give a file name in it)")
        if not os.access(path, os.W_OK):
            raise TrainerError(f"{flag} {path}: not writable")
    parent = path if folder and path.exists() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise TrainerError(f"{flag} {path}: {parent} is not a folder")
    try:  # the one test that also holds for root and read-only or special file systems
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise TrainerError(
            f"{flag} {path}: cannot create files in {parent} ({e.strerror or e})"
        ) from None


def _check_run_paths(args: argparse.Namespace, plan_path: Path | str) -> None:
    """TrainerError when two of the run's paths clash (`embark_runtime.files.run_path_clash`):
    checked on every rank before the first step, so nothing is overwritten."""
    named: list[RunPath] = [RunPath("the plan", Path(plan_path), "input")]
    for flag, path, kind in (
        ("--export-embeddings", args.export_embeddings, "file"),
        ("--log-json", args.log_json, "file"),
        ("--checkpoint-dir", args.checkpoint_dir, "checkpoints"),
        ("--tensorboard", args.tensorboard, "folder"),
        ("--profile-dir", args.profile_dir if args.profile_steps else None, "folder"),
        ("--data", args.data, "input"),
        ("--resume", Path(args.resume) if args.resume else None, "resumed"),
    ):
        if path is not None:
            named.append(RunPath(flag, path, kind))  # type: ignore[arg-type]
    clash = run_path_clash(named)
    if clash is not None:
        raise TrainerError(clash)


def _preflight(plan: Plan, args: argparse.Namespace) -> None:
    """TrainerError when the run cannot start (`embark_runtime.preflight`): no checkpoint
    to resume where --resume says, a --data folder without data files, tables beyond this
    machine's free memory on a CPU run.
    Before any rank allocates; `--preflight` stops after it."""
    from embark_runtime import preflight

    problems = [
        preflight.resume_problem(args.resume, args.checkpoint_dir),
        preflight.data_problem(args.data),
    ]
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        # a sharded export streams each rank's own cells; a whole-table file gathers
        export = args.export_embeddings is not None and not _sharded_export(args.export_embeddings)
        problems.append(preflight.host_memory_check(plan, reference=args.reference, export=export))
    for problem in problems:
        if problem is not None:
            raise TrainerError(problem)


def main(program: TrainProgram, argv: Sequence[str] | None = None) -> int:
    """Entry point of a generated train.py; returns the process exit code."""
    args = build_parser(program).parse_args(argv)
    try:
        _check_args(args)
        _check_run_paths(args, program.plan_path)
        try:
            plan = load_plan(program.plan_path)
            check_complete(plan, program.plan_path, training=True)
        except PlanError as e:
            raise TrainerError(str(e)) from None
        program.check_plan(plan)
        args.precision = _precision(args, plan)
        _open_init(args, plan)
        _preflight(plan, args)
    except _user_errors() as e:
        # the options and plan.json are the same for every rank of a node: one says it
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _say_on_stderr(f"train.py: error: {e}")
        return EXIT_USER_ERROR
    if args.preflight:
        return 0
    try:
        if args.reference:
            return _Reference(program, plan, args).run()
        return _run_sharded(program, plan, args)
    except _user_errors() as e:
        # every rank that fails says so, naming itself: one rank's full disk or bad node
        # is then told apart from an error all of them share
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        who = f"rank {os.environ.get('RANK', '?')} of {world}: " if world > 1 else ""
        if isinstance(e, _Stopped) and e.shared:
            who = f"every rank of {world}: "
        if not (isinstance(e, _Stopped) and e.shared and os.environ.get("RANK", "0") != "0"):
            _say_on_stderr(f"train.py: error: {who}{e}")
        if isinstance(e, _Stopped):
            _wait_for_the_others()
        return EXIT_USER_ERROR


def launch(program: TrainProgram) -> NoReturn:
    """The generated train.py's `__main__`: run `main` and end the process with its code.

    A process that joined a multi-process group ends through `os._exit` once `main` has
    closed every file and destroyed the group: gloo's worker threads can still hold work
    objects at interpreter finalisation, and tearing those down then aborts the process
    (`terminate called without an active exception`, SIGABRT) after a run that
    succeeded. Everything the run writes is closed and synced before `main` returns."""
    code = main(program)
    sys.stdout.flush()
    sys.stderr.flush()
    if _JOINED_A_GROUP:
        os._exit(code)
    sys.exit(code)


_JOINED_A_GROUP = False
"""Set when this process trained in a group of several processes (`launch` then skips the
interpreter's finalisation)."""


def _say_on_stderr(line: str) -> None:
    """One line on stderr in one write: the ranks share the launcher's stderr, and print's
    separate write of the newline let two ranks' messages run into one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _wait_for_the_others() -> None:
    """Every rank is on its way out after a start-up error they all know of: meet once
    more, so that each has printed its message before the first one exits."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the message is out; a broken group changes nothing
        pass


def _user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that report a user's mistake (a bad checkpoint, launch or dataset)."""
    from embark_runtime.checkpoint import CheckpointError
    from embark_runtime.comm import CommError
    from embark_runtime.embedding import PlanNotRunnable
    from embark_runtime.export import ExportError
    from embark_runtime.readers import ReaderError

    return (TrainerError, CheckpointError, CommError, PlanNotRunnable, ReaderError, ExportError)


# --------------------------------------------------------------------------- data


class _Data:
    """Training and held-out batches: synthetic, or read from a dataset file."""

    def __init__(self, program: TrainProgram, plan: Plan, args: argparse.Namespace):
        self.path: Path | None = args.data
        if self.path is None:
            from embark_runtime.synthetic import SyntheticData

            self._synthetic = SyntheticData(
                plan, seed=args.seed, dense_features=program.dense.dense_features
            )
            self.description = f"synthetic (seed {args.seed})"
            self.held_out: int | None = None
        else:
            from embark_runtime import readers

            self._reader = readers.open_dataset(
                self.path,
                plan,
                fmt=args.data_format,
                dense_features=program.dense.dense_features,
                column_map=spec_columns(plan, args.column_map),
            )
            self.description = f"{self.path}"
            # nothing held out: evaluation cycles over the training batches
            self.held_out = self._reader.eval_batches or self._reader.train_batches

    def eval_count(self, asked: int, log: _Log) -> int:
        """The held-out global batches an evaluation reads: `asked` (--eval-batches), at
        most the distinct ones the dataset has (a warning says so when they are fewer)."""
        if self.held_out is None or asked <= self.held_out:
            return asked
        log.warn(
            f"--eval-batches {asked}: {self.path} holds out {self.held_out} global "
            f"batch{'es' if self.held_out != 1 else ''}; each evaluation reads "
            f"{'them' if self.held_out != 1 else 'it'} once"
        )
        return self.held_out

    def batch(self, step: int, rank: int, world: int) -> Any:
        if self.path is None:
            return self._synthetic.batch(step, rank, world)
        return self._reader.batch(step, rank, world)

    def global_batch(self, step: int) -> Any:
        if self.path is None:
            return self._synthetic.global_batch(step)
        return self._reader.batch(step, 0, 1)

    def eval_batch(self, index: int, rank: int, world: int) -> Any:
        if self.path is None:
            return self._synthetic.batch(EVAL_STEP_BASE + index, rank, world)
        return self._reader.eval_batch(index, rank, world)


def _tensors(
    batch: Any, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.from_numpy(np.ascontiguousarray(batch.dense, dtype=np.float32)).to(device, dtype)
    labels = torch.from_numpy(np.ascontiguousarray(batch.labels, dtype=np.float32)).to(device)
    return dense, labels


# --------------------------------------------------------------------------- logging


class _Log:
    """Progress on rank 0: a bar on a terminal, a line every `every` steps otherwise,
    and one JSON object per step to `json_path`."""

    def __init__(self, enabled: bool, total: int, every: int, json_path: Path | None, quiet: bool):
        self.enabled = enabled
        self.total = total
        self.every = every
        self.quiet = quiet or not enabled
        self.tty = sys.stdout.isatty()
        self.json: TextIO | None = None
        self.json_path = json_path
        self.error: TrainerError | None = None
        """The first failed write to the --log-json file (the run stops at the next step)."""
        if enabled and json_path is not None:
            try:
                json_path.parent.mkdir(parents=True, exist_ok=True)
                # append: a restarted group continues the same log
                self.json = json_path.open("a", buffering=1)
            except OSError as e:
                raise TrainerError(f"--log-json {json_path}: {e.strerror or e}") from None

    def warn(self, text: str) -> None:
        """A warning on stderr (rank 0), shown even with --quiet."""
        if self.enabled:
            _say_on_stderr(f"train.py: warning: {text}")

    def say(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                print("\r\x1b[2K", end="")
            print(text, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one JSON object to the --log-json file (rank 0, when asked for). A failed
        write (a full disk) ends the file's writing and is kept in `error`, for the
        trainer to stop on together with the other ranks."""
        if self.json is None:
            return
        try:
            self.json.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as e:
            self.error = TrainerError(
                f"--log-json {self.json_path}: cannot write: {e.strerror or e}"
            )
            json_file, self.json = self.json, None
            try:
                json_file.close()
            except OSError:
                pass

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.write(record)
        if self.quiet:
            return
        done = record["step"]
        text = (
            f"step {done}/{self.total}  loss {record['loss']:.5f}  "
            f"{record['samples_per_s']:,.0f} samples/s  "
            f"{format_mib(record['bytes_total'])} moved"
        )
        if self.tty:
            width = 24
            filled = int(width * done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            print(f"\r\x1b[2K[{bar}] {text}", end="" if done < self.total else "\n", flush=True)
        elif done % self.every == 0 or done == self.total:
            per_cluster = ", ".join(
                f"{c} {format_mib(v['intra'] + v['inter'])}" for c, v in record["bytes"].items()
            )
            print(f"{text} ({per_cluster}){cache_text(record.get('cache'))}", flush=True)

    def close(self) -> None:
        if self.json is not None:
            json_file, self.json = self.json, None
            try:
                json_file.close()
            except OSError as e:
                self.error = self.error or TrainerError(
                    f"--log-json {self.json_path}: cannot write: {e.strerror or e}"
                )


# --------------------------------------------------------------------------- export


def export_tables(path: Path, tables: dict[str, np.ndarray]) -> None:
    """Write `tables` ([rows, dim] float arrays by name) as float32, atomically, by the
    file's suffix (`write_table_file`)."""
    shapes = {k: (int(v.shape[0]), int(v.shape[1])) for k, v in tables.items()}
    write_table_file(path, shapes, (torch.from_numpy(np.asarray(v)) for v in tables.values()))


def write_table_file(
    path: Path, shapes: dict[str, tuple[int, int]], tables: Iterator[torch.Tensor]
) -> None:
    """Write the tables of `shapes` (name -> (rows, dim)) to `path` (.safetensors or .npz)
    as float32, taking each [rows, dim] tensor from `tables` in that order only once the
    one before it is written and released: whoever calls this holds one table at a time
    (and on a device one row chunk of it on the host), not the model
    (`embark_runtime.export.TableFileWriter`: atomic, an older file stays whole; a link
    has the file it names written, a stream is written in place). `tables` is drained
    whatever happens: a sharded run's gathers are collectives every rank takes part in.
    TrainerError when the file system refuses."""
    from embark_runtime.export import ExportError, TableFileWriter

    try:
        with TableFileWriter(path, shapes, "--export-embeddings") as out:
            for name in shapes:
                # the table lives in the chunks' generator alone: freed when written
                out.write(name, _host_chunks(next(tables)))
    except ExportError as e:
        raise TrainerError(str(e)) from None
    finally:
        for _ in tables:
            pass


def _host_chunks(table: torch.Tensor) -> Iterator[np.ndarray]:
    """A [rows, dim] table as float32 host row chunks of at most CHUNK_BYTES (views of a
    float32 table on the CPU; a device's or another dtype's copied a chunk at a time)."""
    from embark_runtime.export import CHUNK_BYTES

    rows, dim = table.shape
    step = max(1, CHUNK_BYTES // max(1, dim * 4))
    for a in range(0, rows, step):
        yield table[a : a + step].detach().float().cpu().numpy()


def load_exported(path: Path) -> dict[str, np.ndarray]:
    """Read a file written by `export_tables`."""
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return dict(load_file(str(path)))
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# --------------------------------------------------------------------------- reference


class _Reference:
    """Unsharded training in one process: ReferenceEmbeddings + the same dense model."""

    def __init__(self, program: TrainProgram, plan: Plan, args: argparse.Namespace):
        from embark_runtime.embedding import ReferenceEmbeddings

        self.program, self.plan, self.args = program, plan, args
        # the device the sharded run would use, so that a GPU run is compared with the
        # same device's rounding; exact numerics unless --numerics fp32
        self.device = _device(args)
        self.data = _Data(program, plan, args)
        self.exact = args.numerics != "fp32" and args.precision == "fp32"
        self.dtype = torch.float64 if self.exact else torch.float32
        self.precision = MixedPrecision(args.precision, self.device)
        self.schedule = dense_schedule(plan)
        self.embeddings = ReferenceEmbeddings(
            plan, seed=args.seed, accum=self.dtype, device=self.device
        )
        self.model = DLRMDense(program.dense, seed=args.seed).to(self.device, self.dtype)
        self.optimizer = make_optimizer(self.model.parameters(), program.optimizer)
        self.log = _Log(True, args.steps, args.log_every, args.log_json, args.quiet)
        self.eval_batches = self.data.eval_count(args.eval_batches, self.log)
        self.step_seconds: list[float] = []
        self.last_eval: dict[str, float] | None = None

    def _logits(self, batch: Any) -> torch.Tensor:
        dense, _ = _tensors(batch, self.device, self.dtype)
        out = self.embeddings(batch.sparse)
        embedded = self.precision.embedded([out[f.name] for f in self.plan.features])
        with self.precision.autocast():
            logits = self.model(dense, embedded)
        return self.precision.output(logits)

    def run(self) -> int:
        a = self.args
        self.log.say(
            f"{self.program.name}: reference run, unsharded, one process"
            f", {'exact (fp64 sums)' if self.exact else 'fp32'}, device {self.device}"
            f"; data {self.data.description}{_rates_line(self.program, self.plan, a)}"
        )
        started = time.perf_counter()
        if a.init_source is not None:
            from embark_runtime.export import warm_start_tables

            for w in a.init_warnings:
                self.log.warn(w)
            warm_start_tables(self.embeddings.weights, a.init_source)
            self.log.say(f"tables initialised from {a.init_embeddings}")
        with Prefetcher(self.data.global_batch, 0, a.steps, a.prefetch) as feed:
            loss_value = self._loop(feed)
        if a.export_embeddings is not None:
            write_table_file(
                a.export_embeddings,
                {t.name: (t.rows, t.dim) for t in self.plan.tables},
                (self.embeddings.weights[t.name] for t in self.plan.tables),
            )
            self.log.say(f"exported {len(self.plan.tables)} tables to {a.export_embeddings}")
        _summarize(self.log, self, time.perf_counter() - started, loss_value, 0)
        self.log.close()
        if self.log.error is not None:
            raise self.log.error
        return 0

    def _loop(self, feed: Any) -> float | None:
        """Steps [0, --steps) from `feed`; returns the last step's loss (None: no step)."""
        a = self.args
        loss_value: float | None = None
        for step in range(a.steps):
            t0 = time.perf_counter()
            self.embeddings.step = step
            set_rate(self.optimizer, self.program.optimizer.lr, self.schedule, step)
            batch, waited = feed.get(step)
            _, labels = _tensors(batch, self.device)
            loss = local_loss(self._logits(batch), labels, self.plan.batch_size)
            self.optimizer.zero_grad(set_to_none=True)
            self.precision.backward(loss)
            self.precision.step(self.optimizer)
            dt = time.perf_counter() - t0
            self.step_seconds.append(dt)
            loss_value = loss.item()
            self.log.step(
                {
                    "step": step + 1,
                    "loss": loss_value,
                    "samples_per_s": self.plan.batch_size / dt,
                    "data_wait_s": waited,
                    "bytes": {},
                    "bytes_total": 0,
                    **_rates_record(self.program, self.plan, step),
                }
            )
            if self.log.error is not None:
                raise self.log.error
            done = step + 1
            if (a.eval_every and done % a.eval_every == 0) or done == a.steps:
                self._evaluate(done)
        return loss_value

    def _evaluate(self, done: int) -> None:
        labels, scores = [], []
        with torch.no_grad():
            for i in range(self.eval_batches):
                world = self.plan.world_size
                # the same samples as the sharded run: every rank's slice, concatenated
                for rank in range(world):
                    b = self.data.eval_batch(i, rank, world)
                    scores.append(torch.sigmoid(self._logits(b)).cpu().numpy())
                    labels.append(np.asarray(b.labels))
        if labels:
            self.last_eval = _report_eval(
                self.log, done, np.concatenate(labels), np.concatenate(scores)
            )


def spec_columns(plan: Plan, flag: str | None) -> dict[str, str] | None:
    """The data's column of each feature: the spec's `column`s (plan.json's), with the
    --column-map flag's entries over them; None when neither names any."""
    from embark_runtime import readers

    columns = {f.name: f.column for f in plan.features if f.column is not None}
    if flag:
        columns.update(readers.parse_column_map(flag))
    return columns or None


def dense_extra(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: MixedPrecision
) -> dict[str, torch.Tensor]:
    """What a checkpoint's extra holds of the dense part: the model, its optimizer's
    state and, for fp16, the loss scaler's state (the scale and its growth tracker)."""
    extra = {DENSE_PREFIX + k: v.detach().cpu() for k, v in model.state_dict().items()}
    for k, v in optimizer_state_tensors(optimizer).items():
        extra[DENSE_OPT_PREFIX + k] = v
    for k, v in precision.scaler_state().items():
        extra[SCALER_PREFIX + k] = v
    return extra


@dataclass(frozen=True)
class DenseFound:
    """What a checkpoint's extra gave the dense part (`load_dense_extra`)."""

    model: bool
    scaler: bool


def load_dense_extra(
    extra: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: MixedPrecision,
    optimizer_kind: str,
) -> DenseFound:
    """Load a `dense_extra` into the model, its optimizer and the loss scaler; what the
    extra lacks starts fresh (DenseStateError: it is another model's or optimizer's)."""

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {
            k[len(prefix) :]: torch.as_tensor(v) for k, v in extra.items() if k.startswith(prefix)
        }

    dense_state = part(DENSE_PREFIX)
    if not dense_state:
        return DenseFound(model=False, scaler=False)
    opt_state = part(DENSE_OPT_PREFIX)
    check_dense_state(model, dense_state, optimizer_kind, opt_state)
    model.load_state_dict(dense_state)
    load_optimizer_state_tensors(optimizer, opt_state)
    return DenseFound(model=True, scaler=precision.load_scaler_state(part(SCALER_PREFIX)))


def _summarize(log: _Log, run: Any, wall: float, loss: float | None, first_step: int) -> None:
    """Print the end-of-run summary (rank 0) and write it as the last --log-json record."""
    from embark_runtime.summary import run_summary, summary_lines

    record = run_summary(
        run.step_seconds, wall, run.plan.batch_size, loss, run.last_eval, run.plan,
        first_step,
    )  # fmt: skip
    log.write(record)
    for line in summary_lines(record):  # the run's result: also under --quiet
        log.say(line)


def _report_eval(log: _Log, done: int, labels: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Say and log the evaluation's AUC and log loss; returns them (for TensorBoard)."""
    if labels.size == 0:
        return {}
    auc = roc_auc(labels, scores)
    ll = log_loss(labels, scores)
    log.say(f"eval after step {done}: AUC {auc:.4f}  log loss {ll:.5f}  ({labels.size} samples)")
    auc_or_none = None if math.isnan(auc) else auc
    log.write(
        {"eval": True, "step": done, "auc": auc_or_none, "logloss": ll, "samples": labels.size}
    )
    return {"logloss": ll} if auc_or_none is None else {"auc": auc, "logloss": ll}


# --------------------------------------------------------------------------- sharded


def _inject_fault(step: int, rank: int, checkpoint_dir: Path | None) -> None:
    at = os.environ.get("EMBARK_FAULT_AT_STEP")
    if at is None or int(at) != step or rank != int(os.environ.get("EMBARK_FAULT_RANK", "1")):
        return
    default = (checkpoint_dir or Path.cwd()) / ".fault-injected"
    marker = Path(os.environ.get("EMBARK_FAULT_MARKER", str(default)))
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    print(f"rank {rank}: EMBARK_FAULT_AT_STEP={step}: killing myself", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _device(args: argparse.Namespace) -> torch.device:
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TrainerError("--device cuda, but CUDA is not available")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _exact(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether to train in exact numerics: `--numerics exact`, or auto off CUDA in fp32."""
    auto = args.numerics == "auto" and device.type != "cuda" and args.precision == "fp32"
    return args.numerics == "exact" or auto


def _precision(args: argparse.Namespace, plan: Plan) -> str:
    """The dense model's precision: --precision, else the plan's; exact numerics (fp64)
    and a lower precision exclude each other."""
    precision = args.precision or dense_precision(plan)
    if precision != "fp32" and args.numerics == "exact":
        origin = "--precision" if args.precision else "the spec's `precision`"
        raise TrainerError(
            f"--numerics exact computes the dense model in fp64, {origin} says {precision}: "
            "use --numerics fp32 (or auto) with it, or --precision fp32 for an exact run"
        )
    if precision == "fp16" and not (torch.cuda.is_available() and args.device != "cpu"):
        raise TrainerError("fp16 trains on CUDA only; on the CPU use --precision bf16 or fp32")
    return str(precision)


def _scheduled_rates(program: TrainProgram, plan: Plan, step: int) -> dict[str, Any] | None:
    """The log record's `lr` of `step` (when any rate is scheduled): the dense optimizer's
    rate and each scheduled table's, {"dense": r, "tables": {name: r}}."""
    tables = {
        t.name: t.optimizer_params.schedule.rate(t.optimizer_params.lr, step)
        for t in plan.tables
        if t.optimizer_params.schedule is not None
    }
    schedule = dense_schedule(plan)
    if schedule is None and not tables:
        return None
    return {"dense": schedule_rate(program.optimizer.lr, schedule, step), "tables": tables}


def _rates_record(program: TrainProgram, plan: Plan, step: int) -> dict[str, Any]:
    rates = _scheduled_rates(program, plan, step)
    return {} if rates is None else {"lr": rates}


def _rates_line(program: TrainProgram, plan: Plan, args: argparse.Namespace) -> str:
    """The start line's words on the precision and the schedules ("" when none is set)."""
    words = [f"dense {args.precision}"] if args.precision != "fp32" else []
    schedule = dense_schedule(plan)
    if schedule is not None:
        words.append(f"dense rate {schedule.describe()}")
    scheduled = [t.name for t in plan.tables if t.optimizer_params.schedule is not None]
    if scheduled:
        words.append(f"{len(scheduled)} scheduled embedding rate(s)")
    return "; " + ", ".join(words) if words else ""


def _kernels(program: TrainProgram, device: torch.device, exact: bool) -> tuple[Any, str]:
    """The kernel implementation for `device` and a phrase saying which it is."""
    if exact:
        from embark_runtime.kernels import TorchKernels

        return TorchKernels(torch.float64), "torch kernels in exact mode (fp64 sums)"
    if device.type != "cuda":
        from embark_runtime.kernels import TorchKernels

        return TorchKernels(), "torch kernels (no CUDA)"
    # kernels_for never raises: without cupy/NVRTC it falls back to the torch path and
    # says why, so a CUDA machine without cupy still trains.
    from embark_runtime.cuda_kernels import kernels_for

    return kernels_for(program.kernels_dir, device)


def _run_sharded(program: TrainProgram, plan: Plan, args: argparse.Namespace) -> int:
    topo = plan.topology
    world_env = os.environ.get("WORLD_SIZE")
    if world_env is None:
        if plan.world_size != 1:
            raise TrainerError(
                f"the plan has {plan.world_size} ranks: launch with ./launch.sh or "
                f"`torchrun --nproc-per-node {topo.gpus_per_node} --nnodes {topo.nodes} "
                "train.py`; or use --reference for one unsharded process"
            )
        # one process needs no rendezvous: `_Sharded` joins a group of its own through
        # an in-memory store, so no port is picked and raced for with other jobs
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        alone = True
    else:
        alone = False
        if int(world_env) != plan.world_size:
            raise TrainerError(
                f"launched with {world_env} processes, but the plan has {plan.world_size} "
                f"ranks ({topo.nodes} node(s) x {topo.gpus_per_node}); launch with "
                "./launch.sh, or recompile the spec for the machines you have"
            )
    if not alone:
        global _JOINED_A_GROUP
        _JOINED_A_GROUP = True
    trainer = _Sharded(program, plan, args, alone=alone)
    try:
        result = trainer.run()
    except _Stopped:
        # the group stays up: `main` prints this rank's message, then meets the others in it
        trainer.log.close()
        raise
    except BaseException:
        trainer.close()
        raise
    trainer.close()
    return result


def _join_alone(device: torch.device) -> None:
    """Make a group of one process, this one, through an in-memory store: no port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=600),
    )


def _join_restarted_job(device: torch.device) -> None:
    """Join a torchrun job through a store namespace of this restart attempt.

    torchrun's workers share the agent's TCPStore across restarts without a per-attempt
    prefix, so after a restart gloo can read a dead worker's address left over from the
    previous attempt ("Connection refused" in connectFullMesh). Prefixing the store with
    TORCHELASTIC_RESTART_COUNT isolates the attempts; init_distributed then finds the
    default group already initialised and only builds the plan's subgroups on it.
    """
    import torch.distributed as dist

    env = os.environ
    if dist.is_initialized() or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = timedelta(seconds=600)
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"embark/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


class _Sharded:
    def __init__(
        self, program: TrainProgram, plan: Plan, args: argparse.Namespace, alone: bool = False
    ):
        import torch.distributed as dist

        from embark_runtime.comm import init_distributed

        self.program, self.plan, self.args = program, plan, args
        self.dist = dist
        self.device = _device(args)
        if alone:
            _join_alone(self.device)
        else:
            _join_restarted_job(self.device)
        self.comm = init_distributed(plan, device=str(self.device))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        exact = _exact(args, self.device)
        kernels, self.kernel_note = _kernels(program, self.device, exact)
        from embark_runtime import phases

        self.clock = phases.PhaseClock(self.device, args.measure_phases, args.phase_barriers)
        kernels = phases.timed_kernels(kernels, self.clock)
        phases.instrument_comm(self.comm, self.clock)

        from embark_runtime.embedding import ShardedEmbeddings

        self.embeddings = ShardedEmbeddings(
            plan,
            self.rank,
            self.world,
            seed=args.seed,
            kernels=kernels,
            device=self.device,
            overlap=not args.no_overlap,
            comm=self.comm,
        )
        phases.instrument_clusters(self.embeddings, self.clock)
        self.profiler = (
            phases.StepProfiler(args.profile_dir, args.profile_range, self.rank, self.device)
            if args.profile_steps
            else None
        )
        self.scalars = (
            phases.Scalars(args.tensorboard)
            if args.tensorboard is not None and self.rank == 0
            else None
        )
        self.dtype = torch.float64 if exact else torch.float32
        self.model = DLRMDense(program.dense, seed=args.seed).to(self.device, self.dtype)
        self.optimizer = make_optimizer(self.model.parameters(), program.optimizer)
        self.precision = MixedPrecision(args.precision, self.device)
        self.schedule = dense_schedule(plan)
        self.data = self._together("read the dataset", lambda: _Data(program, plan, args))
        self.log = _Log(self.rank == 0, args.steps, args.log_every, args.log_json, args.quiet)
        self.eval_batches = self.data.eval_count(args.eval_batches, self.log)
        self.clusters = [c.name for c in plan.clusters] + ["dense"]
        self.cached = host_tier_clusters(plan)
        self.cache_record: dict[str, dict] = {}
        """The last step's host-tier cache counters per cluster, all ranks (the log's `cache`)."""
        self._passed_over: set[Path] = set()
        """Damaged checkpoints the resume passed over (and warned of)."""
        self.step_seconds: list[float] = []
        self.last_eval: dict[str, float] | None = None
        self._pending: Exception | None = None
        """This rank's error during a step (reading the next batch), which every rank
        learns of in the step's all-reduce (`_step`) before they stop together."""

    def _together(self, what: str, step: Callable[[], _T]) -> _T:
        """Take a `step` on every rank and agree on how it went: when it fails on any rank
        (a dataset too small, a damaged checkpoint on one rank's disk, a full disk under a
        checkpoint), every rank raises `_Stopped`, the failing ones with their own error
        and the others naming them, instead of the healthy ranks hanging in their next
        collective or dying with a traceback when the failing one exits."""
        error: Exception | None = None
        try:
            out = step()
        except _user_errors() as e:
            error = e
        failed = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        failed[self.rank] = int(error is not None)
        self.dist.all_reduce(failed)
        if bool(failed.any()):
            shared = self._same_everywhere(None if error is None else str(error))
            if error is not None:
                raise _Stopped(str(error), shared=shared) from None
        flags = failed.cpu().tolist()
        if any(flags):
            ranks = [r for r, f in enumerate(flags) if f]
            names = ", ".join(str(r) for r in ranks)
            raise _Stopped(
                f"stopped: could not {what} on rank{'s' if len(ranks) > 1 else ''} {names} "
                "(see the message of each)"
            )
        return out

    def _same_everywhere(self, message: str | None) -> bool:
        """Whether every rank holds this same error `message` (None: this rank has none),
        compared by a 60-bit digest: then rank 0 alone says it."""
        import hashlib

        code = -1 if message is None else int(hashlib.sha256(message.encode()).hexdigest()[:15], 16)
        codes = torch.tensor([code, -code], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(codes, op=self.dist.ReduceOp.MAX)
        high, low = int(codes[0]), -int(codes[1])
        return self.world > 1 and code >= 0 and high == low

    def close(self) -> None:
        self.log.close()
        if self.scalars is not None:
            self.scalars.close()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # ------------------------------------------------------------------ one step

    def _forward(self, batch: Any) -> torch.Tensor:
        dense, _ = _tensors(batch, self.device, self.dtype)
        out = self.embeddings(batch.sparse)
        with self.precision.autocast():  # evaluated in the precision it trains in
            logits = self.model(dense, [out[f.name] for f in self.plan.features])
        return self.precision.output(logits)

    def _step(
        self, batch: Any, prefetch: Any | None, failed: bool = False
    ) -> tuple[float, dict[str, dict[str, int]], int]:
        """Train one step; returns (global mean loss, bytes moved per cluster, all ranks,
        and the number of ranks that say they `failed`: an error of theirs stops the run
        after this step)."""
        dense_in, labels = _tensors(batch, self.device, self.dtype)
        # the bottom MLP runs before the lookup: its autograd nodes are older, so in the
        # backward the embeddings' node runs first and its dp gradient exchange (left in
        # flight) overlaps the bottom MLP's backward and the dense all-reduce
        phase = self.clock.phase
        with phase("dense_forward", collective=True), self.precision.autocast():
            bottom = self.model.bottom_forward(dense_in)
        out = self.embeddings(batch.sparse)
        if prefetch is not None:
            # the next batch's keys travel while this step's dense part computes
            self.embeddings.prefetch(prefetch.sparse)
        embedded = self.precision.embedded([out[f.name] for f in self.plan.features])
        with phase("dense_forward", collective=True):
            with self.precision.autocast():
                logits = self.model(dense_in, embedded, bottom=bottom)
            loss = local_loss(self.precision.output(logits), labels, self.plan.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        with phase("dense_backward", collective=True):
            self.precision.backward(loss)
        dense_traffic = Traffic()
        # the dp tables' gradient exchange is still in flight (overlap on): it runs
        # while the dense gradients are all-reduced, and completes just after
        allreduce_gradients(
            self.model.parameters(),
            lambda flat: self.comm.hierarchical_all_reduce(
                flat, traffic=dense_traffic, cluster="dense"
            ),
        )
        self.embeddings.finish_backward()
        with phase("dense_update"):
            self.precision.step(self.optimizer)

        moved = {c: dict(v) for c, v in self.embeddings.bytes_moved().items()}
        moved.update(dense_traffic.as_dict())
        # one collective for the loss and every counter, summed over ranks
        flat = [float(loss.detach()), float(failed)]
        for c in self.clusters:
            v = moved.get(c, {"intra": 0, "inter": 0})
            flat += [float(v["intra"]), float(v["inter"])]
        flat += stats_flat(self.embeddings.cache_stats(), self.cached)
        totals = torch.tensor(flat, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(totals)
        t = totals.cpu().tolist()
        # the wait-free backward's rows outside a table are said here, where the host has
        # waited for the step anyway (the kernels that defer them have check_rows)
        check_rows = getattr(self.embeddings.kernels, "check_rows", None)
        if check_rows is not None:
            check_rows()
        self.cache_record = stats_record(t[2 + 2 * len(self.clusters) :], self.cached)
        per_cluster = {
            c: {"intra": int(t[2 + 2 * i]), "inter": int(t[3 + 2 * i])}
            for i, c in enumerate(self.clusters)
        }
        return t[0], per_cluster, int(t[1])

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        a = self.args
        started = time.perf_counter()
        start, source = self._together("resume", self._resume)
        self.log.say(
            f"{self.program.name}: {self.world} rank{'s' if self.world != 1 else ''}, "
            f"backend {self.dist.get_backend()}, "
            f"{self.kernel_note}, device {self.device.type}; data {self.data.description}"
            f"{_rates_line(self.program, self.plan, a)}; "
            + (f"resumed from {source} at step {start}" if source else "starting at step 0")
        )
        if a.checkpoint_dir is not None and self.rank == 0:
            self._warn_newer_checkpoints(start)
        if a.init_source is not None:
            self._warm_start(source)
        batch = None
        if start < a.steps:
            batch = self._together(
                f"read the batch of step {start + 1}",
                lambda: self.data.batch(start, self.rank, self.world),
            )
        # the next steps' batches are read by a thread while the steps run
        feed = Prefetcher(
            lambda s: self.data.batch(s, self.rank, self.world), start + 1, a.steps, a.prefetch
        )
        try:
            loss_value = self._loop(start, batch, feed)
        finally:
            feed.close()
        if a.export_embeddings is not None:
            path = a.export_embeddings
            if _sharded_export(path):
                self._export_sharded(path, a.steps if start < a.steps else start)
            else:
                self._together(f"export the embeddings to {path}", lambda: self._export(path))
        if self.rank == 0:
            _summarize(self.log, self, time.perf_counter() - started, loss_value, start)
        # the last step's log line and what came after it: every rank ends the same way
        self._together("finish", self._raise_pending)
        return 0

    def _loop(self, start: int, batch: Any, feed: Any) -> float | None:
        """Steps [start, --steps): `batch` is step start's, `feed` reads the others;
        returns the last step's global loss (None when no step ran)."""
        a = self.args
        loss_value: float | None = None
        for step in range(start, a.steps):
            _inject_fault(step, self.rank, a.checkpoint_dir)
            done = step + 1
            eval_due = (a.eval_every and done % a.eval_every == 0) or done == a.steps
            if self.profiler is not None:
                self.profiler.before(done)
            t0 = time.perf_counter()
            self.clock.start_step()
            nxt, waited = None, 0.0
            if done < a.steps:
                try:
                    with self.clock.phase("data_wait"):
                        nxt, waited = feed.get(done)
                except _user_errors() as e:
                    self._pending = self._pending or e
            # no prefetch before an evaluation: its forward passes come first. A rank
            # without the next batch prefetches this one in its place, so that every rank
            # takes part in the same collectives; the run stops after this step.
            prefetch = None
            if done < a.steps and not a.no_overlap and not eval_due:
                prefetch = nxt if nxt is not None else batch
            failed = self._pending is not None or self.log.error is not None
            schedule_clusters(self.embeddings.clusters, step)
            set_rate(self.optimizer, self.program.optimizer.lr, self.schedule, step)
            loss, moved, failing = self._step(batch, prefetch, failed)
            spent = self.clock.end_step()
            dt = time.perf_counter() - t0
            self.step_seconds.append(dt)
            loss_value = loss
            if self.profiler is not None:
                self.profiler.after(done, last=done == a.steps)
            record = {
                "step": done,
                "loss": loss,
                "samples_per_s": self.plan.batch_size / dt,
                "step_s": dt,
                "data_wait_s": waited,
                "bytes": moved,
                "bytes_total": sum(v["intra"] + v["inter"] for v in moved.values()),
                **_rates_record(self.program, self.plan, step),
            }
            if self.cache_record:
                record["cache"] = self.cache_record
            if a.measure_phases:
                from embark_runtime.phases import gather_phases

                record["phases"] = gather_phases(spent, dt, self.world, self.device)
            self.log.step(record)
            if self.scalars is not None:
                self.scalars.step(record)
            if failing:
                self._stop(done)
            if a.checkpoint_dir is not None and (
                (a.checkpoint_every and done % a.checkpoint_every == 0) or done == a.steps
            ):
                self._checkpoint(done)
            if eval_due:
                self._evaluate(done)
            batch = nxt
        return loss_value

    def _raise_pending(self) -> None:
        error = self._pending or self.log.error
        if error is not None:
            raise error

    def _stop(self, done: int) -> None:
        """A rank failed during step `done` (each knows it from the step's all-reduce):
        checkpoint the step when there is a --checkpoint-dir, then stop together."""
        if self.args.checkpoint_dir is not None:
            try:
                self._checkpoint(done)
            except _Stopped as e:
                self.log.warn(f"no checkpoint after step {done}: {e}")
        self._together(f"go on after step {done}", self._raise_pending)

    def _warn_newer_checkpoints(self, start: int) -> None:
        """Warn of checkpoints in --checkpoint-dir of later steps than the run starts at
        (another run's): a resume from the folder takes the newest, not this run's."""
        from embark_runtime import checkpoint

        root = self.args.checkpoint_dir
        assert root is not None
        later = sorted(
            s for s, p in checkpoint.step_dirs(root) if s > start and p not in self._passed_over
        )
        if later:
            shown = ", ".join(f"step-{s}" for s in later[:3]) + (", ..." if len(later) > 3 else "")
            self.log.warn(
                f"{root} holds checkpoints of later steps than this run starts at ({shown}): "
                "another run's. This run replaces each as it reaches its step, keeps them "
                "out of --keep-checkpoints, and until then `--resume` from the folder takes "
                "them, not this run's: move them elsewhere to keep both runs apart"
            )

    def _evaluate(self, done: int) -> None:
        labels, scores = [], []
        n = self.eval_batches
        held_out = self._together(
            "read the held-out batches",
            lambda: [self.data.eval_batch(i, self.rank, self.world) for i in range(n)],
        )
        self.model.eval()
        with torch.no_grad():
            for b in held_out:
                scores.append(torch.sigmoid(self._forward(b)))
                labels.append(torch.as_tensor(np.asarray(b.labels), device=self.device))
        self.model.train()
        if not scores:
            return
        mine = torch.stack([torch.cat(labels).float(), torch.cat(scores).float()])
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self.dist.all_gather(gathered, mine)
        if self.rank == 0:
            both = torch.cat(gathered, dim=1).cpu().numpy()
            values = _report_eval(self.log, done, both[0], both[1])
            self.last_eval = values
            if self.scalars is not None and values:
                self.scalars.eval(done, values)

    # ------------------------------------------------------------------ state

    def _extra(self) -> dict[str, torch.Tensor]:
        return dense_extra(self.model, self.optimizer, self.precision)

    def _checkpoint(self, done: int) -> None:
        from embark_runtime import checkpoint

        root = self.args.checkpoint_dir
        assert root is not None

        def save() -> None:
            try:
                checkpoint.save_checkpoint(
                    root,
                    done,
                    self.plan,
                    self.rank,
                    self.world,
                    self.embeddings.cells(),
                    self._extra() if self.rank == 0 else None,
                    finalize=False,
                )
            except OSError as e:
                raise TrainerError(
                    f"--checkpoint-dir {root}: cannot write the checkpoint of step {done}: "
                    f"{e.strerror or e}"
                ) from None

        def publish() -> None:
            if self.rank != 0:
                return
            try:
                checkpoint.finalize_checkpoint(
                    root, done, self.plan, self.world, keep_last=self.args.keep_checkpoints or None
                )
            except OSError as e:
                raise TrainerError(
                    f"--checkpoint-dir {root}: cannot publish the checkpoint of step {done}: "
                    f"{e.strerror or e}"
                ) from None

        try:
            self._together(f"write the checkpoint of step {done}", save)
            self._together(f"publish the checkpoint of step {done}", publish)
        except _Stopped:
            # every rank is done writing: what this step left is of no use (the older
            # checkpoints are untouched), and it may hold the space a full disk lacks
            checkpoint.discard_unfinished(root, done)
            raise
        self.log.say(f"checkpoint after step {done} in {root}")

    def _resume(self) -> tuple[int, Path | None]:
        """Load the checkpoint asked for; returns (first step to train, its path or None)."""
        a = self.args
        if a.resume is None:
            return 0, None
        from embark_runtime import checkpoint

        latest, damaged = None, []
        if a.checkpoint_dir is not None and a.checkpoint_dir.exists():
            latest, damaged = checkpoint.newest_complete(a.checkpoint_dir)
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        # a checkpoint newest_complete chose has had every file hashed: not again
        verified = True
        if a.resume == "" or (restarted and latest is not None):
            # after a restart, what this run checkpointed itself beats the starting point
            self._pass_over(damaged)
            if latest is None:
                return 0, None
            path = Path(latest)
        else:
            path = Path(a.resume)
            if not path.exists():
                raise TrainerError(f"--resume {path}: no such checkpoint")
            # a folder of checkpoints: its newest complete one, naming those passed over
            newest, passed = checkpoint.newest_complete(path)
            if newest is not None:
                self._pass_over(passed)
                path = newest
            verified = newest is not None
        step, cells, extra = checkpoint.load_checkpoint(
            path, self.plan, self.rank, verify=not verified
        )
        self.embeddings.load_cells(cells)
        try:
            found = load_dense_extra(
                extra or {}, self.model, self.optimizer, self.precision, self.program.optimizer.kind
            )
        except DenseStateError as e:
            raise TrainerError(
                f"--resume {path}: {e}. The spec's model or its optimizer changed since "
                "the checkpoint: resume from a checkpoint of this model, or train it from "
                "step 0"
            ) from None
        if not found.model:
            self.log.say(f"{path} has no dense model: the dense part starts fresh")
        elif self.precision.scaler is not None and not found.scaler:
            self.log.say(
                f"{path} has no fp16 loss scale (an fp32 or bf16 run's, or an older one): "
                f"it starts afresh at {self.precision.scaler.get_scale():g}"
            )
        return int(step), path

    def _pass_over(self, damaged: list[tuple[Path, str]]) -> None:
        """Warn of each damaged checkpoint a resume passed over, and remember it (it is no
        other run's checkpoint: `_warn_newer_checkpoints`)."""
        for bad, why in damaged:
            self.log.warn(f"passing over the damaged checkpoint {bad}: {why}")
            self._passed_over.add(bad)

    def _warm_start(self, resumed: Path | None) -> None:
        """--init-embeddings: every rank fills the cells it holds from the source (checked
        against the plan before the start); a resume's checkpoint wins over it."""
        a = self.args
        if resumed is not None:
            self.log.warn(f"--init-embeddings {a.init_embeddings} ignored: resumed from {resumed}")
            return
        from embark_runtime.export import warm_start_sharded

        for w in a.init_warnings:
            self.log.warn(w)
        what = f"initialise the tables from {a.init_embeddings}"
        self._together(what, lambda: warm_start_sharded(self.embeddings, a.init_source))
        self.log.say(f"tables initialised from {a.init_embeddings} ({a.init_source.kind})")

    def _export_sharded(self, path: Path, step: int) -> None:
        """Each rank streams its own cells into the export folder; rank 0 publishes it."""
        from embark_runtime import export

        first = self.rank == 0
        try:
            self._together(f"prepare {path}", lambda: first and export.prepare_export(path))
            self._together(
                f"write the export to {path}",
                lambda: export.save_export_part(
                    path, step, self.plan, self.rank, self.world, self.embeddings
                ),
            )
            self._together(
                f"publish the export in {path}",
                lambda: first and export.finalize_export(path, step, self.plan, self.world),
            )
        except _Stopped:
            if first:
                export.discard_unfinished_export(path)
            raise
        self.log.say(f"exported {len(self.plan.tables)} tables, sharded, to {path}")

    def _export(self, path: Path) -> None:
        export_gathered(path, self.plan, self.embeddings.gather_table, self.rank)
        if self.rank == 0:
            self.log.say(f"exported {len(self.plan.tables)} tables to {path}")


def export_gathered(
    path: Path, plan: Plan, gather: Callable[[str], torch.Tensor], rank: int
) -> None:
    """--export-embeddings FILE of a sharded run: every rank gathers the plan's tables in
    turn (`gather`, a collective), rank 0 writing each to `path` before the next is
    gathered (`write_table_file`), so that no rank holds more than one table at once."""
    tables = (gather(t.name) for t in plan.tables)
    if rank == 0:
        write_table_file(path, {t.name: (t.rows, t.dim) for t in plan.tables}, tables)
    else:
        for _ in tables:
            pass


__all__ = [
    "EVAL_STEP_BASE",
    "TrainProgram",
    "TrainerError",
    "build_parser",
    "export_gathered",
    "export_tables",
    "load_exported",
    "write_table_file",
    "main",
]
