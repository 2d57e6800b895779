"""bench/gpu/host_tier.py (issue 38: the host tier's hit, staged and zero-copy miss paths
against the host link) runs in its CPU dry mode: every case of the table and the verdict
are there, and what each path moves is the host table's rows (correctness of what is
timed, never the times)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

BENCH = ROOT / "bench" / "gpu" / "host_tier.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host_tier", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_host_tier"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_cpu_dry_run_writes_every_case_and_the_verdict(tmp_path):
    out = tmp_path / "host_tier.md"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = out.read_text()
    assert text in r.stdout
    head = next(line for line in text.splitlines() if line.startswith("| width |"))
    for path in ("hit", "fetch staged", "fetch pinned", "fetch 0-copy", "wb staged"):
        assert f"| {path} |" in head
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    cases = {(int(c[0]), c[1].strip(), int(c[2].replace(",", ""))) for c in rows}
    assert cases == {
        (w, o, b) for w in (32, 64, 128) for o in ("sgd", "adagrad") for b in (64, 512)
    }
    for c in rows:
        assert all(v.strip() != "-" for v in c[4:12]), c  # every path measured
        assert c[-1].strip() == "yes", c  # every path's values checked
        assert c[-3].strip() in ("staged", "pinned", "0-copy")
        assert c[-2].strip() in ("staged", "0-copy")
    assert "Host link, a pinned buffer of 1 MiB" in text
    verdict = [line for line in text.splitlines() if line.startswith("verdict: ")]
    assert len(verdict) == 1
    assert "fetch misses by" in verdict[0] and "write back by" in verdict[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_staged_and_zero_copy_paths_move_the_host_tables_rows(bench, optimizer):
    bench._bootstrap()
    dev = torch.device("cpu")
    t = bench.make_tables(96, 8, bench.OPTIMIZERS[optimizer], dev, seed=3)
    assert len(t.host) == 1 + bench.OPTIMIZERS[optimizer] and t.mapped
    rows, rows_dev = bench.row_sets(t.rows, 20, 3, dev)
    assert all(torch.equal(r, r.unique()) and r.numel() == 20 for r in rows)
    assert not set(rows[0].tolist()) & set(rows[1].tolist())  # successive sets disjoint
    assert bench.check_paths(t, rows[0], rows_dev[0], dev) == []
    want = [h[rows[1]].clone() for h in t.host]
    slots = torch.tensor(list(range(19, -1, -1)))
    got = {}
    for name, fetch in (
        ("staged", lambda dst: bench.fetch_staged(t, rows[1], slots, dst)),
        ("pinned", lambda dst: bench.Staging(t, 20, dev).fetch(t, rows[1], slots, dst)),
        ("0-copy", lambda dst: bench.fetch_zero_copy(t, rows_dev[1], slots, dst)),
    ):
        dst = [torch.zeros(20, 8) for _ in t.host]
        fetch(dst)
        got[name] = [d[slots] for d in dst]
        assert all(torch.equal(g, w) for g, w in zip(got[name], want, strict=True)), name
    src = [torch.zeros(20, 8) for _ in t.host]
    for s, w in zip(src, want, strict=True):
        s[slots] = -w
    bench.write_back_zero_copy(t, slots, rows_dev[1], src)
    assert all(torch.equal(h[rows[1]], -w) for h, w in zip(t.host, want, strict=True))
    for s in src:
        s.mul_(-1)
    bench.write_back_staged(t, slots, rows[1], src)
    assert all(torch.equal(h[rows[1]], w) for h, w in zip(t.host, want, strict=True))


def test_the_cache_steps_all_hit_and_all_miss_as_named(bench):
    bench._bootstrap()
    dev = torch.device("cpu")
    t = bench.make_tables(64, 4, 1, dev, seed=5)
    _, sets_dev = bench.row_sets(t.rows, 16, 2, dev)
    case = bench.Case(4, "adagrad", 16, t.row_bytes)
    bench.cache_steps(t, "adagrad", sets_dev, dev, 3, case)
    assert case.failures == []
    assert case.nbytes == {"cache hit": 16 * 32, "cache miss": 2 * 16 * 32}


def test_without_a_gpu_it_exits_2_or_0_when_allowed():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    run = [sys.executable, str(BENCH)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
    r = subprocess.run([*run, "--allow-no-gpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    r = subprocess.run([*run, "--device", "cpu", "--optimizers", "adam"], capture_output=True)
    assert r.returncode == 2


def test_run_sh_runs_the_host_tier_alone():
    script = ROOT / "bench" / "gpu" / "run.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "host_tier.py" in script.read_text()
    if torch.cuda.is_available():
        return
    r = subprocess.run(
        ["bash", str(script), "--host-tier-only", "--allow-no-gpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "host_tier: no CUDA device" in r.stdout
