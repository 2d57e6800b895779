"""A run's outputs are checked against each other, its inputs and its checkpoints before
the first step (issue 35, item 2): a clash is one clear error, exit 2, and nothing is
written. Before, `--export-embeddings` into a checkpoint folder replaced a piece of it
and `--log-json` and `--export-embeddings` on one path lost the log, with exit 0."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from embark_runtime.files import RunPath, checkpoint_holding, run_path_clash
from embarkc.cli import main as embarkc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("tiny")
    out = work / "out"
    assert (
        embarkc(
            ["compile", str(ROOT / "specs/tiny.embark"), "-o", str(out), "-q", "--solver", "greedy"]
        )
        == 0
    )
    return out


def _program(out: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"train_{id(out)}", out / "train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PROGRAM


def _fake_checkpoint(folder: Path) -> dict[str, bytes]:
    """A checkpoint folder as the trainer leaves it (manifest first), its bytes by name."""
    folder.mkdir(parents=True)
    files = {
        "manifest.json": json.dumps({"format": "embark-checkpoint", "step": 5}).encode(),
        "rank-00000.safetensors": b"\x00" * 64,
        "extra.pt": b"\x01" * 16,
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _train(out: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from embark_runtime.trainer import main

    code = main(_program(out), ["--quiet", "--steps", "1", *argv])
    return code, capsys.readouterr().err


def test_clashes_are_refused_before_anything_is_written(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt" / "step-5"
    kept = _fake_checkpoint(ckpt)
    (tmp_path / "log.jsonl").write_text('{"step": 1}\n')
    cases = [
        # (argv, words the message must hold)
        (
            ["--reference", "--export-embeddings", "ckpt/step-5/rank-00000.safetensors"],
            ["--export-embeddings", "inside the checkpoint", "step-5"],
        ),
        (
            ["--reference", "--log-json", "ckpt/step-5/manifest.json"],
            ["--log-json", "inside the checkpoint"],
        ),
        (
            ["--reference", "--log-json", "e.npz", "--export-embeddings", "e.npz"],
            ["--export-embeddings e.npz and --log-json e.npz are the same path"],
        ),
        (
            ["--reference", "--log-json", "new.jsonl", "--export-embeddings", "./new.jsonl/x.npz"],
            ["lies inside --log-json new.jsonl"],
        ),
        (
            ["--checkpoint-dir", "c2", "--log-json", "c2/log.jsonl"],
            ["--log-json c2/log.jsonl lies inside --checkpoint-dir c2"],
        ),
        (["--checkpoint-dir", "c2", "--tensorboard", "c2"], ["are the same path"]),
        (
            ["--checkpoint-dir", "c2", "--profile-steps", "1:2", "--profile-dir", "c2/prof"],
            ["--profile-dir c2/prof lies inside --checkpoint-dir c2"],
        ),
        (
            ["--reference", "--log-json", str(tiny / "plan.json")],
            ["which this run reads", "the plan"],
        ),
        (
            ["--checkpoint-dir", "c3", "--resume", "ckpt/step-5", "--log-json", "ckpt/step-5/l"],
            ["--log-json ckpt/step-5/l lies inside --resume ckpt/step-5"],
        ),
    ]
    for argv, needles in cases:
        code, err = _train(tiny, argv, capsys)
        assert code == 2, (argv, err)
        assert err.startswith("train.py: error: ") and "Traceback" not in err
        for needle in needles:
            assert needle in err, (argv, err)
    for name, data in kept.items():
        assert (ckpt / name).read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "log.jsonl"]
    assert (tmp_path / "log.jsonl").read_text() == '{"step": 1}\n'


def test_paths_that_do_not_clash_are_accepted(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _fake_checkpoint(ckpt / "step-5")
    ok = [
        RunPath("the plan", tmp_path / "out/plan.json", "input"),
        RunPath("--checkpoint-dir", ckpt, "checkpoints"),
        RunPath("--resume", ckpt / "step-5", "resumed"),
        RunPath("--log-json", tmp_path / "runs/log.jsonl", "file"),
        RunPath("--tensorboard", tmp_path / "runs", "folder"),
        RunPath("--profile-dir", tmp_path / "runs", "folder"),
        RunPath("--export-embeddings", Path(os.devnull), "file"),
        RunPath("--log-json", Path(os.devnull), "file"),
    ]
    assert run_path_clash(ok) is None
    # resuming the folder the run checkpoints into continues that run
    again = [RunPath("--checkpoint-dir", ckpt, "checkpoints"), RunPath("--resume", ckpt, "resumed")]
    assert run_path_clash(again) is None


def test_links_and_data_folders_are_seen_through(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data/day_0").write_text("1\t2\n")
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    (tmp_path / "log.jsonl").write_text("")
    os.link(tmp_path / "log.jsonl", tmp_path / "hard.jsonl")
    assert "which this run reads" in (
        run_path_clash(
            [
                RunPath("--data", tmp_path / "data", "input"),
                RunPath("--log-json", tmp_path / "alias/log.jsonl", "file"),
            ]
        )
        or ""
    )
    assert "the same path" in (
        run_path_clash(
            [
                RunPath("--log-json", tmp_path / "log.jsonl", "file"),
                RunPath("--export-embeddings", tmp_path / "hard.jsonl", "file"),
            ]
        )
        or ""
    )


def test_a_checkpoint_is_told_by_its_manifest_or_its_name(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "saved")
    assert checkpoint_holding(tmp_path / "saved/extra.pt") == tmp_path / "saved"
    (tmp_path / "run/step-12").mkdir(parents=True)
    assert checkpoint_holding(tmp_path / "run/step-12/x.npz") == tmp_path / "run/step-12"
    # a compiled folder's manifest is not a checkpoint's
    (tmp_path / "out").mkdir()
    (tmp_path / "out/manifest.json").write_text(json.dumps({"format": "embarkc-manifest"}))
    assert checkpoint_holding(tmp_path / "out/log.jsonl") is None
