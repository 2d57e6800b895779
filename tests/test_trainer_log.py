"""The trainer's progress output: a bar on a terminal, periodic lines otherwise, JSON lines."""

from __future__ import annotations

import io
import json

from embark_runtime.trainer import _Log


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 0.5,
        "samples_per_s": 1000.0,
        "bytes": {"rb0": {"intra": 2**20, "inter": 0}, "dense": {"intra": 0, "inter": 2**20}},
        "bytes_total": 2**21,
    }


def test_a_terminal_gets_one_redrawn_bar(monkeypatch, tmp_path):
    out = _Terminal()
    monkeypatch.setattr("sys.stdout", out)
    log = _Log(True, total=4, every=1, json_path=tmp_path / "log.jsonl", quiet=False)
    for step in range(1, 5):  # steps completed, counted from 1
        log.step(_record(step))
    log.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K[") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "[######..................] step 1/4" in text
    assert (
        "[########################] step 4/4  loss 0.50000  1,000 samples/s  2.00 MiB moved" in text
    )
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_a_pipe_gets_a_line_every_n_steps_with_bytes_per_cluster(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    log = _Log(True, total=5, every=2, json_path=None, quiet=False)
    for step in range(1, 6):
        log.step(_record(step))
    lines = out.getvalue().splitlines()
    assert [x.split()[1] for x in lines] == ["2/5", "4/5", "5/5"]
    assert lines[0].endswith("(rb0 1.00 MiB, dense 1.00 MiB)")


def test_other_ranks_and_quiet_runs_print_no_progress(monkeypatch, tmp_path):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    _Log(False, total=2, every=1, json_path=tmp_path / "x.jsonl", quiet=False).step(_record(1))
    quiet = _Log(True, total=2, every=1, json_path=tmp_path / "q.jsonl", quiet=True)
    quiet.step(_record(1))
    quiet.close()
    assert out.getvalue() == ""
    assert not (tmp_path / "x.jsonl").exists()
    assert json.loads((tmp_path / "q.jsonl").read_text())["step"] == 1
