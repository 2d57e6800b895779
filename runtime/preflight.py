"""What the generated trainer checks before any rank allocates or trains.

`train.py --preflight ARGS` runs these in one process and exits (0, or 2 with one
message): `launch.sh` runs it before torchrun starts the ranks, so a mistake every rank
would make (a missing checkpoint to resume, two outputs at one path, tables that do not
fit this machine) is said once, with exit code 2, instead of once per rank followed by
torchrun's ChildFailedError traceback and exit 1. The ranks run the same checks again
(a job launched with torchrun by hand, or a file changed in between).

Each function returns the problem in words, or None; the trainer raises it as its own
error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from embark_runtime.host_memory import available_host_memory, host_memory_problem, host_need
from embark_runtime.plan import Plan


def machine_ranks(world_size: int, gpus_per_node: int, env: Mapping[str, str]) -> list[int]:
    """The ranks this machine runs. Under torchrun: node GROUP_RANK's LOCAL_WORLD_SIZE
    consecutive ranks. Before it (the preflight, told LOCAL_WORLD_SIZE by launch.sh, else
    the plan's GPUs per node): the heaviest such group is not known yet, so every group is
    a candidate and the caller takes the worst (`node_groups`)."""
    local = int(env.get("LOCAL_WORLD_SIZE") or 0) or min(gpus_per_node, world_size)
    node = int(env.get("GROUP_RANK") or 0)
    first = node * local
    return list(range(first, min(world_size, first + local)))


def node_groups(world_size: int, local: int) -> list[list[int]]:
    """Every group of `local` consecutive ranks one machine may run."""
    return [list(range(lo, min(world_size, lo + local))) for lo in range(0, world_size, local)]


def host_memory_check(
    plan: Plan, *, reference: bool, export: bool, env: Mapping[str, str] | None = None
) -> str | None:
    """The problem when the tables of this run (`reference`: unsharded, in one process)
    do not fit in this machine's free memory (`embark_runtime.host_memory`), or None.
    Called only for runs on the CPU (a CUDA run holds them in GPU memory, which the plan
    already fits). Before torchrun (no RANK in `env`), the heaviest machine's ranks."""
    env = os.environ if env is None else env
    available = available_host_memory()
    if available is None:
        return None
    if reference:
        need = host_need(plan, None, export=export)
        return host_memory_problem(need, available, "the unsharded reference (--reference)")
    world = plan.world_size
    if "RANK" in env:
        groups = [machine_ranks(world, plan.topology.gpus_per_node, env)]
    else:
        local = int(env.get("LOCAL_WORLD_SIZE") or 0) or min(plan.topology.gpus_per_node, world)
        groups = node_groups(world, local)
    needs = [(host_need(plan, g, export=export), g) for g in groups]
    need, ranks = max(needs, key=lambda n: n[0].total)
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} to {ranks[-1]}"
    return host_memory_problem(need, available, f"a CPU run of {span} on this machine")


def resume_problem(resume: str | None, checkpoint_dir: Path | None) -> str | None:
    """What makes `--resume` impossible before any rank starts: the path is missing, or it
    is neither a checkpoint nor a folder holding one (every step-* damaged included), or
    None. `--resume` without a path with no checkpoint yet starts at step 0."""
    if not resume:
        return None
    from embark_runtime import checkpoint

    path = Path(resume)
    if not path.exists():
        return f"--resume {path}: no such checkpoint"
    # manifests only: the ranks hash the files of the one they load
    newest, _ = checkpoint.newest_complete(path, verify=False)
    if newest is not None:
        return None
    try:
        checkpoint.read_manifest(path)
    except checkpoint.CheckpointError as e:
        return f"--resume {path}: {e}"
    return None


def data_problem(data: Path | None) -> str | None:
    """What makes `--data` unreadable before any rank opens it: a folder without data
    files (each rank would find it, after the group formed), or None. Lists names only;
    the records are the ranks' to read."""
    if data is None:
        return None
    from embark_runtime.readers import ReaderError, _expand

    try:
        _expand(data)
    except ReaderError as e:
        why = str(e).removeprefix(f"{data}: ").removeprefix("error: ")
        return f"--data {data}: {why}"
    return None
