"""The generated program (train.py, launch.sh, README.md) for hand-built plans: formatted,
lint-clean, plan-specific, and refusing to run with the wrong plan or world size."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from embark_runtime.plan import (
    Access,
    Cluster,
    Estimate,
    InitParams,
    OptimizerParams,
    Plan,
    PlanError,
    PlanFeature,
    PlannerInfo,
    PlanTable,
    PlanTopology,
    RankEstimate,
    Shard,
    Source,
    dumps_plan,
    load_plan,
    parse_plan,
    plan_digest,
)
from embark_runtime.trainer import main as trainer_main
from embarkc.codegen.program import py, render_program
from embarkc.diagnostics import EmbarkError
from embarkc.emit import GeneratedFile, emit
from embarkc.frontend import load_program_text

ROOT = Path(__file__).resolve().parent.parent

SPEC = """
hardware { preset dgx_h100 nodes 2 gpus_per_node 2 }
defaults { dim 8 optimizer adagrad { lr 0.05 } pooling sum access zipf(1.1) }
table big { rows 500 hotness 3 }
table mid { rows 80 hotness 2 optimizer sgd { lr 0.1 } }
table small { rows 20 }
table wide { rows 200 dim 16 hotness mean 2 max 4 pooling mean }
feature one { table small hotness 1 weighted }
feature pair { table small hotness 2 pooling concat }
model {
  batch 64
  dense_features 13
  bottom_mlp [16, 8]
  interaction dot
  top_mlp [16, 1]
  optimizer adam { lr 0.001 }
}
"""

LAYOUT_A = (
    [
        {"name": "dp0", "kind": "dp", "tables": ["small"]},
        {"name": "rb0", "kind": "rb", "communication": "flat", "tables": ["big", "mid"]},
        {"name": "ub0", "kind": "ub", "tables": ["wide"]},
    ],
    [
        ("big", 0, 2, 0, 8, 0),
        ("big", 1, 2, 0, 4, 1),
        ("big", 1, 2, 4, 8, 2),
        ("mid", 0, 1, 0, 8, 3),
        ("wide", 0, 1, 0, 16, 2),
    ],
)
LAYOUT_B = (
    [
        {"name": "dp0", "kind": "dp", "tables": ["small", "mid"]},
        {"name": "rb0", "kind": "rb", "communication": "hierarchical", "tables": ["big", "wide"]},
    ],
    [
        ("big", 0, 4, 0, 8, 0),
        ("big", 1, 4, 0, 8, 1),
        ("big", 2, 4, 0, 8, 2),
        ("big", 3, 4, 0, 8, 3),
        ("wide", 0, 1, 0, 8, 0),
        ("wide", 0, 1, 8, 16, 3),
    ],
)


def hand_plan(program, layout, strategy="hand") -> Plan:
    """A Plan for `program` with the given clusters and cells (no planner involved)."""
    clusters, shards = layout
    t = program.topology
    tables = [
        PlanTable(
            name=x.name,
            rows=x.rows,
            dim=x.dim,
            dtype=x.dtype,
            optimizer=x.optimizer.kind,
            optimizer_params=OptimizerParams(**x.optimizer.model_dump(exclude={"kind", "span"})),
            init=InitParams(**x.init.model_dump(exclude={"span"})),
        )
        for x in program.tables
    ]
    features = [
        PlanFeature(
            name=f.name,
            table=f.table,
            hotness=f.hotness,
            pooling=f.pooling,
            access=Access(kind=f.access.kind, alpha=f.access.alpha, permuted=f.access.permuted),
            max_hotness=f.max_hotness,
            fixed=f.fixed,
            weighted=f.weighted,
        )
        for f in program.features
    ]
    world = t.world_size
    return Plan(
        source=Source(spec=program.sources[0].path, sha256=program.sources[0].sha256),
        topology=PlanTopology(
            nodes=t.nodes,
            gpus_per_node=t.gpus_per_node,
            hbm_bytes=t.hbm_bytes,
            hbm_bandwidth=t.hbm_bandwidth,
            intra_node_bandwidth=t.intra_node_bandwidth,
            inter_node_bandwidth=t.inter_node_bandwidth,
            arch=t.arch,
        ),
        batch_size=program.model.batch_size,
        tables=tables,
        features=features,
        row_partition="mod",
        clusters=[Cluster(**c) for c in clusters],
        shards=[
            Shard(table=a, row_shard=b, row_shards=c, columns=(lo, hi), rank=r)
            for a, b, c, lo, hi, r in shards
        ],
        estimate=Estimate(
            step_time=0.001,
            per_rank=[RankEstimate(rank=r, memory_bytes=0, time=0.001) for r in range(world)],
        ),
        planner=PlannerInfo(strategy=strategy, solver="greedy", status="greedy"),
    )


@pytest.fixture(scope="module")
def program():
    return load_program_text(SPEC, "specs/hand.embark")


def _write(program, plan, out: Path) -> Path:
    files = [GeneratedFile("plan.json", dumps_plan(plan), "embark_runtime.plan.dumps_plan")]
    files += render_program(program, plan, "specs/hand.embark")
    emit(files, out, spec="specs/hand.embark", spec_sha256=program.sources[0].sha256)
    return out


@pytest.fixture(scope="module")
def out_a(program, tmp_path_factory):
    return _write(program, hand_plan(program, LAYOUT_A), tmp_path_factory.mktemp("a"))


def test_generated_python_is_formatted_and_lint_clean(out_a):
    config = ["--config", str(ROOT / "pyproject.toml")]
    train = str(out_a / "train.py")
    fmt = subprocess.run(
        ["ruff", "format", "--check", "--diff", *config, train], capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run(["ruff", "check", *config, train], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    compile(Path(train).read_text(), train, "exec")


def test_train_py_carries_the_plan_digest_and_the_dense_model_not_the_layout(program, out_a):
    text = (out_a / "train.py").read_text()
    assert f'PLAN_SHA256 = "{plan_digest(hand_plan(program, LAYOUT_A))}"' in text
    assert f'PLAN_SHA256 = "{plan_digest(load_plan(out_a / "plan.json"))}"' in text
    # the layout travels once, in plan.json
    for copy in ("TABLES", "CLUSTERS", "SHARDS", "GLOBAL_BATCH", '"rb0"', '"big"'):
        assert copy not in text
    # features big, mid, wide, one, pair (concat: hotness * dim values), in plan order
    assert "feature_widths=(8, 8, 16, 8, 16)," in text
    assert 'kind="adam",' in text and "lr=0.001," in text
    assert _program(out_a).dense.feature_widths == (8, 8, 16, 8, 16)


def test_another_plan_gives_another_digest_and_nothing_else(program, out_a, tmp_path):
    out_b = _write(program, hand_plan(program, LAYOUT_B), tmp_path)
    a, b = (out_a / "train.py").read_text(), (out_b / "train.py").read_text()
    changed = [(x, y) for x, y in zip(a.splitlines(), b.splitlines(), strict=True) if x != y]
    assert [x.split(" = ")[0] for x, _ in changed] == ["PLAN_SHA256"]
    assert (out_a / "launch.sh").read_text() == (out_b / "launch.sh").read_text()


def _program(out: Path):
    """The PROGRAM constant of a generated train.py, imported without running it."""
    spec = importlib.util.spec_from_file_location(f"train_{out.name}", out / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROGRAM


def _train(out: Path, monkeypatch, capsys, *args: str, env: dict[str, str] | None = None):
    """Run a generated trainer in this process; returns (exit code, stderr)."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    code = trainer_main(_program(out), list(args))
    return code, capsys.readouterr().err


def test_generated_script_exits_2_without_a_traceback(out_a):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    r = subprocess.run(
        [sys.executable, str(out_a / "train.py"), "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("train.py: error: the plan has 4 ranks: launch with ./launch.sh")
    assert "Traceback" not in r.stderr


def test_trainer_refuses_a_plan_json_it_was_not_generated_for(
    program, tmp_path, monkeypatch, capsys
):
    other = _write(program, hand_plan(program, LAYOUT_A), tmp_path)
    (other / "plan.json").write_text(dumps_plan(hand_plan(program, LAYOUT_B)))
    code, err = _train(other, monkeypatch, capsys, "--steps", "1")
    assert code == 2 and "Traceback" not in err
    assert f"{other / 'plan.json'} is not the plan train.py was compiled from" in err
    assert f"`embarkc compile SPEC --plan {other / 'plan.json'} -o {other}`" in err


def _edited(out: Path, edit) -> None:
    data = json.loads((out / "plan.json").read_text())
    edit(data)
    (out / "plan.json").write_text(json.dumps(data, indent=1))


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: d["estimate"].update(step_time=0.5), id="a figure"),
        pytest.param(lambda d: d["shards"][0].update(rank=3), id="a cell's rank"),
        pytest.param(lambda d: d.update(batch_size=128), id="the batch"),
        pytest.param(lambda d: d["features"].pop(), id="a feature removed"),
        pytest.param(lambda d: d["tables"][0]["optimizer_params"].update(lr=1.0), id="a rate"),
    ],
)
def test_any_edit_of_plan_json_after_compiling_is_refused(
    program, tmp_path, monkeypatch, capsys, edit
):
    out = _write(program, hand_plan(program, LAYOUT_A), tmp_path)
    _edited(out, edit)
    code, err = _train(out, monkeypatch, capsys, "--reference", "--steps", "1")
    assert code == 2 and "is not the plan train.py was compiled from" in err, err
    assert "Traceback" not in err


def test_a_reformatted_plan_json_is_the_same_plan(out_a, tmp_path, monkeypatch, capsys):
    """The digest is of the plan's canonical text: indenting, key order and the generated
    note do not change it (the trainer goes on to the launch check)."""
    out = tmp_path / "out"
    shutil.copytree(out_a, out)
    _edited(out, lambda d: d.pop("//"))
    code, err = _train(out, monkeypatch, capsys, "--steps", "1")
    assert code == 2 and "the plan has 4 ranks: launch with ./launch.sh" in err, err


def test_a_train_py_whose_dense_model_was_edited_is_refused(out_a, monkeypatch, capsys):
    program = _program(out_a)
    fewer = replace(program.dense, feature_widths=program.dense.feature_widths[:-1])
    capsys.readouterr()
    code = trainer_main(replace(program, dense=fewer), ["--reference", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "DENSE_MODEL reads 4 feature(s) but" in err and "has 5" in err


def test_recompiling_with_the_edited_plan_makes_it_trainable(
    program, tmp_path, monkeypatch, capsys
):
    """The message's advice works: `compile SPEC --plan DIR/plan.json -o DIR` accepts the
    edited plan (held to the checker against the spec) and bakes in its digest."""
    from embarkc.cli import main as embarkc_main

    spec = tmp_path / "hand.embark"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    assert embarkc_main(["compile", str(spec), "-o", str(out), "-q"]) == 0
    hand = hand_plan(program, LAYOUT_A)
    edited = load_plan(out / "plan.json").model_copy(
        update={"clusters": hand.clusters, "shards": hand.shards}
    )
    (out / "plan.json").write_text(dumps_plan(edited))
    code, err = _train(out, monkeypatch, capsys, "--reference", "--steps", "1")
    assert code == 2 and "is not the plan train.py was compiled from" in err
    argv = ["compile", str(spec), "--plan", str(out / "plan.json"), "-o", str(out), "-q"]
    assert embarkc_main(argv) == 0, capsys.readouterr().err
    assert plan_digest(load_plan(out / "plan.json")) != plan_digest(edited)  # costed anew
    code, err = _train(out, monkeypatch, capsys, "--steps", "1")
    assert code == 2 and "the plan has 4 ranks" in err, err


def test_trainer_refuses_a_wrong_world_size(out_a, monkeypatch, capsys):
    code, err = _train(out_a, monkeypatch, capsys, env={"WORLD_SIZE": "3", "RANK": "0"})
    assert code == 2
    assert "launched with 3 processes, but the plan has 4 ranks" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--export-embeddings", "x.bin"], ".safetensors or .npz"),
        (["--checkpoint-every", "5"], "needs --checkpoint-dir"),
        (["--resume"], "needs --checkpoint-dir"),
        (["--steps", "-1"], "--steps must not be negative"),
        (["--seed", str(2**63)], "--seed must lie in [0, 2147483647]"),
        (["--keep-checkpoints", "2"], "--keep-checkpoints needs --checkpoint-dir"),
        (["--keep-checkpoints", "-1"], "--keep-checkpoints must not be negative"),
        (["--data", "/nonexistent/day_0"], "no such file"),
        (["--data", "/dev/zero"], "--data /dev/zero: is a character device, not a data file"),
        (["--reference", "--checkpoint-dir", "c"], "does not write or read checkpoints"),
    ],
)
def test_trainer_option_mistakes_are_reported_cleanly(out_a, monkeypatch, capsys, args, message):
    code, err = _train(out_a, monkeypatch, capsys, *args)
    assert code == 2 and message in err


def test_outputs_that_cannot_be_written_are_refused_before_training(
    out_a, tmp_path, monkeypatch, capsys
):
    """Every output path is tested before the first step (not when the write fails at the
    end of a long run), and nothing is created by the test."""
    (tmp_path / "file").write_text("keep")
    (tmp_path / "dir").mkdir()
    monkeypatch.chdir(tmp_path)
    cases = [
        (
            ["--export-embeddings", "file/t.npz"],
            "--export-embeddings file/t.npz: file is not a folder",
        ),
        (
            ["--export-embeddings", "dir/x/t.npz", "--log-json", "dir"],
            "--log-json dir: is a folder",
        ),
        (["--log-json", "file/deeper/log.jsonl"], "file is not a folder"),
        (["--checkpoint-dir", "file"], "--checkpoint-dir file: exists and is not a folder"),
        (["--export-embeddings", "/proc/t.npz"], "cannot create files in /proc"),
    ]
    for args, message in cases:
        # checked before the launch itself (the sharded run needs torchrun)
        mode = [] if "--checkpoint-dir" in args else ["--reference"]
        code, err = _train(out_a, monkeypatch, capsys, *mode, "--steps", "1", *args)
        assert code == 2 and message in err, (args, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]
    assert list((tmp_path / "dir").iterdir()) == [] and (tmp_path / "file").read_text() == "keep"


def test_an_export_the_file_system_refuses_at_the_end_is_a_clean_error(tmp_path, monkeypatch):
    from embark_runtime import trainer
    from embark_runtime.trainer import TrainerError, export_tables

    (tmp_path / "file").write_text("keep")
    with pytest.raises(TrainerError, match="cannot write"):
        export_tables(tmp_path / "file" / "t.npz", {"t": np.zeros((2, 4), np.float32)})
    old = tmp_path / "t.npz"
    export_tables(old, {"t": np.ones((2, 4), np.float32)})

    def refused(src, dst):  # the rename fails (a full or read-only disk; root included)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.os, "replace", refused)
    with pytest.raises(TrainerError, match="cannot write: No space left on device"):
        export_tables(old, {"t": np.zeros((2, 4), np.float32)})
    monkeypatch.undo()
    assert np.load(old)["t"].sum() == 8  # the older export stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "t.npz"]  # no temp file


def test_an_option_mistake_is_said_once_per_node(out_a, monkeypatch, capsys):
    """Every rank of a node sees the same options and plan.json: local rank 0 says what is
    wrong, the others exit 2 without repeating it."""
    bad = ("--steps", "-1")
    code, err = _train(out_a, monkeypatch, capsys, *bad, env={"LOCAL_RANK": "1", "RANK": "3"})
    assert code == 2 and err == ""
    code, err = _train(out_a, monkeypatch, capsys, *bad, env={"LOCAL_RANK": "0", "RANK": "2"})
    assert code == 2 and "--steps must not be negative" in err


def test_an_unknown_numerics_is_refused_by_the_parser(out_a, monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        _train(out_a, monkeypatch, capsys, "--numerics", "fp16")
    assert info.value.code == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_launch_sh_runs_torchrun_for_the_topology(out_a):
    launch = out_a / "launch.sh"
    assert os.access(launch, os.X_OK)
    assert subprocess.run(["bash", "-n", str(launch)]).returncode == 0
    env = {**os.environ, "PYTHON": "echo"}
    two = subprocess.run([str(launch), "--steps", "3"], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr
    assert "--nnodes 2 --nproc-per-node 2" in two.stdout
    assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500" in two.stdout
    assert two.stdout.rstrip().endswith("train.py --steps 3")
    # the rendezvous id is one bare word (no quotes kept inside "${RDZV_ID:-...}")
    assert "--rdzv-id embark-" in two.stdout and "'" not in two.stdout
    # a multi-node launch says what it waits for, and how to run it all on this machine
    assert "waiting for 2 nodes to join at 127.0.0.1:29500" in two.stderr
    assert "NNODES=1 NPROC_PER_NODE=4 ./launch.sh" in two.stderr
    assert "# One machine:  NNODES=1 NPROC_PER_NODE=4 ./launch.sh" in launch.read_text()
    one = subprocess.run(
        [str(launch)],
        env={**env, "NNODES": "1", "NPROC_PER_NODE": "4"},
        capture_output=True,
        text=True,
    )
    assert "--standalone --nnodes 1" in one.stdout and "--nproc-per-node 4" in one.stdout
    assert "waiting" not in one.stderr
    bad = subprocess.run(
        [str(launch)], env={**env, "NPROC_PER_NODE": "3"}, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "the plan has 4 ranks" in bad.stderr


def test_readme_explains_one_machine_and_a_cluster(out_a):
    text = (out_a / "README.md").read_text()
    assert "## One machine" in text and "## A cluster" in text
    assert "| rb0 | rb (flat) | 2 | 4 | 4 |" in text
    assert "MASTER_ADDR=" in text


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_at_each_front_door(program):
    """A spec's batch is checked when it is lowered (with its line), a plan file's when it
    is loaded: codegen and the trainer see only batches that split."""
    with pytest.raises(EmbarkError, match="batch 66 is not divisible by the 4 GPUs"):
        load_program_text(SPEC.replace("batch 64", "batch 66"), "specs/hand.embark")
    odd = hand_plan(program, LAYOUT_A).model_copy(update={"batch_size": 66})
    with pytest.raises(PlanError, match=r"\(batch\): batch_size 66 does not split evenly"):
        parse_plan(dumps_plan(odd), "plan.json")


def test_python_literals_are_spelled_exactly():
    assert py(("a",)) == '("a",)'
    assert py((1, (2, 3))) == "(1, (2, 3))"
    assert py(1e-08) == "1e-08" and float(py(0.1)) == 0.1
    assert py('q"\\') == '"q\\"\\\\"'
    assert py(None) == "None" and py(True) == "True"
    with pytest.raises(ValueError):
        py(float("nan"))


def test_a_one_node_plan_launches_standalone_and_says_so(program, tmp_path):
    one = program.model_copy(
        update={"topology": program.topology.model_copy(update={"nodes": 1, "gpus_per_node": 4})}
    )
    out = _write(one, hand_plan(one, LAYOUT_A), tmp_path)
    readme = (out / "README.md").read_text()
    assert "    ./launch.sh --steps 1000" in readme and "NNODES=1" not in readme
    assert "This plan uses one node" in readme
    r = subprocess.run(
        [str(out / "launch.sh")],
        env={**os.environ, "PYTHON": "echo"},
        capture_output=True,
        text=True,
    )
    assert "--standalone --nnodes 1 --nproc-per-node 4" in r.stdout


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_an_export_through_a_link_or_into_a_pipe_keeps_what_is_there(tmp_path, suffix):
    import os
    import threading

    from embark_runtime.trainer import export_tables, load_exported

    real, link = tmp_path / f"real{suffix}", tmp_path / f"link{suffix}"
    real.write_text("old")
    link.symlink_to(real)
    export_tables(link, {"t": np.ones((2, 4), np.float32)})
    assert link.is_symlink() and load_exported(real)["t"].sum() == 8
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    export_tables(fifo, {"t": np.ones((2, 4), np.float32)})
    reader.join(timeout=30)
    assert fifo.is_fifo() and got and got[0]
    out = tmp_path / f"copy{suffix}"
    out.write_bytes(got[0])
    assert load_exported(out)["t"].sum() == 8
