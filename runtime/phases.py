"""Where a training step's time goes, named after the cost model's phases.

Every phase of a step runs inside a range named `embark/<phase>` (a
`torch.profiler.record_function`, and an NVTX range on CUDA), so a `--profile-steps`
trace or an Nsight Systems timeline shows the same names as the plan's estimate:

  data_wait        reading the next batch (the host's data path)
  distributor      the keys' all-to-all and bucketing before the lookup (the planner's
                   `distributor`)
  lookup           the embedding kernels: pooled gathers and the fused sparse update's
                   gathers (`lookup`)
  nvlink, network  the embedding all-to-alls inside a node and across nodes (`nvlink`,
                   `network`)
  dp_exchange      the data-parallel tables' gradient all-reduce (`dp_exchange`)
  dense_forward, dense_backward, dense_allreduce, dense_update
                   the dense model (`dense`, `dense_allreduce_time` of the estimate)
  embedding_update the sparse optimizers' update of the embedding rows

With `--measure-phases` a `PhaseClock` attributes each moment of a step to the innermost
phase open at that moment (exclusive time: the lookup inside the backward is counted as
lookup, not as dense backward); what no phase covers is `other`. On the CPU the marks are
`time.perf_counter` readings; on CUDA they are CUDA events, read once at the step's end,
so the measurement adds no host wait inside the step. Phases end when their host call
returns: an asynchronous collective's time falls in the phase that waits for it.

The instrumentation wraps the objects the trainer already holds (its Comm, the
embedding kernels, each cluster's `distribute`), so no cluster code knows of it; without
`--measure-phases` only the named ranges remain (a few microseconds a call).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .comm import Pending

PHASES = (
    "data_wait",
    "distributor",
    "lookup",
    "nvlink",
    "network",
    "dp_exchange",
    "dense_forward",
    "dense_backward",
    "dense_allreduce",
    "dense_update",
    "embedding_update",
    "other",
)
"""Every phase a step's time is attributed to, in the order of the log's vectors."""

_EXCHANGES = ("dp_exchange", "dense_allreduce")
"""Phases whose own all-to-alls belong to them, not to nvlink/network."""


class PhaseClock:
    """Per-step exclusive time of each phase on this rank (see the module docstring).

    `measure` off: `phase()` only opens the named range. `barriers`: a phase opened with
    `collective=True` (one that every rank opens the same number of times) starts with a
    barrier, so that the time a rank waits for the others falls before it, not in it.
    """

    def __init__(self, device: torch.device, measure: bool, barriers: bool = False):
        self.device = device
        self.measure = measure
        self.barriers = barriers and measure
        self.cuda = device.type == "cuda"
        self._stack: list[str] = []
        self._marks: list[tuple[Any, str]] = []
        """(a perf_counter reading or CUDA event, the phase that owns the time after it)."""

    # ------------------------------------------------------------------ marks
    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self) -> None:
        if self.measure:
            self._marks.append((self._now(), self._stack[-1] if self._stack else "other"))

    def start_step(self) -> None:
        self._stack.clear()
        self._marks.clear()
        self._mark()

    def end_step(self) -> dict[str, float]:
        """Seconds of each phase since `start_step` (all of PHASES; zero when absent)."""
        out = dict.fromkeys(PHASES, 0.0)
        if not self.measure or not self._marks:
            return out
        self._mark()
        if self.cuda:
            self._marks[-1][0].synchronize()
        for (a, owner), (b, _) in zip(self._marks, self._marks[1:], strict=False):
            out[owner] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        self._marks.clear()
        return out

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    # ------------------------------------------------------------------ ranges
    @contextlib.contextmanager
    def phase(self, name: str, collective: bool = False, label: str = "") -> Iterator[None]:
        """Attribute the time inside to `name` (a range `embark/<name>[/label]`)."""
        if self.barriers and collective:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
        title = f"embark/{name}" + (f"/{label}" if label else "")
        nvtx = self.cuda and torch.cuda.is_available()
        if nvtx:
            torch.cuda.nvtx.range_push(title)
        self._mark_push(name)
        try:
            with torch.profiler.record_function(title):
                yield
        finally:
            self._stack.pop()
            self._mark()
            if nvtx:
                torch.cuda.nvtx.range_pop()

    def _mark_push(self, name: str) -> None:
        self._stack.append(name)
        self._mark()

    def wrap(self, fn: Callable[..., Any], name: str, label: str = "") -> Callable[..., Any]:
        """`fn` with each call inside phase `name`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name, label=label):
                return fn(*args, **kwargs)

        return timed


_KERNEL_PHASES = {
    "pooled_forward": "lookup",
    "pooled_backward": "lookup",
    "pooled_backward_padded": "lookup",
    "gather_rows": "lookup",
    "pooled_backward_update": "embedding_update",
    "sparse_update": "embedding_update",
    "sparse_update_padded": "embedding_update",
    "scatter_add_rows": "embedding_update",
    "dedup": "distributor",
    "bucketize": "distributor",
}


class _TimedKernels:
    """The embedding kernels with each call in its phase (see _KERNEL_PHASES)."""

    def __init__(self, kernels: Any, clock: PhaseClock):
        self._kernels = kernels
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kernels, name)
        phase = _KERNEL_PHASES.get(name)
        if phase is None or not callable(attr):
            return attr
        return self._clock.wrap(attr, phase)


def timed_kernels(kernels: Any, clock: PhaseClock) -> Any:
    return _TimedKernels(kernels, clock)


def instrument_comm(comm: Any, clock: PhaseClock) -> None:
    """Put the Comm's counted collectives in their phases: an all-to-all inside a node is
    nvlink, one over the rail or a world that spans nodes is network; a counted
    all-reduce is the dense model's (`cluster="dense"`) or a dp cluster's exchange."""
    spans_nodes = comm.world > comm.gpus_per_node
    all_to_all, hierarchical = comm.all_to_all, comm.hierarchical_all_reduce

    def a2a(*args: Any, scope: str = "world", cluster: str = "", **kwargs: Any) -> Any:
        if clock.current in (*_EXCHANGES, "distributor"):
            return all_to_all(*args, scope=scope, cluster=cluster, **kwargs)
        name = "nvlink" if scope == "node" or (scope == "world" and not spans_nodes) else "network"
        with clock.phase(name, label=cluster):
            out = all_to_all(*args, scope=scope, cluster=cluster, **kwargs)
        return _TimedPending(out, clock, name, cluster) if kwargs.get("async_op") else out

    def reduce(*args: Any, cluster: str = "", **kwargs: Any) -> Any:
        name = "dense_allreduce" if cluster == "dense" else "dp_exchange"
        with clock.phase(name, label=cluster):
            out = hierarchical(*args, cluster=cluster, **kwargs)
        return _TimedPending(out, clock, name, cluster) if kwargs.get("async_op") else out

    comm.all_to_all = a2a
    comm.hierarchical_all_reduce = reduce


class _TimedPending(Pending):
    """An asynchronous collective whose wait is counted in the collective's phase. It is
    a Pending itself, so the Comm's own compositions (the rail all-gather builds on an
    asynchronous all-to-all) take it as they take the one it wraps."""

    def __init__(self, pending: Pending, clock: PhaseClock, name: str, label: str):
        super().__init__([], pending.wait)
        self._clock, self._name, self._label = clock, name, label

    def wait(self) -> Any:
        with self._clock.phase(self._name, label=self._label):
            return super().wait()


def instrument_clusters(embeddings: Any, clock: PhaseClock) -> None:
    """Each cluster's key distribution in the distributor phase."""
    for cluster in embeddings.clusters:
        cluster.distribute = clock.wrap(cluster.distribute, "distributor", cluster.name)


def gather_phases(
    mine: dict[str, float], step_s: float, world: int, device: torch.device
) -> dict[str, Any]:
    """All ranks' phase times (collective): per rank, the slowest rank of each phase,
    the mean, and each rank's own step wall time, for the log."""
    import torch.distributed as dist

    row = torch.tensor([mine[p] for p in PHASES] + [step_s], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world)]
    if dist.is_initialized() and world > 1:
        # gloo gathers on the host; NCCL needs the device
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        out = [r.to(dev) for r in rows]
        dist.all_gather(out, row.to(dev))
        rows = [r.cpu() for r in out]
    else:
        rows = [row]
    table = [r.tolist() for r in rows]
    per_rank = [dict(zip(PHASES, r[:-1], strict=True)) for r in table]
    return {
        "per_rank": per_rank,
        "slowest": {p: max(r[p] for r in per_rank) for p in PHASES},
        "mean": {p: sum(r[p] for r in per_rank) / len(per_rank) for p in PHASES},
        "step_s_per_rank": [r[-1] for r in table],
    }


def parse_steps(text: str) -> tuple[int, int]:
    """`A:B` (steps A..B-1, counted from 1 as the console, the log's `step` and the
    checkpoints' step-N number them: step N is the N-th step trained) of --profile-steps."""
    a, sep, b = text.partition(":")
    try:
        first, end = int(a), int(b)
    except ValueError:
        first = end = -1
    if not sep or first < 1 or end <= first:
        raise ValueError(
            f"--profile-steps {text!r}: expected A:B with 1 <= A < B (steps A to B-1, "
            "counted from 1 as in the console and the log), e.g. 5:8"
        )
    return first, end


class StepProfiler:
    """A torch.profiler trace of steps [first, end) on this rank, written as
    `DIR/rank<r>.pt.trace.json` (Perfetto's ui.perfetto.dev and TensorBoard's profiler
    plugin read it)."""

    def __init__(self, folder: Any, steps: tuple[int, int], rank: int, device: torch.device):
        self.folder, (self.first, self.end), self.rank = folder, steps, rank
        self.device = device
        self._prof: Any = None
        self.written: list[Any] = []

    def before(self, step: int) -> None:
        """`step`: the step about to run, numbered as the log numbers it (from 1)."""
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.__enter__()

    def after(self, step: int, last: bool = False) -> None:
        if self._prof is not None and (step + 1 == self.end or last):
            self._prof.__exit__(None, None, None)
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"rank{self.rank}.pt.trace.json"
            self._prof.export_chrome_trace(str(path))
            self.written.append(path)
            self._prof = None


class Scalars:
    """TensorBoard scalars of rank 0: loss, samples/s, bytes moved, phase times, AUC."""

    def __init__(self, folder: Any):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def step(self, record: dict[str, Any]) -> None:
        n, w = record["step"], self.writer
        w.add_scalar("train/loss", record["loss"], n)
        w.add_scalar("train/samples_per_s", record["samples_per_s"], n)
        w.add_scalar("train/bytes_moved", record["bytes_total"], n)
        w.add_scalar("train/step_s", record["step_s"], n)
        for p, v in record.get("phases", {}).get("slowest", {}).items():
            w.add_scalar(f"phase_slowest_s/{p}", v, n)
        if "lr" in record:  # a scheduled rate: the dense one and each scheduled table's
            w.add_scalar("lr/dense", record["lr"]["dense"], n)
            for table, v in record["lr"]["tables"].items():
                w.add_scalar(f"lr/{table}", v, n)
        for cluster, v in record.get("cache", {}).items():  # host-tier caches
            if v["hit_rate"] is not None:
                w.add_scalar(f"cache_hit_rate/{cluster}", v["hit_rate"], n)

    def eval(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"eval/{k}", v, step)

    def close(self) -> None:
        self.writer.close()
