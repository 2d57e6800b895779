"""One step numbering everywhere (issue 35): the console's `step 3/3`, the log's
`"step": 3` (its eval record too), TensorBoard's step and the checkpoint `step-3` all
name the third step trained; before, the log said 2 for it. A resumed run goes on at 4."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent


def _one_gpu(tmp_path: Path) -> Path:
    text = (ROOT / "specs/tiny.embark").read_text()
    text = re.sub(r"nodes \d+", "nodes 1", text, count=1)
    text = re.sub(r"gpus_per_node \d+", "gpus_per_node 1", text, count=1)
    text = re.sub(r"hbm \d+ MiB", "hbm 64 MiB", text, count=1)
    spec = tmp_path / "one.embark"
    spec.write_text(text)
    out = tmp_path / "one"
    assert embarkc(["compile", str(spec), "-o", str(out), "-q", "--solver", "greedy"]) == 0
    return out


def _train(out: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBARK_", "MASTER_"))}
    return subprocess.run(
        [sys.executable, str(out / "train.py"), "--log-every", "1", *args],
        cwd=cwd,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_console_log_eval_and_checkpoints_count_the_same_steps(tmp_path: Path) -> None:
    out = _one_gpu(tmp_path)
    first = _train(
        out,
        tmp_path,
        "--steps",
        "3",
        "--log-json",
        "a.jsonl",
        "--checkpoint-dir",
        "ckpt",
        "--checkpoint-every",
        "3",
        "--eval-batches",
        "1",
        "--tensorboard",
        "tb",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    console = re.findall(r"^step (\d+)/3 ", first.stdout, re.M)
    assert console == ["1", "2", "3"]
    assert "eval after step 3:" in first.stdout and "checkpoint after step 3" in first.stdout
    records = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    records = [r for r in records if not r.get("summary")]
    assert [r["step"] for r in records if not r.get("eval")] == [1, 2, 3]
    assert [r["step"] for r in records if r.get("eval")] == [3]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-3"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("eval/auc")] == [3]

    again = _train(
        out,
        tmp_path,
        "--steps",
        "5",
        "--log-json",
        "b.jsonl",
        "--resume",
        "ckpt/step-3",
        "--eval-batches",
        "0",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"^step (\d+)/5 ", again.stdout, re.M) == ["4", "5"]
    records = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("eval") and not r.get("summary")] == [4, 5]
