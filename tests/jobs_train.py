"""Run several trainer invocations, each with its own arguments, in one torchrun job.

    torchrun --standalone --nproc-per-node N tests/jobs_train.py JOBS.json

JOBS.json is a list of {"folder": compiled folder, "args": [train.py arguments]}; the
jobs run one after another (a later job may read what an earlier one wrote), each in a
fresh process group joined under a store prefix of its own (as tests/multi_train.py
does). Every job runs whatever the one before it returned; rank 0 writes the exit codes
to JOBS.json's name + ".codes". Starting torch costs seconds per process on a small
machine, so one launch does all of a test's runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(jobs_file: Path) -> int:
    import torch.distributed as dist
    from conftest import load_module
    from multi_train import _join

    from embark_runtime.trainer import main

    jobs = json.loads(jobs_file.read_text())
    codes = []
    for i, job in enumerate(jobs):
        _join(i)
        folder = Path(job["folder"])
        program = load_module(folder / "train.py", f"embark_job_{i}").PROGRAM
        codes.append(main(program, job["args"]))
        if dist.is_initialized():  # a job refused before training leaves its group open
            dist.destroy_process_group()
        if os.environ.get("RANK", "0") == "0":
            print(f"done {i}: {codes[-1]}", flush=True)
    if os.environ.get("RANK", "0") == "0":
        Path(str(jobs_file) + ".codes").write_text(json.dumps(codes))
    return 0


if __name__ == "__main__":
    # as embark_runtime.trainer.launch: past the groups' teardown, the interpreter's
    # finalisation can abort on gloo's worker threads
    code = run(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
