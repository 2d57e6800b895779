"""Whether a run's tables fit in this machine's memory, judged before any is allocated.

A CPU run (the reference, or the sharded trainer on a machine without CUDA) keeps every
table it holds, with its optimizer state, in host memory. A spec sized for GPUs does not
fit there: allocating it died with an allocator traceback, or the kernel's OOM killer
ended the job without a word. `host_memory_problem` estimates what the run allocates
from the plan and compares it with what the machine can give this job, so the trainer
refuses before the first allocation, naming both sizes.

THE ESTIMATE (bytes; `embark_runtime.optimizers` gives every optimizer's state)
  held        weights (the table's dtype) + optimizer state of every cell, and every dp
              table whole, on each rank this machine runs (`PlanTable.bytes_for`); the
              reference holds every table whole, once
  init        the largest table or cell being initialised: its global row ids (int64)
              and its fp32 values before the cast to the table's dtype
              (`embark_runtime.init.initial_values`), on each rank at once
  export      --export-embeddings FILE (a whole-table file): the largest table in fp32,
              gathered on each rank at once, one table at a time (the file is written
              table by table); the reference exports its own tables in row chunks, and
              the largest table's fp32 copy bounds those too. A sharded export (a folder)
              streams each rank's cells and allocates no table
The dense model, batches and communication buffers are left out: for a spec whose tables
matter they are small beside them, and the margin below covers them.

AVAILABLE
  the least of MemAvailable (/proc/meminfo: what can be allocated without swapping) and
  the room under this job's cgroup limit (v2 memory.max - memory.current, or v1
  memory.limit_in_bytes - memory.usage_in_bytes, of the process's own cgroup or the
  mount's root); unknown (no /proc): no check.

Torch-free: `train.py --preflight` runs it before torchrun starts the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from embark_runtime.formatting import format_bytes
from embark_runtime.plan import Plan

MARGIN = 1.1
"""The estimate times this must fit: what the estimate leaves out (the dense model, the
batches, buffers, the interpreter and torch themselves, some hundreds of MiB)."""

_PROC_MEMINFO = Path("/proc/meminfo")
_PROC_CGROUP = Path("/proc/self/cgroup")
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class HostNeed:
    """Bytes of host memory a run allocates for its tables (module docstring)."""

    held: int
    init: int
    export: int

    @property
    def total(self) -> int:
        return self.held + self.init + self.export


def host_need(plan: Plan, ranks: list[int] | None, *, export: bool) -> HostNeed:
    """What a run of `plan` allocates on this machine: the sharded ranks `ranks` (the
    ones it runs), or the unsharded reference (None)."""
    init_of = lambda rows, width: rows * 8 + rows * width * 4  # noqa: E731
    export_bytes = max((t.rows * t.dim * 4 for t in plan.tables), default=0) if export else 0
    if ranks is None:
        held = sum(t.bytes_for(t.rows, t.dim) for t in plan.tables)
        init = max((init_of(t.rows, t.dim) for t in plan.tables), default=0)
        return HostNeed(held, init, export_bytes)
    memory = plan.memory_by_rank()
    held = sum(memory[r] for r in ranks)
    largest = 0
    for c in plan.clusters:
        if c.kind == "dp":
            for name in c.tables:
                t = plan.table(name)
                largest = max(largest, init_of(t.rows, t.dim))
    mine = set(ranks)
    for s in plan.shards:
        if s.rank in mine:
            rows = plan.row_count(s.table, s.row_shard, s.row_shards)
            largest = max(largest, init_of(rows, s.width))
    # every rank of the machine initialises at once, and gathers each exported table
    return HostNeed(held, largest * len(ranks), export_bytes * len(ranks))


def _meminfo_available(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024  # kB
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _own_cgroups() -> list[str]:
    """This process's cgroup paths (/proc/self/cgroup), for v2 (`0::/path`) and the v1
    memory controller (`N:memory:/path`); [] when unknown."""
    try:
        text = _PROC_CGROUP.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers in ("", "memory") and path.startswith("/"):
            out.append(path.lstrip("/"))
    return out


def _cgroup_room() -> int | None:
    """Room under this process's cgroup memory limit, or None when there is none. The
    process's own cgroup first (a host's systemd slice), then the mount's root (a
    container sees its own cgroup there)."""
    candidates = []
    for sub in [*_own_cgroups(), ""]:
        candidates.append((_CGROUP_V2 / sub / "memory.max", _CGROUP_V2 / sub / "memory.current"))
        candidates.append(
            (_CGROUP_V1 / sub / "memory.limit_in_bytes", _CGROUP_V1 / sub / "memory.usage_in_bytes")
        )
    for limit_file, usage_file in candidates:
        limit = _read_int(limit_file)
        # cgroup v1 writes "no limit" as a number near 2^63
        if limit is not None and limit < (1 << 60):
            return max(0, limit - (_read_int(usage_file) or 0))
    return None


def available_host_memory() -> tuple[int, str] | None:
    """(bytes this job can still allocate, where that comes from), or None if unknown."""
    found: list[tuple[int, str]] = []
    try:
        avail = _meminfo_available(_PROC_MEMINFO.read_text())
    except OSError:
        avail = None
    if avail is not None:
        found.append((avail, "MemAvailable in /proc/meminfo"))
    room = _cgroup_room()
    if room is not None:
        found.append((room, "the room under this job's cgroup memory limit"))
    return min(found) if found else None


def host_memory_problem(need: HostNeed, available: tuple[int, str] | None, what: str) -> str | None:
    """The message refusing a run that needs `need` where `available` is free, or None
    when it fits (or the free memory is unknown). `what`: the run, in words."""
    if available is None or need.total * MARGIN <= available[0]:
        return None
    free, source = available
    parts = [f"{format_bytes(need.held)} of tables and optimizer state"]
    if need.init:
        parts.append(f"{format_bytes(need.init)} while initialising")
    if need.export:
        parts.append(f"{format_bytes(need.export)} for --export-embeddings")
    share = free / (need.total * MARGIN)
    fits = f"about {share:.0%}" if share >= 0.01 else "less than 1%"
    return (
        f"{what} needs about {format_bytes(need.total)} of host memory "
        f"({', '.join(parts)}), but {format_bytes(free)} is free ({source}): "
        f"{fits} of it would fit. Train on CUDA (--device cuda), on a machine with "
        "more memory (or fewer ranks on this one), or with smaller tables"
        + (" or without --export-embeddings" if need.export else "")
    )
