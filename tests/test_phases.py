"""Measured phases: the clock's exclusive attribution, and a tiny run with
--measure-phases, --profile-steps and --tensorboard whose three outputs `embarkc
measured` and TensorBoard read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embark_runtime import phases
from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_goes_to_the_innermost_open_phase(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(phases.time, "perf_counter", fake)
    clock = phases.PhaseClock(torch.device("cpu"), measure=True)
    clock.start_step()
    fake.now = 1.0  # 1 s outside any phase
    with clock.phase("dense_backward"):
        fake.now = 3.0
        with clock.phase("lookup"):
            fake.now = 7.0
        fake.now = 8.0
    fake.now = 8.5
    spent = clock.end_step()
    assert spent["other"] == 1.5
    assert spent["dense_backward"] == 3.0
    assert spent["lookup"] == 4.0
    assert sum(spent.values()) == 8.5 and set(spent) == set(phases.PHASES)


def test_without_measuring_nothing_is_timed():
    clock = phases.PhaseClock(torch.device("cpu"), measure=False)
    clock.start_step()
    with clock.phase("lookup"):
        pass
    assert set(clock.end_step().values()) == {0.0}


def test_kernel_calls_fall_in_their_phase(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(phases.time, "perf_counter", fake)
    clock = phases.PhaseClock(torch.device("cpu"), measure=True)

    class Kernels:
        name = "k"

        def gather_rows(self, src, index):
            fake.now += 2.0
            return src

        def sparse_update(self, *a):
            fake.now += 5.0

    k = phases.timed_kernels(Kernels(), clock)
    clock.start_step()
    k.gather_rows(1, 2)
    k.sparse_update()
    spent = clock.end_step()
    assert (spent["lookup"], spent["embedding_update"], k.name) == (2.0, 5.0, "k")


@pytest.mark.parametrize("text", ["3", "4:2", "a:b", "-1:3", "2:2", "0:2"])
def test_bad_profile_steps_are_refused(text):
    with pytest.raises(ValueError, match="expected A:B"):
        phases.parse_steps(text)


@pytest.mark.slow
def test_a_tiny_run_writes_phases_a_trace_and_scalars(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert embarkc(["compile", str(ROOT / "specs" / "tiny.embark"), "-o", str(out), "-q"]) == 0
    log, prof, tb = tmp_path / "log.jsonl", tmp_path / "prof", tmp_path / "tb"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["4", str(out / "train.py"), "--quiet", "--steps", "6", "--log-json", str(log)]
    cmd += ["--measure-phases", "--profile-steps", "2:4", "--profile-dir", str(prof)]
    cmd += ["--tensorboard", str(tb)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]

    steps = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [s for s in steps if "eval" not in s and not s.get("summary")]
    assert [s["step"] for s in steps] == list(range(1, 7))  # steps completed, from 1
    for s in steps:
        ph = s["phases"]
        assert len(ph["per_rank"]) == 4 and len(ph["step_s_per_rank"]) == 4
        for p in phases.PHASES:
            assert ph["slowest"][p] == max(rank[p] for rank in ph["per_rank"])
        # the phases partition each rank's measured step
        for rank, wall in zip(ph["per_rank"], ph["step_s_per_rank"], strict=True):
            assert 0 < sum(rank.values()) <= wall
        # tiny has lookups, key distribution and cross-node exchange on every rank
        assert all(rank["lookup"] > 0 and rank["network"] > 0 for rank in ph["per_rank"])

    traces = sorted(p.name for p in prof.iterdir())
    assert traces == [f"rank{r}.pt.trace.json" for r in range(4)]
    events = json.loads((prof / "rank0.pt.trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"embark/lookup", "embark/dense_backward", "embark/data_wait"} <= names
    assert any(str(n).startswith("embark/distributor/") for n in names)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "train/bytes_moved", "eval/auc"} <= tags
    assert "phase_slowest_s/lookup" in tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 7))

    capsys.readouterr()
    assert embarkc(["measured", str(out), str(log), "--json", str(tmp_path / "m.json")]) == 0
    text = capsys.readouterr().out
    assert "lookup" in text and "critical path" in text
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 4 and m["follows"] in ("step_time", "critical_path", "undetermined")
    assert m["phases"]["lookup"]["measured_critical"] > 0

    (tmp_path / "bad.jsonl").write_text('{"step": 0}\nnot json\n')
    assert embarkc(["measured", str(out), str(tmp_path / "bad.jsonl")]) == 2
    (tmp_path / "plain.jsonl").write_text('{"step": 0, "loss": 1}\n')
    assert embarkc(["measured", str(out), str(tmp_path / "plain.jsonl")]) == 2
    assert "--measure-phases" in capsys.readouterr().err
