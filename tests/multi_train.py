"""Run several compiled trainers in one process (or one torchrun job), one after another.

    torchrun --standalone --nproc-per-node N tests/multi_train.py WORK DIR... -- TRAIN_ARGS
    python tests/multi_train.py WORK DIR... -- --reference TRAIN_ARGS

Starting torch costs seconds per process on a small machine, so the end-to-end fuzz
trains many compiled folders (all of one world size) in one launch: each DIR's train.py
is imported and its `main(PROGRAM, argv)` called with TRAIN_ARGS (`{i}` in them replaced
by the DIR's index) plus `--log-json
WORK/<i>.<mode>.jsonl --export-embeddings WORK/<i>.<mode>.npz` (mode `sharded` or
`reference`). Under torchrun every DIR joins the job's store under a prefix of its own
(as `_join_restarted_job` does for a restarted job), so each trainer starts a fresh
process group and closes it as a standalone launch does. The first DIR whose trainer
returns non-zero (or raises) ends the run with its code; rank 0 prints `done i` after
each DIR.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path


def _join(index: int) -> None:
    import torch.distributed as dist

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = timedelta(seconds=300)
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"multi-train/{index}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def run(argv: list[str]) -> int:
    from conftest import load_module

    from embark_runtime.trainer import main

    split = argv.index("--") if "--" in argv else len(argv)
    work, *folders = (Path(a) for a in argv[:split])
    extra = argv[split + 1 :]
    mode = "reference" if "--reference" in extra else "sharded"
    sharded = mode == "sharded" and "WORLD_SIZE" in os.environ
    for i, folder in enumerate(folders):
        if sharded:
            _join(i)
        outputs = ["--log-json", str(work / f"{i}.{mode}.jsonl")]
        outputs += ["--export-embeddings", str(work / f"{i}.{mode}.npz")]
        args = [a.replace("{i}", str(i)) for a in extra]
        program = load_module(folder / "train.py", f"embark_train_{i}").PROGRAM
        code = main(program, [*args, *outputs])
        if code:
            return code
        if os.environ.get("RANK", "0") == "0":
            print(f"done {i}", flush=True)
    return 0


if __name__ == "__main__":
    # as embark_runtime.trainer.launch: past the groups' teardown, the interpreter's
    # finalisation can abort on gloo's worker threads
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
