"""The generated trainer when something breaks after it started: a malformed record in one
rank's slice of a batch, a file system that refuses a checkpoint, a checkpoint of another
dense model or optimizer, checkpoints of another run in --checkpoint-dir, a folder of
checkpoints with a damaged newest one, fewer held-out batches than --eval-batches, a busy
default port or the one MASTER_PORT names. Every case ends with `train.py: error: ...` (or a warning) and exit code 2
(or 0), never a Python traceback, and every rank says its part (rank 0 alone an error
every rank shares).

The 4-rank cases run tiny.embark under torchrun; the one-process cases a copy of it on
one GPU (`python train.py`, no torchrun), which starts in a few seconds."""

from __future__ import annotations

import re
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.embark"
BATCH = 256  # tiny.embark's global batch

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBARK_FAULT", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(
    cmd: list[str], limit_bytes: int | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    def limit() -> None:  # python ignores SIGXFSZ: a write past the limit fails with EFBIG
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        cmd, capture_output=True, text=True, env=_env() | (env or {}), timeout=400, preexec_fn=limit
    )


def torchrun(out: Path, *args: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    return _run([*cmd, str(out / "train.py"), "--quiet", *args], limit_bytes)


def one(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(out / "train.py"), "--quiet", *args], env=env)


def compile_text(text: str, work: Path, name: str) -> Path:
    spec = work / f"{name}.embark"
    spec.write_text(text)
    out = work / name
    assert embarkc(["compile", str(spec), "-o", str(out), "-q", "--solver", "greedy"]) == 0
    return out


def no_traceback(r: subprocess.CompletedProcess) -> None:
    # torchrun's own launcher prints a traceback when a child fails: ours must not
    ours = [b for b in r.stderr.split("Traceback")[1:] if "torch/distributed/run.py" not in b]
    assert not ours, r.stderr[-4000:]


def exit_2(r: subprocess.CompletedProcess) -> None:
    assert r.returncode != 0
    if "torch.distributed" not in " ".join(map(str, r.args)):
        assert r.returncode == 2, r.stderr[-3000:]
    else:
        assert re.search(r"exitcode\s*:\s*2", r.stderr), r.stderr[-3000:]


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(v) for v in rng.integers(0, 50, 13)]
        cats = [format(int(v), "08x") for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]))
    return lines


# --------------------------------------------------------------------------- 4 ranks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return compile_text(TINY.read_text(), tmp_path_factory.mktemp("tiny"), "tiny")


def test_a_bad_record_in_one_ranks_slice_stops_every_rank_after_a_checkpoint(tiny, tmp_path):
    """Batch 3 (step 4) holds a label 7 in rank 2's quarter. Rank 2 finds it while
    prefetching during step 3, carries it into that step's all-reduce, and all four ranks
    checkpoint step 3 and stop, rank 2 naming the line and the others rank 2."""
    lines = criteo_lines(BATCH * 12)
    bad_line = 3 * BATCH + 2 * BATCH // 4 + 5  # 0-based: rank 2's slice of batch 3
    fields = lines[bad_line].split("\t")
    lines[bad_line] = "\t".join(["7", *fields[1:]])
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    ckpt = tmp_path / "ckpt"
    r = torchrun(tiny, "--steps", "6", "--data", str(data), "--checkpoint-dir", str(ckpt))
    exit_2(r)
    no_traceback(r)
    own = rf"train.py: error: rank 2 of 4: {re.escape(str(data))}:{bad_line + 1}: byte \d+: "
    assert re.search(own + r"error: label '7' is not 0 or 1", r.stderr), r.stderr[-3000:]
    for rank in (0, 1, 3):
        line = f"train.py: error: rank {rank} of 4: stopped: could not go on after step 3 on rank 2"
        assert line in r.stderr, r.stderr[-3000:]
    # the last whole step is saved, complete, and resumable
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3"]
    from embark_runtime.checkpoint import latest_checkpoint

    assert latest_checkpoint(ckpt) == ckpt / "step-3"


def test_a_checkpoint_the_file_system_refuses_stops_every_rank_and_leaves_nothing(tiny, tmp_path):
    """Files are limited to 64 KiB (as a full disk, the write fails): every rank says it
    cannot write its part of the checkpoint, and its unfinished folder is removed."""
    ckpt = tmp_path / "ckpt"
    r = torchrun(tiny, "--steps", "2", "--checkpoint-dir", str(ckpt), limit_bytes=64 << 10)
    exit_2(r)
    no_traceback(r)
    said = re.findall(
        r"train.py: error: rank (\d) of 4: (--checkpoint-dir \S+ cannot write the checkpoint of "
        r"step 2: File too large|stopped: could not write the checkpoint of step 2 on rank)",
        r.stderr,
    )
    # an error every rank shares (each rank's file too large) is said once, by rank 0
    shared = re.findall(
        r"train.py: error: every rank of 4: --checkpoint-dir \S+ cannot write the checkpoint "
        r"of step 2: File too large",
        r.stderr,
    )
    if not shared:
        assert sorted(int(rank) for rank, _ in said) == [0, 1, 2, 3], r.stderr[-3000:]
        assert any("File too large" in what for _, what in said)
    else:
        assert len(shared) == 1 and not said, r.stderr[-3000:]
    assert list(ckpt.iterdir()) == []


# --------------------------------------------------------------------------- one rank


def _one_gpu(text: str) -> str:
    text = re.sub(r"nodes \d+", "nodes 1", text, count=1)
    text = re.sub(r"gpus_per_node \d+", "gpus_per_node 1", text, count=1)
    return re.sub(r"hbm \d+ MiB", "hbm 64 MiB", text, count=1)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, Path, Path]:
    """tiny on one GPU, and copies with a wider bottom MLP and with adam as the dense
    optimizer (adagrad in tiny)."""
    work = tmp_path_factory.mktemp("single")
    text = _one_gpu(TINY.read_text())
    wider = text.replace("bottom_mlp [32, 16]", "bottom_mlp [64, 16]")
    assert wider != text
    model = text[text.index("\nmodel {") :]
    adam = model.replace("optimizer adagrad", "optimizer adam", 1)
    assert adam != model
    return (
        compile_text(text, work, "base"),
        compile_text(wider, work, "wider"),
        compile_text(text.replace(model, adam), work, "adam"),
    )


def test_a_checkpoint_of_another_dense_model_or_optimizer_is_refused_at_resume(single, tmp_path):
    base, wider, adam = single
    ckpt = tmp_path / "ckpt"
    # a one-process run meets no one, so it binds no port: the default one and the one
    # MASTER_PORT names are taken, and it starts all the same
    with socket.socket() as busy, socket.socket() as named:
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # someone else holds it: the run must still start
        named.bind(("127.0.0.1", 0))
        named.listen()
        port = str(named.getsockname()[1])
        r = one(base, "--steps", "2", "--checkpoint-dir", str(ckpt), env={"MASTER_PORT": port})
    assert r.returncode == 0, r.stderr[-3000:]
    r = one(wider, "--steps", "3", "--resume", str(ckpt / "step-2"))
    exit_2(r)
    no_traceback(r)
    assert re.search(
        r"train.py: error: --resume .*step-2: `bottom.0.weight` is \[32, 13\] in the checkpoint "
        r"and \[64, 13\] in the dense model\. The spec's model or its optimizer changed",
        r.stderr,
    ), r.stderr[-3000:]
    r = one(adam, "--steps", "3", "--resume", str(ckpt / "step-2"))
    exit_2(r)
    no_traceback(r)
    assert "holds adagrad's state for the dense parameters; the dense optimizer is now adam" in (
        r.stderr
    ), r.stderr[-3000:]


def test_damaged_and_foreign_checkpoints_are_named_and_kept_apart(single, tmp_path):
    """--resume of a folder whose newest checkpoint is damaged warns and takes the one
    before; checkpoints of later steps in --checkpoint-dir are another run's: a warning,
    and --keep-checkpoints neither counts nor removes them."""
    base, _, _ = single
    ckpt = tmp_path / "ckpt"
    r = one(base, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    damaged = ckpt / "step-4" / "rank-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    r = one(base, "--steps", "3", "--resume", str(ckpt), "--eval-batches", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"train.py: warning: passing over the damaged checkpoint {ckpt / 'step-4'}" in r.stderr
    # resumed from step 2 into another folder that holds a later run's step-9
    other = tmp_path / "other"
    shutil.copytree(ckpt / "step-2", other / "step-9")
    r = one(
        base,
        *("--steps", "4", "--resume", str(ckpt / "step-2"), "--checkpoint-dir", str(other)),
        *("--checkpoint-every", "1", "--keep-checkpoints", "1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warning = f"train.py: warning: {other} holds checkpoints of later steps than this run starts"
    assert f"{warning} at (step-9): another run's" in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in other.iterdir()) == ["step-4", "step-9"]


def test_eval_reads_each_held_out_batch_once(single, tmp_path):
    """A dataset of 3 global batches holds out 1: --eval-batches 4 would count it four
    times; a warning says so, and the evaluation reports the samples it has."""
    base, _, _ = single
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(criteo_lines(BATCH * 3)) + "\n")
    r = one(base, "--steps", "1", "--data", str(data))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"--eval-batches 4: {data} holds out 1 global batch; each evaluation reads it once" in (
        r.stderr
    )
    r = _run(
        [sys.executable, str(base / "train.py"), "--reference", "--steps", "1", "--data", str(data)]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({BATCH} samples)" in r.stdout and "holds out 1 global batch" in r.stderr
