"""The trainer's own failures (issue 35): a user error under launch.sh is one message and
exit code 2, no traceback (a one-process `train.py --preflight` before torchrun, the
ranks quiet about an error they all share, torchrun's ChildFailedError traceback left
out by `embark_runtime.launch`); tables beyond this machine's free memory are refused
before any is allocated, naming the sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embark_runtime import host_memory
from embark_runtime.host_memory import HostNeed, host_memory_problem
from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent
TSV_LINE = "1\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join("a" * 26) + "\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "out"
    spec = str(ROOT / "specs/tiny.embark")
    assert embarkc(["compile", spec, "-o", str(out), "-q", "--solver", "greedy"]) == 0
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBARK_", "MASTER_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def _launch(out: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = _env(NNODES="1", NPROC_PER_NODE="4")
    cmd = [str(out / "launch.sh"), "--quiet", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_user_errors_under_launch_sh_are_one_message_and_exit_2(tiny: Path, tmp_path: Path) -> None:
    # caught by the preflight: torchrun never starts
    r = _launch(tiny, "--steps", "2", "--resume", "nowhere", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "train.py: error: --resume nowhere: no such checkpoint\n"
    (tmp_path / "empty").mkdir()
    r = _launch(tiny, "--steps", "2", "--data", "empty", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "train.py: error: --data empty: the directory holds no data files\n"
    # found by the ranks together (the data has fewer samples than one batch): rank 0 says it
    (tmp_path / "one.tsv").write_text(TSV_LINE)
    r = _launch(tiny, "--steps", "2", "--data", "one.tsv", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "train.py: error: every rank of 4: one.tsv: error: fewer samples than one global batch\n"
    )


def test_help_through_launch_sh_is_printed_once(tiny: Path, tmp_path: Path) -> None:
    r = _launch(tiny, "--help", cwd=tmp_path)
    assert r.returncode == 0
    assert r.stdout.count("usage: train.py") == 1 and "--preflight" in r.stdout


def test_preflight_checks_and_writes_nothing(tiny: Path, tmp_path: Path) -> None:
    run = [sys.executable, str(tiny / "train.py"), "--preflight", "--quiet"]
    ok = subprocess.run(
        [
            *run,
            "--log-json",
            "log.jsonl",
            "--checkpoint-dir",
            "ckpt",
            "--export-embeddings",
            "e.npz",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == "" and list(tmp_path.iterdir()) == []


def _huge(tmp_path: Path) -> Path:
    """A spec of one GPU of 1 PiB holding a 116 TiB table (with its state): no CPU run has that memory."""
    spec = tmp_path / "huge.embark"
    spec.write_text(
        "hardware { nodes 1 gpus_per_node 1 hbm 1024 TiB hbm_bandwidth 3 TB/s nvlink 450 GB/s "
        "network 400 Gb/s arch sm_90 }\n"
        "table big { rows 1_000_000_000_000 dim 16 hotness 1 optimizer adagrad }\n"
        "model { batch 64 dense_features 4 bottom_mlp [16] interaction dot top_mlp [8, 1] }\n"
    )
    out = tmp_path / "huge"
    assert embarkc(["compile", str(spec), "-o", str(out), "-q", "--solver", "greedy"]) == 0
    return out


def test_tables_beyond_the_free_memory_are_refused_before_allocating(tmp_path: Path) -> None:
    out = _huge(tmp_path)
    for extra in (["--reference"], [], ["--preflight"]):
        r = subprocess.run(
            [sys.executable, str(out / "train.py"), "--quiet", "--device", "cpu", *extra],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
        assert "of host memory (" in r.stderr and "TiB of tables and optimizer state" in r.stderr
        assert "is free (" in r.stderr and "--device cuda" in r.stderr
        what = "the unsharded reference" if extra == ["--reference"] else "rank 0"
        assert what in r.stderr


def test_the_estimate_counts_weights_state_initialisation_and_export() -> None:
    from embark_runtime.plan import parse_plan

    plan = parse_plan((ROOT / "tests/snapshots/compile/tiny/plan.json").read_text())
    ref = host_memory.host_need(plan, None, export=True)
    held = sum(t.bytes_for(t.rows, t.dim) for t in plan.tables)
    assert ref.held == held
    item = plan.table("item")  # the largest table: 20,000 x 32
    # the export streams table by table: the largest one in fp32, not the model
    assert ref.export == item.rows * item.dim * 4 < sum(t.rows * t.dim * 4 for t in plan.tables)
    machine = host_memory.host_need(plan, [0, 1], export=True)
    assert machine.export == 2 * item.rows * item.dim * 4  # every rank gathers it
    assert ref.init == item.rows * 8 + item.rows * item.dim * 4
    every = host_memory.host_need(plan, [0, 1, 2, 3], export=False)
    assert every.held == sum(plan.memory_by_rank())
    assert every.export == 0


def test_free_memory_is_the_least_of_meminfo_and_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 8000 kB\nMemAvailable:    4096 kB\n")
    (tmp_path / "memory.max").write_text("3000000\n")
    (tmp_path / "memory.current").write_text("1000000\n")
    monkeypatch.setattr(host_memory, "_PROC_MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(host_memory, "_CGROUP_V2", tmp_path)
    monkeypatch.setattr(host_memory, "_CGROUP_V1", tmp_path / "none")
    monkeypatch.setattr(host_memory, "_PROC_CGROUP", tmp_path / "cgroup")
    (tmp_path / "cgroup").write_text("0::/\n")
    assert host_memory.available_host_memory() == (
        2_000_000,
        "the room under this job's cgroup memory limit",
    )
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory.available_host_memory() == (4096 * 1024, "MemAvailable in /proc/meminfo")
    need = HostNeed(held=4 << 20, init=1 << 20, export=0)
    message = host_memory_problem(need, (2 << 20, "MemAvailable"), "the reference")
    assert message is not None and message.startswith(
        "the reference needs about 5.0 MiB of host memory (4.0 MiB of tables and optimizer "
        "state, 1.0 MiB while initialising), but 2.0 MiB is free (MemAvailable): about 36% "
        "of it would fit."
    )
    assert host_memory_problem(need, (8 << 20, "MemAvailable"), "x") is None
    assert host_memory_problem(need, None, "x") is None
    # on a host, the limit is the process's own slice's
    (tmp_path / "job.slice").mkdir()
    (tmp_path / "job.slice/memory.max").write_text("1500000\n")
    (tmp_path / "job.slice/memory.current").write_text("500000\n")
    (tmp_path / "cgroup").write_text("0::/job.slice\n")
    assert host_memory.available_host_memory() == (
        1_000_000,
        "the room under this job's cgroup memory limit",
    )


def test_the_trainer_refuses_a_plan_without_a_field_it_trains_with(
    tiny: Path, tmp_path: Path
) -> None:
    """A deleted `weighted` trained the feature unweighted (issue 35, item 1)."""
    import json
    import shutil

    out = tmp_path / "out"
    shutil.copytree(tiny, out)
    plan = json.loads((out / "plan.json").read_text())
    (index,) = [i for i, f in enumerate(plan["features"]) if f["weighted"]]
    del plan["features"][index]["weighted"]
    (out / "plan.json").write_text(json.dumps(plan))
    r = subprocess.run(
        [sys.executable, str(out / "train.py"), "--preflight"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert f"`features.{index}.weighted` missing" in r.stderr and "Traceback" not in r.stderr
